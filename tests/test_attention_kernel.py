"""Triton attention kernels (kernels/attention.py) against the float64 NumPy reference.

Without a GPU the kernels run under the Triton interpreter on CPU tensors, so shapes are tiny
(the interpreter tiles are 16 x 16, so 17 and 33 exercise edge, interior and padding tiles).
The reference cases run twice: on the pointer path and on the tensor-descriptor (TMA) path,
which the interpreter executes with the same out-of-bounds zero fill as the hardware.
"""

import os

import numpy as np
import pytest
import torch

if not torch.cuda.is_available():
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402

from fastattn import reference as ref  # noqa: E402
from fastattn.kernels import attention as attn  # noqa: E402
from fastattn.kernels import attention_launch, descriptors  # noqa: E402
from fastattn.testing import launching_directly  # noqa: E402

from cuda_cases import close as _assert_close, mask_np as _mask_np, np_of as _np  # noqa: E402


def attention_forward(*args):
    """The launcher as its registered op runs it (fastattn.testing.launching_directly)."""
    with launching_directly():
        return attention_launch.attention_forward(*args)


def attention_backward(*args):
    """The backward launcher, likewise."""
    with launching_directly():
        return attention_launch.attention_backward(*args)


DEVICE = "cuda" if torch.cuda.is_available() else "cpu"

