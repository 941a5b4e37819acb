"""Side-by-side benchmarking: the library behind ``fastattn bench`` and ``bench/``.

``compare(providers, cases)`` times every provider on every case in one process, and reports per
row: median time and spread, throughput (GB/s or TFLOP/s), the fraction of this device's measured
peak (copy bandwidth, matmul TFLOP/s in the case's dtype — measured once per process), peak memory
(GPU), the speedup over the ``naive`` provider and over the best PyTorch peer (providers named
``torch...``), and the largest error against a float64 reference computed once per case. A provider
that cannot run a case reports why instead of stopping the run.

Timing: ``triton.testing.do_bench`` on a GPU; on a CPU, the median of repeated wall-clock runs
(after a warm-up call) within a time budget per measurement.
"""

from __future__ import annotations

import contextlib
import ctypes
import dataclasses
import datetime
import functools
import json
import math
import os
import platform
import random
import statistics
import subprocess
import sys
import time
import warnings
from typing import Any, Callable, Sequence

import torch

from fastattn import _extension
from fastattn.testing import max_error, to_numpy

# Providers whose names start with this prefix are PyTorch's own implementations (the peers).
TORCH_PREFIX = "torch"
# The eager baseline every speedup is also measured against.
NAIVE = "naive"

# Seconds of timing per (case, provider) measurement, by device type.
DEFAULT_BUDGET_S = {"cuda": 0.25, "cpu": 0.12}


@dataclasses.dataclass
class Case:
    """One benchmark case: ``make()`` builds the inputs, each provider is called as ``fn(*inputs)``.

    ``bytes``/``flops`` are the minimum traffic / work of the case (for GB/s, TFLOP/s).
    ``reference(*inputs)``, if given, returns the float64 forward result (a NumPy array) to measure
    errors against — or the leading corner of it (e.g. batch 0, head 0 of a big attention), which
    is then compared with the same corner of each provider's output. In the ``bwd`` and
    ``fwd_bwd`` modes, ``grad_reference(inputs, dout)`` returns the float64 gradients of the
    inputs that require grad (in order; None to skip one) for the output gradient ``dout``.
    ``params`` names the case's knobs (e.g. ``{"L": 1024, "D": 64, "causal": True}``) and
    ``sweep`` the one plotted along the x axis.
    """

    op: str
    shape: str
    dtype: torch.dtype
    mode: str
    make: Callable[[], tuple]
    bytes: int = 0
    flops: int = 0
    reference: Callable[..., Any] | None = None
    grad_reference: Callable[..., Any] | None = None
    params: dict = dataclasses.field(default_factory=dict)
    sweep: str | None = None
    cpu_memory: bool = False  # on a CPU, also measure each provider's peak memory (one more call)


@dataclasses.dataclass
class Result:
    op: str
    shape: str
    dtype: str
    mode: str
    provider: str
    ms: float | None = None
    ms_p20: float | None = None
    ms_p80: float | None = None
    gbps: float | None = None
    tflops: float | None = None
    peak_fraction: float | None = None
    peak_mem_mb: float | None = None
    speedup_vs_naive: float | None = None
    speedup_vs_torch: float | None = None
    max_error: float | None = None
    max_grad_error: float | None = None
    error: str | None = None
    params: dict = dataclasses.field(default_factory=dict)
    sweep: str | None = None
    tuned: dict | None = None  # fastattn-triton on a GPU: {kernel: the config autotuning chose}

    @property
    def tokens_per_s(self) -> float | None:
        """Throughput in tokens (queries) per second, for cases that count tokens (``params``:
        packed sequences, decoding steps)."""
        tokens = self.params.get("tokens")
        return None if tokens is None or not self.ms else tokens / (self.ms / 1000)

    @property
    def worst_error(self) -> float | None:
        errs = [e for e in (self.max_error, self.max_grad_error) if e is not None]
        return max(errs) if errs else None


def unchecked(fn: Callable) -> Callable:
    """Mark a provider whose result is not the op's (e.g. the bare matmuls of an FFN, a floor):
    it is timed but not compared against the reference."""
    fn.bench_check = False
    return fn


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(
    fn: Callable[[], Any], device: torch.device, budget_s: float | None = None, warmup: bool = True
) -> tuple[float, float, float]:
    """(median, 20th, 80th percentile) milliseconds of ``fn()`` on ``device``; on a CPU,
    ``warmup=False`` skips the warm-up call (when the caller has just run ``fn``'s work)."""
    device = torch.device(device)
    if budget_s is None:
        budget_s = DEFAULT_BUDGET_S.get(device.type, 0.25)
    if device.type == "cuda":
        import triton.testing

        med, p20, p80 = triton.testing.do_bench(
            fn, quantiles=[0.5, 0.2, 0.8], warmup=max(1, int(budget_s * 100)), rep=max(1, int(budget_s * 400))
        )
        return med, p20, p80
    if warmup:
        fn()  # warm-up (first-call allocations, lazy initialization)
    (result,) = sample_interleaved([fn], budget_s)
    if isinstance(result, Exception):
        raise result
    return result.summary()


