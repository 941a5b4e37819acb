"""Registering fastattn's ops with torch.library, the one way every op is defined: :func:`define_op`.

Every compiled op has a schema (C++ ops: csrc/fastattn.cpp; Triton ops: the annotated Python
launcher, checked against the C++ schema by tests/test_schemas.py), a fake implementation (output
shapes for torch.compile / meta tensors) and an autograd formula. The C++ op
``fastattn::<kernel>_fwd`` and its Triton twin ``fastattn::triton_<kernel>_fwd`` share the schema,
so one fake function and one autograd formula serve both (and likewise ``_bwd``).
"""

from __future__ import annotations

import importlib.util
from dataclasses import dataclass
from functools import partial
from typing import Callable

import torch
import torch.autograd.forward_ad as fwAD

from fastattn import _extension, backends
from fastattn.backends import gpu_seen, interpreting


_REBUILD = "rebuild it: pip install --no-build-isolation --no-deps -e ."


@dataclass(frozen=True)
class Compiled:
    """The registered ops of one implementation (C++ or Triton) of an op: forward, backward and
    forward-mode derivative (None where the op has none)."""

    fwd: Callable
    bwd: Callable | None = None
    jvp: Callable | None = None


@dataclass(frozen=True)
class OpDef:
    """What :func:`define_op` registered for one op: its C++ and Triton ops (None where absent)
    and, per compiled backend name, the ops that backend runs (``jvp`` None where its device has
    no JVP kernel)."""

    op: str
    kernel: str
    cpp: Compiled | None
    triton: Compiled | None
    compiled: dict[str, Compiled]
    registered: dict[str, Callable]  # per compiled backend name, the function registered for it


#: Every op defined so far, by public op name (tests check the C++ and Triton schemas agree).
DEFINED: dict[str, OpDef] = {}


_TRANSFORMS_ACTIVE = getattr(torch._C, "_are_functorch_transforms_active", None)
_ANY_REQUIRES_GRAD = getattr(torch._C, "_any_requires_grad", None)
_DISPATCH_MODES = torch._C._len_torch_dispatch_stack
# The per-call tests below, bound once: every op call makes them, and a call in a model runs
# cold, where each attribute lookup through torch's module dicts is a cache miss (measured right
# after an FFN: torch.is_grad_enabled() 2.2 us, bound 0.7; torch.compiler.is_compiling() 6.2,
# bound 4.1). torch.compile recognizes these functions by identity, bound or not.
IS_COMPILING = torch.compiler.is_compiling
_GRAD_ENABLED = torch.is_grad_enabled
BELOW_AUTOGRAD = torch._C._AutoDispatchBelowAutograd


def plain_eager() -> bool:
    """Whether this call runs in plain eager mode: no torch.compile tracing, no functorch
    transform (vmap, grad, jvp), no forward-AD level and no dispatch mode (FakeTensorMode,
    make_fx and export's tracers, FlopCounterMode) around it. There a registered op may be
    called below autograd (:func:`eager_autograd`), and a Python op's own function without the
    dispatcher (:func:`op_callable`): a mode must see the op, not the kernels inside it."""
    return (_TRANSFORMS_ACTIVE is not None and not IS_COMPILING()
            and not _TRANSFORMS_ACTIVE() and fwAD._current_level < 0
            and not _DISPATCH_MODES())


class _EagerAutograd(torch.autograd.Function):
    """A registered op's own autograd formula (``setup_context`` + ``backward``, the ones given to
    torch.library) applied directly, in plain eager mode: the op runs below autograd inside it.
    Same derivative and saved tensors as torch.library's generated Function, without its per-call
    work (``fill_defaults`` over the schema, a redispatch: ~25 of the ~130 us a small CPU
    layer_norm forward+backward took). The last argument is the :class:`_Formula`; forward-style
    ``forward(ctx, ...)``, so ``apply`` binds no signature either."""

    @staticmethod
    def forward(ctx, *args):
        formula = args[-1]
        args = args[:-1]
        with BELOW_AUTOGRAD():
            output = formula.fwd(*args)
        formula.setup_context(ctx, args, output)
        ctx.formula = formula
        # Outputs that get no gradient (ffn's pre, layer_norm's statistics) reach the formula as
        # None, not as zeros allocated and filled on every backward (ffn 256x1024: ~2% of the
        # forward+backward). The formulas take None for those.
        ctx.set_materialize_grads(False)
        return output

    @staticmethod
    def backward(ctx, *grads):
        grads = ctx.formula.backward(ctx, *grads)  # needs_input_grad[i] is argument i's, as there
        return (*(grads if isinstance(grads, tuple) else (grads,)), None)


