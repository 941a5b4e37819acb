"""The CUDA half of the Hopper compile gate: every ``__global__`` kernel of csrc/cuda/*.cu as
built for sm_90a, with exactly the nvcc flags the extension build uses, no GPU needed.

Each .cu file is compiled ONCE (for sm_80 and sm_90a, as setup.py builds it; ``quick=True``:
sm_90a only) with ``-Xptxas -v``; registers and spills come from ptxas' sm_90a report
(:func:`fastattn.aot.report.parse_ptxas`), the instructions from the sm_90a SASS of the same object
(:func:`fastattn.aot.report.sass_of`). Shared memory is the static amount ptxas reports plus, for
the attention kernels, the dynamic amount their launch asks for, which they carry as their last
template argument (``attn_fwd_kernel<T, Cfg, SMEM>``) so that it can be read off the symbol.

Budgets (:data:`KERNEL_RULES`): 0 bytes of spills for every kernel unless a reason is written
beside a larger one; the attention kernels (forward, dK/dV, dQ) must use ldmatrix, cp.async and
mma.sync, with at most one integer instruction per ldmatrix around their mma (operand addresses
folded into the loads, not recomputed per load); the FFN's activation kernels must not use
tanh.approx (float32 accuracy). ``python .ci/compile_cuda.py`` (``make check-cuda``) prints the
table and fails on a compile error, a spill over budget, a missing instruction or a forbidden
one, or address arithmetic over its bound.
"""

from __future__ import annotations

import concurrent.futures
import dataclasses
import glob
import os
import re
import shutil
import subprocess
import tempfile

from fastattn.aot.report import (Row, mma_address_ops, parse_ptxas, sass_digest, sass_features,
                                  sass_of, undefined_uniform_reads)

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
ARCH = "sm_90a"
GENCODE = {
    "sm_80": ["-gencode", "arch=compute_80,code=sm_80"],
    "sm_90a": ["-gencode", "arch=compute_90a,code=sm_90a"],
}


class CudaToolsMissing(RuntimeError):
    """nvcc (or the csrc/ tree) is not there: the CUDA half cannot run on this machine."""


@dataclasses.dataclass(frozen=True)
class KernelRule:
    pattern: str                      # regex searched in the kernel's base name
    config: str = ""                  # regex searched in its template arguments (after the dtype)
    spill_budget: int = 0             # bytes of spill stores + loads allowed
    required: tuple[str, ...] = ()    # SASS features it must hold
    forbidden: tuple[str, ...] = ()   # SASS features it must not hold
    max_addr_ops: float | None = None  # integer ops per ldmatrix allowed (report.mma_address_ops)
    reason: str = ""                  # why a budget is not 0


#: First match wins; kernels no rule names get budget 0 and no required instruction.
KERNEL_RULES = (
    # operand addresses folded into the ldmatrix (cuda_layout.cuh, fragment_offset): 0.2-0.7
    # integer ops per ldmatrix today, 2.3-3.1 when each load computed its swizzled address
    # The PACKED instances (varlen; last template argument 1) keep the sequence's lengths, band
    # and first rows in registers where the dense ones read the constant bank: ptxas spills a
    # few words (sm_90a, 2026-11-28: 24 B in the D256 forward, two 8-byte reloads a key tile;
    # 44 B and 16 B in the D128 / D64 dQ, all outside the key loop)
    KernelRule(r"^attn_(fwd|bwd_dq)_kernel$", config=r",1$", spill_budget=48,
               required=("ldmatrix", "cp.async", "mma"), max_addr_ops=1.0,
               reason="varlen instances: per-sequence lengths, band and rows held in registers"),
    KernelRule(r"^attn_(fwd|bwd_dkdv|bwd_dq)_kernel$", required=("ldmatrix", "cp.async", "mma"),
               max_addr_ops=1.0),
    KernelRule(r"^attn_bwd_delta_kernel$"),
    # paged decoding streams each chunk's K and V rows into shared memory (paged.cu)
    KernelRule(r"^paged_fwd_kernel$", required=("cp.async",)),
    # float32 FFN gradients must match torch's accuracy: no tanh.approx (ffn.cu, tanh_accurate)
    KernelRule(r"^act_(fwd|bwd)_kernel$", forbidden=("tanh.approx",)),
)


