"""The staged GPU protocol: what a session with a lent GPU runs, one device call per stage group.

GPU time comes by chance: 15 minutes of device time a session (all starts, calls and idle time
together), at most 10 minutes a call, on a bare offline machine (docs/benchmarking.md). So the
work is cut into calls that each end by themselves inside 8 minutes (every step has its own
timeout), and results are packed into ``$OUT`` after every step, so a call cut short still
returns what it did. The plan, in the order a session runs it::

    python bench/gpu_protocol.py plan              # the calls and their budgets
    python bench/gpu_protocol.py prebuild          # HERE, before call 1 (no GPU): the extension
                                                   #   for sm_90a against the device's Python
                                                   #   and torch, in .gpu-prebuilt/ (carry it)
    python bench/gpu_protocol.py check             # call 1: Triton tests beside the extension's
                                                   #   tests (the build first, unless carried)
    python bench/gpu_protocol.py profile           # call 2, at once (warm: the build is kept):
                                                   #   ncu on the attention kernels, the cuda
                                                   #   forward's 16 against 32 rows a warp
    python bench/gpu_protocol.py bench             # later leases, after check again: the
    python bench/gpu_protocol.py rest              #   quick benchmark, the rest of the suite's
    python bench/gpu_protocol.py rest-ops          #   GPU cases, the per-op test files' GPU
    python bench/gpu_protocol.py bench-ops         #   cases, decode / varlen / JVP, the full
    python bench/gpu_protocol.py full              #   benchmark grid
    python bench/gpu_protocol.py spare             # a lease's last 90-200 s, warm: decode, JVP
    python bench/gpu_protocol.py rows              #   (or the cuda forward's 16 vs 32 rows)
    python bench/gpu_protocol.py --dry-run all     # print every step; run nothing (CI runs it)

``triton``, ``cuda`` and ``sanitize`` are parts of check, to rerun one. Each call
writes ``bench/results/gpu-<date>-<gpu>/<call>/`` (logs, junit XML, bench JSON, a ``steps.json`` of
statuses and times) and, when ``$OUT`` is set, ``$OUT/<call>.tgz`` plus
``$OUT/<call>-summary.txt``. Unpack the tarballs under bench/results/ here and commit them.
Every call installs the package first and, where it uses the CUDA kernels, builds the extension
unless it is there (the machine keeps build outputs only while it stays warm, 30 s) or a carried
``.gpu-prebuilt/`` holds one built from these very sources for the device's torch and Python.
``--smoke OP BACKEND`` is the one-shape check that the first call runs once per kernel, each in
its own process, so a fault costs one line.
"""

from __future__ import annotations

import argparse
import concurrent.futures
import dataclasses
import datetime
import hashlib
import json
import os
import shlex
import shutil
import signal
import subprocess
import sys
import tarfile
import threading
import time
from pathlib import Path
from xml.etree import ElementTree

ROOT = Path(__file__).resolve().parents[1]
CALL_BUDGET_S = 480          # every call's steps end within this (the tool allows 600)
OPS = ("attention", "softmax", "layer_norm", "ffn", "rope")
KERNEL_TESTS = ["tests/test_attention_kernel.py"]
PY = sys.executable
# The device image (the device tool's KINDS.md; versions.log of every run): an extension built
# here for it must match its Python and torch exactly (torch's C++ ABI, pybind11's, CUDA 13).
DEVICE_PYTHON = "3.12"
DEVICE_TORCH = "2.11.0+cu130"
PREBUILT = ROOT / ".gpu-prebuilt"     # what `prebuild` writes and a device call carries
PREBUILT_VENV = ROOT / ".venv-gpu"    # the device's Python and torch, here (~5 GB)


@dataclasses.dataclass
class Step:
    name: str
    cmd: list[str]
    timeout: int                          # seconds; the step is killed after it
    env: dict[str, str] = dataclasses.field(default_factory=dict)


@dataclasses.dataclass
class Lanes:
    """Sequences of steps that run side by side (a thread each), e.g. the extension's build on
    the CPUs while the Triton tests use the GPU; the next stage starts when every lane is done."""
    lanes: list[list[Step]]

    @property
    def timeout(self) -> int:
        return max(sum(step.timeout for step in lane) for lane in self.lanes)


def _tests(name, *args, junit, step_timeout, workers=8, timeout=None, env=None, maxfail=25):
    """A pytest step. Each test's outcome and seconds go to ``{out}/<junit>-tests.tsv`` (and a
    failure's text to ``.failures`` beside it) as the test ends (tests/conftest.py), so a step
    killed at its limit, which writes no junit XML, still says which tests ran, failed or
    crashed their worker. ``maxfail``: a poisoned CUDA context fails every later test of its
    worker; past that many failures the run stops."""
    cmd = [PY, "-m", "pytest", "-q", "-p", "no:cacheprovider", "-rfE", f"--maxfail={maxfail}",
           "--durations=15", *args]
    if workers and _has_module("xdist"):
        cmd += ["-n", str(workers)]
    if timeout and _has_module("pytest_timeout"):
        cmd += [f"--timeout={timeout}"]
    cmd += [f"--junitxml={{out}}/{junit}.xml"]
    return Step(name, cmd, step_timeout,
                {**(env or {}), "FASTATTN_TEST_LOG": f"{{out}}/{junit}-tests.tsv"})


