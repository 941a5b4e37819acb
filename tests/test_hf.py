"""fastattn.swap on Hugging Face transformers models: each family, built tiny from its config
class (no downloads), float32, on the C++ cpu backend (naive where it is missing). Logits, every
parameter's gradient and greedy generation equal the model's own eager implementation; the
state_dict round-trips; unswap restores the classes and the modeling module's rotary function."""

import copy

import pytest
import torch

import fastattn
from fastattn import hf, swapping
from fastattn.swapping import swap, unswap

pytestmark = pytest.mark.usefixtures("one_thread")

tf = pytest.importorskip("transformers", minversion="5.0")
BACKEND = "cpu" if fastattn.backend_status()["cpu"] is None else "naive"
V, L = 64, 9
TOL = dict(rtol=2e-4, atol=2e-5)  # float32: eager and fastattn round differently

_DECODER = dict(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, max_position_embeddings=64, pad_token_id=0, bos_token_id=1, eos_token_id=2)

# name: (config, model class, {original class: (count, what it becomes)} expected in the report)
FAMILIES = {
    "llama": (lambda: tf.LlamaConfig(**_DECODER), tf.LlamaForCausalLM,
              {"LlamaRMSNorm": 5, "LlamaMLP": 2, "LlamaAttention": 2}),
    "mistral": (lambda: tf.MistralConfig(**_DECODER, sliding_window=4), tf.MistralForCausalLM,
                {"MistralRMSNorm": 5, "MistralMLP": 2, "MistralAttention": 2}),
    "qwen2": (lambda: tf.Qwen2Config(**_DECODER), tf.Qwen2ForCausalLM,
              {"Qwen2RMSNorm": 5, "Qwen2MLP": 2, "Qwen2Attention": 2}),
    "qwen3": (lambda: tf.Qwen3Config(**_DECODER, head_dim=8), tf.Qwen3ForCausalLM,
              {"Qwen3RMSNorm": 9, "Qwen3MLP": 2, "Qwen3Attention": 2}),  # + q_norm, k_norm per layer
    "gemma": (lambda: tf.GemmaConfig(**_DECODER, head_dim=8), tf.GemmaForCausalLM,
              {"GemmaRMSNorm": 5, "GemmaAttention": 2}),
    "gemma2": (lambda: tf.Gemma2Config(**_DECODER, head_dim=8, attn_logit_softcapping=None, sliding_window=4,
                                       query_pre_attn_scalar=8), tf.Gemma2ForCausalLM,
               {"Gemma2RMSNorm": 9, "Gemma2Attention": 2}),
    "gemma3": (lambda: tf.Gemma3TextConfig(**_DECODER, head_dim=8, sliding_window=4, query_pre_attn_scalar=8),
               tf.Gemma3ForCausalLM, {"Gemma3RMSNorm": 13, "Gemma3Attention": 2}),
    "phi3": (lambda: tf.Phi3Config(**{**_DECODER, "pad_token_id": 0},
                                   rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "partial_rotary_factor": 0.5}),
             tf.Phi3ForCausalLM, {"Phi3RMSNorm": 5, "Phi3MLP": 2, "Phi3Attention": 2}),
    "gpt2": (lambda: tf.GPT2Config(vocab_size=V, n_positions=64, n_embd=32, n_layer=2, n_head=4, bos_token_id=1,
                                   eos_token_id=2, pad_token_id=0), tf.GPT2LMHeadModel,
             {"torch.nn.LayerNorm": 5, "GPT2MLP": 2}),
    "gpt_neox": (lambda: tf.GPTNeoXConfig(vocab_size=V, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
                                          num_attention_heads=4, max_position_embeddings=64, bos_token_id=1,
                                          eos_token_id=2, pad_token_id=0), tf.GPTNeoXForCausalLM,
                 {"torch.nn.LayerNorm": 5, "GPTNeoXMLP": 2, "GPTNeoXAttention": 2}),  # partial rotary (0.25)
    "bert": (lambda: tf.BertConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                   intermediate_size=48, max_position_embeddings=64), tf.BertForMaskedLM,
             {"torch.nn.LayerNorm": 6}),
    "roberta": (lambda: tf.RobertaConfig(vocab_size=V, hidden_size=32, num_hidden_layers=2, num_attention_heads=4,
                                         intermediate_size=48, max_position_embeddings=64, pad_token_id=1),
                tf.RobertaForMaskedLM, {"torch.nn.LayerNorm": 6}),
}
DECODERS = [n for n in FAMILIES if n not in ("bert", "roberta")]


def _label(cls_name):
    return cls_name if cls_name.startswith("torch.") else f"transformers.{cls_name}"


def _models(name):
    make, cls, _ = FAMILIES[name]
    torch.manual_seed(0)
    eager = cls._from_config(make(), attn_implementation="eager").eval()
    with torch.no_grad():  # norms start at 1 (Gemma's at 0); perturb them so their weights matter
        for n, p in eager.named_parameters():
            if "norm" in n.lower() and p.dim() == 1:
                p.add_(0.1 * torch.randn_like(p))
    return eager, copy.deepcopy(eager)


