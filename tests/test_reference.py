"""Tests of the float64 NumPy reference (``fastattn.reference``).

The reference is checked three ways: against PyTorch in float64 (forward and autograd), against
central finite differences, and against explicit loops for the band / RNG definitions of
``docs/numerics.md``.
"""

import math

import numpy as np
import pytest
import torch
import torch.nn.functional as F
from hypothesis import given, settings
from hypothesis import strategies as st

from fastattn import reference as R

torch.set_num_threads(2)

TOL = dict(rtol=1e-10, atol=1e-11)  # float64 vs float64: only rounding differs
FD_TOL = dict(rtol=1e-6, atol=1e-7)  # central differences, h = 1e-6


def rng(seed=0):
    return np.random.default_rng(seed)


def T(x, grad=False):
    return torch.tensor(np.asarray(x), dtype=torch.float64, requires_grad=grad)


def N(t):
    return t.detach().numpy()


def numgrad(f, x, h=1e-6):
    """Central differences of the scalar ``f()`` w.r.t. every entry of ``x`` (mutated in place)."""
    g = np.zeros_like(x)
    for idx in np.ndindex(x.shape):
        old = x[idx]
        x[idx] = old + h
        fp = f()
        x[idx] = old - h
        fm = f()
        x[idx] = old
        g[idx] = (fp - fm) / (2 * h)
    return g


# ---------------------------------------------------------------------------------------------
# Dropout RNG
# ---------------------------------------------------------------------------------------------

def py_fmix32(x):
    x &= 0xFFFFFFFF
    x ^= x >> 16
    x = (x * 0x85EBCA6B) & 0xFFFFFFFF
    x ^= x >> 13
    x = (x * 0xC2B2AE35) & 0xFFFFFFFF
    x ^= x >> 16
    return x


def py_keep(seed, B, H, Lq, Lk, p, b, h, i, j):
    stream = py_fmix32((seed + 0x9E3779B9 * (b * H + h)) & 0xFFFFFFFF)
    r = py_fmix32(py_fmix32((i * Lk + j) & 0xFFFFFFFF) ^ stream)
    return r >= math.floor(p * 2**32)


FMIX_VALUES = [0, 1, 2, 3, 12345, 0x7FFFFFFF, 0x80000000, 0xDEADBEEF, 0xFFFFFFFF]


def test_fmix32_matches_pure_python():
    assert py_fmix32(0) == 0
    assert py_fmix32(1) != 1
    for x in FMIX_VALUES:
        got = R.fmix32(x)
        assert got.dtype == np.uint32
        assert int(got) == py_fmix32(x), hex(x)
    arr = R.fmix32(np.array(FMIX_VALUES, dtype=np.uint32))
    assert arr.dtype == np.uint32 and arr.shape == (len(FMIX_VALUES),)
    assert [int(v) for v in arr] == [py_fmix32(x) for x in FMIX_VALUES]
    # Python ints are taken modulo 2**32.
    assert int(R.fmix32(2**32 + 5)) == py_fmix32(5)


def test_fmix32_no_overflow_warnings():
    with np.errstate(all="raise"):
        R.fmix32(np.arange(0xFFFFFF00, 0xFFFFFFFF, dtype=np.uint32))
        R.dropout_keep_mask(0xFFFFFFFF, 3, 5, 4, 4, 0.5)


@pytest.mark.parametrize("seed", [0, 1234, 0xFFFFFFFF, 2**32 + 17, 2**40 + 3])
@pytest.mark.parametrize("p", [0.0, 0.3, 0.9, 1.0])
def test_dropout_keep_mask_matches_definition(seed, p):
    B, H, Lq, Lk = 2, 3, 5, 7
    keep = R.dropout_keep_mask(seed, B, H, Lq, Lk, p)
    assert keep.dtype == np.bool_ and keep.shape == (B, H, Lq, Lk)
    want = np.array([[[[py_keep(seed % 2**32, B, H, Lq, Lk, p, b, h, i, j)
                        for j in range(Lk)] for i in range(Lq)]
                      for h in range(H)] for b in range(B)])
    np.testing.assert_array_equal(keep, want)
    if p == 0.0:
        assert keep.all()
    if p == 1.0:
        assert not keep.any()


@pytest.mark.parametrize("p", [0.1, 0.5, 0.8])
def test_dropout_keep_fraction(p):
    B, H, Lq, Lk = 2, 4, 128, 130
    n = B * H * Lq * Lk
    keep = R.dropout_keep_mask(7, B, H, Lq, Lk, p)
    sigma = math.sqrt(p * (1 - p) / n)
    assert abs(keep.mean() - (1 - p)) < 6 * sigma
    # Each (b, h) stream is unbiased on its own too.
    per_head = keep.mean(axis=(2, 3))
    assert np.all(np.abs(per_head - (1 - p)) < 6 * math.sqrt(p * (1 - p) / (Lq * Lk)))


def test_dropout_seeds_and_heads_differ():
    p = 0.5
    a = R.dropout_keep_mask(1, 2, 2, 64, 64, p)
    b = R.dropout_keep_mask(2, 2, 2, 64, 64, p)
    # Independent masks disagree on about 2 p (1 - p) = 1/2 of the entries.
    assert 0.4 < (a != b).mean() < 0.6
    assert 0.4 < (a[0, 0] != a[0, 1]).mean() < 0.6
    assert 0.4 < (a[0, 0] != a[1, 0]).mean() < 0.6
    np.testing.assert_array_equal(a, R.dropout_keep_mask(1, 2, 2, 64, 64, p))


def test_dropout_rejects_bad_p():
    with pytest.raises(ValueError):
        R.dropout_keep_mask(0, 1, 1, 2, 2, 1.5)


