"""Float64 NumPy reference implementations: the ground truth for every backend.

Everything here follows ``docs/numerics.md``:

* a bool mask is True where attention is **allowed**, a float mask is **added** to the scaled
  scores ``scale * q @ k^T``;
* causal masks and sliding windows are one *band*: query ``i`` may attend key ``j`` iff
  ``i + offset - left <= j <= i + offset + right``;
* a row with nothing to attend outputs 0, has LSE ``-inf`` and zero gradients (never NaN);
* dropout uses the shared counter-based hash RNG (:func:`dropout_keep_mask`).

The module uses NumPy only. Every function accepts anything ``np.asarray`` accepts, computes in
float64 and returns float64 arrays (bool arrays for masks). The code favours clarity over speed:
each function is a direct transcription of the formula in its docstring.
"""

import math

import numpy as np

from fastattn import activations as act
from fastattn.activations import ACTIVATIONS, GATED as GATED_ACTIVATIONS

__all__ = [
    "ACTIVATIONS",
    "GATED_ACTIVATIONS",
    "activation",
    "activation_backward",
    "attention",
    "attention_backward",
    "band_mask",
    "dropout_keep_mask",
    "ffn",
    "ffn_backward",
    "fmix32",
    "layer_norm",
    "layer_norm_backward",
    "linear",
    "multi_head_attention",
    "paged_attention",
    "paged_cache_append",
    "rms_norm",
    "rms_norm_backward",
    "sinusoidal_positional_encoding",
    "softmax",
    "softmax_backward",
    "structural_band",
    "transformer_block",
    "varlen_attention",
    "varlen_attention_backward",
]

_U32 = 0xFFFFFFFF


def _f64(x):
    return np.asarray(x, dtype=np.float64)


def _sum_to_shape(g, shape):
    """Sum ``g`` down to ``shape`` (the inverse of NumPy broadcasting)."""
    shape = tuple(shape)
    extra = g.ndim - len(shape)
    if extra > 0:
        g = g.sum(axis=tuple(range(extra)))
    axes = tuple(a for a, n in enumerate(shape) if n == 1 and g.shape[a] != 1)
    if axes:
        g = g.sum(axis=axes, keepdims=True)
    return g.reshape(shape)


# ---------------------------------------------------------------------------------------------
# Dropout RNG
# ---------------------------------------------------------------------------------------------

def _as_u32_array(x):
    """``x`` modulo 2**32, held in a uint64 array (so that products never overflow)."""
    if isinstance(x, (int, np.integer)):
        return np.asarray(int(x) % (1 << 32), dtype=np.uint64)
    return np.asarray(x).astype(np.uint64) & np.uint64(_U32)


def _fmix32_u64(x):
    """fmix32 on uint64 arrays holding values < 2**32; products are < 2**64, so no overflow."""
    m = np.uint64(_U32)
    x = x ^ (x >> np.uint64(16))
    x = (x * np.uint64(0x85EBCA6B)) & m
    x = x ^ (x >> np.uint64(13))
    x = (x * np.uint64(0xC2B2AE35)) & m
    x = x ^ (x >> np.uint64(16))
    return x


def fmix32(x):
    """MurmurHash3's 32-bit finaliser, elementwise, with uint32 wrapping arithmetic.

    ``x`` is taken modulo 2**32. Returns uint32 (a 0-d array for a scalar input). The steps:
    ``x ^= x >> 16``, ``x *= 0x85EBCA6B``, ``x ^= x >> 13``, ``x *= 0xC2B2AE35``,
    ``x ^= x >> 16``, each product taken modulo 2**32 (tests/test_reference.py checks this
    against a pure-Python version).
    """
    return _fmix32_u64(_as_u32_array(x)).astype(np.uint32)


def dropout_keep_mask(seed, B, H, Lq, Lk, p):
    """Boolean keep-mask of shape ``(B, H, Lq, Lk)`` from the shared counter-based RNG.

    All arithmetic is on uint32, wrapping mod 2**32 (``H`` is the number of *query* heads)::

        stream(b, h)  = fmix32(seed + 0x9E3779B9 * (b * H + h))
        r(b, h, i, j) = fmix32(fmix32(i * Lk + j) ^ stream(b, h))
        keep          = r >= floor(p * 2**32)

    Pure-Python definition (``fmix32`` as in :func:`fmix32`)::

        def keep(seed, B, H, Lq, Lk, p, b, h, i, j):
            M = 0xFFFFFFFF
            stream = fmix32((seed + 0x9E3779B9 * (b * H + h)) & M)
            r = fmix32(fmix32((i * Lk + j) & M) ^ stream)
            return r >= math.floor(p * 2**32)

    So ``P(keep) = 1 - p`` up to 2**-32; ``p = 0`` keeps everything and ``p = 1`` nothing.
    """
    if not 0.0 <= p <= 1.0:
        raise ValueError(f"dropout probability must be in [0, 1], got {p}")
    m = np.uint64(_U32)
    bh = np.arange(B * H, dtype=np.uint64).reshape(B, H, 1, 1)
    stream = _fmix32_u64((_as_u32_array(seed) + np.uint64(0x9E3779B9) * bh) & m)
    i = np.arange(Lq, dtype=np.uint64).reshape(Lq, 1)
    j = np.arange(Lk, dtype=np.uint64).reshape(1, Lk)
    counter = (i * np.uint64(Lk) + j) & m
    r = _fmix32_u64(_fmix32_u64(counter) ^ stream)
    threshold = math.floor(p * 2**32)
    return r >= np.uint64(threshold) if threshold < 2**32 else np.zeros(r.shape, dtype=bool)


