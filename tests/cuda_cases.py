"""The kernel tests' shared data and checks: the GPU tests of the CUDA kernels
(test_cuda_kernels.py), the emulated ones (test_cuda_emulated.py, the same device code run on the
host by fastattn.aot.emulate) and the Triton kernel tests (test_attention_kernel.py): tolerances,
the attention cases (one table of shapes, masks and bands, one input builder, one check against
the float64 reference), the FFN's activations, and the float64 comparison `close`."""

from __future__ import annotations

import numpy as np
import torch

import fastattn
from fastattn import reference as ref


def np_of(t):
    return None if t is None else t.detach().to("cpu", torch.float64).numpy()


def mask_np(m):
    if m is None:
        return None
    return m.cpu().numpy() if m.dtype == torch.bool else np_of(m)


def close(name, got, want, tol):
    """max |got - want| <= tol * max(1, max |want|) over finite reference entries."""
    g = np_of(got)
    assert g.shape == want.shape, f"{name}: shape {g.shape} != {want.shape}"
    assert np.isfinite(g).all(), f"{name}: non-finite values at {np.argwhere(~np.isfinite(g))[:5].tolist()}"
    scale = max(1.0, float(np.abs(want).max()) if want.size else 0.0)
    err = float(np.abs(g - want).max()) if want.size else 0.0
    assert err <= tol * scale, f"{name}: max abs error {err:.3g} > {tol * scale:.3g}"


# Softmax: per dtype, on max |got - want| / max(1, max |want|) (dx: 4x, dmask: 8x).
SM_TOL = {torch.float32: 1e-5, torch.float16: 2e-3, torch.bfloat16: 1.6e-2}

# The FFN's activations (w1 is (2F, D) for the gated ones).
ACTS = ("gelu", "gelu_tanh", "relu", "silu", "swiglu", "geglu")

ATT_TOL = {torch.float16: 5e-3, torch.bfloat16: 3e-2}

# id: (B, H, Hkv, Lq, Lk, D, Dv, causal, window, mask kind, dropout_p)
ATT_CASES = {
    "plain_d64": (1, 2, 2, 17, 33, 64, 64, False, None, None, 0.0),
    "single": (1, 1, 1, 1, 1, 32, 32, False, None, None, 0.0),
    "gqa_d40_causal": (2, 4, 2, 65, 47, 40, 40, True, None, None, 0.0),
    "d80_dv96_br": (1, 2, 1, 100, 129, 80, 96, "bottom_right", None, None, 0.0),
    "decode_d128": (2, 4, 1, 1, 300, 128, 128, "bottom_right", None, None, 0.0),
    "d100_window": (1, 2, 2, 130, 70, 100, 100, False, (9, 4), None, 0.0),
    "d256": (1, 2, 2, 45, 77, 256, 256, True, None, None, 0.0),
    "d256_dv200_bias": (1, 2, 1, 40, 37, 256, 200, False, None, "bias", 0.0),
    "keypad_mqa": (2, 4, 1, 33, 65, 64, 64, False, None, "keypad", 0.0),
    "full_bool": (2, 2, 1, 70, 70, 96, 96, False, None, "full_bool", 0.0),
    "bias_causal": (2, 2, 2, 66, 130, 64, 48, True, None, "bias", 0.0),
    "empty_rows_br": (1, 2, 1, 90, 40, 64, 64, "bottom_right", None, None, 0.0),
    "window_left_only": (1, 2, 2, 50, 150, 128, 128, "bottom_right", (20, None), None, 0.0),
    "dropout_gqa": (1, 4, 2, 70, 90, 64, 64, False, None, None, 0.25),
    "dropout_bias_window": (1, 2, 2, 65, 33, 128, 128, False, (6, 2), "bias", 0.5),
    "dropout_d256": (1, 2, 1, 33, 40, 256, 256, True, None, None, 0.1),
    # The FA2-class kernels' tile paths: several query blocks (BM = 128 / 64) and key tiles
    # (BN = 64 / 32), so the cp.async double buffer turns over more than once and interior tiles
    # take the unmasked fast path beside the masked edge tiles.
    "len1_d128": (1, 2, 2, 1, 1, 128, 128, False, None, None, 0.0),
    "len17_d64_causal": (1, 2, 2, 17, 17, 64, 64, True, None, None, 0.0),
    "long_causal_d128": (1, 2, 2, 300, 300, 128, 128, True, None, None, 0.0),
    "long_d64_gqa": (1, 4, 1, 257, 520, 64, 64, False, None, None, 0.0),
    "long_window_d64": (1, 2, 2, 400, 400, 64, 64, False, (100, 50), None, 0.0),
    "long_d256": (1, 2, 1, 130, 200, 256, 256, False, None, None, 0.0),
    "long_d80_bool": (1, 2, 2, 200, 170, 80, 80, True, None, "full_bool", 0.0),
    "long_dropout_d128": (1, 2, 2, 140, 260, 128, 128, False, None, None, 0.2),
    # dK/dV walks the GQA group's query blocks as one double-buffered sequence; with a band, a key
    # block's first query block is not 0 and the heads' blocks follow one another in it.
    "long_window_gqa_d128": (1, 4, 2, 333, 333, 128, 128, False, (70, 10), None, 0.0),
    # rows 0..259 attend no key: the first two forward CTAs have no key tile at all (their
    # epilogue's __syncwarp is then the only thing between the Q reads and the output staging)
    "empty_block_br": (1, 2, 1, 300, 40, 64, 64, "bottom_right", None, None, 0.0),
}