_C_APPLY = super(torch.autograd.Function, _EagerAutograd).apply  # torch's C++ Function.apply


@dataclass(frozen=True)
class _Formula:
    fwd: Callable
    setup_context: Callable
    backward: Callable


def eager_autograd(fwd: Callable, setup_context: Callable | None = None,
                   backward: Callable | None = None) -> Callable:
    """``fwd`` (a registered forward op) with a fast path in plain eager mode, where
    torch.library's autograd layer (Python, on every call) is pure cost:

    - nothing asks for a gradient: the op is called below autograd (its autograd kernel would only
      redispatch there, ~20 us a call on the CPU; torch's own layer_norm takes 8 us whole at small
      sizes);
    - a gradient is needed and the op has a formula: :class:`_EagerAutograd` applies that formula.

    Anywhere else (torch.compile, functorch transforms, forward-mode AD) the op is called as
    registered, with torch.library's autograd."""
    if _ANY_REQUIRES_GRAD is None:
        return fwd
    raw = op_callable(fwd)
    formula = _Formula(raw, setup_context, backward) if backward is not None else None

    def call(*args):
        if plain_eager():
            if not (_GRAD_ENABLED() and _ANY_REQUIRES_GRAD(*args)):
                with BELOW_AUTOGRAD():
                    return raw(*args)
            if formula is not None:  # (torch's Python apply would only forward)
                return _C_APPLY(*args, formula)
        return fwd(*args)

    call.__name__ = getattr(fwd, "__name__", "fwd")
    call.__doc__ = getattr(fwd, "__doc__", None)
    return call


def op_callable(op: Callable) -> Callable:
    """What calling ``op`` runs, for the plain-eager fast paths (below autograd, no tracing): an
    OpOverload's C++ callable (its Python ``__call__`` only forwards to it; one frame less per
    call); a Python custom op's own function when it has no per-device kernels, which is what its
    dispatcher entry would call (for the Triton ops, ``torch.library.triton_op``'s eager function,
    ``wrap_triton`` off), without the round trip through the dispatcher and its aliasing check
    (~5 us a call on the CPU here; small Triton ops are host-bound on a GPU, H100 run of
    2026-11-26); anything else itself."""
    init = getattr(op, "_init_fn", None)  # torch.library.CustomOpDef (its default kernel: key None)
    if init is not None and set(getattr(op, "_backend_fns", None) or {}) <= {None}:
        return init
    return getattr(op, "_op", op)


def eager_first(op: Callable | None) -> Callable | None:
    """``op`` (a registered backward) for the eager fast paths' formulas: where grad mode is off
    in plain eager mode (a backward pass without ``create_graph``) it is called as
    :func:`op_callable` gives it, for a Triton op its own function without the dispatcher round
    trip (~5 us a call); anywhere else (double backward, tracing, transforms) as registered."""
    raw = None if op is None else op_callable(op)
    if raw is None or raw is op:
        return op

    def call(*args):
        if not _GRAD_ENABLED() and plain_eager():
            return raw(*args)
        return op(*args)

    return call


def no_autograd(*tensors: torch.Tensor | None) -> bool:
    """Whether, in plain eager mode, nothing of ``tensors`` asks for a gradient or a tangent: a
    registered forward called with them then runs below autograd (:func:`eager_autograd`), and a
    public function needs no autograd.Function around it."""
    return (_ANY_REQUIRES_GRAD is not None and plain_eager()
            and not (_GRAD_ENABLED() and _ANY_REQUIRES_GRAD(*tensors)))


#: Whether the public functions offer calls to the extension's one-call path (eager_fast_path);
#: off only to measure what it saves (bench/call_cost.py --ab).
EAGER_FAST_PATH = True


