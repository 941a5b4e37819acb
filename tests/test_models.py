"""fastattn.models (Transformer, GPT) against their NumPy forwards (fastattn.reference.models)."""

import math

import pytest
import torch
import torch.nn.functional as F

import fastattn
from fastattn.reference import models as reference_models
from fastattn.models import GPT, GPTConfig, KVCache, Transformer, TransformerConfig
from fastattn.testing import assert_close_to_reference

from conftest import backend_params, dtype_for, same_tol

F64 = torch.float64
BACKENDS = backend_params("attention")

TCONF = TransformerConfig(
    src_vocab_size=11, tgt_vocab_size=13, d_model=16, nhead=2, num_encoder_layers=2, num_decoder_layers=2,
    dim_feedforward=32, dropout=0.1, max_len=16,
)
GCONF = GPTConfig(vocab_size=17, block_size=8, n_layer=2, n_head=2, n_embd=16, dropout=0.1)


pytestmark = pytest.mark.usefixtures("one_thread")


def _tokens(shape, vocab, seed=0, low=1):
    return torch.randint(low, vocab, shape, generator=torch.Generator().manual_seed(seed))


def _src_tgt():
    src, tgt = _tokens((2, 6), 11), _tokens((2, 5), 13, seed=1)
    src[1, 4:] = 0  # padding
    tgt[0, 3:] = 0
    return src, tgt


def _sharpen(model, scale=3.0):
    """Larger weights than the init, so greedy decoding has no near-ties to flip on rounding."""
    with torch.no_grad():
        for p in model.parameters():
            p.mul_(scale)
    return model


# ---------------------------------------------------------------------------------------------
# Transformer (encoder-decoder)


@pytest.mark.parametrize("norm_first", [False, True])
@pytest.mark.parametrize("activation", ["relu", "gelu"])
def test_transformer_matches_numpy(norm_first, activation):
    torch.manual_seed(0)
    config = TCONF.replace(norm_first=norm_first, activation=activation)
    model = Transformer(config, backend="naive", dtype=F64).eval()
    assert (model.encoder_norm is not None) == norm_first
    src, tgt = _src_tgt()
    logits = model(src, tgt)
    assert logits.shape == (2, 5, 13)
    ref = reference_models.transformer_forward(model.state_dict(), config, src.numpy(), tgt.numpy())
    assert_close_to_reference(logits, ref)


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_transformer_backends(backend, device):
    torch.manual_seed(0)
    config = TCONF.replace(norm_first=True, tie_embeddings=True)
    dt = dtype_for("attention", backend, device)  # (bfloat16 where float32 is refused)
    model = Transformer(config, backend=backend, device=device, dtype=dt).eval()
    assert model.generator.weight is model.tgt_embed.weight
    src, tgt = _src_tgt()
    with torch.no_grad():
        logits = model(src.to(device), tgt.to(device))
    ref = reference_models.transformer_forward(model.state_dict(), config, src.numpy(), tgt.numpy())
    assert_close_to_reference(logits, ref, atol=1e-4 if dt == torch.float32 else None)


def test_transformer_padding_and_causality():
    """Padding is invisible: trimming the source padding leaves the logits unchanged; the decoder
    is causal: changing a later target token leaves earlier logits unchanged."""
    torch.manual_seed(0)
    model = Transformer(TCONF, backend="naive", dtype=F64).eval()
    src, tgt = _src_tgt()
    full = model(src, tgt)
    trimmed = model(src[1:, :4], tgt[1:])
    torch.testing.assert_close(full[1:], trimmed, rtol=0, atol=1e-12)
    tgt2 = tgt.clone()
    tgt2[:, 3] = 7
    changed = model(src, tgt2)
    torch.testing.assert_close(changed[:, :3], full[:, :3], rtol=0, atol=1e-12)
    assert (changed[1, 3:] - full[1, 3:]).abs().max() > 1e-6


def test_transformer_config_and_training_step():
    config = TransformerConfig.from_dict(TCONF.to_dict())
    assert config == TCONF
    with pytest.raises(ValueError, match="unknown"):
        TransformerConfig.from_dict({"d_model": 8, "heads": 2})
    with pytest.raises(ValueError, match="divisible"):
        TransformerConfig(d_model=10, nhead=4)
    torch.manual_seed(0)
    model = Transformer.from_config(config.to_dict(), backend="naive")
    assert model.src_embed.weight[0].abs().sum() == 0  # padding embedding
    src, tgt = _src_tgt()
    opt = torch.optim.Adam(model.parameters(), lr=2e-2)
    losses = []
    for _ in range(5):
        logits = model(src, tgt[:, :-1])
        loss = F.cross_entropy(logits.reshape(-1, 13), tgt[:, 1:].reshape(-1), ignore_index=0)
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] * 0.8
    out = model.eval().greedy_decode(src, max_len=4, bos_id=1, eos_id=2)
    assert out.shape[0] == 2 and out.shape[1] <= 5 and (out[:, 0] == 1).all()


