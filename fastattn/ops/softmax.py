"""Scaled masked softmax ``softmax(scale * x + mask)`` over the last dim: public function, backends.

Backend contract (``backends.register_backend("softmax", name, fn)``)::

    fn(x, mask, scale, is_causal) -> y

with x 4-D (L0, L1, Lq, Lk) with a contiguous last dim, mask None or a (L0, L1, Lq, Lk)
broadcast view (bool True = keep, or float added after scaling), causal top-left over (Lq, Lk);
fully masked rows give 0. Gradients flow through autograd.
"""

from __future__ import annotations

import math
from typing import Optional

import torch
from torch import Tensor

from fastattn import backends
from fastattn.ops._library import (
    as_float, broadcasts_to, check_like, define_op, eager_fast_path, forward_ad_needs, last_dim_contiguous,
    triton_kernels,
)

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _naive(x, mask, scale, is_causal):
    s = x.to(torch.promote_types(x.dtype, torch.float32)) * scale
    if mask is not None and mask.dtype == torch.bool:
        s = s.masked_fill(~mask, float("-inf"))
    elif mask is not None:
        s = s + mask
    if is_causal:
        lq, lk = x.shape[-2:]
        s = s.masked_fill(torch.ones(lq, lk, dtype=torch.bool, device=x.device).triu(1), float("-inf"))
    dead = torch.isneginf(s).all(-1, keepdim=True).detach()
    return torch.softmax(s.masked_fill(dead, 0.0), dim=-1).masked_fill(dead, 0.0).to(x.dtype)


def _fake_fwd(x, mask, scale, is_causal):
    return torch.empty_like(x, memory_format=torch.contiguous_format)


def _fake_bwd(dy, y, scale):
    return torch.empty_like(y, memory_format=torch.contiguous_format)


def _setup_context(ctx, inputs, output):
    ctx.save_for_backward(output)
    ctx.scale = inputs[2]
    ctx.float_mask = inputs[1] is not None and inputs[1].is_floating_point()


def _backward(ops, ctx, dy):
    if dy is None:  # (an undefined gradient: gradcheck passes one)
        return None, None, None, None
    (y,) = ctx.saved_tensors
    dy = last_dim_contiguous(dy)
    dx = ops.bwd(dy, y, ctx.scale)
    # The mask enters unscaled: its gradient is the same formula with scale 1.
    dmask = ops.bwd(dy, y, 1.0) if ctx.float_mask and ctx.needs_input_grad[1] else None
    return dx, dmask, None, None


def _triton_fwd(x: Tensor, mask: Optional[Tensor], scale: float, is_causal: bool) -> Tensor:
    _check_op(x, mask)
    return _kernels.softmax_fwd(x, mask, scale, is_causal)


def _triton_bwd(dy: Tensor, y: Tensor, scale: float) -> Tensor:
    _check_op(y, None, name="y")
    check_like(y.device, dy=(dy, y.shape, y.dtype))
    return _kernels.softmax_bwd(dy, y, scale)


_kernels = triton_kernels("softmax")
define_op("softmax", fake_fwd=_fake_fwd, fake_bwd=_fake_bwd, setup_context=_setup_context,
          backward=_backward, triton_fwd=_triton_fwd, triton_bwd=_triton_bwd, naive=_naive)


def _as_4d(t: Tensor, shape: tuple[int, ...]) -> Tensor:
    """``t`` (already of ``shape``) viewed as (L0, L1, Lq, Lk); a view whenever strides allow."""
    lead = shape[:-3] if len(shape) > 3 else ()
    full = (math.prod(lead), *([1] * (3 - len(shape))), *shape[-min(3, len(shape)):])
    return t.reshape(full)


def _check(x, mask, is_causal, name="x") -> None:
    """The argument checks, written once: run by :func:`scaled_masked_softmax` and (through
    :func:`_check_op`) by the registered Triton ops."""
    if not isinstance(x, Tensor):
        raise TypeError(f"{name} must be a Tensor, got {type(x).__name__}")
    if x.dtype not in _DTYPES:
        raise TypeError(f"{name} has dtype {x.dtype}; supported: {list(_DTYPES)}")
    if x.dim() == 0:
        raise ValueError(f"{name} must have at least one dimension")
    if is_causal and x.dim() < 2:
        raise ValueError(f"is_causal needs {name} with at least 2 dims (..., Lq, Lk), got shape {list(x.shape)}")
    if mask is None:
        return
    if not isinstance(mask, Tensor):
        raise TypeError(f"mask must be a Tensor or None, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(f"mask must be bool or floating, got {mask.dtype}")
    if mask.device != x.device:
        raise ValueError(f"mask is on {mask.device} but {name} is on {x.device}")
    shape = tuple(x.shape)
    if not broadcasts_to(mask.shape, shape):
        raise ValueError(f"mask of shape {list(mask.shape)} is not broadcastable to {name}'s shape {list(shape)}")


def _check_op(x, mask, name="x") -> None:
    """The registered Triton ops' check (callable directly through ``torch.ops``, with the backend
    contract's arguments): :func:`_check`, x 4-D (L0, L1, Lq, Lk) and the mask expanded to x's
    shape. The kernels' launchers check only their own limits."""
    _check(x, mask, False, name=name)
    if x.dim() != 4:
        raise ValueError(f"{name} must be 4-D (L0, L1, Lq, Lk), got shape {list(x.shape)}")
    if mask is not None and mask.shape != x.shape:
        raise ValueError(f"mask must have {name}'s shape {list(x.shape)} (expand it), got {list(mask.shape)}")


def scaled_masked_softmax(
    x: Tensor,
    mask: Tensor | None = None,
    scale: float = 1.0,
    is_causal: bool = False,
    *,
    backend: str | None = None,
) -> Tensor:
    """``softmax(scale * x + mask)`` over the last dim, fused in one kernel.

    ``mask`` is bool (True = keep) or float (added after scaling), broadcastable to ``x``;
    ``is_causal`` masks key ``j > i`` for query row ``i`` of the last two dims (top-left, Lq may
    differ from Lk). Any leading shape and row length; rows with nothing kept are all zeros with
    zero gradient. Statistics in float32.
    """
    if mask is None and (y := eager_fast_path("softmax", backend, x, scale, is_causal)) is not None:
        return y  # (the cpu backend's one-call path)
    _check(x, mask, is_causal)
    shape = tuple(x.shape)
    if mask is not None:
        mask = _as_4d(mask.expand(shape), shape)
    x4 = _as_4d(x, shape)
    if x4.stride(-1) != 1:
        x4 = x4.contiguous()
    _, impl = backends.select("softmax", x.device, backend, x.dtype, needs=forward_ad_needs(x4, mask))
    return impl(x4, mask, as_float("scale", scale), bool(is_causal)).view(shape)