def _has_module(name):
    import importlib.util
    return importlib.util.find_spec(name) is not None


def _smokes(backend):
    """One step per op; Triton's include compiling the op's kernels (one config each)."""
    env = {"FASTATTN_AUTOTUNE": "0", **({} if backend == "cuda" else _NO_EXT)}
    timeouts = {"attention": 45, "ffn": 30} if backend == "triton" else {}
    return [Step(f"smoke-{backend}-{op}", [PY, "bench/gpu_protocol.py", "--smoke", op, backend],
                 timeouts.get(op, 20 if backend == "triton" else 15), env) for op in OPS]


_NO_EXT = {"FASTATTN_NO_EXTENSION": "1"}
# The machine is bare unless it stayed warm since the last call: every call installs the package
# (editable, no extension: seconds), and calls that use the CUDA kernels build the extension
# unless an earlier call on this machine did (sm_90a only: a third of the default compile time;
# 118 s on 16 cores, 2026-11-26).
_INSTALL = Step("install", [PY, "-m", "pip", "install", "-q", "--no-build-isolation", "--no-deps",
                            "-e", "."], 30, _NO_EXT)
# (in place, not a second pip install: that would take the package away from a lane beside it;
# 12 jobs: attention.cu and varlen.cu (attention_kernels.cuh's dense and packed instances, built
# side by side) are most of the build's wall time, and the other cores compile Triton kernels
# for the tests beside it. `--build-extension`: nothing when fastattn._C imports (a warm
# machine), else the carried prebuilt one when its stamp matches, else setup.py here.)
_BUILD = Step("build", [PY, "bench/gpu_protocol.py", "--build-extension"], 220,
              {"TORCH_CUDA_ARCH_LIST": "9.0a", "MAX_JOBS": "12"})
# (Cold on the H100 beside the kernel tests: 97 s and 151 s on 2026-11-26's first two runs,
# over 160 s on the third, after sessions 15-17 grew the CPU kernels: it was cut, and check's
# CUDA steps ran without the extension; 146 s on 2026-11-27, before varlen.cu and paged.cu.
# Prebuilt and carried, it costs the lease seconds.) Calls after "check" should find the build
# there (warm machine): seconds.
_WARM_BUILD = dataclasses.replace(_BUILD, timeout=100)
_CLI = [PY, "-m", "fastattn.cli"]
_QUICK_BENCH = ["--op", "attention", "--seq", "1024,4096,16384", "--mask", "none", "--budget", "0.1"]

_TRITON_INFO = Step("info", [*_CLI, "info"], 15, _NO_EXT)
_CUDA_INFO = Step("info-cuda", [*_CLI, "info"], 15)  # (once built: what the extension holds)
_VERSIONS = Step("versions", ["bash", "-c", "nvidia-smi; nvcc --version; " + PY + " -c 'import sys, "
                 "torch, triton; print(sys.version); print(torch.__version__, "
                 "torch.version.cuda, triton.__version__, torch.cuda.get_device_name())'"
                 "; " + PY + " -m pip list 2>/dev/null | grep -iE 'torch|triton|xdist|timeout'"], 15)
# The Triton kernel tests, pointer and descriptor (TMA) cases alike, and the NaN rule's Triton
# cases (careful paths, the FIXUP launch: GPU-only code paths), with blocking launches: a TMA
# fault poisons the CUDA context of its xdist worker, so it shows as that worker's failures (one
# process per test, tried on 2026-11-26, ran 34 tests in 90 s: too slow for a lease). One pytest
# run for both: the NaN cases as a run of their own, beside the build, spent their 60 s starting
# up (H100, 2026-11-26: 28 tests cut short; the kernel tests took 132 s).
_TRITON_TESTS = [
    _tests("test-kernels", *KERNEL_TESTS, "tests/test_nan.py", "-k",
           "test_attention_kernel or triton or warp_specialized", junit="kernels",
           step_timeout=200, timeout=120, env={**_NO_EXT, "CUDA_LAUNCH_BLOCKING": "1"}),
]
# (+ the NaN rule's cuda cases: the careful paths run on no other call with blocking launches,
# and nowhere but a GPU)
_CUDA_TESTS = _tests("test-cuda", "tests/test_cuda_kernels.py", "tests/test_nan.py", "-k", "cuda",
                     junit="cuda", step_timeout=120, timeout=100,
                     env={"CUDA_LAUNCH_BLOCKING": "1"})
# The rest of the suite on the GPU, in two calls: tests of the CPU side alone (the NumPy
# reference, nvcc and C++ builds, the protocol, the CLI and demos) are CI's, and so are the cpu
# backend's cases; the kernel and NaN files are check's. The first run of the rest (H100,
# 2026-11-26) got through a fifth of it in 210 s, with ~40 failures its -q output could not name
# (hence the per-test log) and a segfault in test_extending.
_NOT_ON_GPU = ["test_reference.py", "test_cpu_simd.py", "test_aot_cuda.py", "test_cuda_layouts.py",
               "test_gpu_protocol.py", "test_hf_clone_root.py", "test_demo.py", "test_cli.py",
               "test_bench.py", "test_schemas.py", "test_cuda_kernels.py", "test_nan.py",
               *(Path(t).name for t in KERNEL_TESTS)]
