"""Attention over packed variable-length sequences (forward, backward) and split-KV decoding
from a paged KV cache, in Triton.

Math (per sequence b, query head h, kv head h // (H // Hkv)), as docs/numerics.md with each
sequence's own lengths Lq_b, Lk_b (band offset Lk_b - Lq_b when bottom-right, else 0)::

    S = scale * Q K^T  (-inf outside the band),  lse = log sum_j exp(S),  P = exp(S - lse)
    O = (P * Z) V                 Z: dropout, batch row b's stream, counter i * Lk_b + j
    delta = rowsum(dO * O),  dV = (P * Z)^T dO,  dS = P * (Z * (dO V^T) - delta)
    dQ = scale * dS K,  dK = scale * dS^T Q

Packed (varlen) work split: the dense kernels' tile loops (``kernels.attention``: the online
softmax step, the dK/dV and dQ tile loops, the band's tile ranges) run on one sequence's slice,
whose start rows come from cu_seqlens; the grid is (query or key blocks of the longest sequence,
batch, heads), and blocks past a sequence's end exit at once. Rows of q, k, v are read through
their token stride, so the packed (total, H, D) tensors are never copied. delta reuses the dense
preprocess kernel on the (1, H, total_q) view.

Paged decoding (flash-decoding): the query rows of one sequence's GQA group (group * Lq rows,
in tiles of BLOCK_M) share one program per key split, so each cached key is read once per split
for the whole group; keys are gathered through block_table (block t // block_size, slot
t % block_size). Each split writes a float32 partial (O normalized, lse); splits are merged with
a log-sum-exp weighted sum: O = sum_s exp(lse_s - lse) O_s, lse = logsumexp_s lse_s. The number
of splits fills the GPU (about two programs per SM), never more than the key tiles.

Tiles are fixed, not autotuned yet (see _tiles: chosen so that every kernel compiles for sm_90
without register spills); the split merge is a kernel of its own (_paged_merge_kernel), one
program a query row.

NaN rule (docs/numerics.md): as the dense kernels, detect then recompute -- each program checks
its output tile for a NaN and only then reruns its block on kernels.attention's careful path
(_fwd_careful, _dkdv_careful, _dq_careful; paged: _paged_tiles with CAREFUL, 16 rows at a time).

Precision: scores, statistics and accumulators float32, P and dS cast to the input dtype for the
dots (float32 dots are IEEE); lse float32. Rows with nothing to attend: O = 0, lse = -inf,
gradients 0. Limits: float16 / bfloat16 / float32, head dims <= 256, unit stride on the last
dim; no float mask (the band only); int64 offsets for tokens and blocks.
"""

import torch
import triton
import triton.language as tl

from . import tuning
from .attention import (
    _DTYPES,
    _INTERPRET,
    _LOG2E,
    _MAX_HEAD_DIM,
    _dkdv_tiles,
    _dot,
    _dq_tiles,
    _any_nan,
    _dkdv_careful,
    _dq_careful,
    _fwd_careful,
    _fwd_finish,
    _fwd_tiles,
    _in_band,
    _key_tiles,
    _load_rows,
    _load_vec,
    _masked_dot,
    _query_tiles,
    _scores,
    _store_dkdv,
    _store_dq,
    _store_rows,
)
from .attention_launch import _bwd_delta, _dot_precision, _dropout_args, _head_block

# One fixed tile shape per kernel (no autotuning yet): 16 x 16 under the interpreter; on a GPU
# the shapes that compile for sm_90 without register spills (fastattn.aot, Triton 3.6).
# 16-bit (bf16 / fp16 at D 64, 128, 256): forward 64 x 64 (32 x 32 above D 128), 4 warps;
# backward 64 x 64 at D <= 64, 32 x 64 at D <= 128, 32 x 32 with 8 warps above; the paged
# forward as the forward, with a limit of 128 registers at D <= 64, where ptxas held it to 96 (its
# 5-blocks tier; shared memory would allow 11) and the fp16 kernel spilled 4/4 B; 128 keeps 4
# blocks of 4 warps per SM (bench/aot/README.md).
# float32 (IEEE dots: FMA loops, each thread holding whole rows of both operands) spilled with
# those shapes (forward 5-100 KB, backward 6-100 KB, paged 0.1-2.5 KB of local memory on
# 2026-11-26): its own, as kernels.attention's _FP32_CONFIGS, checked at D 64, 128 and 256 with
# 0 spills: forward 32 x 16 w8 (128-194 registers), paged the same up to D 128 and 16 x 16 w8
# above (194); dK/dV 32 x 16 w8 one stage (103-176), 16 x 16 w8 above D 128 (235); dQ 16 x 16 w4
# (80-223).
_FP32_TILES = {  # kernel: (shape up to D 128, shape above), shape (BLOCK_M, BLOCK_N, warps, stages)
    "fwd": ((32, 16, 8, 2), (32, 16, 8, 2)),
    "paged": ((32, 16, 8, 2), (16, 16, 8, 2)),
    "dkdv": ((32, 16, 8, 1), (16, 16, 8, 1)),
    "dq": ((16, 16, 4, 2), (16, 16, 4, 2)),
}


