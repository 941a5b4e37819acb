"""Drop-in modules (fastattn.nn) against torch's own modules (float64) and the NumPy reference."""

import pytest
import torch
import torch.nn.functional as F

import fastattn
from fastattn import reference
from fastattn.nn.attention import merge_mha_masks
from fastattn.testing import assert_close_to_reference, to_numpy

from conftest import backend_params, dtype_for, same_tol

F64 = torch.float64
ATTN_BACKENDS = backend_params("attention")
SOFTMAX_BACKENDS = backend_params("softmax")
FFN_BACKENDS = backend_params("ffn")


pytestmark = pytest.mark.usefixtures("one_thread")


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _pair(ref, ours):
    """Give ``ours`` the parameters of ``ref`` (torch's module) and return both in eval mode."""
    missing = ours.load_state_dict(ref.state_dict())
    assert not missing.missing_keys and not missing.unexpected_keys
    return ref.eval(), ours.eval()


def _close(a, b, tol=1e-10, name="output"):
    assert a.shape == b.shape, f"{name}: shape {tuple(a.shape)} != {tuple(b.shape)}"
    assert not torch.isnan(a).any(), f"{name} has NaN"
    err = (a.double() - b.double()).abs().max().item() if a.numel() else 0.0
    assert err <= tol, f"{name}: max error {err:.3g} > {tol:g}"


# ---------------------------------------------------------------------------------------------
# MultiheadAttention


MHA_CONFIGS = [
    dict(),
    dict(bias=False),
    dict(add_bias_kv=True),
    dict(add_zero_attn=True),
    dict(kdim=6, vdim=5),
    dict(add_bias_kv=True, add_zero_attn=True, kdim=7, vdim=7),
]


def _mask_cases(N, H, L, S, g):
    am = torch.rand(L, S, generator=g) < 0.3
    am[:, 0] = False  # every query keeps key 0: no fully masked row (torch gives NaN there)
    am3 = torch.rand(N * H, L, S, generator=g) < 0.3
    am3[..., 1] = False
    kpm = torch.zeros(N, S, dtype=torch.bool)
    kpm[0, S - 2:] = True
    fam = torch.randn(L, S, generator=g, dtype=F64)
    fkpm = torch.randn(N, S, generator=g, dtype=F64)
    return {
        "none": {},
        "bool2d": dict(attn_mask=am),
        "bool3d": dict(attn_mask=am3),
        "float2d": dict(attn_mask=fam),
        "kpm": dict(key_padding_mask=kpm),
        "float_kpm": dict(key_padding_mask=fkpm),
        "bool2d+kpm": dict(attn_mask=am, key_padding_mask=kpm),
        "bool3d+kpm": dict(attn_mask=am3, key_padding_mask=kpm),
        "float2d+kpm": dict(attn_mask=fam, key_padding_mask=kpm),
    }