_OP_TESTS = ["test_attention.py", "test_softmax.py", "test_layer_norm.py", "test_ffn.py",
             "test_rope.py", "test_sdpa.py", "test_combinations.py"]


def _rest(name, timeout, files=None, exclude=()):
    """The GPU part of the rest of the suite: ``files`` (default: every test file not excluded).
    14 workers: nothing builds beside these runs, and their time is Triton's compiles (one per
    new shape and flag set, 3-20 s each on the CPUs; the kernel tests' median was 5.3 s a test),
    so more workers finish more of the ~260 (rest) and ~800 (rest-ops) GPU cases; the GPU and
    its 80 GB are nowhere near busy with them. Up to 60 failures: the first run of these files
    had ~40 in its first fifth, most of them one cause (fixed since), and each one named helps."""
    args = [f"tests/{f}" for f in files] if files else [
        "tests", *(f"--ignore=tests/{f}" for f in (*_NOT_ON_GPU, *exclude))]
    return _tests(f"test-{name}", *args, "-k", "not cpu", junit=name, step_timeout=timeout,
                  workers=14, timeout=150, maxfail=60)


# Does an error raised in C++ reach Python? (H100, 2026-11-26: pytest workers of the rest of
# the suite segfaulted while one was raised. The cause, found by bench/cxx_exceptions.py on the
# third run: CXX there links a static copy of the C++ runtime into each library; fixed by
# fastattn.extending.DEFAULT_LDFLAGS.) Its probes, and a tiny op built by each compiler with and
# without fastattn's flags, in rest, beside its tests.
_CXX_BUILDS = Step("cxx-exceptions-builds", [PY, "bench/cxx_exceptions.py"], 120)

# The Triton forward's illegal address of 2026-11-27 (H100): test_combinations' first Triton
# attention case (seed 0: bf16, D 100, Dv 1, causal with a window, a full bool mask with a fully
# masked row, (B, L, H, D) inputs) faulted on the pointer path inside the autotuner's timing of
# its one config, after 6 clean launches of it. Under the interpreter every access of every
# config the H100 pruners keep is in bounds (bench/triton_bounds.py, seeds 0-47, fast and
# careful paths). So, compiled: that forward 5000 times back to back (does it fault, and
# how often), then memcheck on seed 0's every kept config, forward and backward (which kernel,
# which access). Since then (2026-11-27, session 21) the launcher gives the kernels a copy of
# a mask whose rows are not 16-element aligned (Lk 40 here: each element was a load of its
# own, and that config spilled 740 B), and the pruner no longer keeps 64x64 w4s3 at this head
# dim: "as-faulted" runs the faulting launch as it was (that config, the caller's mask).
_AS_FAULTED = ["--config", "64x64 w4s3", "--unaligned-mask"]


def _seed0(name, timeout, *args, memcheck=False):
    """bench/triton_bounds.py on seed 0, compiled (Triton alone), under memcheck or not."""
    tool = ["compute-sanitizer", "--tool", "memcheck", "--error-exitcode", "1",
            "--print-limit", "20"] if memcheck else []
    return Step(name, [*tool, PY, "bench/triton_bounds.py", "--device", "cuda", "--seeds", "0",
                       *args], timeout, {**_NO_EXT, "TRITON_INTERPRET": "0"})


_TRITON_FAULT = [
    _seed0("stress-triton", 60, "--forward-only", "--first-only", "--repeat", "5000", "--no-sync"),
    _seed0("stress-triton-as-faulted", 60, "--forward-only", *_AS_FAULTED, "--repeat", "5000",
           "--no-sync"),
    _seed0("memcheck-triton-as-faulted", 60, "--forward-only", *_AS_FAULTED, "--repeat", "3",
           memcheck=True),
    _seed0("memcheck-triton", 150, "--repeat", "3", memcheck=True),
]

# compute-sanitizer on the CUDA kernels, a step per tool (9-15 s each on 2026-11-26's runs).
_SANITIZE = [Step(tool, ["compute-sanitizer", "--tool", tool, "--error-exitcode", "1", PY,
                         "bench/sanitize_cuda.py"], 30) for tool in ("memcheck", "racecheck")]

# The cuda forward on 16 against 32 rows a warp, alternating in one process: in "profile", and
# alone as "rows", the call for a lease's last two minutes (warm).
_CUDA_FWD_ROWS = Step("cuda-fwd-rows", [PY, "bench/cuda_fwd_rows.py", "--json",
                                        "{out}/cuda-fwd-rows.json"], 60)

