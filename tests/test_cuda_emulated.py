"""The cuda backend's kernels RUN without a GPU: csrc/cuda/*.cu's device code, compiled for the
host on the SIMT emulator (fastattn.aot.emulate, cuda_emulator.h), against the float64 reference;
attention on the GPU tests' own cases (cuda_cases.py), packed (varlen) attention on
test_varlen.py's, the other ops on each of their paths.

What this proves before a GPU does: the fragment maps of ldmatrix and mma.sync as the kernels
use them, the swizzled tile addresses, the cp.async double buffers (a copy lands only at its
wait_group), the online softmax, masks, bands, GQA, dropout's RNG, the three backward kernels and
the NaN rule's careful paths, for both forward configs (16 and 32 query rows a warp); and, by the
emulator's happens-before check, that no shared-memory access races. What it does not: speed,
occupancy, the compiler's sm_90a code. The emulator's own checks have their controls at the end.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastattn import reference as ref
from fastattn.reference import rope as ref_rope

import fastattn
from cuda_cases import ATT_CASES, ATT_TOL, SM_TOL, att_run, check_att, close, np_of
from test_nan import KERNEL_CASES, _check_kernel_case as check_kernel_case
from test_paged import CASES as PAGED_CASES, SPLIT_CASE, _ids as paged_id, _paged, check_paged
from test_varlen import CASES as VARLEN_CASES, KERNEL_CASES as VARLEN_LONG, _ids as varlen_id, \
    _packed, check_dropout, check_fully_masked_rows, check_varlen

emulate = pytest.importorskip("fastattn.aot.emulate")


@pytest.fixture(scope="module")
def kernels():
    try:
        return emulate.load()
    except emulate.EmulatorUnavailable as e:
        pytest.skip(str(e))


@pytest.fixture(scope="module")
def backend(kernels):
    """The emulated kernels as the attention backend "cuda_emulated" (autograd included)."""
    return emulate.register()


# Every case of the GPU tests in float16 with the default forward; bfloat16 and the 32-row
# forward (FwdWide) on the cases that reach their distinct paths, keeping the emulated run short.
CASES = [pytest.param(c, torch.float16, 16, id=f"{c}-f16-rows16") for c in ATT_CASES]
CASES += [pytest.param(c, torch.bfloat16, 16, id=f"{c}-bf16-rows16")
          for c in ("gqa_d40_causal", "bias_causal", "dropout_bias_window", "long_d256")]
CASES += [pytest.param(c, dt, 32, id=f"{c}-{str(dt)[6:].replace('loat', '')}-rows32")
          for c, dt in (("plain_d64", torch.float16), ("d80_dv96_br", torch.bfloat16),
                        ("full_bool", torch.float16), ("dropout_gqa", torch.bfloat16),
                        ("long_causal_d128", torch.float16), ("long_window_d64", torch.float16),
                        ("empty_block_br", torch.float16))]


@pytest.mark.parametrize("case,dtype,rows", CASES)
def test_emulated_attention_matches_reference(backend, case, dtype, rows, monkeypatch):
    if rows == 32:
        monkeypatch.setenv("FASTATTN_CUDA_FWD_ROWS", "32")
    out, lse, grads, want, _ = att_run(case, dtype, "cpu", backend,
                                       transposed=case == "plain_d64")
    check_att(case, dtype, out, lse, grads, want)


@pytest.mark.parametrize("rows", [16, 32])
@pytest.mark.parametrize("D", [16, 100, 256])
@pytest.mark.parametrize("case", KERNEL_CASES, ids=[c[0] for c in KERNEL_CASES])
def test_emulated_nan_rule_paths(backend, case, D, rows, monkeypatch):
    """test_nan.py's cuda cases: the detect-and-recompute paths (forward per warp, dK/dV and dQ
    per CTA) with NaN and inf in q, k, v, GQA, dropout, bands and a float mask, bfloat16."""
    if rows == 32:
        if D > 128:
            pytest.skip("the 32-row forward covers head dims up to 128")
        monkeypatch.setenv("FASTATTN_CUDA_FWD_ROWS", "32")
    check_kernel_case(case, backend, "cpu", torch.bfloat16, D=D)


@pytest.mark.parametrize("rows", [16, 32])
def test_emulated_dropout_mask_is_the_shared_rng(backend, rows, monkeypatch):
    """q = k = 0 gives P = 1 / L; with v = I the output is keep / ((1 - p) L): its support must
    be the reference's keep-mask bit for bit (seeds past 2^32 included)."""
    if rows == 32:
        monkeypatch.setenv("FASTATTN_CUDA_FWD_ROWS", "32")
    B, H, L, p = 2, 3, 64, 0.4
    for seed in (5, 2**40 + 17):
        q = torch.zeros(B, H, L, 32, dtype=torch.float16)
        k = torch.zeros(B, 1, L, 32, dtype=torch.float16)
        v = torch.eye(L, dtype=torch.float16).expand(B, 1, L, L)
        out = fastattn.attention(q, k, v, dropout_p=p, seed=seed, enable_gqa=True, backend=backend)
        keep = ref.dropout_keep_mask(seed, B, H, L, L, p)
        np.testing.assert_array_equal(np_of(out) != 0, keep)
        np.testing.assert_allclose(np_of(out), keep / ((1 - p) * L), rtol=ATT_TOL[torch.float16])