@pytest.mark.parametrize(
    "config,batch_first",
    [(c, True) for c in MHA_CONFIGS] + [(MHA_CONFIGS[0], False), (MHA_CONFIGS[-1], False)],
    ids=lambda c: (",".join(f"{k}={v}" for k, v in c.items()) or "default") if isinstance(c, dict) else f"batch_first={c}",
)
def test_mha_matches_torch(config, batch_first):
    """Outputs, weights (averaged and per head) and gradients equal torch's, for every mask kind."""
    E, H, N, L, S = 8, 2, 3, 4, 5
    torch.manual_seed(0)
    ref, ours = _pair(
        torch.nn.MultiheadAttention(E, H, batch_first=batch_first, dtype=F64, **config),
        fastattn.nn.MultiheadAttention(E, H, batch_first=batch_first, dtype=F64, backend="naive", **config),
    )
    g = _gen(1)
    q = torch.randn(N, L, E, generator=g, dtype=F64)
    k = torch.randn(N, S, config.get("kdim", E), generator=g, dtype=F64)
    v = torch.randn(N, S, config.get("vdim", E), generator=g, dtype=F64)
    if not batch_first:
        q, k, v = (t.transpose(0, 1) for t in (q, k, v))
    modes = ((False, True), (True, True), (True, False))  # (need_weights, average_attn_weights)
    for i, (case, masks) in enumerate(_mask_cases(N, H, L, S, g).items()):
        for need_weights, average in (modes[i % 3],):
            inputs = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            o1, w1 = ref(*inputs, need_weights=need_weights, average_attn_weights=average, **masks)
            inputs2 = [t.detach().clone().requires_grad_() for t in (q, k, v)]
            o2, w2 = ours(*inputs2, need_weights=need_weights, average_attn_weights=average, **masks)
            _close(o2, o1, name=f"{case} output")
            if need_weights:
                _close(w2, w1, name=f"{case} weights")
            else:
                assert w2 is None
            dy = torch.randn(o1.shape, generator=g, dtype=F64)
            g1 = torch.autograd.grad(o1, inputs + [ref.out_proj.weight], dy)
            g2 = torch.autograd.grad(o2, inputs2 + [ours.out_proj.weight], dy)
            for name, a, b in zip(("dq", "dk", "dv", "dWo"), g2, g1):
                _close(a, b, name=f"{case} {name}")


def test_mha_self_attention_and_parameter_gradients():
    """Self-attention (packed projection path): every parameter's gradient equals torch's."""
    torch.manual_seed(0)
    ref, ours = _pair(
        torch.nn.MultiheadAttention(8, 4, batch_first=True, dtype=F64, add_bias_kv=True),
        fastattn.nn.MultiheadAttention(8, 4, batch_first=True, dtype=F64, add_bias_kv=True, backend="naive"),
    )
    x = torch.randn(2, 5, 8, generator=_gen(), dtype=F64)
    kpm = torch.tensor([[False] * 5, [False, False, False, True, True]])
    o1, _ = ref(x, x, x, key_padding_mask=kpm, need_weights=False)
    o2, _ = ours(x, x, x, key_padding_mask=kpm, need_weights=False)
    _close(o2, o1)
    o1.square().sum().backward()
    o2.square().sum().backward()
    for (name, p1), (_, p2) in zip(ref.named_parameters(), ours.named_parameters()):
        _close(p2.grad, p1.grad, name=f"grad {name}")


def test_mha_unbatched():
    torch.manual_seed(0)
    ref, ours = _pair(
        torch.nn.MultiheadAttention(8, 2, dtype=F64), fastattn.nn.MultiheadAttention(8, 2, dtype=F64, backend="naive")
    )
    g = _gen()
    q, k = torch.randn(4, 8, generator=g, dtype=F64), torch.randn(6, 8, generator=g, dtype=F64)
    kpm = torch.tensor([False, False, False, False, True, True])
    am = torch.randn(2, 4, 6, generator=g, dtype=F64)  # (num_heads, L, S) for unbatched input
    o1, w1 = ref(q, k, k, key_padding_mask=kpm, attn_mask=am, average_attn_weights=False)
    o2, w2 = ours(q, k, k, key_padding_mask=kpm, attn_mask=am, average_attn_weights=False)
    assert o2.shape == (4, 8) and w2.shape == (2, 4, 6)
    _close(o2, o1)
    _close(w2, w1, name="weights")


