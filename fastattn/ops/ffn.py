"""The feed-forward network ``act(x @ w1^T + b1) @ w2^T + b2``: public function and backends.

Backend contract (``backends.register_backend("ffn", name, fn)``)::

    fn(x, w1, b1, w2, b2, activation) -> out

with x 2-D (M, D) contiguous, weights in nn.Linear layout (w1 (F, D), or (2F, D) for the gated
activations whose first-layer output splits into [gate, up]; w2 (D2, F)), biases optional.
Gradients flow through autograd; compiled backends keep the pre-activation and recompute the
activation in backward.
"""

from __future__ import annotations

import functools
from typing import Optional

import torch
import torch.nn.functional as F
from torch import Tensor

from fastattn import activations as act
from fastattn import backends
from fastattn.activations import ACTIVATIONS, GATED
from fastattn.ops._library import (
    check_like, define_op, eager_fast_path, empty_or_none, forward_ad_needs, triton_kernels,
)

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


#: The elementwise function of each activation code (fastattn/activations.py), in eager PyTorch.
_FUNCTIONS = {
    act.GELU: F.gelu,
    act.GELU_TANH: functools.partial(F.gelu, approximate="tanh"),
    act.RELU: F.relu,
    act.SILU: F.silu,
}


def activate(name: str, h: Tensor) -> Tensor:
    """The activation ``name`` applied to the first layer's output ``h`` (eager PyTorch)."""
    a = act.lookup(name)
    if a.gated:
        gate, up = h.chunk(2, dim=-1)
        return _FUNCTIONS[a.code](gate) * up
    return _FUNCTIONS[a.code](h)


def _naive(x, w1, b1, w2, b2, activation):
    return F.linear(activate(activation, F.linear(x, w1, b1)), w2, b2)


def _fake_fwd(x, w1, b1, w2, b2, activation):
    return x.new_empty(x.shape[0], w2.shape[0]), x.new_empty(x.shape[0], w1.shape[0])


def _fake_bwd(dout, x, w1, w2, pre, activation, output_mask):
    db1 = w1.new_empty(w1.shape[0]) if output_mask[0] else w1.new_empty(0)
    db2 = w2.new_empty(w2.shape[0]) if output_mask[1] else w2.new_empty(0)
    return torch.empty_like(x), torch.empty_like(w1), db1, torch.empty_like(w2), db2


def _setup_context(ctx, inputs, output):
    x, w1, b1, w2, b2, activation = inputs
    ctx.save_for_backward(x, w1, w2, output[1])
    ctx.activation = activation
    ctx.has_bias = (b1 is not None, b2 is not None)


def _backward(ops, ctx, dout, _dpre):
    # (restated for the cpu backend's one-call training path: csrc/eager.cpp FfnFn; change both,
    # tests/test_eager_fast_path.py compares their bits)
    if dout is None:  # (pre, an internal output, gets no gradient; or an undefined one)
        return (None,) * 6
    x, w1, w2, pre = ctx.saved_tensors
    want = [ctx.has_bias[0] and ctx.needs_input_grad[2], ctx.has_bias[1] and ctx.needs_input_grad[4]]
    dx, dw1, db1, dw2, db2 = ops.bwd(dout.contiguous(), x, w1, w2, pre, ctx.activation, want)
    return dx, dw1, empty_or_none(db1), dw2, empty_or_none(db2), None


def _triton_fwd(
    x: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor, b2: Optional[Tensor], activation: str
) -> tuple[Tensor, Tensor]:
    _check_op(x, w1, b1, w2, b2, activation)
    return _kernels.ffn_fwd(x, w1, b1, w2, b2, activation)


def _triton_bwd(
    dout: Tensor, x: Tensor, w1: Tensor, w2: Tensor, pre: Tensor, activation: str, output_mask: list[bool]
) -> tuple[Tensor, Tensor, Tensor, Tensor, Tensor]:
    _check_op(x, w1, None, w2, None, activation)
    check_like(x.device, dout=(dout, (x.shape[0], w2.shape[0]), x.dtype),
               pre=(pre, (x.shape[0], w1.shape[0]), x.dtype))
    if len(output_mask) != 2:
        raise ValueError(f"output_mask must have 2 entries [db1, db2], got {list(output_mask)}")
    return _kernels.ffn_bwd(dout, x, w1, w2, pre, activation, output_mask)


