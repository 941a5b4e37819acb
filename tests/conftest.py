"""Shared test setup: the Triton interpreter on CPU-only machines, poisoned outputs, backends."""

import contextlib
import os
import sys
import time
from pathlib import Path

# `python -m pytest` puts the repository root on sys.path, where the folder kernels/ (shipped as
# fastattn.kernels) would stand in for the PyPI package `kernels` that libraries such as
# transformers probe for. The tests use the installed package instead.
_ROOT = Path(__file__).resolve().parents[1]
sys.path[:] = [p for p in sys.path if Path(os.path.abspath(p or ".")).resolve() != _ROOT]

import torch  # noqa: E402

if not torch.cuda.is_available():
    # Must be set before triton is imported (by fastattn) for the kernels to run on CPU tensors.
    os.environ.setdefault("TRITON_INTERPRET", "1")
else:
    # The suite's many small shapes would each autotune every config (a compile apiece): run
    # the first config the pruners keep instead. Benchmarks tune fully.
    os.environ.setdefault("FASTATTN_AUTOTUNE", "0")

import pytest  # noqa: E402

import fastattn  # noqa: E402
from fastattn import backends  # noqa: E402
from fastattn.testing import (  # noqa: E402
    poisoned_outputs,
    round_bf16_in_interpreter,
    strict_launches_in_interpreter,
)

GPU = torch.cuda.is_available()
DEVICE = torch.device("cuda" if GPU else "cpu")

if not GPU:
    # The interpreter truncates float32 -> bfloat16 where the GPU rounds to nearest even, and
    # takes launch keywords the compiled kernel would refuse: hold it to the GPU's behaviour.
    round_bf16_in_interpreter()
    strict_launches_in_interpreter()


def pytest_collection_modifyitems(config, items):
    if GPU:
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


_xdist_worker = []  # [True] in an xdist worker (pytest_configure)


def pytest_configure(config):
    # (an xdist worker has config.workerinput; PYTEST_XDIST_WORKER in the environment would also
    # be inherited by a pytest run that a test starts, which is a controller of its own)
    if hasattr(config, "workerinput"):
        _xdist_worker.append(True)


def pytest_runtest_logreport(report):
    """With FASTATTN_TEST_LOG set (the GPU protocol sets it): each test's outcome and seconds as a
    line of that file the moment it ends, and a failure's text in FILE.failures, so a run that
    is killed at its time limit (no junit XML then) still tells which tests ran, failed or
    crashed their worker. Written by the controlling process only (xdist workers forward their
    reports to it)."""
    path = os.environ.get("FASTATTN_TEST_LOG")
    if not path or _xdist_worker:
        return
    if report.when == "call" or report.outcome != "passed":
        outcome = "xfailed" if hasattr(report, "wasxfail") and report.skipped else report.outcome
        with open(path, "a") as f:
            f.write(f"{report.nodeid}\t{report.when}\t{outcome}\t{report.duration:.2f}\n")
        if report.failed:
            with open(path + ".failures", "a") as f:
                f.write(f"==== {report.nodeid} ({report.when})\n{report.longreprtext[-4000:]}\n")


# CUDA errors after which the process's context is lost: every later CUDA call fails the same.
_CONTEXT_LOST = ("illegal memory access", "unspecified launch failure", "misaligned address",
                 "illegal instruction", "device-side assert")
_context_lost = []


@pytest.hookimpl(trylast=True, specname="pytest_runtest_logreport")
def pytest_runtest_logreport_ends_a_lost_worker(report):
    """On a GPU, an xdist worker whose test lost the CUDA context (an illegal address, ...) ends
    itself once that test's reports are sent, and xdist starts a fresh one: one fault costs one
    test, where it cost every later test of its worker (H100, 2026-11-27: 40 of rest-ops')."""
    if not GPU or not _xdist_worker:
        return
    if report.when == "call" and report.failed and any(
            s in report.longreprtext for s in _CONTEXT_LOST):
        _context_lost.append(report.nodeid)
    if report.when == "teardown" and _context_lost:
        print(f"\n{report.nodeid}: the CUDA context is lost; this worker ends", file=sys.stderr)
        time.sleep(1)  # (the reports reach the controller)
        os._exit(3)


