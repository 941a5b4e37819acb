"""Configuration dataclasses of the reference models."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import Any


class _Config:
    """Shared helpers: ``to_dict`` / ``from_dict`` (unknown keys rejected) and ``replace``."""

    def to_dict(self) -> dict[str, Any]:
        return dataclasses.asdict(self)

    @classmethod
    def from_dict(cls, d: dict[str, Any]):
        names = {f.name for f in dataclasses.fields(cls)}
        unknown = sorted(set(d) - names)
        if unknown:
            raise ValueError(f"unknown {cls.__name__} fields: {unknown}")
        return cls(**d)

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)

    @classmethod
    def coerce(cls, config):
        """``config`` itself, or the config a dict describes (the models' ``from_config``)."""
        return cls.from_dict(config) if isinstance(config, dict) else config


@dataclass
class TransformerConfig(_Config):
    """The encoder-decoder of "Attention Is All You Need" (defaults: the paper's base model).

    ``norm_first=False`` is the paper's post-norm; True gives pre-norm blocks with a final
    LayerNorm after each stack. ``pad_id`` marks padding in source and target (None: no
    padding masks). ``tie_embeddings`` shares the target embedding with the output projection.
    """

    src_vocab_size: int = 32000
    tgt_vocab_size: int = 32000
    d_model: int = 512
    nhead: int = 8
    num_encoder_layers: int = 6
    num_decoder_layers: int = 6
    dim_feedforward: int = 2048
    dropout: float = 0.1
    activation: str = "relu"
    norm_first: bool = False
    layer_norm_eps: float = 1e-5
    bias: bool = True
    max_len: int = 1024
    pad_id: int | None = 0
    tie_embeddings: bool = False

    def __post_init__(self):
        if self.d_model % self.nhead:
            raise ValueError(f"d_model ({self.d_model}) must be divisible by nhead ({self.nhead})")


@dataclass
class GPTConfig(_Config):
    """A GPT-2 style decoder-only model (defaults: GPT-2 small, vocabulary padded to 50304).

    ``activation="gelu_tanh"`` is GPT-2's own; ``mlp_ratio`` sets the hidden width of the MLP.
    ``pos="rotary"`` replaces the learned position embedding (``transformer.wpe``) by rotary
    embeddings (:func:`fastattn.rope`, GPT-NeoX pairs, base ``rope_base``) applied to the queries
    and keys of every layer.
    """

    vocab_size: int = 50304
    block_size: int = 1024
    n_layer: int = 12
    n_head: int = 12
    n_embd: int = 768
    dropout: float = 0.0
    bias: bool = True
    activation: str = "gelu"
    mlp_ratio: int = 4
    layer_norm_eps: float = 1e-5
    pos: str = "learned"
    rope_base: float = 10000.0

    def __post_init__(self):
        if self.n_embd % self.n_head:
            raise ValueError(f"n_embd ({self.n_embd}) must be divisible by n_head ({self.n_head})")
        if self.pos not in ("learned", "rotary"):
            raise ValueError(f"pos must be 'learned' or 'rotary', got {self.pos!r}")
        if self.pos == "rotary" and (self.n_embd // self.n_head) % 2:
            raise ValueError(f"pos='rotary' needs an even head dim, got {self.n_embd // self.n_head}")
