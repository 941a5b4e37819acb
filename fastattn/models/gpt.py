"""A GPT-2 style decoder-only language model on fastattn's kernels, with a KV cache for generation."""

from __future__ import annotations

import math

import torch
import torch.nn.functional as F
from torch import Tensor

from fastattn.models.config import GPTConfig
from fastattn.nn.ffn import FeedForward, active_dropout
from fastattn.nn.norm import LayerNorm
from fastattn.ops.attention import attention
from fastattn.nn.rope import RotaryEmbedding
from fastattn.ops.varlen import paged_attention, paged_cache_append, varlen_attention

__all__ = ["GPT", "KVCache", "PagedKVCache"]


class KVCache:
    """Keys and values of every layer for ``length`` positions, preallocated to ``capacity``.

    ``k[i]`` / ``v[i]`` are layer ``i``'s (B, H, capacity, head_dim) buffers; a forward pass over
    T new tokens writes positions ``length .. length + T - 1`` in every layer, then advances
    ``length`` by T.
    """

    def __init__(self, n_layer: int, batch: int, n_head: int, capacity: int, head_dim: int, *, device=None, dtype=None):
        shape = (batch, n_head, capacity, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layer)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layer)]
        self.capacity = capacity
        self.length = 0

    def update(self, layer: int, k: Tensor, v: Tensor) -> tuple[Tensor, Tensor]:
        """Store layer ``layer``'s new (B, H, T, D) keys and values; return all keys and values so far."""
        start, end = self.length, self.length + k.shape[2]
        if end > self.capacity:
            raise ValueError(f"KV cache overflow: {end} positions > capacity {self.capacity}")
        self.k[layer][:, :, start:end] = k
        self.v[layer][:, :, start:end] = v
        return self.k[layer][:, :, :end], self.v[layer][:, :, :end]


class PagedKVCache:
    """Keys and values of every layer in fixed-size blocks (vLLM-style), for a batch of sequences
    of different lengths.

    ``k[i]`` / ``v[i]`` are layer ``i``'s (num_blocks, block_size, H, head_dim) pools;
    ``block_table`` (B, blocks per row) int32 lists each sequence's blocks in order (here row
    ``b`` owns blocks ``b, b + B, b + 2B, ...``: interleaved, to show that the order is the
    table's, not memory's); ``seqlens`` (B,) int32 counts each sequence's cached positions.
    A forward pass appends its tokens' keys in every layer (:func:`fastattn.paged_cache_append`),
    then advances ``seqlens``.
    """

    def __init__(self, n_layer: int, batch: int, n_head: int, capacity: int, head_dim: int, *,
                 block_size: int = 16, device=None, dtype=None):
        per_row = -(-capacity // block_size)
        shape = (batch * per_row, block_size, n_head, head_dim)
        self.k = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layer)]
        self.v = [torch.zeros(shape, device=device, dtype=dtype) for _ in range(n_layer)]
        self.block_table = torch.arange(batch * per_row, dtype=torch.int32, device=device).view(per_row, batch).T.contiguous()
        self.seqlens = torch.zeros(batch, dtype=torch.int32, device=device)
        self.capacity = per_row * block_size

    def append(self, layer: int, k: Tensor, v: Tensor, cu_seqlens: Tensor | None = None) -> None:
        """Store layer ``layer``'s new keys and values: (B, H, T, D) with T per sequence, or packed
        (total, H, D) with ``cu_seqlens`` giving each sequence's tokens."""
        if cu_seqlens is None:
            paged_cache_append(self.k[layer], self.v[layer], self.block_table, self.seqlens, k, v)
            return
        bounds = cu_seqlens.tolist()
        for b in range(len(bounds) - 1):
            rows = slice(bounds[b], bounds[b + 1])
            paged_cache_append(self.k[layer], self.v[layer], self.block_table[b:b + 1], self.seqlens[b:b + 1],
                               k[rows].transpose(0, 1)[None], v[rows].transpose(0, 1)[None])