# ---------------------------------------------------------------------------------------------
# GPT


def test_gpt_matches_numpy_and_init():
    torch.manual_seed(0)
    model = GPT(GCONF.replace(activation="gelu_tanh"), backend="naive", dtype=F64).eval()
    assert model.lm_head.weight is model.transformer.wte.weight
    # GPT-2 init: residual projections have std 0.02 / sqrt(2 * n_layer)
    std = torch.cat([b.attn.c_proj.weight.flatten() for b in model.transformer.h]).std().item()
    assert abs(std - 0.02 / math.sqrt(4)) < 0.003
    idx = _tokens((2, 7), 17, low=0)
    logits, loss = model(idx)
    assert loss is None and logits.shape == (2, 7, 17)
    ref = reference_models.gpt_forward(model.state_dict(), model.config, idx.numpy())
    assert_close_to_reference(logits, ref)
    _, loss = model(idx, idx)
    torch.testing.assert_close(loss, F.cross_entropy(logits.reshape(-1, 17).float(), idx.reshape(-1)).to(loss.dtype))


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_gpt_backends(backend, device):
    torch.manual_seed(0)
    dt = dtype_for("attention", backend, device)  # (bfloat16 where float32 is refused)
    model = GPT(GCONF, backend=backend, device=device, dtype=dt).eval()
    idx = _tokens((2, 6), 17, low=0)
    with torch.no_grad():
        logits, _ = model(idx.to(device))
    ref = reference_models.gpt_forward(model.state_dict(), GCONF, idx.numpy())
    assert_close_to_reference(logits, ref, atol=1e-4 if dt == torch.float32 else None)
    # Decoding with the cache: the logits of each new token equal those of the full recomputation.
    cache = model.new_cache(2)
    with torch.no_grad():
        prefill, _ = model(idx[:, :4].to(device), cache=cache)
        step, _ = model(idx[:, 4:5].to(device), cache=cache)
    assert cache.length == 5
    tol = same_tol(dt)
    torch.testing.assert_close(prefill, logits[:, :4], **tol)
    torch.testing.assert_close(step[:, 0], logits[:, 4], **tol)


def test_gpt_generate_with_cache_equals_recompute():
    """Greedy generation with the KV cache equals recomputing the whole context every step,
    also past block_size (where the window slides); decode steps call fastattn.attention with one
    query and causal="bottom_right"."""
    torch.manual_seed(0)
    model = _sharpen(GPT(GCONF, backend="naive", dtype=F64).eval())
    prompt = _tokens((2, 3), 17, low=0)
    calls = []
    real = fastattn.models.gpt.attention
    try:
        fastattn.models.gpt.attention = lambda q, k, v, *a, **kw: calls.append((q.shape[2], k.shape[2], kw["causal"])) or real(q, k, v, *a, **kw)
        cached = model.generate(prompt, 8, greedy=True)
    finally:
        fastattn.models.gpt.attention = real
    recomputed = model.generate(prompt, 8, greedy=True, use_cache=False)
    assert cached.shape == (2, 11) and torch.equal(cached[:, :3], prompt)
    assert torch.equal(cached, recomputed)
    # token by token, by hand, without any cache
    idx = prompt
    for _ in range(8):
        logits, _ = model(idx[:, -GCONF.block_size:])
        idx = torch.cat([idx, logits[:, -1].argmax(-1, keepdim=True)], dim=1)
    assert torch.equal(cached, idx)
    assert calls[:2] == [(3, 3, "bottom_right")] * 2  # prefill, both layers
    assert (1, 4, "bottom_right") in calls and (1, 8, "bottom_right") in calls  # decode steps
    assert len(set(cached[0].tolist())) > 1


def test_gpt_sampling_and_cache_limits():
    torch.manual_seed(0)
    model = GPT(GCONF, backend="naive").eval()
    prompt = _tokens((1, 2), 17, low=0)
    greedy = model.generate(prompt, 5, greedy=True)
    top1 = model.generate(prompt, 5, temperature=0.7, top_k=1)
    assert torch.equal(greedy, top1)
    g1, g2 = torch.Generator().manual_seed(3), torch.Generator().manual_seed(3)
    assert torch.equal(model.generate(prompt, 6, generator=g1), model.generate(prompt, 6, generator=g2))
    cache = KVCache(2, 1, 2, 3, 8)
    model(prompt, cache=cache)
    with pytest.raises(ValueError, match="overflow"):
        model(prompt, cache=cache)
    with pytest.raises(ValueError, match="block_size"):
        model(_tokens((1, 9), 17, low=0))


