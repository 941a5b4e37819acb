"""The public functional API (one module per op family) and its registered torch ops."""

from fastattn.ops.attention import attention, scaled_dot_product_attention
from fastattn.ops.ffn import ffn
from fastattn.ops.layer_norm import add_layer_norm, layer_norm, rms_norm
from fastattn.ops.rope import rope, rotary_cos_sin
from fastattn.ops.softmax import scaled_masked_softmax
from fastattn.ops.varlen import paged_attention, paged_cache_append, varlen_attention

__all__ = [
    "add_layer_norm",
    "attention",
    "ffn",
    "layer_norm",
    "paged_attention",
    "paged_cache_append",
    "rms_norm",
    "rope",
    "rotary_cos_sin",
    "scaled_dot_product_attention",
    "scaled_masked_softmax",
    "varlen_attention",
]