def test_mha_is_causal():
    """is_causal with the causal attn_mask equals torch; without the mask (torch refuses) it is
    the same causal band."""
    torch.manual_seed(0)
    ref, ours = _pair(
        torch.nn.MultiheadAttention(8, 2, batch_first=True, dtype=F64),
        fastattn.nn.MultiheadAttention(8, 2, batch_first=True, dtype=F64, backend="naive"),
    )
    x = torch.randn(2, 5, 8, generator=_gen(), dtype=F64)
    causal = torch.nn.Transformer.generate_square_subsequent_mask(5, dtype=F64)
    for need_weights in (False, True):
        o1, w1 = ref(x, x, x, attn_mask=causal, is_causal=True, need_weights=need_weights)
        o2, w2 = ours(x, x, x, attn_mask=causal, is_causal=True, need_weights=need_weights)
        o3, w3 = ours(x, x, x, is_causal=True, need_weights=need_weights)
        _close(o2, o1)
        _close(o3, o1)
        if need_weights:
            _close(w2, w1, name="weights")
            _close(w3, w1, name="weights")
            assert (w3[:, 0, 1:] == 0).all()
    # appended keys (add_bias_kv, add_zero_attn) stay visible to every query under is_causal
    ref, ours = _pair(
        torch.nn.MultiheadAttention(8, 2, batch_first=True, dtype=F64, add_bias_kv=True, add_zero_attn=True),
        fastattn.nn.MultiheadAttention(8, 2, batch_first=True, dtype=F64, add_bias_kv=True, add_zero_attn=True, backend="naive"),
    )
    o1, w1 = ref(x, x, x, attn_mask=causal, is_causal=True)
    o2, w2 = ours(x, x, x, is_causal=True)
    _close(o2, o1)
    _close(w2, w1, name="weights")


def test_mha_fully_masked_row_is_zero():
    """The documented difference: a query with no key to attend outputs out_proj.bias (attention 0), not NaN."""
    ours = fastattn.nn.MultiheadAttention(8, 2, batch_first=True, dtype=F64, backend="naive").eval()
    torch.nn.init.normal_(ours.out_proj.bias)
    x = torch.randn(1, 3, 8, generator=_gen(), dtype=F64, requires_grad=True)
    am = torch.zeros(3, 3, dtype=torch.bool)
    am[1] = True  # query 1 may attend nothing
    out, w = ours(x, x, x, attn_mask=am)
    _close(out[0, 1], ours.out_proj.bias.detach(), name="masked row")
    assert (w[0, 1] == 0).all() and not torch.isnan(out).any()
    out.sum().backward()
    assert not torch.isnan(x.grad).any()


def test_mha_float32_mask_kept_in_float32_for_a_bf16_module():
    """torch adds a float32 attn_mask in float32 to a bf16 module's scores; rounded to bf16
    first (a bias near 100: steps of 0.5) the output moved several times further from float64."""
    E, H, L = 16, 2, 8
    torch.manual_seed(0)
    ref, ours = _pair(torch.nn.MultiheadAttention(E, H, batch_first=True),
                      fastattn.nn.MultiheadAttention(E, H, batch_first=True))
    x = torch.randn(1, L, E, generator=_gen())
    i, j = torch.arange(L)[:, None], torch.arange(L)[None, :]
    bias = -(i - j).abs().float() * 3.37 + 100.0
    want = ref.double()(*(x.double(),) * 3, attn_mask=bias.double(), need_weights=False)[0]
    ref, ours, xb = ref.bfloat16(), ours.bfloat16(), x.bfloat16()
    torch_err = (ref(xb, xb, xb, attn_mask=bias, need_weights=False)[0].double() - want).abs().max()
    err = (ours(xb, xb, xb, attn_mask=bias, need_weights=False)[0].double() - want).abs().max()
    assert err <= 1.5 * torch_err + 1e-3, (err, torch_err)