# ---------------------------------------------------------------------------------------------
# Bands
# ---------------------------------------------------------------------------------------------

@settings(max_examples=60, deadline=None)
@given(Lq=st.integers(1, 9), Lk=st.integers(1, 9), offset=st.integers(-10, 10),
       left=st.integers(-3, 20), right=st.integers(-3, 20))
def test_band_mask_matches_loop(Lq, Lk, offset, left, right):
    got = R.band_mask(Lq, Lk, offset, left, right)
    assert got.shape == (Lq, Lk) and got.dtype == np.bool_
    for i in range(Lq):
        for j in range(Lk):
            assert got[i, j] == (i + offset - left <= j <= i + offset + right)


def loop_band(Lq, Lk, causal, window):
    """The band written out from docs/numerics.md, one (i, j) at a time."""
    out = np.zeros((Lq, Lk), dtype=bool)
    off = Lk - Lq if causal == "bottom_right" else 0
    for i in range(Lq):
        for j in range(Lk):
            ok = True
            if causal:
                ok &= j <= i + off
            if window is not None:
                wl, wr = window
                if wl is not None:
                    ok &= j >= i + off - wl
                if wr is not None:
                    ok &= j <= i + off + wr
            out[i, j] = ok
    return out


BAND_CASES = [(False, None), (True, None), ("top_left", None), ("bottom_right", None),
              (False, (2, 1)), (False, (3, None)), (False, (None, 2)), (False, (0, 0)),
              (True, (2, None)), (True, (1, 5)), (True, (3, -1)), ("bottom_right", (2, None)),
              ("bottom_right", (None, 3))]


@pytest.mark.parametrize("causal,window", BAND_CASES)
@pytest.mark.parametrize("Lq,Lk", [(1, 1), (5, 5), (4, 9), (9, 4), (1, 17)])
def test_structural_band_matches_loop(causal, window, Lq, Lk):
    off, left, right = R.structural_band(Lq, Lk, causal=causal, window=window)
    assert all(isinstance(v, int) for v in (off, left, right))
    np.testing.assert_array_equal(R.band_mask(Lq, Lk, off, left, right),
                                  loop_band(Lq, Lk, causal, window))


def test_structural_band_values():
    assert R.structural_band(3, 5) == (0, 8, 8)
    assert R.structural_band(3, 5, causal=True) == (0, 8, 0)
    assert R.structural_band(3, 5, causal="bottom_right") == (2, 8, 0)
    assert R.structural_band(3, 5, window=(2, None)) == (0, 2, 8)
    assert R.structural_band(3, 5, causal="bottom_right", window=(1, 4)) == (2, 1, 0)
    assert R.structural_band(3, 5, causal=True, window=(1, -1)) == (0, 1, -1)  # intersection
    with pytest.raises(ValueError):
        R.structural_band(3, 5, causal="diagonal")


def loop_attention(q, k, v, allowed, scale):
    """Attention one row at a time, keys restricted to ``allowed`` (B, H, Lq, Lk)."""
    B, H, Lq, _ = q.shape
    out = np.zeros((B, H, Lq, v.shape[-1]))
    lse = np.full((B, H, Lq), -np.inf)
    for b in range(B):
        for h in range(H):
            for i in range(Lq):
                js = np.flatnonzero(allowed[b, h, i])
                if js.size == 0:
                    continue
                s = np.array([scale * q[b, h, i] @ k[b, h, j] for j in js])
                m = s.max()
                w = np.exp(s - m)
                lse[b, h, i] = m + math.log(w.sum())
                out[b, h, i] = (w / w.sum()) @ v[b, h, js]
    return out, lse


@pytest.mark.parametrize("causal,window", BAND_CASES)
@pytest.mark.parametrize("Lq,Lk", [(6, 6), (3, 8), (8, 3)])
def test_attention_band_matches_loop(causal, window, Lq, Lk):
    g = rng(1)
    q, k, v = (g.normal(size=(1, 2, L, d)) for L, d in ((Lq, 5), (Lk, 5), (Lk, 3)))
    out, lse = R.attention(q, k, v, causal=causal, window=window)
    allowed = np.broadcast_to(loop_band(Lq, Lk, causal, window), (1, 2, Lq, Lk))
    want_out, want_lse = loop_attention(q, k, v, allowed, 1 / math.sqrt(5))
    np.testing.assert_allclose(out, want_out, **TOL)
    np.testing.assert_array_equal(np.isneginf(lse), np.isneginf(want_lse))
    np.testing.assert_allclose(lse, want_lse, **TOL)
    if causal == "bottom_right" and Lq > Lk and window is None:
        assert np.isneginf(lse[..., : Lq - Lk]).all()  # rows above the diagonal see nothing


# ---------------------------------------------------------------------------------------------
# Fully masked rows
# ---------------------------------------------------------------------------------------------

def dead_row_cases():
    g = rng(2)
    B, H, Lq, Lk = 2, 2, 5, 6
    bool_mask = g.random((B, H, Lq, Lk)) < 0.7
    bool_mask[0, 1, 2] = False
    float_mask = g.normal(size=(B, 1, Lq, Lk))
    float_mask[1, 0, 3] = -np.inf
    float_mask[0, 0, 1, ::2] = -np.inf  # partially masked: still alive
    rows = (slice(None), slice(None))
    return [
        dict(mask=bool_mask, dead=(0, 1, 2)),
        dict(mask=float_mask, dead=(1, slice(None), 3)),
        dict(mask=None, causal="bottom_right", window=(0, None), Lq=8, Lk=6,
             dead=rows + (slice(0, 2),)),
        dict(mask=None, window=(-2, None), dead=rows + (slice(Lk - 1, None),)),
    ]