def _batch():
    g = torch.Generator().manual_seed(1)
    ids = torch.randint(3, V, (2, L), generator=g)
    mask = torch.ones(2, L, dtype=torch.long)
    mask[1, 6:] = 0  # right padding: every query row still has keys
    return ids, mask


def _logits_and_grads(model, ids, mask):
    model.zero_grad(set_to_none=True)
    logits = model(input_ids=ids, attention_mask=mask).logits
    (logits[mask.bool()].square().mean()).backward()
    return logits.detach(), {n: p.grad for n, p in model.named_parameters()}


@pytest.mark.parametrize("name", list(FAMILIES))
def test_family_matches_eager(name):
    eager, model = _models(name)
    rotary_before = {m: getattr(__import__(m, fromlist=["x"]), "apply_rotary_pos_emb", None)
                     for m in {type(x).__module__ for x in model.modules()}}
    keys = list(model.state_dict())
    report = swap(model, backend=BACKEND)

    expected = {_label(k): v for k, v in FAMILIES[name][2].items()}
    assert report.counts == expected, str(report)
    assert report.hf_attention == f"fastattn_{BACKEND}" and model.config._attn_implementation == report.hf_attention
    assert list(model.state_dict()) == keys
    text = str(report)
    if name in ("gemma", "gemma2", "gemma3"):
        assert "left: gated tanh-GELU" in text  # GeGLU with tanh GELU: no fused activation
        assert "(1 + weight)" in text

    ids, mask = _batch()
    calls = []
    real = hf.attention
    hf.attention = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        out, grads = _logits_and_grads(model, ids, mask)
    finally:
        hf.attention = real
    assert len(calls) == 2  # every layer's attention ran on fastattn
    ref, ref_grads = _logits_and_grads(eager, ids, mask)
    torch.testing.assert_close(out[mask.bool()], ref[mask.bool()], **TOL)
    for n, g in ref_grads.items():
        if g is None:
            assert grads[n] is None, n
        else:
            torch.testing.assert_close(grads[n], g, rtol=1e-3, atol=1e-5, msg=lambda m: f"grad {n}: {m}")

    if name in DECODERS:
        kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
        with torch.no_grad():
            generated = model.generate(ids[:, :6], attention_mask=mask[:, :6], **kw)
            assert torch.equal(generated, eager.generate(ids[:, :6], attention_mask=mask[:, :6], **kw))

    # state_dict round trip: the swapped model loads the original's and saves the same tensors
    state = model.state_dict()
    assert all(torch.equal(state[k], v) for k, v in eager.state_dict().items())
    fresh = copy.deepcopy(model)
    fresh.load_state_dict(eager.state_dict())

    restored = unswap(model)
    assert len(restored) == len(report)
    assert model.config._attn_implementation == "eager"
    assert not any(getattr(type(m), "_fastattn_spec", None) for m in model.modules())
    assert [type(m) for m in model.modules()] == [type(m) for m in eager.modules()]
    if name in ("llama", "gpt_neox"):  # a copy of a swapped model runs fastattn's rope too
        with torch.no_grad():
            torch.testing.assert_close(fresh(input_ids=ids, attention_mask=mask).logits, out, rtol=0, atol=0)
        unswap(fresh)
    for mod, fn in rotary_before.items():
        assert getattr(__import__(mod, fromlist=["x"]), "apply_rotary_pos_emb", None) is fn
    with torch.no_grad():
        torch.testing.assert_close(model(input_ids=ids, attention_mask=mask).logits, ref, rtol=0, atol=0)


@pytest.mark.parametrize("name", ["llama", "gemma3"])
def test_bfloat16_within_a_few_ulps(name):
    """bfloat16 weights and activations: fastattn rounds once where eager rounds between steps."""
    eager, model = _models(name)
    eager, model = eager.to(torch.bfloat16), model.to(torch.bfloat16)
    swap(model, backend=BACKEND)
    ids, mask = _batch()
    with torch.no_grad():
        out = model(input_ids=ids, attention_mask=mask).logits
        ref = eager(input_ids=ids, attention_mask=mask).logits
    assert out.dtype == ref.dtype == torch.bfloat16
    torch.testing.assert_close(out[mask.bool()].float(), ref[mask.bool()].float(), rtol=2e-2, atol=2e-2)


def test_gemma2_softcapping_keeps_attention_and_says_why():
    config = tf.Gemma2Config(**_DECODER, head_dim=8, query_pre_attn_scalar=8)  # attn_logit_softcapping=50
    model = tf.Gemma2ForCausalLM._from_config(config, attn_implementation="eager")
    report = swap(model, backend=BACKEND)
    assert report.hf_attention is None and model.config._attn_implementation == "eager"
    assert "attention stays 'eager': attn_logit_softcapping=50.0" in str(report)
    assert report.counts["transformers.Gemma2RMSNorm"] == 9
    unswap(model)