@dataclasses.dataclass
class Samples:
    """One call's CPU timings from :func:`sample_interleaved`: milliseconds by round."""

    by_round: dict[int, float]

    def summary(self) -> tuple[float, float, float]:
        """(median, 20th, 80th percentile) milliseconds."""
        ts = list(self.by_round.values())
        q = statistics.quantiles(ts, n=10, method="inclusive")
        return statistics.median(ts), q[1], q[7]


def paired_ratio(num: Samples | None, den: Samples | None) -> float | None:
    """The median over the rounds both calls ran of ``num``'s time / ``den``'s: a slowdown of
    the machine that lasts a round (another process, a noisy neighbour) falls on both sides of
    each ratio, where a ratio of two medians takes it whole when it hit one call's samples more
    than the other's (on this project's 2-core VM: ratios of medians moved 5-10% from run to
    run, paired ones 1-2%). None without common rounds."""
    if num is None or den is None:
        return None
    common = num.by_round.keys() & den.by_round.keys()
    return statistics.median(num.by_round[k] / den.by_round[k] for k in common) if common else None


def _fastest_peer(peers: list, samples: dict) -> Any:
    """The peer the others' speedups are taken against: the fastest, judged as the speedups are
    (paired ratios where there are samples): the one that no other beats by more. By median
    times instead, another peer could read a speedup over 1 against it (1.0146, CI 2026-11-27:
    two SDPA entries that ran the same kernel)."""
    def worst(p):
        ratios = [paired_ratio(samples.get(p.provider), samples.get(r.provider)) for r in peers]
        return max((x for x in ratios if x is not None), default=0.0)
    return min(peers, key=lambda p: (worst(p), p.ms), default=None)


def sample_interleaved(calls: Sequence[Callable[[], Any]], budget_s: float) -> list:
    """CPU timing of several calls side by side: rounds that run each call once, so that
    whatever the machine does meanwhile (another process, a thread pool still spinning after the
    previous case) falls on every call alike, not on whichever was timed first. The order is
    shuffled every round (seeded: the same for every run): a call runs slower right after a
    different one, whose code and data took the caches (measured: of two copies of one FFN
    provider in fixed order, the one after the other provider took 2-3.5% longer every time), so
    with a fixed order each call would pay for its own predecessor. Each call stays in the
    rounds until its own samples add up to ``budget_s`` with at least 5 of them (3 once they add
    up to 3x the budget), or 200. Returns each call's :class:`Samples`, or the exception it
    raised (it leaves the rounds)."""
    times: list[dict[int, float]] = [{} for _ in calls]
    results: list = [None] * len(calls)
    shuffle = random.Random(0).shuffle

    def done(ts):
        spent = sum(ts.values()) / 1e3
        return len(ts) >= 200 or (len(ts) >= 5 and spent >= budget_s) or (
            len(ts) >= 3 and spent >= 3 * budget_s)

    active = list(range(len(calls)))
    round_ = 0
    while active:
        shuffle(active)
        for i in list(active):
            start = time.perf_counter()
            try:
                calls[i]()
            except Exception as exc:  # noqa: BLE001 (reported in the provider's row)
                results[i] = exc
                active.remove(i)
                continue
            times[i][round_] = (time.perf_counter() - start) * 1e3
            if done(times[i]):
                active.remove(i)
        round_ += 1
    return [r if r is not None else Samples(ts) for r, ts in zip(results, times)]


@functools.cache
def _openblas_thread_setters() -> tuple[tuple[Callable, Callable], ...]:
    """(get, set) thread-count functions of every OpenBLAS this process has loaded (NumPy's
    wheels bundle one, with prefixed names); empty where there is none or no /proc. Looked up
    once (NumPy is loaded before the first reference runs)."""
    try:
        with open("/proc/self/maps") as maps:
            paths = sorted({line.split()[-1] for line in maps if "openblas" in line.lower()})
    except OSError:
        return ()
    found = []
    for path in paths:
        try:
            lib = ctypes.CDLL(path)
        except OSError:
            continue
        names = [(f"{p}_get_num_threads{s}", f"{p}_set_num_threads{s}")
                 for p in ("scipy_openblas", "openblas") for s in ("64_", "")]
        pairs = [(getattr(lib, g, None), getattr(lib, t, None)) for g, t in names]
        found += [pair for pair in pairs if None not in pair][:1]
    return tuple(found)


