"""LayerNorm and RMSNorm, optionally fused with a residual add: public functions and backends.

The flow, the pattern every op follows:
kernel (kernels/layer_norm.py, csrc/*/layer_norm.*) → registered op ``fastattn::layer_norm_fwd``
(C++) or ``fastattn::triton_layer_norm_fwd`` (Triton), with one fake impl and one autograd formula
for both → backend implementation ``(x, residual, normalized_shape, weight, bias, eps, rms) ->
(y, h)`` → public functions below → ``fastattn.nn.LayerNorm``.
"""

from __future__ import annotations

import math
import numbers
import operator
from typing import Optional, Sequence

import torch
from torch import Tensor

from fastattn import backends
from fastattn.ops._library import (
    check_like, define_op, eager_fast_path, empty_or_none, forward_ad_needs, last_dim_contiguous,
    triton_kernels,
)

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


# ---------------------------------------------------------------------------------------------
# Fake implementations and autograd, shared by the C++ and Triton ops (same schema).


def _fake_fwd(x, residual, weight, bias, eps, rms):
    rows = x.shape[0]
    h = torch.empty_like(x) if residual is not None else x.new_empty(0)
    mean = x.new_empty(0 if rms else rows, dtype=torch.float32)
    rstd = x.new_empty(rows, dtype=torch.float32)
    return torch.empty_like(x, memory_format=torch.contiguous_format), h, mean, rstd


def _fake_bwd(dy, dh, h, weight, mean, rstd, rms, output_mask):
    dw = weight.new_empty(weight.shape) if weight is not None and output_mask[0] else h.new_empty(0)
    want_db = weight is not None and output_mask[1] and not rms
    db = weight.new_empty(weight.shape) if want_db else h.new_empty(0)
    return torch.empty_like(h, memory_format=torch.contiguous_format), dw, db


def _setup_context(ctx, inputs, output):
    x, residual, weight, bias, _eps, rms = inputs
    _y, h, mean, rstd = output
    ctx.save_for_backward(h if residual is not None else x, weight, mean, rstd)
    ctx.rms = rms
    ctx.has_residual = residual is not None
    ctx.has_bias = bias is not None
    ctx.bias_dtype = None if bias is None else bias.dtype


def _backward(ops, ctx, dy, dh, _dmean, _drstd):
    # (restated for the cpu backend's one-call training path: csrc/eager.cpp LayerNormFn; change
    # both, tests/test_eager_fast_path.py compares their bits)
    h, weight, mean, rstd = ctx.saved_tensors
    if dy is None and dh is None:  # (the statistics get no gradient)
        return (None,) * 6
    if dy is None:
        dy = torch.zeros_like(h)
    want = [weight is not None and ctx.needs_input_grad[2], ctx.has_bias and ctx.needs_input_grad[3]]
    dy = last_dim_contiguous(dy)
    dh = last_dim_contiguous(dh) if ctx.has_residual else None
    dx, dw, db = ops.bwd(dy, dh, h, weight, mean, rstd, ctx.rms, want)
    db = empty_or_none(db)
    if db is None and ctx.has_bias and weight is None and ctx.needs_input_grad[3]:
        db = dy.sum(0, dtype=torch.float32).to(ctx.bias_dtype)  # a bias without a weight
    return dx, dx if ctx.has_residual else None, empty_or_none(dw), db, None, None


# ---------------------------------------------------------------------------------------------
# Triton launchers (schemas = the C++ ops'), the backend contract over the compiled ops, naive.


