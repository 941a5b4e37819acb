"""Backend registry and selection.

Every public op (``layer_norm``, ``scaled_dot_product_attention`` ...) is implemented by several
interchangeable backends behind one contract:

- ``triton``: the Triton kernels in ``fastattn.kernels`` (CUDA tensors; CPU tensors only under
  ``TRITON_INTERPRET=1``, which is slow and meant for testing);
- ``cuda``: the CUDA C++ kernels of the extension ``fastattn._C`` (CUDA tensors);
- ``cpu``: the C++ CPU kernels of ``fastattn._C`` (CPU tensors);
- ``naive``: eager PyTorch that materializes full intermediates (any device) — the baseline.

A backend is chosen per call, in this order: the call's ``backend=`` argument, the innermost
``fastattn.use_backend(...)`` context, the ``FASTATTN_BACKEND`` environment variable, then the best
available backend for the inputs' device. A backend named explicitly must be available, support the
op and the device; otherwise a ValueError says why and lists the backends that would work.

Each (op, backend) pair declares what it takes — a :class:`Capability`: dtypes, device types and
limits on the call (a head dim, say) — and :func:`select` checks the call against it before any
kernel runs: a backend named explicitly that cannot take the call raises the registry's ValueError;
the automatic choice passes over it to the next. Users add their own implementation with
:func:`register_backend`, which takes the same declaration; it is then selectable by name like the
built-in ones.
"""

from __future__ import annotations

import contextlib
import functools
import importlib.util
import logging
import os
import threading
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch

from fastattn import contracts

logger = logging.getLogger("fastattn")

BUILTIN = ("triton", "cuda", "cpu", "naive")

# Automatic choice, best first, by device type.
_PREFERENCE = {"cuda": ("triton", "cuda", "naive"), "cpu": ("cpu", "naive")}


_GPU_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_ALL_DTYPES = (*_GPU_DTYPES, torch.float64)


@dataclass(frozen=True)
class Capability:
    """What one backend's implementation of one op takes.

    ``dtypes`` / ``devices``: None means the backend's own. ``limits`` is called with the facts
    the public op passes to :func:`select` (e.g. ``head_dim=...``) and returns why the call is out
    of reach (a phrase: "head dim 300 > 256"), or None.
    """

    dtypes: tuple[torch.dtype, ...] | None = None
    devices: tuple[str, ...] | None = None
    limits: Callable[..., str | None] | None = None


_NO_CAPABILITY = Capability()  # an op the backend declares nothing about


@dataclass
class Backend:
    """A backend: which device types it runs on, why it may be unavailable, its op
    implementations and, per op, what that implementation takes."""

    name: str
    devices: tuple[str, ...]
    unavailable: Callable[[], str | None] = lambda: None
    impls: dict[str, Callable] = field(default_factory=dict)
    dtypes: tuple[torch.dtype, ...] = _ALL_DTYPES
    missing: dict[str, str] = field(default_factory=dict)
    caps: dict[str, Capability] = field(default_factory=dict)
    # op -> optional features it supports (e.g. "jvp": forward-mode AD), and why others are absent
    features: dict[str, set[str]] = field(default_factory=dict)
    missing_features: dict[tuple[str, str], str] = field(default_factory=dict)

    def lacks(self, op: str, needs: tuple[str, ...]) -> str | None:
        """Why this backend cannot give ``op`` a feature of ``needs``, or None. A backend
        registered by a user that declares nothing about a feature is trusted with it (its own
        autograd decides)."""
        for feature in needs:
            if (op, feature) in self.missing_features:
                return self.missing_features[(op, feature)]
            if self.name in BUILTIN and feature not in self.features.get(op, ()):
                what = {"jvp": "forward-mode AD (JVP)"}.get(feature, feature)
                return f"it has no {what} for {op}"
        return None

    def why_unavailable(self) -> str | None:
        """``self.unavailable()``; under torch.compile a constant read once, not traced: the
        checks import, read the environment and are cached, none of which tracing takes (an
        H100, torch 2.11, 2026-11-27: every fullgraph compile of a Triton op broke there)."""
        if torch.compiler.is_compiling() and _REGISTRY.get(self.name) is self:
            return _unavailable_constant(self.name)
        return self.unavailable()

    def refuses(
        self, op: str, device: torch.device, dtype: torch.dtype | None, facts: dict, needs: tuple[str, ...] = ()
    ) -> str | None:
        """Why this backend cannot run ``op`` on these inputs, or None when it can."""
        cap = self.caps.get(op, _NO_CAPABILITY)
        problem = self.missing.get(op) or self.why_unavailable()
        if problem is None and op not in self.impls:
            problem = f"it has no implementation of {op}"
        if problem is None and device_type(device) not in (cap.devices or self.devices):
            problem = f"it does not run on {device.type} tensors"
        if problem is None and dtype is not None and dtype not in (cap.dtypes or self.dtypes):
            problem = f"it does not take {dtype}"
        if problem is None and cap.limits is not None:
            problem = cap.limits(**facts)
        return problem or (self.lacks(op, needs) if needs else None)