def test_gpt_training_step_with_dropout():
    torch.manual_seed(0)
    model = GPT(GCONF, backend="naive")
    idx = _tokens((4, 8), 17, low=0)
    opt = torch.optim.AdamW(model.parameters(), lr=3e-3)
    losses = []
    for _ in range(10):
        _, loss = model(idx[:, :-1], idx[:, 1:])
        opt.zero_grad()
        loss.backward()
        opt.step()
        losses.append(loss.item())
    assert losses[-1] < losses[0] - 0.1
    model.eval()
    a, _ = model(idx)
    b, _ = model(idx)
    assert torch.equal(a, b)  # no dropout in eval


# ---------------------------------------------------------------------------------------------
# Data parallel: 2 processes (gloo, CPU) give the gradients of one process on the whole batch


def _ddp_worker(rank, world, init_file, out_dir):
    import torch.distributed as dist
    from torch.nn.parallel import DistributedDataParallel

    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{init_file}", rank=rank, world_size=world)
    try:
        torch.manual_seed(0)
        model = GPT(GCONF.replace(dropout=0.0), backend="naive", dtype=F64)
        ddp = DistributedDataParallel(model)
        idx = _tokens((4, 8), 17, low=0)
        part = idx.chunk(world)[rank]
        _, loss = ddp(part[:, :-1], part[:, 1:])
        loss.backward()
        torch.save({n: p.grad for n, p in model.named_parameters()}, f"{out_dir}/grads{rank}.pt")
    finally:
        dist.destroy_process_group()


def test_ddp_gradients_equal_single_process(tmp_path):
    import torch.distributed as dist
    import torch.multiprocessing as mp

    if not dist.is_available() or not dist.is_gloo_available():
        pytest.skip("torch.distributed with gloo is not available")
    mp.spawn(_ddp_worker, args=(2, str(tmp_path / "rendezvous"), str(tmp_path)), nprocs=2, join=True)
    torch.manual_seed(0)
    model = GPT(GCONF.replace(dropout=0.0), backend="naive", dtype=F64)
    idx = _tokens((4, 8), 17, low=0)
    _, loss = model(idx[:, :-1], idx[:, 1:])
    loss.backward()
    for rank in range(2):
        grads = torch.load(tmp_path / f"grads{rank}.pt")
        assert set(grads) == {n for n, _ in model.named_parameters()}
        for name, p in model.named_parameters():
            torch.testing.assert_close(grads[name], p.grad, rtol=1e-10, atol=1e-12, msg=f"rank {rank} grad {name}")


# Rotary positions (fastattn.rope) in the GPT


@pytest.mark.parametrize("backend", ["naive", None])
def test_gpt_rotary_matches_reference_and_decodes_with_the_cache(backend):
    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=64, block_size=32, n_layer=2, n_head=2, n_embd=32, pos="rotary")
    model = GPT(cfg, backend=backend).eval()
    assert "transformer.wpe.weight" not in model.state_dict()
    idx = torch.randint(0, 64, (2, 12))
    logits, _ = model(idx)
    ref = reference_models.gpt_forward(model.state_dict(), cfg, idx.numpy())
    assert_close_to_reference(logits, ref, name="logits")
    cache = model.new_cache(2)
    steps = torch.cat([model(idx[:, t:t + 1], cache=cache)[0] for t in range(12)], dim=1)
    torch.testing.assert_close(steps, logits, atol=1e-5, rtol=1e-5)
    out = model.generate(idx[:, :4], 20, greedy=True)  # past block_size: the window is recomputed
    assert torch.equal(out, model.generate(idx[:, :4], 20, greedy=True, use_cache=False))
    model.num_parameters()
    with pytest.raises(ValueError, match="pos"):
        GPTConfig(pos="alibi")


def test_gpt_rotary_bf16_cast_keeps_tables():
    cfg = GPTConfig(vocab_size=64, block_size=16, n_layer=1, n_head=2, n_embd=32, pos="rotary")
    model = GPT(cfg, backend="naive").to(torch.bfloat16).eval()
    logits, _ = model(torch.randint(0, 64, (1, 16)))
    assert logits.dtype == torch.bfloat16 and model.transformer.h[0].attn.rotary.cos.dtype == torch.float32
