"""What a Hopper compile gate reports, and the readers both halves share.

One :class:`Row` per compiled kernel variant (a Triton launch x autotune config, or a CUDA
``__global__`` instantiation): its resources from ``ptxas -v`` (registers, spill bytes, shared
memory), the instructions its SASS holds that matter for speed on Hopper, and whether it passed:
it compiled, its spills are within the budget stated for it, and its SASS reads no uniform
register that it never wrote (:func:`undefined_uniform_reads`).
"""

from __future__ import annotations

import dataclasses
import hashlib
import os
import re
import shutil
import subprocess
import tempfile

#: SASS opcodes (prefix match) -> the feature name a row reports.
SASS_FEATURES = {
    "HGMMA": "wgmma",       # Hopper warpgroup MMA (sm_90a)
    "HMMA": "mma",          # warp-level tensor-core MMA (mma.sync)
    "LDSM": "ldmatrix",
    "LDGSTS": "cp.async",   # asynchronous global -> shared copy (Ampere)
    "UTMALDG": "tma",       # bulk tensor copy engine (TMA) load
    "UBLKCP": "bulk-copy",  # bulk (non-tensor) async copy
    "USETMAXREG": "setmaxnreg",
    "LDL": "local-load",
    "STL": "local-store",
    "MUFU.TANH": "tanh.approx",  # what --use_fast_math makes of tanhf: relative error ~2^-11
}


@dataclasses.dataclass
class Row:
    kernel: str                  # kernel (function) name
    case: str                    # the launch it stands for: shape, dtype, flags
    config: str = ""             # block sizes, warps, stages ("" where there is none)
    regs: int | None = None
    spill_stores: int = 0        # bytes
    spill_loads: int = 0         # bytes
    smem: int = 0                # bytes of shared memory (static + what the launch asks for)
    features: tuple[str, ...] = ()
    spill_budget: int = 0        # bytes of spill stores + loads allowed
    required: tuple[str, ...] = ()   # features the SASS must hold
    forbidden: tuple[str, ...] = ()  # features it must not hold
    smem_limit: int = 0              # bytes of shared memory a block may have (0: unchecked)
    error: str = ""              # compile error, empty when it compiled
    digest: str = ""             # hash of the SASS instructions: equal digests, same machine code
    undefined: tuple[str, ...] = ()  # uniform registers read before written (a ptxas bug)
    addr_ops: float | None = None    # integer ops per ldmatrix in the MMA stretches (mma_address_ops)
    max_addr_ops: float | None = None  # the most of them allowed (None: unchecked)

    @property
    def spills(self) -> int:
        return self.spill_stores + self.spill_loads

    @property
    def problems(self) -> list[str]:
        if self.error:
            return [f"compile error: {self.error}"]
        found = []
        if self.spills > self.spill_budget:
            found.append(f"spills {self.spill_stores}/{self.spill_loads} B over the budget "
                         f"of {self.spill_budget} B")
        if self.smem_limit and self.smem > self.smem_limit:
            found.append(f"shared memory {self.smem} B over the {self.smem_limit} B a block "
                         f"may have")
        missing = [f for f in self.required if f not in self.features]
        if missing:
            found.append(f"SASS lacks {', '.join(missing)}")
        if self.undefined:
            found.append(f"SASS reads {', '.join(self.undefined)} before writing them")
        held = [f for f in self.forbidden if f in self.features]
        if held:
            found.append(f"SASS holds {', '.join(held)}")
        if self.max_addr_ops is not None and (self.addr_ops or 0.0) > self.max_addr_ops:
            found.append(f"{self.addr_ops:.2f} integer ops per ldmatrix in its MMA code, over "
                         f"{self.max_addr_ops} (addresses recomputed per load)")
        return found

    @property
    def status(self) -> str:
        return "error" if self.error else ("FAIL" if self.problems else "ok")


_PTXAS_FUNC = re.compile(r"Compiling entry function '([^']+)'")
_PTXAS_SPILL = re.compile(r"(\d+) bytes spill stores, (\d+) bytes spill loads")
_PTXAS_REGS = re.compile(r"Used (\d+) registers")
_PTXAS_SMEM = re.compile(r"(\d+) bytes smem")


def parse_ptxas(log: str) -> dict[str, dict[str, int]]:
    """``ptxas -v`` output -> {function: {regs, spill_stores, spill_loads, smem}}; the last
    report of a function wins (nvcc compiles each architecture in turn: filter by arch first)."""
    out: dict[str, dict[str, int]] = {}
    func = None
    for line in log.splitlines():
        m = _PTXAS_FUNC.search(line)
        if m:
            func = m.group(1)
            out[func] = {"regs": 0, "spill_stores": 0, "spill_loads": 0, "smem": 0}
            continue
        if func is None:
            continue
        if m := _PTXAS_SPILL.search(line):
            out[func]["spill_stores"], out[func]["spill_loads"] = int(m[1]), int(m[2])
        if m := _PTXAS_REGS.search(line):
            out[func]["regs"] = int(m[1])
            if m := _PTXAS_SMEM.search(line):
                out[func]["smem"] = int(m[1])
    return out