# ---------------------------------------------------------------------------------------------
# Bands (causal masks and sliding windows)
# ---------------------------------------------------------------------------------------------

def band_mask(Lq, Lk, offset, left, right):
    """Bool ``(Lq, Lk)``: query ``i`` may attend key ``j`` iff
    ``i + offset - left <= j <= i + offset + right``."""
    i = np.arange(Lq).reshape(Lq, 1)
    j = np.arange(Lk).reshape(1, Lk)
    return (j >= i + offset - left) & (j <= i + offset + right)


def structural_band(Lq, Lk, causal=False, window=None):
    """The ``(offset, left, right)`` band of a causal flag and/or a sliding window.

    * ``causal``: ``False`` (none), ``True`` or ``"top_left"`` (SDPA's ``is_causal``,
      ``offset = 0``), ``"bottom_right"`` (``offset = Lk - Lq``, for KV caches);
    * ``window``: ``None`` or ``(left, right)``, either side ``None`` for unbounded; it is aligned
      bottom-right with ``causal="bottom_right"``, top-left otherwise;
    * causal sets ``right = 0`` (``min(right, 0)`` together with a window);
    * an unbounded side is encoded as ``Lq + Lk``, which no ``|i + offset - j|`` reaches.

    With neither causal nor window the band allows everything.
    """
    if causal not in (False, True, "top_left", "bottom_right"):
        raise ValueError(
            f"causal must be False, True, 'top_left' or 'bottom_right', got {causal!r}")
    unbounded = Lq + Lk
    offset = Lk - Lq if causal == "bottom_right" else 0
    left = right = unbounded
    if window is not None:
        wl, wr = window
        left = unbounded if wl is None else int(wl)
        right = unbounded if wr is None else int(wr)
    if causal is not False:
        right = min(right, 0)
    return offset, left, right


# ---------------------------------------------------------------------------------------------
# Softmax
# ---------------------------------------------------------------------------------------------

def _additive_mask(mask):
    """Bool mask (True = keep) -> 0 / -inf; float mask unchanged; None -> 0."""
    if mask is None:
        return 0.0
    mask = np.asarray(mask)
    if mask.dtype == np.bool_:
        return np.where(mask, 0.0, -np.inf)
    return _f64(mask)


def _masked_softmax(s):
    """Row softmax of ``s`` (last axis) with ``-inf`` entries; returns ``(probs, lse)``.

    ``lse = m + log(sum_j exp(s_j - m))`` with ``m = max_j s_j``; a row with ``m = -inf`` (fully
    masked) gets probabilities 0 and ``lse = -inf``.
    """
    m = s.max(axis=-1, keepdims=True)
    dead = np.isneginf(m)
    m_safe = np.where(dead, 0.0, m)
    e = np.where(dead, 0.0, np.exp(s - m_safe))
    denom = e.sum(axis=-1, keepdims=True)
    probs = e / np.where(dead, 1.0, denom)
    with np.errstate(divide="ignore"):
        lse = np.where(dead, -np.inf, m_safe + np.log(np.where(dead, 1.0, denom)))
    return probs, lse[..., 0]


def softmax(x, mask=None, scale=1.0, is_causal=False):
    """Scaled, masked softmax over the last axis.

    ``y = softmax(scale * x + M)`` where ``M`` is the float mask, or 0 / -inf from a bool mask
    (True = keep), plus -inf above the top-left diagonal of the last two axes when ``is_causal``
    (``j > i``; ``Lq`` and ``Lk`` may differ). Fully masked rows are all zeros.
    """
    x = _f64(x)
    s = scale * x + _additive_mask(mask)
    if is_causal:
        Lq, Lk = x.shape[-2:]
        s = np.where(band_mask(Lq, Lk, *structural_band(Lq, Lk, causal=True)), s, -np.inf)
    return _masked_softmax(s)[0]


def softmax_backward(dy, y, scale=1.0):
    """Gradient w.r.t. ``x`` of ``y = softmax(scale * x + M)``:

        dx = scale * y * (dy - sum_j dy_j y_j)

    Fully masked rows have ``y = 0`` and hence ``dx = 0``.
    """
    dy, y = _f64(dy), _f64(y)
    return scale * y * (dy - (dy * y).sum(axis=-1, keepdims=True))


# ---------------------------------------------------------------------------------------------
# Attention
# ---------------------------------------------------------------------------------------------

