"""Drop-in modules that run fastattn's kernels."""

from fastattn.nn.attention import MultiheadAttention
from fastattn.nn.ffn import FeedForward
from fastattn.nn.norm import LayerNorm, RMSNorm
from fastattn.nn.softmax import ScaledMaskedSoftmax
from fastattn.nn.transformer import TransformerDecoderLayer, TransformerEncoderLayer
from fastattn.nn.rope import RotaryEmbedding

__all__ = [
    "FeedForward",
    "LayerNorm",
    "MultiheadAttention",
    "RMSNorm",
    "RotaryEmbedding",
    "ScaledMaskedSoftmax",
    "TransformerDecoderLayer",
    "TransformerEncoderLayer",
]