# Absolute tolerances relative to the largest reference magnitude (at least 1).
TOL = {torch.float32: 2e-5, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def _inputs(B, H, Hkv, Lq, Lk, D, Dv, dtype, seed=0, amp=1.0, transposed=False):
    g = torch.Generator().manual_seed(seed)

    def rnd(*shape):
        return (amp * torch.randn(*shape, generator=g)).to(dtype).to(DEVICE)

    if transposed:  # (B, L, H, D) memory layout, as from a fused projection
        q = rnd(B, Lq, H, D).transpose(1, 2)
    else:
        q = rnd(B, H, Lq, D)
    return q, rnd(B, Hkv, Lk, D), rnd(B, Hkv, Lk, Dv), rnd(B, H, Lq, Dv) / amp


def _make_mask(kind, B, H, Lq, Lk, seed=1):
    """(kernel mask: a (B, H, Lq, Lk) view, the tensor the reference sees, requires dmask)."""
    g = torch.Generator().manual_seed(seed)
    if kind is None:
        return None, None, False
    if kind == "keypad":  # (B, 1, 1, Lk) key padding, the last keys of batch 1 masked
        base = torch.ones(B, 1, 1, Lk, dtype=torch.bool)
        base[-1, ..., Lk // 2:] = False
    elif kind == "full_bool":  # (B, H, Lq, Lk) with one fully masked row
        base = torch.rand(B, H, Lq, Lk, generator=g) > 0.3
        base[0, 0, 2] = False
    elif kind == "bias":  # (1, H, Lq, Lk) float bias with a -inf row and scattered -inf
        base = torch.randn(1, H, Lq, Lk, generator=g)
        base[0, -1, 1] = float("-inf")
        base[torch.rand(base.shape, generator=g) < 0.1] = float("-inf")
    else:
        raise ValueError(kind)
    base = base.to(DEVICE)
    return base.expand(B, H, Lq, Lk), base, base.dtype != torch.bool


@pytest.fixture(params=["pointer", "tma"])
def path(request, monkeypatch):
    """Force the pointer path or the descriptor path, and check afterwards that the descriptor
    path was not switched off by a failure (its fallback would hide a bug)."""
    if request.param == "tma" and not descriptors.HAS_DESCRIPTORS:
        pytest.skip(f"Triton {triton.__version__} has no tl.make_tensor_descriptor")
    monkeypatch.setattr(descriptors, "TMA", "1" if request.param == "tma" else "0")
    monkeypatch.setattr(descriptors, "disabled", {})
    yield request.param
    assert descriptors.disabled == {}, f"the descriptor path failed: {descriptors.disabled}"


# id: (B, H, Hkv, Lq, Lk, D, Dv, causal, window, mask, dropout_p, dtype)
CASES = {
    "plain": (1, 2, 2, 17, 17, 16, 16, False, None, None, 0.0, torch.float32),
    "single": (1, 1, 1, 1, 1, 16, 16, False, None, None, 0.0, torch.float32),
    "decode_mqa": (2, 4, 1, 1, 33, 16, 16, "bottom_right", None, None, 0.0, torch.float32),
    "causal_tl_dv": (1, 2, 2, 17, 33, 40, 24, True, None, None, 0.0, torch.float32),
    "causal_br_empty_rows": (1, 2, 1, 33, 17, 16, 16, "bottom_right", None, None, 0.0,
                             torch.float32),
    "gqa_window": (1, 4, 2, 33, 33, 16, 16, False, (5, 3), None, 0.0, torch.float32),
    "window_br_left": (1, 2, 2, 17, 33, 16, 16, "bottom_right", (4, None), None, 0.0,
                       torch.float32),
    "keypad_mqa": (2, 4, 1, 17, 33, 16, 16, False, None, "keypad", 0.0, torch.float32),
    "bias_causal": (2, 2, 2, 17, 33, 40, 40, True, None, "bias", 0.0, torch.float32),
    "full_mask": (2, 2, 1, 17, 17, 16, 32, False, None, "full_bool", 0.0, torch.float32),
    "dropout_gqa": (1, 4, 2, 17, 33, 16, 16, False, None, None, 0.25, torch.float32),
    "dropout_bias_window": (1, 2, 2, 33, 17, 16, 16, False, (6, 2), "bias", 0.5, torch.float32),
    "bf16_causal": (1, 4, 2, 33, 33, 40, 40, True, None, "keypad", 0.0, torch.bfloat16),
    "fp16_dropout": (1, 2, 1, 17, 33, 16, 24, "bottom_right", None, None, 0.1, torch.float16),
}


def _run(B, H, Hkv, Lq, Lk, D, Dv, causal, window, mask_kind, p, dtype, seed=1234, amp=1.0,
         transposed=False):
    q, k, v, dout = _inputs(B, H, Hkv, Lq, Lk, D, Dv, dtype, amp=amp, transposed=transposed)
    assert descriptors.use_tma(q, k, v, dout) == (descriptors.TMA == "1"), "inputs meant for the TMA path"
    mask, mask_ref, need_dmask = _make_mask(mask_kind, B, H, Lq, Lk)
    scale = D ** -0.5
    band = ref.structural_band(Lq, Lk, causal, window)
    out, lse = attention_forward(q, k, v, mask, scale, *band, p, seed)
    grads = attention_backward(dout, q, k, v, out, lse, mask, scale, *band, p, seed, need_dmask)
    args = (_np(q), _np(k), _np(v), _mask_np(mask_ref), scale, causal, window, p, seed, True)
    want = ref.attention(*args), ref.attention_backward(_np(dout), *args)
    return (out, lse), grads, want, mask


@pytest.mark.parametrize("case", list(CASES))
def test_matches_reference(case, path):
    B, H, Hkv, Lq, Lk, D, Dv, causal, window, mask_kind, p, dtype = CASES[case]
    (out, lse), (dq, dk, dv, dmask), ((r_out, r_lse), (r_dq, r_dk, r_dv, r_dmask)), mask = _run(
        *CASES[case], transposed=case == "plain")
    tol = TOL[dtype]
    assert out.dtype == dtype and out.shape == (B, H, Lq, Dv) and out.is_contiguous()
    assert lse.dtype == torch.float32 and lse.shape == (B, H, Lq)
    _assert_close("out", out, r_out, tol)
    lse_np = _np(lse)
    dead = np.isneginf(r_lse)
    assert (np.isneginf(lse_np) == dead).all(), "fully masked rows must have lse = -inf"
    _assert_close("lse", lse[torch.from_numpy(~dead)], r_lse[~dead], max(tol, 1e-5))
    assert not _np(out)[dead].any(), "fully masked rows must output 0"
    for name, got, want in (("dq", dq, r_dq), ("dk", dk, r_dk), ("dv", dv, r_dv)):
        assert got.dtype == dtype, name
        _assert_close(name, got, want, 4 * tol)
    assert not _np(dq)[dead].any(), "fully masked rows must have dq = 0"
    if r_dmask is None:
        assert dmask is None
    else:
        assert dmask.dtype == torch.float32 and dmask.shape == (B, H, Lq, Lk)
        broadcast = [d for d in range(4) if mask.stride(d) == 0 and mask.shape[d] > 1]
        reduced = dmask.sum(dim=broadcast, keepdim=True) if broadcast else dmask
        _assert_close("dmask", reduced, r_dmask, 4 * tol)
    if case == "causal_br_empty_rows":
        assert dead.any()


def test_huge_logits(path):
    """Scores around 1e4: the online softmax must neither overflow nor lose the maximum."""
    (out, lse), grads, ((r_out, r_lse), r_grads), _ = _run(
        1, 2, 1, 17, 33, 16, 16, True, None, None, 0.0, torch.float32, amp=60.0)
    assert float(np.abs(r_lse[np.isfinite(r_lse)]).max()) > 1e3
    _assert_close("out", out, r_out, 1e-2)
    np.testing.assert_allclose(_np(lse), r_lse, rtol=1e-5)
    for name, got, want in zip(("dq", "dk", "dv"), grads[:3], r_grads[:3]):
        _assert_close(name, got, want, 1e-2)


@pytest.mark.parametrize("seed", [5, 3_000_000_000, 2**40 + 17])
def test_dropout_mask_is_the_shared_rng(seed):
    """With v = I the output is P * keep / (1 - p) exactly: its support is the keep-mask."""
    B, H, L, p = 2, 3, 17, 0.4
    g = torch.Generator().manual_seed(0)
    q = torch.randn(B, H, L, 16, generator=g).to(DEVICE)
    k = torch.randn(B, 1, L, 16, generator=g).to(DEVICE)
    v = torch.eye(L, device=DEVICE).expand(B, 1, L, L)
    band = ref.structural_band(L, L)
    out, lse = attention_forward(q, k, v, None, 0.25, *band, p, seed)
    keep = ref.dropout_keep_mask(seed, B, H, L, L, p)
    np.testing.assert_array_equal(_np(out) != 0, keep)
    probs = np.exp(0.25 * _np(q) @ np.swapaxes(_np(k), -1, -2) - _np(lse)[..., None])
    np.testing.assert_allclose(_np(out), probs * keep / (1 - p), atol=1e-6)
    _, lse0 = attention_forward(q, k, v, None, 0.25, *band, 0.0, None)
    torch.testing.assert_close(lse, lse0, rtol=0, atol=0)


def test_dropout_replay():
    args = _inputs(1, 2, 1, 17, 33, 16, 16, torch.float32)
    q, k, v, dout = args
    band = ref.structural_band(17, 33)

    def fwd_bwd(seed):
        out, lse = attention_forward(q, k, v, None, 0.25, *band, 0.3, seed)
        grads = attention_backward(dout, q, k, v, out, lse, None, 0.25, *band, 0.3, seed, False)
        return (out, *grads[:3])

    first, again, other = fwd_bwd(11), fwd_bwd(11), fwd_bwd(12)
    for a, b in zip(first, again):
        assert torch.equal(a, b)
    assert not torch.equal(first[0], other[0])


def _good():
    q = torch.randn(2, 4, 5, 16, device=DEVICE)
    k = torch.randn(2, 2, 7, 16, device=DEVICE)
    v = torch.randn(2, 2, 7, 8, device=DEVICE)
    return q, k, v


# Bad arguments are caught once, in fastattn.ops, before the triton backend runs; the messages
# name the public arguments (query, key, value, attn_mask).
BAD = {
    "rank": (lambda q, k, v: (q[0], k, v, None, 0.0), ValueError, "query must be 4-D"),
    "batch": (lambda q, k, v: (q, k[:1], v[:1], None, 0.0), ValueError, "batch"),
    "head_dim": (lambda q, k, v: (q, k[..., :8], v, None, 0.0), ValueError, "head dim"),
    "gqa": (lambda q, k, v: (q[:, :3], k, v, None, 0.0), ValueError, "multiple of key/value"),
    "big_head": (lambda q, k, v: (torch.zeros(1, 1, 2, 512), torch.zeros(1, 1, 2, 512),
                                  torch.zeros(1, 1, 2, 8), None, 0.0), ValueError, "256"),
    "dtype": (lambda q, k, v: (q.double(), k.double(), v.double(), None, 0.0), ValueError,
              "triton.* does not take torch.float64"),  # the registry's refusal (caps)
    "mixed": (lambda q, k, v: (q.half(), k, v, None, 0.0), TypeError, "share a dtype"),
    "mask_shape": (lambda q, k, v: (q, k, v, torch.ones(2, 4, 5, 6, dtype=torch.bool, device=q.device), 0.0),
                   ValueError, "not broadcastable"),
    "mask_dtype": (lambda q, k, v: (q, k, v, torch.ones(2, 4, 5, 7, dtype=torch.int32, device=q.device), 0.0),
                   TypeError, "attn_mask must be bool"),
    "dropout": (lambda q, k, v: (q, k, v, None, 1.0), ValueError, "dropout_p"),
}


@pytest.mark.parametrize("bad", list(BAD))
def test_bad_inputs(bad):
    import fastattn

    make, exc, msg = BAD[bad]
    q, k, v, mask, p = make(*_good())
    with pytest.raises(exc, match=msg):
        fastattn.attention(q, k, v, mask, dropout_p=p, enable_gqa=True, backend="triton")


def test_kernel_limits():
    """What only the kernels know, checked by their launchers: head dims up to 256, and offsets
    within one (batch, head) slice that fit in int32 (meta tensors: no memory)."""
    q, k, v = (torch.empty(1, 1, 2, 512) for _ in range(3))
    with pytest.raises(ValueError, match="head dims up to 256"):
        attention_forward(q, k, v, None, 1.0, 0, 100, 100, 0.0, 0)
    q = torch.empty(1, 1, 2, 16, device="meta")
    kv = torch.empty(1, 1, 2**27 + 1, 16, device="meta")  # (2**27) * 16 = 2**31
    with pytest.raises(ValueError, match="k .* int32"):
        attention_forward(q, kv, kv, None, 1.0, 0, 0, 0, 0.0, 0)


def test_tma_path_choice(monkeypatch):
    """The descriptor path needs 16-byte aligned bases and row strides; "0" turns it off,
    "auto" keeps it to Hopper-class GPUs, and tracing (fake tensors) never takes it."""
    monkeypatch.setattr(descriptors, "disabled", {})
    x = torch.zeros(2, 3, 5, 64, dtype=torch.float16, device=DEVICE)
    odd = torch.zeros(2, 3, 5, 100, dtype=torch.float16, device=DEVICE)  # rows of 200 bytes
    shifted = torch.zeros(2, 3, 5, 65, dtype=torch.float16, device=DEVICE)[..., 1:]
    monkeypatch.setattr(descriptors, "TMA", "1")
    assert descriptors.use_tma(x, x) == descriptors.HAS_DESCRIPTORS
    assert not descriptors.use_tma(x, odd) and not descriptors.use_tma(shifted)
    assert not descriptors.use_tma(x.transpose(2, 3))  # last dim not contiguous
    assert not descriptors.use_tma(x, x[:, :, :1].expand(x.shape))  # rows broadcast (stride 0)
    with torch._subclasses.FakeTensorMode() as mode:
        assert not descriptors.use_tma(mode.from_tensor(x))
    monkeypatch.setattr(descriptors, "TMA", "0")
    assert not descriptors.use_tma(x) and descriptors.tma_status()["default_path"] == "pointer"
    monkeypatch.setattr(descriptors, "TMA", "auto")
    hopper = DEVICE == "cuda" and torch.cuda.get_device_capability()[0] >= 9
    assert descriptors.use_tma(x) == (hopper and descriptors.HAS_DESCRIPTORS)
    monkeypatch.setattr(descriptors, "TMA", "yes")
    with pytest.raises(ValueError, match="FASTATTN_TRITON_TMA"):
        descriptors.use_tma(x)
    # float32 (FMA dots) keeps to the pointer path unless forced: as on a Hopper GPU here
    x32 = x.float()
    monkeypatch.setattr(descriptors, "TMA", "auto")
    monkeypatch.setattr(descriptors, "tma_for", lambda device_type: True)
    assert descriptors.use_tma(x) and not descriptors.use_tma(x32, x32)
    monkeypatch.setattr(descriptors, "TMA", "1")
    assert descriptors.use_tma(x32, x32)


def test_tma_failure_falls_back_once(monkeypatch):
    """A launch whose descriptor variant fails to build switches that feature off (warp
    specialization first when it was a candidate) and repeats on the path left."""
    monkeypatch.setattr(descriptors, "disabled", {})
    monkeypatch.setattr(descriptors, "warp_specialize_ok",
                        lambda: "warp_specialize" not in descriptors.disabled)
    launched = []

    def launch(use_tma):
        if use_tma:
            raise RuntimeError("PassManager::run failed")
        launched.append(use_tma)

    descriptors.launch(launch, True, ws_candidate=True)
    assert launched == [False] and list(descriptors.disabled) == ["warp_specialize", "tma"]
    assert "PassManager" in descriptors.disabled["tma"]
    descriptors.launch(launch, True)  # not tried again
    assert launched == [False, False]
    assert descriptors.tma_status()["disabled"] == descriptors.disabled
    assert descriptors.tma_status()["default_path"] == "pointer"


def test_a_config_out_of_resources_is_raised_and_switches_nothing_off(monkeypatch):
    """A config over the GPU's shared memory is the pruner's fault: raised as it is, with the
    descriptor path left on (it used to switch that off for the process, silently)."""
    from triton.runtime.errors import OutOfResources

    monkeypatch.setattr(descriptors, "disabled", {})
    tried = []

    def launch(use_tma):
        tried.append(use_tma)
        raise OutOfResources(246784, 232448, "shared memory")

    with pytest.raises(OutOfResources):
        descriptors.launch(launch, True, ws_candidate=True)
    assert tried == [True] and descriptors.disabled == {}


@pytest.fixture
def tuned(monkeypatch):
    """Autotuning on, as users run it (the GPU test suite turns it off: tests/conftest.py), for
    the tests of what the pruners keep."""
    from fastattn.kernels import tuning
    monkeypatch.setattr(tuning, "AUTOTUNE", True)


def test_the_shared_memory_model_counts_the_mask_tiles(tuned):
    """A mask tensor's BM x BN tiles are staged in shared memory too (all stages but one): on
    the descriptor path D64 128x128 w8s3 with a float32 bias asked for 246,784 B of the H100's
    232,448 (fastattn.aot), and the pruner kept it. The model now predicts 245,760 for it."""
    big = triton.Config({"BLOCK_M": 128, "BLOCK_N": 128}, num_warps=8, num_stages=3)
    small = triton.Config({"BLOCK_M": 64, "BLOCK_N": 32}, num_warps=4, num_stages=2)

    def kept(mask_dtype):
        args = dict(BLOCK_D=64, BLOCK_DV=64, USE_TMA=True, HAS_MASK=mask_dtype is not None,
                    MASK_BOOL=False, HAS_DROPOUT=True, HEAD_DIM=64, lq_bucket=4096,
                    Q=torch.empty(0, dtype=torch.bfloat16))
        if mask_dtype is not None:
            args["Mask"] = torch.empty(0, dtype=mask_dtype)
        return [c for c in attn._prune([big, small], {}, kernel="fwd", **args)  # (never empty)
                if (c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"]) == (128, 128)]

    assert attn._shared_bytes("fwd", 128, 128, 64, 64, 2, 3, mask_bytes=4) == 245760
    assert kept(None) and kept(torch.bfloat16) and not kept(torch.float32)


def test_warp_specialized_configs_only_where_allowed(monkeypatch, tuned):
    configs = [triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "WARP_SPECIALIZE": ws},
                             num_warps=4, num_stages=3) for ws in (False, True)]
    args = dict(BLOCK_D=64, BLOCK_DV=64, USE_TMA=True, HAS_MASK=False, HAS_DROPOUT=False,
                Q=torch.empty(0, dtype=torch.bfloat16), lq_bucket=4096)

    def kept(ok, **changes):
        monkeypatch.setattr(descriptors, "warp_specialize_ok", lambda: ok)
        return [c.kwargs["WARP_SPECIALIZE"] for c in attn._prune(configs, {}, kernel="fwd",
                                                                 **{**args, **changes})]

    assert kept(True) == [False, True]
    assert kept(False) == [False]
    assert kept(True, USE_TMA=False) == [False]
    assert kept(True, HAS_MASK=True) == [False]
    assert kept(True, HAS_DROPOUT=True) == [False]


def test_warp_specialized_only_configs_run_plain_where_not_allowed(monkeypatch, tuned):
    """A config list holding only warp-specialized variants (as test_warp_specialized_loop
    sets up) runs them as the plain loop once warp specialization is off, never nothing."""
    ws = triton.Config({"BLOCK_M": 64, "BLOCK_N": 64, "WARP_SPECIALIZE": True}, num_warps=4,
                       num_stages=3)
    monkeypatch.setattr(descriptors, "warp_specialize_ok", lambda: False)
    kept = attn._prune([ws], {}, kernel="fwd", BLOCK_D=64, BLOCK_DV=64, USE_TMA=True,
                       HAS_MASK=False, HAS_DROPOUT=False, Q=torch.empty(0, dtype=torch.bfloat16),
                       lq_bucket=4096)
    assert [(c.kwargs["BLOCK_M"], c.kwargs["WARP_SPECIALIZE"]) for c in kept] == [(64, False)]


@pytest.mark.parametrize("kernel, dtype, d, dropped, first", [
    # what fastattn.aot measured for sm_90 with Triton 3.6: these spill, the first kept does not
    ("fwd", torch.bfloat16, 128, (128, 64, 4), (128, 64, 8)),
    ("dkdv", torch.bfloat16, 128, (32, 128, 8), (64, 64, 8)),
    ("dkdv", torch.bfloat16, 64, (64, 128, 8), (32, 128, 8)),
    ("dq", torch.bfloat16, 128, (128, 64, 8), (128, 32, 8)),
    ("fwd", torch.bfloat16, 256, (64, 64, 8), (16, 64, 4)),  # pointer path, 256-wide pointers
    ("fwd", torch.bfloat16, 64, (128, 64, 4), (128, 64, 8)),  # pointer path, with the NaN branch
])
def test_pruner_drops_configs_that_spill(kernel, dtype, d, dropped, first, tuned):
    gpu = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "WARP_SPECIALIZE": False}, num_warps=w,
                         num_stages=3) for bm, bn, w in (dropped, first)]
    kept = attn._prune(gpu, {}, kernel=kernel, BLOCK_D=d, BLOCK_DV=d, USE_TMA=False,
                       HAS_MASK=False, HAS_DROPOUT=False, Q=torch.empty(0, dtype=dtype),
                       lq_bucket=4096)
    assert [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps) for c in kept] == [first]