def eager_fast_path(op: str, backend: str | None, *args):
    """The public function of ``op`` run by the extension in one call (``fastattn._C.<op>(*args)``,
    csrc/eager.cpp), or None: then the caller takes its Python path. Asked only outside
    torch.compile, for a first argument that is a CPU tensor, when no argument requires a
    gradient under grad mode (or, for the functions with a training path in the extension, in
    plain eager mode: :func:`plain_eager`), and when the backend choice for that tensor's device
    and dtype (the call's ``backend=``, then ``use_backend``, then the environment, then the
    device's best) is the cpu backend's own implementation. The C++ function checks the rest
    (plain CPU tensors, no tangent, no dispatch mode or JIT trace, valid arguments) and returns
    None where the Python path must run: that path checks the arguments and raises the errors,
    written once."""
    x = args[0]
    if (IS_COMPILING() or not EAGER_FAST_PATH or not isinstance(x, torch.Tensor)
            or backends.device_type(x.device) != "cpu"):  # (a GPU call leaves here)
        return None
    if _GRAD_ENABLED() and (_ANY_REQUIRES_GRAD is None or _ANY_REQUIRES_GRAD(*args)) and not (
            _extension.eager_trains(op) and plain_eager()):
        return None
    fast = _extension.eager_function(op)
    defined = DEFINED.get(op)
    if fast is None or defined is None:
        return None
    try:
        _, impl = backends.select(op, x.device, backend, x.dtype)
    except ValueError:  # (the Python path raises it, after the argument checks)
        return None
    return fast(*args) if impl is defined.registered.get("cpu") else None


def triton_installed() -> bool:
    return importlib.util.find_spec("triton") is not None


def triton_kernels(name: str):
    """The launcher module ``fastattn.kernels.<name>``, or None when triton is not installed."""
    return importlib.import_module(f"fastattn.kernels.{name}") if triton_installed() else None


def define_op(
    op: str,
    *,
    kernel: str | None = None,
    fake_fwd: Callable,
    fake_bwd: Callable | None = None,
    fake_jvp: Callable | None = None,
    setup_context: Callable | None = None,
    backward: Callable | None = None,
    triton_fwd: Callable | None = None,
    triton_bwd: Callable | None = None,
    triton_jvp: Callable | None = None,
    naive: Callable | None = None,
    adapt: Callable[[Callable], Callable] = lambda fwd: fwd,
    caps: dict[str, dict] | None = None,
    each_op: Callable[[Callable], None] | None = None,
) -> OpDef:
    """Register op ``op`` once for every backend.

    - C++: ``fastattn::<kernel>_fwd`` (and ``_bwd`` / ``_jvp`` when ``fake_bwd`` / ``fake_jvp``
      are given) from the extension, with the fake impls; a missing extension leaves the cpu/cuda
      backends unavailable (they say why), and an extension built before the op existed (stale)
      makes them refuse ``op`` (or its forward mode) with a rebuild hint, the same way for every op.
    - Triton (when triton is installed): the annotated launchers ``triton_fwd`` / ``_bwd`` /
      ``_jvp`` become ``fastattn::triton_<kernel>_fwd`` / ``_bwd`` / ``_jvp`` with the same fakes.
    - Autograd: ``backward(ops, ctx, *grads)`` with ``ops`` the :class:`Compiled` ops of the
      implementation being differentiated, and ``setup_context``, on each forward op.
      ``each_op(op)`` runs once for every registered op (e.g. to register a vmap rule).
    - Backends: ``naive`` (with forward-mode AD, ``"jvp"``: torch's own) and, wrapped by
      ``adapt(fwd_op)`` into the op's backend contract, the C++ op for each device it has kernels
      for and the Triton op, each declaring ``"jvp"`` when it has a JVP kernel. ``caps`` maps a
      backend name to its :class:`~fastattn.backends.Capability` keywords for this op.
    """
    kernel = kernel or op
    caps = caps or {}
    fakes = {"fwd": fake_fwd, "bwd": fake_bwd, "jvp": fake_jvp}
    cpp = _define_cpp(op, kernel, fakes)
    triton = None
    launchers = {"fwd": triton_fwd, "bwd": triton_bwd, "jvp": triton_jvp}
    if triton_fwd is not None and triton_installed():
        triton = Compiled(**{
            part: triton_op(f"triton_{kernel}_{part}", fakes[part])(fn)
            for part, fn in launchers.items() if fn is not None
        })
    for ops in (cpp, triton):
        if ops is not None and backward is not None:
            torch.library.register_autograd(ops.fwd, partial(backward, ops), setup_context=setup_context)
        if ops is not None and each_op is not None:
            for fn in (ops.fwd, ops.bwd, ops.jvp):
                if fn is not None:
                    each_op(fn)
    compiled = {}
    if cpp is not None:
        with_jvp = cpp_backends(f"{kernel}_jvp") if cpp.jvp is not None else []
        for name in cpp_backends(f"{kernel}_fwd"):
            compiled[name] = Compiled(cpp.fwd, cpp.bwd, cpp.jvp if name in with_jvp else None)
    if triton is not None:
        compiled["triton"] = triton
    if naive is not None:  # eager torch: forward-mode AD is torch's own
        backends.register_backend(op, "naive", naive, **{"features": ("jvp",), **caps.get("naive", {})})
    registered = {}
    for name, ops in compiled.items():
        jvp = ("jvp",) if ops.jvp is not None else ()
        eager_ops = Compiled(ops.fwd, eager_first(ops.bwd), ops.jvp)  # (the fast path's formulas)
        registered[name] = adapt(eager_autograd(ops.fwd, setup_context,
                                                backward and partial(backward, eager_ops)))
        backends.register_backend(op, name, registered[name], **{"features": jvp, **caps.get(name, {})})
        if fake_jvp is not None and ops.jvp is None:
            stale = name != "triton" and not hasattr(torch.ops.fastattn, f"{kernel}_jvp")
            backends.note_missing_feature(op, name, "jvp", (
                f"the loaded fastattn._C was built before fastattn::{kernel}_jvp existed; {_REBUILD}"
                if stale else f"it has no forward-mode AD (JVP) kernel for {op}"))
    DEFINED[op] = OpDef(op, kernel, cpp, triton, compiled, registered)
    return DEFINED[op]


