"""The cuda backend's attention kernels RUN without a GPU: csrc/cuda/attention.cu's device code,
compiled for the host on the SIMT emulator (fastattn.aot.emulate, cuda_emulator.h), against the
float64 reference on the GPU tests' own cases (cuda_attention_cases.py).

What this proves before a GPU does: the fragment maps of ldmatrix and mma.sync as the kernels
use them, the swizzled tile addresses, the cp.async double buffers (a copy lands only at its
wait_group), the online softmax, masks, bands, GQA, dropout's RNG, the three backward kernels and
the NaN rule's careful paths, for both forward configs (16 and 32 query rows a warp). What it does
not: speed, occupancy, and races the in-order emulation hides (compute-sanitizer's racecheck on a
GPU). The emulator's own checks have their controls at the end.
"""

from __future__ import annotations

import numpy as np
import pytest
import torch

from fastattn import reference as ref
from fastattn.ops.attention import band

import fastattn
from cuda_attention_cases import (ATT_CASES, ATT_TOL, att_inputs, att_reference, check_att, close,
                                  np_of)
from test_nan import KERNEL_CASES, _check_kernel_case as check_kernel_case

emulate = pytest.importorskip("fastattn.aot.emulate")


@pytest.fixture(scope="module")
def kernels():
    try:
        return emulate.load()
    except emulate.EmulatorUnavailable as e:
        pytest.skip(str(e))


def _attention(kernels, case, q, k, v, dout, mask, seed=1234, need_dmask=None):
    """The cuda ops' forward and backward as the backend contract calls them: the mask as a
    (B, H, Lq, Lk) view; dmask summed back to the mask's shape."""
    B, H, _, Lq, Lk, D, _, causal, window, _, p = ATT_CASES[case]
    offset, left, right = band(Lq, Lk, causal, window)
    view = None if mask is None else mask.expand(B, H, Lq, Lk)
    scale = D ** -0.5
    out, lse = kernels.attention_fwd(q, k, v, view, scale, offset, left, right, p, seed)
    if need_dmask is None:
        need_dmask = mask is not None and mask.is_floating_point()
    dq, dk, dv, dmask = kernels.attention_bwd(dout, q, k, v, out, lse, view, scale, offset, left,
                                              right, p, seed, need_dmask)
    grads = [dq, dk, dv]
    if need_dmask:
        dims = [d for d in range(4) if mask.shape[d] == 1]
        grads.append(dmask.sum(dim=dims, keepdim=True) if dims else dmask)
    return out, lse, grads


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
def test_emulated_attention_matches_reference(kernels, case, dtype, rows, monkeypatch):
    if rows == 32:
        monkeypatch.setenv("FASTATTN_CUDA_FWD_ROWS", "32")
    q, k, v, dout, mask = att_inputs(case, dtype, "cpu", transposed=case == "plain_d64")
    out, lse, grads = _attention(kernels, case, q, k, v, dout, mask)
    check_att(case, dtype, out, lse, grads, att_reference(case, q, k, v, dout, mask, 1234))


@pytest.fixture(scope="module")
def backend(kernels):
    """The emulated kernels as the attention backend "cuda_emulated" (autograd included)."""
    return emulate.register()


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


def test_emulated_backward_is_deterministic(kernels):
    case = "dropout_gqa"
    q, k, v, dout, mask = att_inputs(case, torch.bfloat16, "cpu")
    first = _attention(kernels, case, q, k, v, dout, mask, seed=11)
    again = _attention(kernels, case, q, k, v, dout, mask, seed=11)
    other = _attention(kernels, case, q, k, v, dout, mask, seed=12)
    for a, b in zip([first[0], first[1], *first[2]], [again[0], again[1], *again[2]]):
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
# The emulator's controls (csrc/emulate/selftest.cpp): each kernel has one defect the emulator
# must report, and runs once the defect is removed (ok=True).

CONTROLS = {
    # which side of a race is reported depends on the emulator's thread order
    "raw_race": "race: st_shared writes .* read by thread 31 with no barrier",
    "war_race": "race: ldmatrix reads .* written by thread 63 with no barrier",
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