def test_mask_rows_start_on_16_element_boundaries():
    """The kernels get a mask whose strides (but the last) are multiples of 16 elements from a
    16-byte aligned pointer, so that Triton may load its tiles in vectors: the caller's where it
    is so, else a copy with padded rows that keeps broadcast dimensions broadcast."""
    def aligned(t):
        return t.data_ptr() % 16 == 0 and all(s % 16 == 0 for s in t.stride()[:-1])

    g = torch.Generator().manual_seed(0)
    q = torch.empty(0)
    for shape, view in (((2, 1, 33, 40), (2, 3, 33, 40)),     # key length 40
                        ((2, 1, 1, 37), (2, 3, 17, 37)),      # a key padding mask
                        ((1, 3, 5, 7), (1, 3, 5, 7))):
        for dtype in (torch.bool, torch.float32):
            m = (torch.rand(shape, generator=g) > 0.5).to(dtype).expand(view)
            t, strides, has_mask, is_bool = attention_launch._mask_args(m, q)
            assert has_mask and is_bool == (dtype == torch.bool) and strides == t.stride()
            assert aligned(t) and not aligned(m)
            assert torch.equal(t.view(dtype) if dtype == torch.bool else t, m)
            assert [s == 0 for s in t.stride()] == [s == 0 for s in m.stride()]
    m = torch.ones(2, 3, 8, 64, dtype=torch.bool)
    assert attention_launch._mask_args(m, q)[0].data_ptr() == m.data_ptr()  # no copy
    shifted = m[..., 1:17]  # rows of 16 at an odd address
    t = attention_launch._mask_args(shifted, q)[0]
    assert aligned(t) and torch.equal(t.view(torch.bool), shifted)


