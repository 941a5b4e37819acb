"""Helpers to test an op against a float64 reference, with the package's tolerance policy.

Policy: an output in dtype ``d`` passes when its largest error against the float64 reference is at
most ``factor`` times the error of PyTorch's own implementation in dtype ``d`` (the *baseline*,
computed from the same inputs) plus a small absolute slack ``ATOL[d]``. Without a baseline the
allowed error is ``RTOL[d] * max|reference| + ATOL[d]``.

The extension kit (for fastattn's own ops and for users' kernels alike):

* :func:`assert_close_to_reference` — one tensor against its float64 reference;
* :func:`assert_op_matches_reference` — a whole op: forward and gradients against a float64
  reference (its backward, or finite differences of its forward), with the policy above;
* :func:`odd_shapes` — sizes that catch tail bugs (1, 17, 130; head dims 40, 80, 100);
* :func:`opcheck` — ``torch.library.opcheck`` with fastattn's defaults;
* :func:`poisoned_outputs` — NaN-fill fresh allocations, so unwritten outputs fail the NaN check;
* :func:`launching_directly` — call a Triton launcher (``fastattn.kernels``) bare, in eager mode,
  the way its registered op runs it;
* :func:`round_bf16_in_interpreter` — make the Triton CPU interpreter round float32 to bfloat16
  as the GPU does (to nearest even), not truncate.
"""

from __future__ import annotations

import contextlib
import dataclasses
import itertools
from typing import Any, Callable, Iterator, Sequence

import numpy as np
import torch

__all__ = [
    "ATOL",
    "ODD_HEAD_DIMS",
    "ODD_SIZES",
    "OPCHECK_UTILS",
    "RTOL",
    "assert_close_to_reference",
    "assert_op_matches_reference",
    "max_error",
    "odd_shapes",
    "opcheck",
    "poisoned_outputs",
    "round_bf16_in_interpreter",
    "strict_launches_in_interpreter",
    "to_numpy",
]

ATOL = {
    torch.float64: 1e-10,
    torch.float32: 2e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 2e-2,
}
RTOL = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1.6e-2,
}


def to_numpy(t) -> np.ndarray:
    """A tensor (any dtype, any device, with or without grad) or array as a float64 NumPy array."""
    if isinstance(t, torch.Tensor):
        return t.detach().to("cpu", torch.float64).numpy()
    return np.asarray(t, dtype=np.float64)


def mask_to_numpy(mask) -> np.ndarray | None:
    """An attention mask for the reference: None stays None, a float mask becomes float64 (added to
    the scores), a bool one stays bool (True = allowed; as float64 it would be added as 1.0)."""
    if mask is None:
        return None
    if isinstance(mask, torch.Tensor) and not mask.is_floating_point():
        return mask.detach().cpu().numpy()
    return to_numpy(mask)


def max_error(actual, reference) -> float:
    """The largest absolute difference between ``actual`` and ``reference`` (compared in float64;
    infinities of the same sign count as equal; 0.0 for empty inputs)."""
    a, r = to_numpy(actual), to_numpy(reference)
    if a.shape != r.shape:
        raise AssertionError(f"shape {a.shape} differs from the reference's {r.shape}")
    if a.size == 0:
        return 0.0
    same_inf = np.isinf(a) & np.isinf(r) & (np.sign(a) == np.sign(r))
    with np.errstate(invalid="ignore"):
        return float(np.max(np.where(same_inf, 0.0, np.abs(a - r))))


def assert_close_to_reference(
    actual: torch.Tensor,
    reference,
    baseline: torch.Tensor | None = None,
    *,
    factor: float = 2.0,
    atol: float | None = None,
    name: str = "output",
) -> None:
    """Assert ``actual`` is as close to the float64 ``reference`` as the policy above allows."""
    dtype = actual.dtype
    slack = ATOL.get(dtype, 1e-5) if atol is None else atol
    a = to_numpy(actual)
    if np.isnan(a).any():
        raise AssertionError(f"{name} holds NaN at {np.argwhere(np.isnan(a))[:5].tolist()}")
    err = max_error(actual, reference)
    if baseline is not None:
        allowed = factor * max_error(baseline, reference) + slack
        rule = f"{factor} x torch's error + {slack:g}"
    else:
        ref = to_numpy(reference)
        finite = np.abs(ref[np.isfinite(ref)])
        scale = float(finite.max()) if finite.size else 0.0
        allowed = RTOL.get(dtype, 1e-5) * scale + slack
        rule = f"rtol {RTOL.get(dtype, 1e-5):g} x {scale:.3g} + {slack:g}"
    if not err <= allowed:
        raise AssertionError(f"{name} ({dtype}): max error {err:.3g} > allowed {allowed:.3g} ({rule})")


