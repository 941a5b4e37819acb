"""The CUDA C++ kernels (csrc/cuda: softmax.cu, ffn.cu, layer_norm.cu, attention.cu, varlen.cu)
against the float64 reference.

GPU only: every test is marked ``gpu`` (skipped on machines without CUDA, see conftest.py) and
also skips when the extension was built without its CUDA kernels. The public functions are
called with ``backend="cuda"`` (autograd included); ``torch.library.opcheck`` checks each op's
registration (schema, fake implementation, autograd wiring) against the real kernels.

Shapes are chosen to hit the kernels' edges: odd lengths (partial tiles), head dims that are not
a multiple of the tile (40, 80, 96, 100), the three head-dim buckets (64, 128, 256), the softmax
warp path (Lk <= 1024), its cached (<= 11264) and uncached block paths, and unaligned rows
(scalar loads instead of 16-byte vectors).
"""

from __future__ import annotations

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fastattn
from fastattn import reference as ref
from fastattn.testing import assert_close_to_reference

from cuda_cases import (ACTS, ATT_CASES, ATT_TOL, SM_TOL, att_run, check_att, close as _close,
                        mask_np as _mask_np, np_of as _np)
from test_paged import CASES as PAGED_CASES, SPLIT_CASE, _ids as _paged_id, _paged, check_paged
from test_varlen import CASES as VARLEN_CASES, KERNEL_CASES as VARLEN_LONG, _ids as _varlen_id, \
    _packed, check_dropout, check_fully_masked_rows, check_varlen

pytestmark = pytest.mark.gpu

DEV = "cuda"


def _cuda_backend_ready():
    if not torch.cuda.is_available():
        return "needs a CUDA GPU"
    return fastattn.backend_status().get("cuda")


@pytest.fixture(autouse=True)
def _need_cuda_backend():
    reason = _cuda_backend_ready()
    if reason:
        pytest.skip(f"cuda backend unavailable: {reason}")


def _sum_to(g, shape):
    """Sum a full-shape gradient down to a broadcast shape (numpy)."""
    lead = g.ndim - len(shape)
    g = g.sum(axis=tuple(range(lead))) if lead else g
    axes = tuple(i for i, s in enumerate(shape) if s == 1 and g.shape[i] != 1)
    return g.sum(axis=axes, keepdims=True) if axes else g


# =============================================================================================
# softmax
# =============================================================================================


# (L0, L1, Lq, Lk): warp path (E = 1..32 elements per lane), block path cached / uncached, long.
SM_SHAPES = [
    (2, 3, 5, 7),
    (1, 1, 1, 1),
    (2, 2, 9, 64),
    (1, 2, 33, 1000),
    (1, 2, 3, 1024),
    (1, 2, 3, 1025),
    (1, 1, 4, 4096),
    (1, 1, 2, 11264),
    (1, 1, 2, 12289),
    (1, 1, 1, 262144),
]


def _sm_mask(kind, shape, gen):
    L0, L1, Lq, Lk = shape
    if kind is None:
        return None
    if kind == "bool_rows":  # (1, 1, Lq, Lk) broadcast, with a fully masked row
        m = torch.rand(1, 1, Lq, Lk, generator=gen) > 0.3
        m[..., 0, :] = False
        return m.to(DEV)
    if kind == "float_keys":  # (L0, 1, 1, Lk) float with -inf entries
        m = torch.randn(L0, 1, 1, Lk, generator=gen)
        m[torch.rand(m.shape, generator=gen) < 0.2] = float("-inf")
        return m.to(DEV)
    if kind == "f64_col":  # (L0, L1, Lq, 1): last-dim broadcast (stride 0 along Lk), float64
        return torch.randn(L0, L1, Lq, 1, generator=gen, dtype=torch.float64).to(DEV)
    if kind == "half_full":
        return torch.randn(shape, generator=gen).half().to(DEV)
    raise ValueError(kind)


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("shape", SM_SHAPES, ids=lambda s: "x".join(map(str, s)))
def test_softmax_shapes(shape, dtype):
    gen = torch.Generator().manual_seed(0)
    x = (2 * torch.randn(shape, generator=gen)).to(dtype).to(DEV).requires_grad_()
    dy = torch.randn(shape, generator=gen).to(dtype).to(DEV)
    y = fastattn.scaled_masked_softmax(x, None, scale=0.7, backend="cuda")
    want = ref.softmax(_np(x), None, 0.7)
    _close("y", y, want, SM_TOL[dtype])
    (dx,) = torch.autograd.grad(y, x, dy)
    _close("dx", dx, ref.softmax_backward(_np(dy), _np(y), 0.7), 4 * SM_TOL[dtype])


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("kind", ["bool_rows", "float_keys", "f64_col", "half_full"])
@pytest.mark.parametrize("causal", [False, True])
@pytest.mark.parametrize("shape", [(2, 3, 17, 33), (1, 2, 5, 2000), (1, 1, 3, 13000)],
                         ids=lambda s: "x".join(map(str, s)))