def test_pruner_register_rules_for_sm90(monkeypatch, tuned):
    """The register rules fastattn.aot measured (bench/aot/README.md, issue 12): tiles under 64
    rows on the descriptor path count their K/V tiles, configs measured to spill are dropped,
    and maxnreg keeps the blocks per SM that shared memory allows."""
    def prune(kernel, shapes, d=128, **flags):
        gpu = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "WARP_SPECIALIZE": False},
                             num_warps=w, num_stages=s) for bm, bn, w, s in shapes]
        args = dict(BLOCK_D=d, BLOCK_DV=d, USE_TMA=False, HAS_MASK=False, MASK_BOOL=False,
                    HAS_DROPOUT=False, Q=torch.empty(0, dtype=torch.bfloat16), lq_bucket=4096)
        kept = attn._prune(gpu, {}, kernel=kernel, **{**args, **flags})
        return [(c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], c.num_warps) for c in kept]

    # dQ D256 on the descriptor path: 16x64 holds K and V in registers (208 values), 16x32 fits
    assert prune("dq", [(16, 64, 4, 3), (16, 32, 4, 2)], d=256, USE_TMA=True) == [(16, 32, 4)]
    # dQ 32x64 w4 spills on the descriptor path at every head dim, not on the pointer path
    assert prune("dq", [(32, 64, 4, 3), (64, 64, 8, 3)], d=64, USE_TMA=True) == [(64, 64, 8)]
    assert prune("dq", [(32, 64, 4, 3), (64, 64, 8, 3)], d=64) == [(32, 64, 4), (64, 64, 8)]
    # dK/dV 32x32 w8: ptxas's 128-register tier cannot hold it at BLOCK_D 128
    assert prune("dkdv", [(32, 32, 8, 2), (32, 64, 8, 3)]) == [(32, 64, 8)]
    assert prune("dkdv", [(32, 32, 8, 2), (32, 64, 8, 3)], d=64) == [(32, 32, 8), (32, 64, 8)]
    # dK/dV 64x64 w8 at BLOCK_D 128: over the model (160 values), but the 2-stage one compiles
    # clean on the descriptor path (kept); 3 stages, or the pointer path, spill (dropped)
    assert prune("dkdv", [(64, 64, 8, 2), (32, 64, 8, 3)], USE_TMA=True) == [(64, 64, 8), (32, 64, 8)]
    assert prune("dkdv", [(64, 64, 8, 3), (32, 64, 8, 3)], USE_TMA=True) == [(32, 64, 8)]
    assert prune("dkdv", [(64, 64, 8, 2), (32, 64, 8, 3)]) == [(32, 64, 8)]
    # maxnreg: fwd 16x128 w4s3 D128 bf16 fits one block per SM (255 registers keep it); many
    # blocks of a small dQ tile fit (none); a 168 cap only for tiles of <= 64 live values
    assert attn._maxnreg("fwd", 16, 128, 128, 128, 2, 3, 4, live=40) == 255
    assert attn._maxnreg("dq", 16, 32, 128, 128, 2, 2, 4, live=40) is None
    assert attn._maxnreg("fwd", 64, 128, 64, 64, 2, 3, 4, live=112) is None
    assert attn._maxnreg("fwd", 64, 128, 64, 64, 2, 3, 4, live=60) == 168
    # decoding at head dims > 128: 16-row forward tiles get 255 (fp16 16x32 w4s1 spilled at 168)
    assert attn._maxnreg("fwd", 16, 32, 256, 256, 2, 1, 4, live=52) == 255
    # head dims that are not multiples of 16 (loaded element by element): no register limit,
    # 8-warp 16-row forward tiles instead of 4-warp ones (the other way round elsewhere), no
    # 64-row dK/dV tiles at BLOCK_D 128
    decoding = [(16, 64, 4, 3), (16, 128, 4, 3), (16, 64, 8, 3)]
    assert prune("fwd", decoding, lq_bucket=1) == [(16, 64, 4), (16, 128, 4)]
    assert prune("fwd", decoding, lq_bucket=1, HEAD_DIM=100, HEAD_DIM_V=100) == [(16, 64, 8)]
    assert prune("fwd", decoding, lq_bucket=1, HEAD_DIM=128, HEAD_DIM_V=1) == [(16, 64, 8)]
    wide = decoding + [(16, 32, 4, 1)]
    assert prune("fwd", wide, d=256, lq_bucket=1, HEAD_DIM=200, HEAD_DIM_V=200) == [(16, 32, 4)]
    assert prune("dkdv", [(64, 32, 8, 3), (32, 64, 8, 3)], HEAD_DIM=100) == [(32, 64, 8)]
    gpu = [triton.Config({"BLOCK_M": 32, "BLOCK_N": 64, "WARP_SPECIALIZE": False}, num_warps=4,
                         num_stages=3)]
    args = dict(BLOCK_D=128, BLOCK_DV=128, USE_TMA=False, HAS_MASK=False, HAS_DROPOUT=False,
                Q=torch.empty(0, dtype=torch.bfloat16), lq_bucket=4096)
    monkeypatch.setattr(attn, "_INTERPRET", False)  # (register limits are for GPUs only)
    assert attn._prune(gpu, {}, kernel="fwd", HEAD_DIM=128, HEAD_DIM_V=128, **args)[0].maxnreg
    assert attn._prune(gpu, {}, kernel="fwd", HEAD_DIM=100, HEAD_DIM_V=100, **args)[0].maxnreg \
        is None
    # a mask tensor with both band sides bounded: the forward's 16x64 w4 at D128 spills
    masked = dict(HAS_MASK=True, MASK_BOOL=True, Mask=torch.empty(0, dtype=torch.uint8))
    assert prune("fwd", decoding[:2], lq_bucket=1, **masked) == [(16, 64, 4), (16, 128, 4)]
    assert prune("fwd", decoding[:2], lq_bucket=1, LO_BOUNDED=True, HI_BOUNDED=True,
                 **masked) == [(16, 128, 4)]