def _define_cpp(op: str, kernel: str, fakes: dict[str, Callable | None]) -> Compiled | None:
    if not _extension.loaded():
        return None
    absent = [f"{kernel}_{part}" for part in ("fwd", "bwd") if fakes[part] is not None
              and not hasattr(torch.ops.fastattn, f"{kernel}_{part}")]
    if absent:
        for name in ("cpu", "cuda"):
            backends.note_missing(op, name, f"the loaded fastattn._C was built before fastattn::{absent[0]} existed; {_REBUILD}")
        return None
    return Compiled(**{
        part: cpp_op(f"{kernel}_{part}", fake) for part, fake in fakes.items()
        if fake is not None and hasattr(torch.ops.fastattn, f"{kernel}_{part}")
    })


def triton_op(name: str, fake: Callable) -> Callable[[Callable], Callable]:
    """Register the decorated launcher wrapper as the op ``fastattn::<name>``.

    On a GPU this is ``torch.library.triton_op``: torch.compile traces into the Triton kernels
    (launched through ``wrap_triton``) without a graph break. Under the Triton interpreter
    (TRITON_INTERPRET=1, CPU tensors) kernels cannot run on fake tensors, so the op is an opaque
    ``custom_op`` with ``fake`` as its fake implementation; behaviour in eager mode is the same.
    So it is on a machine with no CUDA GPU, where the triton backend cannot run (it says so):
    ``triton_op`` reads each launcher's source and imports torch._inductor to do it, which was
    4 of ``import fastattn``'s 7.5 s on the CPU here (torch 2.13).
    """

    def register(fn: Callable) -> Callable:
        qualname = f"fastattn::{name}"
        if interpreting() or not gpu_seen():
            op = torch.library.custom_op(qualname, fn, mutates_args=())
            op.register_fake(fake)
            return op
        return torch.library.triton_op(qualname, fn, mutates_args=())

    return register


def cpp_op(name: str, fake: Callable) -> Callable | None:
    """The C++ op ``fastattn::<name>`` with ``fake`` registered, or None without the extension."""
    if not _extension.loaded():
        return None
    torch.library.register_fake(f"fastattn::{name}", fake)
    return getattr(torch.ops.fastattn, name).default