def test_merge_mha_masks_is_minimal():
    """One fastattn mask (True = allowed), never expanded past the shapes it combines."""
    N, H, L, S = 3, 4, 5, 6
    am = torch.rand(L, S) < 0.5
    am3 = torch.rand(N * H, L, S) < 0.5
    kpm = torch.rand(N, S) < 0.5
    assert merge_mha_masks(None, None, N, H, L, S) is None
    m = merge_mha_masks(am, None, N, H, L, S)
    assert m.shape == (1, 1, L, S) and m.dtype == torch.bool and torch.equal(m[0, 0], ~am)
    m = merge_mha_masks(None, kpm, N, H, L, S)
    assert m.shape == (N, 1, 1, S) and torch.equal(m[:, 0, 0], ~kpm)
    m = merge_mha_masks(am, kpm, N, H, L, S)
    assert m.shape == (N, 1, L, S) and torch.equal(m, ~(am[None, None] | kpm[:, None, None]))
    m = merge_mha_masks(am3, kpm, N, H, L, S)
    assert m.shape == (N, H, L, S)
    m = merge_mha_masks(am.double(), kpm, N, H, L, S)  # float + bool: additive float
    assert m.dtype.is_floating_point and m.shape == (N, 1, L, S)
    assert torch.isneginf(m[kpm[:, None, None].expand(N, 1, L, S)]).all()
    m = merge_mha_masks(None, kpm, N, H, L, S + 1, extra_keys=1)  # add_bias_kv column allowed
    assert m.shape == (N, 1, 1, S + 1) and m[..., -1].all()
    with pytest.raises(RuntimeError, match="2D attn_mask"):
        merge_mha_masks(torch.zeros(L, S + 1, dtype=torch.bool), None, N, H, L, S)
    with pytest.raises(TypeError, match="bool and floating"):
        merge_mha_masks(torch.zeros(L, S, dtype=torch.int64), None, N, H, L, S)


def test_mha_bad_input_names_the_callers_shapes():
    mha = fastattn.nn.MultiheadAttention(8, 2)  # (L, N, E)
    q, kv = torch.randn(4, 3, 8), torch.randn(5, 2, 8)
    with pytest.raises(ValueError, match=r"query \[4, 3, 8\] and key \[5, 2, 8\] must share their batch dim"):
        mha(q, kv, kv)
    with pytest.raises(ValueError, match=r"unbatched .* 1-D \(S,\), got shape \[1, 5\]"):
        mha(q[:, 0], kv[:, 0], kv[:, 0], key_padding_mask=torch.zeros(1, 5, dtype=torch.bool))


def test_mha_matches_numpy_reference():
    torch.manual_seed(0)
    m = fastattn.nn.MultiheadAttention(8, 2, batch_first=True, dtype=F64, backend="naive").eval()
    torch.nn.init.normal_(m.in_proj_bias)
    g = _gen()
    q, k = torch.randn(2, 4, 8, generator=g, dtype=F64), torch.randn(2, 6, 8, generator=g, dtype=F64)
    am = torch.randn(4, 6, generator=g, dtype=F64)
    kpm = torch.tensor([[False] * 6, [False] * 4 + [True] * 2])
    out, _ = m(q, k, k, attn_mask=am, key_padding_mask=kpm, need_weights=False)
    ref = reference.multi_head_attention(q, k, k, {n: to_numpy(p) for n, p in m.state_dict().items()}, 2, to_numpy(am), kpm.numpy())
    assert_close_to_reference(out, ref)


@pytest.mark.parametrize("backend,device", ATTN_BACKENDS)
def test_mha_backends(backend, device):
    """Each backend (float32; bfloat16 where the backend takes no float32): output and weights
    against the float64 NumPy reference, gradients against torch's module."""
    torch.manual_seed(0)
    dt = dtype_for("attention", backend, device)
    ref_mod, ours = _pair(
        torch.nn.MultiheadAttention(16, 2, batch_first=True, device=device, dtype=dt),
        fastattn.nn.MultiheadAttention(16, 2, batch_first=True, device=device, dtype=dt,
                                       backend=backend),
    )
    g = _gen()
    x = torch.randn(2, 5, 16, generator=g).to(device, dt)
    kpm = torch.tensor([[False] * 5, [False, False, False, True, True]], device=device)
    am = (torch.randn(5, 5, generator=g) * 0.5).to(device, dt)
    o2, w2 = ours(x, x, x, key_padding_mask=kpm, attn_mask=am)
    o1, w1 = ref_mod(x, x, x, key_padding_mask=kpm, attn_mask=am)
    params = {n: to_numpy(p) for n, p in ours.state_dict().items()}
    xn = to_numpy(x)
    ref_out = reference.multi_head_attention(xn, xn, xn, params, 2, to_numpy(am), kpm.cpu().numpy())
    assert_close_to_reference(o2, ref_out, o1, factor=4)
    # weights: softmax of the reference scores
    qkv = reference.linear(to_numpy(x), params["in_proj_weight"], params["in_proj_bias"])
    qh, kh = (t.reshape(2, 5, 2, 8).transpose(0, 2, 1, 3) for t in (qkv[..., :16], qkv[..., 16:32]))
    p = reference.softmax(qh @ kh.transpose(0, 1, 3, 2), to_numpy(am) + reference._additive_mask(~kpm.cpu().numpy()[:, None, None]), 8**-0.5)
    assert_close_to_reference(w2, p.mean(axis=1), w1, factor=4, name="weights")
    dy = torch.randn(o1.shape, generator=g).to(device, dt)
    g1 = torch.autograd.grad(o1, list(ref_mod.parameters()), dy)
    g2 = torch.autograd.grad(o2, list(ours.parameters()), dy)
    tol = same_tol(dt)
    for a, b in zip(g2, g1):
        torch.testing.assert_close(a, b, **tol)