def test_float32_configs_for_sm90(monkeypatch):
    """float32 (IEEE dots: FMA loops) gets tiles of its own on a GPU, measured clean for sm_90 by
    fastattn.aot (bench/aot/README.md): attention's per-kernel lists, the FFN's two tiles, the
    packed and paged kernels' table, and the paged forward's register limit at small head dims."""
    from fastattn.kernels import ffn, varlen

    monkeypatch.setattr(attn, "_INTERPRET", False)
    big = [triton.Config({"BLOCK_M": 128, "BLOCK_N": 64, "WARP_SPECIALIZE": False}, num_warps=8,
                         num_stages=3)]
    args = dict(BLOCK_D=128, BLOCK_DV=128, USE_TMA=False, HAS_MASK=False, HAS_DROPOUT=False,
                lq_bucket=4096)
    def described(configs):
        return [(c.kwargs, c.num_warps, c.num_stages) for c in configs]

    for kernel in ("fwd", "dkdv", "dq"):
        kept = attn._prune(big, {}, kernel=kernel, Q=torch.empty(0, dtype=torch.float32), **args)
        assert kept and described(kept) == described(attn._FP32_CONFIGS[kernel][:len(kept)])
        kept16 = attn._prune(big, {}, kernel=kernel, Q=torch.empty(0, dtype=torch.bfloat16), **args)
        assert all(c.kwargs["BLOCK_M"] == 128 for c in kept16)  # 16-bit: the list it was given
    # a kernel without the forward's WARP_SPECIALIZE (the JVP) gets the float32 tiles without it:
    # compiled Triton refuses a keyword the kernel lacks (the H100 run of 2026-11-26)
    plain = [triton.Config({"BLOCK_M": 64, "BLOCK_N": 64}, num_warps=4, num_stages=2)]
    kept = attn._prune(plain, {}, kernel="fwd", Q=torch.empty(0, dtype=torch.float32), **args)
    assert kept and all(set(c.kwargs) == {"BLOCK_M", "BLOCK_N"} for c in kept)

    monkeypatch.setattr(ffn, "_INTERPRET", False)
    tiles = [(128, 256, 64, 8), (64, 64, 64, 4), (32, 64, 32, 2)]
    configs = [triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8},
                             num_warps=w, num_stages=3) for bm, bn, bk, w in tiles]
    for dtype, want in ((torch.float32, tiles[1:2]), (torch.bfloat16, tiles[:1])):
        kept = ffn._prune_configs(configs, {"A": torch.empty(0, dtype=dtype)},
                                  ACTIVATION=ffn._IDENTITY.value)
        assert [ffn._tile(c) for c in kept][:1] == want

    monkeypatch.setattr(varlen, "_INTERPRET", False)
    assert varlen._tiles(64, 64, torch.bfloat16, "paged")[-1] == {"maxnreg": 128}
    assert varlen._tiles(128, 128, torch.bfloat16, "paged")[-1] == {}
    for kernel in ("fwd", "paged", "dkdv", "dq"):  # packed and paged kernels: float32 tiles
        for d in (64, 256):
            assert varlen._tiles(d, d, torch.float32, kernel)[:4] == varlen._FP32_TILES[kernel][d > 128]