def cpp_backends(name: str) -> list[str]:
    """The backends (``cpu``, ``cuda``) for which the extension has a kernel of ``fastattn::<name>``
    (none when the extension, e.g. one built from older sources, does not define the op)."""
    if not _extension.loaded() or not hasattr(torch.ops.fastattn, name):
        return []
    keys = (("cpu", "CPU"), ("cuda", "CUDA"))
    return [b for b, key in keys if torch._C._dispatch_has_kernel_for_dispatch_key(f"fastattn::{name}", key)]


def broadcast_shapes(*shapes) -> torch.Size:
    """``torch.broadcast_shapes``, in plain Python for int shapes: torch's costs 15-30 us a call,
    and the public functions check shapes on every call (small ops are host-bound on a GPU).
    Under torch.compile, and for symbolic sizes, torch's. RuntimeError when they do not
    broadcast."""
    if IS_COMPILING() or not all(type(n) is int for s in shapes for n in s):
        return torch.broadcast_shapes(*shapes)
    out = [1] * max((len(s) for s in shapes), default=0)
    for s in shapes:
        for i, n in enumerate(s, len(out) - len(s)):
            if n != 1:
                if out[i] not in (1, n):
                    raise RuntimeError(f"shapes {[list(t) for t in shapes]} do not broadcast")
                out[i] = n
    return torch.Size(out)


def broadcasts_to(src, dst) -> bool:
    """Whether shape ``src`` broadcasts to exactly ``dst`` (a mask to the scores, say): each of
    its trailing sizes 1 or ``dst``'s (:func:`broadcast_shapes` for symbolic sizes)."""
    if len(src) > len(dst):
        return False
    tail = dst[len(dst) - len(src):]
    if IS_COMPILING() or not all(type(n) is int for n in (*src, *tail)):
        try:
            return torch.broadcast_shapes(src, dst) == tuple(dst)
        except RuntimeError:
            return False
    return all(s == 1 or s == d for s, d in zip(src, tail))


def last_dim_contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` with stride 1 in its last dim, as kernels require. Autograd may hand backward a
    broadcast gradient (e.g. of ``y.sum()``, strides all 0); that one is materialized here."""
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


def as_float(name: str, value) -> float:
    """``value`` (a Python number, or anything ``float()`` takes but a string) as a float, or a
    TypeError naming the argument, as torch's argument parser raises for a float argument."""
    try:
        if isinstance(value, (str, bytes)):
            raise TypeError
        return float(value)
    except (TypeError, ValueError):
        raise TypeError(f"{name} must be a float, got {type(value).__name__}: {value!r}") from None


def check_like(device: torch.device, **like: tuple) -> None:
    """The registered ops' check of the tensors that only they take (gradients, saved outputs,
    statistics): each ``name=(tensor, shape, dtype)`` must be a tensor of ``shape`` on ``device``,
    of ``dtype`` (None: any dtype; the launcher says which it takes). ValueError/TypeError naming
    the argument otherwise. Shapes, dtypes and devices only: never a device-to-host sync."""
    for name, (t, shape, dtype) in like.items():
        if not isinstance(t, torch.Tensor):
            raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
        if tuple(t.shape) != tuple(shape) or t.device != device:
            raise ValueError(f"{name} must have shape {tuple(shape)} on {device}, got "
                             f"{tuple(t.shape)} on {t.device}")
        if dtype is not None and t.dtype != dtype:
            raise TypeError(f"{name} must be {dtype}, got {t.dtype}")


def empty_or_none(t: torch.Tensor) -> torch.Tensor | None:
    """Ops return empty tensors for outputs that were not asked for; autograd wants None."""
    return None if t.numel() == 0 else t


def forward_ad_needs(*tensors: torch.Tensor | None) -> tuple[str, ...]:
    """``("jvp",)`` when forward-mode AD is on for any of ``tensors`` (a dual tensor of
    torch.autograd.forward_ad, an input of torch.func.jvp / jacfwd), else ``()``: what
    ``backends.select(..., needs=...)`` is asked for, so that a backend without forward mode for
    the op is refused (named) or passed over (automatic choice). Never under torch.compile."""
    if fwAD._current_level < 0 or IS_COMPILING():
        return ()  # no dual level is open (torch.func.jvp opens one too): no tensor has a tangent
    if any(t is not None and fwAD.unpack_dual(t).tangent is not None for t in tensors):
        return ("jvp",)
    return ()