def _expand_kv_heads(k, H, enable_gqa):
    """Repeat key/value heads so that query head ``h`` reads kv head ``h // (H // Hkv)``."""
    Hkv = k.shape[1]
    if Hkv == H:
        return k
    if not enable_gqa:
        raise ValueError(f"query has {H} heads but key/value have {Hkv}; pass enable_gqa=True")
    if Hkv == 0 or H % Hkv != 0:
        raise ValueError(f"number of query heads {H} must be a multiple of kv heads {Hkv}")
    return np.repeat(k, H // Hkv, axis=1)


def _reduce_kv_heads(dk, Hkv):
    """Sum the gradient of the repeated heads back over each GQA group."""
    B, H, L, D = dk.shape
    return dk.reshape(B, Hkv, H // Hkv, L, D).sum(axis=2)


def _attention_probs(q, k, mask, scale, causal, window):
    """Scores ``S = scale * q k^T + M`` (mask and band as -inf), then ``(P, lse, allowed)``.

    ``allowed`` (broadcast to ``P``'s shape) is True where query i attends key j: inside the band,
    bool mask True, float mask not -inf. Outside it ``S = -inf`` and ``P = 0`` exactly, whatever
    q, k or the mask hold there (the NaN rule of docs/numerics.md: a NaN in a row that attends it
    makes the whole row's P and lse NaN, and only the attended entries).
    """
    Lq, Lk = q.shape[-2], k.shape[-2]
    with np.errstate(invalid="ignore"):
        s = scale * (q @ np.swapaxes(k, -1, -2)) + _additive_mask(mask)
    allowed = band_mask(Lq, Lk, *structural_band(Lq, Lk, causal, window))
    if mask is not None:
        m = np.asarray(mask)
        allowed = allowed & (m if m.dtype == np.bool_ else ~np.isneginf(_f64(m)))
    allowed = np.broadcast_to(allowed, s.shape)
    s = np.where(allowed, s, -np.inf)
    with np.errstate(invalid="ignore"):
        p, lse = _masked_softmax(s)
    return np.where(allowed, p, 0.0), lse, allowed


def _attended_matmul(a, b, allowed):
    """``a @ b`` summed over the attended pairs only: ``c_ix = sum_{j: allowed_ij} a_ij b_jx``.

    ``a`` is 0 wherever ``allowed`` is False; when ``b`` is all finite that is ``a @ b``, else the
    products are formed pairwise so a NaN / inf in ``b`` meets no masked-out 0 (0 * NaN = NaN).
    """
    if np.isfinite(b).all():
        return a @ b
    with np.errstate(invalid="ignore"):
        prod = a[..., :, :, None] * b[..., None, :, :]
    return np.where(allowed[..., None], prod, 0.0).sum(axis=-2)


def _dropout_factor(B, H, Lq, Lk, dropout_p, seed):
    """``Z = keep / (1 - p)``: the dropout multiplier on the probabilities (1 when ``p = 0``)."""
    if dropout_p == 0:
        return 1.0
    if seed is None:
        raise ValueError("the reference needs an explicit seed when dropout_p > 0")
    keep = dropout_keep_mask(seed, B, H, Lq, Lk, dropout_p)
    if dropout_p >= 1:
        return np.zeros(keep.shape)
    return keep / (1.0 - dropout_p)


def _prepare(q, k, v, scale, enable_gqa):
    """float64 ``q, k, v`` with kv heads repeated to ``H``, and the scale (default 1/sqrt(D))."""
    q, k, v = _f64(q), _f64(k), _f64(v)
    if q.ndim != 4 or k.ndim != 4 or v.ndim != 4:
        raise ValueError("q, k, v must be 4-D: (B, H, Lq, D), (B, Hkv, Lk, D), (B, Hkv, Lk, Dv)")
    H = q.shape[1]
    if scale is None:
        scale = 1.0 / math.sqrt(q.shape[-1])
    return q, _expand_kv_heads(k, H, enable_gqa), _expand_kv_heads(v, H, enable_gqa), scale


def attention(q, k, v, mask=None, scale=None, causal=False, window=None, dropout_p=0.0,
              seed=None, enable_gqa=False):
    """Scaled dot-product attention with SDPA conventions; returns ``(out, lse)``.

    Shapes: ``q (B, H, Lq, D)``, ``k (B, Hkv, Lk, D)``, ``v (B, Hkv, Lk, Dv)``; with
    ``enable_gqa`` query head ``h`` reads key/value head ``h // (H // Hkv)``.

        S   = scale * q k^T + M          (scale defaults to 1/sqrt(D); M: float mask, or 0/-inf
                                          from a bool mask with True = allowed, and -inf outside
                                          the band of ``causal`` / ``window``)
        lse = log sum_j exp(S_ij)        (natural log; -inf for a fully masked row)
        P   = exp(S - lse)               (0 for a fully masked row)
        out = (P * Z) v                  (Z = keep / (1 - p), keep = dropout_keep_mask(seed, ...))

    ``out`` is ``(B, H, Lq, Dv)`` and ``lse`` is ``(B, H, Lq)``.
    """
    q, k, v, scale = _prepare(q, k, v, scale, enable_gqa)
    B, H, Lq, _ = q.shape
    p, lse, allowed = _attention_probs(q, k, mask, scale, causal, window)
    z = _dropout_factor(B, H, Lq, k.shape[2], dropout_p, seed)
    with np.errstate(invalid="ignore"):
        return _attended_matmul(p * z, v, allowed), lse


def attention_backward(dout, q, k, v, mask=None, scale=None, causal=False, window=None,
                       dropout_p=0.0, seed=None, enable_gqa=False):
    """Analytic gradients of :func:`attention`; returns ``(dq, dk, dv, dmask)``.

    With ``P`` the probabilities and ``Z`` the dropout multiplier:

        dV = (P * Z)^T dO
        dP = (dO V^T) * Z
        dS = P * (dP - rowsum(dP * P))     (= P * (dP - rowsum(dO * O)))
        dQ = scale * dS K
        dK = scale * dS^T Q

    ``dk`` and ``dv`` are summed over each GQA group (shaped like ``k`` and ``v``). ``dmask`` is
    ``dS`` summed down to ``mask.shape`` for a float mask, ``None`` for a bool mask or no mask.
    Fully masked rows have ``P = 0`` and so contribute 0 to every gradient. Every sum runs over
    the attended pairs only (``dS = 0`` elsewhere), so non-finite values at masked-out positions
    do not reach any gradient (docs/numerics.md, NaN rule).
    """
    Hkv = np.shape(k)[1]
    q, k, v, scale = _prepare(q, k, v, scale, enable_gqa)
    dout = _f64(dout)
    B, H, Lq, _ = q.shape
    p, _, allowed = _attention_probs(q, k, mask, scale, causal, window)
    z = _dropout_factor(B, H, Lq, k.shape[2], dropout_p, seed)
    allowed_t = np.swapaxes(allowed, -1, -2)
    with np.errstate(invalid="ignore"):
        dv = _attended_matmul(np.swapaxes(p * z, -1, -2), dout, allowed_t)
        dp = (dout @ np.swapaxes(v, -1, -2)) * z
        ds = np.where(allowed, p * (dp - np.where(allowed, dp * p, 0.0).sum(axis=-1, keepdims=True)), 0.0)
        dq = scale * _attended_matmul(ds, k, allowed)
        dk = scale * _attended_matmul(np.swapaxes(ds, -1, -2), q, allowed_t)
    dmask = None
    if mask is not None and np.asarray(mask).dtype != np.bool_:
        dmask = _sum_to_shape(ds, np.shape(mask))
    return dq, _reduce_kv_heads(dk, Hkv), _reduce_kv_heads(dv, Hkv), dmask


def attention_jvp(q, k, v, mask=None, tq=None, tk=None, tv=None, tmask=None, scale=None,
                  causal=False, window=None, dropout_p=0.0, seed=None, enable_gqa=False):
    """Forward-mode derivative of :func:`attention`: the tangents ``(tout, tlse)`` of
    ``(out, lse)`` along the tangents ``tq, tk, tv`` (shaped like q, k, v) and ``tmask`` (a float
    mask's, broadcastable like it); None means zero. With ``P`` the probabilities and ``Z`` the
    dropout multiplier:

        dS   = scale * (tq k^T + q tk^T) + tmask
        tlse = rowsum(P * dS)
        tout = ((P * (dS - tlse)) * Z) v + (P * Z) tv

    Fully masked rows have ``P = 0``, so both tangents are 0 there; masked-out entries
    contribute nothing, whatever ``dS`` holds there.
    """
    q, k, v, scale = _prepare(q, k, v, scale, enable_gqa)
    B, H, Lq, D = q.shape
    Lk, Dv = k.shape[2], v.shape[3]
    zero = np.zeros
    tq = zero(q.shape) if tq is None else _f64(tq)
    tk = zero(k.shape) if tk is None else _expand_kv_heads(_f64(tk), H, enable_gqa)
    tv = zero(v.shape) if tv is None else _expand_kv_heads(_f64(tv), H, enable_gqa)
    p, _, allowed = _attention_probs(q, k, mask, scale, causal, window)
    z = _dropout_factor(B, H, Lq, Lk, dropout_p, seed)
    with np.errstate(invalid="ignore"):
        ds = scale * (tq @ np.swapaxes(k, -1, -2) + q @ np.swapaxes(tk, -1, -2))
        if tmask is not None:
            ds = ds + _f64(tmask)
        pds = np.where(allowed, p * ds, 0.0)
        tlse = pds.sum(axis=-1)
        tout = (_attended_matmul((pds - p * tlse[..., None]) * z, v, allowed)
                + _attended_matmul(p * z, tv, allowed))
    return tout, tlse


# ---------------------------------------------------------------------------------------------
# Packed (variable-length) sequences and the paged KV cache
# ---------------------------------------------------------------------------------------------

def _sequence_seed(seed, b, H):
    """The seed whose batch-0 dropout streams are batch ``b``'s: ``stream(b, h)`` hashes
    ``seed + 0x9E3779B9 * (b * H + h)``, so sequence ``b`` of a packed batch draws the mask that
    batch row ``b`` of a padded ``(B, H, Lq_b, Lk_b)`` batch would."""
    if seed is None:
        return None
    return (int(seed) + 0x9E3779B9 * b * H) % (1 << 32)


def _segments(cu_seqlens):
    cu = np.asarray(cu_seqlens, dtype=np.int64)
    return [(int(cu[b]), int(cu[b + 1])) for b in range(len(cu) - 1)]


def varlen_attention(q, k, v, cu_seqlens_q, cu_seqlens_k, scale=None, causal=False, window=None,
                     dropout_p=0.0, seed=None):
    """Attention over a packed batch of sequences; returns ``(out, lse)``.

    ``q (total_q, H, D)``, ``k (total_k, Hkv, D)``, ``v (total_k, Hkv, Dv)``: sequence ``b`` is
    rows ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` of q and ``cu_seqlens_k[b]:cu_seqlens_k[b+1]`` of
    k and v. Each sequence is :func:`attention` on its own ``(1, H, Lq_b, D)`` slice, with the
    band (``causal``, ``window``) of its own lengths and GQA when ``Hkv < H``; dropout draws
    batch row ``b``'s mask (see :func:`dropout_keep_mask` with ``B`` sequences, ``Lk = Lk_b``).
    ``out`` is ``(total_q, H, Dv)``, ``lse`` ``(H, total_q)``. A sequence with ``Lk_b = 0``
    has only fully masked rows: output 0, lse -inf.
    """
    q, k, v = _f64(q), _f64(k), _f64(v)
    H = q.shape[1]
    out = np.zeros(q.shape[:2] + (v.shape[2],))
    lse = np.full((H, q.shape[0]), -np.inf)
    for b, ((q0, q1), (k0, k1)) in enumerate(zip(_segments(cu_seqlens_q), _segments(cu_seqlens_k))):
        if q1 == q0 or k1 == k0:
            continue
        o, l = attention(q[None, q0:q1].transpose(0, 2, 1, 3), k[None, k0:k1].transpose(0, 2, 1, 3),
                         v[None, k0:k1].transpose(0, 2, 1, 3), scale=scale, causal=causal,
                         window=window, dropout_p=dropout_p, seed=_sequence_seed(seed, b, H),
                         enable_gqa=True)
        out[q0:q1] = o[0].transpose(1, 0, 2)
        lse[:, q0:q1] = l[0]
    return out, lse


def varlen_attention_backward(dout, q, k, v, cu_seqlens_q, cu_seqlens_k, scale=None, causal=False,
                              window=None, dropout_p=0.0, seed=None):
    """Gradients of :func:`varlen_attention`; returns ``(dq, dk, dv)`` shaped like q, k, v.

    Per sequence, :func:`attention_backward` on its slices (dK, dV summed over GQA groups);
    rows of empty or fully masked sequences get 0.
    """
    q, k, v, dout = _f64(q), _f64(k), _f64(v), _f64(dout)
    H = q.shape[1]
    dq, dk, dv = np.zeros(q.shape), np.zeros(k.shape), np.zeros(v.shape)
    heads = lambda t: t[None].transpose(0, 2, 1, 3)  # noqa: E731  (L, H, D) -> (1, H, L, D)
    for b, ((q0, q1), (k0, k1)) in enumerate(zip(_segments(cu_seqlens_q), _segments(cu_seqlens_k))):
        if q1 == q0 or k1 == k0:
            continue
        g = attention_backward(heads(dout[q0:q1]), heads(q[q0:q1]), heads(k[k0:k1]),
                               heads(v[k0:k1]), scale=scale, causal=causal, window=window,
                               dropout_p=dropout_p, seed=_sequence_seed(seed, b, H),
                               enable_gqa=True)
        dq[q0:q1], dk[k0:k1], dv[k0:k1] = (t[0].transpose(1, 0, 2) for t in g[:3])
    return dq, dk, dv


def _paged_keys(cache, block_table, b, n):
    """The first ``n`` cached rows of sequence ``b``, ``(n, Hkv, D)``: position ``t`` lives in
    block ``block_table[b, t // block_size]`` at slot ``t % block_size``."""
    block_size = cache.shape[1]
    t = np.arange(n)
    return cache[np.asarray(block_table)[b, t // block_size], t % block_size]


def paged_attention(q, k_cache, v_cache, block_table, cache_seqlens, scale=None,
                    causal="bottom_right", window=None):
    """Attention of new queries over a paged KV cache; returns ``(out, lse)``.

    ``q (B, H, Lq, D)``; caches ``(num_blocks, block_size, Hkv, D/Dv)``; ``block_table (B,
    max_blocks)`` of block indices; ``cache_seqlens (B,)`` valid keys per sequence (the new
    tokens' included). Sequence ``b`` is :func:`attention` of ``q[b]`` over its first
    ``cache_seqlens[b]`` cached keys (see :func:`_paged_keys`), with the band of
    ``(Lq, cache_seqlens[b])`` — bottom-right causal by default, so query ``i`` sees keys up to
    ``cache_seqlens[b] - Lq + i``. ``out (B, H, Lq, Dv)``, ``lse (B, H, Lq)``.
    """
    q, k_cache, v_cache = _f64(q), _f64(k_cache), _f64(v_cache)
    B, H, Lq, _ = q.shape
    out = np.zeros((B, H, Lq, v_cache.shape[-1]))
    lse = np.full((B, H, Lq), -np.inf)
    for b in range(B):
        n = int(np.asarray(cache_seqlens)[b])
        if n == 0 or Lq == 0:
            continue
        k = _paged_keys(k_cache, block_table, b, n).transpose(1, 0, 2)[None]
        v = _paged_keys(v_cache, block_table, b, n).transpose(1, 0, 2)[None]
        o, l = attention(q[b:b + 1], k, v, scale=scale, causal=causal, window=window,
                         enable_gqa=True)
        out[b], lse[b] = o[0], l[0]
    return out, lse


def paged_cache_append(k_cache, v_cache, block_table, cache_seqlens, k_new, v_new):
    """The caches after writing ``k_new``, ``v_new`` ``(B, Hkv, Lnew, D/Dv)`` at positions
    ``cache_seqlens[b] .. cache_seqlens[b] + Lnew - 1`` of each sequence (copies; the inputs
    are unchanged). Returns ``(k_cache, v_cache)``."""
    k_cache, v_cache = _f64(k_cache).copy(), _f64(v_cache).copy()
    k_new, v_new = _f64(k_new), _f64(v_new)
    block_size = k_cache.shape[1]
    table = np.asarray(block_table)
    for b in range(k_new.shape[0]):
        for i in range(k_new.shape[2]):
            t = int(np.asarray(cache_seqlens)[b]) + i
            blk, slot = table[b, t // block_size], t % block_size
            k_cache[blk, slot] = k_new[b, :, i]
            v_cache[blk, slot] = v_new[b, :, i]
    return k_cache, v_cache


# ---------------------------------------------------------------------------------------------
# Normalisation
# ---------------------------------------------------------------------------------------------

def _norm_axes(x, normalized_shape):
    if isinstance(normalized_shape, (int, np.integer)):
        normalized_shape = (int(normalized_shape),)
    normalized_shape = tuple(normalized_shape)
    n = len(normalized_shape)
    if tuple(x.shape[x.ndim - n:]) != normalized_shape:
        raise ValueError(f"trailing shape of x {x.shape} is not {normalized_shape}")
    return tuple(range(x.ndim - n, x.ndim))


def layer_norm(x, normalized_shape, weight=None, bias=None, eps=1e-5):
    """Layer normalisation over the trailing ``normalized_shape`` axes; returns
    ``(y, mean, rstd)`` with ``mean`` and ``rstd`` shaped ``x.shape[:-len(normalized_shape)]``.

        mean = E[x],   var = E[(x - mean)^2]   (biased),   rstd = 1 / sqrt(var + eps)
        y    = (x - mean) * rstd * weight + bias
    """
    x = _f64(x)
    axes = _norm_axes(x, normalized_shape)
    mean = x.mean(axis=axes, keepdims=True)
    rstd = 1.0 / np.sqrt(((x - mean) ** 2).mean(axis=axes, keepdims=True) + eps)
    y = (x - mean) * rstd
    if weight is not None:
        y = y * _f64(weight)
    if bias is not None:
        y = y + _f64(bias)
    lead = x.shape[: x.ndim - len(axes)]
    return y, mean.reshape(lead), rstd.reshape(lead)


def layer_norm_backward(dy, x, normalized_shape, weight=None, eps=1e-5):
    """Gradients of :func:`layer_norm`; returns ``(dx, dweight, dbias)``, always arrays
    (with ``weight=None`` they are the gradients a weight of ones and a zero bias would get).

    With ``xhat = (x - mean) * rstd``, ``g = dy * weight`` and ``E`` the mean over the
    normalised axes:

        dx      = rstd * (g - E[g] - xhat * E[g * xhat])
        dweight = sum over leading axes of dy * xhat
        dbias   = sum over leading axes of dy
    """
    x, dy = _f64(x), _f64(dy)
    axes = _norm_axes(x, normalized_shape)
    mean = x.mean(axis=axes, keepdims=True)
    rstd = 1.0 / np.sqrt(((x - mean) ** 2).mean(axis=axes, keepdims=True) + eps)
    xhat = (x - mean) * rstd
    g = dy if weight is None else dy * _f64(weight)
    dx = rstd * (g - g.mean(axis=axes, keepdims=True)
                 - xhat * (g * xhat).mean(axis=axes, keepdims=True))
    lead = tuple(range(x.ndim - len(axes)))
    return dx, (dy * xhat).sum(axis=lead), dy.sum(axis=lead)


def rms_norm(x, normalized_shape, weight=None, eps=1e-6):
    """RMS normalisation over the trailing ``normalized_shape`` axes; returns ``(y, rstd)``.

        rstd = 1 / sqrt(E[x^2] + eps),   y = x * rstd * weight
    """
    x = _f64(x)
    axes = _norm_axes(x, normalized_shape)
    rstd = 1.0 / np.sqrt((x * x).mean(axis=axes, keepdims=True) + eps)
    y = x * rstd
    if weight is not None:
        y = y * _f64(weight)
    return y, rstd.reshape(x.shape[: x.ndim - len(axes)])


def rms_norm_backward(dy, x, normalized_shape, weight=None, eps=1e-6):
    """Gradients of :func:`rms_norm`; returns ``(dx, dweight)``, always arrays.

    With ``xhat = x * rstd`` and ``g = dy * weight``:

        dx      = rstd * (g - xhat * E[g * xhat])
        dweight = sum over leading axes of dy * xhat
    """
    x, dy = _f64(x), _f64(dy)
    axes = _norm_axes(x, normalized_shape)
    rstd = 1.0 / np.sqrt((x * x).mean(axis=axes, keepdims=True) + eps)
    xhat = x * rstd
    g = dy if weight is None else dy * _f64(weight)
    dx = rstd * (g - xhat * (g * xhat).mean(axis=axes, keepdims=True))
    return dx, (dy * xhat).sum(axis=tuple(range(x.ndim - len(axes))))


# ---------------------------------------------------------------------------------------------
# Activations and the feed-forward block
# ---------------------------------------------------------------------------------------------

# The names (ACTIVATIONS) and which are gated (GATED_ACTIVATIONS: the input ``h`` of width
# ``2 * hidden`` splits as ``[gate, up]``) come from the one table, fastattn/activations.py.

_erf = np.vectorize(math.erf, otypes=[np.float64])
_SQRT_2_OVER_PI = math.sqrt(2.0 / math.pi)
_GELU_TANH_C = 0.044715


def _sigmoid(h):
    return 0.5 * (1.0 + np.tanh(0.5 * h))  # = 1 / (1 + exp(-h)), without overflow


def _gelu(h):
    """``gelu(h) = h * Phi(h) = 0.5 h (1 + erf(h / sqrt 2))``; returns ``(f, f')`` with
    ``f'(h) = Phi(h) + h * phi(h)``."""
    cdf = 0.5 * (1.0 + _erf(h / math.sqrt(2.0)))
    pdf = np.exp(-0.5 * h * h) / math.sqrt(2.0 * math.pi)
    return h * cdf, cdf + h * pdf


def _gelu_tanh(h):
    """``0.5 h (1 + tanh(u))``, ``u = sqrt(2/pi) (h + 0.044715 h^3)``; returns ``(f, f')`` with
    ``f' = 0.5 (1 + t) + 0.5 h (1 - t^2) sqrt(2/pi) (1 + 3 * 0.044715 h^2)``."""
    t = np.tanh(_SQRT_2_OVER_PI * (h + _GELU_TANH_C * h**3))
    du = _SQRT_2_OVER_PI * (1.0 + 3.0 * _GELU_TANH_C * h * h)
    return 0.5 * h * (1.0 + t), 0.5 * (1.0 + t) + 0.5 * h * (1.0 - t * t) * du


def _relu(h):
    """``max(h, 0)``; returns ``(f, f')`` with ``f' = [h > 0]``."""
    return np.maximum(h, 0.0), (h > 0).astype(np.float64)


def _silu(h):
    """``silu(h) = h * sigmoid(h)``; returns ``(f, f')`` with ``f' = s (1 + h (1 - s))``."""
    s = _sigmoid(h)
    return h * s, s * (1.0 + h * (1.0 - s))


#: The elementwise function f of each activation code, returning ``(f, f')``.
_FUNCTIONS = {act.GELU: _gelu, act.GELU_TANH: _gelu_tanh, act.RELU: _relu, act.SILU: _silu}


def _split_gate(h):
    n = h.shape[-1]
    if n % 2:
        raise ValueError(f"a gated activation needs an even width, got {n}")
    return h[..., : n // 2], h[..., n // 2:]


def _activate(name, h):
    """Forward of :func:`activation` (a separate name so ``ffn`` may call its argument
    ``activation``)."""
    a = act.lookup(name)
    h = _f64(h)
    if not a.gated:
        return _FUNCTIONS[a.code](h)[0]
    gate, up = _split_gate(h)
    return _FUNCTIONS[a.code](gate)[0] * up


def activation(name, h):
    """Apply an activation from :data:`ACTIVATIONS` to ``h``.

    Elementwise: ``gelu`` (exact, erf), ``gelu_tanh``, ``relu``, ``silu``. Gated (the last axis,
    of width ``2 n``, split as ``[gate, up]``; the result has width ``n``):
    ``swiglu = silu(gate) * up`` and ``geglu = gelu(gate) * up``.
    """
    return _activate(name, h)


def activation_backward(name, h, dy):
    """Gradient w.r.t. ``h`` of ``activation(name, h)`` given the output gradient ``dy``.

    Elementwise: ``dh = f'(h) * dy``. Gated ``y = f(gate) * up``:
    ``dh = [f'(gate) * up * dy, f(gate) * dy]`` (same width as ``h``).
    """
    a = act.lookup(name)
    h, dy = _f64(h), _f64(dy)
    if not a.gated:
        return _FUNCTIONS[a.code](h)[1] * dy
    gate, up = _split_gate(h)
    f, df = _FUNCTIONS[a.code](gate)
    return np.concatenate([df * up * dy, f * dy], axis=-1)


def linear(x, w, b=None):
    """``nn.Linear``: ``y = x w^T + b`` with ``w`` of shape ``(out, in)``; any leading shape."""
    y = _f64(x) @ _f64(w).T
    return y if b is None else y + _f64(b)


def ffn(x, w1, b1, w2, b2, activation="gelu"):
    """Feed-forward block ``y = act(x w1^T + b1) w2^T + b2`` (``nn.Linear`` layout).

    For a gated activation ``w1`` is ``(2 * hidden, E)`` (rows ``[gate; up]``) and ``w2`` is
    ``(E, hidden)``. ``b1`` / ``b2`` may be ``None``; ``x`` may have any leading shape.
    """
    return linear(_activate(activation, linear(x, w1, b1)), w2, b2)


def ffn_backward(dy, x, w1, b1, w2, b2, activation="gelu"):
    """Gradients of :func:`ffn`; returns ``(dx, dw1, db1, dw2, db2)`` (``db*`` is ``None`` when
    the bias is ``None``). With ``h = x w1^T + b1`` and ``a = act(h)``, rows flattened over the
    leading axes:

        dw2 = dy^T a,   db2 = sum dy,   da = dy w2,   dh = act'(h) . da,
        dw1 = dh^T x,   db1 = sum dh,   dx = dh w1
    """
    x, dy, w1, w2 = _f64(x), _f64(dy), _f64(w1), _f64(w2)
    h = linear(x, w1, b1)
    a = _activate(activation, h)
    dh = activation_backward(activation, h, dy @ w2)
    rows = lambda t: t.reshape(-1, t.shape[-1])  # noqa: E731
    dw2 = rows(dy).T @ rows(a)
    dw1 = rows(dh).T @ rows(x)
    db2 = None if b2 is None else rows(dy).sum(axis=0)
    db1 = None if b1 is None else rows(dh).sum(axis=0)
    return dh @ w1, dw1, db1, dw2, db2


# ---------------------------------------------------------------------------------------------
# Modules: multi-head attention, positional encoding, transformer encoder layer
# ---------------------------------------------------------------------------------------------

def _mha_additive_mask(mask):
    """A torch-MHA mask (bool True = NOT allowed, or float added) as an additive float mask."""
    mask = np.asarray(mask)
    if mask.dtype == np.bool_:
        return np.where(mask, -np.inf, 0.0)
    return _f64(mask)


def multi_head_attention(query, key, value, params, num_heads, attn_mask=None,
                         key_padding_mask=None, is_causal=False):
    """``torch.nn.MultiheadAttention(batch_first=True)`` forward; returns ``(B, Lq, E)``.

    ``params`` uses the module's state_dict names: ``in_proj_weight (3E, E)``, ``in_proj_bias``,
    ``out_proj.weight``, ``out_proj.bias``. Masks use **torch MHA's** meaning:
    ``key_padding_mask (B, Lk)`` and a bool ``attn_mask`` ``(Lq, Lk)`` or
    ``(B * num_heads, Lq, Lk)`` are True where attention is *not* allowed; float masks are added.
    ``is_causal`` adds the top-left causal band.

        Q, K, V = query Wq^T + bq, key Wk^T + bk, value Wv^T + bv      (split into heads)
        out     = concat_heads(attention(Q, K, V, mask)) Wo^T + bo
    """
    query, key, value = _f64(query), _f64(key), _f64(value)
    B, Lq, E = query.shape
    Lk = key.shape[1]
    hd = E // num_heads
    wq, wk, wv = np.split(_f64(params["in_proj_weight"]), 3, axis=0)
    bias = params.get("in_proj_bias")
    bq, bk, bv = (None, None, None) if bias is None else np.split(_f64(bias), 3)

    def heads(t, w, b):  # (B, L, E) -> (B, H, L, hd)
        return linear(t, w, b).reshape(B, -1, num_heads, hd).transpose(0, 2, 1, 3)

    mask = np.zeros((1, 1, 1, 1))
    if attn_mask is not None:
        am = _mha_additive_mask(attn_mask)
        mask = mask + (am.reshape(B, num_heads, Lq, Lk) if am.ndim == 3 else am)
    if key_padding_mask is not None:
        mask = mask + _mha_additive_mask(key_padding_mask).reshape(B, 1, 1, Lk)
    out, _ = attention(heads(query, wq, bq), heads(key, wk, bk), heads(value, wv, bv),
                       mask=mask, causal=bool(is_causal))
    out = out.transpose(0, 2, 1, 3).reshape(B, Lq, E)
    return linear(out, params["out_proj.weight"], params.get("out_proj.bias"))


def sinusoidal_positional_encoding(length, dim):
    """Transformer sinusoidal positions, ``(length, dim)``:

        PE[pos, 2i]     = sin(pos / 10000^(2i / dim))
        PE[pos, 2i + 1] = cos(pos / 10000^(2i / dim))

    For odd ``dim`` the last column is a sine.
    """
    pos = np.arange(length, dtype=np.float64).reshape(-1, 1)
    col = np.arange(dim)
    angle = pos / 10000.0 ** ((col - col % 2) / dim)
    return np.where(col % 2 == 0, np.sin(angle), np.cos(angle))


def transformer_block(x, params, num_heads, norm_first=False, activation="gelu", eps=1e-5,
                      attn_mask=None, key_padding_mask=None, is_causal=False):
    """``torch.nn.TransformerEncoderLayer(batch_first=True, dropout=0)`` forward.

    ``params`` uses the layer's state_dict names (``self_attn.*``, ``linear1.*``, ``linear2.*``,
    ``norm1.*``, ``norm2.*``); masks as in :func:`multi_head_attention`.

        post-norm:  x = norm1(x + sa(x));        x = norm2(x + ff(x))
        pre-norm:   x = x + sa(norm1(x));        x = x + ff(norm2(x))

    with ``ff(x) = linear2(act(linear1(x)))``.
    """
    x = _f64(x)
    E = x.shape[-1]
    attn = {name[len("self_attn."):]: val for name, val in params.items()
            if name.startswith("self_attn.")}

    def norm(t, i):
        return layer_norm(t, E, params[f"norm{i}.weight"], params[f"norm{i}.bias"], eps)[0]

    def sa(t):
        return multi_head_attention(t, t, t, attn, num_heads, attn_mask, key_padding_mask,
                                    is_causal)

    def ff(t):
        return ffn(t, params["linear1.weight"], params.get("linear1.bias"),
                   params["linear2.weight"], params.get("linear2.bias"), activation)

    if norm_first:
        x = x + sa(norm(x, 1))
        return x + ff(norm(x, 2))
    x = norm(x + sa(x), 1)
    return norm(x + ff(x), 2)