def setup_nvcc_flags() -> list[str]:
    """The nvcc flags setup.py builds with: fastattn.extending.DEFAULT_CUDA_CFLAGS, the one
    place for them (setup.py reads them there too, so the two cannot drift)."""
    from fastattn.extending import DEFAULT_CUDA_CFLAGS
    return list(DEFAULT_CUDA_CFLAGS)


def torch_nvcc_flags() -> list[str]:
    """What torch.utils.cpp_extension's BuildExtension adds to every nvcc call of a CUDAExtension:
    its COMMON_NVCC_FLAGS (the __CUDA_NO_HALF_OPERATORS__ family), the extension defines, the C++
    ABI, -fPIC, and the torch include paths."""
    import torch
    from torch.utils import cpp_extension as ce

    flags = list(ce.COMMON_NVCC_FLAGS)
    flags += ["-DTORCH_API_INCLUDE_EXTENSION_H", "-DTORCH_EXTENSION_NAME=_C",
              f"-D_GLIBCXX_USE_CXX11_ABI={int(torch._C._GLIBCXX_USE_CXX11_ABI)}"]
    abi = getattr(ce, "_get_pybind11_abi_build_flags", None)
    if abi is not None:
        flags += list(abi())
    flags += ["-Xcompiler", "-fPIC"]
    flags += [f"-I{p}" for p in ce.include_paths()]
    return flags


def nvcc_command(source: str, obj: str, archs: tuple[str, ...] = ("sm_80", "sm_90a"),
                 device_only: bool = False) -> list[str]:
    """nvcc with setup.py's flags: an object (``-c``), or with ``device_only`` a fatbinary of
    the device code alone (``-fatbin``). The device-only build still runs nvcc's front end over
    the whole file, host code included (a host type error fails it), and ptxas over every
    kernel; it skips the host compiler's pass over the ATen-heavy host code, ~26 s a file on
    CI's machine (paged.cu: 85 -> 59 s, 2026-11-28). That pass runs in the emulator build
    (csrc/emulate/, the same .cu files through g++), and in every real install on a GPU."""
    nvcc = shutil.which("nvcc")
    if nvcc is None:
        raise CudaToolsMissing("nvcc not found on PATH")
    cmd = [nvcc, *setup_nvcc_flags(), *torch_nvcc_flags(), "-I", os.path.join(ROOT, "csrc", "include")]
    for arch in archs:
        cmd += GENCODE[arch]
    return [*cmd, "-Xptxas", "-v", "-fatbin" if device_only else "-c", source, "-o", obj]


def ptxas_for_arch(log: str, arch: str) -> str:
    """The lines of a multi-architecture ``ptxas -v`` log that belong to `arch`'s functions (each
    function's report follows its "Compiling entry function '...' for 'sm_XX'" line)."""
    keep, out = False, []
    for line in log.splitlines():
        m = re.search(r"Compiling entry function '[^']+' for '(\w+)'", line)
        if m:
            keep = m.group(1) == arch
        if keep:
            out.append(line)
    return "\n".join(out)


def demangle(names: list[str]) -> dict[str, str]:
    tool = shutil.which("c++filt")
    if tool is None or not names:
        return {n: n for n in names}
    out = subprocess.run([tool], input="\n".join(names), capture_output=True, text=True).stdout
    lines = out.splitlines()
    return dict(zip(names, lines)) if len(lines) == len(names) else {n: n for n in names}


def split_name(mangled: str, pretty: str) -> tuple[str, str, int]:
    """(base name, compact template arguments, dynamic smem carried by an attention symbol)."""
    text = re.sub(r"\((anonymous|\{anonymous\}) namespace\)::|fastattn::(cuda::)?|c10::", "", pretty)
    text = re.sub(r"^void ", "", text)
    m = re.match(r"([A-Za-z_]\w*)(?:<(.*)>)?\(", text)
    if not m:
        m2 = re.search(r"\d+([A-Za-z_]\w*?)I", mangled)
        return (m2.group(1) if m2 else mangled), "", 0
    base, args = m.group(1), (m.group(2) or "").replace(" ", "").replace("true", "1").replace("false", "0")
    smem = 0
    if base.startswith("attn_") and base != "attn_bwd_delta_kernel":
        tail = re.search(r",(\d+)$", args)
        if tail:
            smem = int(tail.group(1))
            args = args[: tail.start()]
    return base, args, smem


