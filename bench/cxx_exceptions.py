"""Does an error raised in C++ reach Python, or crash the process? A diagnostic for the GPU image.

Why: the H100 run of 2026-11-26 (bench/results/gpu-2026-11-26-h100-s14/retest/test-rest.log)
lost three pytest workers to segfaults, each while an error was being raised through C++: a
``TORCH_CHECK`` in a user's JIT-built op (test_extending), a bad-input case of the paged cache
(test_paged), and one whose trace was cut. On this CPU machine all of them raise as they should.
In the same run an error raised by the CUDA side of ``fastattn._C`` (the layer norm's launch,
bench/host_overhead.py) reached Python; that process had run no CPU op before it. What differs
on that image: the host compiler (``/opt/gcc/bin/g++``; torch's wheel and its Python are built
with GCC 13.3), and perhaps a second OpenMP runtime beside torch's once an op compiled with
``-fopenmp`` has run in parallel.

Each probe runs in a process of its own (a crash costs one line, and its signal is the answer);
then the facts that tell the causes apart (compilers, the runtimes mapped into a process, what
``fastattn._C`` links), then, unless ``--no-builds``, a tiny op built with each compiler found,
with and without ``-fopenmp``, thrown from at once and after a parallel loop. Exit status 1 when
any probe did not raise as expected. Run by the GPU protocol's ``check`` call beside the build.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import os
import shlex
import shutil
import subprocess
import sys
import sysconfig
import tempfile
import textwrap
from pathlib import Path

PY = sys.executable

# Code run before a probe's raising line: a CPU op of fastattn's, large enough to run on
# several threads (its OpenMP pool starts), or torch's own.
_FASTATTN_PARALLEL = ("import fastattn; "
                      "torch.ops.fastattn.softmax_fwd(torch.randn(16, 8, 64, 512), None, 1.0, False)")
_TORCH_PARALLEL = "torch.randn(4096, 4096).softmax(-1)"
_PY_OP = textwrap.dedent("""
    @torch.library.custom_op("cxxprobe::fail", mutates_args=())
    def fail(x: torch.Tensor) -> torch.Tensor:
        raise ValueError("a Python op's error, through the dispatcher")
    """)

# name -> (setup, the line that must raise, needs CUDA)
PROBES = {
    "torch": ("", "torch.ones(2) @ torch.ones(3)", False),
    "torch, after torch's parallel op": (_TORCH_PARALLEL, "torch.ones(2) @ torch.ones(3)", False),
    "torch, after fastattn's parallel op": (_FASTATTN_PARALLEL, "torch.ones(2) @ torch.ones(3)", False),
    "fastattn cpu op": ("import fastattn",
                        "torch.ops.fastattn.softmax_fwd(torch.zeros(3), None, 1.0, False)", False),
    "fastattn cpu op, after its parallel op": (
        _FASTATTN_PARALLEL, "torch.ops.fastattn.softmax_fwd(torch.zeros(3), None, 1.0, False)", False),
    "python op, after fastattn's parallel op": (_FASTATTN_PARALLEL + "\n" + _PY_OP,
                                                "fail(torch.zeros(3))", False),
    "fastattn cuda op": ("import fastattn", "torch.ops.fastattn.softmax_fwd("
                         "torch.zeros(3, device='cuda'), None, 1.0, False)", True),
    "fastattn cuda op, after its cpu parallel op": (
        _FASTATTN_PARALLEL, "torch.ops.fastattn.softmax_fwd(torch.zeros(3, device='cuda'), "
        "None, 1.0, False)", True),
}


def _raise_code(setup: str, line: str) -> str:
    return "\n".join([
        "import torch", setup,
        "try:", f"    {line}",
        "except Exception as e:",
        "    print(f'raised {type(e).__name__}: {str(e).splitlines()[0][:90]}')",
        "    raise SystemExit(0)",
        "print('did not raise'); raise SystemExit(3)"])


def run_probe(code: str, env: dict | None = None, timeout: float = 300) -> tuple[bool, str]:
    """Run ``code`` in a fresh interpreter: (raised as expected, one line saying what happened)."""
    try:
        proc = subprocess.run([PY, "-c", code], capture_output=True, text=True, timeout=timeout,
                              env={**os.environ, **(env or {})})
    except subprocess.TimeoutExpired:
        return False, f"TIMEOUT after {timeout:.0f} s"
    if proc.returncode < 0:
        return False, f"CRASH: signal {-proc.returncode}"
    lines = (proc.stdout + proc.stderr).strip().splitlines()
    last = lines[-1] if lines else ""
    return proc.returncode == 0, last if proc.returncode == 0 else f"exit {proc.returncode}: {last}"


def _sh(cmd: str) -> str:
    proc = subprocess.run(["bash", "-c", cmd], capture_output=True, text=True)
    return (proc.stdout + proc.stderr).strip()


def compilers() -> list[str]:
    """The distinct C++ compilers an extension build could use here: $CXX, the one Python's
    sysconfig names (setup.py's), ``c++`` on PATH (torch's JIT load), /usr/bin/g++."""
    found = []
    for name in (os.environ.get("CXX"), (sysconfig.get_config_var("CXX") or "").split(" ")[0],
                 "c++", "/usr/bin/g++"):
        path = shutil.which(name) if name else None
        if path and os.path.realpath(path) not in {os.path.realpath(p) for p in found}:
            found.append(path)
    return found


def facts() -> str:
    """What tells the causes apart: compilers and their versions, torch's build compiler, the
    C++ and OpenMP runtimes fastattn._C links and a process maps after a parallel op."""
    out = []
    for cxx in compilers():
        out.append(f"compiler {cxx} -> {os.path.realpath(cxx)}: {_sh(f'{cxx} --version').splitlines()[0]}")
    out.append(f"CXX={os.environ.get('CXX', '')!r}; sysconfig CXX={sysconfig.get_config_var('CXX')!r}")
    out.append("nvcc's host compiler: " + (_sh(
        "nvcc --dryrun -x cu -c /dev/null -o /dev/null 2>&1 | "
        "grep -m1 -oE '^#\\$ [^ ]*(gcc|g\\+\\+|c\\+\\+)' | cut -c4-") or "none found"))
    code = "\n".join([
        "import torch", "print([l.strip() for l in torch.__config__.show().splitlines()[1:3]])",
        _FASTATTN_PARALLEL,
        "import fastattn._C as C; print('fastattn._C', C.__file__)",
        "libs = sorted({l.split()[-1] for l in open('/proc/self/maps') if any(k in l for k in "
        "('gomp', 'omp5', 'stdc++', 'gcc_s'))})",
        "print('mapped after a parallel op:', *libs, sep='\\n  ')"])
    out.append(_sh(f"{PY} -c {shlex.quote(code)}"))
    so = _sh(f"{PY} -c 'import fastattn._C as C; print(C.__file__)' 2>/dev/null | tail -1")
    if so.endswith(".so"):
        out.append("ldd fastattn._C: " + _sh(f"ldd {so} | grep -E 'gomp|omp|stdc|gcc_s' | "
                                             "sed 's/ (0x.*//' | tr -s ' \\t' ' '"))
        out.append("exported unwinder/C++ runtime symbols: " + _sh(
            f"nm -D --defined-only {so} | grep -cE ' (_Unwind_|__cxa_|__gxx_personality)' || true"))
    out.append("OMP_NUM_THREADS=" + os.environ.get("OMP_NUM_THREADS", "(unset)") +
               f"; cpus {os.cpu_count()}")
    return "\n".join(out)


# (ATen/core/Tensor.h, not ATen/ATen.h: the same runtime, linking and unwinding, built in 8 s
# instead of 18 on CI's machine)
_USER_OP = r"""
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

