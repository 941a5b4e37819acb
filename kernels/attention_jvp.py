"""Forward-mode AD (the Jacobian-vector product) of fused attention in Triton.

Math (per batch ``b`` and query head ``h``; kv head ``h // (H // Hkv)``), with the tangents
Q', K', V' and M' of q, k, v and a float mask (any may be absent = zero)::

    S    = scale * Q K^T + M,   P = softmax(S) (-inf outside the band / mask),   O = (P * Z) V
    S'   = scale * (Q' K^T + Q K'^T) + M'
    lse' = rowsum(P * S')
    O'   = ((P * (S' - lse')) * Z) V + (P * Z) V'  =  ((P * S') * Z) V + (P * Z) V' - lse' * O

Work split: one program per (BLOCK_M query rows, b, h), as the forward (kernels/attention.py).
It streams over the key tiles that intersect the band with the online softmax (running max
and sum in log2 units) and three accumulators rescaled together: ``acc_o = sum (p Z) v``,
``acc_t = sum (p s' Z) v + (p Z) v'`` and ``ls = sum p s'``; the row ends with
``O = acc_o / l``, ``lse' = ls / l``, ``O' = acc_t / l - lse' O``. The pass recomputes O (one
more dot than the forward) rather than reading the forward's output, so the tangent does not
depend on the saved statistics. Memory O(L): no Lq x Lk matrix. Every tile takes the edge
path (band and bounds checks); the forward's interior-tile split and TMA path are not used here.

Masked-out entries (P = 0) contribute nothing to lse' or O', whatever S' holds there; a row
with nothing to attend gets O' = 0 and lse' = 0. Dropout uses the forward's keep-mask
(``rng.dropout_keep``); lse' is that of the undropped softmax.

Precision: scores, statistics and accumulators float32; P and P * S' are cast to the input
dtype for the dots with V (as the forward's P); O' in the input dtype, lse' float32.
Limits: as the forward (float16 / bfloat16 / float32, head dims up to 256, offsets within a
(batch, head) slice in int32).
"""

import torch
import triton
import triton.language as tl

from . import tuning
from .attention import _configs, _dot, _key_tiles, _load_rows, _prune, _query_block, _scores
from .attention_launch import _prepare, _strides3
from .rng import dropout_keep

_JVP_CONFIGS = _configs(
    [(64, 64, 4, 2), (64, 32, 4, 2), (32, 64, 4, 2), (32, 32, 4, 1), (16, 32, 4, 1)],
    (16, 16, 4, 1),
)

# Live tile values per thread the JVP may hold without spilling on sm_90: two accumulators
# (BM x DV), q and q' (BM x D, 16-bit: half a register each), and S / S' / P / P S' (two
# BM x BN at a time). Measured with Triton 3.9 (python -m fastattn.aot --case jvp): bf16 D128
# 64x32 w4 (224) holds, 64x64 w4 (256) spills 60 B.
_JVP_VALUES_PER_THREAD = 224


def _jvp_live_values(c, block_d, block_dv, elem_bytes):
    bm, bn = c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]
    half = elem_bytes / 4
    return (2 * bm * block_dv + 2 * bm * bn + 2 * bm * block_d * half) / (32 * c.num_warps)


def _prune_jvp(configs, named_args, **kwargs):
    """The forward's pruning (kernels.attention._prune on the pointer path) of the configs
    within the JVP's own register budget (:data:`_JVP_VALUES_PER_THREAD`)."""
    args = {**named_args, **kwargs}
    elem = args["Q"].element_size()

    def live(c):
        return _jvp_live_values(c, args["BLOCK_D"], args["BLOCK_DV"], elem)

    fits = [c for c in configs if live(c) <= _JVP_VALUES_PER_THREAD] or [min(configs, key=live)]
    return _prune(fits, named_args, kernel="fwd", **{**kwargs, "USE_TMA": False})


