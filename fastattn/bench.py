"""Side-by-side benchmarking: the library behind ``fastattn bench`` and ``bench/``.

``compare(providers, cases)`` times every provider on every case in one process, and reports per
row: median time and spread, throughput (GB/s or TFLOP/s), the fraction of this device's measured
peak (copy bandwidth, matmul TFLOP/s — measured once per process), peak memory, the speedup over
the ``naive`` provider and over the best PyTorch peer, and the largest error against a float64
reference. A provider that cannot run a case reports why instead of stopping the run.

Timing: ``triton.testing.do_bench`` on a GPU; on a CPU, the median of repeated wall-clock runs
(after warm-up) within a time budget per measurement.
"""

from __future__ import annotations

import dataclasses
import datetime
import json
import platform
import statistics
import subprocess
import time
from typing import Any, Callable, Sequence

import torch

from fastattn.testing import max_error

# Providers whose names start with this prefix are PyTorch's own implementations (the peers).
TORCH_PREFIX = "torch"


@dataclasses.dataclass
class Case:
    """One benchmark case: ``make()`` builds the inputs, each provider is called as ``fn(*inputs)``.

    ``bytes``/``flops`` are the minimum traffic / work of the case (for GB/s, TFLOP/s);
    ``reference(*inputs)``, if given, returns the float64 result to measure errors against; for a
    backward mode ``backward`` returns the tensors whose gradients the provider must produce.
    """

    op: str
    shape: str
    dtype: torch.dtype
    mode: str
    make: Callable[[], tuple]
    bytes: int = 0
    flops: int = 0
    reference: Callable[..., Any] | None = None


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
    error: str | None = None