def test_softmax_masks(shape, kind, causal, dtype):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=gen).to(dtype).to(DEV).requires_grad_()
    mask = _sm_mask(kind, shape, gen)
    if mask.is_floating_point():
        mask.requires_grad_()
    y = fastattn.scaled_masked_softmax(x, mask, scale=0.5, is_causal=causal, backend="cuda")
    want = ref.softmax(_np(x), _mask_np(mask), 0.5, causal)
    _close("y", y, want, SM_TOL[dtype])
    dy = torch.randn(shape, generator=gen).to(dtype).to(DEV)
    inputs = (x, mask) if mask.requires_grad else (x,)
    grads = torch.autograd.grad(y, inputs, dy)
    _close("dx", grads[0], ref.softmax_backward(_np(dy), _np(y), 0.5), 4 * SM_TOL[dtype])
    if mask.requires_grad:
        full = ref.softmax_backward(_np(dy), _np(y), 1.0)
        # dmask comes back in the mask's dtype: a float16 mask rounds it to float16
        tol = max(SM_TOL[dtype], SM_TOL.get(mask.dtype, 0.0))
        _close("dmask", grads[1], _sum_to(full, tuple(mask.shape)), 8 * tol)
    # Fully masked rows: exactly 0, with zero gradient.
    dead = np.isclose(want.sum(-1), 0.0)
    if dead.any():
        assert not _np(y)[dead].any()
        assert not _np(grads[0])[dead].any()


def test_softmax_strided_and_unaligned_inputs():
    """A transposed (non-contiguous leading dims) x and an odd row length (no vector loads)."""
    gen = torch.Generator().manual_seed(2)
    base = torch.randn(3, 2, 6, 45, generator=gen).half().to(DEV)
    x = base.transpose(0, 1)  # (2, 3, 6, 45), leading strides permuted
    y = fastattn.scaled_masked_softmax(x, None, scale=1.3, is_causal=True, backend="cuda")
    _close("y", y, ref.softmax(_np(x), None, 1.3, True), SM_TOL[torch.float16])
    # offset by one element: the row starts are not 16-byte aligned
    flat = torch.randn(1 + 4 * 64, generator=gen).to(DEV)
    x2 = flat[1:].view(1, 1, 4, 64)
    y2 = fastattn.scaled_masked_softmax(x2, None, scale=1.0, backend="cuda")
    _close("y2", y2, ref.softmax(_np(x2)), SM_TOL[torch.float32])


def test_softmax_empty():
    x = torch.randn(2, 0, 3, 5, device=DEV)
    assert fastattn.scaled_masked_softmax(x, backend="cuda").shape == x.shape
    x = torch.randn(2, 1, 3, 0, device=DEV)
    assert fastattn.scaled_masked_softmax(x, backend="cuda").shape == x.shape


# =============================================================================================
# ffn
# =============================================================================================

def _ffn_inputs(M, D, F, D2, act, dtype, bias, seed=0):
    gen = torch.Generator().manual_seed(seed)
    f1 = 2 * F if act in ("swiglu", "geglu") else F

    def rnd(*s, scale=1.0):
        return (scale * torch.randn(*s, generator=gen)).to(dtype).to(DEV).requires_grad_()

    x = rnd(M, D)
    w1, w2 = rnd(f1, D, scale=D ** -0.5), rnd(D2, F, scale=F ** -0.5)
    b1 = rnd(f1, scale=0.5) if bias else None
    b2 = rnd(D2, scale=0.5) if bias else None
    return x, w1, b1, w2, b2