def cuobjdump() -> str | None:
    """A cuobjdump: beside nvcc, else the one the Triton wheel ships."""
    found = shutil.which("cuobjdump")
    if found:
        return found
    try:
        import triton
    except ImportError:
        return None
    path = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    return path if os.path.exists(path) else None


def sass_of(cubin: bytes | str, arch: str | None = None) -> dict[str, str]:
    """{function: its SASS text} of a cubin (bytes) or of an object/cubin file (path); ``arch``
    (e.g. "sm_90a") keeps only that architecture's code of a multi-architecture object."""
    tool = cuobjdump()
    if tool is None:
        raise RuntimeError("cuobjdump not found (neither beside nvcc nor in the triton wheel)")
    with tempfile.TemporaryDirectory() as tmp:
        path = cubin
        if isinstance(cubin, bytes):
            path = os.path.join(tmp, "k.cubin")
            with open(path, "wb") as f:
                f.write(cubin)
        cmd = [tool, "-sass", *(["-arch", arch] if arch else []), path]
        text = subprocess.run(cmd, capture_output=True, text=True,
                              check=True).stdout
    funcs: dict[str, list[str]] = {}
    current = None
    for line in text.splitlines():
        m = re.match(r"\s*Function : (\S+)", line)
        if m:
            current = m.group(1)
            funcs[current] = []
        elif current is not None:
            funcs[current].append(line)
    return {name: "\n".join(lines) for name, lines in funcs.items()}


def sass_digest(sass: str) -> str:
    """A short hash of the instructions in ``sass`` (addresses and encodings included, comments
    and the function header not): a refactor that changes no machine code keeps it."""
    code = re.findall(r"/\*[0-9a-f]{3,}\*/\s+([^;]*;)", sass)
    return hashlib.sha1("\n".join(" ".join(c.split()) for c in code).encode()).hexdigest()[:12]


#: one SASS instruction: address, predicate, opcode with its modifiers, operands
_SASS_INSTR = re.compile(r"/\*([0-9a-f]{3,})\*/\s+(@!?U?P\w+\s+)?"
                         r"([A-Z][A-Z0-9_]*(?:\.\w+)*)\s*([^;]*);")


def sass_features(sass: str) -> tuple[str, ...]:
    """The :data:`SASS_FEATURES` whose opcodes occur in ``sass``, sorted."""
    opcodes = {op for _, _, op, _ in _SASS_INSTR.findall(sass)}
    return tuple(sorted({name for op in opcodes for prefix, name in SASS_FEATURES.items()
                         if op == prefix or op.startswith(prefix + ".")}))


#: integer opcodes (before the first ".") that compute shared-memory addresses; IMAD.MOV (a copy)
#: does not count
_ADDRESS_OPS = {"LOP3", "LEA", "IADD3", "SHF", "IMAD", "VIADD"}


def mma_address_ops(sass: str, gap: int = 60, lead: int = 20) -> float | None:
    """Integer instructions per ldmatrix in the stretches of a kernel's SASS that hold its
    mma.sync: each run of HMMAs no more than ``gap`` instructions apart, from ``lead``
    instructions before its first. None without HMMA or LDSM there.

    The attention kernels' operand addresses are a lane part, computed once, plus the 16 x 16
    block's constant (cuda_layout.cuh, Swizzled::fragment_offset), which ptxas folds into the
    ldmatrix: 0.2-0.7 integer ops per ldmatrix in every attention kernel (sm_90a, CUDA 13,
    2026-11-28). Computing the swizzled address per load (chunk_offset at the block's corner
    plus the lane's row and chunk) had cost 2.3-3.1 (an OR, an XOR, a shift-add each)."""
    ops = [op for _, _, op, _ in _SASS_INSTR.findall(sass)]
    base = [op.split(".")[0] for op in ops]
    mma = [i for i, b in enumerate(base) if b == "HMMA"]
    if not mma:
        return None
    stretches, start, prev = [], mma[0], mma[0]
    for i in mma[1:]:
        if i - prev > gap:
            stretches.append((start, prev))
            start = i
        prev = i
    stretches.append((start, prev))
    n_int = n_ldsm = 0
    for a, b in stretches:
        for i in range(max(0, a - lead), b + 1):
            if base[i] == "LDSM":
                n_ldsm += 1
            elif base[i] in _ADDRESS_OPS and not ops[i].startswith("IMAD.MOV"):
                n_int += 1
    return n_int / n_ldsm if n_ldsm else None


