"""Rotary position embedding (RoPE): public function, registered ops, backends and module.

This op is the worked example of ``docs/extending.md``. It follows the pattern of every op:
kernel (``kernels/rope.py``, ``csrc/cpu/rope.cpp``, ``csrc/cuda/rope.cu``) → registered op
``fastattn::rope_fwd`` (C++) or ``fastattn::triton_rope_fwd`` (Triton), one schema, with one fake
impl and one autograd formula for both → backend implementations → :func:`rope` →
:class:`RotaryEmbedding`. The float64 ground truth is :mod:`fastattn.reference.rope`.

Convention: the GPT-NeoX / Hugging Face LLaMA ``rotate_half`` pairs ``(i, i + D/2)`` by default,
GPT-J's interleaved pairs ``(2i, 2i + 1)`` with ``interleaved=True``; pair ``i`` of the token at
position ``p`` is rotated by ``theta = p * base ** (-2i / D)``.

Backend contract (``backends.register_backend("rope", name, fn)``)::

    fn(x, cos, sin, positions, interleaved) -> y

with x (B, H, L, D) with a contiguous last dim; cos, sin contiguous (P, D/2) tables in the
accumulation dtype (float32, or float64 for float64 x); positions None (token l uses row l, and
P == L) or an int64 (B, L) tensor of table rows; y contiguous (B, H, L, D) in x.dtype. A position
outside [0, P) gives NaN for that token. Gradients flow through autograd.
"""

from __future__ import annotations

from typing import Optional

import torch
from torch import Tensor

from fastattn import backends
from fastattn.ops._library import (
    check_like, define_op, forward_ad_needs, last_dim_contiguous, triton_kernels,
)

__all__ = ["rope", "rotary_cos_sin"]

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)


def _acc_dtype(dtype: torch.dtype) -> torch.dtype:
    """The dtype of the tables and the arithmetic: float64 for float64 inputs, else float32."""
    return torch.float64 if dtype == torch.float64 else torch.float32


# ---------------------------------------------------------------------------------------------
# Tables.


def _cos_sin_of(positions: Tensor, dim: int, base: float, device, dtype) -> tuple[Tensor, Tensor]:
    """cos and sin of ``theta = positions[..., None] * base ** (-2i / dim)``, computed in float64
    (on the CPU for devices without float64) and rounded to ``dtype`` once."""
    work = positions.device if positions.device.type in ("cpu", "cuda", "meta") else torch.device("cpu")
    inv_freq = torch.arange(0, dim, 2, dtype=torch.float64, device=work).div_(dim).mul_(-1.0)
    inv_freq = torch.pow(float(base), inv_freq)
    theta = positions.to(work, torch.float64)[..., None] * inv_freq
    return theta.cos().to(device, dtype), theta.sin().to(device, dtype)


def rotary_cos_sin(
    seq_len: int,
    dim: int,
    base: float = 10000.0,
    device: torch.device | str | None = None,
    dtype: torch.dtype = torch.float32,
    *,
    offset: int = 0,
) -> tuple[Tensor, Tensor]:
    """The RoPE tables ``(cos, sin)``, each ``(seq_len, dim // 2)``, for positions ``offset ..
    offset + seq_len - 1``.

    Row ``p``, column ``i`` holds ``cos`` / ``sin`` of ``theta = (offset + p) * base ** (-2i / dim)``.
    The angles are computed in float64 and rounded to ``dtype`` once, so long positions keep their
    precision (computing ``theta`` in float32 loses about ``p * 6e-8`` radians).
    """
    if dim <= 0 or dim % 2:
        raise ValueError(f"dim must be even and positive, got {dim}")
    if seq_len < 0:
        raise ValueError(f"seq_len must be >= 0, got {seq_len}")
    device = torch.device(device) if device is not None else torch.device("cpu")
    work = device if device.type in ("cpu", "cuda", "meta") else torch.device("cpu")
    positions = torch.arange(offset, offset + seq_len, dtype=torch.float64, device=work)
    return _cos_sin_of(positions, dim, base, device, dtype)