@triton.jit
def _jvp_tile(acc_o, acc_t, m_i, l_i, ls_i, q, tq, k_base, tk_base, v_base, tv_base, mask_base,
              tmask_base, offs_m, offs_d, offs_dv, n0, stride_k_n, stride_tk_n, stride_v_n,
              stride_tv_n, stride_mask_m, stride_mask_n, stride_tmask_m, stride_tmask_n, Lq, Lk,
              scale, qk_scale, band_lo, band_hi, seed, bh, threshold,
              HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
              BLOCK_DV: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr,
              HAS_TQ: tl.constexpr, HAS_TK: tl.constexpr, HAS_TV: tl.constexpr,
              HAS_TMASK: tl.constexpr, LO_BOUNDED: tl.constexpr, HI_BOUNDED: tl.constexpr,
              HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr):
    """One online-softmax step of the JVP over the key tile starting at n0."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    k = _load_rows(k_base, offs_n, stride_k_n, offs_d, Lk, HEAD_DIM, BLOCK_D, True)
    s = _scores(q, k, offs_m, offs_n, mask_base, stride_mask_m, stride_mask_n, Lq, Lk, qk_scale,
                band_lo, band_hi, HAS_MASK, MASK_BOOL, LO_BOUNDED, HI_BOUNDED, True, False,
                DOT_PRECISION)
    # S' (natural units)
    ts = tl.zeros(s.shape, dtype=tl.float32)
    if HAS_TQ:
        ts += _dot(tq, tl.trans(k), DOT_PRECISION)
    if HAS_TK:
        tk = _load_rows(tk_base, offs_n, stride_tk_n, offs_d, Lk, HEAD_DIM, BLOCK_D, True)
        ts += _dot(q, tl.trans(tk), DOT_PRECISION)
    ts = ts * scale
    if HAS_TMASK:
        in_bounds = (offs_m[:, None] < Lq) & (offs_n[None, :] < Lk)
        tm = tl.load(tmask_base + offs_m[:, None] * stride_tmask_m + offs_n[None, :] * stride_tmask_n,
                     mask=in_bounds, other=0.0)
        ts += tm.to(tl.float32)
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    pts = tl.where(s == float("-inf"), 0.0, p * ts)  # masked-out: nothing, whatever S' is there
    l_i = l_i * alpha + tl.sum(p, 1)
    ls_i = ls_i * alpha + tl.sum(pts, 1)
    if HAS_DROPOUT:
        keep = dropout_keep(seed, bh, offs_m[:, None], offs_n[None, :], Lk, threshold)
        p = tl.where(keep, p, 0.0)
        pts = tl.where(keep, pts, 0.0)
    v = _load_rows(v_base, offs_n, stride_v_n, offs_dv, Lk, HEAD_DIM_V, BLOCK_DV, True)
    acc_o = acc_o * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION)
    acc_t = acc_t * alpha[:, None] + _dot(pts.to(v.dtype), v, DOT_PRECISION)
    if HAS_TV:
        tv = _load_rows(tv_base, offs_n, stride_tv_n, offs_dv, Lk, HEAD_DIM_V, BLOCK_DV, True)
        acc_t += _dot(p.to(tv.dtype), tv, DOT_PRECISION)
    return acc_o, acc_t, m_new, l_i, ls_i


@triton.autotune(configs=_JVP_CONFIGS,
                 key=["lq_bucket", "lk_bucket", "HEAD_DIM", "HEAD_DIM_V", "HAS_MASK", "HAS_TQ",
                      "HAS_TK", "HAS_TV", "HAS_TMASK", "LO_BOUNDED", "HI_BOUNDED", "HAS_DROPOUT"],
                 prune_configs_by={"early_config_prune": _prune_jvp},
                 do_bench=tuning.do_bench)
@triton.jit(do_not_specialize=["lq_bucket", "lk_bucket", "seed", "threshold"])
def _attn_jvp_kernel(
    Q, K, V, TQ, TK, TV, Mask, TMask, TOut, TLse,
    stride_q_b, stride_q_h, stride_q_m,
    stride_k_b, stride_k_h, stride_k_n,
    stride_v_b, stride_v_h, stride_v_n,
    stride_tq_b, stride_tq_h, stride_tq_m,
    stride_tk_b, stride_tk_h, stride_tk_n,
    stride_tv_b, stride_tv_h, stride_tv_n,
    stride_to_b, stride_to_h, stride_to_m,
    stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n,
    stride_tmask_b, stride_tmask_h, stride_tmask_m, stride_tmask_n,
    H, GROUP, Lq, Lk, lq_bucket, lk_bucket, scale, qk_scale, band_lo, band_hi, seed, threshold,
    rcp_keep,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr,
    HAS_TQ: tl.constexpr, HAS_TK: tl.constexpr, HAS_TV: tl.constexpr, HAS_TMASK: tl.constexpr,
    LO_BOUNDED: tl.constexpr, HI_BOUNDED: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    bh, b, h, hkv, m0 = _query_block(H, GROUP, Lq, BLOCK_M)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    q = _load_rows(Q + b * stride_q_b + h * stride_q_h, offs_m, stride_q_m, offs_d, Lq, HEAD_DIM,
                   BLOCK_D, True)
    tq = q
    if HAS_TQ:
        tq = _load_rows(TQ + b * stride_tq_b + h * stride_tq_h, offs_m, stride_tq_m, offs_d, Lq,
                        HEAD_DIM, BLOCK_D, True)
    k_base = K + b * stride_k_b + hkv * stride_k_h
    tk_base = TK + b * stride_tk_b + hkv * stride_tk_h
    v_base = V + b * stride_v_b + hkv * stride_v_h
    tv_base = TV + b * stride_tv_b + hkv * stride_tv_h
    mask_base = Mask + b * stride_mask_b + h * stride_mask_h
    tmask_base = TMask + b * stride_tmask_b + h * stride_tmask_h

    acc_o = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    acc_t = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
    m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
    l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    ls_i = tl.zeros([BLOCK_M], dtype=tl.float32)
    n_base, num, _, _ = _key_tiles(m0, Lq, Lk, band_lo, band_hi, BLOCK_M, BLOCK_N)
    for t in range(0, num):
        acc_o, acc_t, m_i, l_i, ls_i = _jvp_tile(
            acc_o, acc_t, m_i, l_i, ls_i, q, tq, k_base, tk_base, v_base, tv_base, mask_base,
            tmask_base, offs_m, offs_d, offs_dv, n_base + t * BLOCK_N, stride_k_n, stride_tk_n,
            stride_v_n, stride_tv_n, stride_mask_m, stride_mask_n, stride_tmask_m,
            stride_tmask_n, Lq, Lk, scale, qk_scale, band_lo, band_hi, seed, bh, threshold,
            HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, HAS_MASK, MASK_BOOL, HAS_TQ, HAS_TK, HAS_TV,
            HAS_TMASK, LO_BOUNDED, HI_BOUNDED, HAS_DROPOUT, DOT_PRECISION, BLOCK_N)

    dead = l_i == 0.0
    inv = tl.where(dead, 0.0, 1.0 / tl.where(dead, 1.0, l_i))
    tlse = ls_i * inv
    out = acc_o * inv[:, None]
    tout = acc_t * inv[:, None]
    if HAS_DROPOUT:
        out = out * rcp_keep
        tout = tout * rcp_keep
    tout = tout - tlse[:, None] * out

    row_ok = offs_m < Lq
    to_ptrs = TOut + b * stride_to_b + h * stride_to_h + offs_m[:, None] * stride_to_m + offs_dv[None, :]
    tl.store(to_ptrs, tout.to(TOut.dtype.element_ty),
             mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V))
    tl.store(TLse + bh.to(tl.int64) * Lq + offs_m, tlse, mask=row_ok)


def attention_jvp(q, k, v, mask, tq, tk, tv, tmask, scale, offset, left, right, dropout_p, seed):
    """Tangents ``(tout, tlse)`` of attention's ``(out, lse)`` along ``tq, tk, tv`` (shaped like
    q, k, v) and ``tmask`` (like a float mask); None = zero; checked by fastattn.ops. Arguments
    otherwise as :func:`kernels.attention_launch.attention_forward`. tout (B, H, Lq, Dv) in q's
    dtype, tlse (B, H, Lq) float32."""
    c = _prepare(q, k, v, mask, scale, offset, left, right, dropout_p, seed)
    B, H, Lq, Dv, q, k, v = c.B, c.H, c.Lq, c.Dv, c.q, c.k, c.v
    # absent tangents: their primal stands in as an unused pointer (HAS_T* False)
    tq_, tk_, tv_ = (p if t is None else t for t, p in ((tq, q), (tk, k), (tv, v)))
    for name, t in (("tq", tq_), ("tk", tk_), ("tv", tv_)):
        tuning.check_layout("attention JVP", name, t, (q.dtype,))
    tout = torch.empty((B, H, Lq, Dv), dtype=q.dtype, device=q.device)
    tlse = torch.empty((B, H, Lq), dtype=torch.float32, device=q.device)
    if B * H == 0:
        return tout, tlse

    def grid(meta):
        return (tuning.cdiv(Lq, meta["BLOCK_M"]) * B * H,)

    kernel = tuning.wrap_triton(_attn_jvp_kernel)[grid]
    kernel(
        q, k, v, tq_, tk_, tv_, c.mask, q if tmask is None else tmask, tout, tlse,
        *_strides3(q, k, v, tq_, tk_, tv_, tout),
        *c.mask_strides, *((0, 0, 0, 0) if tmask is None else tmask.stride()), *c.scalars,
        HAS_TQ=tq is not None, HAS_TK=tk is not None, HAS_TV=tv is not None,
        HAS_TMASK=tmask is not None, **c.consts,
    )
    return tout, tlse