def assume_constant_result(fn: Callable) -> Callable:
    """``torch.compiler.assume_constant_result``: the mark it sets, set without importing
    torch._dynamo, which that function does first (2.7 of ``import fastattn``'s 7 s on the CPU
    here, torch 2.13). tests/test_backends.py checks that torch's decorator marks a function
    this same way and no other."""
    fn._dynamo_marked_constant = True
    return fn


@assume_constant_result
def _unavailable_constant(name: str) -> str | None:
    return _REGISTRY[name].unavailable()


def interpreting() -> bool:
    """Whether Triton kernels run in the interpreter (TRITON_INTERPRET as Triton reads it), e.g.
    on a CPU machine."""
    from fastattn.kernels.tuning import interpreting as triton_interpreting
    return triton_interpreting()


@functools.cache
def gpu_seen() -> bool:
    """Whether torch sees a CUDA device, asked as ``torch.cuda.device_count`` asks: through NVML
    where it can, so that it leaves CUDA uninitialized (a process may still fork). For import
    time (which Triton ops to register); the backends' availability asks CUDA itself."""
    return torch.cuda.device_count() > 0


@functools.cache
def _triton_unavailable() -> str | None:
    if importlib.util.find_spec("triton") is None:
        return "triton is not installed"
    if not torch.cuda.is_available() and not interpreting():
        return "no CUDA GPU (set TRITON_INTERPRET=1 to run the Triton kernels on the CPU, slowly)"
    return None


@functools.cache
def _extension_unavailable() -> str | None:
    from fastattn import _extension

    return _extension.error()


@functools.cache
def _cuda_unavailable() -> str | None:
    reason = _extension_unavailable()
    if reason:
        return reason
    if not torch._C._dispatch_has_kernel_for_dispatch_key("fastattn::layer_norm_fwd", "CUDA"):
        return "fastattn._C was built without CUDA kernels (torch without CUDA, or no nvcc)"
    if not torch.cuda.is_available():
        return "no CUDA GPU"
    return None


_REGISTRY: dict[str, Backend] = {
    "triton": Backend("triton", ("cuda", "cpu"), _triton_unavailable, dtypes=_GPU_DTYPES),
    "cuda": Backend("cuda", ("cuda",), _cuda_unavailable, dtypes=_GPU_DTYPES),
    "cpu": Backend("cpu", ("cpu",), _extension_unavailable),
    "naive": Backend("naive", ("cuda", "cpu", "mps", "xpu", "meta")),
}

class _Local(threading.local):
    """Per thread: the stack of use_backend names. Set up on each thread's first access, so that
    reading it never misses: getattr(threading.local(), "stack", None) raised and caught an
    AttributeError on every call outside use_backend (2.6 us of select's 7)."""

    def __init__(self) -> None:
        self.stack: list[str] = []


_local = _Local()
# (backend asked for or None, op, device, dtype, needs) -> (name, backend, implementation,
# limits) chosen by select; emptied whenever the registry changes.
_CHOSEN: dict[tuple, tuple[str, Backend, Callable, Callable | None]] = {}
_logged_fallbacks: set[tuple[str, str, str]] = set()