def _triton_fwd(
    x: Tensor,
    residual: Optional[Tensor],
    weight: Optional[Tensor],
    bias: Optional[Tensor],
    eps: float,
    rms: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    _check_op(x, residual, weight, bias, eps, rms)
    return _kernels.layer_norm_fwd(x, residual, weight, bias, eps, rms)


def _triton_bwd(
    dy: Tensor,
    dh: Optional[Tensor],
    h: Tensor,
    weight: Optional[Tensor],
    mean: Tensor,
    rstd: Tensor,
    rms: bool,
    output_mask: list[bool],
) -> tuple[Tensor, Tensor, Tensor]:
    _check_bwd(dy, dh, h, weight, mean, rstd, rms, output_mask)
    return _kernels.layer_norm_bwd(dy, dh, h, weight, mean, rstd, rms, output_mask)


def _rows(t: Tensor, n: int) -> Tensor:
    """``t`` as (rows, n) with a contiguous last dimension (a view whenever possible)."""
    if t.dim() != 2 or t.shape[1] != n:
        t = t.reshape(-1, n)
    return t if t.stride(-1) == 1 or n == 1 else t.contiguous()


def _flat(t: Tensor | None, n: int) -> Tensor | None:
    """A weight or bias as the contiguous (n,) vector the kernels take (None stays None)."""
    if t is None:
        return t
    t = t if t.dim() == 1 else t.reshape(n)
    return t if t.is_contiguous() else t.contiguous()


def _compiled(fwd):
    def impl(x, residual, normalized_shape, weight, bias, eps, rms):
        n = math.prod(normalized_shape)
        y, h, _mean, _rstd = fwd(
            _rows(x, n),
            None if residual is None else _rows(residual, n),
            _flat(weight, n),
            _flat(bias, n),
            eps,
            rms,
        )
        if y.shape != x.shape:  # (no view when not needed, and view_as: view(Size) costs ~3 us)
            y, h = y.view_as(x), (h.view_as(x) if residual is not None else None)
        return y, (h if residual is not None else None)

    return impl


def _naive(x, residual, normalized_shape, weight, bias, eps, rms):
    """Eager PyTorch: every intermediate materialized, statistics in float32 (float64 for float64)."""
    h = x + residual if residual is not None else x
    dims = tuple(range(-len(normalized_shape), 0))
    hf = h.to(torch.promote_types(h.dtype, torch.float32))
    if rms:
        y = hf * torch.rsqrt(hf.square().mean(dims, keepdim=True) + eps)
    else:
        centered = hf - hf.mean(dims, keepdim=True)
        y = centered * torch.rsqrt(centered.square().mean(dims, keepdim=True) + eps)
    if weight is not None:
        y = y * weight
    if bias is not None:
        y = y + bias
    return y.to(x.dtype).contiguous(), (h if residual is not None else None)  # (contiguous, as torch)


_kernels = triton_kernels("layer_norm")
define_op("layer_norm", fake_fwd=_fake_fwd, fake_bwd=_fake_bwd, setup_context=_setup_context,
          backward=_backward, triton_fwd=_triton_fwd, triton_bwd=_triton_bwd, naive=_naive,
          adapt=_compiled)


# ---------------------------------------------------------------------------------------------
# Public functions.


def _size(d) -> int:
    """One dim of normalized_shape: an int (or what indexes as one: a 0-d integer tensor, as
    torch takes), never a bool or a float. TypeError otherwise."""
    if isinstance(d, bool):
        raise TypeError(d)
    return int(d) if isinstance(d, torch.SymInt) else operator.index(d)


def _check(x, residual, normalized_shape, weight, bias, eps, rms, name="input") -> tuple[int, ...]:
    """The argument checks, written once: run by the public functions and by the registered Triton
    ops (through :func:`_check_op`). Returns normalized_shape as a tuple."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a Tensor, got {type(x).__name__}")
    if x.dtype not in _DTYPES:
        raise TypeError(f"{name} has dtype {x.dtype}; supported: {list(_DTYPES)}")
    # (isinstance against tuple first: the numbers ABCs are slow, and the modules pass tuples)
    if (not isinstance(normalized_shape, tuple) and isinstance(normalized_shape, numbers.Integral)
            and not isinstance(normalized_shape, bool)):
        normalized_shape = (int(normalized_shape),)
    try:  # (a bool is no size, as in torch)
        shape = tuple(_size(d) for d in normalized_shape)
    except TypeError:
        raise TypeError(f"normalized_shape must be an int or a sequence of ints, got {normalized_shape!r}") from None
    if len(shape) == 0 or x.dim() < len(shape) or tuple(x.shape[-len(shape):]) != shape:
        raise ValueError(
            f"normalized_shape {list(shape)} must be a non-empty suffix of {name}'s shape "
            f"{list(x.shape)}"
        )
    device = x.device
    for arg, t in (("residual", residual), ("weight", weight), ("bias", bias)):
        if t is None:
            continue
        if not isinstance(t, Tensor):
            raise TypeError(f"{arg} must be a Tensor or None, got {type(t).__name__}")
        want = tuple(x.shape) if arg == "residual" else shape
        if tuple(t.shape) != want:  # (tuples: torch.Size's != goes through SymInt-aware Python)
            raise ValueError(f"{arg} has shape {list(t.shape)}, expected {list(want)}")
        if t.device != device:
            raise ValueError(f"{arg} is on {t.device} but {name} is on {x.device}")
        if arg != "residual" and t.dtype not in (x.dtype, torch.float32):  # (as F.layer_norm)
            raise TypeError(f"{arg} has dtype {t.dtype}; it must have {name}'s dtype {x.dtype} or "
                            f"be float32")
    if weight is not None and bias is not None and weight.dtype != bias.dtype:
        raise TypeError(f"weight and bias must share a dtype, got {weight.dtype} and {bias.dtype}")
    if residual is not None and residual.dtype != x.dtype:
        raise TypeError(f"residual has dtype {residual.dtype}, {name} {x.dtype}: they must match")
    if rms and bias is not None:
        raise ValueError("bias must be None with rms=True (RMSNorm has no bias)")
    real = type(eps) is float or (isinstance(eps, numbers.Real) and not isinstance(eps, bool))
    if not real or not eps >= 0:
        raise ValueError(f"eps must be a non-negative float, got {eps!r}")
    return shape


def _check_op(x, residual, weight, bias, eps, rms, name="x") -> None:
    """The registered Triton ops' check (callable directly through ``torch.ops``; they take the
    rows as a (M, N) matrix): :func:`_check` with normalized_shape (N,). The kernels' launchers
    check only their own limits."""
    if x.dim() != 2:
        raise ValueError(f"{name} must be 2-D (rows, N), got shape {list(x.shape)}")
    _check(x, residual, x.shape[-1:], weight, bias, eps, rms, name=name)


def _check_bwd(dy, dh, h, weight, mean, rstd, rms, output_mask) -> None:
    """The registered Triton backward's check: h (M, N) and weight as in the forward, dy and dh
    (M, N) on h's device, the float32 statistics (M,) (mean only for LayerNorm)."""
    _check_op(h, None, weight, None, 0.0, rms, name="h")
    M, N = h.shape
    like = {"dy": (dy, (M, N), None), "rstd": (rstd, (M,), torch.float32)}
    if dh is not None:
        like["dh"] = (dh, (M, N), None)
    if not rms:
        like["mean"] = (mean, (M,), torch.float32)
    check_like(h.device, **like)
    if len(output_mask) != 2:
        raise ValueError(f"output_mask must be [want dweight, want dbias], got {output_mask!r}")