def test_emulated_backward_is_deterministic(backend):
    def run(seed):
        out, lse, grads, _, _ = att_run("dropout_gqa", torch.bfloat16, "cpu", backend, seed=seed)
        return (out, lse, *grads)

    first, again, other = run(11), run(11), run(12)
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    assert not torch.equal(first[0], other[0])


@pytest.mark.parametrize("D", [64, 128])
def test_emulated_unaligned_inputs_take_the_element_path(backend, D):
    """Base pointers off a 16-byte boundary: no 16-byte cp.async (the emulator would refuse an
    unaligned one), element loads instead; results unchanged."""
    gen = torch.Generator().manual_seed(3)
    B, H, L = 1, 2, 150

    def rnd(*s):
        return torch.randn(*s[:-1], s[-1] + 1, generator=gen).half()[..., 1:]

    q, k, v = rnd(B, H, L, D), rnd(B, H, L, D), rnd(B, H, L, D)
    assert q.data_ptr() % 16 != 0
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    out = fastattn.attention(q, k, v, causal=True, backend=backend)
    dout = torch.randn(out.shape, generator=gen).half()
    grads = torch.autograd.grad(out, (q, k, v), dout)
    args = (np_of(q), np_of(k), np_of(v), None, D ** -0.5, True, None, 0.0, 0, False)
    close("out", out, ref.attention(*args)[0], ATT_TOL[torch.float16])
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref.attention_backward(np_of(dout), *args)):
        close(name, got, want, 4 * ATT_TOL[torch.float16])


def test_emulated_empty_keys(backend):
    """No keys at all: every CTA has no key tile; out 0, lse -inf, gradients 0."""
    q = torch.randn(1, 2, 5, 64, dtype=torch.float16, requires_grad=True)
    k = torch.randn(1, 2, 0, 64, dtype=torch.float16, requires_grad=True)
    v = torch.randn(1, 2, 0, 64, dtype=torch.float16, requires_grad=True)
    out, lse = fastattn.attention(q, k, v, return_lse=True, backend=backend)
    assert out.shape == (1, 2, 5, 64) and not out.any()
    assert torch.isneginf(lse).all()
    (dq,) = torch.autograd.grad(out, (q,), torch.ones_like(out))
    assert not dq.any()


# ---------------------------------------------------------------------------------------------
# Packed variable-length sequences (varlen_attention): the same kernels, each CTA narrowed to its
# sequence by seq_view(), on test_varlen.py's cases and checks.

