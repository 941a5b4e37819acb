"""Float64 NumPy forwards of :mod:`fastattn.models` (the ground truth the tests compare with).

Built from the pieces of :mod:`fastattn.reference` (attention, multi-head attention, the
transformer block, layer norm, the feed-forward network, sinusoidal positions). ``params`` is a
model's ``state_dict`` (tensors or arrays, any dtype), ``config`` its config dataclass, and the
tokens integer arrays. NumPy only; clarity over speed.
"""

from __future__ import annotations

import math

import numpy as np

from fastattn import reference as ref
from fastattn.reference import rope as reference_rope

__all__ = ["gpt_forward", "transformer_decoder_layer", "transformer_forward"]


def _np(params) -> dict[str, np.ndarray]:
    out = {}
    for name, value in params.items():
        if hasattr(value, "detach"):  # a torch tensor: no torch import needed here
            value = value.detach().cpu().double().numpy()
        out[name] = np.asarray(value, dtype=np.float64)
    return out


def _sub(params: dict, prefix: str) -> dict:
    return {name[len(prefix):]: v for name, v in params.items() if name.startswith(prefix)}


def transformer_decoder_layer(x, memory, params, num_heads, norm_first=False, activation="relu", eps=1e-5,
                              tgt_key_padding_mask=None, memory_key_padding_mask=None, tgt_is_causal=True):
    """``torch.nn.TransformerDecoderLayer(batch_first=True, dropout=0)`` forward (state_dict names).

        post-norm:  x = norm1(x + sa(x));  x = norm2(x + ca(x, mem));  x = norm3(x + ff(x))
        pre-norm:   x = x + sa(norm1(x));  x = x + ca(norm2(x), mem);  x = x + ff(norm3(x))

    ``sa`` is causal self-attention (when ``tgt_is_causal``) with the target padding masked;
    ``ca`` attends the memory with its padding masked (bool masks, True = padding).
    """
    E = x.shape[-1]

    def norm(t, i):
        return ref.layer_norm(t, E, params[f"norm{i}.weight"], params.get(f"norm{i}.bias"), eps)[0]

    def sa(t):
        return ref.multi_head_attention(t, t, t, _sub(params, "self_attn."), num_heads,
                                        key_padding_mask=tgt_key_padding_mask, is_causal=tgt_is_causal)

    def ca(t):
        return ref.multi_head_attention(t, memory, memory, _sub(params, "multihead_attn."), num_heads,
                                        key_padding_mask=memory_key_padding_mask)

    def ff(t):
        return ref.ffn(t, params["linear1.weight"], params.get("linear1.bias"),
                       params["linear2.weight"], params.get("linear2.bias"), activation)

    if norm_first:
        x = x + sa(norm(x, 1))
        x = x + ca(norm(x, 2))
        return x + ff(norm(x, 3))
    x = norm(x + sa(x), 1)
    x = norm(x + ca(x), 2)
    return norm(x + ff(x), 3)


def transformer_forward(params, config, src, tgt):
    """Logits (B, T, tgt_vocab) of :class:`fastattn.models.Transformer` in eval mode.

        x = src_embed[src] * sqrt(d) + PE;   x = encoder layers (padding of src masked);
        y = tgt_embed[tgt] * sqrt(d) + PE;   y = decoder layers (causal, padding masked);
        logits = y Wg^T + bg
    with a final LayerNorm after each stack when ``config.norm_first``.
    """
    p = _np(params)
    c = config
    src, tgt = np.asarray(src), np.asarray(tgt)
    d = c.d_model
    src_pad = None if c.pad_id is None else src == c.pad_id
    tgt_pad = None if c.pad_id is None else tgt == c.pad_id

    def embed(table, tokens):
        return table[tokens] * math.sqrt(d) + ref.sinusoidal_positional_encoding(tokens.shape[1], d)

    x = embed(p["src_embed.weight"], src)
    for i in range(c.num_encoder_layers):
        x = ref.transformer_block(x, _sub(p, f"encoder_layers.{i}."), c.nhead, c.norm_first, c.activation,
                                  c.layer_norm_eps, key_padding_mask=src_pad)
    if c.norm_first:
        x = ref.layer_norm(x, d, p["encoder_norm.weight"], p.get("encoder_norm.bias"), c.layer_norm_eps)[0]
    y = embed(p["tgt_embed.weight"], tgt)
    for i in range(c.num_decoder_layers):
        y = transformer_decoder_layer(y, x, _sub(p, f"decoder_layers.{i}."), c.nhead, c.norm_first, c.activation,
                                      c.layer_norm_eps, tgt_pad, src_pad, tgt_is_causal=True)
    if c.norm_first:
        y = ref.layer_norm(y, d, p["decoder_norm.weight"], p.get("decoder_norm.bias"), c.layer_norm_eps)[0]
    return ref.linear(y, p["generator.weight"], p.get("generator.bias"))


def gpt_forward(params, config, idx):
    """Logits (B, T, vocab) of :class:`fastattn.models.GPT` in eval mode.

        x = wte[idx] + wpe[0..T-1]                  (pos="rotary": x = wte[idx], and q, k rotated
                                                     by reference_rope.rope before attention)
        per block:  x = x + c_proj(causal_attention(split_heads(c_attn(ln_1(x)))))
                    x = x + fc2(act(fc1(ln_2(x))))
        logits = ln_f(x) wte^T                      (the head is tied to wte)
    """
    p = _np(params)
    c = config
    idx = np.asarray(idx)
    B, T = idx.shape
    E, H = c.n_embd, c.n_head
    eps = c.layer_norm_eps

    def ln(t, name):
        return ref.layer_norm(t, E, p[f"{name}.weight"], p.get(f"{name}.bias"), eps)[0]

    def heads(t):  # (B, T, E) -> (B, H, T, E / H)
        return t.reshape(B, T, H, E // H).transpose(0, 2, 1, 3)

    rotary = getattr(c, "pos", "learned") == "rotary"
    x = p["transformer.wte.weight"][idx]
    if not rotary:
        x = x + p["transformer.wpe.weight"][:T]
    for i in range(c.n_layer):
        b = f"transformer.h.{i}."
        qkv = ref.linear(ln(x, b + "ln_1"), p[b + "attn.c_attn.weight"], p.get(b + "attn.c_attn.bias"))
        q, k, v = (heads(t) for t in np.split(qkv, 3, axis=-1))
        if rotary:
            q, k = reference_rope.rope(q, base=c.rope_base), reference_rope.rope(k, base=c.rope_base)
        y, _ = ref.attention(q, k, v, causal=True)
        y = y.transpose(0, 2, 1, 3).reshape(B, T, E)
        x = x + ref.linear(y, p[b + "attn.c_proj.weight"], p.get(b + "attn.c_proj.bias"))
        x = x + ref.ffn(ln(x, b + "ln_2"), p[b + "mlp.fc1.weight"], p.get(b + "mlp.fc1.bias"),
                        p[b + "mlp.fc2.weight"], p.get(b + "mlp.fc2.bias"), c.activation)
    return ref.linear(ln(x, "transformer.ln_f"), p["transformer.wte.weight"])
