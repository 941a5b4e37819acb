"""Scaled, masked softmax over the last dimension of a 4-D tensor (Triton backend).

Math (per row ``x`` of length ``N = Lk``; all arithmetic in float32):

    forward   s_j = scale * x_j + m_j      (float mask: m_j added; bool mask: m_j = 0 / -inf)
              s_j = -inf  where j > i       (is_causal, top-left: query i sees keys j <= i)
              y_j = exp(s_j - max s) / sum_k exp(s_k - max s)
    backward  dx_j = scale * y_j * (dy_j - sum_k dy_k y_k)

A row whose scores are all ``-inf`` (fully masked) gets ``y = 0``; its backward then gives
``dx = 0`` by the formula, never NaN. Exponentials are taken as ``exp2`` of scores pre-multiplied
by ``log2(e)``.

Work split: rows are the flattened ``(L0, L1, Lq)`` index; ``x``, ``dy`` and ``y`` are read through
their three leading strides (the last dimension must be contiguous) and the mask through all four
of its strides, so broadcast views (stride 0) are never materialized. Outputs are contiguous.

* short rows (``next_pow2(N) <= MAX_FUSED_N``, 16384 elements): one pass, the row lives in
  registers; a program handles ``BLOCK_M`` rows at once (``BLOCK_M * BLOCK_N ~ 4096`` elements), so
  tiny rows are batched. Forward reads ``x`` (and the mask) once and writes ``y`` once; backward
  reads ``dy`` and ``y`` once and writes ``dx`` once.
* long rows (any longer ``N``): one program per row loops over ``BLOCK_N = 4096`` chunks. Forward
  makes an online pass (running max, running sum rescaled by ``exp(m_old - m_new)`` whenever the
  max grows), then a normalize pass that re-reads ``x`` and writes ``y``; backward accumulates
  ``sum dy * y`` in one pass, then writes ``dx`` in a second.

Limits (checked by the launchers; the arguments themselves are checked by fastattn.ops): ``x`` in
float32 / float16 / bfloat16, 4-D with a contiguous last dimension, at most 2**31 - 4097 rows
(int32 row indices) and a mask whose offsets along a row fit in int32; any row length (the long
path has no upper bound, but a few very long rows give few programs: one per row). The mask is
bool (True = keep) or any floating dtype and must have exactly ``x``'s shape (use ``expand`` for
broadcasting). Precision: loads are upcast to float32, reductions and exponentials are float32,
results are rounded once to ``x``'s dtype.
"""

import math

import torch
import triton
import triton.language as tl

from . import tuning

__all__ = ["softmax_fwd", "softmax_bwd", "MAX_FUSED_N"]

#: Longest padded row (elements) handled in registers in one pass; longer rows use the chunked path.
MAX_FUSED_N = 16384
#: Target elements per program on the short path (several rows per program for short rows).
_ROWS_TILE = 4096
#: Chunk length of the long-row path.
_LONG_BLOCK_N = 4096
_LOG2E = math.log2(math.e)
_LOG2E_TL: tl.constexpr = tl.constexpr(_LOG2E)
_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
#: Row indices are int32 (a tile's last index, rows + BLOCK_M - 1, must not wrap).
_MAX_ROWS = 2**31 - 1 - _ROWS_TILE