def register_backend(
    op: str,
    name: str,
    fn: Callable,
    *,
    devices: tuple[str, ...] | None = None,
    dtypes: tuple[torch.dtype, ...] | None = None,
    limits: Callable[..., str | None] | None = None,
    features: tuple[str, ...] = (),
) -> None:
    """Make ``fn`` the implementation of ``op`` for backend ``name``.

    ``fn`` follows the op's backend contract: the typed signature in :mod:`fastattn.contracts`
    (checked here: a function that cannot be called that way is a TypeError now, not at its first
    call) and the shapes in the docstring of the op's module, e.g. :mod:`fastattn.ops.softmax`. A new backend name is created on first
    registration, usable on ``devices`` (default cuda and cpu). ``devices``, ``dtypes`` and
    ``limits`` declare what this implementation takes (see :class:`Capability`); left None they
    are the backend's own. :func:`select` refuses a call outside them before ``fn`` is called.
    ``features`` names the optional features ``fn`` supports (``"jvp"``: forward-mode AD).
    """
    _CHOSEN.clear()
    if not callable(fn):
        raise TypeError(f"the implementation of {op!r} for backend {name!r} must be callable, got {type(fn).__name__}")
    why = contracts.mismatch(op, fn)
    if why is not None:
        raise TypeError(f"the implementation of {op!r} for backend {name!r} does not fit the op's contract: {why}")
    backend = _REGISTRY.setdefault(name, Backend(name, tuple(devices or ("cuda", "cpu"))))
    backend.impls[op] = fn
    backend.caps[op] = Capability(
        tuple(dtypes) if dtypes is not None else None, tuple(devices) if devices is not None else None, limits
    )
    for feature in features:
        register_feature(op, name, feature)


def register_feature(op: str, name: str, feature: str) -> None:
    """Declare that backend ``name``'s ``op`` supports ``feature`` (e.g. ``"jvp"``, forward-mode
    AD), which :func:`select` may be asked for."""
    _CHOSEN.clear()
    _REGISTRY[name].features.setdefault(op, set()).add(feature)


def note_missing_feature(op: str, name: str, feature: str, reason: str) -> None:
    """Record why backend ``name``'s ``op`` lacks ``feature``, for the error of :func:`select`."""
    _CHOSEN.clear()
    _REGISTRY[name].missing_features[(op, feature)] = reason


def capability(op: str, name: str) -> Capability:
    """What backend ``name`` declared it takes for ``op``."""
    return _check_name(name).caps.get(op, Capability())


def note_missing(op: str, name: str, reason: str) -> None:
    """Record why backend ``name`` does not implement ``op`` (e.g. "not implemented on cuda yet"),
    so that asking for it explicitly says so."""
    _CHOSEN.clear()
    _REGISTRY[name].missing[op] = reason


def implementations(op: str) -> list[str]:
    """Names of the backends (available here or not) that implement ``op``."""
    return [name for name, b in _REGISTRY.items() if op in b.impls]


def backend_status() -> dict[str, str | None]:
    """Each backend's name mapped to None when usable here, else the reason it is not."""
    return {name: b.unavailable() for name, b in _REGISTRY.items()}


def available_backends() -> list[str]:
    """Names of the backends usable on this machine."""
    return [name for name, reason in backend_status().items() if reason is None]


@contextlib.contextmanager
def use_backend(name: str) -> Iterator[None]:
    """Within the block, ops without an explicit ``backend=`` use backend ``name``."""
    _check_name(name)
    stack = _local.stack
    stack.append(name)
    try:
        yield
    finally:
        stack.pop()


def _check_name(name: str) -> Backend:
    backend = _REGISTRY.get(name)
    if backend is None:
        raise ValueError(
            f"unknown backend {name!r}; available backends: {available_backends()} "
            f"(all known: {sorted(_REGISTRY)})"
        )
    return backend


# os.environ.get encodes the key and raises and catches two KeyErrors when the variable is unset:
# ~17 us a call when it runs cold, as every op call in a model does. The dict behind os.environ
# (CPython keeps it in sync with every change made through os.environ) answers in one lookup.
_ENV_DATA = getattr(os.environ, "_data", None)
_ENV_KEY = os.environ.encodekey("FASTATTN_BACKEND") if hasattr(os.environ, "encodekey") else None