# ---------------------------------------------------------------------------------------------
# The naive backend: the eager formula (Hugging Face's ``x * cos + rotate_half(x) * sin``).


def _gather_tables(cos, sin, positions, x):
    """cos / sin of every token as (1 or B, 1, L, half), and a (B, 1, L, 1) mask of valid tokens
    (None without positions). Invalid positions read row 0; their outputs become NaN."""
    if positions is None:
        return cos[None, None], sin[None, None], None
    valid = (positions >= 0) & (positions < cos.shape[0])
    rows = torch.where(valid, positions, 0)
    return cos[rows][:, None], sin[rows][:, None], valid[:, None, :, None]


def _naive(x, cos, sin, positions, interleaved):
    """Eager PyTorch: every intermediate materialized, in float32 (float64 for float64 inputs)."""
    c, s, valid = _gather_tables(cos, sin, positions, x)
    xf = x.to(_acc_dtype(x.dtype))
    if interleaved:
        a, b = xf[..., 0::2], xf[..., 1::2]
        y = torch.stack((a * c - b * s, b * c + a * s), dim=-1).flatten(-2)
    else:
        a, b = xf.chunk(2, dim=-1)
        y = torch.cat((a * c - b * s, b * c + a * s), dim=-1)
    if valid is not None:
        y = torch.where(valid, y, float("nan"))
    return y.to(x.dtype)


# ---------------------------------------------------------------------------------------------
# Fake implementation and autograd, shared by the C++ and Triton ops (same schema).


def _fake_fwd(x, cos, sin, positions, interleaved, inverse):
    return x.new_empty(x.shape)


def _setup_context(ctx, inputs, output):
    x, cos, sin, positions, interleaved, inverse = inputs
    want_tables = ctx.needs_input_grad[1] or ctx.needs_input_grad[2]
    ctx.save_for_backward(cos, sin, positions, x if want_tables else None)
    ctx.interleaved = interleaved
    ctx.inverse = inverse


def _table_grads(dy, x, cos, positions, interleaved, inverse):
    """Gradients of the cos / sin tables (eager; only when a table requires grad)."""
    acc = cos.dtype
    dy, x = dy.to(acc), x.to(acc)
    if interleaved:
        a, b, da, db = x[..., 0::2], x[..., 1::2], dy[..., 0::2], dy[..., 1::2]
    else:
        (a, b), (da, db) = x.chunk(2, dim=-1), dy.chunk(2, dim=-1)
    sign = -1.0 if inverse else 1.0
    gc = (da * a + db * b).sum(1)  # (B, L, half): summed over heads
    gs = (db * a - da * b).sum(1) * sign
    if positions is None:
        return gc.sum(0), gs.sum(0)
    valid = (positions >= 0) & (positions < cos.shape[0])
    rows = torch.where(valid, positions, 0).reshape(-1)
    keep = valid.reshape(-1, 1)
    dcos = torch.zeros_like(cos).index_add_(0, rows, torch.where(keep, gc.reshape(-1, cos.shape[1]), 0.0))
    dsin = torch.zeros_like(cos).index_add_(0, rows, torch.where(keep, gs.reshape(-1, cos.shape[1]), 0.0))
    return dcos, dsin


def _backward(ops, ctx, dy):
    if dy is None:  # (an undefined gradient: gradcheck passes one)
        return (None,) * 6
    cos, sin, positions, x = ctx.saved_tensors
    dy = last_dim_contiguous(dy)
    dx = dcos = dsin = None
    if ctx.needs_input_grad[0]:
        # The rotation is orthogonal: its gradient is the inverse rotation of dy.
        dx = ops.fwd(dy, cos, sin, positions, ctx.interleaved, not ctx.inverse)
    if x is not None:
        dcos, dsin = _table_grads(dy, x, cos, positions, ctx.interleaved, ctx.inverse)
    return dx, dcos, dsin, None, None, None