static at::Tensor probe(const at::Tensor& x, bool fail) {
  at::Tensor y = x.new_empty(x.sizes());
  const float* xp = x.const_data_ptr<float>();
  float* yp = y.data_ptr<float>();
  at::parallel_for(0, x.numel(), 4096, [&](int64_t a, int64_t b) {
    for (int64_t i = a; i < b; ++i) yp[i] = 2 * xp[i];
  });
  TORCH_CHECK(!fail, "probe asked to fail, x of shape ", x.sizes());
  return y;
}

TORCH_LIBRARY(NAMESPACE, m) { m.def("probe(Tensor x, bool fail) -> Tensor"); }
TORCH_LIBRARY_IMPL(NAMESPACE, CPU, m) { m.impl("probe", &probe); }
"""


def build_variant(root: Path, name: str, cxx: str, flags: list[str], ldflags: list[str]) -> list[str]:
    """Build the tiny op with ``cxx``, ``flags`` and ``ldflags``; probe a throw at once and
    after its parallel loop, each in a fresh process: ok when it raises with its whole message
    (a second C++ runtime in the library truncated it on a CPU machine and crashed the process
    on the GPU image). Lines of the report."""
    src = root / f"{name}.cpp"
    src.write_text(_USER_OP.replace("NAMESPACE", name))
    build = root / name
    build.mkdir()
    load = (f"import torch, torch.utils.cpp_extension as ext; ext.load({name!r}, [{str(src)!r}], "
            f"extra_cflags={flags!r}, extra_ldflags={ldflags!r}, build_directory={str(build)!r}, "
            "is_python_module=False)")
    ok, what = run_probe(load + "\nprint('raised nothing: built')", {"CXX": cxx}, timeout=240)
    label = f"{Path(cxx).name} ({os.path.realpath(cxx)}) {' '.join(flags + ldflags)}"
    if "built" not in what:
        return [f"  build {label}: FAILED {what}"]
    lines = []
    for when, setup in (("at once", ""), ("after its parallel loop",
                                         f"torch.ops.{name}.probe(torch.randn(1 << 20), False)")):
        ok, what = run_probe(_raise_code(f"{load}\n{setup}",
                                         f"torch.ops.{name}.probe(torch.zeros(3), True)"), {"CXX": cxx})
        ok = ok and "x of shape [3]" in what
        lines.append(f"  {'ok   ' if ok else 'FAIL '} user op by {label}, {when}: {what}")
    return lines


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--no-builds", action="store_true", help="skip the JIT-built variants")
    args = parser.parse_args(argv)
    import torch  # (here: a probe process imports it itself)

    cuda = torch.cuda.is_available()
    failed = 0
    print("Errors raised through C++, each in a fresh process:")
    jobs = {name: (setup, line) for name, (setup, line, needs_cuda) in PROBES.items()
            if cuda or not needs_cuda}
    with concurrent.futures.ThreadPoolExecutor(4) as pool:
        results = dict(zip(jobs, pool.map(lambda sl: run_probe(_raise_code(*sl)), jobs.values())))
    for name, (ok, what) in results.items():
        failed += not ok
        print(f"  {'ok   ' if ok else 'FAIL '} {name}: {what}", flush=True)
    if not cuda:
        print("  (no CUDA device: the cuda op probes did not run)")
    print("\nFacts:\n" + textwrap.indent(facts(), "  "), flush=True)
    if not args.no_builds:
        print("\nA tiny op (TORCH_CHECK after an at::parallel_for) built with each compiler:")
        with tempfile.TemporaryDirectory(prefix="cxxprobe-") as tmp:
            # fastattn's own flags (what fastattn._C and the user op of test_extending are
            # built with), and the compiler bare: no OpenMP, no explicit C++ runtime
            from fastattn.extending import DEFAULT_CFLAGS, DEFAULT_LDFLAGS
            flag_sets = ((list(DEFAULT_CFLAGS), list(DEFAULT_LDFLAGS)),
                         ([f for f in DEFAULT_CFLAGS if f != "-fopenmp"], []))
            # Only fastattn's flags count toward the exit status: a bare compiler that crashes
            # (the GPU image's /opt/gcc, 2026-11-26 and -27) is shown for contrast.
            variants = [((f"cxxprobe{i}{j}", cxx, *flags), j == 0)
                        for i, cxx in enumerate(compilers()) for j, flags in enumerate(flag_sets)]
            with concurrent.futures.ThreadPoolExecutor(len(variants)) as pool:
                futures = {pool.submit(build_variant, Path(tmp), *v): ours for v, ours in variants}
                for future in concurrent.futures.as_completed(futures):  # (a step cut at its
                    lines = future.result()                               # limit keeps these)
                    if futures[future]:
                        failed += sum("FAIL" in line for line in lines)
                    else:
                        lines = [line.replace("FAIL ", "fail ", 1) + " (bare: for contrast)"
                                 if "FAIL" in line else line for line in lines]
                    print("\n".join(lines), flush=True)
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