# (The 32-row forward is not built for packed launches: FASTATTN_CUDA_FWD_ROWS leaves them be.)
VARLEN = [pytest.param(c, torch.float16, id=f"{varlen_id(c)}-f16") for c in VARLEN_CASES + VARLEN_LONG]
VARLEN += [pytest.param(VARLEN_CASES[1], torch.bfloat16, id=f"{varlen_id(VARLEN_CASES[1])}-bf16")]


@pytest.mark.parametrize("case,dtype", VARLEN)
def test_emulated_varlen_matches_reference(backend, case, dtype):
    check_varlen(backend, "cpu", case, dtype)


def test_emulated_varlen_grid_past_every_sequence(backend):
    """max_seqlen above every length: CTAs past their sequence's end exit before any barrier."""
    check_varlen(backend, "cpu", VARLEN_CASES[1], torch.float16, max_seqlens=(150, 200))


def test_emulated_varlen_fully_masked_rows_and_dropout(backend):
    check_fully_masked_rows(backend, "cpu", torch.float16)
    check_dropout(backend, "cpu", torch.bfloat16)


def test_emulated_varlen_bad_cu_seqlens_stay_in_bounds(kernels):
    """The op trusts cu_seqlens' values (the public function checks them, on the host); a
    sequence past the totals is left empty rather than read or written out of bounds, and the
    valid ones are unaffected."""
    q, k, v, cu_q, cu_k = _packed([5, 2], [4, 3], 2, 2, 16, 16, "cpu", torch.float16)
    bad_q = torch.tensor([0, 5, 90], dtype=torch.int32)
    out, lse = kernels.varlen_attention_fwd(q, k, v, bad_q, cu_k, 90, 4, 0.25, False, 9, 9, 0.0, 0)
    want, want_lse = ref.varlen_attention(np_of(q), np_of(k), np_of(v), cu_q, cu_k, scale=0.25)
    close("out", out[:5], want[:5], ATT_TOL[torch.float16])
    close("lse", lse[:, :5], want_lse[:, :5], ATT_TOL[torch.float16])


# ---------------------------------------------------------------------------------------------
# Paged KV cache (paged.cu, forward only): test_paged.py's cases and check, the key splits'
# merge, NaN only where attended, bad indices kept in bounds.

PAGED = [pytest.param(c, torch.float16, id=f"{paged_id(c)}-f16") for c in PAGED_CASES]
PAGED += [pytest.param(PAGED_CASES[0], torch.bfloat16, id=f"{paged_id(PAGED_CASES[0])}-bf16")]


@pytest.mark.parametrize("case,dtype", PAGED)
def test_emulated_paged_matches_reference(backend, case, dtype):
    check_paged(backend, "cpu", case, dtype)


@pytest.mark.parametrize("splits", [1, 3, 8])
def test_emulated_paged_key_splits_merge(backend, splits, monkeypatch):
    monkeypatch.setenv("FASTATTN_CUDA_PAGED_SPLITS", str(splits))
    check_paged(backend, "cpu", SPLIT_CASE, torch.float16)


