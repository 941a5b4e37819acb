"""fastattn.swap / unswap (module fastattn.swapping): swapping fastattn's modules into torch models (and Hugging Face models) and back."""

import copy

import pytest
import torch

import fastattn
from fastattn.swapping import SwapReport, swap, unswap

from conftest import backend_params, dtype_for

F64 = torch.float64


pytestmark = pytest.mark.usefixtures("one_thread")


def _close(a, b, tol=1e-10, name="output"):
    assert a.shape == b.shape and not torch.isnan(a).any(), name
    err = (a.double() - b.double()).abs().max().item()
    assert err <= tol, f"{name}: max error {err:.3g} > {tol:g}"


def _transformer(**kw):
    torch.manual_seed(0)
    args = dict(d_model=16, nhead=2, num_encoder_layers=2, num_decoder_layers=1, dim_feedforward=32, dropout=0.1, batch_first=True, dtype=F64)
    args.update(kw)
    return torch.nn.Transformer(**args)


def _inputs(batch_first=True):
    g = torch.Generator().manual_seed(1)
    src = torch.randn(2, 6, 16, generator=g, dtype=F64)
    tgt = torch.randn(2, 5, 16, generator=g, dtype=F64)
    if not batch_first:
        src, tgt = src.transpose(0, 1), tgt.transpose(0, 1)
    kpm = torch.zeros(2, 6, dtype=torch.bool)
    kpm[1, 4:] = True
    masks = dict(
        tgt_mask=torch.nn.Transformer.generate_square_subsequent_mask(5, dtype=F64), tgt_is_causal=True,
        src_key_padding_mask=kpm, memory_key_padding_mask=kpm,
    )
    return src, tgt, masks


@pytest.mark.parametrize("batch_first", [True, False])
def test_swap_transformer_keeps_everything(batch_first):
    model = _transformer(batch_first=batch_first).eval()
    reference = copy.deepcopy(model)
    params = {n: p for n, p in model.named_parameters()}
    keys = list(model.state_dict())
    nested = model.encoder.use_nested_tensor  # torch enables it for batch_first only
    assert nested is batch_first
    src, tgt, masks = _inputs(batch_first)
    expected = reference(src, tgt, **masks)

    report = swap(model, backend="naive")
    assert isinstance(report, SwapReport)
    # 2 encoder + 1 decoder layers; 2 + 2 MHA; 2*2 + 3 + 2 final LayerNorms
    assert report.counts == {
        "torch.nn.TransformerEncoderLayer": 2, "torch.nn.TransformerDecoderLayer": 1,
        "torch.nn.MultiheadAttention": 4, "torch.nn.LayerNorm": 9,
    }
    assert len(report) == 16 and "fastattn swapped 16 module(s)" in str(report)
    assert "encoder.layers.0.self_attn" in str(report)
    layer = model.encoder.layers[0]
    assert type(layer) is fastattn.nn.TransformerEncoderLayer and layer.backend == "naive"
    assert type(layer.self_attn) is fastattn.nn.MultiheadAttention and type(model.decoder.norm) is fastattn.nn.LayerNorm
    assert all(p is params[n] for n, p in model.named_parameters())  # the same Parameter objects
    assert list(model.state_dict()) == keys and not model.training
    assert model.encoder.use_nested_tensor is False
    _close(model(src, tgt, **masks), expected)

    model.train()
    g1 = torch.autograd.grad(model(src, tgt, **masks).sum(), list(model.parameters()), allow_unused=True)
    assert model.training and model.encoder.layers[1].training

    restored = unswap(model)
    assert len(restored) == 16 and "restored" in str(restored)
    assert type(model.encoder.layers[0]) is torch.nn.TransformerEncoderLayer
    assert type(model.encoder.layers[0].self_attn) is torch.nn.MultiheadAttention
    assert "backend" not in model.encoder.layers[0].self_attn.__dict__
    assert model.encoder.use_nested_tensor is nested
    model.eval()
    _close(model(src, tgt, **masks), expected)
    assert len(g1) == len(list(model.parameters()))


def test_swapped_gradients_match_torch():
    model = _transformer(dropout=0.0)
    reference = copy.deepcopy(model)
    swap(model, backend="naive")
    src, tgt, masks = _inputs()
    g_ref = torch.autograd.grad(reference(src, tgt, **masks).square().sum(), list(reference.parameters()))
    g_new = torch.autograd.grad(model(src, tgt, **masks).square().sum(), list(model.parameters()))
    for (name, _), a, b in zip(model.named_parameters(), g_new, g_ref):
        _close(a, b, tol=1e-9, name=f"grad {name}")