def _run(x, residual, normalized_shape, weight, bias, eps, rms, backend):
    if residual is None and (y := eager_fast_path(  # (the cpu backend's one-call path)
            "layer_norm", backend, x, normalized_shape, weight, bias, eps, rms)) is not None:
        return y, None
    shape = _check(x, residual, normalized_shape, weight, bias, eps, rms)
    _, impl = backends.select("layer_norm", x.device, backend, x.dtype,
                              needs=forward_ad_needs(x, residual, weight, bias))
    return impl(x, residual, shape, weight, bias, float(eps), rms)


def layer_norm(
    input: Tensor,
    normalized_shape: int | Sequence[int],
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    *,
    backend: str | None = None,
) -> Tensor:
    """Layer normalization over the last ``len(normalized_shape)`` dims.

    Same contract as :func:`torch.nn.functional.layer_norm`: ``y = (x - mean) / sqrt(var + eps)
    * weight + bias`` with the biased variance; statistics in float32 whatever the input dtype.
    """
    return _run(input, None, normalized_shape, weight, bias, eps, False, backend)[0]


def rms_norm(
    input: Tensor,
    normalized_shape: int | Sequence[int],
    weight: Tensor | None = None,
    eps: float | None = None,
    *,
    backend: str | None = None,
) -> Tensor:
    """RMS normalization, as :func:`torch.nn.functional.rms_norm`: ``x / sqrt(mean(x²) + eps) * weight``.

    ``eps=None`` means the machine epsilon of the type the norm is computed in, as PyTorch's
    kernels do: ``torch.finfo(torch.float32).eps`` for float16 / bfloat16 / float32 inputs,
    ``torch.finfo(torch.float64).eps`` for float64 (not the 16-bit type's own, 4-5 orders of
    magnitude larger).
    """
    if eps is None:
        eps = torch.finfo(torch.promote_types(input.dtype, torch.float32)).eps
    return _run(input, None, normalized_shape, weight, None, eps, True, backend)[0]


def add_layer_norm(
    input: Tensor,
    residual: Tensor,
    normalized_shape: int | Sequence[int],
    weight: Tensor | None = None,
    bias: Tensor | None = None,
    eps: float = 1e-5,
    *,
    rms: bool = False,
    backend: str | None = None,
) -> tuple[Tensor, Tensor]:
    """The pre-norm residual step in one pass: ``h = input + residual``; returns ``(norm(h), h)``.

    ``norm`` is LayerNorm, or RMSNorm with ``rms=True`` (then ``bias`` must be None and ``eps``
    is used as given). ``h`` is in the input's dtype and feeds the next residual add; gradients
    flowing into it are added to those of ``input`` and ``residual``.
    """
    if residual is None:
        raise ValueError("residual must be a Tensor; use layer_norm or rms_norm without one")
    return _run(input, residual, normalized_shape, weight, bias, eps, rms, backend)