@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("act", ACTS)
@pytest.mark.parametrize(
    "M,D,F,D2,bias",
    [(37, 64, 128, 64, True), (1, 48, 100, 35, False), (300, 33, 71, 17, True), (513, 128, 256, 96, True)],
)
def test_ffn(M, D, F, D2, bias, act, dtype):
    x, w1, b1, w2, b2 = _ffn_inputs(M, D, F, D2, act, dtype, bias)
    out = fastattn.ffn(x, w1, b1, w2, b2, act, backend="cuda")
    # PyTorch in the same dtype is the baseline of the tolerance policy (fastattn.testing).
    base = fastattn.ffn(x, w1, b1, w2, b2, act, backend="naive")
    args = [_np(t) for t in (x, w1, b1, w2, b2)]
    assert_close_to_reference(out, ref.ffn(*args, act), base, factor=3.0, name="out")
    dout = torch.randn_like(out)
    params = [t for t in (x, w1, b1, w2, b2) if t is not None]
    got = torch.autograd.grad(out, params, dout)
    want_all = ref.ffn_backward(_np(dout), *args, act)
    base_all = torch.autograd.grad(base, params, dout)
    want = [w for w in want_all if w is not None]
    names = [n for n, t in zip(("dx", "dw1", "db1", "dw2", "db2"), (x, w1, b1, w2, b2)) if t is not None]
    for name, g, w, bl in zip(names, got, want, base_all):
        assert g.dtype == dtype, name
        assert_close_to_reference(g, w, bl, factor=3.0, name=name)


def test_ffn_bias_grad_is_deterministic():
    x, w1, b1, w2, b2 = _ffn_inputs(4099, 64, 96, 32, "swiglu", torch.float32, True, seed=3)
    out = fastattn.ffn(x, w1, b1, w2, b2, "swiglu", backend="cuda")
    dout = torch.randn_like(out)
    first = torch.autograd.grad(out, (b1, b2), dout, retain_graph=True)
    again = torch.autograd.grad(out, (b1, b2), dout)
    for a, b in zip(first, again):
        assert torch.equal(a, b)


def test_ffn_empty_rows():
    x, w1, b1, w2, b2 = _ffn_inputs(0, 16, 32, 8, "gelu", torch.float32, True)
    out = fastattn.ffn(x, w1, b1, w2, b2, "gelu", backend="cuda")
    assert out.shape == (0, 8)
    g = torch.autograd.grad(out.sum(), (w1, b1, w2, b2))
    for t in g:
        assert not t.any()


# =============================================================================================
# attention
# =============================================================================================
# layer_norm.cu at its shared memory edges: the kernels cache rows (and, backward, the dweight /
# dbias accumulators) in dynamic shared memory, and 48 KB of it exactly, with the kernel's static
# arrays beside it, is over the limit a block gets without opting in (the H100, 2026-11-26: the
# bf16 backward at n = 4096 failed with "invalid argument"). Cases: (dtype, n, affine) with the
# bytes they ask for: backward 2*n*sizeof(T) + n*4*accumulators, forward n*sizeof(T).
LN_EDGES = [
    (torch.bfloat16, 4096, "weight+bias"),  # backward: 16 KB + 32 KB = 48 KB
    (torch.float32, 3072, "weight+bias"),   # backward: 24 KB + 24 KB
    (torch.float32, 4096, "weight"),        # backward: 32 KB + 16 KB
    (torch.bfloat16, 6144, "weight"),       # backward: 24 KB + 24 KB
    (torch.bfloat16, 24576, None),          # forward: 48 KB; backward: 96 KB (opted in)
    (torch.float32, 12288, None),           # forward: 48 KB
    (torch.float32, 65536, "weight+bias"),  # past the opt-in limit: no cache, global accumulators
]