def test_mha_dropout_training_only():
    torch.manual_seed(0)
    m = fastattn.nn.MultiheadAttention(8, 2, dropout=0.5, batch_first=True, dtype=F64, backend="naive")
    ref = torch.nn.MultiheadAttention(8, 2, dropout=0.5, batch_first=True, dtype=F64)
    ref.load_state_dict(m.state_dict())
    x = torch.randn(2, 70, 8, generator=_gen(), dtype=F64)  # > 64 keys: weights built in two chunks
    m.eval(), ref.eval()
    _close(m(x, x, x)[0], ref(x, x, x)[0], name="eval output")  # no dropout in eval
    m.train()
    torch.manual_seed(1)
    o1, w1 = m(x, x, x, average_attn_weights=False)
    torch.manual_seed(1)
    o2, _ = m(x, x, x)
    _close(o2, o1, name="same seed")  # reproducible from torch's generator
    assert (o1 - ref(x, x, x)[0]).abs().max() > 1e-3  # dropout did something
    # The returned weights are the ones used (dropped and rescaled): out = out_proj(weights @ V).
    assert (w1 == 0).any() and (w1.sum(-1) - 1).abs().max() > 1e-3
    v = F.linear(x, m.in_proj_weight[16:], m.in_proj_bias[16:]).unflatten(-1, (2, 4)).transpose(1, 2)
    recon = F.linear((w1 @ v).transpose(1, 2).reshape(2, 70, 8), m.out_proj.weight, m.out_proj.bias)
    _close(o1, recon, name="output from the weights")


def test_mha_is_a_torch_module():
    m = fastattn.nn.MultiheadAttention(12, 3, kdim=5, vdim=7, add_bias_kv=True, backend="naive")
    t = torch.nn.MultiheadAttention(12, 3, kdim=5, vdim=7, add_bias_kv=True)
    assert isinstance(m, torch.nn.MultiheadAttention)
    assert {k: v.shape for k, v in m.state_dict().items()} == {k: v.shape for k, v in t.state_dict().items()}
    assert "backend='naive'" in repr(m)
    with pytest.raises(ValueError, match="kdim"):
        m(torch.randn(2, 1, 12), torch.randn(3, 1, 6), torch.randn(3, 1, 7))


# ---------------------------------------------------------------------------------------------
# ScaledMaskedSoftmax and FeedForward