@contextlib.contextmanager
def poisoned_outputs() -> Iterator[None]:
    """Fill every newly allocated uninitialized tensor with NaN (torch.empty and C++ at::empty
    alike), so a kernel that leaves part of its output unwritten fails the NaN check."""
    det, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(det, warn_only=warn)
        torch.utils.deterministic.fill_uninitialized_memory = fill


@contextlib.contextmanager
def launching_directly() -> Iterator[None]:
    """Run Triton launchers called bare (``fastattn.kernels.*``, not through their ops) as their
    registered ops run them in eager mode: ``torch.library.triton_op`` turns ``wrap_triton`` off
    there. Left on, every launch on a GPU goes through torch's higher-order op, which prunes the
    configs itself and launches a fresh Autotuner each call: the kernel's own Autotuner (its
    ``best_config``, ``prune_configs`` and ``cache``) never runs, and each call tunes again
    (found on the H100, 2026-11-26). Under the Triton interpreter it changes nothing."""
    from torch._library.triton import set_wrap_triton_enabled
    with set_wrap_triton_enabled(False):
        yield


# ---------------------------------------------------------------------------------------------
# The Triton interpreter's float32 -> bfloat16 conversion.


def _bf16_bits_rtne(x: np.ndarray) -> np.ndarray:
    """The bfloat16 bit patterns (uint16) of float32 ``x`` as torch rounds them (to nearest,
    ties to even, as the GPU's ``cvt.rn.bf16.f32``)."""
    x = torch.from_numpy(np.ascontiguousarray(x, dtype=np.float32))
    return x.to(torch.bfloat16).view(torch.int16).numpy().view(np.uint16)


def round_bf16_in_interpreter() -> bool:
    """Make ``TRITON_INTERPRET=1`` convert float32 to bfloat16 as the GPU does; returns whether
    the interpreter needed it (False: already correct, or no Triton).

    Triton's CPU interpreter (3.6 to 3.9 at least) drops the low 16 bits of a float32 cast to
    bfloat16 (``.to(tl.bfloat16)`` and every store into a bfloat16 pointer), where compiled code
    rounds to nearest even: a bias of up to a whole bfloat16 ulp, toward zero. A kernel tested
    under the interpreter then looks about twice as inaccurate as it is on a GPU (found as the
    Triton FFN's bfloat16 ``dw2``, 2.5-3.7x torch's error). This swaps the interpreter's
    conversion for a rounding one, only for float32 -> bfloat16; the test suite calls it once
    (tests/conftest.py), and tests/test_triton_rounding.py checks it against torch bit for bit.
    """
    try:
        from triton.runtime import interpreter
        import triton.language as tl
    except ImportError:
        return False
    convert = interpreter._convert_float
    if getattr(convert, "_fastattn_rtne", False):
        return True
    probe = np.array([1.0 + 2.0 ** -8 + 2.0 ** -20], dtype=np.float32)  # rounds up to 1 + 2^-7
    if convert(probe, tl.float32, tl.bfloat16, None).view(np.uint16)[0] == _bf16_bits_rtne(probe)[0]:
        return False

    nearest = (None, interpreter._ir.ROUNDING_MODE.RTNE)  # the default, and asked for by name

    def rounding_convert(input, input_dtype, output_dtype, rounding_mode):
        if input_dtype == tl.float32 and output_dtype == tl.bfloat16 and rounding_mode in nearest:
            return _bf16_bits_rtne(input).reshape(np.shape(input))
        return convert(input, input_dtype, output_dtype, rounding_mode)

    rounding_convert._fastattn_rtne = True
    interpreter._convert_float = rounding_convert
    return True


