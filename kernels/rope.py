"""Triton rotary position embedding (RoPE), forward and backward in one kernel.

Math (per token at table row p, head dim D = 2 * half, all arithmetic in float32):
    pairs     rotate_half (GPT-NeoX / HF LLaMA, the default): (i, i + half)
              interleaved (GPT-J):                             (2i, 2i + 1)
    forward   for every pair (a, b) = (x[first_i], x[second_i]), c = cos[p, i], s = sin[p, i]:
                  y[first_i]  = a * c - b * s
                  y[second_i] = b * c + a * s
    backward  the inverse rotation (angle -theta): the same kernel with s negated (inverse=True)
The table row p of the token at (b, l) is l, or positions[b, l] when positions are given; a
position outside [0, P) makes the token's output rows NaN (memory is never read out of bounds).

Split over programs: grid (B * cdiv(L, BLOCK_L), cdiv(H, HEADS)). A program loads the cos/sin
rows of BLOCK_L tokens once ((BLOCK_L, BLOCK_HALF) float32 each) and applies them to HEADS heads
of those tokens, so the table is read about H / HEADS times instead of H times. rotate_half loads
x as two contiguous halves; interleaved loads the whole row and splits the pairs in registers
(reshape to (BLOCK_L, BLOCK_HALF, 2) + tl.split), so every load is contiguous. HEADS shrinks
from H until the grid has a few programs per SM (decode: L = 1). The op is memory bound: one
read of x, one write of y, plus the table (from L2 after the first head).

Limits (checked by the launcher; the arguments themselves are checked by fastattn.ops): x with a
unit last stride, contiguous float32 tables; offsets are int64.

Precision: x float32 / float16 / bfloat16 (any strides with a contiguous last dim); cos/sin
float32; y is allocated contiguous (B, H, L, D) in x.dtype, rounded once.
"""

import torch
import triton
import triton.language as tl

from . import tuning

__all__ = ["rope_fwd"]

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_TILE_ELEMS = 4096  # x elements per (token block, head) tile
_PROGRAMS_PER_SM = 4