@pytest.mark.parametrize("case", dead_row_cases(), ids=["bool", "float", "band", "window"])
def test_fully_masked_rows_are_zero(case):
    g = rng(3)
    B, H, D = 2, 2, 4
    Lq, Lk = case.get("Lq", 5), case.get("Lk", 6)
    kw = dict(mask=case["mask"], causal=case.get("causal", False), window=case.get("window"))
    q, k, v = (g.normal(size=(B, H, L, D)) for L in (Lq, Lk, Lk))
    dead = case["dead"]
    with np.errstate(all="raise"):
        out, lse = R.attention(q, k, v, **kw)
    assert np.isfinite(out).all()
    assert np.isneginf(lse[dead]).all() and (out[dead] == 0).all()
    assert np.isfinite(np.delete(lse.reshape(-1), np.flatnonzero(np.isneginf(lse)))).all()
    assert np.isneginf(lse).sum() < lse.size  # some rows are alive

    dout = g.normal(size=out.shape)
    dq, dk, dv, dmask = R.attention_backward(dout, q, k, v, **kw)
    for gr in (dq, dk, dv) + (() if dmask is None else (dmask,)):
        assert np.isfinite(gr).all()
    assert (dq[dead] == 0).all()
    # Dead rows contribute nothing: changing their output gradient changes no gradient.
    dout2 = dout.copy()
    dout2[dead] = g.normal(size=dout2[dead].shape)
    dq2, dk2, dv2, dmask2 = R.attention_backward(dout2, q, k, v, **kw)
    np.testing.assert_array_equal(dk, dk2)
    np.testing.assert_array_equal(dv, dv2)
    np.testing.assert_array_equal(dq, dq2)
    if dmask is not None:
        np.testing.assert_array_equal(dmask, dmask2)
        assert (dmask[dead] == 0).all()


def test_softmax_fully_masked_rows():
    x = rng(4).normal(size=(2, 3, 4))
    mask = np.ones((2, 3, 4), dtype=bool)
    mask[1, 2] = False
    y = R.softmax(x, mask=mask)
    assert (y[1, 2] == 0).all()
    np.testing.assert_allclose(y.sum(-1)[mask.any(-1)], 1.0, **TOL)
    fmask = np.zeros((3, 4))
    fmask[0] = -np.inf
    y = R.softmax(x, mask=fmask)
    assert (y[:, 0] == 0).all() and np.isfinite(y).all()
    dx = R.softmax_backward(rng(5).normal(size=y.shape), y)
    assert (dx[:, 0] == 0).all()


# ---------------------------------------------------------------------------------------------
# Softmax
# ---------------------------------------------------------------------------------------------

def torch_masked_softmax(x, mask, scale, is_causal):
    s = scale * T(x)
    if mask is not None:
        m = T(mask) if mask.dtype != np.bool_ else torch.from_numpy(mask)
        s = s + m if mask.dtype != np.bool_ else s.masked_fill(~m, -math.inf)
    if is_causal:
        Lq, Lk = x.shape[-2:]
        s = s.masked_fill(~torch.ones(Lq, Lk, dtype=torch.bool).tril(), -math.inf)
    return torch.softmax(s, dim=-1)


def softmax_masks(shape):
    g = rng(6)
    Lq, Lk = shape[-2:]
    fm = g.normal(size=(Lq, Lk))
    fm[0, 1:] = -np.inf
    return {"none": None, "bool": g.random(shape) < 0.6, "bool_bcast": g.random((Lq, Lk)) < 0.6,
            "float": g.normal(size=shape) * 3, "float_inf": fm}


@pytest.mark.parametrize("mask_kind", ["none", "bool", "bool_bcast", "float", "float_inf"])
@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 3, 7, 11), (3, 17, 5), (1, 1)])
def test_softmax_vs_torch(mask_kind, is_causal, shape):
    x = rng(7).normal(size=shape) * 4
    mask = softmax_masks(shape)[mask_kind]
    y = R.softmax(x, mask=mask, scale=0.7, is_causal=is_causal)
    want = N(torch_masked_softmax(x, mask, 0.7, is_causal))
    nan = np.isnan(want)
    np.testing.assert_allclose(y[~nan], want[~nan], **TOL)
    assert (y[nan] == 0).all()
    if is_causal and shape[-2] > 1:
        Lq, Lk = shape[-2:]
        assert (y[..., np.triu_indices(Lq, 1, Lk)[0], np.triu_indices(Lq, 1, Lk)[1]] == 0).all()


def test_softmax_backward_vs_torch_and_fd():
    g = rng(8)
    x, dy = g.normal(size=(2, 5, 9)), g.normal(size=(2, 5, 9))
    xt = T(x, grad=True)
    yt = torch.softmax(1.3 * xt, -1)
    yt.backward(T(dy))
    dx = R.softmax_backward(dy, R.softmax(x, scale=1.3), scale=1.3)
    np.testing.assert_allclose(dx, N(xt.grad), **TOL)
    # finite differences, with a causal mask
    xs, dys = x[0, :4, :6].copy(), dy[0, :4, :6]
    y = R.softmax(xs, scale=1.3, is_causal=True)
    fd = numgrad(lambda: (R.softmax(xs, scale=1.3, is_causal=True) * dys).sum(), xs)
    np.testing.assert_allclose(R.softmax_backward(dys, y, scale=1.3), fd, **FD_TOL)


# ---------------------------------------------------------------------------------------------
# Attention vs torch SDPA
# ---------------------------------------------------------------------------------------------