def _bench_op(op):
    """``fastattn bench --op <op> --quick``, warm, no torch.compile peers (bench-ops, spare)."""
    return Step(f"bench-{op}", [*_CLI, "bench", "--op", op, "--quick", "--budget", "0.1",
                                "--no-compile", "--json", f"{{out}}/bench-{op}.json"],
                {"decode": 70, "varlen": 110, "jvp": 100}[op])


# The calls, in the order a session makes them; each one's steps fit CALL_BUDGET_S. A 15-minute
# lease makes "check" then "profile" back to back (the machine stays warm 30 s); the next lease
# goes on with "check" again, then "bench", and so on.
CALLS: dict[str, list[Step | Lanes]] = {
    # 1. Correctness of both GPU backends in one call, side by side: the Triton kernels' smokes
    #    and tests; the extension (built on the CPUs unless carried prebuilt), compute-sanitizer
    #    on it, its smokes and tests. Built there, the CUDA lane is the longer (~320 s against
    #    ~160); carried, the Triton lane is, and check ends ~150 s sooner.
    "check": [
        _INSTALL, _VERSIONS,
        Lanes([[_TRITON_INFO, Lanes([[s] for s in _smokes("triton")]), *_TRITON_TESTS],
               [_BUILD, *_SANITIZE, _CUDA_INFO, Lanes([[s] for s in _smokes("cuda")]),
                _CUDA_TESTS]]),
    ],
    # 2. Why the attention kernels run as they do, second since session 24: three leases had
    #    timed the cuda attention at 0.19-0.29 of cuDNN (gpu-notes) and none had reached this.
    #    Nsight Compute's counters for one fwd+bwd of cuda, cuda-rows32 and triton at L4k,
    #    D64/D128, causal or not (bench/profile_attention.py), then the cuda forward on 16
    #    against 32 rows a warp, alternating in one process (bench/cuda_fwd_rows.py).
    "profile": [
        _INSTALL, _WARM_BUILD,
        Step("ncu-attention", [PY, "bench/profile_attention.py", "--out", "{out}"], 240),
        _CUDA_FWD_ROWS,
    ],
    # 3. The quick benchmark, warm (the build is kept): host vs kernel time of the small ops
    #    and of the attention at L1k; attention D64 and D128 against each SDPA backend, fwd
    #    and fwd+bwd, causal and not, bf16, at the lengths no run has reached yet (runs 2, 3
    #    and 7 each timed D128 L1k-4k and D64 L1k, the same within 1-3%, and were cut there);
    #    softmax and layer norm bandwidth. FlexAttention and torch.compile compile every
    #    shape: they are in "full". A step cut short keeps the cases it finished (--json is
    #    written after each).
    "bench": [
        _INSTALL, _WARM_BUILD,
        # Host time against kernel time first, the small ops before anything compiles (a 6-12
        # us layer norm was timed at 300 us, its host busy), then the attention at L1k (the
        # Triton D128 causal forward: 0.25 ms in runs 2-3, 0.43 in run 7, same config): 28 s
        # for the small ops on 2026-11-27; the attention autotunes.
        Step("host-overhead", [PY, "bench/host_overhead.py", "--json", "{out}/host-overhead.json"],
             100),
        # D64 autotunes at 20-35 s a case at L1k (run 7: 3 of 8 cases in 100 s); D128 L4k
        # cases took 3-6 s; the L16k ones time torch's math path over 16k x 16k scores.
        Step("bench-attention-d64", [*_CLI, "bench", *_QUICK_BENCH, "--seq", "4096,16384",
                                     "--d", "64", "--no-compile", "--json",
                                     "{out}/bench-attention-d64.json"], 100),
        Step("bench-attention-d128", [*_CLI, "bench", *_QUICK_BENCH, "--seq", "16384", "--d",
                                      "128", "--no-compile", "--json",
                                      "{out}/bench-attention-d128.json"], 80),
        # (58 s of measurements in run 7, cut at 70 s after them: the write and exit)
        Step("bench-bandwidth", [*_CLI, "bench", "--op", "softmax,layer_norm", "--quick",
                                 "--budget", "0.1", "--json", "{out}/bench-bandwidth.json"], 70),
    ],
    # 4. The rest of the suite's GPU cases, warm (the build is kept):
    #    varlen, paged, JVP, the models and the Hugging Face swaps, never all run on a GPU yet;
    #    then the per-op files' GPU cases.
    #    Beside them, what decides why an error raised in C++ crashed a worker.
    "rest": [_INSTALL, _WARM_BUILD,
             Lanes([[_rest("rest", 300, exclude=_OP_TESTS)], [_CXX_BUILDS], _TRITON_FAULT])],
    "rest-ops": [_INSTALL, _WARM_BUILD, _rest("rest-ops", 340, files=_OP_TESTS)],
    # 5. The quick numbers the other issues ask of a GPU: decode on a paged cache (L 4k and
    #    32k, batch 1 and 64: the fraction of copy bandwidth, target >= 85% at L >= 8k), packed
    #    varlen against padded SDPA, the JVP against torch's math-path JVP (and the forward).
    #    Warm; autotuned where the op is; no torch.compile peers.
    "bench-ops": [_INSTALL, _WARM_BUILD, *(_bench_op(op) for op in ("decode", "varlen", "jvp"))],
    # 7. When a session has time left: the full grid, and the Triton pointer path beside the
    #    descriptor path.
    "full": [
        _INSTALL,
        Step("bench-full", [*_CLI, "bench", "--budget", "0.1", "--json", "{out}/bench-full.json"],
             280, _NO_EXT),
        Step("bench-pointer", [*_CLI, "bench", *_QUICK_BENCH, "--d", "64,128", "--providers",
                               "fastattn-triton,sdpa", "--json", "{out}/bench-pointer.json"], 120,
             {**_NO_EXT, "FASTATTN_TRITON_TMA": "0"}),
    ],
}