# ---------------------------------------------------------------------------------------------
# Compiled backends: the C++ op (cpu and cuda backends) and the Triton op.


def _triton_fwd(
    x: Tensor,
    cos: Tensor,
    sin: Tensor,
    positions: Optional[Tensor],
    interleaved: bool,
    inverse: bool,
) -> Tensor:
    _check_op(x, cos, sin, positions)
    return _kernels.rope_fwd(x, cos, sin, positions, interleaved, inverse)


def _compiled(fwd):
    def impl(x, cos, sin, positions, interleaved):
        return fwd(x, cos, sin, positions, interleaved, False)

    return impl


_kernels = triton_kernels("rope")
define_op("rope", fake_fwd=_fake_fwd, setup_context=_setup_context, backward=_backward,
          triton_fwd=_triton_fwd, naive=_naive, adapt=_compiled)


# ---------------------------------------------------------------------------------------------
# Public function.


def _check_x(x) -> None:
    if not isinstance(x, Tensor):
        raise TypeError(f"x must be a Tensor, got {type(x).__name__}")
    if x.dtype not in _DTYPES:
        raise TypeError(f"x has dtype {x.dtype}; supported: {list(_DTYPES)}")
    if x.dim() != 4:
        raise ValueError(f"x must be 4-D (batch, heads, seq_len, head_dim), got shape {list(x.shape)}")
    if x.shape[-1] == 0 or x.shape[-1] % 2:
        raise ValueError(f"x's head dim must be even and positive, got {x.shape[-1]}")


def _check_positions(positions, x, offset) -> Tensor:
    """positions as an int64 (B, L) tensor (an expanded view for (L,) or (1, L))."""
    B, _, L, _ = x.shape
    if not isinstance(positions, Tensor):
        raise TypeError(f"positions must be a Tensor, got {type(positions).__name__}")
    if positions.dtype == torch.bool or positions.is_floating_point() or positions.is_complex():
        raise TypeError(f"positions must be an integer tensor, got {positions.dtype}")
    if offset != 0:
        raise ValueError("pass either positions or offset, not both (add the offset to the positions)")
    if positions.device != x.device:
        raise ValueError(f"positions is on {positions.device} but x is on {x.device}")
    shape = tuple(positions.shape)
    if shape not in ((L,), (1, L), (B, L)):
        raise ValueError(f"positions must have shape (L,), (1, L) or (B, L) = {(B, L)}, got {list(shape)}")
    positions = positions.to(torch.int64)
    return (positions[None] if positions.dim() == 1 else positions).expand(B, L)