def _tiles(D, Dv, dtype, kernel="fwd"):
    """(BLOCK_M, BLOCK_N, num_warps, num_stages, launch options) of ``kernel`` ("fwd", "paged",
    "dkdv", "dq") for these head dims and input dtype (the table above)."""
    if _INTERPRET:
        return 16, 16, 4, 1, {}
    wide = max(D, Dv)
    if dtype == torch.float32:  # (not [wide > 128]: with dynamic shapes a SymBool, no index)
        return (*_FP32_TILES[kernel][1 if wide > 128 else 0], {})
    if kernel in ("fwd", "paged"):
        shape = (64, 64, 4) if wide <= 128 else (32, 32, 4)
        return (*shape, 2, {"maxnreg": 128} if kernel == "paged" and wide <= 64 else {})
    return (*((64, 64, 4) if wide <= 64 else (32, 64, 4) if wide <= 128 else (32, 32, 8)), 2, {})


@triton.jit
def _sequence(Cu, b):
    """Start (int64) and length of sequence b of a cu_seqlens array."""
    start = tl.load(Cu + b)
    return start.to(tl.int64), tl.load(Cu + b + 1) - start


@triton.jit
def _seq_band(Lq, Lk, left, right, BOTTOM_RIGHT: tl.constexpr):
    """The kernel band (band_lo, band_hi) of one sequence: key j is allowed for query i iff
    i + band_lo <= j <= i + band_hi, clamped to [-Lq, Lk] as the dense launcher does."""
    if BOTTOM_RIGHT:
        offset = Lk - Lq
    else:
        offset = Lk * 0
    lo = tl.minimum(tl.maximum(offset - left, -Lq), Lk)
    hi = tl.minimum(tl.maximum(offset + right, -Lq), Lk)
    return lo, hi