#: opcodes (before the first ".") whose first operand, even a bare URn, is read: the others write
#: a bare URn in first place (stores and copies name memory there, compares a predicate)
_READS_FIRST = {"HGMMA", "UTMALDG", "UTMASTG", "UTMAPF", "UBLKCP", "ST", "STS", "STG", "STL",
                "RED", "REDG", "SYNCS", "BRA", "BRX", "JMP", "CALL", "RET"}


def undefined_uniform_reads(sass: str) -> tuple[str, ...]:
    """Uniform registers (``URn``) that an instruction reads before any instruction at a lower
    address has written them: values the kernel never computed, whatever the last kernel left.

    ptxas 12.8 (Triton 3.6's) does this for some pipelined attention forwards on sm_90a: the
    shared-memory descriptor of the P@V wgmma is built on such a register, and on an H100 the
    wgmma read out of shared memory's range on some launches (compute-sanitizer: "Out-of-range
    shared or local address" at that HGMMA; 2026-11-27, session 23). ptxas 13.0 builds the same PTX
    without it. Address order stands in for control flow: the code before a kernel's first loop
    is straight, which is where such a read shows; a write placed after a loop that jumps back to
    it would read as a false alarm, which a gate case would show by name. Read as writes: the
    pairs of .64 and .WIDE ops, R2UR's register after its predicate, predicated writes (ptxas
    pairs them with reads under the same predicate) and, after a CALL, every register (the
    subroutine's writes are not followed). A wgmma reads its B descriptor from URn+2:URn+3 of
    ``gdesc[URn]``, and A's from URn:URn+1 unless A is in registers."""
    written: set[int] = set()
    found: list[str] = []
    for _pc, _pred, op, operands in _SASS_INSTR.findall(sass):
        ops = [o.strip() for o in operands.split(",")] if operands.strip() else []
        dest = ops[0] if ops and op.split(".")[0] not in _READS_FIRST else None
        if op.startswith("R2UR") and len(ops) > 2 and re.fullmatch(r"U?P\d+|U?PT", ops[0]):
            ops, dest = ops[1:], ops[1]  # R2UR P0, UR13, R32: a predicate, then the register
        # .64 ops read and write register pairs; .WIDE multiplies write a pair and add one
        wide = 2 if ".64" in op or ".WIDE" in op else 1
        sources = ops if dest is None else ops[1:]
        for i, o in enumerate(sources):
            pair = ".64" in op or (".WIDE" in op and i == len(sources) - 1)
            reads = []
            for n in map(int, re.findall(r"\bUR(\d+)\b", o)):
                if o.startswith("gdesc["):
                    # a wgmma's descriptors: A's in URn:URn+1 (unused when A is in registers,
                    # the operand before), B's in URn+2:URn+3
                    a_in_registers = i > 0 and re.fullmatch(r"R\d+", sources[i - 1])
                    reads += range(n + 2 if a_in_registers else n, n + 4)
                else:
                    reads += range(n, n + (2 if pair and re.fullmatch(r"UR\d+", o) else 1))
            for r in reads:
                if r not in written and f"UR{r}" not in found:
                    found.append(f"UR{r}")
        if op.startswith("CALL"):  # a subroutine (64-bit division) returns in registers it
            written.update(range(64))  # writes further down; what it writes is not followed
        m = re.fullmatch(r"UR(\d+)", dest or "")
        if m:  # predicated writes count: ptxas pairs them with reads under the same predicate
            written.update(range(int(m.group(1)), int(m.group(1)) + wide))
    return tuple(found)


def print_table(rows: list[Row], title: str = "") -> None:
    """One line per row, then totals."""
    if title:
        print(title)
    header = f"{'kernel':34} {'case':38} {'config':26} {'regs':>4} {'spill st/ld':>12} " \
             f"{'smem':>7} {'status':6} features / problems"
    print(header)
    print("-" * len(header))
    for r in rows:
        spill = f"{r.spill_stores}/{r.spill_loads}"
        note = ", ".join(r.problems) or " ".join(r.features)
        if r.addr_ops is not None and not r.problems:
            note += f" addr/ldsm {r.addr_ops:.2f}"
        print(f"{r.kernel[:34]:34} {r.case[:38]:38} {r.config[:26]:26} "
              f"{'' if r.regs is None else r.regs:>4} {spill:>12} {r.smem:>7} {r.status:6} {note}")
    print(summary(rows))


def summary(rows: list[Row]) -> str:
    errors = sum(r.status == "error" for r in rows)
    failed = sum(r.status == "FAIL" for r in rows)
    spilled = sum(r.spills > 0 for r in rows if not r.error)
    return (f"{len(rows)} variants: {len(rows) - errors - failed} ok, {errors} compile errors, "
            f"{failed} over budget or with missing or forbidden instructions; {spilled} spill at all")