def strict_launches_in_interpreter() -> bool:
    """Make ``TRITON_INTERPRET=1`` refuse a launch keyword that is neither a parameter of the
    kernel nor a compile option, as compiled Triton does (``JITFunction.run``: "Keyword argument
    X was specified but unrecognised", a KeyError); returns whether it is in place (False: no
    Triton).

    The interpreter drops such keywords silently, so a config meant for another kernel passes
    every CPU test and fails at its first GPU launch: the float32 JVP did so on the H100 run of
    2026-11-26 (kernels.attention's configs, with a WARP_SPECIALIZE the JVP kernel lacks). The
    test suite calls this once (tests/conftest.py); tests/test_triton_rounding.py checks it.
    """
    try:
        from triton.backends.nvidia.compiler import CUDAOptions
        from triton.runtime.interpreter import InterpretedFunction
    except ImportError:
        return False
    run = InterpretedFunction.run
    if getattr(run, "_fastattn_strict", False):
        return True
    options = {f.name for f in dataclasses.fields(CUDAOptions)}

    def strict_run(self, *args, grid, warmup, **kwargs):
        unknown = sorted(k for k in kwargs if k not in self.arg_names and k not in options)
        if unknown:
            raise KeyError(f"Keyword argument(s) {unknown} of {self.fn.__name__} are neither "
                           "parameters of the kernel nor compile options: compiled Triton "
                           "refuses them")
        return run(self, *args, grid=grid, warmup=warmup, **kwargs)

    strict_run._fastattn_strict = True
    InterpretedFunction.run = strict_run
    return True


# ---------------------------------------------------------------------------------------------
# Odd shapes.

#: Sizes that are not multiples of any block or vector width: a single element, a prime, and a
#: length just past a power of two.
ODD_SIZES = (1, 17, 130)
#: Head dims that are even but not powers of two (kernels pad them to 64 / 128 / 128).
ODD_HEAD_DIMS = (40, 80, 100)


def odd_shapes(kind: str = "bhld", *, max_numel: int | None = None) -> Iterator[tuple[int, ...]]:
    """Shapes built from :data:`ODD_SIZES` and :data:`ODD_HEAD_DIMS`, deterministic, for tests.

    ``kind="bhld"`` yields attention-style ``(B, H, L, D)``: every sequence length ``L`` in
    ``ODD_SIZES`` with every head dim ``D`` in ``ODD_HEAD_DIMS`` (9 shapes), with batch and head
    counts cycling through 1, 2 and 1, 3, 2. ``kind="rows"`` yields ``(M, N)`` row matrices: every
    ``M`` in ``ODD_SIZES`` with every ``N`` in ``ODD_SIZES + ODD_HEAD_DIMS`` (18 shapes).
    ``max_numel`` drops the larger ones (e.g. for the Triton interpreter).
    """
    if kind == "bhld":
        pairs = itertools.product(ODD_SIZES, ODD_HEAD_DIMS)
        shapes = [((1, 2)[i % 2], (1, 3, 2)[i % 3], L, D) for i, (L, D) in enumerate(pairs)]
    elif kind == "rows":
        shapes = list(itertools.product(ODD_SIZES, ODD_SIZES + ODD_HEAD_DIMS))
    else:
        raise ValueError(f"kind must be 'bhld' or 'rows', got {kind!r}")
    for shape in shapes:
        n = 1
        for s in shape:
            n *= s
        if max_numel is None or n <= max_numel:
            yield tuple(shape)


# ---------------------------------------------------------------------------------------------
# A whole op against its float64 reference.


def _reference_arg(a):
    """An argument as the reference sees it: float tensors as float64 arrays, other tensors as
    arrays of their own dtype (bool masks stay bool, positions stay integers)."""
    if isinstance(a, torch.Tensor):
        if a.is_floating_point():
            return to_numpy(a)
        return a.detach().cpu().numpy()
    return a


def _as_tuple(out) -> tuple:
    return tuple(out) if isinstance(out, (tuple, list)) else (out,)


def _finite_difference_grads(ref_fn, np_args, indices, douts, max_numel, eps=1e-6):
    """Vector-Jacobian products of ``ref_fn`` by central differences in float64."""
    total = sum(np.asarray(np_args[i]).size for i in indices)
    if total > max_numel:
        raise ValueError(
            f"finite differences over {total} input elements (> {max_numel}) would be slow; "
            f"pass ref_backward, or smaller inputs"
        )

    def loss(args):
        outs = _as_tuple(ref_fn(*args))
        return sum(float(np.sum(np.asarray(o, dtype=np.float64) * d)) for o, d in zip(outs, douts) if d is not None)

    grads = []
    for i in indices:
        base = np.array(np_args[i], dtype=np.float64)
        g = np.zeros_like(base)
        args = list(np_args)
        for k in range(base.size):
            h = eps * max(1.0, abs(base.flat[k]))
            plus, minus = base.copy(), base.copy()
            plus.flat[k] += h
            minus.flat[k] -= h
            args[i] = plus
            f_plus = loss(args)
            args[i] = minus
            g.flat[k] = (f_plus - loss(args)) / (2 * h)
        grads.append(g)
    return grads