def test_swap_eval_no_grad_padding_runs_fastattn():
    """torch's encoder would use nested tensors + its own fused kernel in eval/no_grad with a
    padding mask; after swap our layers run (counted) and valid positions match."""
    model = torch.nn.TransformerEncoder(
        torch.nn.TransformerEncoderLayer(16, 2, 32, batch_first=True, dtype=F64), 2, enable_nested_tensor=True
    ).eval()
    reference = copy.deepcopy(model)
    swap(model, backend="naive")
    calls = []
    model.layers[0].self_attn.register_forward_hook(lambda *a: calls.append(1))
    src, _, masks = _inputs()
    kpm = masks["src_key_padding_mask"]
    with torch.no_grad():
        out = model(src, src_key_padding_mask=kpm)
        expected = reference(src, src_key_padding_mask=kpm)
    assert calls == [1]
    _close(out[~kpm], expected[~kpm])


def test_swap_flags_and_unsupported_activation():
    model = _transformer(activation=torch.tanh).eval()
    reference = copy.deepcopy(model)
    report = swap(model, attention=False, layer_norm=True, ffn=True)
    assert type(model.encoder.layers[0].self_attn) is torch.nn.MultiheadAttention
    assert type(model.encoder.layers[0].norm1) is fastattn.nn.LayerNorm
    layer = model.encoder.layers[0]
    assert type(layer) is fastattn.nn.TransformerEncoderLayer and layer.fused_ffn is False
    assert "not one of fastattn's" in str(report)
    src, tgt, masks = _inputs()
    _close(model(src, tgt, **masks), reference(src, tgt, **masks))

    model = _transformer().eval()
    report = swap(model, attention=True, layer_norm=False, ffn=False)
    assert type(model.encoder.norm) is torch.nn.LayerNorm
    assert model.encoder.layers[0].fused_ffn is False and "ffn=False" in str(report)
    assert report.counts == {"torch.nn.TransformerEncoderLayer": 2, "torch.nn.TransformerDecoderLayer": 1, "torch.nn.MultiheadAttention": 4}
    assert len(swap(model)) == 9  # a second swap converts the rest (the norms) only

    model = _transformer()
    assert len(swap(model, attention=False, layer_norm=False, ffn=False)) == 0


def test_swap_subclasses_hooks_and_rmsnorm():
    class PlainLayerNorm(torch.nn.LayerNorm):  # e.g. a library's alias class
        pass

    class CustomLayerNorm(torch.nn.LayerNorm):
        def forward(self, x):
            return super().forward(x) * 2

    model = torch.nn.Sequential(
        PlainLayerNorm(8, dtype=F64), CustomLayerNorm(8, dtype=F64), torch.nn.RMSNorm(8, dtype=F64), torch.nn.Linear(8, 8, dtype=F64)
    )
    torch.nn.init.normal_(model[0].weight)
    seen = []
    model[0].register_forward_hook(lambda mod, inp, out: seen.append(type(mod)))
    x = torch.randn(3, 8, dtype=F64)
    expected = model(x)
    report = swap(model, backend="naive")
    assert isinstance(model[0], PlainLayerNorm) and isinstance(model[0], fastattn.nn.LayerNorm)
    assert type(model[1]) is CustomLayerNorm and "overrides forward" in str(report)
    assert type(model[2]) is fastattn.nn.RMSNorm
    assert report.counts == {f"{__name__}.test_swap_subclasses_hooks_and_rmsnorm.<locals>.PlainLayerNorm": 1, "torch.nn.RMSNorm": 1}
    _close(model(x), expected)
    assert seen[-1] is type(model[0]) and len(seen) == 2  # the hook survived the swap
    unswap(model)
    assert type(model[0]) is PlainLayerNorm and type(model[2]) is torch.nn.RMSNorm


@pytest.mark.parametrize("backend,device", backend_params("attention"))
def test_swap_backends(backend, device):
    """Each backend (float32; bfloat16 where the backend takes no float32; tiny): the swapped
    torch.nn.Transformer against the float64 original (its weights as the swapped one holds them)."""
    torch.manual_seed(0)
    dt = dtype_for("attention", backend, device)
    model = torch.nn.Transformer(16, 2, 1, 1, 32, batch_first=True, device=device, dtype=dt).eval()
    reference = copy.deepcopy(model).double().cpu()
    swap(model, backend=backend)
    src, tgt, masks = _inputs()
    src, tgt = src.to(dt).double(), tgt.to(dt).double()  # (the inputs as the model reads them)
    masks["tgt_mask"] = masks["tgt_mask"].to(dt)
    with torch.no_grad():
        out = model(src.to(device, dt), tgt.to(device, dt), **{k: v.to(device) if torch.is_tensor(v) else v for k, v in masks.items()})
        masks["tgt_mask"] = masks["tgt_mask"].double()
        expected = reference(src, tgt, **masks)
    tol = 1e-4 if dt == torch.float32 else 6e-2
    torch.testing.assert_close(out.double().cpu(), expected, rtol=tol, atol=tol)