# ---------------------------------------------------------------------------------------------
# Packed sequences: forward
# ---------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["seed", "threshold"])
def _varlen_fwd_kernel(
    Q, K, V, Out, Lse, CuQ, CuK,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_o_t, stride_o_h,
    total_q, H, GROUP, qk_scale, left, right, seed, threshold, rcp_keep,
    BOTTOM_RIGHT: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, LO_BOUNDED: tl.constexpr,
    HI_BOUNDED: tl.constexpr, HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    m0 = tl.program_id(0) * BLOCK_M
    b = tl.program_id(1)
    h = tl.program_id(2)
    q_start, Lq = _sequence(CuQ, b)
    k_start, Lk = _sequence(CuK, b)
    if m0 < Lq:
        hkv = (h // GROUP).to(tl.int64)
        bh = b * H + h
        band_lo, band_hi = _seq_band(Lq, Lk, left, right, BOTTOM_RIGHT)
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        k_src = K + k_start * stride_k_t + hkv * stride_k_h
        v_src = V + k_start * stride_v_t + hkv * stride_v_h
        q = _load_rows(Q + q_start * stride_q_t + h.to(tl.int64) * stride_q_h, offs_m, stride_q_t,
                       offs_d, Lq, HEAD_DIM, BLOCK_D, True)
        acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        n_base, num, t1, t2 = _key_tiles(m0, Lq, Lk, band_lo, band_hi, BLOCK_M, BLOCK_N)
        acc, m_i, l_i = _fwd_tiles(
            acc, m_i, l_i, q, k_src, v_src, Q, offs_m, offs_d, offs_dv, n_base, num, t1, t2,
            stride_k_t, stride_v_t, 0, 0, Lq, Lk, qk_scale, band_lo, band_hi, seed, bh,
            threshold, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, False, False, LO_BOUNDED,
            HI_BOUNDED, HAS_DROPOUT, DOT_PRECISION, BLOCK_N, True, False, False)

        out, lse = _fwd_finish(acc, m_i, l_i, rcp_keep, HAS_DROPOUT)
        out_base = Out + q_start * stride_o_t + h.to(tl.int64) * stride_o_h
        lse_base = Lse + h.to(tl.int64) * total_q + q_start
        if _any_nan(out, offs_m < Lq):  # the NaN rule: kernels.attention's careful path
            _fwd_careful(Q + q_start * stride_q_t + h.to(tl.int64) * stride_q_h, stride_q_t,
                         k_src, v_src, out_base, stride_o_t, lse_base, Q, m0, offs_d, offs_dv,
                         stride_k_t, stride_v_t, 0, 0, Lq, Lk, qk_scale, band_lo, band_hi, seed,
                         bh, threshold, rcp_keep, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, False,
                         False, LO_BOUNDED, HI_BOUNDED, HAS_DROPOUT, DOT_PRECISION, BLOCK_M)
        else:
            _store_rows(out_base, offs_m, stride_o_t, offs_dv, out, lse_base, lse, Lq, HEAD_DIM_V)


# ---------------------------------------------------------------------------------------------
# Packed sequences: backward (dK/dV per key block, then dQ per query block; no atomics)
# ---------------------------------------------------------------------------------------------

@triton.jit(do_not_specialize=["seed", "threshold"])
def _varlen_dkdv_kernel(
    Q, K, V, DOut, Lse, Delta, DK, DV, CuQ, CuK,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_do_t, stride_do_h, stride_dk_t, stride_dk_h, stride_dv_t, stride_dv_h,
    total_q, H, GROUP, scale, qk_scale, left, right, seed, threshold, rcp_keep,
    BOTTOM_RIGHT: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, LO_BOUNDED: tl.constexpr,
    HI_BOUNDED: tl.constexpr, HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    n0 = tl.program_id(0) * BLOCK_N
    b = tl.program_id(1)
    hkv = tl.program_id(2).to(tl.int64)
    q_start, Lq = _sequence(CuQ, b)
    k_start, Lk = _sequence(CuK, b)
    if n0 < Lk:
        band_lo, band_hi = _seq_band(Lq, Lk, left, right, BOTTOM_RIGHT)
        offs_n = n0 + tl.arange(0, BLOCK_N)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        k = _load_rows(K + k_start * stride_k_t + hkv * stride_k_h, offs_n, stride_k_t, offs_d,
                       Lk, HEAD_DIM, BLOCK_D, True)
        v = _load_rows(V + k_start * stride_v_t + hkv * stride_v_h, offs_n, stride_v_t, offs_dv,
                       Lk, HEAD_DIM_V, BLOCK_DV, True)
        dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)
        m_base, num, t1, t2 = _query_tiles(n0, Lq, Lk, band_lo, band_hi, BLOCK_M, BLOCK_N)
        for g in range(0, GROUP):
            h = hkv * GROUP + g
            bh = b * H + h
            q_src = Q + q_start * stride_q_t + h * stride_q_h
            do_src = DOut + q_start * stride_do_t + h * stride_do_h
            lse_ptr = Lse + h * total_q + q_start
            delta_ptr = Delta + h * total_q + q_start
            dk, dv = _dkdv_tiles(
                dk, dv, k, v, q_src, do_src, lse_ptr, delta_ptr, Q, offs_n, offs_d, offs_dv,
                m_base, num, t1, t2, stride_q_t, stride_do_t, 0, 0, Lq, Lk, qk_scale, band_lo,
                band_hi, seed, bh, threshold, rcp_keep, HEAD_DIM, HEAD_DIM_V, BLOCK_D,
                BLOCK_DV, False, False, LO_BOUNDED, HI_BOUNDED, HAS_DROPOUT, DOT_PRECISION,
                BLOCK_M, True, False)
        dk_base = DK + k_start * stride_dk_t + hkv * stride_dk_h
        dv_base = DV + k_start * stride_dv_t + hkv * stride_dv_h
        if _any_nan(dk, offs_n < Lk) | _any_nan(dv, offs_n < Lk):  # the NaN rule: careful path
            h0 = hkv * GROUP
            _dkdv_careful(
                Q + q_start * stride_q_t + h0 * stride_q_h, stride_q_h, stride_q_t,
                DOut + q_start * stride_do_t + h0 * stride_do_h, stride_do_h, stride_do_t,
                Lse + h0 * total_q + q_start, Delta + h0 * total_q + q_start, total_q,
                K + k_start * stride_k_t + hkv * stride_k_h,
                V + k_start * stride_v_t + hkv * stride_v_h, stride_k_t, stride_v_t, dk_base,
                stride_dk_t, dv_base, stride_dv_t, Q, 0, 0, 0, n0, b * H + h0, GROUP, offs_d,
                offs_dv, Lq, Lk, scale, qk_scale, band_lo, band_hi, seed, threshold, rcp_keep,
                HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, False, False, LO_BOUNDED, HI_BOUNDED,
                HAS_DROPOUT, DOT_PRECISION, BLOCK_N)
        else:
            _store_dkdv(dk_base, dv_base, offs_n, stride_dk_t, stride_dv_t, offs_d, offs_dv, dk,
                        dv, scale, Lk, HEAD_DIM, HEAD_DIM_V)


@triton.jit(do_not_specialize=["seed", "threshold"])
def _varlen_dq_kernel(
    Q, K, V, DOut, Lse, Delta, DQ, CuQ, CuK,
    stride_q_t, stride_q_h, stride_k_t, stride_k_h, stride_v_t, stride_v_h,
    stride_do_t, stride_do_h, stride_dq_t, stride_dq_h,
    total_q, H, GROUP, scale, qk_scale, left, right, seed, threshold, rcp_keep,
    BOTTOM_RIGHT: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, LO_BOUNDED: tl.constexpr,
    HI_BOUNDED: tl.constexpr, HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    m0 = tl.program_id(0) * BLOCK_M
    b = tl.program_id(1)
    h = tl.program_id(2).to(tl.int64)
    q_start, Lq = _sequence(CuQ, b)
    k_start, Lk = _sequence(CuK, b)
    if m0 < Lq:
        hkv = h // GROUP
        bh = b * H + h
        band_lo, band_hi = _seq_band(Lq, Lk, left, right, BOTTOM_RIGHT)
        offs_m = m0 + tl.arange(0, BLOCK_M)
        offs_d = tl.arange(0, BLOCK_D)
        offs_dv = tl.arange(0, BLOCK_DV)
        k_src = K + k_start * stride_k_t + hkv * stride_k_h
        v_src = V + k_start * stride_v_t + hkv * stride_v_h
        q = _load_rows(Q + q_start * stride_q_t + h * stride_q_h, offs_m, stride_q_t, offs_d, Lq,
                       HEAD_DIM, BLOCK_D, True)
        do = _load_rows(DOut + q_start * stride_do_t + h * stride_do_h, offs_m, stride_do_t,
                        offs_dv, Lq, HEAD_DIM_V, BLOCK_DV, True)
        lse = _load_vec(Lse + h * total_q + q_start, offs_m, Lq, True)
        lse = tl.where(lse == float("-inf"), 0.0, lse * _LOG2E)
        delta = _load_vec(Delta + h * total_q + q_start, offs_m, Lq, True)
        dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
        n_base, num, t1, t2 = _key_tiles(m0, Lq, Lk, band_lo, band_hi, BLOCK_M, BLOCK_N)
        dq = _dq_tiles(
            dq, q, do, lse, delta, k_src, v_src, Q, Q, offs_m, offs_d, offs_dv, n_base, num, t1,
            t2, stride_k_t, stride_v_t, 0, 0, Lq, Lk, qk_scale, band_lo, band_hi, seed, bh,
            threshold, rcp_keep, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, False, False,
            LO_BOUNDED, HI_BOUNDED, HAS_DROPOUT, False, DOT_PRECISION, BLOCK_N, True, False)
        dq_base = DQ + q_start * stride_dq_t + h * stride_dq_h
        if _any_nan(dq, offs_m < Lq):  # the NaN rule: kernels.attention's careful path
            _dq_careful(Q + q_start * stride_q_t + h * stride_q_h, stride_q_t,
                        DOut + q_start * stride_do_t + h * stride_do_h, stride_do_t,
                        Lse + h * total_q + q_start, Delta + h * total_q + q_start, k_src, v_src,
                        dq_base, stride_dq_t, Q, Q, m0, offs_d, offs_dv, stride_k_t, stride_v_t,
                        0, 0, Lq, Lk, scale, qk_scale, band_lo, band_hi, seed, bh, threshold,
                        rcp_keep, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, False, False,
                        LO_BOUNDED, HI_BOUNDED, HAS_DROPOUT, False, DOT_PRECISION, BLOCK_M)
        else:
            _store_dq(dq_base, offs_m, stride_dq_t, offs_d, dq, scale, Lq, HEAD_DIM)


# ---------------------------------------------------------------------------------------------
# Paged KV cache: split-KV decoding
# ---------------------------------------------------------------------------------------------

@triton.jit
def _paged_rows(Cache, Table, b_table, offs_n, n_valid, hkv, offs_d, stride_c_blk, stride_c_slot,
                stride_c_h, BLOCK_SIZE, DIM: tl.constexpr):
    """Gather the cache rows of positions offs_n (< n_valid) of one sequence (its block_table
    row at b_table) and kv head: a [len(offs_n), BLOCK] tile, zero elsewhere."""
    valid = offs_n < n_valid
    blk = tl.load(Table + b_table + offs_n // BLOCK_SIZE, mask=valid, other=0).to(tl.int64)
    rows = blk * stride_c_blk + (offs_n % BLOCK_SIZE).to(tl.int64) * stride_c_slot + hkv * stride_c_h
    return tl.load(Cache + rows[:, None] + offs_d[None, :],
                   mask=valid[:, None] & (offs_d[None, :] < DIM), other=0.0)


@triton.jit
def _paged_queries(Q, b, hkv, GROUP, Lq, offs_r, offs_d, stride_q_b, stride_q_h, stride_q_m,
                   HEAD_DIM: tl.constexpr):
    """The query rows offs_r of one sequence's GQA group (row r: query head hkv * GROUP +
    r // Lq, query row r % Lq): (q tile, row index i, head h, row valid)."""
    row_ok = offs_r < GROUP * Lq
    offs_i = offs_r % Lq
    h = hkv * GROUP + (offs_r // Lq).to(tl.int64)
    q = tl.load(Q + b * stride_q_b + h[:, None] * stride_q_h + offs_i[:, None] * stride_q_m
                + offs_d[None, :], mask=row_ok[:, None] & (offs_d[None, :] < HEAD_DIM), other=0.0)
    return q, offs_i, h, row_ok


@triton.jit
def _paged_store(OPart, LsePart, b, H, h, Lq, offs_i, num_splits, split, offs_dv, out, lse,
                 row_ok, HEAD_DIM_V: tl.constexpr):
    """Store one split's partial O and lse of the rows (h, offs_i): (B, H, Lq, num_splits[,
    Dv]) float32."""
    part = ((b * H + h) * Lq + offs_i) * num_splits + split
    tl.store(OPart + part[:, None] * HEAD_DIM_V + offs_dv[None, :], out,
             mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V))
    tl.store(LsePart + part, lse, mask=row_ok)


@triton.jit
def _paged_tiles(q, KC, VC, Table, b_table, hkv, offs_i, offs_d, offs_dv, n_lo, n_end, Lq,
                 stride_kc_blk, stride_kc_slot, stride_kc_h, stride_vc_blk, stride_vc_slot,
                 stride_vc_h, BLOCK_SIZE, qk_scale, band_lo, band_hi, HEAD_DIM: tl.constexpr,
                 HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, LO_BOUNDED: tl.constexpr,
                 HI_BOUNDED: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                 BLOCK_N: tl.constexpr, CAREFUL: tl.constexpr):
    """Online softmax over the cached keys [n_lo, n_end) of one split; (O, lse) of its rows.
    CAREFUL: the NaN-safe path of kernels.attention (pairs outside the band skipped)."""
    acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    for n0 in tl.range(n_lo, n_end, BLOCK_N, num_stages=1 if CAREFUL else None):
        offs_n = n0 + tl.arange(0, BLOCK_N)
        k = _paged_rows(KC, Table, b_table, offs_n, n_end, hkv, offs_d, stride_kc_blk,
                        stride_kc_slot, stride_kc_h, BLOCK_SIZE, HEAD_DIM)
        s = _scores(q, k, offs_i, offs_n, KC, 0, 0, Lq, n_end, qk_scale, band_lo, band_hi,
                    False, False, LO_BOUNDED, HI_BOUNDED, True, False, DOT_PRECISION)
        m_new = tl.maximum(m_i, tl.max(s, 1))
        m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
        alpha = tl.exp2(m_i - m_safe)
        p = tl.exp2(s - m_safe[:, None])
        if CAREFUL:
            allowed = _in_band(offs_i, offs_n, Lq, n_end, band_lo, band_hi, LO_BOUNDED,
                               HI_BOUNDED, False)
            p = tl.where(allowed, p, 0.0)
        l_i = l_i * alpha + tl.sum(p, 1)
        v = _paged_rows(VC, Table, b_table, offs_n, n_end, hkv, offs_dv, stride_vc_blk,
                        stride_vc_slot, stride_vc_h, BLOCK_SIZE, HEAD_DIM_V)
        if CAREFUL:
            acc = _masked_dot(acc * alpha[:, None], p, v, allowed, DOT_PRECISION, BLOCK_N)
        else:
            acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION)
        m_i = m_new
    return _fwd_finish(acc, m_i, l_i, 1.0, False)


@triton.jit
def _paged_fwd_kernel(
    Q, KC, VC, Table, Seqlens, OPart, LsePart,
    stride_q_b, stride_q_h, stride_q_m,
    stride_kc_blk, stride_kc_slot, stride_kc_h,
    stride_vc_blk, stride_vc_slot, stride_vc_h,
    stride_t_b, H, GROUP, Lq, BLOCK_SIZE, split_len, num_splits, qk_scale, left, right,
    BOTTOM_RIGHT: tl.constexpr, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
    BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, LO_BOUNDED: tl.constexpr,
    HI_BOUNDED: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    split = tl.program_id(0)
    bhkv = tl.program_id(1)
    r0 = tl.program_id(2) * BLOCK_M
    Hkv = H // GROUP
    b = (bhkv // Hkv).to(tl.int64)
    hkv = (bhkv % Hkv).to(tl.int64)
    Lk = tl.load(Seqlens + b)
    band_lo, band_hi = _seq_band(Lq, Lk, left, right, BOTTOM_RIGHT)

    offs_r = r0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q, offs_i, h, row_ok = _paged_queries(Q, b, hkv, GROUP, Lq, offs_r, offs_d, stride_q_b,
                                          stride_q_h, stride_q_m, HEAD_DIM)

    # Keys of this split that some query row (0 <= i < Lq) may see.
    n_lo = tl.maximum(tl.maximum(split * split_len, band_lo), 0)
    n_lo = (n_lo // BLOCK_N) * BLOCK_N
    n_end = tl.minimum(tl.minimum((split + 1) * split_len, Lk), Lq - 1 + band_hi + 1)

    b_table = b * stride_t_b
    out, lse = _paged_tiles(
        q, KC, VC, Table, b_table, hkv, offs_i, offs_d, offs_dv, n_lo, n_end, Lq, stride_kc_blk,
        stride_kc_slot, stride_kc_h, stride_vc_blk, stride_vc_slot, stride_vc_h, BLOCK_SIZE,
        qk_scale, band_lo, band_hi, HEAD_DIM, HEAD_DIM_V, BLOCK_DV, LO_BOUNDED, HI_BOUNDED,
        DOT_PRECISION, BLOCK_M, BLOCK_N, False)
    if _any_nan(out, row_ok):  # the NaN rule: kernels.attention's careful path, 16 x 16
        for r in range(0, BLOCK_M, 16):  # (names of their own: loop-carried values keep a shape)
            q16, offs_i16, h16, ok16 = _paged_queries(Q, b, hkv, GROUP, Lq,
                                                      r0 + r + tl.arange(0, 16), offs_d,
                                                      stride_q_b, stride_q_h, stride_q_m, HEAD_DIM)
            out16, lse16 = _paged_tiles(
                q16, KC, VC, Table, b_table, hkv, offs_i16, offs_d, offs_dv, n_lo, n_end, Lq,
                stride_kc_blk, stride_kc_slot, stride_kc_h, stride_vc_blk, stride_vc_slot,
                stride_vc_h, BLOCK_SIZE, qk_scale, band_lo, band_hi, HEAD_DIM, HEAD_DIM_V,
                BLOCK_DV, LO_BOUNDED, HI_BOUNDED, DOT_PRECISION, 16, 16, True)
            _paged_store(OPart, LsePart, b, H, h16, Lq, offs_i16, num_splits, split, offs_dv,
                         out16, lse16, ok16, HEAD_DIM_V)
    else:
        _paged_store(OPart, LsePart, b, H, h, Lq, offs_i, num_splits, split, offs_dv, out, lse,
                     row_ok, HEAD_DIM_V)


@triton.jit
def _paged_merge_kernel(OPart, LsePart, Out, Lse, num_splits, HEAD_DIM_V: tl.constexpr,
                        BLOCK_S: tl.constexpr, BLOCK_DV: tl.constexpr, CHUNK: tl.constexpr):
    """One row's split partials (num_splits of them, float32) merged: lse = logsumexp_s lse_s,
    O = sum_s exp(lse_s - lse) O_s, as torch.logsumexp and a weighted sum would (a row no split
    attended: lse -inf, O 0; a NaN propagates). One program a row, the splits CHUNK at a time."""
    row = tl.program_id(0).to(tl.int64)
    offs_s = tl.arange(0, BLOCK_S)
    part = row * num_splits
    lse_s = tl.load(LsePart + part + offs_s, mask=offs_s < num_splits, other=float("-inf"))
    m = tl.max(lse_s, 0)
    m = tl.where((m == float("inf")) | (m == float("-inf")), 0.0, m)  # (as torch.logsumexp)
    lse = tl.log(tl.sum(tl.exp(lse_s - m), 0)) + m
    lse_safe = tl.where(lse == float("-inf"), 0.0, lse)
    offs_dv = tl.arange(0, BLOCK_DV)
    acc = tl.zeros([BLOCK_DV], dtype=tl.float32)
    for s0 in range(0, num_splits, CHUNK):
        offs_c = s0 + tl.arange(0, CHUNK)
        ok = offs_c < num_splits
        w = tl.exp(tl.load(LsePart + part + offs_c, mask=ok, other=float("-inf")) - lse_safe)
        o = tl.load(OPart + (part + offs_c)[:, None] * HEAD_DIM_V + offs_dv[None, :],
                    mask=ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)
        acc += tl.sum(w[:, None] * o, 0)
    tl.store(Out + row * HEAD_DIM_V + offs_dv, acc.to(Out.dtype.element_ty),
             mask=offs_dv < HEAD_DIM_V)
    tl.store(Lse + row, lse)


# ---------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------

def _limits(q, k, v, what=""):
    """The kernels' own limits (the arguments are checked once, by fastattn.ops): dtypes, head
    dims up to 256 and a unit stride on the last dim of q, k and v (``what``: "_cache" for the paged
    caches). Returns the head dims (D, Dv)."""
    for name, x in (("q", q), (f"k{what}", k), (f"v{what}", v)):
        tuning.check_layout("packed/paged attention", name, x, _DTYPES)
    D, Dv = q.shape[-1], v.shape[-1]
    if max(D, Dv) > _MAX_HEAD_DIM:
        raise ValueError(f"the triton kernels take head dims up to {_MAX_HEAD_DIM}, got {D} and {Dv}")
    return D, Dv


def _band_flags(left, right, unbounded):
    return left < unbounded, right < unbounded


def varlen_forward(q, k, v, cu_q, cu_k, max_q, max_k, scale, bottom_right, left, right, dropout_p, seed):
    """Packed forward; returns out (total_q, H, Dv) and lse (H, total_q) float32. cu_seqlens must
    be valid (checked by fastattn.varlen_attention) and max_seqlen_* at least every length: the
    grid covers max_seqlen blocks and each program reads its sequence's bounds."""
    D, Dv = _limits(q, k, v)
    H, Hkv, batch = q.shape[1], k.shape[1], cu_q.shape[0] - 1
    total_q = q.shape[0]
    out = torch.empty((total_q, H, Dv), dtype=q.dtype, device=q.device)
    lse = torch.empty((H, total_q), dtype=torch.float32, device=q.device)
    if total_q == 0 or batch == 0 or max_q == 0:
        return out, lse
    seed32, threshold, rcp_keep, has_dropout = _dropout_args(dropout_p, seed)
    lo_b, hi_b = _band_flags(left, right, max_q + max_k)
    block_m, block_n, warps, stages, _ = _tiles(D, Dv, q.dtype)
    grid = (tuning.cdiv(max_q, block_m), batch, H)
    tuning.wrap_triton(_varlen_fwd_kernel)[grid](
        q, k, v, out, lse, cu_q, cu_k,
        q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
        out.stride(0), out.stride(1),
        total_q, H, H // Hkv, scale * _LOG2E.value, left, right, seed32, threshold, rcp_keep,
        BOTTOM_RIGHT=bool(bottom_right), HEAD_DIM=D, HEAD_DIM_V=Dv, BLOCK_D=_head_block(D),
        BLOCK_DV=_head_block(Dv), LO_BOUNDED=lo_b, HI_BOUNDED=hi_b, HAS_DROPOUT=has_dropout,
        DOT_PRECISION=_dot_precision(q.dtype), BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=warps, num_stages=stages,
    )
    return out, lse


def varlen_backward(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, bottom_right, left,
                    right, dropout_p, seed):
    """Packed backward; returns dq, dk, dv shaped like q, k, v (dk, dv summed over GQA groups)."""
    D, Dv = _limits(q, k, v)
    H, Hkv, batch = q.shape[1], k.shape[1], cu_q.shape[0] - 1
    total_q = q.shape[0]
    for name, x in (("out", out), ("dout", dout)):
        tuning.check_layout("packed/paged attention", name, x, (q.dtype,))
    lse = lse.contiguous()
    dq = torch.zeros_like(q, memory_format=torch.contiguous_format)
    dk = torch.zeros_like(k, memory_format=torch.contiguous_format)
    dv = torch.zeros_like(v, memory_format=torch.contiguous_format)
    if batch == 0 or (total_q == 0 and k.shape[0] == 0):
        return dq, dk, dv
    seed32, threshold, rcp_keep, has_dropout = _dropout_args(dropout_p, seed)
    lo_b, hi_b = _band_flags(left, right, max_q + max_k)
    consts = dict(
        BOTTOM_RIGHT=bool(bottom_right), HEAD_DIM=D, HEAD_DIM_V=Dv, BLOCK_D=_head_block(D),
        BLOCK_DV=_head_block(Dv), LO_BOUNDED=lo_b, HI_BOUNDED=hi_b, HAS_DROPOUT=has_dropout,
        DOT_PRECISION=_dot_precision(q.dtype),
    )

    def shape(kernel):
        block_m, block_n, warps, stages, _ = _tiles(D, Dv, q.dtype, kernel)
        return dict(BLOCK_M=block_m, BLOCK_N=block_n, num_warps=warps, num_stages=stages)
    scalars = (total_q, H, H // Hkv, scale, scale * _LOG2E.value, left, right, seed32, threshold,
               rcp_keep)
    delta = torch.empty((H, total_q), dtype=torch.float32, device=q.device)
    if total_q:
        # delta = rowsum(dO * O): the dense preprocess on the (1, H, total_q) view.
        _bwd_delta(out, dout, delta, (0, out.stride(1), out.stride(0), 0, dout.stride(1),
                                      dout.stride(0)), H, H, total_q, Dv)
    if max_k:
        dkdv = shape("dkdv")
        grid = (tuning.cdiv(max_k, dkdv["BLOCK_N"]), batch, Hkv)
        tuning.wrap_triton(_varlen_dkdv_kernel)[grid](
            q, k, v, dout, lse, delta, dk, dv, cu_q, cu_k,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            dout.stride(0), dout.stride(1), dk.stride(0), dk.stride(1), dv.stride(0), dv.stride(1),
            *scalars, **consts, **dkdv,
        )
    if max_q:
        dq_shape = shape("dq")
        grid = (tuning.cdiv(max_q, dq_shape["BLOCK_M"]), batch, H)
        tuning.wrap_triton(_varlen_dq_kernel)[grid](
            q, k, v, dout, lse, delta, dq, cu_q, cu_k,
            q.stride(0), q.stride(1), k.stride(0), k.stride(1), v.stride(0), v.stride(1),
            dout.stride(0), dout.stride(1), dq.stride(0), dq.stride(1),
            *scalars, **consts, **dq_shape,
        )
    return dq, dk, dv


def _num_splits(device, programs, key_tiles):
    """Key splits so that about two programs run per SM (of kernels.tuning's target), at most
    one per key tile."""
    sms = tuning.num_sms(device)
    return max(1, min(tuning.cdiv(2 * sms, max(programs, 1)), key_tiles))


def paged_forward(q, k_cache, v_cache, block_table, cache_seqlens, scale, bottom_right, left, right,
                  num_splits=None):
    """Paged decoding forward; returns out (B, H, Lq, Dv) and lse (B, H, Lq) float32.
    block_table / cache_seqlens must be valid (checked by fastattn.paged_attention: entries of
    used slots in range, lengths within the owned blocks). ``num_splits`` (default: fill the GPU)
    sets the key splits."""
    D, Dv = _limits(q, k_cache, v_cache, "_cache")
    B, H, Lq, _ = q.shape
    _, block_size, Hkv, _ = k_cache.shape
    out = torch.empty((B, H, Lq, Dv), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, Lq), dtype=torch.float32, device=q.device)
    if out.numel() == 0 and lse.numel() == 0:
        return out, lse
    max_len = block_table.shape[1] * block_size
    rows = (H // Hkv) * Lq
    tile_m, block_n, warps, stages, options = _tiles(D, Dv, q.dtype, "paged")
    block_m = max(16, min(tuning.next_power_of_2(rows), tile_m))
    row_tiles = tuning.cdiv(rows, block_m)
    key_tiles = max(1, tuning.cdiv(max_len, block_n))
    splits = num_splits or _num_splits(q.device, B * Hkv * row_tiles, key_tiles)
    split_len = tuning.cdiv(tuning.cdiv(max(max_len, 1), splits), block_n) * block_n
    o_part = torch.empty((B, H, Lq, splits, Dv), dtype=torch.float32, device=q.device)
    lse_part = torch.empty((B, H, Lq, splits), dtype=torch.float32, device=q.device)
    block_table = block_table.contiguous()
    cache_seqlens = cache_seqlens.contiguous()
    lo_b, hi_b = _band_flags(left, right, Lq + max_len)
    tuning.wrap_triton(_paged_fwd_kernel)[(splits, B * Hkv, row_tiles)](
        q, k_cache, v_cache, block_table, cache_seqlens, o_part, lse_part,
        q.stride(0), q.stride(1), q.stride(2),
        k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
        v_cache.stride(0), v_cache.stride(1), v_cache.stride(2),
        block_table.stride(0), H, H // Hkv, Lq, block_size, split_len, splits,
        scale * _LOG2E.value, left, right,
        BOTTOM_RIGHT=bool(bottom_right), HEAD_DIM=D, HEAD_DIM_V=Dv, BLOCK_D=_head_block(D),
        BLOCK_DV=_head_block(Dv), LO_BOUNDED=lo_b, HI_BOUNDED=hi_b,
        DOT_PRECISION=_dot_precision(q.dtype), BLOCK_M=block_m, BLOCK_N=block_n,
        num_warps=warps, num_stages=stages, **options,
    )
    # Merge the splits, one launch (it was seven torch ops: their launches outlasted a batch-1
    # decode step's kernel).
    tuning.wrap_triton(_paged_merge_kernel)[(B * H * Lq,)](
        o_part, lse_part, out, lse, splits, HEAD_DIM_V=Dv,
        BLOCK_S=max(16, tuning.next_power_of_2(splits)), BLOCK_DV=_head_block(Dv), CHUNK=8, num_warps=4)
    return out, lse