def assert_op_matches_reference(
    fn: Callable[..., Any],
    ref_fn: Callable[..., Any],
    inputs: Sequence[Any],
    *,
    dtype: torch.dtype | None = None,
    grads: bool | Sequence[int] = True,
    ref_backward: Callable[..., Any] | None = None,
    baseline: Callable[..., Any] | None = None,
    grad_outputs: Sequence[torch.Tensor | None] | None = None,
    arg_names: Sequence[str] | None = None,
    factor: float = 2.0,
    atol: float | None = None,
    seed: int = 0,
    fd_max_numel: int = 20_000,
) -> dict[str, float]:
    """Check an op's forward and gradients against its float64 reference, with the package policy.

    ``fn(*inputs)`` is the op under test and returns a tensor or a tuple of tensors (None entries
    are skipped). ``ref_fn`` takes the same arguments as NumPy float64 arrays (non-float tensors
    as arrays of their own dtype, other values unchanged) and returns the matching arrays.

    Floating-point tensor inputs are cast to ``dtype`` (when given) first; the reference sees the
    cast values, so only the op's own error is measured. ``grads`` picks the inputs whose
    gradients are checked: True for every floating-point tensor input, False for none, or a list
    of argument indices; those inputs become fresh leaves that require grad (the caller's tensors
    are left alone). Output gradients are ``grad_outputs`` or seeded standard normals.

    Reference gradients come from ``ref_backward(douts, *reference_args)`` (``douts`` a single
    array for a single output, else a tuple), returning one array per checked input in order
    (None skips one); without it, from central finite differences of ``ref_fn`` (small inputs
    only: ``fd_max_numel`` elements).

    ``baseline``, e.g. PyTorch's own implementation, is run on the same inputs in the same dtype:
    the allowed error is then ``factor`` x the baseline's error + ``ATOL[dtype]``, else
    ``RTOL[dtype] * max|reference| + ATOL[dtype]`` (see the module docstring). Returns the measured
    errors by name (``output``, ``output[1]``, ``d<arg>``) and raises AssertionError on failure.
    """
    inputs = list(inputs)
    cast = [
        a.detach().to(dtype) if dtype is not None and isinstance(a, torch.Tensor) and a.is_floating_point() else a
        for a in inputs
    ]
    floats = [i for i, a in enumerate(cast) if isinstance(a, torch.Tensor) and a.is_floating_point()]
    if grads is True:
        diff = floats
    elif grads is False:
        diff = []
    else:
        diff = [int(i) for i in grads]
        bad = [i for i in diff if i not in floats]
        if bad:
            raise ValueError(f"grads: inputs {bad} are not floating-point tensors")
    args = [a.detach().clone().requires_grad_(True) if i in diff else a for i, a in enumerate(cast)]
    names = list(arg_names) if arg_names is not None else [f"input{i}" for i in range(len(args))]
    np_args = [_reference_arg(a) for a in args]

    errors: dict[str, float] = {}
    outs = _as_tuple(fn(*args))
    refs = _as_tuple(ref_fn(*np_args))
    if len(refs) != len(outs):
        raise AssertionError(f"the op returned {len(outs)} outputs, the reference {len(refs)}")
    base_outs = _as_tuple(baseline(*args)) if baseline is not None else (None,) * len(outs)
    for k, (out, ref, base) in enumerate(zip(outs, refs, base_outs)):
        if out is None or ref is None:
            continue
        label = "output" if len(outs) == 1 else f"output[{k}]"
        assert_close_to_reference(out, ref, base, factor=factor, atol=atol, name=label)
        errors[label] = max_error(out, ref)

    if not diff:
        return errors
    live = [k for k, o in enumerate(outs) if isinstance(o, torch.Tensor) and o.requires_grad]
    if not live:
        raise AssertionError("no output requires grad: the op does not propagate gradients")
    if grad_outputs is None:
        g = torch.Generator().manual_seed(seed)
        douts = [
            torch.randn(o.shape, generator=g, dtype=torch.float64).to(o.device, o.dtype) if k in live else None
            for k, o in enumerate(outs)
        ]
    else:
        douts = list(grad_outputs)
    got = torch.autograd.grad(
        [outs[k] for k in live], [args[i] for i in diff], [douts[k] for k in live], allow_unused=True
    )
    base_grads = [None] * len(diff)
    if baseline is not None:
        blive = [k for k in live if isinstance(base_outs[k], torch.Tensor) and base_outs[k].requires_grad]
        if blive:
            base_grads = torch.autograd.grad(
                [base_outs[k] for k in blive], [args[i] for i in diff], [douts[k] for k in blive],
                allow_unused=True,
            )
    np_douts = [None if d is None else to_numpy(d) for d in douts]
    slack = atol
    if ref_backward is not None:
        ref_grads = _as_tuple(ref_backward(np_douts[0] if len(outs) == 1 else tuple(np_douts), *np_args))
    else:
        ref_grads = _finite_difference_grads(ref_fn, np_args, diff, np_douts, fd_max_numel)
    if len(ref_grads) != len(diff):
        raise AssertionError(f"the reference returned {len(ref_grads)} gradients for {len(diff)} inputs")
    for i, g_op, g_ref, g_base in zip(diff, got, ref_grads, base_grads):
        if g_ref is None:
            continue
        label = f"d{names[i]}"
        if g_op is None:
            g_op = torch.zeros_like(args[i])
        if ref_backward is None:  # finite differences are good to about 1e-7 relative
            scale = float(np.max(np.abs(g_ref))) if np.size(g_ref) else 0.0
            slack = max(ATOL.get(g_op.dtype, 1e-5) if atol is None else atol, 1e-7 * max(1.0, scale))
        assert_close_to_reference(g_op, g_ref, g_base, factor=factor, atol=slack, name=label)
        errors[label] = max_error(g_op, g_ref)
    return errors


