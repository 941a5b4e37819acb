"""Reference models built from fastattn's modules: the encoder-decoder :class:`Transformer` of
"Attention Is All You Need" and the decoder-only :class:`GPT` (with a KV cache).

Their float64 NumPy forwards, the ground truth in the tests, are in :mod:`fastattn.reference.models`.
"""

from fastattn.models.config import GPTConfig, TransformerConfig
from fastattn.models.gpt import GPT, KVCache
from fastattn.models.transformer import Transformer, sinusoidal_positions

__all__ = ["GPT", "GPTConfig", "KVCache", "Transformer", "TransformerConfig", "sinusoidal_positions"]