@pytest.mark.parametrize("backend,device", SOFTMAX_BACKENDS)
def test_scaled_masked_softmax_module(backend, device):
    g = _gen()
    x = torch.randn(2, 3, 4, 6, generator=g).to(device)
    mask = (torch.rand(2, 1, 4, 6, generator=g) < 0.7).to(device)
    mod = fastattn.nn.ScaledMaskedSoftmax(scale=0.7, is_causal=True, backend=backend)
    y = mod(x, mask)
    assert_close_to_reference(y, reference.softmax(to_numpy(x), mask.cpu().numpy(), 0.7, True))
    assert "is_causal=True" in repr(mod)


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu", "silu", "swiglu", "geglu"])
def test_feed_forward_matches_reference(activation):
    torch.manual_seed(0)
    m = fastattn.nn.FeedForward(8, 12, activation, out_features=6, backend="naive", dtype=F64)
    assert list(m.state_dict()) == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    assert m.fc1.out_features == (24 if activation in ("swiglu", "geglu") else 12) and m.fc2.out_features == 6
    x = torch.randn(2, 3, 8, generator=_gen(), dtype=F64)
    p = {n: to_numpy(t) for n, t in m.state_dict().items()}
    ref = reference.ffn(to_numpy(x), p["fc1.weight"], p["fc1.bias"], p["fc2.weight"], p["fc2.bias"], activation)
    assert_close_to_reference(m(x), ref)


@pytest.mark.parametrize("backend,device", FFN_BACKENDS)
def test_feed_forward_backends(backend, device):
    torch.manual_seed(0)
    m = fastattn.nn.FeedForward(16, 24, "swiglu", bias=False, backend=backend, device=device).eval()
    assert m.fc1.bias is None
    x = torch.randn(5, 16, generator=_gen()).to(device)
    p = {n: to_numpy(t) for n, t in m.state_dict().items()}
    ref = reference.ffn(to_numpy(x), p["fc1.weight"], None, p["fc2.weight"], None, "swiglu")
    base = F.linear(F.silu(F.linear(x, m.fc1.weight[:24])) * F.linear(x, m.fc1.weight[24:]), m.fc2.weight)
    assert_close_to_reference(m(x), ref, base, factor=4)


def test_feed_forward_dropout_and_errors():
    m = fastattn.nn.FeedForward(8, 16, dropout=0.5, backend="naive", dtype=F64)
    x = torch.randn(4, 8, generator=_gen(), dtype=F64)
    m.eval()
    y_eval = m(x)
    m.train()
    y_train = m(x)
    zeros = y_train == 0
    assert zeros.any()
    _close(y_train[~zeros], 2 * y_eval[~zeros], name="kept values scaled by 1/(1-p)")
    with pytest.raises(ValueError, match="unknown activation"):
        fastattn.nn.FeedForward(8, 16, "tanh")


# ---------------------------------------------------------------------------------------------
# Transformer layers


def _layer_inputs(batch_first, g):
    x = torch.randn(3, 5, 16, generator=g, dtype=F64)
    mem = torch.randn(3, 7, 16, generator=g, dtype=F64)
    if not batch_first:
        x, mem = x.transpose(0, 1), mem.transpose(0, 1)
    kpm = torch.zeros(3, 5, dtype=torch.bool)
    kpm[1, 3:] = True
    mkpm = torch.zeros(3, 7, dtype=torch.bool)
    mkpm[2, 4:] = True
    return x, mem, kpm, mkpm