@contextlib.contextmanager
def one_blas_thread():
    """Run NumPy's BLAS (the float64 references) on the calling thread only. OpenBLAS's worker
    threads busy-wait for a while after each call; on a machine with few cores they then take
    the CPU from whatever is timed next (measured on 2 cores: an FFN timed just after a 1024^2
    float64 matmul ran at 35-74 ms instead of 19). The first provider of every case is timed
    right after its reference, so without this it alone paid for it."""
    setters = _openblas_thread_setters()
    before = [get() for get, _ in setters]
    for _, put in setters:
        put(1)
    try:
        yield
    finally:
        for (_, put), n in zip(setters, before):
            put(n)


#: glibc mallopt parameters (malloc.h) and the values :func:`steady_cpu_allocator` sets.
_M_TRIM_THRESHOLD, _M_MMAP_THRESHOLD = -1, -3
_MMAP_ABOVE, _TRIM_ABOVE = 32 * 2**20, 2**30
_CPU_MALLOC: str | None = None


def steady_cpu_allocator() -> str:
    """Keep freed tensor memory in this process (glibc malloc) so that CPU timings measure the
    kernels, not page faults: returns what the allocator now does (recorded as ``cpu_malloc``).

    torch's CPU allocator is plain ``posix_memalign``. glibc serves a large block with a fresh
    ``mmap`` (every 4 KiB page of it faults on first touch) until a block that size has been
    freed, and hands the heap's top back to the kernel past a threshold that moves with the
    calls. Which call of a case pays the faults is then a matter of that state: measured on a
    2-core VM, a 4 MiB layer_norm output cost 1.8 ms in faults against 0.2 ms of kernel, and the
    same case's ratio to torch ranged 0.2-2.1 from run to run. Fixed thresholds (mmap only above
    32 MiB, never trim below 1 GiB) let every provider reuse the heap alike; numbers of the
    first calls of a cold process are not what this measures."""
    global _CPU_MALLOC
    if _CPU_MALLOC is None:
        try:
            libc = ctypes.CDLL(None)
            mallopt = libc.mallopt
        except (OSError, AttributeError):
            _CPU_MALLOC = "default (no glibc mallopt)"
        else:
            ok = mallopt(_M_MMAP_THRESHOLD, _MMAP_ABOVE) and mallopt(_M_TRIM_THRESHOLD, _TRIM_ABOVE)
            _CPU_MALLOC = (f"glibc, mmap above {_MMAP_ABOVE >> 20} MiB, trim above {_TRIM_ABOVE >> 30} GiB"
                           if ok else "default (mallopt refused)")
    return _CPU_MALLOC


_PEAKS: dict[tuple[str, str], dict[str, Any]] = {}


def default_dtype(device: torch.device) -> torch.dtype:
    return torch.bfloat16 if torch.device(device).type == "cuda" else torch.float32


def measure_peaks(device: torch.device, dtype: torch.dtype | None = None) -> dict[str, Any]:
    """This device's copy bandwidth (GB/s, read + write) and matmul TFLOP/s in ``dtype``
    (default: bfloat16 on a GPU, float32 on a CPU), measured once per process."""
    device = torch.device(device)
    dtype = dtype or default_dtype(device)
    key = (str(device), str(dtype))
    if key not in _PEAKS:
        copy = next((p["copy_gbps"] for (dev, _), p in _PEAKS.items() if dev == str(device)), None)
        if copy is None:
            n = (256 if device.type == "cuda" else 16) * 2**20
            src = torch.empty(n, dtype=torch.float32, device=device).uniform_()
            dst = torch.empty_like(src)
            ms, _, _ = time_fn(lambda: dst.copy_(src), device, budget_s=0.1)
            copy = 2 * src.numel() * 4 / ms / 1e6
            del src, dst
        size = 8192 if device.type == "cuda" else 1024
        a = torch.randn(size, size, device=device).to(dtype)
        b = torch.randn(size, size, device=device).to(dtype)
        ms, _, _ = time_fn(lambda: a @ b, device, budget_s=0.1)
        _PEAKS[key] = {"copy_gbps": copy, "matmul_tflops": 2 * size**3 / ms / 1e9, "matmul_dtype": str(dtype).replace("torch.", "")}
    return _PEAKS[key]


def measured_peaks() -> dict[str, dict[str, Any]]:
    """Every peak measured so far in this process, keyed ``"<device> <dtype>"``."""
    return {f"{dev} {dt.replace('torch.', '')}": dict(p) for (dev, dt), p in _PEAKS.items()}


def _first(out):
    return out[0] if isinstance(out, (tuple, list)) else out


def _leaves(inputs) -> list[torch.Tensor]:
    return [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]


