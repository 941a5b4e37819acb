"""The encoder-decoder Transformer of "Attention Is All You Need", on fastattn's modules."""

from __future__ import annotations

import math

import torch
from torch import Tensor

from fastattn.models.config import TransformerConfig
from fastattn.nn.norm import LayerNorm
from fastattn.nn.transformer import TransformerDecoderLayer, TransformerEncoderLayer

__all__ = ["Transformer", "sinusoidal_positions"]


def sinusoidal_positions(length: int, dim: int, dtype=torch.float32, device=None) -> Tensor:
    """``PE[pos, 2i] = sin(pos / 10000^(2i/dim))``, ``PE[pos, 2i+1] = cos(...)``, (length, dim)."""
    pos = torch.arange(length, dtype=torch.float64, device=device)[:, None]
    col = torch.arange(dim, device=device)
    angle = pos / 10000.0 ** ((col - col % 2).to(torch.float64) / dim)
    return torch.where(col % 2 == 0, torch.sin(angle), torch.cos(angle)).to(dtype)


class Transformer(torch.nn.Module):
    """Encoder-decoder Transformer: token embeddings scaled by ``sqrt(d_model)`` plus sinusoidal
    positions, ``num_encoder_layers`` encoder and ``num_decoder_layers`` decoder layers
    (:class:`fastattn.nn.TransformerEncoderLayer` / ``TransformerDecoderLayer``, batch first;
    post-norm, or pre-norm with a final LayerNorm per stack), and a linear ``generator`` to
    target-vocabulary logits. Padding (``config.pad_id``) is masked out of every attention's keys;
    the decoder's self-attention is causal. All kernels run on ``backend``.
    """

    def __init__(self, config: TransformerConfig, *, backend: str | None = None, device=None, dtype=None):
        super().__init__()
        c = self.config = config
        self.backend = backend
        factory = {"device": device, "dtype": dtype}
        self.src_embed = torch.nn.Embedding(c.src_vocab_size, c.d_model, padding_idx=c.pad_id, **factory)
        self.tgt_embed = torch.nn.Embedding(c.tgt_vocab_size, c.d_model, padding_idx=c.pad_id, **factory)
        self.register_buffer(
            "positions", sinusoidal_positions(c.max_len, c.d_model, dtype or torch.get_default_dtype(), device), persistent=False
        )
        self.dropout = torch.nn.Dropout(c.dropout)
        layer = dict(
            d_model=c.d_model, nhead=c.nhead, dim_feedforward=c.dim_feedforward, dropout=c.dropout,
            activation=c.activation, layer_norm_eps=c.layer_norm_eps, batch_first=True,
            norm_first=c.norm_first, bias=c.bias, backend=backend, **factory,
        )
        self.encoder_layers = torch.nn.ModuleList(TransformerEncoderLayer(**layer) for _ in range(c.num_encoder_layers))
        self.decoder_layers = torch.nn.ModuleList(TransformerDecoderLayer(**layer) for _ in range(c.num_decoder_layers))
        if c.norm_first:
            self.encoder_norm = LayerNorm(c.d_model, eps=c.layer_norm_eps, bias=c.bias, backend=backend, **factory)
            self.decoder_norm = LayerNorm(c.d_model, eps=c.layer_norm_eps, bias=c.bias, backend=backend, **factory)
        else:
            self.encoder_norm = self.decoder_norm = None
        self.generator = torch.nn.Linear(c.d_model, c.tgt_vocab_size, bias=c.bias, **factory)
        self.reset_parameters()
        if c.tie_embeddings:
            self.generator.weight = self.tgt_embed.weight

    @classmethod
    def from_config(cls, config: TransformerConfig | dict, **kwargs) -> "Transformer":
        return cls(TransformerConfig.coerce(config), **kwargs)

    def reset_parameters(self) -> None:
        """Xavier-uniform matrices, zero biases, unit norms; the padding embedding is zero."""
        for name, p in self.named_parameters():
            if p.dim() > 1:
                torch.nn.init.xavier_uniform_(p)
            elif name.endswith("bias"):
                torch.nn.init.zeros_(p)
        with torch.no_grad():
            for emb in (self.src_embed, self.tgt_embed):
                if emb.padding_idx is not None:
                    emb.weight[emb.padding_idx].zero_()

    def _embed(self, emb: torch.nn.Embedding, tokens: Tensor) -> Tensor:
        L = tokens.shape[1]
        if L > self.config.max_len:
            raise ValueError(f"sequence of length {L} exceeds config.max_len={self.config.max_len}")
        x = emb(tokens) * math.sqrt(self.config.d_model) + self.positions[:L]
        return self.dropout(x)

    def padding_mask(self, tokens: Tensor) -> Tensor | None:
        """(B, L) bool, True at padding (torch's key_padding_mask meaning); None without pad_id."""
        return None if self.config.pad_id is None else tokens == self.config.pad_id

    def encode(self, src: Tensor, src_padding: Tensor | None = None) -> Tensor:
        """(B, S) tokens -> memory (B, S, d_model). ``src_padding`` defaults to ``src == pad_id``."""
        if src_padding is None:
            src_padding = self.padding_mask(src)
        x = self._embed(self.src_embed, src)
        for layer in self.encoder_layers:
            x = layer(x, src_key_padding_mask=src_padding)
        return x if self.encoder_norm is None else self.encoder_norm(x)

    def decode(
        self, tgt: Tensor, memory: Tensor, src_padding: Tensor | None = None, tgt_padding: Tensor | None = None
    ) -> Tensor:
        """(B, T) target tokens and memory -> decoder states (B, T, d_model), causal."""
        y = self._embed(self.tgt_embed, tgt)
        for layer in self.decoder_layers:
            y = layer(
                y, memory, tgt_key_padding_mask=tgt_padding, memory_key_padding_mask=src_padding, tgt_is_causal=True
            )
        return y if self.decoder_norm is None else self.decoder_norm(y)

    def forward(
        self, src: Tensor, tgt: Tensor, src_padding: Tensor | None = None, tgt_padding: Tensor | None = None
    ) -> Tensor:
        """Logits (B, T, tgt_vocab_size) for source tokens (B, S) and target tokens (B, T).

        The padding masks (True = padding) default to the tokens equal to ``config.pad_id``.
        """
        if src_padding is None:
            src_padding = self.padding_mask(src)
        if tgt_padding is None:
            tgt_padding = self.padding_mask(tgt)
        memory = self.encode(src, src_padding)
        return self.generator(self.decode(tgt, memory, src_padding, tgt_padding))

    @torch.no_grad()
    def greedy_decode(self, src: Tensor, max_len: int, bos_id: int, eos_id: int | None = None) -> Tensor:
        """Greedy decoding: (B, S) source tokens -> (B, <= max_len + 1) target tokens starting with
        ``bos_id``; a sequence that produced ``eos_id`` is padded (``pad_id``, else ``eos_id``)."""
        src_padding = self.padding_mask(src)
        memory = self.encode(src, src_padding)
        out = torch.full((src.shape[0], 1), bos_id, dtype=torch.long, device=src.device)
        done = torch.zeros(src.shape[0], dtype=torch.bool, device=src.device)
        fill = self.config.pad_id if self.config.pad_id is not None else eos_id
        for _ in range(max_len):
            logits = self.generator(self.decode(out, memory, src_padding)[:, -1])
            nxt = logits.argmax(-1)
            if eos_id is not None:
                nxt = torch.where(done, torch.full_like(nxt, fill), nxt)
                done |= nxt == eos_id
            out = torch.cat([out, nxt[:, None]], dim=1)
            if eos_id is not None and bool(done.all()):
                break
        return out