@pytest.mark.parametrize(
    "norm_first,batch_first,activation", [(False, True, "relu"), (True, True, "gelu"), (False, False, "gelu"), (True, False, "relu")]
)
def test_encoder_layer_matches_torch(norm_first, batch_first, activation):
    torch.manual_seed(0)
    kw = dict(dim_feedforward=32, dropout=0.1, activation=activation, batch_first=batch_first, norm_first=norm_first, dtype=F64)
    ref, ours = _pair(torch.nn.TransformerEncoderLayer(16, 2, **kw), fastattn.nn.TransformerEncoderLayer(16, 2, backend="naive", **kw))
    assert list(ours.state_dict()) == list(ref.state_dict())
    assert isinstance(ours.self_attn, fastattn.nn.MultiheadAttention) and isinstance(ours.norm1, fastattn.nn.LayerNorm)
    x, _, kpm, _ = _layer_inputs(batch_first, _gen(1))
    causal = torch.nn.Transformer.generate_square_subsequent_mask(5, dtype=F64)
    for masks in (dict(), dict(src_key_padding_mask=kpm), dict(src_mask=causal, is_causal=True, src_key_padding_mask=kpm)):
        x1, x2 = x.clone().requires_grad_(), x.clone().requires_grad_()
        y1, y2 = ref(x1, **masks), ours(x2, **masks)
        _close(y2, y1)
        y1.sum().backward()
        y2.sum().backward()
        _close(x2.grad, x1.grad, name="dx")
        _close(ours.linear1.weight.grad, ref.linear1.weight.grad, name="dW1")


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("batch_first", [True, False])
def test_decoder_layer_matches_torch(norm_first, batch_first):
    torch.manual_seed(0)
    kw = dict(dim_feedforward=32, dropout=0.1, batch_first=batch_first, norm_first=norm_first, dtype=F64)
    ref, ours = _pair(torch.nn.TransformerDecoderLayer(16, 2, **kw), fastattn.nn.TransformerDecoderLayer(16, 2, backend="naive", **kw))
    assert list(ours.state_dict()) == list(ref.state_dict())
    x, mem, kpm, mkpm = _layer_inputs(batch_first, _gen(1))
    causal = torch.nn.Transformer.generate_square_subsequent_mask(5, dtype=F64)
    masks = dict(tgt_mask=causal, tgt_is_causal=True, tgt_key_padding_mask=kpm, memory_key_padding_mask=mkpm)
    y1 = ref(x, mem, **masks)
    _close(ours(x, mem, **masks), y1)
    masks.pop("tgt_mask")  # the band alone (torch needs the mask)
    _close(ours(x, mem, **masks), y1)
    mm = torch.randn(5, 7, generator=_gen(2), dtype=F64)
    _close(ours(x, mem, memory_mask=mm), ref(x, mem, memory_mask=mm), name="memory_mask")


def test_encoder_layer_matches_numpy_reference():
    torch.manual_seed(0)
    layer = fastattn.nn.TransformerEncoderLayer(
        16, 2, 24, dropout=0.0, activation="swiglu", batch_first=True, norm_first=True, dtype=F64, backend="naive"
    ).eval()
    assert layer.linear1.weight.shape == (48, 16)  # [gate; up]
    x, _, kpm, _ = _layer_inputs(True, _gen(1))
    p = {n: to_numpy(t) for n, t in layer.state_dict().items()}
    ref = reference.transformer_block(to_numpy(x), p, 2, norm_first=True, activation="swiglu", key_padding_mask=kpm.numpy(), is_causal=True)
    assert_close_to_reference(layer(x, src_key_padding_mask=kpm, is_causal=True), ref)


def test_layers_training_dropout_path_matches_torch():
    """In training with the FFN's inner dropout > 0 the FFN runs unfused, dropout where torch puts
    it: with the same seed, torch's exact output and gradients. (Attention dropout is turned off
    and dropout1/2/3 too: their masks depend on the memory layout of the attention output.)"""
    torch.manual_seed(0)
    kw = dict(dim_feedforward=32, dropout=0.3, batch_first=True, dtype=F64)
    for ref_cls, our_cls in (
        (torch.nn.TransformerEncoderLayer, fastattn.nn.TransformerEncoderLayer),
        (torch.nn.TransformerDecoderLayer, fastattn.nn.TransformerDecoderLayer),
    ):
        ref, ours = ref_cls(16, 2, **kw), our_cls(16, 2, backend="naive", **kw)
        ours.load_state_dict(ref.state_dict())
        ref.train(), ours.train()
        for m in (*ref.modules(), *ours.modules()):
            if isinstance(m, torch.nn.MultiheadAttention):
                m.dropout = 0.0
        for layer in (ref, ours):
            for name in ("dropout1", "dropout2", "dropout3"):
                if hasattr(layer, name):
                    getattr(layer, name).p = 0.0
        x, mem, _, _ = _layer_inputs(True, _gen(1))
        args = (x,) if ref_cls is torch.nn.TransformerEncoderLayer else (x, mem)
        torch.manual_seed(5)
        y1 = ref(*args)
        torch.manual_seed(5)
        y2 = ours(*args)
        _close(y2, y1, name=f"{our_cls.__name__} train output")
        y1.sum().backward()
        y2.sum().backward()
        _close(ours.linear1.weight.grad, ref.linear1.weight.grad, name="dW1")
        ref.eval(), ours.eval()
        assert (ours(*args) - y2).abs().max() > 1e-3  # dropout was active in training