# Parts of check, to rerun one: Triton only, no CUDA build; the extension, its smokes and GPU
# tests with blocking launches; compute-sanitizer.
CALLS["triton"] = [_INSTALL, _VERSIONS, _TRITON_INFO, *_smokes("triton"), *_TRITON_TESTS]
CALLS["cuda"] = [_INSTALL, _BUILD, _CUDA_INFO, *_smokes("cuda"), _CUDA_TESTS]
CALLS["sanitize"] = [_INSTALL, _BUILD, *_SANITIZE]
RERUNS = ("triton", "cuda", "sanitize")
# A lease's last minutes, warm (~80 s): what is still unmeasured and short, never a hand-typed
# command (run 7 lost 134 s to one: a `pip install -e .` that rebuilt the extension).
CALLS["rows"] = [_INSTALL, _WARM_BUILD, _CUDA_FWD_ROWS]
# bench-ops is five leases down the plan, and leases came to 7 of 32 sessions: the decode and
# JVP numbers that the paged / JVP issues wait on go in a lease's last minutes instead (each
# case is written as it ends, so a call cut short keeps what it timed).
CALLS["spare"] = [_INSTALL, _WARM_BUILD, _bench_op("decode"), _bench_op("jvp")]
SPARE = ("spare", "rows")


def _flat(stage: Step | Lanes) -> list[Step]:
    return [s for lane in stage.lanes for st in lane for s in _flat(st)] \
        if isinstance(stage, Lanes) else [stage]


def budget(call: str) -> int:
    return sum(step.timeout for step in CALLS[call])


def _gpu_short_name() -> str:
    """"h100", "h200", ... from nvidia-smi (no torch, no CUDA context here); "gpu" without one."""
    try:
        name = subprocess.run(["nvidia-smi", "--query-gpu=name", "--format=csv,noheader"],
                              capture_output=True, text=True, timeout=20).stdout
    except (OSError, subprocess.SubprocessError):
        return "gpu"
    words = [w.lower() for w in name.split() if any(c.isdigit() for c in w)]
    return words[0] if words else "gpu"


def results_dir(call: str) -> Path:
    """bench/results/gpu-<date>-<gpu>/<call>: two runs of one day on different GPUs (the H200
    and the H100 of 2026-11-26) keep folders of their own."""
    day = datetime.date.today().isoformat()
    return ROOT / "bench" / "results" / f"gpu-{day}-{_gpu_short_name()}" / call


def _pack(call: str, out: Path, records: list[dict]) -> None:
    """Write steps.json, and with $OUT set, the tarball and a one-line-per-step summary."""
    (out / "steps.json").write_text(json.dumps(records, indent=1))
    dest = os.environ.get("OUT")
    if not dest:
        return
    summary = "\n".join(f"{r['step']:28} {r['status']:8} {r['seconds']:6.1f} s" for r in records)
    Path(dest, f"{call}-summary.txt").write_text(summary + "\n")
    with tarfile.open(Path(dest, f"{call}.tgz"), "w:gz") as tar:
        tar.add(out, arcname=f"{out.parent.name}/{call}")


def _all_skipped(cmd: list[str]) -> bool:
    """Whether a pytest step's junit XML says that every test it collected was skipped."""
    path = next((part.split("=", 1)[1] for part in cmd if part.startswith("--junitxml=")), None)
    if path is None or not Path(path).is_file():
        return False
    suites = list(ElementTree.parse(path).getroot().iter("testsuite"))
    tests = sum(int(s.get("tests", 0)) for s in suites)
    return tests > 0 and tests == sum(int(s.get("skipped", 0)) for s in suites)


def run_step(step: Step, out: Path) -> dict:
    """Run one step in its own process group, killed at its timeout; its log goes to out/."""
    cmd = [part.replace("{out}", str(out)) for part in step.cmd]
    env = {**os.environ, "PYTHONUNBUFFERED": "1",
           **{k: v.replace("{out}", str(out)) for k, v in step.env.items()}}
    log = out / f"{step.name}.log"
    start = time.monotonic()
    with open(log, "w") as f:
        f.write(f"$ {shlex.join(cmd)}\n")
        f.flush()
        proc = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=f, stderr=subprocess.STDOUT,
                                start_new_session=True)
        try:
            rc = proc.wait(timeout=step.timeout)
            status = "ok" if rc == 0 else f"exit {rc}"
            if rc == 0 and _all_skipped(cmd):
                status = "all skipped"  # (check's cuda tests when the build was cut, 2026-11-26)
        except subprocess.TimeoutExpired:
            os.killpg(proc.pid, signal.SIGKILL)
            proc.wait()
            status = "timeout"
    record = {"step": step.name, "status": status, "seconds": time.monotonic() - start,
              "timeout": step.timeout}
    tail = log.read_text(errors="replace").splitlines()[-8:]
    print(f"== {step.name}: {status} in {record['seconds']:.0f} s")
    print("\n".join("   " + line for line in tail), flush=True)
    return record