# ---------------------------------------------------------------------------------------------
# torch.library.opcheck with fastattn's defaults.

#: What :func:`opcheck` runs by default: every test torch.library.opcheck has.
OPCHECK_UTILS = ("test_schema", "test_autograd_registration", "test_faketensor", "test_aot_dispatch_dynamic")


def _resolve_op(op):
    if isinstance(op, str):
        ns, _, name = op.rpartition("::")
        packet = getattr(getattr(torch.ops, ns or "fastattn"), name)
        return packet.default
    if isinstance(op, torch._ops.OpOverloadPacket):
        return op.default
    return op


def opcheck(
    op: Any,
    args: Sequence[Any],
    kwargs: dict[str, Any] | None = None,
    *,
    test_utils: str | Sequence[str] = OPCHECK_UTILS,
    requires_grad: bool = True,
    raise_exception: bool = True,
) -> dict[str, str]:
    """Run :func:`torch.library.opcheck` on a registered op with fastattn's defaults.

    ``op`` is an op overload or packet, a ``CustomOpDef``, or a name: ``"rope_fwd"`` (in the
    ``fastattn`` namespace) or ``"namespace::name"``. With ``requires_grad`` (the default),
    floating-point tensor arguments are replaced by copies that require grad, so the autograd
    registration test exercises the backward; turn it off for ops without autograd. All four
    tests run by default (schema, autograd registration, fake tensor, AOT dispatch with dynamic
    shapes). Returns opcheck's result dict; raises on the first failure unless
    ``raise_exception=False``.
    """
    op = _resolve_op(op)
    if requires_grad:
        args = tuple(
            a.detach().clone().requires_grad_(True) if isinstance(a, torch.Tensor) and a.is_floating_point() else a
            for a in args
        )
    return torch.library.opcheck(op, tuple(args), kwargs, test_utils=test_utils, raise_exception=raise_exception)


def symbolic_int(shape_env, value: int, name: str):
    """A SymInt of ``shape_env`` with hint ``value``, as torch.compile's dynamic shapes hand a
    launcher its sizes (``name`` distinguishes the symbols); for testing launch plans on them."""
    from torch._dynamo.source import ConstantSource

    symbol = shape_env.create_symbol(value, ConstantSource(name))
    return shape_env.create_symintnode(symbol, hint=value)