class CausalSelfAttention(torch.nn.Module):
    """Causal multi-head self-attention: ``c_attn`` (fused q, k, v projection), fastattn's
    attention, ``c_proj``. With a cache the new queries attend every cached key
    (``causal="bottom_right"``). With ``config.pos == "rotary"`` the queries and keys are rotated
    (:class:`fastattn.nn.RotaryEmbedding`) at their positions before the cache stores them."""

    def __init__(self, config: GPTConfig, backend: str | None = None, device=None, dtype=None):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        self.n_head = config.n_head
        self.dropout = config.dropout
        self.backend = backend
        self.c_attn = torch.nn.Linear(config.n_embd, 3 * config.n_embd, bias=config.bias, **factory)
        self.c_proj = torch.nn.Linear(config.n_embd, config.n_embd, bias=config.bias, **factory)
        self.resid_dropout = torch.nn.Dropout(config.dropout)
        self.rotary = None
        if config.pos == "rotary":
            self.rotary = RotaryEmbedding(
                config.n_embd // config.n_head, config.block_size, config.rope_base, backend=backend, device=device
            )

    def forward(self, x: Tensor, cache: KVCache | PagedKVCache | None = None, layer: int = 0,
                positions: Tensor | None = None, cu_seqlens: Tensor | None = None) -> Tensor:
        B, T, C = x.shape
        # (B, T, 3, H, D) -> three (B, H, T, D) views, in two calls (indexing costs more)
        q, k, v = self.c_attn(x).view(B, T, 3, self.n_head, C // self.n_head).permute(2, 0, 3, 1, 4).unbind(0)
        if isinstance(cache, PagedKVCache):
            y = self._paged(q, k, v, cache, layer, positions, cu_seqlens).reshape(B, T, C)
            return active_dropout(self.resid_dropout, self.c_proj(y))
        if self.rotary is not None:
            start = 0 if cache is None else cache.length
            q, k = self.rotary(q, offset=start), self.rotary(k, offset=start)
        if cache is not None:
            k, v = cache.update(layer, k, v)
        y = attention(
            q, k, v, causal="bottom_right", dropout_p=self.dropout if self.training else 0.0, backend=self.backend
        )
        return active_dropout(self.resid_dropout, self.c_proj(y.transpose(1, 2).reshape(B, T, C)))

    def _paged(self, q, k, v, cache, layer, positions, cu_seqlens):
        """Attention on a paged cache, (B, T, H, D) out. Packed prefill (``cu_seqlens``; x is
        (1, total, C)): causal attention within each prompt (:func:`fastattn.varlen_attention`).
        Decoding (x (B, T, C)): the new tokens attend their row's cached keys
        (:func:`fastattn.paged_attention`). Either way the keys are appended to the cache first."""
        if self.rotary is not None:
            q, k = self.rotary(q, positions=positions), self.rotary(k, positions=positions)
        if cu_seqlens is not None:
            q, k, v = (t[0].transpose(0, 1) for t in (q, k, v))  # (total, H, D)
            cache.append(layer, k, v, cu_seqlens)
            return varlen_attention(q, k, v, cu_seqlens, cu_seqlens, causal=True, backend=self.backend)
        cache.append(layer, k, v)
        y = paged_attention(q, cache.k[layer], cache.v[layer], cache.block_table, cache.seqlens + q.shape[2],
                            backend=self.backend)
        return y.transpose(1, 2)


class Block(torch.nn.Module):
    """Pre-norm transformer block: ``x + attn(ln_1(x))``, then ``x + mlp(ln_2(x))``."""

    def __init__(self, config: GPTConfig, backend: str | None = None, device=None, dtype=None):
        super().__init__()
        factory = {"device": device, "dtype": dtype}
        norm = dict(eps=config.layer_norm_eps, bias=config.bias, backend=backend, **factory)
        self.ln_1 = LayerNorm(config.n_embd, **norm)
        self.attn = CausalSelfAttention(config, backend, **factory)
        self.ln_2 = LayerNorm(config.n_embd, **norm)
        self.mlp = FeedForward(
            config.n_embd, config.mlp_ratio * config.n_embd, config.activation, bias=config.bias,
            dropout=config.dropout, backend=backend, **factory,
        )

    def forward(self, x: Tensor, cache: KVCache | PagedKVCache | None = None, layer: int = 0,
                positions: Tensor | None = None, cu_seqlens: Tensor | None = None) -> Tensor:
        x = x + self.attn(self.ln_1(x), cache, layer, positions, cu_seqlens)
        return x + self.mlp(self.ln_2(x))


class GPT(torch.nn.Module):
    """GPT-2 style language model: learned token (``transformer.wte``) and position
    (``transformer.wpe``) embeddings, ``n_layer`` pre-norm blocks ``transformer.h``, a final
    ``transformer.ln_f`` and ``lm_head`` tied to ``wte``; GPT-2 initialization (normal(0, 0.02),
    residual projections scaled by ``1/sqrt(2 * n_layer)``). All kernels run on ``backend``.
    """

    def __init__(self, config: GPTConfig, *, backend: str | None = None, device=None, dtype=None):
        super().__init__()
        self.config = config
        self.backend = backend
        factory = {"device": device, "dtype": dtype}
        modules = {"wte": torch.nn.Embedding(config.vocab_size, config.n_embd, **factory)}
        if config.pos == "learned":  # rotary positions live in the attention layers instead
            modules["wpe"] = torch.nn.Embedding(config.block_size, config.n_embd, **factory)
        modules.update(
            drop=torch.nn.Dropout(config.dropout),
            h=torch.nn.ModuleList(Block(config, backend, **factory) for _ in range(config.n_layer)),
            ln_f=LayerNorm(config.n_embd, eps=config.layer_norm_eps, bias=config.bias, backend=backend, **factory),
        )
        self.transformer = torch.nn.ModuleDict(modules)
        self.lm_head = torch.nn.Linear(config.n_embd, config.vocab_size, bias=False, **factory)
        self.lm_head.weight = self.transformer.wte.weight  # tied
        self.reset_parameters()

    @classmethod
    def from_config(cls, config: GPTConfig | dict, **kwargs) -> "GPT":
        return cls(GPTConfig.coerce(config), **kwargs)

    def reset_parameters(self) -> None:
        """GPT-2 initialization."""
        for module in self.modules():
            if isinstance(module, (torch.nn.Linear, torch.nn.Embedding)):
                torch.nn.init.normal_(module.weight, mean=0.0, std=0.02)
            if isinstance(module, torch.nn.Linear) and module.bias is not None:
                torch.nn.init.zeros_(module.bias)
            if isinstance(module, torch.nn.LayerNorm):
                module.reset_parameters()
        std = 0.02 / math.sqrt(2 * self.config.n_layer)
        for block in self.transformer.h:
            torch.nn.init.normal_(block.attn.c_proj.weight, mean=0.0, std=std)
            torch.nn.init.normal_(block.mlp.fc2.weight, mean=0.0, std=std)

    def num_parameters(self, non_embedding: bool = True) -> int:
        n = sum(p.numel() for p in self.parameters())
        if non_embedding and "wpe" in self.transformer:
            n -= self.transformer.wpe.weight.numel()
        return n

    def new_cache(self, batch: int, capacity: int | None = None) -> KVCache:
        c = self.config
        w = self.transformer.wte.weight
        return KVCache(c.n_layer, batch, c.n_head, capacity or c.block_size, c.n_embd // c.n_head, device=w.device, dtype=w.dtype)

    def forward(self, idx: Tensor, targets: Tensor | None = None, *, cache: KVCache | None = None):
        """Logits (B, T, vocab) for tokens ``idx`` (B, T), and the mean cross-entropy against
        ``targets`` (B, T; -1 ignored) when given, else None: returns ``(logits, loss)``.

        With ``cache`` the tokens continue the cached sequence: their positions start at
        ``cache.length``, they attend every cached key, and the cache is extended by them.
        """
        B, T = idx.shape
        start = 0 if cache is None else cache.length
        if start + T > self.config.block_size:
            raise ValueError(f"sequence of {start + T} positions exceeds block_size={self.config.block_size}")
        x = self.transformer.wte(idx)
        if "wpe" in self.transformer:  # learned positions; rotary ones are applied in attention
            # (rows start..start+T of the table: a slice, where a lookup of arange(start, start + T)
            # costs an arange and an index_select forward and a scatter backward, ~15 us a call)
            x = x + self.transformer.wpe.weight[start:start + T]
        x = active_dropout(self.transformer.drop, x)
        for i, block in enumerate(self.transformer.h):
            x = block(x, cache, i)
        if cache is not None:
            cache.length += T
        logits = self.lm_head(self.transformer.ln_f(x))
        loss = None
        if targets is not None:
            loss = F.cross_entropy(logits.reshape(-1, logits.shape[-1]).float(), targets.reshape(-1), ignore_index=-1)
        return logits, loss

    @torch.no_grad()
    def generate(
        self,
        idx: Tensor,
        max_new_tokens: int,
        temperature: float = 1.0,
        top_k: int | None = None,
        greedy: bool = False,
        *,
        use_cache: bool = True,
        generator: torch.Generator | None = None,
    ) -> Tensor:
        """Append ``max_new_tokens`` tokens to ``idx`` (B, T), each sampled from the softmax of
        the last logits divided by ``temperature`` (restricted to the ``top_k`` largest), or
        their argmax when ``greedy``. The context is the last ``block_size`` tokens.

        With ``use_cache`` (default) the prompt is run once and each step feeds only the new
        token, attending the cached keys and values (``causal="bottom_right"``); once the
        sequence outgrows ``block_size``, the positions shift, so the window is recomputed.
        The tokens equal those of recomputing the whole context every step.
        """
        block = self.config.block_size
        cache = None
        for _ in range(max_new_tokens):
            context = idx[:, -block:]
            if not use_cache:
                logits, _ = self(context)
            elif cache is None or cache.length >= block:
                cache = self.new_cache(idx.shape[0])
                logits, _ = self(context, cache=cache)
            else:
                logits, _ = self(idx[:, -1:], cache=cache)
            logits = logits[:, -1, :].float()
            if greedy:
                nxt = logits.argmax(dim=-1, keepdim=True)
            else:
                logits = logits / max(temperature, 1e-8)
                if top_k is not None:
                    kth = torch.topk(logits, min(top_k, logits.shape[-1])).values[:, -1:]
                    logits = logits.masked_fill(logits < kth, float("-inf"))
                probs = torch.softmax(logits, dim=-1)
                nxt = torch.multinomial(probs, 1, generator=generator)
            idx = torch.cat([idx, nxt], dim=1)
        return idx

    def new_paged_cache(self, batch: int, capacity: int | None = None, block_size: int = 16) -> PagedKVCache:
        c = self.config
        w = self.transformer.wte.weight
        return PagedKVCache(c.n_layer, batch, c.n_head, capacity or c.block_size, c.n_embd // c.n_head,
                            block_size=block_size, device=w.device, dtype=w.dtype)

    def _forward_paged(self, idx: Tensor, positions: Tensor, cache: PagedKVCache,
                       cu_seqlens: Tensor | None = None) -> Tensor:
        """Logits of tokens ``idx`` at ``positions`` (both (B, T), or (1, total) packed with
        ``cu_seqlens``) through the paged ``cache``, whose ``seqlens`` then advance."""
        x = self.transformer.wte(idx)
        if "wpe" in self.transformer:
            x = x + self.transformer.wpe(positions)
        for i, block in enumerate(self.transformer.h):
            x = block(x, cache, i, positions, cu_seqlens)
        if cu_seqlens is None:
            cache.seqlens += idx.shape[1]
        else:
            cache.seqlens += (cu_seqlens[1:] - cu_seqlens[:-1]).to(torch.int32)
        return self.lm_head(self.transformer.ln_f(x))

    @torch.no_grad()
    def generate_paged(self, prompts: list[Tensor], max_new_tokens: int, *, block_size: int = 16) -> list[Tensor]:
        """Greedy continuation of a batch of prompts of different lengths (1-D token tensors) on
        a paged KV cache: one packed prefill (:func:`fastattn.varlen_attention`, no padding),
        then ``max_new_tokens`` batched decoding steps (:func:`fastattn.paged_attention`).
        Returns each prompt followed by its new tokens: the same tokens as
        ``generate(prompt[None], max_new_tokens, greedy=True)`` row by row, while every
        sequence fits in ``block_size`` positions."""
        lengths = [int(p.numel()) for p in prompts]
        longest = max(lengths) + max_new_tokens
        if longest > self.config.block_size:
            raise ValueError(f"prompts of up to {max(lengths)} tokens + {max_new_tokens} new exceed "
                             f"block_size={self.config.block_size}")
        device = self.transformer.wte.weight.device
        cache = self.new_paged_cache(len(prompts), longest, block_size)
        cu = torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)
        packed = torch.cat([p.to(device) for p in prompts])[None]
        positions = torch.cat([torch.arange(n, device=device) for n in lengths])[None]
        logits = self._forward_paged(packed, positions, cache, cu)[0, (cu[1:] - 1).long()]
        out = [[] for _ in prompts]
        for step in range(max_new_tokens):
            nxt = logits.float().argmax(dim=-1)
            for b, t in enumerate(nxt.tolist()):
                out[b].append(t)
            if step + 1 == max_new_tokens:
                break
            logits = self._forward_paged(nxt[:, None], cache.seqlens.long()[:, None], cache)[:, -1]
        return [torch.cat([p.to(device), torch.tensor(o, dtype=p.dtype, device=device)]) for p, o in zip(prompts, out)]