def run_call(call: str, steps: list[Step | Lanes] | None = None, out: Path | None = None) -> int:
    steps = CALLS[call] if steps is None else steps
    out = results_dir(call) if out is None else out
    if out.exists():  # an earlier run's files (committed, or a rerun): the tarball holds this one's
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)
    records, lock = [], threading.Lock()

    def run(stage):
        if isinstance(stage, Lanes):
            with concurrent.futures.ThreadPoolExecutor(len(stage.lanes)) as pool:
                list(pool.map(lambda lane: [run(s) for s in lane], stage.lanes))
            return
        record = run_step(stage, out)
        with lock:
            records.append(record)
            _pack(call, out, records)

    for stage in steps:
        run(stage)
    failed = [r["step"] for r in records if r["status"] != "ok"]
    print(f"{call}: {len(records) - len(failed)} of {len(records)} steps ok"
          + (f"; not ok: {', '.join(failed)}" if failed else "") + f"; results in {out}")
    return 1 if failed else 0


def dry_run(calls: list[str]) -> int:
    """Print each call's steps, commands and budgets; fail if a call's budget is over
    CALL_BUDGET_S or a step names a file that does not exist."""
    problems = []
    for call in calls:
        total = budget(call)
        print(f"call {call}: {len(CALLS[call])} steps, budget {total} s "
              f"(limit {CALL_BUDGET_S} s){'  OVER' if total > CALL_BUDGET_S else ''}")
        if total > CALL_BUDGET_S:
            problems.append(f"{call} is over budget")
        for stage in CALLS[call]:
            if isinstance(stage, Lanes):
                print(f"  side by side, {stage.timeout} s at most:")
            for step in _flat(stage):
                env = " ".join(f"{k}={v}" for k, v in step.env.items())
                print(f"  {step.name:24} {step.timeout:4} s  {env + ' ' if env else ''}"
                      f"{shlex.join(step.cmd)}")
                for part in step.cmd:
                    if part.startswith(("tests/", "bench/")) and not (ROOT / part).exists():
                        problems.append(f"{call}/{step.name}: {part} does not exist")
    for problem in problems:
        print(f"PROBLEM: {problem}")
    return 1 if problems else 0


def plan() -> None:
    print("First, here (no GPU, no device time): python bench/gpu_protocol.py prebuild, then "
          'name carry=[".gpu-prebuilt"] in every device call (the build step uses it where its '
          "stamp fits, else builds there).")
    print("One device call per line, in this order (each ends by itself within its budget); a "
          "15-minute lease fits the first two, back to back (a machine stays warm 30 s): "
          "`check` (timeout_s 480; 292-345 s on 2026-11-27), then at once the first call no "
          "run has finished (timeout_s: what the lease has left less 20 s). A later lease runs "
          "`check` again, then the next one. Each session's machine started in under a minute:")
    for i, call in enumerate([c for c in CALLS if c not in RERUNS + SPARE], 1):
        print(f"  {i}. python bench/gpu_protocol.py {call:9} ~{budget(call) // 60 + 1} min at most")
    print("With 90-200 s left, warm: python bench/gpu_protocol.py spare (decode, then the JVP; "
          "timeout_s: what is left less 20 s), or rows when no run of profile has finished its "
          "cuda-fwd-rows step. Never a hand-typed command: its mistakes cost the lease.")
    print("To rerun a part of check: " + ", ".join(
        f"python bench/gpu_protocol.py {c} (~{budget(c) // 60 + 1} min)" for c in RERUNS))
    print("Then unpack $OUT/<call>.tgz under bench/results/, run python bench/summarize.py, "
          "commit.")