def test_layer_activations():
    name = fastattn.nn.transformer.activation_name
    assert name(F.relu) == "relu" and name(torch.nn.GELU()) == "gelu" and name(torch.nn.GELU("tanh")) == "gelu_tanh"
    assert name(F.silu) == "silu" and name("geglu") == "geglu"
    with pytest.raises(ValueError, match="not supported"):
        fastattn.nn.TransformerDecoderLayer(16, 2, activation="tanh")
    layer = fastattn.nn.TransformerEncoderLayer(16, 2, 32, activation=F.gelu, dtype=F64, backend="naive").eval()
    ref = torch.nn.TransformerEncoderLayer(16, 2, 32, activation=F.gelu, dtype=F64).eval()
    ref.load_state_dict(layer.state_dict())
    x = torch.randn(5, 2, 16, generator=_gen(), dtype=F64)
    _close(layer(x), ref(x))
    # As in torch: any callable, and a reassigned activation takes effect (fused where it can be).
    for act in (torch.tanh, F.silu, F.relu, torch.nn.GELU("tanh")):  # (a module stays one, in torch too)
        layer.activation = ref.activation = act
        assert layer.activation_name == (None if act is torch.tanh else fastattn.nn.transformer.activation_name(act))
        _close(layer(x), ref(x))
    layer = fastattn.nn.TransformerEncoderLayer(16, 2, 32, activation=torch.tanh, dtype=F64, backend="naive").eval()
    ref = torch.nn.TransformerEncoderLayer(16, 2, 32, activation=torch.tanh, dtype=F64).eval()
    ref.load_state_dict(layer.state_dict())
    assert "unfused" in repr(layer)
    _close(layer(x), ref(x))


@pytest.mark.parametrize("backend,device", ATTN_BACKENDS)
def test_layers_backends(backend, device):
    """Each backend (float32; bfloat16 where the backend takes no float32), tiny shapes: encoder
    and decoder layers against torch's float64 layers."""
    torch.manual_seed(0)
    dt = dtype_for("attention", backend, device)
    atol = 1e-4 if dt == torch.float32 else None  # (None: the dtype's own tolerance)
    kw = dict(dim_feedforward=32, batch_first=True)
    enc = fastattn.nn.TransformerEncoderLayer(16, 2, backend=backend, device=device, dtype=dt,
                                              **kw).eval()
    dec = fastattn.nn.TransformerDecoderLayer(16, 2, backend=backend, device=device, dtype=dt,
                                              **kw).eval()
    enc64 = torch.nn.TransformerEncoderLayer(16, 2, dtype=F64, **kw).eval()
    dec64 = torch.nn.TransformerDecoderLayer(16, 2, dtype=F64, **kw).eval()
    enc64.load_state_dict(enc.state_dict())  # (in float64: the weights as ours hold them)
    dec64.load_state_dict(dec.state_dict())
    x, mem, kpm, mkpm = _layer_inputs(True, _gen(1))
    causal = torch.nn.Transformer.generate_square_subsequent_mask(5, dtype=F64)
    with torch.no_grad():
        y = enc(x.to(device, dt), src_key_padding_mask=kpm.to(device))
        assert_close_to_reference(y, enc64(x.to(dt).double(), src_key_padding_mask=kpm), atol=atol)
        z = dec(y, mem.to(device, dt), tgt_is_causal=True, memory_key_padding_mask=mkpm.to(device))
        ref = dec64(y.double().cpu(), mem.to(dt).double(), tgt_mask=causal, tgt_is_causal=True,
                    memory_key_padding_mask=mkpm)
        assert_close_to_reference(z, ref, atol=atol)