def test_autotune_keys_bucket_lengths():
    """Autotuning is keyed on lengths rounded up to powers of two, so a generation loop over
    lengths 1..4096 tunes each kernel 13 times rather than 4096."""
    from fastattn.kernels import ffn, tuning

    assert [tuning.bucket(n) for n in (0, 1, 2, 3, 17, 4096, 4097)] == [1, 1, 2, 4, 32, 4096, 8192]
    assert len({tuning.bucket(n) for n in range(1, 4097)}) == 13
    for kernel in (attn._attn_fwd_kernel, attn._attn_bwd_dkdv_kernel, attn._attn_bwd_dq_kernel):
        assert "Lq" not in kernel.keys and "lq_bucket" in kernel.keys
    assert "M" not in ffn._matmul_kernel.keys and "m_bucket" in ffn._matmul_kernel.keys


def test_untuned_kernels_are_not_timed(monkeypatch):
    """With autotuning off (FASTATTN_AUTOTUNE=0, the test suite) the one config left is launched,
    not timed first: Triton's autotuner times even a single config, ~125 ms of launches at every
    new shape (on a GPU, more than the test's own work). Every autotuned kernel takes the timer."""
    from fastattn.kernels import attention_jvp, ffn, tuning

    for kernel in (attn._attn_fwd_kernel, attn._attn_bwd_dkdv_kernel, attn._attn_bwd_dq_kernel,
                   attention_jvp._attn_jvp_kernel, ffn._matmul_kernel):
        assert kernel._do_bench is tuning.do_bench
    calls = []
    monkeypatch.setattr(tuning, "AUTOTUNE", False)
    assert tuning.do_bench(lambda: calls.append(1), quantiles=(0.5, 0.2, 0.8)) == [0.0] * 3
    assert calls == []