def test_unknown_family_is_reported_and_flags_are_honoured():
    config = tf.LlamaConfig(**_DECODER)
    model = tf.LlamaForCausalLM._from_config(config, attn_implementation="eager")
    report = swap(model, backend=BACKEND, layer_norm=False, rope=False, attention=False)
    assert report.counts == {"transformers.LlamaMLP": 2} and report.hf_attention is None
    unswap(model)
    row = hf.FAMILIES.pop("llama")
    try:
        report = swap(model, backend=BACKEND)
        assert report.counts == {} and "model_type 'llama' has no row in fastattn.hf.FAMILIES" in str(report)
        assert report.hf_attention == f"fastattn_{BACKEND}"
    finally:
        hf.FAMILIES["llama"] = row
        unswap(model)


def test_activation_is_identified_by_value():
    from transformers.activations import ACT2FN

    assert [hf.activation_of(ACT2FN[n]) for n in ("silu", "gelu", "gelu_new", "gelu_pytorch_tanh", "relu")] == [
        "silu", "gelu", "gelu_tanh", "gelu_tanh", None]


def test_rope_hf_matches_transformers_partial_and_batched_tables():
    from transformers.models.gpt_neox.modeling_gpt_neox import apply_rotary_pos_emb

    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 3, 5, 16, generator=g, dtype=torch.float64)
    freqs = torch.randn(2, 5, 4, generator=g, dtype=torch.float64)
    cos, sin = torch.cat([freqs, freqs], -1).cos(), torch.cat([freqs, freqs], -1).sin()  # R = 8 of D = 16
    expected, _ = apply_rotary_pos_emb(q, q, cos, sin)
    torch.testing.assert_close(hf.rope_hf(q, cos, sin, backend="naive"), expected, rtol=0, atol=1e-12)
    out = hf.rope_hf(q.transpose(1, 2), cos, sin, 2, backend="naive")
    torch.testing.assert_close(out, expected.transpose(1, 2), rtol=0, atol=1e-12)
    expected, _ = apply_rotary_pos_emb(q, q, cos[:1], sin[:1])
    torch.testing.assert_close(hf.rope_hf(q, cos[:1], sin[:1], backend="naive"), expected, rtol=0, atol=1e-12)


# ---------------------------------------------------------------------------------------------
# The registered attention function on its own (attn_implementation="fastattn").


def test_hf_attention_function_matches_sdpa():
    """The registered function itself against transformers' sdpa integration: GQA, bool and
    float masks, causal without a mask, dropout off, scaling."""
    from transformers.integrations.sdpa_attention import sdpa_attention_forward

    g = torch.Generator().manual_seed(0)
    module = torch.nn.Module()
    module.is_causal, module.num_key_value_groups = True, 2
    q = torch.randn(2, 4, 5, 8, generator=g, dtype=torch.float64)
    k, v = torch.randn(2, 2, 5, 8, generator=g, dtype=torch.float64), torch.randn(2, 2, 5, 8, generator=g, dtype=torch.float64)
    bool_mask = torch.rand(2, 1, 5, 5, generator=g) < 0.7
    bool_mask[..., 0] = True
    for mask in (None, bool_mask, torch.randn(2, 1, 5, 5, generator=g, dtype=torch.float64)):
        out, w = swapping.hf_attention_forward(module, q, k, v, mask, scaling=0.3, backend="naive")
        expected, _ = sdpa_attention_forward(module, q, k, v, mask, scaling=0.3)
        assert w is None and out.shape == (2, 5, 4, 8)
        torch.testing.assert_close(out, expected, rtol=0, atol=1e-12)
    with pytest.raises(ValueError, match="softcap"):
        swapping.hf_attention_forward(module, q, k, v, None, softcap=1.0)


def test_from_config_with_attn_implementation_fastattn():
    """register_hf() then attn_implementation="fastattn": equal to sdpa, float64, generation too."""
    fastattn.register_hf()
    make, cls, _ = FAMILIES["llama"]
    torch.manual_seed(0)
    sdpa = cls._from_config(make(), attn_implementation="sdpa", dtype=torch.float64).eval()
    ours = cls._from_config(make(), attn_implementation="fastattn", dtype=torch.float64).eval()
    ours.load_state_dict(sdpa.state_dict())
    ids, mask = _batch()
    with torch.no_grad(), fastattn.use_backend("naive"):
        torch.testing.assert_close(ours(input_ids=ids, attention_mask=mask).logits[mask.bool()],
                                   sdpa(input_ids=ids, attention_mask=mask).logits[mask.bool()], rtol=0, atol=1e-10)
        kw = dict(max_new_tokens=4, do_sample=False, pad_token_id=0)
        assert torch.equal(ours.generate(ids[:, :6], **kw), sdpa.generate(ids[:, :6], **kw))