def att_mask(kind, B, H, Lq, Lk, gen):
    """The user mask of a case, on the CPU: None, "keypad" (B, 1, 1, Lk) bool, "full_bool"
    (B, H, Lq, Lk) with a fully masked row, or "bias" (1, H, Lq, Lk) float with -inf entries."""
    if kind is None:
        return None
    if kind == "keypad":  # (B, 1, 1, Lk): the last keys of the last batch masked
        m = torch.ones(B, 1, 1, Lk, dtype=torch.bool)
        m[-1, ..., Lk // 2:] = False
    elif kind == "full_bool":  # (B, H, Lq, Lk) with one fully masked row
        m = torch.rand(B, H, Lq, Lk, generator=gen) > 0.3
        m[0, 0, 2] = False
    elif kind == "bias":  # (1, H, Lq, Lk) float with a -inf row and scattered -inf
        m = torch.randn(1, H, Lq, Lk, generator=gen)
        m[0, -1, 1] = float("-inf")
        m[torch.rand(m.shape, generator=gen) < 0.1] = float("-inf")
    else:
        raise ValueError(kind)
    return m


def att_inputs(case, dtype, device, transposed=False):
    """q, k, v, dout and the mask of `case` in `dtype` on `device` (q strided (B, L, H, D) ->
    (B, H, L, D) when `transposed`)."""
    B, H, Hkv, Lq, Lk, D, Dv, causal, window, kind, p = ATT_CASES[case]
    gen = torch.Generator().manual_seed(0)

    def rnd(*s):
        return torch.randn(*s, generator=gen).to(dtype).to(device)

    q = rnd(B, Lq, H, D).transpose(1, 2) if transposed else rnd(B, H, Lq, D)
    k, v, dout = rnd(B, Hkv, Lk, D), rnd(B, Hkv, Lk, Dv), rnd(B, H, Lq, Dv)
    mask = att_mask(kind, B, H, Lq, Lk, gen)
    return q, k, v, dout, None if mask is None else mask.to(device)


def att_reference(case, q, k, v, dout, mask, seed):
    """((out, lse), (dq, dk, dv, dmask)) of the float64 reference for these inputs."""
    *_, D, _, causal, window, _, p = ATT_CASES[case]
    args = (np_of(q), np_of(k), np_of(v), mask_np(mask), D ** -0.5, causal, window, p, seed, True)
    return ref.attention(*args), ref.attention_backward(np_of(dout), *args)


def att_run(case, dtype, device, backend, seed=1234, transposed=False):
    """`case` through fastattn.attention on `backend` (autograd included): out, lse, the
    gradients of q, k, v (and of a float mask), the reference's, and the mask."""
    q, k, v, dout, mask = att_inputs(case, dtype, device, transposed)
    *_, D, _, causal, window, _, p = ATT_CASES[case]
    q, k, v = (t.requires_grad_() for t in (q, k, v))
    leaves = [q, k, v]
    if mask is not None and mask.is_floating_point():
        mask.requires_grad_()
        leaves.append(mask)
    out, lse = fastattn.attention(q, k, v, mask, causal=causal, window=window, scale=D ** -0.5,
                                  dropout_p=p, seed=seed, enable_gqa=True, return_lse=True,
                                  backend=backend)
    grads = torch.autograd.grad(out, leaves, dout)
    return out, lse, grads, att_reference(case, q, k, v, dout, mask, seed), mask


def check_att(case, dtype, out, lse, grads, want):
    """out, lse and the gradients (dq, dk, dv[, dmask summed to the mask's shape]) of `case`
    against the reference `want`: values, dtypes, and 0 (never NaN) for fully masked rows."""
    B, H, Hkv, Lq, Lk, D, Dv, *_ = ATT_CASES[case]
    (r_out, r_lse), (r_dq, r_dk, r_dv, r_dmask) = want
    tol = ATT_TOL[dtype]
    assert out.dtype == dtype and out.shape == (B, H, Lq, Dv)
    assert lse.dtype == torch.float32 and lse.shape == (B, H, Lq)
    close("out", out, r_out, tol)
    lse_np = np_of(lse)
    dead = np.isneginf(r_lse)
    assert (np.isneginf(lse_np) == dead).all(), "fully masked rows must have lse = -inf"
    close("lse", lse.cpu()[torch.from_numpy(~dead)], r_lse[~dead], max(tol, 1e-5))
    assert not np_of(out)[dead].any(), "fully masked rows must output 0"
    for name, got, want_g in zip(("dq", "dk", "dv"), grads[:3], (r_dq, r_dk, r_dv)):
        assert got.dtype == dtype, name
        close(name, got, want_g, 4 * tol)
    assert not np_of(grads[0])[dead].any(), "fully masked rows must have dq = 0"
    if r_dmask is not None:
        close("dmask", grads[3], r_dmask, 4 * tol)
    if case == "empty_rows_br":
        assert dead.any()