def test_warp_specialization_is_off_unless_asked_for(monkeypatch):
    """FASTATTN_TRITON_WS: 0 (the default since the first GPU run) keeps warp-specialized configs
    out of autotuning, 1 lets them in where the GPU and Triton allow; anything else is refused."""
    monkeypatch.setattr(descriptors, "disabled", {})
    monkeypatch.setattr(descriptors, "hopper_or_newer", lambda: True)
    assert descriptors.WARP_SPECIALIZE == os.environ.get("FASTATTN_TRITON_WS", "0")
    monkeypatch.setattr(descriptors, "WARP_SPECIALIZE", "0")
    assert not descriptors.warp_specialize_ok() and not descriptors.tma_status()["warp_specialize_on"]
    monkeypatch.setattr(descriptors, "WARP_SPECIALIZE", "1")
    with pytest.warns(RuntimeWarning, match="gives wrong results"):  # (the H100 run)
        assert descriptors.warp_specialize_ok() == descriptors.HAS_WARP_SPECIALIZE
    with pytest.warns(RuntimeWarning):
        assert descriptors.tma_status()["warp_specialize_on"]
    monkeypatch.setattr(descriptors, "WARP_SPECIALIZE", "yes")
    with pytest.raises(ValueError, match="FASTATTN_TRITON_WS"):
        descriptors.warp_specialize_ok()


@pytest.mark.filterwarnings("ignore:FASTATTN_TRITON_WS=1:RuntimeWarning")  # (known: docstring)
@pytest.mark.parametrize("d", [64, 128])
@pytest.mark.parametrize("tile", [(128, 64, 4, 3), (128, 128, 4, 2)], ids=lambda t: "x".join(map(str, t)))
def test_warp_specialized_loop(monkeypatch, request, d, tile):
    """The forward's warp-specialized loop (autotuned only with FASTATTN_TRITON_WS=1, on Hopper
    and newer) gives the reference result, in each warp-specialized config the kernel lists; under
    the interpreter the keyword is accepted and the loop runs as is (one case). On the H100
    (2026-11-26, Triton 3.6) every case here was wrong, out errors 0.42-0.63 against a bound of
    0.03, while every plain config was right. On the next H100 run (2026-11-27) the 128x128 D128
    case came right, alone of the four: the loop is wrong some runs and right others, as a race
    would be, so one pass proves nothing. An expected failure on a GPU, not strict; it goes when
    every case passes on several runs (and FASTATTN_TRITON_WS's warning with it)."""
    if not (descriptors.HAS_DESCRIPTORS and descriptors.HAS_WARP_SPECIALIZE):
        pytest.skip(f"Triton {triton.__version__} lacks descriptors or warp specialization")
    if DEVICE == "cuda" and not descriptors.hopper_or_newer():
        pytest.skip("warp specialization is only tried on Hopper and newer")
    if DEVICE == "cuda":
        request.applymarker(pytest.mark.xfail(
            strict=False, raises=AssertionError,
            reason="the warp-specialized loop computes wrong outputs on Hopper, on some runs "
                   "(H100, 2026-11-26: all four cases; 2026-11-27: three)"))
    if DEVICE == "cpu" and (d, tile) != (64, (128, 64, 4, 3)):
        pytest.skip("the interpreter runs the plain loop: one case shows the keyword is taken")
    monkeypatch.setattr(descriptors, "TMA", "1")
    monkeypatch.setattr(descriptors, "WARP_SPECIALIZE", "1")
    monkeypatch.setattr(descriptors, "disabled", {})
    bm, bn, warps, stages = (16, 16, 4, 1) if DEVICE == "cpu" else tile
    config = triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "WARP_SPECIALIZE": True},
                           num_warps=warps, num_stages=stages)
    monkeypatch.setattr(attn._attn_fwd_kernel, "configs", [config])
    attn._attn_fwd_kernel.cache.clear()
    L = 40 if DEVICE == "cpu" else 300  # interior tiles and a partial last one
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    q, k, v, _ = _inputs(1, 2, 2, L, L, d, d, dtype)
    out, lse = attention_forward(q, k, v, None, d ** -0.5, *ref.structural_band(L, L), 0.0, None)
    if DEVICE == "cuda":
        assert attn._attn_fwd_kernel.best_config.kwargs["WARP_SPECIALIZE"], "not the WS config"
    want, want_lse = ref.attention(_np(q), _np(k), _np(v), scale=d ** -0.5)
    _assert_close("out", out, want, TOL[dtype])
    _assert_close("lse", lse, want_lse, max(TOL[dtype], 1e-5))
    assert descriptors.disabled == {}, f"the warp-specialized path failed: {descriptors.disabled}"