def _grads_of(out, inputs, dout):
    """A closure computing the gradients of the inputs that require grad, for ``out``'s first
    tensor with output gradient ``dout`` (the graph is kept, so it can be called repeatedly)."""
    leaves = _leaves(inputs)
    first = _first(out)
    return lambda: torch.autograd.grad([first], leaves, [dout], retain_graph=True, allow_unused=True)


def output_grad(out, device: torch.device) -> torch.Tensor:
    """The output gradient of a backward measurement: seeded standard normal, like ``out``'s
    first tensor (random rather than ones, which would make e.g. softmax's gradient vanish)."""
    first = _first(out)
    gen = torch.Generator().manual_seed(0)
    return torch.randn(first.shape, generator=gen).to(device=device, dtype=first.dtype)


def timed_call(mode: str, fn: Callable, inputs: tuple, out=None, dout=None) -> Callable[[], Any]:
    """What is timed in ``mode``: the forward ``fn(*inputs)``; the backward of ``out`` (an output
    of ``fn(*inputs)``, its graph kept); or a forward and its backward."""
    if mode == "fwd":
        return lambda: fn(*inputs)
    if mode == "bwd":
        return _grads_of(out, inputs, dout)
    if mode != "fwd_bwd":
        raise ValueError(f"unknown mode {mode!r}: choose from fwd, bwd, fwd_bwd")

    def both():
        _grads_of(fn(*inputs), inputs, dout)()

    return both


def _corner(t: torch.Tensor, ref) -> torch.Tensor:
    """The leading corner of ``t`` with ``ref``'s shape (all of ``t`` when the shapes match)."""
    if tuple(t.shape) == tuple(ref.shape) or t.dim() != len(ref.shape):
        return t
    return t[tuple(slice(0, n) for n in ref.shape)]


def _error_message(exc: BaseException, caught: list) -> str:
    msg = str(exc).strip().splitlines()
    text = f"{type(exc).__name__}: {msg[0][:160] if msg else ''}"
    # torch explains why a forced SDPA kernel cannot run in warnings, not in the error.
    reasons = [str(w.message).strip().splitlines()[0] for w in caught if str(w.message).strip()]
    reasons = [r for r in reasons if "not used because" in r or "kernel" in r.lower()]
    if reasons:
        text += f" ({reasons[0][:160]})"
    return text


class _ProviderError(Exception):
    """A provider's first call failed; the message is the formatted reason."""


def cpu_peak_mb(call: Callable[[], Any]) -> float:
    """Peak of the memory that ``call()`` allocates on the CPU above what is allocated before it
    (MiB), from the profiler's allocation events (every tensor allocation; not the kernels'
    small task-local buffers)."""
    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        call()
    events = sorted((e for e in prof.profiler.kineto_results.events()
                     if e.name() == "[memory]" and e.device_type() == torch.autograd.DeviceType.CPU),
                    key=lambda e: e.start_ns())
    now = peak = 0
    for e in events:
        now += e.nbytes()
        peak = max(peak, now)
    return peak / 2**20


def _chosen_configs(reset=False) -> dict:
    try:
        from fastattn.kernels import tuning
    except ImportError:  # no Triton
        return {}
    return tuning.chosen_configs(reset)


