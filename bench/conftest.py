"""pytest-benchmark suites over the cases of ``fastattn.bench.suites`` — the same cases, providers
and sizes as ``fastattn bench`` on this device.

    python -m pytest bench/ --benchmark-only                 # the device's default grid
    python -m pytest bench/ --benchmark-only --bench-quick   # fewer sizes
    python -m pytest bench/bench_attention.py --benchmark-only -k "flash or naive"

Files here are named ``bench_*.py``: this conftest collects them when bench/ (or a file in it) is
passed explicitly, so the plain ``python -m pytest`` (testpaths = tests) never runs them. Each test
is one (case, provider), timed for about ``--bench-budget`` seconds (one call per round); one
that cannot run a case is skipped with the reason. On a GPU the
timing is also taken with ``triton.testing.do_bench`` (``fastattn.bench.time_fn``) and recorded in
``extra_info`` beside throughput and the error against the float64 reference.
"""

from __future__ import annotations

import fnmatch
import os
import time

import pytest
import torch

from fastattn import bench
from fastattn.bench.suites import SUITES, Options

DEVICE = torch.device(os.environ.get("FASTATTN_BENCH_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu"))
HERE = os.path.dirname(os.path.abspath(__file__))
if DEVICE.type == "cpu":
    bench.steady_cpu_allocator()  # as fastattn bench: timings of kernels, not of page faults


def pytest_addoption(parser):
    group = parser.getgroup("fastattn bench")
    group.addoption("--bench-quick", action="store_true", help="fastattn: fewer sizes (as fastattn bench --quick)")
    group.addoption("--bench-tiny", action="store_true", help="fastattn: minimal shapes (a smoke test)")
    group.addoption("--bench-mode", default="fwd,fwd_bwd", help="fastattn: comma-separated modes (default fwd,fwd_bwd)")
    group.addoption("--bench-budget", type=float, default=0.25,
                    help="fastattn: seconds of timing per test (rounds = budget / one call, 3 to 200)")
    group.addoption("--bench-compile", action="store_true", default=None,
                    help="fastattn: include torch.compile / FlexAttention peers (default: on a GPU only)")


def pytest_collect_file(file_path, parent):
    """Collect bench_*.py in this folder when the folder is collected (not twice)."""
    if file_path.suffix != ".py" or not file_path.name.startswith("bench_"):
        return None
    if os.path.dirname(str(file_path)) != HERE:
        return None
    # pytest itself collects files named on the command line, and those python_files matches.
    if parent.session.isinitpath(file_path):
        return None
    if any(fnmatch.fnmatch(file_path.name, pat) for pat in parent.config.getini("python_files")):
        return None
    return pytest.Module.from_parent(parent, path=file_path)


def pytest_generate_tests(metafunc):
    """Parametrize ``bench_case`` with every (case, provider) of the module's ``OP`` suite."""
    if "bench_case" not in metafunc.fixturenames:
        return
    config = metafunc.config
    modes = [m for m in config.getoption("--bench-mode").split(",") if m]
    options = Options(tiny=config.getoption("--bench-tiny"), compile=config.getoption("--bench-compile"))
    providers, cases = SUITES[metafunc.module.OP](
        DEVICE, bench.default_dtype(DEVICE), modes, config.getoption("--bench-quick"), options
    )
    params = []
    for case in cases:
        for name, fn in providers.items():
            ident = f"{case.shape.replace(' ', '-')}-{case.mode}-{name}"
            params.append(pytest.param((case, name, fn), id=ident))
    metafunc.parametrize("bench_case", params)


@pytest.fixture
def run_bench(benchmark, request):
    """``run_bench(bench_case)``: time one provider on one case with pytest-benchmark."""

    def run(bench_case):
        case, name, fn = bench_case
        benchmark.group = f"{case.op} {case.shape} {str(case.dtype).replace('torch.', '')} {case.mode}"
        inputs = case.make()
        dout = None
        try:
            out = fn(*inputs)
            if case.mode != "fwd":
                dout = bench.output_grad(out, DEVICE)
                bench.timed_call("bwd", fn, inputs, out, dout)()
        except Exception as exc:
            pytest.skip(f"{name} cannot run {case.op} {case.shape} {case.mode}: {type(exc).__name__}: {str(exc).splitlines()[0][:200] if str(exc) else ''}")
        call = bench.timed_call(case.mode, fn, inputs, out, dout)
        if case.reference is not None and getattr(fn, "bench_check", True):
            ref = case.reference(*inputs)
            benchmark.extra_info["max_error"] = bench.max_error(bench._corner(bench._first(out), ref), ref)
        if DEVICE.type == "cuda":
            med, p20, p80 = bench.time_fn(call, DEVICE)
            benchmark.extra_info.update(do_bench_ms=med, do_bench_p20_ms=p20, do_bench_p80_ms=p80)

        def synced():
            call()
            if DEVICE.type == "cuda":
                torch.cuda.synchronize(DEVICE)

        # Rounds to fill the budget (one call per round), at least 3, from a timed warm-up call.
        start = time.perf_counter()
        synced()
        seconds = time.perf_counter() - start
        budget = request.config.getoption("--bench-budget")
        rounds = max(3, min(200, int(budget / max(seconds, 1e-6))))
        benchmark.pedantic(synced, rounds=rounds, warmup_rounds=1, iterations=1)
        seconds = benchmark.stats.stats.median
        if case.flops:
            benchmark.extra_info["tflops"] = case.flops / seconds / 1e12
        if case.bytes:
            benchmark.extra_info["gbps"] = case.bytes / seconds / 1e9
        benchmark.extra_info.update(provider=name, params=case.params)

    return run