@triton.jit
def _rope_kernel(
    X, COS, SIN, POS, Y,
    stride_xb, stride_xh, stride_xl,
    stride_pb, stride_pl,
    H, L, P, HALF, l_blocks, heads_per_program,
    BLOCK_L: tl.constexpr, BLOCK_HALF: tl.constexpr,
    HAS_POS: tl.constexpr, INTERLEAVED: tl.constexpr, INVERSE: tl.constexpr,
):
    pid = tl.program_id(0)
    pid_h = tl.program_id(1)
    b = (pid // l_blocks).to(tl.int64)
    pid_l = pid % l_blocks
    ls = pid_l * BLOCK_L + tl.arange(0, BLOCK_L)
    pairs = tl.arange(0, BLOCK_HALF)
    l_mask = ls < L
    p_mask = pairs < HALF
    mask = l_mask[:, None] & p_mask[None, :]

    # Table rows of these tokens; invalid positions read row 0 and are turned into NaN below.
    if HAS_POS:
        rows = tl.load(POS + b * stride_pb + ls.to(tl.int64) * stride_pl, mask=l_mask, other=0)
        rows = rows.to(tl.int64)
        valid = (rows >= 0) & (rows < P)
        rows = tl.where(valid, rows, 0)
    else:
        rows = ls.to(tl.int64)
    tab = rows[:, None] * HALF + pairs[None, :]
    c = tl.load(COS + tab, mask=mask, other=0.0).to(tl.float32)
    s = tl.load(SIN + tab, mask=mask, other=0.0).to(tl.float32)
    if INVERSE:
        s = -s
    if HAS_POS:
        c = tl.where(valid[:, None], c, float("nan"))

    D = 2 * HALF
    h_start = pid_h * heads_per_program
    h_end = tl.minimum(h_start + heads_per_program, H)
    for h in range(h_start, h_end):
        h64 = tl.cast(h, tl.int64)
        x_row = X + b * stride_xb + h64 * stride_xh + ls.to(tl.int64)[:, None] * stride_xl
        y_row = Y + ((b * H + h64) * L + ls.to(tl.int64))[:, None] * D
        if INTERLEAVED:
            cols = tl.arange(0, 2 * BLOCK_HALF)
            full_mask = l_mask[:, None] & (cols < D)[None, :]
            x = tl.load(x_row + cols[None, :], mask=full_mask, other=0.0).to(tl.float32)
            a, bb = tl.split(tl.reshape(x, (BLOCK_L, BLOCK_HALF, 2)))
            y = tl.reshape(tl.join(a * c - bb * s, bb * c + a * s), (BLOCK_L, 2 * BLOCK_HALF))
            tl.store(y_row + cols[None, :], y.to(Y.dtype.element_ty), mask=full_mask)
        else:
            a = tl.load(x_row + pairs[None, :], mask=mask, other=0.0).to(tl.float32)
            bb = tl.load(x_row + HALF + pairs[None, :], mask=mask, other=0.0).to(tl.float32)
            tl.store(y_row + pairs[None, :], (a * c - bb * s).to(Y.dtype.element_ty), mask=mask)
            tl.store(y_row + HALF + pairs[None, :], (bb * c + a * s).to(Y.dtype.element_ty),
                     mask=mask)


def _check_limits(x, cos, sin):
    """What only this kernel knows, checked cheaply; the arguments themselves (ranks, shapes,
    devices, positions) are checked once, in fastattn.ops. x in a dtype the kernel is built for
    with a unit last stride; float32 contiguous tables (indexed as row * D/2 + pair)."""
    tuning.check_layout("rope", "x", x, _SUPPORTED_DTYPES)
    for name, t in (("cos", cos), ("sin", sin)):
        if t.dtype != torch.float32:
            raise TypeError(f"the triton rope kernel takes float32 tables, got {name} {t.dtype}")
        if not t.is_contiguous():
            raise ValueError(f"the triton rope kernel takes contiguous tables, got {name} of shape "
                             f"{tuple(t.shape)} with strides {tuple(t.stride())}")


def rope_fwd(x, cos, sin, positions, interleaved, inverse):
    """Rotate the pairs of x's last dim by the angles of the cos/sin tables (RoPE).

    x: (B, H, L, D), D even, float32/float16/bfloat16, any strides with a contiguous last dim.
    cos, sin: contiguous float32 (P, D/2) tables; without positions P must equal L (token l
    uses row l). positions: None or an int64 (B, L) tensor (any strides, e.g. an expanded (L,))
    of table rows; a row outside [0, P) gives NaN for that token. interleaved: pairs (2i, 2i+1)
    instead of (i, i + D/2). inverse: rotate by -theta (the backward of the forward rotation).
    Returns y, a contiguous (B, H, L, D) tensor in x.dtype. The arguments are checked by
    fastattn.ops (the registered op runs the same check); this checks the kernel's own limits.
    """
    _check_limits(x, cos, sin)
    B, H, L, D = x.shape
    half = D // 2
    P = cos.shape[0]
    y = torch.empty((B, H, L, D), dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y

    block_half = tuning.next_power_of_2(half)
    block_l = max(1, min(tuning.next_power_of_2(L), _TILE_ELEMS // (2 * block_half)))
    l_blocks = tuning.cdiv(L, block_l)
    target = _PROGRAMS_PER_SM * tuning.num_sms(x.device)
    heads = H
    while heads > 1 and l_blocks * B * tuning.cdiv(H, heads) < target:
        heads = tuning.cdiv(heads, 2)
    grid = (l_blocks * B, tuning.cdiv(H, heads))
    pos_arg = positions if positions is not None else cos
    spb, spl = (positions.stride(0), positions.stride(1)) if positions is not None else (0, 0)
    num_warps = max(1, min(8, block_l * block_half * 2 // 512))
    tuning.wrap_triton(_rope_kernel)[grid](
        x, cos, sin, pos_arg, y,
        x.stride(0), x.stride(1), x.stride(2),
        spb, spl,
        H, L, P, half, l_blocks, heads,
        BLOCK_L=block_l, BLOCK_HALF=block_half,
        HAS_POS=positions is not None, INTERLEAVED=bool(interleaved), INVERSE=bool(inverse),
        num_warps=num_warps,
    )
    return y