@pytest.mark.parametrize("dtype,n,affine", LN_EDGES, ids=lambda v: str(v).replace("torch.", ""))
def test_layer_norm_at_the_shared_memory_edges(dtype, n, affine):
    gen = torch.Generator().manual_seed(0)
    x = torch.randn(3, n, generator=gen).to(dtype).to(DEV).requires_grad_()
    w = (1 + torch.randn(n, generator=gen)).to(dtype).to(DEV).requires_grad_() if affine else None
    b = torch.randn(n, generator=gen).to(dtype).to(DEV).requires_grad_() \
        if affine == "weight+bias" else None
    dy = torch.randn(3, n, generator=gen).to(dtype).to(DEV)
    y = fastattn.layer_norm(x, (n,), w, b, eps=1e-5, backend="cuda")
    want_y, _, _ = ref.layer_norm(_np(x), (n,), _np(w), _np(b), 1e-5)
    assert_close_to_reference(y, want_y, F.layer_norm(x, (n,), w, b, 1e-5), name="y")
    inputs = [t for t in (x, w, b) if t is not None]
    got = torch.autograd.grad(y, inputs, dy)
    base = torch.autograd.grad(F.layer_norm(x, (n,), w, b, 1e-5), inputs, dy)
    want = ref.layer_norm_backward(_np(dy), _np(x), (n,), _np(w), 1e-5)
    for name, g, r, bl in zip(("dx", "dweight", "dbias"), got, want, base):
        assert_close_to_reference(g, r, bl, name=name)


# =============================================================================================

def _att_run(case, dtype, seed=1234, transposed=False):
    return att_run(case, dtype, DEV, "cuda", seed, transposed)


# The forward's rows per warp: 16 (the default configs) and 32 (Configs<DP>::FwdWide, two m16
# tiles a warp, head dims up to 128; FASTATTN_CUDA_FWD_ROWS=32 until it has run on a GPU).
FWD_ROWS = [pytest.param(16, id="rows16"), pytest.param(32, id="rows32")]


def _fwd_rows(rows, monkeypatch, *head_dims):
    if rows == 32:
        if max(head_dims) > 128:
            pytest.skip("the 32-row forward covers head dims up to 128")
        monkeypatch.setenv("FASTATTN_CUDA_FWD_ROWS", "32")


@pytest.mark.parametrize("rows", FWD_ROWS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", list(ATT_CASES))
def test_attention_matches_reference(case, dtype, rows, monkeypatch):
    *_, D, Dv, _, _, _, _ = ATT_CASES[case]
    _fwd_rows(rows, monkeypatch, D, Dv)
    out, lse, grads, want, _ = _att_run(case, dtype, transposed=case == "plain_d64")
    check_att(case, dtype, out, lse, grads, want)


@pytest.mark.parametrize("rows", FWD_ROWS)
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("seed", [5, 3_000_000_000, 2**40 + 17])
def test_attention_dropout_mask_is_the_shared_rng(seed, dtype, rows, monkeypatch):
    """q = k = 0 gives uniform P = 1 / L; with v = I the output is keep / ((1 - p) L) exactly,
    so its support is the keep-mask, which must equal the reference's bit for bit."""
    B, H, L, p = 2, 3, 64, 0.4
    _fwd_rows(rows, monkeypatch, 32, L)  # (head dims D, Dv)
    q = torch.zeros(B, H, L, 32, device=DEV, dtype=dtype)
    k = torch.zeros(B, 1, L, 32, device=DEV, dtype=dtype)
    v = torch.eye(L, device=DEV, dtype=dtype).expand(B, 1, L, L)
    out = fastattn.attention(q, k, v, dropout_p=p, seed=seed, enable_gqa=True, backend="cuda")
    keep = ref.dropout_keep_mask(seed, B, H, L, L, p)
    np.testing.assert_array_equal(_np(out) != 0, keep)
    expect = keep / ((1 - p) * L)
    np.testing.assert_allclose(_np(out), expect, rtol=ATT_TOL[dtype])


def test_attention_backward_is_deterministic_and_replays():
    def run(seed):
        out, lse, grads, _, _ = _att_run("dropout_gqa", torch.bfloat16, seed=seed)
        return (out, lse, *grads)

    first, again, other = run(11), run(11), run(12)
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    assert not torch.equal(first[0], other[0])


@pytest.mark.parametrize("D", [64, 128])
def test_attention_unaligned_inputs_take_the_element_path(D):
    """Base pointers off a 16-byte boundary (a storage offset of one element): the tile loads
    cannot use 16-byte cp.async and fall back to element loads; results must not change."""
    gen = torch.Generator().manual_seed(3)
    B, H, L = 1, 2, 150

    def rnd(*s):
        buf = torch.randn(*s[:-1], s[-1] + 1, generator=gen).half().to(DEV)
        return buf[..., 1:]

    q, k, v = rnd(B, H, L, D), rnd(B, H, L, D), rnd(B, H, L, D)
    assert q.data_ptr() % 16 != 0
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = fastattn.attention(q, k, v, causal=True, backend="cuda")
    dout = torch.randn(out.shape, generator=gen).half().to(DEV)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    args = (_np(q), _np(k), _np(v), None, D ** -0.5, True, None, 0.0, 0, False)
    _close("out", out, ref.attention(*args)[0], ATT_TOL[torch.float16])
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref.attention_backward(_np(dout), *args)):
        _close(name, got, want, 4 * ATT_TOL[torch.float16])