def _sync(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.synchronize(device)


def time_fn(fn: Callable[[], Any], device: torch.device, budget_s: float = 0.25) -> tuple[float, float, float]:
    """(median, 20th, 80th percentile) milliseconds of ``fn()`` on ``device``."""
    if device.type == "cuda":
        import triton.testing

        med, p20, p80 = triton.testing.do_bench(fn, quantiles=[0.5, 0.2, 0.8], rep=int(budget_s * 400))
        return med, p20, p80
    fn()  # warm-up (first-call allocations, lazy initialization)
    times: list[float] = []
    deadline = time.perf_counter() + budget_s
    while len(times) < 5 or (time.perf_counter() < deadline and len(times) < 200):
        start = time.perf_counter()
        fn()
        times.append((time.perf_counter() - start) * 1e3)
    q = statistics.quantiles(times, n=10)
    return statistics.median(times), q[1], q[7]


_PEAKS: dict[str, dict[str, float]] = {}


def measure_peaks(device: torch.device) -> dict[str, float]:
    """This device's copy bandwidth (GB/s, read + write) and matmul TFLOP/s, measured once."""
    key = str(device)
    if key not in _PEAKS:
        n = (256 if device.type == "cuda" else 32) * 2**20
        src = torch.empty(n, dtype=torch.float32, device=device).uniform_()
        dst = torch.empty_like(src)
        ms, _, _ = time_fn(lambda: dst.copy_(src), device)
        copy = 2 * src.numel() * 4 / ms / 1e6
        size = 8192 if device.type == "cuda" else 1024
        dtype = torch.bfloat16 if device.type == "cuda" else torch.float32
        a = torch.randn(size, size, device=device, dtype=dtype)
        b = torch.randn(size, size, device=device, dtype=dtype)
        ms, _, _ = time_fn(lambda: a @ b, device)
        _PEAKS[key] = {"copy_gbps": copy, "matmul_tflops": 2 * size**3 / ms / 1e9, "matmul_dtype": str(dtype)}
    return _PEAKS[key]


def _grads_of(out, inputs):
    leaves = [t for t in inputs if isinstance(t, torch.Tensor) and t.requires_grad]
    outs = out if isinstance(out, (tuple, list)) else (out,)
    outs = [o for o in outs if isinstance(o, torch.Tensor) and o.requires_grad]
    grads = [torch.ones_like(o) for o in outs]
    return lambda: torch.autograd.grad(outs, leaves, grads, retain_graph=True)


def run_case(case: Case, providers: dict[str, Callable], device: torch.device) -> list[Result]:
    peaks = measure_peaks(device)
    inputs = case.make()
    ref = None
    if case.reference is not None:
        ref = case.reference(*inputs)
    rows = []
    for name, fn in providers.items():
        row = Result(case.op, case.shape, str(case.dtype).replace("torch.", ""), case.mode, name)
        try:
            if device.type == "cuda":
                torch.cuda.reset_peak_memory_stats(device)
                base_mem = torch.cuda.memory_allocated(device)
            out = fn(*inputs)
            if ref is not None:
                first = out[0] if isinstance(out, (tuple, list)) else out
                row.max_error = max_error(first, ref)
            if case.mode == "fwd":
                call = lambda: fn(*inputs)  # noqa: E731
            elif case.mode == "bwd":
                call = _grads_of(out, inputs)
            else:

                def call():
                    _grads_of(fn(*inputs), inputs)()

            row.ms, row.ms_p20, row.ms_p80 = time_fn(call, device)
            if device.type == "cuda":
                row.peak_mem_mb = (torch.cuda.max_memory_allocated(device) - base_mem) / 2**20
        except Exception as exc:  # a provider that cannot run a case says why; the run goes on
            if device.type == "cuda" and isinstance(exc, torch.OutOfMemoryError):
                torch.cuda.empty_cache()
            row.error = f"{type(exc).__name__}: {str(exc).splitlines()[0][:120]}"
        if row.ms:
            if case.bytes:
                row.gbps = case.bytes / row.ms / 1e6
                row.peak_fraction = row.gbps / peaks["copy_gbps"]
            if case.flops:
                row.tflops = case.flops / row.ms / 1e9
                row.peak_fraction = row.tflops / peaks["matmul_tflops"]
        rows.append(row)
    naive = next((r.ms for r in rows if r.provider == "naive" and r.ms), None)
    peer = min((r.ms for r in rows if r.provider.startswith(TORCH_PREFIX) and r.ms), default=None)
    for r in rows:
        if r.ms and naive:
            r.speedup_vs_naive = naive / r.ms
        if r.ms and peer:
            r.speedup_vs_torch = peer / r.ms
    return rows


def compare(
    providers: dict[str, Callable],
    cases: Sequence[Case],
    *,
    device: torch.device | str | None = None,
    progress: bool = True,
) -> list[Result]:
    """Time every provider on every case; returns one :class:`Result` per (case, provider)."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    results: list[Result] = []
    bar = None
    if progress:
        try:
            from tqdm import tqdm

            bar = tqdm(total=len(cases), desc="bench", leave=False)
        except ImportError:
            pass
    for case in cases:
        results.extend(run_case(case, providers, device))
        if bar is not None:
            bar.update()
    if bar is not None:
        bar.close()
    return results


def environment(device: torch.device | str | None = None) -> dict[str, Any]:
    """Device name, versions, date and git commit, recorded with every result."""
    device = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    env: dict[str, Any] = {
        "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        "torch": torch.__version__,
        "python": platform.python_version(),
        "machine": platform.machine(),
        "threads": torch.get_num_threads(),
    }
    try:
        import triton

        env["triton"] = triton.__version__
    except ImportError:
        env["triton"] = None
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
        env["device"] = platform.processor() or _cpu_name()
    try:
        env["commit"] = subprocess.run(
            ["git", "rev-parse", "--short", "HEAD"], capture_output=True, text=True, timeout=10
        ).stdout.strip() or None
    except (OSError, subprocess.SubprocessError):
        env["commit"] = None
    env["peaks"] = measure_peaks(device)
    return env


def _cpu_name() -> str:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("model name"):
                    return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.machine()


def _fmt(v, spec: str) -> str:
    return "-" if v is None else format(v, spec)


COLUMNS = ["op", "shape", "dtype", "mode", "provider", "ms (p20-p80)", "GB/s", "TFLOP/s", "% peak",
           "x naive", "x torch", "max err"]


def table_rows(results: Sequence[Result]) -> list[list[str]]:
    rows = []
    for r in results:
        if r.error:
            rows.append([r.op, r.shape, r.dtype, r.mode, r.provider, r.error, *["-"] * 6])
            continue
        rows.append([
            r.op, r.shape, r.dtype, r.mode, r.provider,
            f"{r.ms:.3f} ({r.ms_p20:.3f}-{r.ms_p80:.3f})",
            _fmt(r.gbps, ".1f"), _fmt(r.tflops, ".2f"),
            _fmt(None if r.peak_fraction is None else 100 * r.peak_fraction, ".0f"),
            _fmt(r.speedup_vs_naive, ".2f"), _fmt(r.speedup_vs_torch, ".2f"), _fmt(r.max_error, ".1e"),
        ])
    return rows


def print_table(results: Sequence[Result], title: str = "fastattn bench") -> None:
    rows = table_rows(results)
    try:
        from rich.console import Console
        from rich.table import Table
    except ImportError:
        widths = [max(len(c), *(len(r[i]) for r in rows)) for i, c in enumerate(COLUMNS)]
        print(title)
        for line in [COLUMNS, *rows]:
            print("  ".join(cell.ljust(w) for cell, w in zip(line, widths)))
        return
    table = Table(title=title)
    for c in COLUMNS:
        table.add_column(c, justify="left" if c in ("op", "shape", "dtype", "mode", "provider") else "right")
    for r in rows:
        table.add_row(*r)
    Console().print(table)


def write_json(path: str, results: Sequence[Result], env: dict[str, Any]) -> None:
    with open(path, "w") as f:
        json.dump({"environment": env, "results": [dataclasses.asdict(r) for r in results]}, f, indent=1)