def run_case(
    case: Case, providers: dict[str, Callable], device: torch.device, budget_s: float | None = None
) -> list[Result]:
    device = torch.device(device)
    peaks = measure_peaks(device, case.dtype)
    inputs = case.make()
    ref = grad_ref = None
    dout = None
    ref_error = None
    try:
        if case.reference is not None:
            with one_blas_thread():
                ref = case.reference(*inputs)
    except Exception as exc:  # a reference that cannot run leaves the error column empty
        ref_error = exc
    rows = []
    pending = []  # CPU: (row, call) timed side by side once every provider is warm
    samples: dict[str, Samples] = {}  # CPU: each provider's times by round
    for name, fn in providers.items():
        row = Result(
            case.op, case.shape, str(case.dtype).replace("torch.", ""), case.mode, name,
            params=dict(case.params), sweep=case.sweep,
        )
        try:
            if device.type == "cuda":
                torch.cuda.empty_cache()
                torch.cuda.reset_peak_memory_stats(device)
                base_mem = torch.cuda.memory_allocated(device)
            tuned = device.type == "cuda" and name.startswith("fastattn-triton")
            if tuned:
                _chosen_configs(reset=True)
            with warnings.catch_warnings(record=True) as caught:
                warnings.simplefilter("always")
                try:
                    out = fn(*inputs)
                    if case.mode != "fwd":
                        if dout is None:
                            dout = output_grad(out, device)
                        grads = _grads_of(out, inputs, dout)()
                except Exception as exc:
                    raise _ProviderError(_error_message(exc, caught)) from exc
            check = getattr(fn, "bench_check", True)
            if check and ref is not None:
                first = _first(out)
                row.max_error = max_error(_corner(first, ref), ref)
            if check and case.mode != "fwd" and case.grad_reference is not None:
                if grad_ref is None:
                    try:
                        with one_blas_thread():
                            grad_ref = case.grad_reference(inputs, to_numpy(dout))
                    except Exception:
                        grad_ref = []
                errs = [max_error(_corner(g, r), r) for g, r in zip(grads, grad_ref) if r is not None and g is not None]
                row.max_grad_error = max(errs) if errs else None
            call = timed_call(case.mode, fn, inputs, out, dout)
            if case.mode != "bwd":
                out = None
            if device.type == "cuda":
                row.ms, row.ms_p20, row.ms_p80 = time_fn(call, device, budget_s, warmup=False)
                row.peak_mem_mb = (torch.cuda.max_memory_allocated(device) - base_mem) / 2**20
                if tuned:  # (which configs the numbers are of: the next change starts there)
                    row.tuned = _chosen_configs() or None
            else:  # the first call above (with its backward) was the warm-up
                pending.append((row, call))
        except Exception as exc:  # a provider that cannot run a case says why; the run goes on
            if isinstance(exc, _ProviderError):
                row.error = str(exc)
            else:
                row.error = _error_message(exc, [])
            if device.type == "cuda" and isinstance(exc.__cause__ or exc, torch.OutOfMemoryError):
                torch.cuda.empty_cache()
        finally:
            call = grads = out = None  # noqa: F841  (free the graph before the next provider)
        rows.append(row)
    if pending:
        budget = DEFAULT_BUDGET_S.get(device.type, 0.25) if budget_s is None else budget_s
        timings = sample_interleaved([call for _, call in pending], budget)
        for (row, call), timing in zip(pending, timings):
            if isinstance(timing, Exception):
                row.error = _error_message(timing, [])
                continue
            row.ms, row.ms_p20, row.ms_p80 = timing.summary()
            samples[row.provider] = timing
            if case.cpu_memory:
                row.peak_mem_mb = cpu_peak_mb(call)
    for row in rows:
        if row.ms:
            if case.bytes:
                row.gbps = case.bytes / row.ms / 1e6
                row.peak_fraction = row.gbps / peaks["copy_gbps"]
            if case.flops:
                row.tflops = case.flops / row.ms / 1e9
                row.peak_fraction = row.tflops / peaks["matmul_tflops"]
    if ref_error is not None and rows:
        print(f"fastattn bench: the reference of {case.op} {case.shape} {case.mode} failed: {ref_error}", file=sys.stderr)
    # Speedups: on a CPU the median of the per-round ratios (paired_ratio; every provider ran in
    # the same rounds), on a GPU (do_bench per provider) the ratio of the medians.
    naive = next((r for r in rows if r.provider == NAIVE and r.ms), None)
    peer = _fastest_peer([r for r in rows if r.provider.startswith(TORCH_PREFIX) and r.ms], samples)
    for r in rows:
        for base, field in ((naive, "speedup_vs_naive"), (peer, "speedup_vs_torch")):
            if r.ms and base is not None:
                paired = paired_ratio(samples.get(base.provider), samples.get(r.provider))
                setattr(r, field, base.ms / r.ms if paired is None else paired)
    return rows