def _check_tables(cos, sin, x) -> None:
    if (cos is None) != (sin is None):
        raise ValueError("pass both cos and sin, or neither (they are then computed from base)")
    half = x.shape[-1] // 2
    for name, t in (("cos", cos), ("sin", sin)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
        if not t.is_floating_point():
            raise TypeError(f"{name} must be floating point, got {t.dtype}")
        if t.dim() != 2 or t.shape[1] != half:
            raise ValueError(
                f"{name} must have shape (positions, head_dim / 2) = (P, {half}), got {list(t.shape)}"
                + (" (for Hugging Face's duplicated tables pass cos[..., :D // 2])" if t.shape[-1] == 2 * half else "")
            )
        if t.device != x.device:
            raise ValueError(f"{name} is on {t.device} but x is on {x.device}")
    if cos.shape != sin.shape:
        raise ValueError(f"cos and sin must have the same shape, got {list(cos.shape)} and {list(sin.shape)}")


def _check_op(x, cos, sin, positions) -> None:
    """The registered Triton op's check (callable directly through ``torch.ops``, with the backend
    contract's arguments): the public function's :func:`_check_x` and :func:`_check_tables`, and
    positions as the contract has them (None with one table row per token, else int64 (B, L)).
    The kernel's launcher checks only its own limits."""
    _check_x(x)
    _check_tables(cos, sin, x)
    B, _, L, _ = x.shape
    if positions is None:
        if cos.shape[0] != L:
            raise ValueError(f"without positions the tables must have one row per token, "
                             f"L = {L}, got cos {list(cos.shape)}")
    else:
        check_like(x.device, positions=(positions, (B, L), torch.int64))


def rope(
    x: Tensor,
    cos: Tensor | None = None,
    sin: Tensor | None = None,
    *,
    positions: Tensor | None = None,
    offset: int = 0,
    base: float = 10000.0,
    interleaved: bool = False,
    backend: str | None = None,
) -> Tensor:
    """Rotary position embedding (RoPE) of queries or keys ``x`` (B, H, L, D), in one fused pass.

    Pair ``i`` of each head row is rotated by ``theta = p * base ** (-2i / D)``, ``p`` the token's
    position: ``(x1, x2) -> (x1 cos - x2 sin, x2 cos + x1 sin)``. Pairs are ``(i, i + D/2)``
    (GPT-NeoX / Hugging Face LLaMA ``rotate_half``), or ``(2i, 2i + 1)`` with ``interleaved=True``
    (GPT-J).

    Positions: token ``l`` has position ``offset + l`` (``offset`` = the number of cached tokens
    when decoding with a KV cache), or ``positions[b, l]`` when ``positions`` ((L,) or (B, L)
    integers) is given. ``cos``, ``sin``: optional ``(P, D/2)`` tables indexed by position (e.g.
    from :func:`rotary_cos_sin`, or scaled variants); without them they are computed from
    ``base``. Tables are used in float32 (float64 for float64 ``x``); if they require grad, they
    get gradients. A position outside the table is a ValueError for CPU tensors; on the GPU it
    is not checked (that would synchronize) and gives NaN for that token.

    ``x`` may have any strides with a contiguous last dim (e.g. ``(B, L, H, D).transpose(1, 2)``);
    the result is a contiguous (B, H, L, D) tensor in ``x``'s dtype. Arithmetic in float32.
    """
    _check_x(x)
    B, _, L, D = x.shape
    acc = _acc_dtype(x.dtype)
    if positions is not None:
        positions = _check_positions(positions, x, offset)
    if cos is None and sin is None:
        if positions is None:
            cos, sin = rotary_cos_sin(L, D, base, x.device, acc, offset=offset)
        elif positions.stride(0) == 0:  # the same positions for every batch row: an (L, D/2) table
            cos, sin = _cos_sin_of(positions[0], D, base, x.device, acc)
            positions = None
        else:  # one table row per token
            cos, sin = _cos_sin_of(positions.reshape(-1), D, base, x.device, acc)
            positions = torch.arange(B * L, device=x.device).view(B, L)
    else:
        _check_tables(cos, sin, x)
        P = cos.shape[0]
        if positions is None:
            if offset < 0 or offset + L > P:
                raise ValueError(f"positions offset .. offset + L - 1 = {offset} .. {offset + L - 1} "
                                 f"are outside the tables' {P} rows")
            cos, sin = cos[offset:offset + L], sin[offset:offset + L]
        elif positions.device.type != "cuda" and positions.numel() > 0:
            lo, hi = int(positions.min()), int(positions.max())
            if lo < 0 or hi >= P:
                raise ValueError(f"positions span {lo} .. {hi}, outside the tables' {P} rows")
        cos, sin = cos.to(acc).contiguous(), sin.to(acc).contiguous()
    if x.stride(-1) != 1:
        x = x.contiguous()
    _, impl = backends.select("rope", x.device, backend, x.dtype, needs=forward_ad_needs(x, cos, sin))
    return impl(x, cos, sin, positions, bool(interleaved))


def __getattr__(name: str):
    # RotaryEmbedding moved to fastattn.nn (its home with the other modules); the old path works.
    if name == "RotaryEmbedding":
        from fastattn.nn.rope import RotaryEmbedding

        return RotaryEmbedding
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