@triton.jit
def _row_index(rows, L1, Lq):
    """Split the flattened (int32) row index into (i0, i1, iq); int64 for the stride products."""
    iq = rows % Lq
    bh = rows // Lq
    return (bh // L1).to(tl.int64), (bh % L1).to(tl.int64), iq.to(tl.int64)


@triton.jit
def _scores(X, Mask, x_off, mask_off, iq, cols, valid, stride_mask_k, scale_log2e,
            HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr, IS_CAUSAL: tl.constexpr):
    """log2-domain scores (scale * x + mask) * log2(e), -inf where masked or out of range.

    Works for any broadcast-compatible shapes of the offsets (a 2-D tile or a 1-D chunk).
    """
    keep = valid
    if IS_CAUSAL:
        keep = keep & (cols <= iq)
    s = tl.load(X + x_off + cols, mask=keep, other=0.0).to(tl.float32) * scale_log2e
    if HAS_MASK:
        m_ptrs = Mask + mask_off + cols * stride_mask_k
        if MASK_IS_BOOL:
            keep = keep & (tl.load(m_ptrs, mask=keep, other=0) != 0)
        else:
            s += tl.load(m_ptrs, mask=keep, other=0.0).to(tl.float32) * _LOG2E_TL
    return tl.where(keep, s, float("-inf"))


@triton.jit
def _softmax_fwd_kernel(Y, X, Mask, n_rows, N, L1, Lq,
                        stride_x_0, stride_x_1, stride_x_row,
                        stride_mask_0, stride_mask_1, stride_mask_row, stride_mask_k,
                        scale_log2e,
                        HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr,
                        IS_CAUSAL: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Short rows: BLOCK_M whole rows per program, held in registers."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)[None, :]
    i0, i1, iq = _row_index(rows, L1, Lq)
    x_off = (i0 * stride_x_0 + i1 * stride_x_1 + iq * stride_x_row)[:, None]
    mask_off = (i0 * stride_mask_0 + i1 * stride_mask_1 + iq * stride_mask_row)[:, None]
    valid = (rows < n_rows)[:, None] & (cols < N)
    s = _scores(X, Mask, x_off, mask_off, iq[:, None], cols, valid, stride_mask_k, scale_log2e,
                HAS_MASK, MASK_IS_BOOL, IS_CAUSAL)
    m = tl.max(s, axis=1)
    m = tl.where(m == float("-inf"), 0.0, m)
    e = tl.exp2(s - m[:, None])
    d = tl.sum(e, axis=1)
    y = e * (1.0 / tl.where(d > 0.0, d, 1.0))[:, None]
    y_off = rows.to(tl.int64)[:, None] * N
    tl.store(Y + y_off + cols, y.to(Y.dtype.element_ty), mask=valid)


@triton.jit
def _softmax_fwd_long_kernel(Y, X, Mask, N, L1, Lq,
                             stride_x_0, stride_x_1, stride_x_row,
                             stride_mask_0, stride_mask_1, stride_mask_row, stride_mask_k,
                             scale_log2e,
                             HAS_MASK: tl.constexpr, MASK_IS_BOOL: tl.constexpr,
                             IS_CAUSAL: tl.constexpr, BLOCK_N: tl.constexpr):
    """Long rows: one program per row; online max/sum pass, then a normalize pass."""
    row = tl.program_id(0)
    i0, i1, iq = _row_index(row, L1, Lq)
    x_off = i0 * stride_x_0 + i1 * stride_x_1 + iq * stride_x_row
    mask_off = i0 * stride_mask_0 + i1 * stride_mask_1 + iq * stride_mask_row
    offs = tl.arange(0, BLOCK_N)
    m_run = float("-inf")
    d_run = 0.0
    for start in range(0, N, BLOCK_N):
        cols = start + offs
        s = _scores(X, Mask, x_off, mask_off, iq, cols, cols < N, stride_mask_k, scale_log2e,
                    HAS_MASK, MASK_IS_BOOL, IS_CAUSAL)
        m_new = tl.maximum(m_run, tl.max(s, axis=0))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        d_run = d_run * tl.exp2(m_run - m_safe) + tl.sum(tl.exp2(s - m_safe), axis=0)
        m_run = m_new
    m_safe = tl.where(m_run == float("-inf"), 0.0, m_run)
    inv = 1.0 / tl.where(d_run > 0.0, d_run, 1.0)
    y_row = Y + row.to(tl.int64) * N
    for start in range(0, N, BLOCK_N):
        cols = start + offs
        valid = cols < N
        s = _scores(X, Mask, x_off, mask_off, iq, cols, valid, stride_mask_k, scale_log2e,
                    HAS_MASK, MASK_IS_BOOL, IS_CAUSAL)
        y = tl.exp2(s - m_safe) * inv
        tl.store(y_row + cols, y.to(Y.dtype.element_ty), mask=valid)


@triton.jit
def _softmax_bwd_kernel(DX, DY, Y, n_rows, N, L1, Lq,
                        stride_dy_0, stride_dy_1, stride_dy_row,
                        stride_y_0, stride_y_1, stride_y_row,
                        scale, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Short rows: BLOCK_M whole rows per program, held in registers."""
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)[None, :]
    i0, i1, iq = _row_index(rows, L1, Lq)
    dy_off = (i0 * stride_dy_0 + i1 * stride_dy_1 + iq * stride_dy_row)[:, None]
    y_off = (i0 * stride_y_0 + i1 * stride_y_1 + iq * stride_y_row)[:, None]
    valid = (rows < n_rows)[:, None] & (cols < N)
    dy = tl.load(DY + dy_off + cols, mask=valid, other=0.0).to(tl.float32)
    y = tl.load(Y + y_off + cols, mask=valid, other=0.0).to(tl.float32)
    dot = tl.sum(dy * y, axis=1)
    dx = scale * y * (dy - dot[:, None])
    dx_off = rows.to(tl.int64)[:, None] * N
    tl.store(DX + dx_off + cols, dx.to(DX.dtype.element_ty), mask=valid)


@triton.jit
def _softmax_bwd_long_kernel(DX, DY, Y, N, L1, Lq,
                             stride_dy_0, stride_dy_1, stride_dy_row,
                             stride_y_0, stride_y_1, stride_y_row,
                             scale, BLOCK_N: tl.constexpr):
    """Long rows: one program per row; a pass for sum(dy * y), then a pass writing dx."""
    row = tl.program_id(0)
    i0, i1, iq = _row_index(row, L1, Lq)
    dy_row = DY + i0 * stride_dy_0 + i1 * stride_dy_1 + iq * stride_dy_row
    y_row = Y + i0 * stride_y_0 + i1 * stride_y_1 + iq * stride_y_row
    offs = tl.arange(0, BLOCK_N)
    acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    for start in range(0, N, BLOCK_N):
        cols = start + offs
        valid = cols < N
        dy = tl.load(dy_row + cols, mask=valid, other=0.0).to(tl.float32)
        y = tl.load(y_row + cols, mask=valid, other=0.0).to(tl.float32)
        acc += dy * y
    dot = tl.sum(acc, axis=0)
    dx_row = DX + row.to(tl.int64) * N
    for start in range(0, N, BLOCK_N):
        cols = start + offs
        valid = cols < N
        dy = tl.load(dy_row + cols, mask=valid, other=0.0).to(tl.float32)
        y = tl.load(y_row + cols, mask=valid, other=0.0).to(tl.float32)
        dx = scale * y * (dy - dot)
        tl.store(dx_row + cols, dx.to(DX.dtype.element_ty), mask=valid)


def _check_limits(mask=None, **tensors):
    """What only these kernels know, checked cheaply; the arguments themselves (ranks, shapes,
    devices, mask dtype) are checked once, in fastattn.ops. Returns the row count (L0 * L1 * Lq).

    Each of ``tensors`` (4-D) in a dtype the kernels are built for, with a unit last stride; the
    flattened row index is int32 (fewer than 2**31 - _ROWS_TILE rows, so a tile's last index does
    not wrap), and so is the mask's offset along a row ((Lk - 1) * its last stride)."""
    for name, t in tensors.items():
        tuning.check_layout("softmax", name, t, _DTYPES)
    name, t = next(iter(tensors.items()))
    n_rows = t.shape[0] * t.shape[1] * t.shape[2]
    if n_rows > _MAX_ROWS:
        raise ValueError(f"{name} has {n_rows} rows (L0 * L1 * Lq); the triton softmax kernels "
                         f"take at most {_MAX_ROWS} (int32 row indices)")
    if mask is not None and (mask.shape[-1] - 1) * abs(mask.stride(-1)) >= 2**31:
        raise ValueError(f"mask {tuple(mask.shape)} with strides {mask.stride()}: offsets along a "
                         f"row must fit in int32")
    return n_rows


def _short_launch(n_rows, n):
    """(BLOCK_M, BLOCK_N, num_warps) for the one-pass path, or None when the row is too long."""
    block_n = tuning.next_power_of_2(n)
    if block_n > MAX_FUSED_N:
        return None
    block_m = min(max(1, _ROWS_TILE // block_n), tuning.next_power_of_2(n_rows))
    num_warps = min(16, max(1, block_m * block_n // 512))
    return block_m, block_n, num_warps


def softmax_fwd(x, mask, scale, is_causal):
    """``y = softmax(scale * x + mask)`` over the last dim of ``x`` (L0, L1, Lq, Lk).

    ``mask``: None, or a (L0, L1, Lq, Lk) tensor (usually a broadcast view), bool (True = keep) or
    floating (added after scaling). ``is_causal``: key j visible to query i iff j <= i. Returns a
    contiguous tensor of ``x``'s dtype; fully masked rows are zeros.
    """
    n_rows = _check_limits(mask, x=x)
    L0, L1, Lq, Lk = x.shape
    y = torch.empty((L0, L1, Lq, Lk), dtype=x.dtype, device=x.device)
    if y.numel() == 0:
        return y
    mask_is_bool = mask is not None and mask.dtype == torch.bool
    if mask_is_bool:
        mask = mask.view(torch.uint8)
    mask_strides = mask.stride() if mask is not None else (0, 0, 0, 0)
    args = (y, x, mask)
    common = (L1, Lq, *x.stride()[:3], *mask_strides, float(scale) * _LOG2E)
    flags = dict(HAS_MASK=mask is not None, MASK_IS_BOOL=mask_is_bool, IS_CAUSAL=bool(is_causal))
    short = _short_launch(n_rows, Lk)
    if short is not None:
        block_m, block_n, num_warps = short
        tuning.wrap_triton(_softmax_fwd_kernel)[(tuning.cdiv(n_rows, block_m),)](
            *args, n_rows, Lk, *common, **flags, BLOCK_M=block_m, BLOCK_N=block_n,
            num_warps=num_warps)
    else:
        tuning.wrap_triton(_softmax_fwd_long_kernel)[(n_rows,)](
            *args, Lk, *common, **flags, BLOCK_N=_LONG_BLOCK_N, num_warps=8)
    return y


def softmax_bwd(dy, y, scale):
    """``dx = scale * y * (dy - sum(dy * y))`` row-wise; ``dy``, ``y`` (L0, L1, Lq, Lk).

    Returns a contiguous tensor of ``y``'s dtype.
    """
    n_rows = _check_limits(y=y, dy=dy)
    L0, L1, Lq, Lk = y.shape
    dx = torch.empty((L0, L1, Lq, Lk), dtype=y.dtype, device=y.device)
    if dx.numel() == 0:
        return dx
    common = (L1, Lq, *dy.stride()[:3], *y.stride()[:3], float(scale))
    short = _short_launch(n_rows, Lk)
    if short is not None:
        block_m, block_n, num_warps = short
        tuning.wrap_triton(_softmax_bwd_kernel)[(tuning.cdiv(n_rows, block_m),)](
            dx, dy, y, n_rows, Lk, *common, BLOCK_M=block_m, BLOCK_N=block_n,
            num_warps=num_warps)
    else:
        tuning.wrap_triton(_softmax_bwd_long_kernel)[(n_rows,)](
            dx, dy, y, Lk, *common, BLOCK_N=_LONG_BLOCK_N, num_warps=8)
    return dx