def compare(
    providers: dict[str, Callable],
    cases: Sequence[Case],
    *,
    device: torch.device | str | None = None,
    progress: bool = True,
    budget_s: float | None = None,
    on_case: Callable[[list[Result]], None] | None = None,
) -> list[Result]:
    """Time every provider on every case; returns one :class:`Result` per (case, provider).
    ``on_case``, if given, gets the results so far after each case (``fastattn bench --json``
    writes them, so a run cut short keeps what it measured)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    results: list[Result] = []
    bar = None
    if progress and cases:
        try:
            from tqdm import tqdm

            bar = tqdm(total=len(cases), desc=f"bench {cases[0].op}", leave=False)
        except ImportError:
            pass
    for case in cases:
        results.extend(run_case(case, providers, device, budget_s))
        if on_case is not None:
            on_case(results)
        if bar is not None:
            bar.update()
    if bar is not None:
        bar.close()
    return results


def _git(*args: str) -> str | None:
    try:
        out = subprocess.run(
            ["git", *args], capture_output=True, text=True, timeout=10,
            cwd=os.path.dirname(os.path.abspath(__file__)),
        )
    except (OSError, subprocess.SubprocessError):
        return None
    return out.stdout.strip() if out.returncode == 0 else None


def environment(device: torch.device | str | None = None) -> dict[str, Any]:
    """Device name, versions, date and git commit, recorded with every result."""
    import fastattn

    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "fastattn": fastattn.__version__,
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
        "device_type": device.type,
    }
    if hasattr(os, "getloadavg"):  # other work on the machine skews CPU timings: record it
        env["loadavg"] = [round(v, 2) for v in os.getloadavg()]
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
    else:
        from fastattn.kernels.descriptors import tma_status

        env["triton_attention"] = tma_status()
        from fastattn.kernels import tuning

        env["autotune"] = tuning.AUTOTUNE  # False: each Triton kernel's first kept config
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        env.update(device=props.name, cuda=torch.version.cuda, sms=props.multi_processor_count)
        try:
            env["driver"] = subprocess.run(
                ["nvidia-smi", "--query-gpu=driver_version", "--format=csv,noheader"],
                capture_output=True, text=True, timeout=10,
            ).stdout.strip()
        except (OSError, subprocess.SubprocessError):
            env["driver"] = None
    else:
        env["device"] = _cpu_name()
        env["cpus"] = os.cpu_count()
        # the cpu backend's CPU-dependent kernel choices (its SIMD path, whose kernel runs the
        # plain attention forward, the FFN's 16-bit matmul dtype), as the extension makes them
        choices = _extension.cpu_choices() or {}
        env["cpu_isa"] = choices.pop("isa", None)
        if choices:
            env["cpu_kernels"] = choices
        # the ISA of torch's own CPU kernels (the peers'), capped by $ATEN_CPU_CAPABILITY; its
        # GEMMs' (oneDNN: bf16 / fp16 matmuls, whose bf16 dot instructions an AVX2 machine
        # lacks; MKL: float32 matmuls, and the flash attention's GEMMs, AVX-512 on an Intel CPU)
        # capped by $ONEDNN_MAX_CPU_ISA and $MKL_ENABLE_INSTRUCTIONS, recorded when set
        env["torch_cpu_isa"] = torch.backends.cpu.get_cpu_capability().lower()
        onednn = os.environ.get("ONEDNN_MAX_CPU_ISA") or os.environ.get("DNNL_MAX_CPU_ISA")
        if onednn:
            env["onednn_max_cpu_isa"] = onednn.lower()
        if os.environ.get("MKL_ENABLE_INSTRUCTIONS"):
            env["mkl_enable_instructions"] = os.environ["MKL_ENABLE_INSTRUCTIONS"].lower()
        env["cpu_malloc"] = _CPU_MALLOC or "default"
    env["commit"] = _git("rev-parse", "--short", "HEAD")
    status = _git("status", "--porcelain", "--untracked-files=no")
    env["commit_dirty"] = None if status is None else bool(status)
    env["backends"] = fastattn.available_backends()
    measure_peaks(device)
    env["peaks"] = measured_peaks()
    return env


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or platform.machine()


# ---------------------------------------------------------------------------------------------
# Output: tables, JSON, plots.


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


def _fmt_count(v: float | None) -> str:
    """A rate in at most 5 characters: 950, 12.3k, 4.56M, 1.20G."""
    if v is None:
        return "-"
    for div, unit in ((1e9, "G"), (1e6, "M"), (1e3, "k")):
        if v >= div:
            return f"{v / div:.3g}{unit}"
    return f"{v:.0f}"


def _fmt_ms(r: Result) -> str:
    return f"{r.ms:.3f} ({r.ms_p20:.3f}-{r.ms_p80:.3f})"


WIDTH = 120  # the printed tables fit in this many columns


def columns(results: Sequence[Result]) -> list[str]:
    cols = ["shape"]
    if len({r.dtype for r in results}) > 1:  # one dtype goes in the table's title instead
        cols.append("dtype")
    cols += ["mode", "provider", "ms (p20-p80)"]
    if any(r.tflops is not None for r in results):
        cols.append("TFLOP/s")
    if any(r.gbps is not None and r.tflops is None for r in results):
        cols.append("GB/s")
    cols.append("% peak")
    if any(r.tokens_per_s is not None for r in results):
        cols.append("tok/s")
    if any(r.peak_mem_mb is not None for r in results):
        cols.append("mem MB")
    return cols + ["x naive", "x torch", "max err"]


def table_rows(results: Sequence[Result], cols: Sequence[str] | None = None,
               wrong: set[int] | None = None) -> list[list[str]]:
    """One row of cells per result; ``wrong`` is :func:`wrong_results` of them when the caller
    has it already."""
    cols = list(cols or columns(results))
    wrong = wrong_results(results) if wrong is None else wrong
    rows = []
    for r in results:
        cells = {"shape": r.shape, "dtype": r.dtype, "mode": r.mode, "provider": r.provider}
        if r.error:
            cells["ms (p20-p80)"] = r.error if len(r.error) <= 64 else r.error[:61] + "..."
        else:
            cells.update({
                "ms (p20-p80)": _fmt_ms(r),
                "TFLOP/s": _fmt(r.tflops, ".3f"),
                "GB/s": _fmt(r.gbps, ".1f"),
                "% peak": _fmt(None if r.peak_fraction is None else 100 * r.peak_fraction, ".0f"),
                "tok/s": _fmt_count(r.tokens_per_s),
                "mem MB": _fmt(r.peak_mem_mb, ".0f"),
                "x naive": _fmt(r.speedup_vs_naive, ".2f"),
                "x torch": _fmt(r.speedup_vs_torch, ".2f"),
                "max err": _fmt(r.worst_error, ".1e") + (" WRONG" if id(r) in wrong else ""),
            })
        rows.append([cells.get(c, "-") for c in cols])
    return rows


def _case_key(r: Result) -> tuple:
    return (r.op, r.shape, r.dtype, r.mode)


#: A fastattn result is wrong when its largest error is over WRONG_ERROR and over WRONG_FACTOR
#: times the largest error of the other providers of its case (their rounding sets the scale).
WRONG_ERROR, WRONG_FACTOR = 5e-2, 10.0


def wrong_results(results: Sequence[Result]) -> set[int]:
    """ids of the fastattn results whose outputs or gradients are wrong (WRONG_ERROR): the table
    marks them and never counts them fastest, SUMMARY.md leaves them out of its geomeans (the
    first GPU run's autotuned D128 forward had an error of 0.25 where its peers had 7e-4)."""
    cases: dict[tuple, list[Result]] = {}
    for r in results:
        cases.setdefault(_case_key(r), []).append(r)
    wrong = set()
    for rows in cases.values():
        others = [r.worst_error for r in rows
                  if not r.provider.startswith("fastattn") and r.worst_error is not None]
        bound = max([WRONG_ERROR] + [WRONG_FACTOR * e for e in others])
        wrong |= {id(r) for r in rows if r.provider.startswith("fastattn")
                  and r.worst_error is not None and not r.worst_error <= bound}  # (NaN too)
    return wrong


def footnotes(results: Sequence[Result]) -> list[str]:
    """The providers that could not run, once each with why: ``provider, ...: error`` (with the
    number of cases when a provider failed on only some of its cases)."""
    totals: dict[str, int] = {}
    for r in results:
        totals[r.provider] = totals.get(r.provider, 0) + 1
    failed: dict[str, dict[str, int]] = {}
    for r in results:
        if r.error:
            failed.setdefault(r.error, {}).setdefault(r.provider, 0)
            failed[r.error][r.provider] += 1
    lines = []
    for error, providers in failed.items():
        names = [p if n == totals[p] else f"{p} ({n} of {totals[p]} cases)" for p, n in providers.items()]
        lines.append(f"{', '.join(names)}: {error}")
    return lines


def print_table(results: Sequence[Result], title: str = "fastattn bench") -> None:
    """One table per op, at most :data:`WIDTH` columns wide; providers of one case are grouped,
    the fastest time is highlighted. Providers that could not run are not rows: a footnote
    names each once, with the reason."""
    import textwrap

    ops = list(dict.fromkeys(r.op for r in results))
    try:
        from rich import box
        from rich.console import Console
        from rich.table import Table
        from rich.text import Text
    except ImportError:
        Console = None
    if Console is None:
        print(title)
    else:
        console = Console(width=WIDTH)
        console.print(Text(title, style="bold"))
    for op in ops:
        rs = [r for r in results if r.op == op and not r.error]
        if not rs:
            continue
        cols = columns(rs)
        wrong = wrong_results(rs)
        rows = table_rows(rs, cols, wrong)
        name = op if "dtype" in cols else f"{op} ({rs[0].dtype})"
        if Console is None:
            widths = [max(len(c), *(len(row[i]) for row in rows)) for i, c in enumerate(cols)]
            print(f"\n{name}")
            for line in [cols, *rows]:
                print(" ".join(cell.rjust(w) if c not in ("shape", "dtype", "mode", "provider") else cell.ljust(w)
                               for c, cell, w in zip(cols, line, widths)).rstrip())
            continue
        best = {}
        for r in rs:
            if r.ms and id(r) not in wrong and (_case_key(r) not in best or r.ms < best[_case_key(r)]):
                best[_case_key(r)] = r.ms
        table = Table(title=name, title_justify="left", box=box.SIMPLE_HEAD, pad_edge=False, padding=(0, 1),
                      collapse_padding=True)
        for c in cols:
            left = c in ("shape", "dtype", "mode", "provider")
            table.add_column(c, justify="left" if left else "right", overflow="fold",
                             no_wrap=c in ("shape", "provider", "dtype", "mode"))
        for i, (r, row) in enumerate(zip(rs, rows)):
            last = i + 1 == len(rs) or _case_key(rs[i + 1]) != _case_key(r)
            style = None
            if id(r) in wrong:
                style = "bold red"
            elif r.ms == best.get(_case_key(r)):
                style = "bold green"
            elif r.provider.startswith("fastattn"):
                style = "bold"
            table.add_row(*(Text(cell) for cell in row), style=style, end_section=last)
        console.print(table)
    notes = footnotes(results)
    if notes:
        print("\nnot run here:")
        for note in notes:
            print(textwrap.fill(note, WIDTH, initial_indent="  ", subsequent_indent="    "))


def to_dict(results: Sequence[Result], env: dict[str, Any]) -> dict[str, Any]:
    return {"environment": env, "results": [dataclasses.asdict(r) for r in results]}


def write_json(path: str, results: Sequence[Result], env: dict[str, Any]) -> None:
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    data = to_dict(results, env)
    with open(path, "w") as f:  # one result per line: readable, and diffs stay small
        f.write('{"environment": ' + json.dumps(data["environment"], indent=1, default=str) + ',\n "results": [\n')
        f.write(",\n".join("  " + json.dumps(row, default=str) for row in data["results"]))
        f.write("\n ]}\n")


def load_json(path: str) -> tuple[list[Result], dict[str, Any]]:
    """The results and environment of a file written by :func:`write_json`."""
    with open(path) as f:
        data = json.load(f)
    names = {f.name for f in dataclasses.fields(Result)}
    results = [Result(**{k: v for k, v in row.items() if k in names}) for row in data["results"]]
    return results, data.get("environment", {})


def _panel_key(r: Result) -> tuple:
    rest = tuple(sorted((k, v) for k, v in r.params.items() if k != r.sweep))
    return (r.op, r.dtype, r.mode, rest)


def _panel_title(key: tuple) -> str:
    op, dtype, mode, rest = key
    parts = []
    for k, v in rest:
        if isinstance(v, bool):
            parts.append(k if v else f"no {k}")
        else:
            parts.append(f"{k}={v}")
    return f"{op} {mode} {dtype}" + (f"\n{', '.join(parts)}" if parts else "")


def plot(results: Sequence[Result], path: str, title: str | None = None) -> str:
    """Throughput (TFLOP/s, or GB/s for memory-bound ops) against the swept size (sequence
    length, row length ...), one line per provider, one panel per op / mode / head dim / mask.
    Needs matplotlib; raises ImportError with an install hint without it."""
    try:
        import matplotlib

        matplotlib.use("Agg")
        import matplotlib.pyplot as plt
    except ImportError as exc:
        raise ImportError(
            "--plot needs matplotlib: pip install matplotlib (or pip install -e '.[bench]')"
        ) from exc
    panels: dict[tuple, list[Result]] = {}
    for r in results:
        if r.sweep and r.sweep in r.params and r.ms:
            panels.setdefault(_panel_key(r), []).append(r)
    if not panels:
        raise ValueError("no successful results with a swept size to plot")
    n = len(panels)
    ncols = min(4, n)
    nrows = math.ceil(n / ncols)
    fig, axes = plt.subplots(nrows, ncols, figsize=(4.6 * ncols, 3.6 * nrows), squeeze=False)
    providers = list(dict.fromkeys(r.provider for rs in panels.values() for r in rs))
    cmap = plt.get_cmap("tab10" if len(providers) <= 10 else "tab20")
    colors = {p: cmap(i % cmap.N) for i, p in enumerate(providers)}
    for ax, (key, rs) in zip(axes.flat, panels.items()):
        flops = any(r.tflops is not None for r in rs)
        for p in providers:
            pts = sorted((r.params[r.sweep], r.tflops if flops else r.gbps) for r in rs if r.provider == p)
            pts = [(x, y) for x, y in pts if y is not None]
            if not pts:
                continue
            style = "-" if p.startswith("fastattn") else ("--" if p == NAIVE else ":")
            width = 2.2 if p.startswith("fastattn") else 1.3
            ax.plot([x for x, _ in pts], [y for _, y in pts], style, marker="o", ms=3, lw=width,
                    color=colors[p], label=p)
        ax.set_xscale("log", base=2)
        ax.set_xlabel(rs[0].sweep)
        ax.set_ylabel("TFLOP/s" if flops else "GB/s")
        ax.set_title(_panel_title(key), fontsize=9)
        ax.grid(True, which="both", alpha=0.3)
        ax.legend(fontsize=6)
    for ax in list(axes.flat)[n:]:
        ax.axis("off")
    if title:
        fig.suptitle(title, fontsize=10)
    fig.tight_layout()
    directory = os.path.dirname(os.path.abspath(path))
    os.makedirs(directory, exist_ok=True)
    fig.savefig(path, dpi=110)
    plt.close(fig)
    return path