def test_attention_float32_is_rejected_with_a_clear_error():
    q = torch.randn(1, 1, 4, 16, device=DEV)
    with pytest.raises(ValueError, match="float32.*triton"):  # refused by the backend's limits
        fastattn.attention(q, q, q, backend="cuda")


def test_attention_empty_keys_and_queries():
    q = torch.randn(1, 2, 5, 64, device=DEV, dtype=torch.float16, requires_grad=True)
    k = torch.randn(1, 2, 0, 64, device=DEV, dtype=torch.float16, requires_grad=True)
    out, lse = fastattn.attention(q, k, k, return_lse=True, backend="cuda")
    assert not out.any() and torch.isneginf(lse).all()
    (dq,) = torch.autograd.grad(out.sum(), (q,))
    assert not dq.any()
    q0 = torch.randn(1, 2, 0, 64, device=DEV, dtype=torch.float16)
    k1 = torch.randn(1, 2, 7, 64, device=DEV, dtype=torch.float16)
    assert fastattn.attention(q0, k1, k1, backend="cuda").shape == (1, 2, 0, 64)


def test_sdpa_dropin_matches_torch():
    gen = torch.Generator().manual_seed(5)
    q, k, v = (torch.randn(2, 4, 77, 64, generator=gen).half().to(DEV) for _ in range(3))
    got = fastattn.scaled_dot_product_attention(q, k, v, is_causal=True, backend="cuda")
    want = torch.nn.functional.scaled_dot_product_attention(q.float(), k.float(), v.float(), is_causal=True)
    torch.testing.assert_close(got.float(), want, atol=5e-3, rtol=5e-3)


# =============================================================================================
# opcheck: schema, fake (meta) implementation and autograd registration of every CUDA op
# =============================================================================================

_OPCHECK_TESTS = ("test_schema", "test_faketensor", "test_autograd_registration")


def _opcheck(op, args):
    torch.library.opcheck(op, args, test_utils=_OPCHECK_TESTS)


def test_opcheck_softmax():
    x = torch.randn(2, 3, 5, 37, device=DEV, dtype=torch.float16, requires_grad=True)
    mask = (torch.rand(1, 1, 5, 37, device=DEV) > 0.2).expand(2, 3, 5, 37)
    _opcheck(torch.ops.fastattn.softmax_fwd.default, (x, mask, 0.5, True))
    y = torch.ops.fastattn.softmax_fwd(x.detach(), None, 0.5, False)
    _opcheck(torch.ops.fastattn.softmax_bwd.default, (torch.randn_like(y), y, 0.5))


