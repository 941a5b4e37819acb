"""fastattn.attention / scaled_dot_product_attention on every backend, against the float64 reference.

Shapes stay tiny: on a CPU-only machine the triton backend runs under the Triton interpreter.
"""

import math
import zlib

import pytest
import torch
import torch.nn.functional as F

import fastattn
from fastattn import reference
from fastattn.testing import assert_close_to_reference, mask_to_numpy, to_numpy

from conftest import backend_params, cpu_built, dtype_for, registered_ops, skip_refused, torch_threads

BACKENDS = backend_params("attention")


def _mask(kind, B, H, Lq, Lk, device, dtype, g):
    if kind is None:
        return None
    if kind == "padding":  # key padding (B, 1, 1, Lk), each batch keeps a prefix
        keep = torch.arange(Lk)[None, :] < torch.tensor([Lk, max(1, Lk // 2)][:B])[:, None]
        return keep.view(B, 1, 1, Lk).to(device)
    if kind == "bool":  # full (B, H, Lq, Lk)
        return (torch.rand(B, H, Lq, Lk, generator=g) > 0.3).to(device)
    if kind == "bias":  # per-head float bias (1, H, Lq, Lk), gradient wanted
        return (torch.randn(1, H, Lq, Lk, generator=g, dtype=torch.float64) * 0.5).to(device, dtype).requires_grad_()
    if kind == "2d-inf":  # float (Lq, Lk) with some -inf
        m = torch.randn(Lq, Lk, generator=g, dtype=torch.float64)
        m[torch.rand(Lq, Lk, generator=g) < 0.2] = float("-inf")
        return m.to(device, dtype)
    raise ValueError(kind)


def _qkv(B, H, Hkv, Lq, Lk, D, Dv, device, dtype, g, scale=1.0):
    mk = lambda *s: (torch.randn(*s, generator=g, dtype=torch.float64) * scale).to(device, dtype).requires_grad_()  # noqa: E731
    return mk(B, H, Lq, D), mk(B, Hkv, Lk, D), mk(B, Hkv, Lk, Dv)


# (B, H, Hkv, Lq, Lk, D, Dv, mask, causal, window)
CASES = [
    (1, 2, 2, 1, 17, 16, 16, None, False, None),            # decode row
    (2, 2, 2, 17, 17, 40, 40, "padding", False, None),
    (1, 4, 2, 17, 33, 16, 24, "bias", False, None),          # GQA, Dv != D, bias gradient
    (2, 2, 1, 33, 17, 16, 16, "bool", True, None),           # MQA, causal top-left, Lq > Lk
    (1, 2, 2, 17, 33, 16, 16, None, "bottom_right", None),
    (1, 2, 2, 33, 33, 16, 16, "2d-inf", False, (4, 3)),      # sliding window
    (1, 1, 1, 130, 130, 80, 80, None, True, (16, 0)),
    (1, 1, 1, 17, 17, 100, 100, "padding", False, None),
]


def _ids(case):
    B, H, Hkv, Lq, Lk, D, Dv, mask, causal, window = case
    return f"{B}x{H}/{Hkv}x{Lq}x{Lk}xd{D}/{Dv}-{mask}-{causal}-{window}"


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_attention_matches_reference(backend, device, dtype, case):
    B, H, Hkv, Lq, Lk, D, Dv, kind, causal, window = case
    skip_refused("attention", backend, device, dtype, head_dim=max(D, Dv))
    g = torch.Generator().manual_seed(zlib.crc32(repr(case).encode()))
    q, k, v = _qkv(B, H, Hkv, Lq, Lk, D, Dv, device, dtype, g)
    mask = _mask(kind, B, H, Lq, Lk, device, dtype, g)
    out, lse = fastattn.attention(q, k, v, mask, causal=causal, window=window, enable_gqa=True,
                                  return_lse=True, backend=backend)
    assert out.shape == (B, H, Lq, Dv) and out.dtype == dtype and lse.dtype == torch.float32
    args = dict(mask=mask_to_numpy(mask),
                causal=causal, window=window, enable_gqa=True)
    ref_out, ref_lse = reference.attention(to_numpy(q), to_numpy(k), to_numpy(v), **args)
    assert_close_to_reference(out, ref_out, name="out")
    assert_close_to_reference(lse, ref_lse, atol=1e-4 if dtype == torch.float32 else 5e-2, name="lse")

    dout = torch.randn(out.shape, generator=g, dtype=torch.float64).to(device, dtype)
    inputs = [q, k, v] + ([mask] if kind == "bias" else [])
    grads = torch.autograd.grad(out, inputs, dout)
    rq, rk, rv, rmask = reference.attention_backward(to_numpy(dout), to_numpy(q), to_numpy(k), to_numpy(v), **args)
    for name, got, want in zip(("dq", "dk", "dv", "dmask"), grads, (rq, rk, rv, rmask)):
        assert_close_to_reference(got, want, name=name)


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_fully_masked_rows_give_zero_not_nan(backend, device):
    g = torch.Generator().manual_seed(1)
    dtype = dtype_for("attention", backend, device)
    q, k, v = _qkv(1, 2, 2, 5, 7, 16, 16, device, dtype, g)
    mask = torch.ones(1, 2, 5, 7, dtype=torch.bool, device=device)
    mask[0, 0, 1] = False  # row 1 of head 0 sees nothing
    bias = torch.zeros(1, 2, 5, 7, device=device, dtype=dtype)
    bias[0, 1, 3] = float("-inf")  # row 3 of head 1 sees nothing
    for m in (mask, bias):
        out, lse = fastattn.attention(q, k, v, m, return_lse=True, backend=backend)
        dq, dk, dv = torch.autograd.grad(out, (q, k, v), torch.ones_like(out))
        for t in (out, dq, dk, dv):
            assert not torch.isnan(t).any()
        dead = (0, 0, 1) if m is mask else (0, 1, 3)
        assert torch.all(out[dead] == 0) and torch.all(dq[dead] == 0)
        assert lse[dead] == float("-inf")
    # Causal bottom-right with Lq > Lk: the first Lq - Lk rows see nothing.
    q2, k2, v2 = _qkv(1, 1, 1, 9, 4, 16, 16, device, dtype, g)
    out = fastattn.attention(q2, k2, v2, causal="bottom_right", backend=backend)
    assert torch.all(out[0, 0, :5] == 0) and not torch.isnan(out).any()


CPU = cpu_built("attention")


@pytest.mark.skipif(not CPU, reason="the cpu backend is not built")
@pytest.mark.parametrize("hkv", [1, 2], ids=["two-pass", "one-pass"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("kind", ["bias", "bool", "2d-inf", "padding"])
def test_cpu_backward_both_passes_with_masks(kind, dtype, hkv):
    """The cpu backward takes two passes (dK/dV, then dQ) when few (batch, kv head) pairs would
    leave threads idle (B * Hkv = 1 on 2 threads), else one: both, with every mask kind, at
    lengths that leave partial tiles and partial 8 x 8 blocks (the dK/dV pass reads the mask
    transposed, in register-transposed blocks)."""
    with torch_threads(2):
        g = torch.Generator().manual_seed(zlib.crc32(f"{kind}{dtype}{hkv}".encode()))
        B, H, Lq, Lk, D = 1, 2, 37, 45, 16
        q, k, v = _qkv(B, H, hkv, Lq, Lk, D, D, "cpu", dtype, g)
        mask = _mask(kind, B, H, Lq, Lk, "cpu", dtype, g)
        out = fastattn.attention(q, k, v, mask, enable_gqa=True, backend="cpu")
        dout = torch.randn(out.shape, generator=g, dtype=torch.float64).to(dtype)
        inputs = [q, k, v] + ([mask] if kind == "bias" else [])
        grads = torch.autograd.grad(out, inputs, dout)
    np_mask = mask_to_numpy(mask)
    refs = reference.attention_backward(to_numpy(dout), to_numpy(q), to_numpy(k), to_numpy(v),
                                        mask=np_mask, enable_gqa=True)
    for name, got, want in zip(("dq", "dk", "dv", "dmask"), grads, refs):
        assert_close_to_reference(got, want, name=name)


@pytest.mark.skipif(not CPU, reason="the cpu backend is not built")
@pytest.mark.parametrize("torch_kernel", ["0", "1"], ids=["own-kernel", "torch-kernel"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(2, 3, 40, 33, 16), (1, 2, 130, 130, 64), (1, 2, 17, 300, 40)],
                         ids=lambda s: "x".join(map(str, s)))
def test_cpu_plain_forward_on_either_kernel(monkeypatch, torch_kernel, dtype, shape):
    """The cpu backend's non-causal forward without mask or dropout runs torch's own CPU flash
    kernel on Intel CPUs and its own elsewhere (FASTATTN_CPU_TORCH_ATTENTION=1 / 0
    forces one): either way the output, the lse its backward uses and the gradients match the reference."""
    monkeypatch.setenv("FASTATTN_CPU_TORCH_ATTENTION", torch_kernel)
    B, H, Lq, Lk, D = shape
    g = torch.Generator().manual_seed(zlib.crc32(f"{shape}{dtype}{torch_kernel}".encode()))
    q, k, v = _qkv(B, H, H, Lq, Lk, D, D, "cpu", dtype, g)
    out, lse = fastattn.attention(q, k, v, return_lse=True, backend="cpu")
    ref, ref_lse = reference.attention(to_numpy(q), to_numpy(k), to_numpy(v))
    assert_close_to_reference(out, ref, name="out")
    assert lse.dtype == torch.float32 and lse.shape == (B, H, Lq) and lse.is_contiguous()
    assert_close_to_reference(lse, ref_lse, name="lse")
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64).to(dtype)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    refs = reference.attention_backward(to_numpy(dout), to_numpy(q), to_numpy(k), to_numpy(v))
    for name, got, want in zip(("dq", "dk", "dv"), grads, refs):
        assert_close_to_reference(got, want, name=name)


def _cpu_forward_and_reference(threads, B, H, Hkv, Lq, Lk, D, opts):
    """The cpu forward (float32) on `threads` threads with `opts` (mask: a _mask kind), and the
    reference's: (out, lse, ref_out, ref_lse)."""
    with torch_threads(threads):
        g = torch.Generator().manual_seed(zlib.crc32(f"{threads}{H}{Lq}{opts}".encode()))
        q, k, v = _qkv(B, H, Hkv, Lq, Lk, D, D, "cpu", torch.float32, g)
        kw = dict(opts)
        mask = _mask(kw.pop("mask", None), B, H, Lq, Lk, "cpu", torch.float32, g)
        out, lse = fastattn.attention(q, k, v, mask, return_lse=True, enable_gqa=True, backend="cpu", **kw)
    ref, ref_lse = reference.attention(to_numpy(q), to_numpy(k), to_numpy(v), mask_to_numpy(mask),
                                       enable_gqa=True, **kw)
    return out, lse, ref, ref_lse


@pytest.mark.skipif(not CPU, reason="the cpu backend is not built")
@pytest.mark.parametrize("threads", [1, 2])
@pytest.mark.parametrize("H,Lq,Lk", [(8, 60, 70), (4, 100, 100), (4, 120, 300)], ids=["gqa", "two-blocks", "two-tiles"])
@pytest.mark.parametrize("opts", [dict(causal=True), dict(causal="bottom_right", window=(20, 0)),
                                  dict(mask="bias"), dict(dropout_p=0.25, seed=7)], ids=["causal", "window", "bias", "dropout"])
def test_cpu_forward_claims_a_kv_head_at_a_time(threads, H, Lq, Lk, opts):
    """Where every key tile serves at most two tasks and the kv heads outnumber the threads, a
    cpu forward worker claims all tasks of one kv head at once and packs its key tiles once
    (whole_kv_head in csrc/cpu/attention.cpp): the GQA group's heads, or a head's two query blocks,
    against the reference with every option, on 1 and 2 threads, one and two key tiles."""
    out, _, ref, _ = _cpu_forward_and_reference(threads, 2, H, 4, Lq, Lk, 16, opts)
    assert_close_to_reference(out, ref, name="out")


@pytest.mark.skipif(not CPU, reason="the cpu backend is not built")
@pytest.mark.parametrize("threads,H,Lq", [(1, 4, 300), (1, 2, 600), (2, 2, 300)],
                         ids=["256-rows", "128-rows", "64-rows"])
@pytest.mark.parametrize("opts", [dict(), dict(mask="bias"), dict(mask="padding"),
                                  dict(dropout_p=0.25, seed=3)], ids=["plain", "bias", "padding", "dropout"])
def test_cpu_forward_tall_query_blocks(monkeypatch, threads, H, Lq, opts):
    """Where no band limits the keys, the cpu forward takes query blocks of up to 256 rows, halved
    while the tasks would not keep the threads busy (fwd_block_q in csrc/cpu/attention.cpp):
    blocks of 256, 128 and 64 rows with a short last block, against two key tiles (256 + 14 keys),
    with every option, on its own kernel; output and lse against the reference."""
    monkeypatch.setenv("FASTATTN_CPU_TORCH_ATTENTION", "0")
    out, lse, ref, ref_lse = _cpu_forward_and_reference(threads, 1, H, H, Lq, 270, 40, opts)
    assert_close_to_reference(out, ref, name="out")
    assert_close_to_reference(lse, ref_lse, name="lse")


@pytest.mark.skipif(not CPU, reason="the cpu backend is not built")
@pytest.mark.parametrize("hkv", [1, 2], ids=["two-pass", "one-pass"])
@pytest.mark.parametrize("mask_kind", ["bf16-bias", "fp16-bias-transposed", "bool"])
def test_cpu_backward_stages_long_mask_rows(mask_kind, hkv):
    """The cpu backward copies a query block's 16-bit and bool mask rows, 512 keys at a time,
    before its 64-key tiles read them (cpu::stage_rows): keys over several such chunks, a window
    that starts the later query blocks' walks past key 0, a partial last chunk, and a mask whose
    keys are not contiguous (read in place)."""
    with torch_threads(2):
        g = torch.Generator().manual_seed(zlib.crc32(f"{mask_kind}{hkv}".encode()))
        dtype = torch.float16 if mask_kind.startswith("fp16") else torch.bfloat16
        B, H, Lq, Lk, D = 1, 2, 150, 1100, 16
        q, k, v = _qkv(B, H, hkv, Lq, Lk, D, D, "cpu", dtype, g)
        if mask_kind == "bool":
            mask = torch.rand(Lq, Lk, generator=g) > 0.2
        elif mask_kind.endswith("transposed"):
            mask = (torch.randn(Lk, Lq, generator=g, dtype=torch.float64) * 0.5).to(dtype).t()
        else:
            mask = (torch.randn(1, 1, Lq, Lk, generator=g, dtype=torch.float64) * 0.5).to(dtype)
        window = (700, 300)  # (left, right) of the diagonal, bottom-right aligned
        kw = dict(causal=False, window=window, enable_gqa=True)
        out = fastattn.attention(q, k, v, mask, backend="cpu", **kw)
        dout = torch.randn(out.shape, generator=g, dtype=torch.float64).to(dtype)
        grads = torch.autograd.grad(out, (q, k, v), dout)
    np_mask = mask_to_numpy(mask)
    refs = reference.attention_backward(to_numpy(dout), to_numpy(q), to_numpy(k), to_numpy(v),
                                        mask=np_mask, **kw)
    for name, got, want in zip(("dq", "dk", "dv"), grads, refs):
        assert_close_to_reference(got, want, name=name)


@pytest.mark.parametrize("as_float", [False, True])
@pytest.mark.parametrize("threads", [1, 16], ids=["one-pass", "two-pass"])
def test_key_padding_mask_over_whole_key_tiles(as_float, threads):
    """A key-padding mask that removes whole key tiles (the cpu forward's 256 keys, the backward's
    64; both skip them): output and gradients (dmask too, for a float mask) as the reference's,
    in the backward's one pass and its two (16 threads for 6 (batch, head) pairs), nothing read
    from the skipped keys (a NaN there stays out), and a sequence with no key at all gives 0."""
    if "cpu" not in fastattn.available_backends():
        pytest.skip("the cpu backend is not built")
    g = torch.Generator().manual_seed(7)
    B, H, Lq, Lk, D = 3, 2, 20, 600, 16
    q, k, v = _qkv(B, H, H, Lq, Lk, D, D, "cpu", torch.float32, g)
    keep = (torch.arange(Lk)[None, :] < torch.tensor([Lk, 100, 0])[:, None]).view(B, 1, 1, Lk)
    mask = torch.zeros(keep.shape).masked_fill(~keep, float("-inf")).requires_grad_() if as_float else keep
    dout = torch.randn(B, H, Lq, D, generator=g)
    with torch_threads(threads):
        out, lse = fastattn.attention(q, k, v, mask, return_lse=True, backend="cpu")
        inputs = [q, k, v] + ([mask] if as_float else [])
        grads = torch.autograd.grad(out, inputs, dout)
        v_nan = v.detach().clone().requires_grad_()
        with torch.no_grad():
            v_nan[1, :, 300:] = float("nan")  # keys of batch 1's skipped tiles (and of a partial tile)
        out_nan = fastattn.attention(q, k, v_nan, mask, backend="cpu")
        grads_nan = torch.autograd.grad(out_nan, inputs[:2] + [v_nan], dout)
    np_mask = mask_to_numpy(mask)
    ref_out, ref_lse = reference.attention(to_numpy(q), to_numpy(k), to_numpy(v), mask=np_mask)
    assert_close_to_reference(out, ref_out, name="out")
    assert torch.all(out[2] == 0) and torch.all(lse[2] == float("-inf"))
    refs = reference.attention_backward(to_numpy(dout), to_numpy(q), to_numpy(k), to_numpy(v), mask=np_mask)
    for name, got, want in zip(("dq", "dk", "dv", "dmask"), grads, refs):
        assert_close_to_reference(got, want, name=name)
    assert torch.equal(out_nan, out.detach())
    for name, got, want in zip(("dq", "dk", "dv"), grads_nan, grads):
        assert torch.equal(got, want), name


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_huge_logits(backend, device):
    g = torch.Generator().manual_seed(2)
    q, k, v = _qkv(1, 2, 2, 17, 17, 16, 16, device, dtype_for("attention", backend, device), g,
                   scale=100.0)  # scores ~1e4
    out = fastattn.attention(q, k, v, causal=True, backend=backend)
    ref, _ = reference.attention(to_numpy(q), to_numpy(k), to_numpy(v), causal=True)
    assert_close_to_reference(out, ref, atol=1e-3 if q.dtype == torch.float32 else None, name="out")


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_dropout_replays_and_matches_the_shared_rng(backend, device):
    g = torch.Generator().manual_seed(3)
    q, k, v = _qkv(2, 2, 2, 9, 17, 16, 16, device, dtype_for("attention", backend, device), g)
    p = 0.3
    a = fastattn.attention(q, k, v, dropout_p=p, seed=1234, backend=backend)
    b = fastattn.attention(q, k, v, dropout_p=p, seed=1234, backend=backend)
    c = fastattn.attention(q, k, v, dropout_p=p, seed=4321, backend=backend)
    assert torch.equal(a, b) and not torch.equal(a, c)
    ref, _ = reference.attention(to_numpy(q), to_numpy(k), to_numpy(v), dropout_p=p, seed=1234)
    assert_close_to_reference(a, ref, name="out")
    dout = torch.randn(a.shape, generator=g, dtype=torch.float64).to(device, q.dtype)
    grads = torch.autograd.grad(a, (q, k, v), dout)
    refs = reference.attention_backward(to_numpy(dout), to_numpy(q), to_numpy(k), to_numpy(v), dropout_p=p, seed=1234)
    for name, got, want in zip(("dq", "dk", "dv"), grads, refs):
        assert_close_to_reference(got, want, name=name)


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_dropout_drops_the_expected_fraction(backend, device):
    # With V = identity the output is the dropped probability matrix itself.
    Lk = 64
    dtype = dtype_for("attention", backend, device)
    q = torch.zeros(1, 4, 64, Lk, device=device, dtype=dtype)
    k = torch.zeros(1, 4, Lk, Lk, device=device, dtype=dtype)
    v = torch.eye(Lk, device=device, dtype=dtype).expand(1, 4, Lk, Lk).contiguous()
    p = 0.25
    out = fastattn.attention(q, k, v, dropout_p=p, seed=7, backend=backend)
    dropped = (out == 0).double().mean().item()
    n = out.numel()
    assert abs(dropped - p) < 6 * math.sqrt(p * (1 - p) / n)
    kept = out[out != 0].double()  # 1 / Lk / (1 - p), rounded to the dtype once
    assert torch.allclose(kept, torch.full_like(kept, 1 / Lk / (1 - p)),
                          rtol=1e-5 if dtype == torch.float32 else 8e-3)


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("mask_kind", [None, "padding", "bias"])
@pytest.mark.parametrize("is_causal", [False, True])
def test_sdpa_is_a_drop_in(backend, device, mask_kind, is_causal):
    if mask_kind is not None and is_causal:
        pytest.skip("torch rejects a mask together with is_causal")
    g = torch.Generator().manual_seed(4)
    q, k, v = _qkv(2, 4, 2, 17, 17, 16, 16, device, dtype_for("attention", backend, device, torch.float64, torch.float32), g)
    mask = _mask(mask_kind, 2, 4, 17, 17, device, q.dtype, g)
    got = fastattn.scaled_dot_product_attention(q, k, v, mask, is_causal=is_causal, scale=0.3, enable_gqa=True, backend=backend)
    want = F.scaled_dot_product_attention(q, k, v, mask, is_causal=is_causal, scale=0.3, enable_gqa=True)
    assert_close_to_reference(got, want, name="out")


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_bad_input_errors(backend, device):
    """fastattn.attention's own rules (scaled_dot_product_attention follows torch's: test_sdpa.py)."""
    q = torch.randn(1, 2, 4, 8, device=device)
    with pytest.raises(ValueError, match="4-D"):
        fastattn.attention(q[0], q[0], q[0], backend=backend)
    with pytest.raises(ValueError, match="batch sizes differ"):
        fastattn.attention(q, torch.cat([q, q]), torch.cat([q, q]), backend=backend)
    with pytest.raises(ValueError, match="head dim"):
        fastattn.scaled_dot_product_attention(q, q[..., :4], q, backend=backend)
    with pytest.raises(ValueError, match="enable_gqa"):
        fastattn.attention(q, q[:, :1], q[:, :1], backend=backend)
    kv = torch.randn(1, 3, 4, 8, device=device)
    with pytest.raises(ValueError, match="enable_gqa"):
        fastattn.scaled_dot_product_attention(q, kv, kv, backend=backend)
    with pytest.raises(ValueError, match="multiple"):
        fastattn.scaled_dot_product_attention(torch.cat([q, q], 1), kv, kv, enable_gqa=True, backend=backend)
    with pytest.raises(ValueError, match="not broadcastable"):
        fastattn.scaled_dot_product_attention(q, q, q, torch.ones(3, 4, dtype=torch.bool, device=device), backend=backend)
    with pytest.raises(ValueError, match="dropout_p"):
        fastattn.attention(q, q, q, dropout_p=1.0, backend=backend)
    with pytest.raises(TypeError, match="dtype"):
        fastattn.scaled_dot_product_attention(q.long(), q.long(), q.long(), backend=backend)
    with pytest.raises(ValueError, match="not both"):
        fastattn.scaled_dot_product_attention(q, q, q, torch.ones(4, 4, dtype=torch.bool, device=device), is_causal=True, backend=backend)
    with pytest.raises(ValueError, match="causal"):
        fastattn.attention(q, q, q, causal="diagonal", backend=backend)


@pytest.mark.parametrize("backend,device", [p for p in BACKENDS if p.id in ("triton", "cuda")])
def test_head_dim_limit(backend, device):
    q = torch.randn(1, 1, 2, 264, device=device, dtype=dtype_for("attention", backend, device))
    with pytest.raises(ValueError, match="256"):
        fastattn.attention(q, q, q, backend=backend)


@pytest.mark.parametrize("op,device", registered_ops("attention"))
@pytest.mark.parametrize("mask_kind", [None, "bias"])
def test_opcheck(op, device, mask_kind):
    g = torch.Generator().manual_seed(5)
    q, k, v = _qkv(1, 2, 1, 5, 7, 16, 16, device, torch.float32, g)
    mask = _mask(mask_kind, 1, 2, 5, 7, device, torch.float32, g)
    mask = None if mask is None else mask.expand(1, 2, 5, 7)
    torch.library.opcheck(op, (q, k, v, mask, 0.25, 0, 12, 0, 0.0, 0))


@pytest.mark.parametrize("backend,device", [p for p in BACKENDS if p.id in ("cpu", "naive", "triton")])
def test_compiles_without_graph_breaks(backend, device):
    if backend == "triton" and device.type == "cpu":
        pytest.skip("torch.compile of Triton ops needs a GPU")
    g = torch.Generator().manual_seed(6)
    q, k, v = _qkv(1, 2, 2, 8, 8, 16, 16, device, torch.float32, g)
    compiler = "inductor" if device.type == "cuda" else "aot_eager"

    def f(q, k, v):
        return fastattn.scaled_dot_product_attention(q * 2, k, v, is_causal=True, backend=backend).sum()

    out = torch.compile(f, fullgraph=True, backend=compiler)(q, k, v)
    out.backward()
    assert torch.allclose(out, f(q, k, v), atol=1e-4) and q.grad is not None


@pytest.mark.gpu
@pytest.mark.parametrize("backend", ["triton", "cuda"])
@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
@pytest.mark.parametrize("D", [64, 96, 128, 256])
@pytest.mark.parametrize("causal", [False, True])
def test_gpu_grid_within_twice_torch_error(backend, dtype, D, causal):
    if backend not in fastattn.available_backends():
        pytest.skip(f"{backend} unavailable")
    g = torch.Generator().manual_seed(D)
    q, k, v = _qkv(2, 4, 4, 257, 257, D, D, "cuda", dtype, g)
    out = fastattn.attention(q, k, v, causal=causal, backend=backend)
    base = F.scaled_dot_product_attention(q, k, v, is_causal=causal)
    ref, _ = reference.attention(to_numpy(q), to_numpy(k), to_numpy(v), causal=causal)
    assert_close_to_reference(out, ref, base, name="out")
    dout = torch.randn(out.shape, generator=g, dtype=torch.float64).to("cuda", dtype)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    bgrads = torch.autograd.grad(base, (q, k, v), dout)
    refs = reference.attention_backward(to_numpy(dout), to_numpy(q), to_numpy(k), to_numpy(v), causal=causal)
    for name, got, b, want in zip(("dq", "dk", "dv"), grads, bgrads, refs):
        assert_close_to_reference(got, want, b, name=name)