_AUTOTUNED = {"fwd": attn._attn_fwd_kernel, "dkdv": attn._attn_bwd_dkdv_kernel,
              "dq": attn._attn_bwd_dq_kernel}


@pytest.mark.skipif(DEVICE != "cuda", reason="GPU configs: the interpreter runs 16x16 tiles only")
@pytest.mark.parametrize("kernel", list(_AUTOTUNED))
@pytest.mark.parametrize("d, causal, mask_kind, p", [
    (64, False, None, 0.0), (64, True, None, 0.0), (128, False, None, 0.0), (128, True, None, 0.0),
    (128, False, "bias", 0.25),  # the mask and dropout prune rules (descriptor path first)
], ids=lambda x: str(x))
def test_every_autotuned_config_matches_the_reference(monkeypatch, kernel, d, causal, mask_kind,
                                                       p):
    """The GPU suite runs each kernel's first kept config (FASTATTN_AUTOTUNE=0), the autotuner
    any of them: every config the pruner keeps for ``kernel`` in turn, as the autotuner would run
    it (maxnreg included), forward and backward against the reference (bf16, default path)."""
    from fastattn.kernels import tuning
    monkeypatch.setattr(tuning, "AUTOTUNE", True)
    fn = _AUTOTUNED[kernel]
    L, scale, seed, tol = 300, d ** -0.5, 1234, TOL[torch.bfloat16]
    q, k, v, dout = _inputs(1, 4, 2, L, L, d, d, torch.bfloat16)
    mask, mask_ref, need_dmask = _make_mask(mask_kind, 1, 4, L, L)
    band = ref.structural_band(L, L, causal)
    args = (_np(q), _np(k), _np(v), _mask_np(mask_ref), scale, causal, None, p, seed, True)
    (r_out, r_lse), (r_dq, r_dk, r_dv, _) = ref.attention(*args), ref.attention_backward(_np(dout), *args)

    def run():
        out, lse = attention_forward(q, k, v, mask, scale, *band, p, seed)
        return (out, lse, *attention_backward(dout, q, k, v, out, lse, mask, scale, *band, p,
                                              seed, need_dmask)[:3])

    prune, kept = fn.prune_configs, []

    def record(kwargs):  # the kept list, and only its first config to run
        kept[:] = prune(kwargs)
        return kept[:1]

    failures = []
    monkeypatch.setattr(descriptors, "disabled", {})  # (a fallback below is a failure, by name)
    try:
        monkeypatch.setattr(fn, "prune_configs", record)
        fn.cache.clear()
        run()
        assert kept, "the pruner kept nothing"
        for config in list(kept):
            monkeypatch.setattr(fn, "prune_configs", lambda kwargs, config=config: [config])
            fn.cache.clear()
            try:  # (a config the GPU cannot launch, e.g. over its shared memory, fails by name)
                out, lse, dq, dk, dv = run()
            except triton.runtime.errors.OutOfResources as e:
                failures.append(f"{config}: {e}")
                continue
            if descriptors.disabled:  # the descriptor path failed and the pointer path ran
                failures.append(f"{config}: descriptor path switched off: {descriptors.disabled}")
                descriptors.disabled.clear()
            assert fn.best_config is config
            dead = np.isneginf(r_lse)  # fully masked rows (the bias mask has one)
            try:
                assert (np.isneginf(_np(lse)) == dead).all(), "lse: -inf exactly where masked"
                _assert_close("lse", lse[torch.from_numpy(~dead)], r_lse[~dead], tol)
                for name, x, want in (("out", out, r_out), ("dq", dq, r_dq), ("dk", dk, r_dk),
                                      ("dv", dv, r_dv)):
                    _assert_close(name, x, want, tol if name == "out" else 4 * tol)
            except AssertionError as e:
                failures.append(f"{config}: {e}")
    finally:
        fn.cache.clear()  # no forced choice outlives the test
    assert not failures, "\n".join(failures)


def test_autotune_off_keeps_the_first_pruned_config(monkeypatch, tuned):
    """FASTATTN_AUTOTUNE=0 (the GPU test suite's setting): one config, the first one kept."""
    from fastattn.kernels import tuning

    configs = [triton.Config({"BLOCK_M": bm, "BLOCK_N": 64}, num_warps=4, num_stages=3)
               for bm in (128, 64, 32)]
    args = dict(BLOCK_D=64, BLOCK_DV=64, USE_TMA=False, HAS_MASK=False, HAS_DROPOUT=False,
                Q=torch.empty(0, dtype=torch.bfloat16), lq_bucket=tuning.bucket(40), kernel="fwd")
    assert len(attn._prune(configs, {}, **args)) == 2  # 128-row tiles dropped
    monkeypatch.setattr(tuning, "AUTOTUNE", False)
    assert [c.kwargs["BLOCK_M"] for c in attn._prune(configs, {}, **args)] == [64]


def test_chosen_configs_name_what_autotuning_ran():
    """``kernels.tuning.chosen_configs`` (what ``fastattn bench`` records per Triton row on a
    GPU): the config of each autotuned kernel launched since the reset, in short form."""
    import fastattn
    from fastattn.kernels import tuning

    assert tuning.chosen_configs(reset=True) == {}
    dtype = torch.float32 if DEVICE == "cpu" else torch.bfloat16
    q, k, v, dout = _inputs(1, 2, 2, 33, 33, 16, 16, dtype)
    q.requires_grad_(True)
    fastattn.attention(q, k, v, backend="triton").backward(dout)
    chosen = tuning.chosen_configs()
    assert {"attn_fwd_kernel", "attn_bwd_dkdv_kernel", "attn_bwd_dq_kernel"} <= set(chosen)
    assert chosen["attn_fwd_kernel"] == tuning.config_text(attn._attn_fwd_kernel.best_config)
    assert tuning.chosen_configs(reset=True) == {} and tuning.chosen_configs() == {}