def test_opcheck_ffn():
    x = torch.randn(9, 16, device=DEV, requires_grad=True)
    w1 = torch.randn(64, 16, device=DEV, requires_grad=True)
    b1 = torch.randn(64, device=DEV, requires_grad=True)
    w2 = torch.randn(8, 32, device=DEV, requires_grad=True)
    b2 = torch.randn(8, device=DEV, requires_grad=True)
    _opcheck(torch.ops.fastattn.ffn_fwd.default, (x, w1, b1, w2, b2, "swiglu"))
    out, pre = torch.ops.fastattn.ffn_fwd(x.detach(), w1.detach(), b1.detach(), w2.detach(), b2.detach(), "swiglu")
    _opcheck(torch.ops.fastattn.ffn_bwd.default,
             (torch.randn_like(out), x.detach(), w1.detach(), w2.detach(), pre, "swiglu", [True, True]))


def test_opcheck_attention():
    q = torch.randn(1, 4, 33, 40, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    k = torch.randn(1, 2, 47, 40, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    v = torch.randn(1, 2, 47, 24, device=DEV, dtype=torch.bfloat16, requires_grad=True)
    mask = torch.randn(1, 1, 33, 47, device=DEV).expand(1, 4, 33, 47)
    args = (q, k, v, mask, 0.2, 14, 80, 0, 0.0, 0)
    _opcheck(torch.ops.fastattn.attention_fwd.default, args)
    out, lse = torch.ops.fastattn.attention_fwd(q.detach(), k.detach(), v.detach(), *args[3:])
    _opcheck(torch.ops.fastattn.attention_bwd.default,
             (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, mask, 0.2, 14,
              80, 0, 0.1, 7, True))


def test_opcheck_varlen_attention():
    q, k, v, cu_q, cu_k = _packed([5, 0, 17], [9, 3, 17], 4, 2, 40, 24, DEV, torch.bfloat16)
    args = (q, k, v, cu_q, cu_k, 17, 17, 0.2, True, 6, 0, 0.0, 0)
    _opcheck(torch.ops.fastattn.varlen_attention_fwd.default, args)
    out, lse = torch.ops.fastattn.varlen_attention_fwd(q.detach(), k.detach(), v.detach(), *args[3:])
    _opcheck(torch.ops.fastattn.varlen_attention_bwd.default,
             (torch.randn_like(out), q.detach(), k.detach(), v.detach(), out, lse, *args[3:11], 0.1, 7))


# =============================================================================================
# varlen_attention (packed sequences): the attention kernels' PACKED instances
# =============================================================================================


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", VARLEN_CASES + VARLEN_LONG, ids=_varlen_id)
def test_cuda_varlen_matches_reference(case, dtype):
    check_varlen("cuda", DEV, case, dtype)


def test_cuda_varlen_grid_past_every_sequence():
    check_varlen("cuda", DEV, VARLEN_CASES[1], torch.float16, max_seqlens=(150, 200))


def test_cuda_varlen_fully_masked_rows_and_dropout():
    check_fully_masked_rows("cuda", DEV, torch.float16)
    check_dropout("cuda", DEV, torch.bfloat16)


# =============================================================================================
# paged_attention (paged.cu: split-KV decoding over a paged cache, forward only)
# =============================================================================================


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
@pytest.mark.parametrize("case", PAGED_CASES, ids=_paged_id)
def test_cuda_paged_matches_reference(case, dtype):
    check_paged("cuda", DEV, case, dtype)


@pytest.mark.parametrize("splits", [1, 3, 8])
def test_cuda_paged_key_splits_merge(splits, monkeypatch):
    monkeypatch.setenv("FASTATTN_CUDA_PAGED_SPLITS", str(splits))
    check_paged("cuda", DEV, SPLIT_CASE, torch.float16)


def test_cuda_paged_long_cache_splits():
    """A 20k-key cache at batch 1: the default split count (about two CTAs per SM) and merge."""
    check_paged("cuda", DEV, ([20000, 3000], 1, 8, 2, 128, 128, 16, "bottom_right", None),
                torch.bfloat16)


def test_opcheck_paged_attention():
    q, kc, vc, table, seqlens = _paged([9, 30], 2, 4, 2, 40, 24, 8, DEV, torch.bfloat16)
    _opcheck(torch.ops.fastattn.paged_attention_fwd.default,
             (q, kc, vc, table, seqlens, 0.3, True, 50, 0))