def _compiled(fwd):
    def impl(x, w1, b1, w2, b2, activation):
        return fwd(x, w1, b1, w2, b2, activation)[0]

    return impl


_kernels = triton_kernels("ffn")
define_op("ffn", fake_fwd=_fake_fwd, fake_bwd=_fake_bwd, setup_context=_setup_context,
          backward=_backward, triton_fwd=_triton_fwd, triton_bwd=_triton_bwd, naive=_naive,
          adapt=_compiled)


def _check(x, w1, b1, w2, b2, activation) -> None:
    """The argument checks, written once: run by :func:`ffn` and (through :func:`_check_op`) by
    the registered Triton ops."""
    if activation not in ACTIVATIONS:
        raise ValueError(f"unknown activation {activation!r}; choose from {list(ACTIVATIONS)}")
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a Tensor, got {type(x).__name__}")
    dtype, device = x.dtype, x.device
    for name, t in (("x", x), ("w1", w1), ("w2", w2), ("b1", b1), ("b2", b2)):
        if t is None and name in ("b1", "b2"):
            continue
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
        if t.dtype != dtype or dtype not in _DTYPES:
            raise TypeError(f"{name} has dtype {t.dtype}; all tensors must share one of {list(_DTYPES)}")
        if t is not x and t.device != device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
    if x.dim() < 1 or w1.dim() != 2 or w2.dim() != 2:
        raise ValueError(f"expected x (..., D), w1 2-D, w2 2-D; got {list(x.shape)}, {list(w1.shape)}, {list(w2.shape)}")
    d = x.shape[-1]
    hidden = w1.shape[0] // 2 if activation in GATED else w1.shape[0]
    if w1.shape[1] != d:
        raise ValueError(f"w1 has shape {list(w1.shape)}: its second dim must be x's last dim {d}")
    if activation in GATED and w1.shape[0] % 2:
        raise ValueError(f"{activation} needs w1 with an even number of rows (gate and up halves), got {w1.shape[0]}")
    if w2.shape[1] != hidden:
        raise ValueError(f"w2 has shape {list(w2.shape)}: its second dim must be the hidden size {hidden}")
    if b1 is not None and tuple(b1.shape) != (w1.shape[0],):
        raise ValueError(f"b1 has shape {list(b1.shape)}, expected [{w1.shape[0]}]")
    if b2 is not None and tuple(b2.shape) != (w2.shape[0],):
        raise ValueError(f"b2 has shape {list(b2.shape)}, expected [{w2.shape[0]}]")


def _check_op(x, w1, b1, w2, b2, activation) -> None:
    """The registered Triton ops' check (callable directly through ``torch.ops``, with the backend
    contract's arguments): :func:`_check` with x 2-D (M, D). The kernels' launchers check only
    their own limits."""
    _check(x, w1, b1, w2, b2, activation)
    if x.dim() != 2:
        raise ValueError(f"x must be 2-D (M, D), got shape {list(x.shape)}")


def ffn(
    x: Tensor,
    w1: Tensor,
    b1: Tensor | None,
    w2: Tensor,
    b2: Tensor | None,
    activation: str = "gelu",
    *,
    backend: str | None = None,
) -> Tensor:
    """``act(x @ w1^T + b1) @ w2^T + b2`` with the bias and activation fused into the matmuls.

    Weights in nn.Linear layout: ``w1`` (F, D) — (2F, D) for ``swiglu``/``geglu``, whose first
    output half is the gate and second half the up projection — and ``w2`` (D2, F). Activations:
    ``gelu`` (exact), ``gelu_tanh``, ``relu``, ``silu``, ``swiglu``, ``geglu``. Any leading shape.
    """
    if (out := eager_fast_path("ffn", backend, x, w1, b1, w2, b2, activation)) is not None:
        return out  # (the cpu backend's one-call path)
    _check(x, w1, b1, w2, b2, activation)
    d = x.shape[-1]
    _, impl = backends.select("ffn", x.device, backend, x.dtype, needs=forward_ad_needs(x, w1, b1, w2, b2))
    out = impl(x.reshape(-1, d).contiguous(), w1.contiguous(), b1, w2.contiguous(), b2, activation)
    return out.view(*x.shape[:-1], w2.shape[0])