@pytest.mark.parametrize("D", [64, 100])  # 16-byte K loads, and element loads
def test_emulated_paged_nan_only_where_attended(backend, D):
    """NaN in every cache slot no row attends (spare blocks, the slots past each length) changes
    nothing; a NaN in an attended V row reaches that column of the rows attending it."""
    q, kc, vc, table, seqlens = _paged([20, 9], 2, 2, 1, D, D, 8, "cpu", torch.float16)
    clean = fastattn.paged_attention(q, kc, vc, table, seqlens, backend=backend)
    used = torch.zeros(kc.shape[:2], dtype=torch.bool)
    for b, n in enumerate(seqlens.tolist()):
        t = torch.arange(n)
        used[table[b, t // 8].long(), t % 8] = True
    kc[~used], vc[~used] = float("nan"), float("nan")
    assert torch.equal(fastattn.paged_attention(q, kc, vc, table, seqlens, backend=backend), clean)
    clean_v = vc[table[1, 0].long(), 3, 0, 5].item()
    vc[table[1, 0].long(), 3, 0, 5] = float("nan")  # key 3 of row 1: attended by both its queries
    out = fastattn.paged_attention(q, kc, vc, table, seqlens, backend=backend)
    assert out[1, :, :, 5].isnan().all() and not out[1, :, :, :5].isnan().any()
    assert torch.equal(out[0], clean[0])
    # Key 8 of row 1, its last: only query 1 attends it (query 0 sees keys 0..7), while the CTA
    # reads it for both queries' rows. A NaN in its V row reaches query 1 only; in its K row,
    # every score of query 1 (so its whole output) and nothing of query 0.
    last = (table[1, 1].long(), 0, 0)
    vc[table[1, 0].long(), 3, 0, 5] = clean_v
    vc[last + (7,)] = float("nan")
    out = fastattn.paged_attention(q, kc, vc, table, seqlens, backend=backend)
    assert out[1, :, 1, 7].isnan().all() and not out[1, :, 1, :7].isnan().any()
    assert torch.equal(out[1, :, 0], clean[1, :, 0]) and torch.equal(out[0], clean[0])
    vc[last + (7,)] = clean_v
    kc[last + (2,)] = float("nan")
    out = fastattn.paged_attention(q, kc, vc, table, seqlens, backend=backend)
    assert out[1, :, 1].isnan().all()
    assert torch.equal(out[1, :, 0], clean[1, :, 0]) and torch.equal(out[0], clean[0])


def test_emulated_paged_bad_indices_stay_in_bounds(kernels):
    """The op trusts block_table and cache_seqlens (the public function checks them); an entry
    out of range leaves its key unattended and a length beyond the row's blocks leaves the row
    empty, rather than reading out of bounds; the valid row is unaffected."""
    q, kc, vc, table, seqlens = _paged([12, 7], 1, 2, 2, 32, 32, 4, "cpu", torch.float16)
    bad_table, bad_lens = table.clone(), seqlens.clone()
    bad_table[1, 0] = 1 << 30
    bad_lens[0] = 1 << 20
    out, lse = kernels.paged_attention_fwd(q, kc, vc, bad_table, seqlens, 0.25, True, 99, 0)
    want, want_lse = ref.paged_attention(np_of(q), np_of(kc), np_of(vc), table.numpy(),
                                         seqlens.numpy(), scale=0.25)
    close("out", out[0], want[0], ATT_TOL[torch.float16])
    out, lse = kernels.paged_attention_fwd(q, kc, vc, table, bad_lens, 0.25, True, 99, 0)
    assert not out[0].any() and torch.isneginf(lse[0]).all()
    close("out", out[1], want[1], ATT_TOL[torch.float16])


# ---------------------------------------------------------------------------------------------
# The other CUDA ops (softmax.cu, layer_norm.cu, ffn.cu, rope.cu), called as their torch ops
# take their arguments, against the float64 reference: each kernel path once or twice.

_T = {torch.float32: 1e-4, torch.float16: 4e-3, torch.bfloat16: 3e-2}  # layer norm, FFN, RoPE


@pytest.mark.parametrize("shape,kind,causal,dtype", [
    ((2, 3, 17, 33), None, False, torch.float32),          # warp per row
    ((2, 3, 17, 40), "bool", True, torch.float16),         # warp per row, 16-byte vectors
    ((1, 2, 5, 2000), "float", False, torch.bfloat16),     # block per row, cached scores
    ((1, 1, 3, 13000), "bool", True, torch.float32),       # block per row, two passes
], ids=["warp", "warp-vec-causal", "block-cached", "block-uncached"])
def test_emulated_softmax(kernels, shape, kind, causal, dtype):
    gen = torch.Generator().manual_seed(1)
    x = torch.randn(shape, generator=gen).to(dtype)
    L0, L1, Lq, Lk = shape
    mask = None
    if kind == "bool":  # (1, 1, Lq, Lk), a fully masked row
        mask = torch.rand(1, 1, Lq, Lk, generator=gen) > 0.3
        mask[..., 0, :] = False
    elif kind == "float":  # (L0, 1, 1, Lk) with -inf entries
        mask = torch.randn(L0, 1, 1, Lk, generator=gen)
        mask[torch.rand(mask.shape, generator=gen) < 0.2] = float("-inf")
    y = kernels.softmax_fwd(x, None if mask is None else mask.expand(shape), 0.5, causal)
    want = ref.softmax(np_of(x), None if mask is None else mask.numpy(), 0.5, causal)
    close("y", y, want, SM_TOL[dtype])
    dy = torch.randn(shape, generator=gen).to(dtype)
    dx = kernels.softmax_bwd(dy, y, 0.5)
    close("dx", dx, ref.softmax_backward(np_of(dy), np_of(y), 0.5), 4 * SM_TOL[dtype])


@pytest.mark.parametrize("n,dtype,affine,rms", [
    (64, torch.float32, "weight+bias", False),
    (1000, torch.bfloat16, "weight", False),
    (4096, torch.bfloat16, "weight+bias", False),  # backward at 48 KB of shared memory
    (200, torch.float16, "weight", True),      # RMSNorm
    (333, torch.float32, None, False),         # odd n: element loads
])
def test_emulated_layer_norm(kernels, n, dtype, affine, rms):
    gen = torch.Generator().manual_seed(0)
    M, eps = 6, 1e-5
    x = torch.randn(M, n, generator=gen).to(dtype)
    w = (1 + torch.randn(n, generator=gen)).to(dtype) if affine else None
    b = torch.randn(n, generator=gen).to(dtype) if affine == "weight+bias" else None
    y, _, mean, rstd = kernels.layer_norm_fwd(x, None, w, b, eps, rms)
    assert rstd.dtype == torch.float32
    dy = torch.randn(M, n, generator=gen).to(dtype)
    dx, dw, db = kernels.layer_norm_bwd(dy, None, x, w, mean, rstd, rms, [w is not None, b is not None])
    xs, ws, bs = np_of(x), np_of(w), np_of(b)
    if rms:
        want_y, _ = ref.rms_norm(xs, (n,), ws, eps)
        want = ref.rms_norm_backward(np_of(dy), xs, (n,), ws, eps)
    else:
        want_y = ref.layer_norm(xs, (n,), ws, bs, eps)[0]
        want = ref.layer_norm_backward(np_of(dy), xs, (n,), ws, eps)
    close("y", y, want_y, _T[dtype])
    close("dx", dx, want[0], 4 * _T[dtype])
    if w is not None:
        close("dweight", dw, want[1], 4 * _T[dtype])
    if b is not None:
        close("dbias", db, want[2], 4 * _T[dtype])


@pytest.mark.parametrize("M,D,F,D2,bias,act,dtype", [
    (37, 64, 128, 64, True, "gelu", torch.float32),
    (5, 48, 100, 35, False, "swiglu", torch.float32),
    (30, 33, 71, 17, True, "gelu_tanh", torch.float32),
    (19, 64, 96, 32, True, "geglu", torch.bfloat16),
], ids=lambda v: str(v).replace("torch.", ""))
def test_emulated_ffn(kernels, M, D, F, D2, bias, act, dtype):
    gen = torch.Generator().manual_seed(0)
    f1 = 2 * F if act in ("swiglu", "geglu") else F

    def rnd(*shape, scale=1.0):
        return (scale * torch.randn(*shape, generator=gen)).to(dtype)

    x, w1, w2 = rnd(M, D), rnd(f1, D, scale=D ** -0.5), rnd(D2, F, scale=F ** -0.5)
    b1 = rnd(f1, scale=0.5) if bias else None
    b2 = rnd(D2, scale=0.5) if bias else None
    out, pre = kernels.ffn_fwd(x, w1, b1, w2, b2, act)
    args = [np_of(t) for t in (x, w1, b1, w2, b2)]
    close("out", out, ref.ffn(*args, act), 3 * _T[dtype])
    dout = rnd(M, D2)
    got = kernels.ffn_bwd(dout, x, w1, w2, pre, act, [bias, bias])
    for name, g, w in zip(("dx", "dw1", "db1", "dw2", "db2"), got,
                          ref.ffn_backward(np_of(dout), *args, act)):
        if w is not None:
            close(name, g, w, 6 * _T[dtype])


@pytest.mark.parametrize("interleaved", [False, True])
@pytest.mark.parametrize("D,dtype,positions", [(64, torch.float32, False), (40, torch.bfloat16, True),
                                               (6, torch.float16, False)])
def test_emulated_rope(kernels, D, dtype, positions, interleaved):
    gen = torch.Generator().manual_seed(0)
    B, H, L, P = 2, 3, 9, 16
    x = torch.randn(B, H, L, D, generator=gen).to(dtype)
    cos, sin = (torch.from_numpy(t).float() for t in ref_rope.rotary_cos_sin(P, D))
    pos = torch.randint(0, P, (B, L), generator=gen) if positions else None
    if pos is None:
        cos, sin = cos[:L], sin[:L]
    y = kernels.rope_fwd(x, cos, sin, pos, interleaved, False)
    kw = dict(positions=None if pos is None else pos.numpy(), interleaved=interleaved)
    close("y", y, ref_rope.rope(np_of(x), cos.numpy(), sin.numpy(), **kw), _T[dtype])
    back = kernels.rope_fwd(y, cos, sin, pos, interleaved, True)  # the inverse rotation
    close("x", back, np_of(x), 2 * _T[dtype])


# ---------------------------------------------------------------------------------------------
# The emulator's controls (csrc/emulate/selftest.cpp): each kernel has one defect the emulator
# must report, and runs once the defect is removed (ok=True).

CONTROLS = {
    # which side of a race is reported depends on the emulator's thread order
    "raw_race": "race: st_shared writes .* read by thread 31 with no barrier",
    "war_race": "race: ldmatrix reads .* written by thread 63 with no barrier",
    "waw_race": "race: st_shared writes .* written by thread 0 with no barrier",
    "read_in_flight": "while a cp.async to it is in flight",
    "exit_in_flight": "returned with cp.async copies in flight",
    "read_unwritten": "which nobody wrote",
    "divergent_barrier": "deadlock",
    "ldmatrix_out_of_bounds": "outside the dynamic shared memory",
}


@pytest.mark.parametrize("name", list(CONTROLS))
def test_emulator_reports_each_defect(kernels, name):
    a = torch.arange(512, dtype=torch.int16).view(torch.float16)
    b = torch.zeros(128, dtype=torch.float16)
    kernels.selftest(name, True, a, b)
    with pytest.raises(RuntimeError, match=CONTROLS[name]):
        kernels.selftest(name, False, a, b)


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16], ids=str)
def test_emulated_mma_is_the_matrix_product(kernels, dtype):
    """ldmatrix + mma.sync m16n8k16 on row-major A (16 x 16) and B^T (8 x 16), emulated, equals
    A B in float64 (the products of 16-bit inputs are exact; the sum is rounded once)."""
    gen = torch.Generator().manual_seed(7)
    a = torch.randn(16, 16, generator=gen).to(dtype)
    bt = torch.randn(8, 16, generator=gen).to(dtype)
    out = kernels.selftest("mma_f16" if dtype == torch.float16 else "mma_bf16", True,
                           torch.cat([a.flatten(), torch.zeros(256, dtype=dtype)]), bt.flatten())
    want = a.double() @ bt.double().T
    torch.testing.assert_close(out[:128].view(16, 8).double(), want, rtol=1e-6, atol=1e-6)