def attention_inputs(B, H, Hkv, Lq, Lk, D, Dv, seed=0):
    g = rng(seed)
    return (g.normal(size=(B, H, Lq, D)), g.normal(size=(B, Hkv, Lk, D)),
            g.normal(size=(B, Hkv, Lk, Dv)))


def make_mask(kind, B, H, Lq, Lk, seed=0):
    g = rng(seed + 100)
    if kind == "none":
        return None
    if kind == "bool":
        m = g.random((B, H, Lq, Lk)) < 0.7
        m[0, 0, 0] = False  # one fully masked row
        return m
    if kind == "key_padding":
        m = np.ones((B, 1, 1, Lk), dtype=bool)
        m[-1, ..., Lk // 2:] = False
        if Lk > 1:
            m[0, ..., -1] = False
        return m
    if kind == "float":
        return g.normal(size=(Lq, Lk)) * 2
    if kind == "float_inf":
        m = g.normal(size=(B, 1, Lq, Lk))
        m[g.random(m.shape) < 0.3] = -np.inf
        return m
    raise AssertionError(kind)


def sdpa(q, k, v, mask, is_causal=False, scale=None, enable_gqa=False):
    m = None
    if mask is not None:
        m = torch.from_numpy(mask) if mask.dtype == np.bool_ else T(mask)
    return F.scaled_dot_product_attention(T(q), T(k), T(v), attn_mask=m, is_causal=is_causal,
                                          scale=scale, enable_gqa=enable_gqa)


def masked_scores_torch(q, k, mask, is_causal, scale, H):
    kt = T(k).repeat_interleave(H // k.shape[1], dim=1)
    s = scale * T(q) @ kt.transpose(-1, -2)
    if mask is not None:
        if mask.dtype == np.bool_:
            s = s.masked_fill(~torch.from_numpy(mask), -math.inf)
        else:
            s = s + T(mask)
    if is_causal:
        s = s.masked_fill(~torch.ones(q.shape[2], k.shape[2], dtype=torch.bool).tril(), -math.inf)
    return s


SDPA_SHAPES = [  # B, H, Hkv, Lq, Lk, D, Dv
    (2, 4, 4, 17, 17, 40, 40),
    (1, 8, 2, 1, 130, 80, 80),
    (2, 4, 1, 33, 17, 100, 64),
    (1, 2, 2, 1, 1, 16, 16),
    (1, 6, 3, 130, 7, 8, 12),
]


@pytest.mark.parametrize("shape", SDPA_SHAPES, ids=lambda s: "x".join(map(str, s)))
@pytest.mark.parametrize("mask_kind",
                         ["none", "bool", "key_padding", "float", "float_inf", "causal"])
def test_attention_vs_sdpa(shape, mask_kind):
    B, H, Hkv, Lq, Lk, D, Dv = shape
    q, k, v = attention_inputs(*shape)
    is_causal = mask_kind == "causal"
    mask = None if is_causal else make_mask(mask_kind, B, H, Lq, Lk)
    gqa = H != Hkv
    out, lse = R.attention(q, k, v, mask=mask, causal=is_causal, enable_gqa=gqa)
    assert out.shape == (B, H, Lq, Dv) and lse.shape == (B, H, Lq)
    assert out.dtype == np.float64 and lse.dtype == np.float64
    want = N(sdpa(q, k, v, mask, is_causal, enable_gqa=gqa))
    nan = np.isnan(want).any(-1)
    np.testing.assert_allclose(out[~nan], want[~nan], **TOL)
    assert (out[nan] == 0).all() and np.isneginf(lse[nan]).all()
    if mask_kind == "bool":  # the fully masked row (torch gives NaN or 0 depending on version)
        assert (out[0, 0, 0] == 0).all() and np.isneginf(lse[0, 0, 0])
        assert np.isnan(want[0, 0, 0]).all() or (want[0, 0, 0] == 0).all()
    scores = masked_scores_torch(q, k, mask, is_causal, 1 / math.sqrt(D), H)
    want_lse = N(torch.logsumexp(scores, -1))
    np.testing.assert_allclose(lse, want_lse, **TOL)


def test_attention_custom_scale_vs_sdpa():
    q, k, v = attention_inputs(2, 3, 3, 9, 12, 20, 20, seed=3)
    out, _ = R.attention(q, k, v, scale=0.37, causal=True)
    np.testing.assert_allclose(out, N(sdpa(q, k, v, None, True, scale=0.37)), **TOL)


def test_attention_gqa_head_mapping():
    q, k, v = attention_inputs(1, 6, 2, 4, 5, 8, 8, seed=4)
    out, _ = R.attention(q, k, v, enable_gqa=True)
    # query head h reads kv head h // 3
    for h in range(6):
        o, _ = R.attention(q[:, h:h + 1], k[:, h // 3:h // 3 + 1], v[:, h // 3:h // 3 + 1])
        np.testing.assert_allclose(out[:, h:h + 1], o, **TOL)


def test_attention_gqa_errors():
    q, k, v = attention_inputs(1, 6, 2, 4, 5, 8, 8)
    with pytest.raises(ValueError):
        R.attention(q, k, v)  # enable_gqa not set
    q4, k4, v4 = attention_inputs(1, 6, 4, 4, 5, 8, 8)
    with pytest.raises(ValueError):
        R.attention(q4, k4, v4, enable_gqa=True)  # 6 % 4 != 0
    with pytest.raises(ValueError):
        R.attention(q, k, v, enable_gqa=True, dropout_p=0.1)  # no seed


GRAD_CASES = [  # shape, mask kind / float-mask shape, causal
    ((2, 4, 4, 9, 13, 40, 24), None, False),
    ((2, 4, 2, 17, 17, 16, 16), None, True),
    ((1, 4, 1, 7, 130, 8, 8), "bool", False),
    ((2, 4, 2, 9, 13, 16, 16), (2, 4, 9, 13), False),
    ((2, 4, 2, 9, 13, 16, 16), (9, 13), False),
    ((2, 4, 4, 9, 13, 16, 16), (2, 1, 1, 13), False),
    ((2, 4, 4, 9, 13, 16, 16), (4, 1, 13), True),
    ((1, 2, 2, 1, 17, 100, 100), (1, 2, 1, 17), False),
]


@pytest.mark.parametrize("shape,mask_spec,causal", GRAD_CASES)
def test_attention_backward_vs_autograd(shape, mask_spec, causal):
    B, H, Hkv, Lq, Lk, D, Dv = shape
    q, k, v = attention_inputs(*shape, seed=5)
    g = rng(9)
    if mask_spec is None:
        mask = None
    elif mask_spec == "bool":
        mask = g.random((B, 1, Lq, Lk)) < 0.5
        mask[..., 0] = True  # no fully masked row (torch would give NaN gradients)
    else:
        mask = g.normal(size=mask_spec)
    dout = g.normal(size=(B, H, Lq, Dv))
    gqa = H != Hkv
    qt, kt, vt = T(q, True), T(k, True), T(v, True)
    mt = None
    if mask is not None:
        mt = torch.from_numpy(mask) if mask.dtype == np.bool_ else T(mask, True)
    if causal and mt is not None:  # SDPA refuses both: fold the causal band into the mask
        band = torch.ones(Lq, Lk, dtype=torch.bool).tril()
        causal_bias = torch.zeros(Lq, Lk, dtype=torch.float64).masked_fill(~band, -math.inf)
        t_mask, t_causal = mt + causal_bias, False
    else:
        t_mask, t_causal = mt, causal
    F.scaled_dot_product_attention(qt, kt, vt, attn_mask=t_mask, is_causal=t_causal,
                                   enable_gqa=gqa).backward(T(dout))
    dq, dk, dv, dmask = R.attention_backward(dout, q, k, v, mask=mask, causal=causal,
                                             enable_gqa=gqa)
    assert dk.shape == k.shape and dv.shape == v.shape
    np.testing.assert_allclose(dq, N(qt.grad), **TOL)
    np.testing.assert_allclose(dk, N(kt.grad), **TOL)
    np.testing.assert_allclose(dv, N(vt.grad), **TOL)
    if mask is None or mask.dtype == np.bool_:
        assert dmask is None
    else:
        assert dmask.shape == mask.shape
        np.testing.assert_allclose(dmask, N(mt.grad), **TOL)


FD_CASES = [
    dict(shape=(1, 2, 1, 3, 4, 3, 2), mask=(2, 1, 4)),
    dict(shape=(1, 2, 2, 4, 3, 2, 3), mask=(4, 3), causal="bottom_right", window=(1, None)),
    dict(shape=(2, 2, 1, 3, 4, 2, 2), mask=(2, 1, 3, 4), window=(1, 1)),
    dict(shape=(1, 2, 1, 3, 5, 3, 2), mask=(1, 1, 3, 5), dropout_p=0.4, seed=11),
]


@pytest.mark.parametrize("case", FD_CASES)
def test_attention_backward_vs_finite_differences(case):
    B, H, Hkv, Lq, Lk, D, Dv = case["shape"]
    q, k, v = attention_inputs(*case["shape"], seed=6)
    g = rng(10)
    mask = g.normal(size=case["mask"])
    dout = g.normal(size=(B, H, Lq, Dv))
    kw = dict(causal=case.get("causal", False), window=case.get("window"),
              dropout_p=case.get("dropout_p", 0.0), seed=case.get("seed"), enable_gqa=H != Hkv)

    def loss():
        return (R.attention(q, k, v, mask=mask, **kw)[0] * dout).sum()

    dq, dk, dv, dmask = R.attention_backward(dout, q, k, v, mask=mask, **kw)
    for analytic, x in ((dq, q), (dk, k), (dv, v), (dmask, mask)):
        np.testing.assert_allclose(analytic, numgrad(loss, x), **FD_TOL)
    assert np.abs(dmask).max() > 1e-3  # the check is not vacuous


def test_attention_dropout_matches_manual():
    B, H, Lq, Lk, D = 2, 3, 17, 20, 16
    q, k, v = attention_inputs(B, H, H, Lq, Lk, D, D, seed=7)
    p, seed = 0.3, 1234
    out, lse = R.attention(q, k, v, causal=True, dropout_p=p, seed=seed)
    out0, lse0 = R.attention(q, k, v, causal=True)
    np.testing.assert_array_equal(lse, lse0)  # dropout does not touch the statistics
    scores = q @ np.swapaxes(k, -1, -2) / math.sqrt(D)
    probs = R.softmax(scores, is_causal=True)
    keep = R.dropout_keep_mask(seed, B, H, Lq, Lk, p)
    np.testing.assert_allclose(out, (probs * keep / (1 - p)) @ v, **TOL)
    assert not np.allclose(out, out0)
    out_b, _ = R.attention(q, k, v, causal=True, dropout_p=p, seed=seed + 1)
    assert not np.allclose(out, out_b)
    # Same against torch, feeding our keep-mask through the probabilities.
    pt = torch.softmax(masked_scores_torch(q, k, None, True, 1 / math.sqrt(D), H), -1)
    want = (pt * torch.from_numpy(keep) / (1 - p)) @ T(v)
    np.testing.assert_allclose(out, N(want), **TOL)


def test_attention_dropout_backward_vs_autograd():
    B, H, Lq, Lk, D = 1, 2, 6, 9, 8
    q, k, v = attention_inputs(B, H, H, Lq, Lk, D, D, seed=8)
    p, seed = 0.25, 99
    dout = rng(11).normal(size=(B, H, Lq, D))
    keep = torch.from_numpy(R.dropout_keep_mask(seed, B, H, Lq, Lk, p))
    qt, kt, vt = T(q, True), T(k, True), T(v, True)
    pt = torch.softmax(qt @ kt.transpose(-1, -2) / math.sqrt(D), -1)
    ((pt * keep / (1 - p)) @ vt).backward(T(dout))
    dq, dk, dv, _ = R.attention_backward(dout, q, k, v, dropout_p=p, seed=seed)
    np.testing.assert_allclose(dq, N(qt.grad), **TOL)
    np.testing.assert_allclose(dk, N(kt.grad), **TOL)
    np.testing.assert_allclose(dv, N(vt.grad), **TOL)


# ---------------------------------------------------------------------------------------------
# Normalisation
# ---------------------------------------------------------------------------------------------

NORM_CASES = [((4, 7, 40), (40,)), ((3, 100), 100), ((2, 3, 5, 6), (5, 6)), ((1, 17), (17,))]


@pytest.mark.parametrize("shape,nshape", NORM_CASES)
@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_vs_torch(shape, nshape, affine):
    g = rng(12)
    ns = (nshape,) if isinstance(nshape, int) else nshape
    x = g.normal(size=shape) * 3 + 1
    w, b = (g.normal(size=ns), g.normal(size=ns)) if affine else (None, None)
    dy = g.normal(size=shape)
    y, mean, rstd = R.layer_norm(x, nshape, w, b, eps=1e-5)
    lead = shape[: len(shape) - len(ns)]
    assert mean.shape == lead and rstd.shape == lead
    xt = T(x, True)
    wt, bt = (T(w, True), T(b, True)) if affine else (None, None)
    yt = F.layer_norm(xt, ns, wt, bt, eps=1e-5)
    np.testing.assert_allclose(y, N(yt), **TOL)
    axes = tuple(range(len(lead), len(shape)))
    var_t, mean_t = torch.var_mean(T(x), dim=axes, unbiased=False)
    np.testing.assert_allclose(mean, N(mean_t), **TOL)
    np.testing.assert_allclose(rstd, N(torch.rsqrt(var_t + 1e-5)), **TOL)
    yt.backward(T(dy))
    dx, dw, db = R.layer_norm_backward(dy, x, nshape, w, eps=1e-5)
    np.testing.assert_allclose(dx, N(xt.grad), **TOL)
    assert dw.shape == ns and db.shape == ns
    if affine:
        np.testing.assert_allclose(dw, N(wt.grad), **TOL)
        np.testing.assert_allclose(db, N(bt.grad), **TOL)


def test_layer_norm_backward_finite_differences():
    g = rng(13)
    x, w, b, dy = g.normal(size=(3, 5)), g.normal(size=5), g.normal(size=5), g.normal(size=(3, 5))

    def loss():
        return (R.layer_norm(x, 5, w, b, eps=1e-3)[0] * dy).sum()

    dx, dw, db = R.layer_norm_backward(dy, x, 5, w, eps=1e-3)
    np.testing.assert_allclose(dx, numgrad(loss, x), **FD_TOL)
    np.testing.assert_allclose(dw, numgrad(loss, w), **FD_TOL)
    np.testing.assert_allclose(db, numgrad(loss, b), **FD_TOL)


@pytest.mark.parametrize("shape,nshape", NORM_CASES)
@pytest.mark.parametrize("affine", [True, False])
def test_rms_norm_vs_torch(shape, nshape, affine):
    g = rng(14)
    ns = (nshape,) if isinstance(nshape, int) else nshape
    x = g.normal(size=shape) * 2 + 0.5
    w = g.normal(size=ns) if affine else None
    dy = g.normal(size=shape)
    y, rstd = R.rms_norm(x, nshape, w, eps=1e-6)
    lead = shape[: len(shape) - len(ns)]
    assert rstd.shape == lead
    xt = T(x, True)
    wt = T(w, True) if affine else None
    yt = F.rms_norm(xt, ns, wt, eps=1e-6)
    np.testing.assert_allclose(y, N(yt), **TOL)
    axes = tuple(range(len(lead), len(shape)))
    np.testing.assert_allclose(rstd, N(torch.rsqrt((T(x) ** 2).mean(axes) + 1e-6)), **TOL)
    yt.backward(T(dy))
    dx, dw = R.rms_norm_backward(dy, x, nshape, w, eps=1e-6)
    np.testing.assert_allclose(dx, N(xt.grad), **TOL)
    assert dw.shape == ns
    if affine:
        np.testing.assert_allclose(dw, N(wt.grad), **TOL)


def test_rms_norm_backward_finite_differences():
    g = rng(15)
    x, w, dy = g.normal(size=(2, 3, 4)), g.normal(size=4), g.normal(size=(2, 3, 4))

    def loss():
        return (R.rms_norm(x, (4,), w, eps=1e-3)[0] * dy).sum()

    dx, dw = R.rms_norm_backward(dy, x, (4,), w, eps=1e-3)
    np.testing.assert_allclose(dx, numgrad(loss, x), **FD_TOL)
    np.testing.assert_allclose(dw, numgrad(loss, w), **FD_TOL)


# ---------------------------------------------------------------------------------------------
# Activations and FFN
# ---------------------------------------------------------------------------------------------

def torch_act(name, h):
    if name in R.GATED_ACTIVATIONS:
        gate, up = h.chunk(2, dim=-1)
        return (F.silu(gate) if name == "swiglu" else F.gelu(gate)) * up
    return {"gelu": F.gelu, "gelu_tanh": lambda t: F.gelu(t, approximate="tanh"),
            "relu": F.relu, "silu": F.silu}[name](h)


def test_activation_names():
    assert set(R.ACTIVATIONS) == {"gelu", "gelu_tanh", "relu", "silu", "swiglu", "geglu"}
    assert set(R.GATED_ACTIVATIONS) == {"swiglu", "geglu"}
    with pytest.raises(ValueError):
        R.activation("tanh", np.zeros(3))
    with pytest.raises(ValueError):
        R.activation("swiglu", np.zeros(3))  # odd width


@pytest.mark.parametrize("name", R.ACTIVATIONS)
def test_activation_vs_torch_and_fd(name):
    g = rng(16)
    h = g.normal(size=(3, 10)) * 3
    h[0, :4] = [0.0, 1e-3, -40.0, 40.0]  # the kink of relu is avoided by FD below
    dy = g.normal(size=(3, 5 if name in R.GATED_ACTIVATIONS else 10))
    ht = T(h, True)
    yt = torch_act(name, ht)
    y = R.activation(name, h)
    np.testing.assert_allclose(y, N(yt), **TOL)
    yt.backward(T(dy))
    dh = R.activation_backward(name, h, dy)
    assert dh.shape == h.shape
    np.testing.assert_allclose(dh, N(ht.grad), **TOL)
    hs = h[1:].copy()  # no value within 1e-6 of 0
    fd = numgrad(lambda: (R.activation(name, hs) * dy[1:]).sum(), hs)
    np.testing.assert_allclose(R.activation_backward(name, hs, dy[1:]), fd, **FD_TOL)


def test_linear_vs_torch():
    g = rng(17)
    x, w, b = g.normal(size=(2, 3, 5)), g.normal(size=(4, 5)), g.normal(size=4)
    np.testing.assert_allclose(R.linear(x, w, b), N(F.linear(T(x), T(w), T(b))), **TOL)
    np.testing.assert_allclose(R.linear(x, w), N(F.linear(T(x), T(w))), **TOL)


@pytest.mark.parametrize("name", R.ACTIVATIONS)
@pytest.mark.parametrize("bias", [True, False])
def test_ffn_vs_torch(name, bias):
    g = rng(18)
    E, Hd = 40, 24
    width = 2 * Hd if name in R.GATED_ACTIVATIONS else Hd
    x = g.normal(size=(2, 17, E))
    w1, w2 = g.normal(size=(width, E)) / math.sqrt(E), g.normal(size=(E, Hd)) / math.sqrt(Hd)
    b1, b2 = (g.normal(size=width), g.normal(size=E)) if bias else (None, None)
    dy = g.normal(size=x.shape)
    xt, w1t, w2t = T(x, True), T(w1, True), T(w2, True)
    b1t, b2t = (T(b1, True), T(b2, True)) if bias else (None, None)
    yt = F.linear(torch_act(name, F.linear(xt, w1t, b1t)), w2t, b2t)
    y = R.ffn(x, w1, b1, w2, b2, activation=name)
    np.testing.assert_allclose(y, N(yt), **TOL)
    yt.backward(T(dy))
    dx, dw1, db1, dw2, db2 = R.ffn_backward(dy, x, w1, b1, w2, b2, name)
    np.testing.assert_allclose(dx, N(xt.grad), **TOL)
    np.testing.assert_allclose(dw1, N(w1t.grad), **TOL)
    np.testing.assert_allclose(dw2, N(w2t.grad), **TOL)
    if bias:
        np.testing.assert_allclose(db1, N(b1t.grad), **TOL)
        np.testing.assert_allclose(db2, N(b2t.grad), **TOL)
    else:
        assert db1 is None and db2 is None


@pytest.mark.parametrize("name", ["gelu", "silu", "swiglu", "gelu_tanh"])
def test_ffn_backward_finite_differences(name):
    g = rng(19)
    E, Hd = 3, 4
    width = 2 * Hd if name in R.GATED_ACTIVATIONS else Hd
    x, dy = g.normal(size=(2, E)), g.normal(size=(2, E))
    w1, b1 = g.normal(size=(width, E)), g.normal(size=width)
    w2, b2 = g.normal(size=(E, Hd)), g.normal(size=E)

    def loss():
        return (R.ffn(x, w1, b1, w2, b2, name) * dy).sum()

    grads = R.ffn_backward(dy, x, w1, b1, w2, b2, name)
    for analytic, p in zip(grads, (x, w1, b1, w2, b2)):
        np.testing.assert_allclose(analytic, numgrad(loss, p), **FD_TOL)


# ---------------------------------------------------------------------------------------------
# Modules
# ---------------------------------------------------------------------------------------------

def state_dict_np(module):
    return {name: N(t) for name, t in module.state_dict().items()}


def mha_masks(kind, B, nh, Lq, Lk):
    g = rng(20)
    if kind == "none":
        return {}
    if kind == "bool2d":
        m = g.random((Lq, Lk)) < 0.3
        m[:, 0] = False  # True = NOT allowed; keep every row alive
        return dict(attn_mask=m)
    if kind == "float2d":
        return dict(attn_mask=g.normal(size=(Lq, Lk)))
    if kind == "bool3d":
        m = g.random((B * nh, Lq, Lk)) < 0.3
        m[..., -1] = False
        return dict(attn_mask=m)
    if kind == "float3d":
        return dict(attn_mask=g.normal(size=(B * nh, Lq, Lk)))
    if kind == "key_padding":
        m = np.zeros((B, Lk), dtype=bool)
        m[0, Lk // 2:] = True
        return dict(key_padding_mask=m)
    if kind == "kpm_and_bool":
        m = np.zeros((B, Lk), dtype=bool)
        m[-1, 1:] = True
        am = g.random((Lq, Lk)) < 0.3
        am[:, 0] = False
        return dict(key_padding_mask=m, attn_mask=am)
    if kind == "kpm_and_float":  # float key padding: -inf = ignore
        m = np.zeros((B, Lk))
        m[-1, 1:] = -np.inf
        m[0] = g.normal(size=Lk)
        return dict(key_padding_mask=m, attn_mask=g.normal(size=(Lq, Lk)))
    if kind == "causal":
        return dict(attn_mask=~np.tril(np.ones((Lq, Lk), dtype=bool)), is_causal=True)
    raise AssertionError(kind)


def torch_mask(m):
    if m is None:
        return None
    return torch.from_numpy(m) if m.dtype == np.bool_ else T(m)


MHA_KINDS = ["none", "bool2d", "float2d", "bool3d", "float3d", "key_padding", "kpm_and_bool",
             "kpm_and_float"]
MHA_CASES = ([(kind, 32, 4, 17, 17) for kind in MHA_KINDS + ["causal"]]
             + [(kind, 80, 2, 5, 9) for kind in MHA_KINDS])  # causal hint: self-attention only


@pytest.mark.parametrize("kind,E,nh,Lq,Lk", MHA_CASES)
def test_multi_head_attention_vs_torch(kind, E, nh, Lq, Lk):
    torch.manual_seed(0)
    mha = torch.nn.MultiheadAttention(E, nh, batch_first=True, dtype=torch.float64)
    with torch.no_grad():
        mha.in_proj_bias.normal_()
        mha.out_proj.bias.normal_()
    g = rng(21)
    B = 2
    query = g.normal(size=(B, Lq, E))
    key = query if Lq == Lk else g.normal(size=(B, Lk, E))
    value = query if Lq == Lk else g.normal(size=(B, Lk, E))
    masks = mha_masks(kind, B, nh, Lq, Lk)
    with torch.no_grad():
        want, _ = mha(T(query), T(key), T(value), need_weights=False,
                      attn_mask=torch_mask(masks.get("attn_mask")),
                      key_padding_mask=torch_mask(masks.get("key_padding_mask")),
                      is_causal=masks.get("is_causal", False))
    got = R.multi_head_attention(query, key, value, state_dict_np(mha), nh, **masks)
    assert got.shape == (B, Lq, E)
    np.testing.assert_allclose(got, N(want), **TOL)
    if kind == "causal":  # is_causal alone applies the causal mask
        alone = R.multi_head_attention(query, key, value, state_dict_np(mha), nh, is_causal=True)
        np.testing.assert_allclose(alone, N(want), **TOL)


def test_multi_head_attention_fully_masked_row():
    E, nh, L = 16, 2, 4
    mha = torch.nn.MultiheadAttention(E, nh, batch_first=True, dtype=torch.float64)
    params = state_dict_np(mha)
    x = rng(22).normal(size=(1, L, E))
    kpm = np.ones((1, L), dtype=bool)  # every key ignored
    out = R.multi_head_attention(x, x, x, params, nh, key_padding_mask=kpm)
    # attention output 0, so only the output projection's bias remains
    np.testing.assert_allclose(out, np.broadcast_to(params["out_proj.bias"], out.shape), **TOL)


@pytest.mark.parametrize("length,dim", [(1, 1), (17, 8), (130, 33), (5, 100)])
def test_sinusoidal_positional_encoding(length, dim):
    pe = R.sinusoidal_positional_encoding(length, dim)
    assert pe.shape == (length, dim) and pe.dtype == np.float64
    want = np.zeros((length, dim))
    for pos in range(length):
        for c in range(dim):
            i2 = c - c % 2
            angle = pos / 10000 ** (i2 / dim)
            want[pos, c] = math.sin(angle) if c % 2 == 0 else math.cos(angle)
    np.testing.assert_allclose(pe, want, rtol=1e-12, atol=1e-12)
    np.testing.assert_array_equal(pe[0, 0::2], 0.0)
    np.testing.assert_array_equal(pe[0, 1::2], 1.0)


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["gelu", "relu"])
@pytest.mark.parametrize("kind", ["none", "key_padding", "causal"])
def test_transformer_block_vs_torch(norm_first, activation, kind):
    E, nh, ff, B, L = 40, 4, 64, 2, 17
    torch.manual_seed(1)
    layer = torch.nn.TransformerEncoderLayer(E, nh, dim_feedforward=ff, dropout=0.0,
                                             activation=activation, batch_first=True,
                                             norm_first=norm_first, dtype=torch.float64)
    with torch.no_grad():  # non-trivial affine parameters
        for name, p in layer.named_parameters():
            if "norm" in name or "bias" in name:
                p.normal_()
    layer.train()  # dropout is 0; training mode avoids the fused fast path
    x = rng(23).normal(size=(B, L, E))
    masks = mha_masks(kind, B, nh, L, L)
    with torch.no_grad():
        want = layer(T(x), src_mask=torch_mask(masks.get("attn_mask")),
                     src_key_padding_mask=torch_mask(masks.get("key_padding_mask")),
                     is_causal=masks.get("is_causal", False))
    got = R.transformer_block(x, state_dict_np(layer), nh, norm_first=norm_first,
                              activation=activation, eps=1e-5, **masks)
    assert got.shape == (B, L, E)
    np.testing.assert_allclose(got, N(want), rtol=1e-9, atol=1e-10)