def smoke(op: str, backend: str) -> int:
    """One shape of ``op`` on ``backend`` (forward and backward) against the naive backend."""
    import torch

    import fastattn

    torch.manual_seed(0)
    dev, dt = "cuda", torch.bfloat16

    def t(*shape):
        return torch.randn(*shape, device=dev, dtype=dt, requires_grad=True)

    if op == "attention":
        args = (t(2, 4, 300, 128), t(2, 4, 300, 128), t(2, 4, 300, 128))

        def fn(q, k, v, backend):
            return fastattn.scaled_dot_product_attention(q, k, v, is_causal=True, backend=backend)
    elif op == "softmax":
        args = (t(2, 4, 300, 300),)

        def fn(x, backend):
            return fastattn.scaled_masked_softmax(x, None, scale=0.125, is_causal=True,
                                                  backend=backend)
    elif op == "layer_norm":
        args = (t(1000, 1024), t(1024), t(1024))

        def fn(x, w, b, backend):
            return fastattn.layer_norm(x, (1024,), w, b, backend=backend)
    elif op == "ffn":
        args = (t(300, 256), t(1024, 256), t(1024), t(256, 1024), t(256))

        def fn(x, w1, b1, w2, b2, backend):
            return fastattn.ffn(x, w1, b1, w2, b2, activation="gelu", backend=backend)
    elif op == "rope":
        args = (t(2, 4, 300, 128),)

        def fn(x, backend):
            return fastattn.rope(x, backend=backend)
    else:
        raise ValueError(f"unknown op {op!r}")
    outs = {}
    for name in (backend, "naive"):
        inputs = [a.detach().clone().requires_grad_() for a in args]
        y = fn(*inputs, backend=name)
        y.float().square().sum().backward()
        torch.cuda.synchronize()
        outs[name] = [y.float()] + [a.grad.float() for a in inputs]
    worst = max(((a - b).abs().max() / b.abs().max().clamp_min(1e-6)).item()
                for a, b in zip(outs[backend], outs["naive"]))
    ok = worst < 3e-2 and all(torch.isfinite(a).all() for a in outs[backend])
    print(f"smoke {op} on {backend}: {'ok' if ok else 'FAILED'} (largest relative difference "
          f"to naive {worst:.2e})")
    return 0 if ok else 1


def extension_digest(root: Path = ROOT) -> str:
    """sha256 of what the extension is built from: setup.py, its flags (fastattn/extending.py)
    and every file under csrc/, names and contents."""
    digest = hashlib.sha256()
    files = [root / "setup.py", root / "fastattn" / "extending.py",
             *sorted(p for p in (root / "csrc").rglob("*") if p.is_file())]
    for path in files:
        digest.update(path.relative_to(root).as_posix().encode() + b"\0")
        digest.update(path.read_bytes() + b"\0")
    return digest.hexdigest()


def prebuilt_refusal(stamp: dict, digest: str, torch_version: str, python: str) -> str | None:
    """Why a prebuilt extension with this stamp may not stand in for a build here, or None."""
    for key, here in (("digest", digest), ("torch", torch_version), ("python", python)):
        if stamp.get(key) != here:
            return f"built for {key} {stamp.get(key)!r}, here {here!r}"
    return None


def _import_extension() -> subprocess.CompletedProcess:
    return subprocess.run([PY, "-c", "import fastattn._C"], cwd=ROOT, capture_output=True,
                          text=True)


def _use_prebuilt() -> str | None:
    """Put the carried prebuilt extension in place if its stamp matches this tree, this torch
    and this Python and it imports; else say why not (and leave nothing behind)."""
    stamp_path = PREBUILT / "stamp.json"
    if not stamp_path.is_file():
        return f"no prebuilt extension ({stamp_path.relative_to(ROOT)} was not carried)"
    stamp = json.loads(stamp_path.read_text())
    import torch
    refusal = prebuilt_refusal(stamp, extension_digest(), torch.__version__,
                               f"{sys.version_info.major}.{sys.version_info.minor}")
    if refusal:
        return f"the prebuilt extension does not fit: {refusal}"
    dest = ROOT / "fastattn" / stamp["file"]
    shutil.copy2(PREBUILT / stamp["file"], dest)
    result = _import_extension()
    if result.returncode != 0:
        dest.unlink()
        return f"the prebuilt extension did not import:\n{result.stderr[-2000:]}"
    print(f"using the prebuilt extension: {stamp['file']} built {stamp['built']} at "
          f"{stamp['commit']} in {stamp['seconds']:.0f} s, sources {stamp['digest'][:12]}")
    return None


def build_extension() -> int:
    """check's build step: nothing when fastattn._C imports already (a machine still warm from
    an earlier call), else the carried prebuilt extension where it fits, else nvcc here
    (setup.py build_ext --inplace, TORCH_CUDA_ARCH_LIST and MAX_JOBS from the step)."""
    if _import_extension().returncode == 0:
        print("fastattn._C imports: already built")
        return 0
    why = _use_prebuilt()
    if why is None:
        return 0
    print(f"{why}\nbuilding the extension here", flush=True)
    return subprocess.call([PY, "setup.py", "-q", "build_ext", "--inplace"], cwd=ROOT)


def _find_python(version: str) -> str:
    names = [f"python{version}", *sorted(
        str(p) for p in Path.home().glob(f".pyenv/versions/{version}.*/bin/python{version}"))]
    for name in names:
        found = shutil.which(name)
        if found:
            return found
    raise SystemExit(f"prebuild needs a Python {version} (the device's); none of {names} found. "
                     f"Pass one with --python.")