def rule_for(base: str, config: str = "") -> KernelRule:
    """The first rule naming the kernel ``base`` with template arguments ``config``."""
    for rule in KERNEL_RULES:
        if re.search(rule.pattern, base) and re.search(rule.config, config):
            return rule
    return KernelRule(".*")


def compile_file(source: str, out_dir: str, archs: tuple[str, ...]) -> list[Row]:
    """One nvcc run of `source`; one Row per __global__ function of its sm_90a build."""
    name = os.path.basename(source)
    obj = os.path.join(out_dir, name + ".fatbin")
    proc = subprocess.run(nvcc_command(source, obj, archs, device_only=True), capture_output=True,
                          text=True)
    log = proc.stdout + proc.stderr
    if proc.returncode != 0:
        errors = [ln for ln in log.splitlines() if "error" in ln][:3] or log.splitlines()[-3:]
        return [Row(kernel=name, case="(whole file)", error=" | ".join(errors)[:400])]
    resources = parse_ptxas(ptxas_for_arch(log, ARCH))
    sass = sass_of(obj, arch=ARCH)
    pretty = demangle(sorted(resources))
    rows = []
    for mangled, res in sorted(resources.items()):
        base, args, dyn = split_name(mangled, pretty[mangled])
        dtype, _, rest = args.partition(",")  # the first template argument is the dtype
        rule = rule_for(base, rest)
        rows.append(Row(
            kernel=base, case=f"{name} {dtype}".strip(), config=rest,
            regs=res["regs"], spill_stores=res["spill_stores"], spill_loads=res["spill_loads"],
            smem=res["smem"] + dyn, features=sass_features(sass.get(mangled, "")),
            digest=sass_digest(sass.get(mangled, "")),
            undefined=undefined_uniform_reads(sass.get(mangled, "")),
            addr_ops=mma_address_ops(sass.get(mangled, "")), max_addr_ops=rule.max_addr_ops,
            spill_budget=rule.spill_budget, required=rule.required, forbidden=rule.forbidden,
            error="" if mangled in sass else "no sm_90a SASS found for this function"))
    return rows


def cuda_sources(ops: list[str] | None = None) -> list[str]:
    """csrc/cuda/<op>.cu of every op, or of ``ops`` (an unknown op is a ValueError)."""
    sources = sorted(glob.glob(os.path.join(ROOT, "csrc", "cuda", "*.cu")))
    if not sources:
        raise CudaToolsMissing(f"no CUDA sources under {os.path.join(ROOT, 'csrc', 'cuda')}")
    if ops is None:
        return sources
    by_op = {os.path.splitext(os.path.basename(s))[0]: s for s in sources}
    unknown = sorted(set(ops) - set(by_op))
    if unknown:
        raise ValueError(f"--op: no CUDA source for {unknown}; there are {sorted(by_op)}")
    return [by_op[op] for op in ops]


def _compile_weight(source: str) -> int:
    """Bytes of ``source`` and of the headers beside it that it includes: a proxy of its
    compile time."""
    with open(source) as f:
        text = f.read()
    here = os.path.dirname(source)
    local = [os.path.join(here, h) for h in re.findall(r'#include "([^"/]+)"', text)]
    return len(text) + sum(os.path.getsize(h) for h in local if os.path.isfile(h))


def cuda_rows(quick: bool = False, jobs: int | None = None,
              ops: list[str] | None = None) -> list[Row]:
    """One Row per __global__ kernel of every csrc/cuda/*.cu (of ``ops``' files) for sm_90a. Each file is compiled
    once, for sm_80 and sm_90a as setup.py builds it (``quick``: sm_90a only, about half the
    time); files compile in parallel (``jobs``, default: the CPU count). Raises CudaToolsMissing
    when nvcc or the sources are not there."""
    if shutil.which("nvcc") is None:
        raise CudaToolsMissing("nvcc not found on PATH")
    archs = ("sm_90a",) if quick else ("sm_80", "sm_90a")
    # The longest first, so that they do not end the run alone (2 cores: attention.cu and
    # varlen.cu, which instantiate attention_kernels.cuh, took 130-150 s each, the rest 20-60).
    sources = cuda_sources(ops)
    with tempfile.TemporaryDirectory() as out, \
            concurrent.futures.ThreadPoolExecutor(jobs or os.cpu_count() or 1) as pool:
        futures = {s: pool.submit(compile_file, s, out, archs)
                   for s in sorted(sources, key=_compile_weight, reverse=True)}
        return [row for s in sources for row in futures[s].result()]