@pytest.fixture(autouse=True)
def _poison():
    """Every uninitialized allocation is NaN-filled, so unwritten outputs are caught."""
    with poisoned_outputs():
        yield


@contextlib.contextmanager
def torch_threads(n: int):
    """torch's intra-op thread count set to ``n`` inside the block, restored after it."""
    old = torch.get_num_threads()
    torch.set_num_threads(n)
    try:
        yield
    finally:
        torch.set_num_threads(old)


@pytest.fixture(scope="module")
def one_thread():
    """Tiny shapes: one thread is fastest, and immune to oversubscription on a busy machine."""
    with torch_threads(1):
        yield


def refusal(op, backend, device, dtype, **facts):
    """Why ``backend`` refuses ``op`` on ``device`` in ``dtype`` (its declared capability, as
    :func:`fastattn.backends.select` applies it), or None where it takes the call."""
    try:
        backends.select(op, torch.device(device), backend, dtype, **facts)
    except ValueError as e:
        return str(e)
    return None


def skip_refused(op, backend, device, dtype, **facts):
    """Skip a test of one dtype's precision where the backend refuses that dtype (the cuda
    attention takes float16 / bfloat16 only)."""
    reason = refusal(op, backend, device, dtype, **facts)
    if reason:
        pytest.skip(reason)


def dtype_for(op, backend, device, *preferred):
    """The first dtype of ``preferred`` (default float32) that ``backend`` takes for ``op``, else
    bfloat16: a test of behaviour written in float32 runs on every backend (the cuda attention
    takes no float32). Its tolerances must follow the dtype returned."""
    for dtype in preferred or (torch.float32,):
        if refusal(op, backend, device, dtype) is None:
            return dtype
    return torch.bfloat16


def same_tol(dtype):
    """torch.testing.assert_close tolerances for two fastattn results that should agree (prefill
    against the full forward, ours against torch's module): float32's, or bfloat16's for the
    tests that :func:`dtype_for` moved to bfloat16."""
    return dict(rtol=1e-4, atol=1e-5) if dtype == torch.float32 else dict(rtol=3e-2, atol=3e-2)


def cpu_built(op: str) -> bool:
    """Whether the cpu backend implements ``op`` and is available (the extension is built)."""
    return "cpu" in backends.implementations(op) and fastattn.backend_status()["cpu"] is None


def registered_ops(op):
    """pytest params (op overload, device) for the registered compiled ops of ``op``: the C++
    ``fastattn::<op>_fwd`` when the cpu backend has it, and the Triton ``triton_<op>_fwd``."""
    triton_device = "cuda" if GPU else "cpu"
    params = []
    for name, device, backend in ((f"{op}_fwd", "cpu", "cpu"), (f"triton_{op}_fwd", triton_device, "triton")):
        overload = getattr(torch.ops.fastattn, name, None)
        if overload is not None and backend in backends.implementations(op):
            params.append(pytest.param(overload.default, device, id=name))
    return params


def backend_params(op):
    """pytest params (backend, device) for every built-in backend, skipped where it cannot run."""
    status = fastattn.backend_status()
    params = []
    for name in backends.BUILTIN:
        device = {"cpu": torch.device("cpu"), "cuda": torch.device("cuda")}.get(name, DEVICE)
        reason = status[name]
        if reason is None and name not in backends.implementations(op):
            reason = f"{name} has no {op}"
        if reason is None and device.type == "cuda" and not GPU:
            reason = "needs a CUDA GPU"
        marks = [pytest.mark.skip(reason=reason)] if reason else []
        params.append(pytest.param(name, device, id=name, marks=marks))
    return params


def graph_nodes(t):
    """The names (``Node.name()``) of the autograd nodes behind ``t``, each once."""
    seen, todo = [], [t.grad_fn]
    while todo:
        node = todo.pop()
        if node is not None and node.name() not in seen:
            seen.append(node.name())
            todo += [n for n, _ in node.next_functions]
    return seen