def prebuild(python: str | None = None) -> int:
    """Here, on the CPUs, before a lease: build the extension as check's build step would on the
    device (sm_90a, setup.py's flags) but against the device's Python and torch, installed in
    .venv-gpu/ (torch from PyPI: the +cu130 build the image has). The result and its stamp go
    to .gpu-prebuilt/; a device call with carry [".gpu-prebuilt"] then skips the build."""
    venv_py = PREBUILT_VENV / "bin" / "python"
    if not venv_py.exists():
        subprocess.check_call([python or _find_python(DEVICE_PYTHON), "-m", "venv",
                               str(PREBUILT_VENV)])
        subprocess.check_call([str(venv_py), "-m", "pip", "install", "-q",
                               f"torch=={DEVICE_TORCH.split('+')[0]}", "ninja", "wheel",
                               "setuptools>=70.1,<82"])
    probe = subprocess.run([str(venv_py), "-c", "import sys, sysconfig, torch; print(torch."
                            "__version__, f'{sys.version_info[0]}.{sys.version_info[1]}', "
                            "sysconfig.get_config_var('EXT_SUFFIX'))"],
                           capture_output=True, text=True, check=True).stdout.split()
    torch_version, python_version, suffix = probe
    if (torch_version, python_version) != (DEVICE_TORCH, DEVICE_PYTHON):
        raise SystemExit(f"{PREBUILT_VENV} has torch {torch_version} on Python {python_version}; "
                         f"the device has {DEVICE_TORCH} on {DEVICE_PYTHON}")
    shutil.rmtree(PREBUILT, ignore_errors=True)
    digest, start = extension_digest(), time.monotonic()
    env = {**os.environ, "TORCH_CUDA_ARCH_LIST": _BUILD.env["TORCH_CUDA_ARCH_LIST"]}
    env.pop("FASTATTN_NO_EXTENSION", None)
    env.pop("FASTATTN_NO_CUDA", None)
    # (torch takes CUDA_HOME from the nvcc on PATH when unset: here a wrapper in /usr/local/bin,
    # whose ../lib64 holds no libcudart to link against)
    if "CUDA_HOME" not in env and Path("/usr/local/cuda/bin/nvcc").exists():
        env["CUDA_HOME"] = "/usr/local/cuda"
    subprocess.check_call([str(venv_py), "setup.py", "-q", "build_ext", "--build-lib",
                           str(PREBUILT / "lib"), "--build-temp",
                           str(ROOT / "build" / "gpu-prebuilt")], cwd=ROOT, env=env)
    seconds = time.monotonic() - start
    if extension_digest() != digest:
        raise SystemExit("the sources changed during the build; run prebuild again")
    name = f"_C{suffix}"
    (PREBUILT / "lib" / "fastattn" / name).rename(PREBUILT / name)
    shutil.rmtree(PREBUILT / "lib")
    # Loading it resolves every symbol against the device's torch (RTLD_NOW): a wrong ABI fails
    # here, not in the lease.
    subprocess.run([str(venv_py), "-c", "import importlib.util, sys, torch; spec = importlib.util."
                    f"spec_from_file_location('fastattn._C', sys.argv[1]); "
                    "importlib.util.module_from_spec(spec)", str(PREBUILT / name)], check=True)
    commit = subprocess.run(["git", "describe", "--always", "--dirty"], cwd=ROOT,
                            capture_output=True, text=True).stdout.strip()
    stamp = {"file": name, "digest": digest, "torch": torch_version, "python": python_version,
             "arch": env["TORCH_CUDA_ARCH_LIST"], "commit": commit, "seconds": seconds,
             "built": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}
    (PREBUILT / "stamp.json").write_text(json.dumps(stamp, indent=1) + "\n")
    size = (PREBUILT / name).stat().st_size / 2**20
    listed = subprocess.run(["git", "ls-files", "-z", "--cached", "--others", "--exclude-standard"],
                            cwd=ROOT, capture_output=True, text=True).stdout.split("\0")
    tree = sum((ROOT / f).stat().st_size for f in listed if f and (ROOT / f).is_file()) / 2**20
    print(f"{PREBUILT / name}: {size:.1f} MiB, built in {seconds:.0f} s. Carry it: "
          f'run(..., carry=[".gpu-prebuilt"]); with the working tree ({tree:.1f} MiB) '
          f"{tree + size:.1f} MiB of the device call's 64 MiB")
    return 0 if tree + size < 64 else 1


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("calls", nargs="*", help=f"plan, all, or calls: {', '.join(CALLS)}")
    parser.add_argument("--dry-run", action="store_true", help="print the steps, run nothing")
    parser.add_argument("--smoke", nargs=2, metavar=("OP", "BACKEND"))
    parser.add_argument("--build-extension", action="store_true",
                        help="check's build step (on the device)")
    parser.add_argument("--python", help=f"prebuild: a Python {DEVICE_PYTHON} for .venv-gpu/")
    args = parser.parse_args(argv)
    if args.smoke:
        return smoke(*args.smoke)
    if args.build_extension:
        return build_extension()
    calls = list(CALLS) if args.calls in ([], ["all"]) else args.calls
    if calls == ["plan"]:
        plan()
        return 0
    if calls == ["prebuild"]:
        return prebuild(args.python)
    unknown = [c for c in calls if c not in CALLS]
    if unknown:
        parser.error(f"unknown call(s) {unknown}; choose from plan, all, {', '.join(CALLS)}")
    if args.dry_run:
        return dry_run(calls)
    return max(run_call(call) for call in calls)


if __name__ == "__main__":
    sys.exit(main())