def _environment_backend() -> str | None:
    if _ENV_DATA is None or _ENV_KEY is None:
        return os.environ.get("FASTATTN_BACKEND")
    raw = _ENV_DATA.get(_ENV_KEY)
    return None if raw is None else os.environ.decodevalue(raw)


def _requested() -> tuple[str | None, str]:
    stack = _local.stack
    if stack:
        return stack[-1], "fastattn.use_backend"
    env = _environment_backend()
    if env:
        return env, "FASTATTN_BACKEND"
    return None, ""


_DEVICE_TYPES: dict[torch.device, str] = {}


def device_type(device: torch.device) -> str:
    """``device.type``, remembered per device: torch builds that string anew on every access
    (~10 us when the call runs cold)."""
    kind = _DEVICE_TYPES.get(device)
    if kind is None:
        kind = _DEVICE_TYPES[device] = device.type
    return kind


def select(
    op: str,
    device: torch.device,
    backend: str | None = None,
    dtype: torch.dtype | None = None,
    needs: tuple[str, ...] = (),
    **facts,
) -> tuple[str, Callable]:
    """The backend name and implementation of ``op`` for inputs on ``device`` of ``dtype``.

    ``needs`` names optional features the call needs (``"jvp"`` under forward-mode AD).
    ``facts`` describe the call for the backends' declared limits (e.g. ``head_dim=``). A
    backend named explicitly (argument, context, environment) that cannot take the call raises
    ValueError naming the reason and the backends that can. The automatic choice passes over
    backends that cannot (float64 on the GPU backends goes to ``naive``), logging that once at
    debug level.
    """
    name, source = (backend, "backend=") if backend is not None else _requested()
    # A choice already made for this kind of call (same backend asked for, op, device, dtype and
    # features) holds while the backend's declared limits take the call's facts. (Checked against
    # the registry too, which tests edit by hand.)
    key = (name, op, device, dtype, needs)
    known = _CHOSEN.get(key)
    if (known is not None and _REGISTRY.get(known[0]) is known[1] and known[1].impls.get(op) is known[2]
            and (known[3] is None or known[3](**facts) is None)):
        return known[0], known[2]
    if name is not None:
        b = _check_name(name)
        problem = b.refuses(op, device, dtype, facts, needs)
        if problem:
            usable = [n for n, c in _REGISTRY.items() if n != name and c.refuses(op, device, dtype, facts, needs) is None]
            raise ValueError(
                f"backend {name!r} (from {source}) cannot run {op}: {problem}; "
                f"backends that can: {usable}"
            )
        _CHOSEN[key] = _choice(name, b, op)
        return name, b.impls[op]
    best = None
    for name in _PREFERENCE.get(device_type(device), ("naive",)):
        b = _REGISTRY[name]
        if b.why_unavailable() is None and op in b.impls and op not in b.missing:
            best = best or name
            problem = b.refuses(op, device, dtype, facts, needs)
            if problem is None:
                if name != best:
                    log_fallback_once(op, best, name, f"{best} cannot: {_REGISTRY[best].refuses(op, device, dtype, facts, needs)}")
                else:  # (a fallback is not remembered: the best may take the next call)
                    _CHOSEN[key] = _choice(name, b, op)
                return name, b.impls[op]
    raise ValueError(f"no backend can run {op} on {device.type} tensors")


def _choice(name: str, b: Backend, op: str) -> tuple[str, Backend, Callable, Callable | None]:
    """What select remembers of a choice (see _CHOSEN)."""
    return name, b, b.impls[op], b.caps.get(op, _NO_CAPABILITY).limits


def log_fallback_once(op: str, src: str, dst: str, reason: str) -> None:
    """Log at debug level, once per (op, from, to), that a case was handed to another backend."""
    key = (op, src, dst)
    if key not in _logged_fallbacks:
        _logged_fallbacks.add(key)
        logger.debug("fastattn: %s on backend %r runs on %r instead: %s", op, src, dst, reason)
