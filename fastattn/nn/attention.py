"""Drop-in :class:`torch.nn.MultiheadAttention` whose attention runs in fastattn's fused kernel.

It subclasses torch's module, so the constructor, the parameters (``in_proj_weight`` or
``q/k/v_proj_weight``, ``in_proj_bias``, ``out_proj``, ``bias_k``/``bias_v``), the state_dict and
``isinstance`` checks are those of PyTorch; only :meth:`MultiheadAttention.forward` differs.
"""

from __future__ import annotations

import torch
import torch.nn.functional as F
from torch import Tensor

from fastattn.ops.attention import attention
from fastattn.ops.softmax import scaled_masked_softmax

__all__ = ["MultiheadAttention", "merge_mha_masks"]


def _check_mask_dtype(mask: Tensor, name: str) -> None:
    if not isinstance(mask, Tensor):
        raise TypeError(f"{name} must be a Tensor, got {type(mask).__name__}")
    if mask.dtype != torch.bool and not mask.is_floating_point():
        raise TypeError(f"only bool and floating types of {name} are supported, got {mask.dtype}")


def _pad_keys(mask: Tensor | None, extra: int) -> Tensor | None:
    """Append ``extra`` key columns that every query may attend (False / 0 in torch's meaning)."""
    if mask is None or extra == 0:
        return mask
    return F.pad(mask, (0, extra), value=False if mask.dtype == torch.bool else 0.0)


def merge_mha_masks(
    attn_mask: Tensor | None,
    key_padding_mask: Tensor | None,
    batch: int,
    heads: int,
    lq: int,
    lk: int,
    extra_keys: int = 0,
) -> Tensor | None:
    """torch.nn.MultiheadAttention's masks as ONE mask in fastattn's convention.

    ``attn_mask`` is (Lq, S) or (batch * heads, Lq, S), ``key_padding_mask`` (batch, S), with
    ``S = lk - extra_keys`` (the keys before ``add_bias_kv`` / ``add_zero_attn`` appended
    theirs); in torch's meaning: bool True = may NOT attend, float = added to the scores.
    Returns None, a bool mask (True = may attend) when both are bool, else an additive float
    mask, in the smallest shape broadcastable to (batch, heads, Lq, lk) that holds both:
    (1, 1, Lq, lk), (batch, 1, 1, lk), (batch, 1, Lq, lk) or (batch, heads, Lq, lk).
    """
    s = lk - extra_keys
    masks = []
    if attn_mask is not None:
        _check_mask_dtype(attn_mask, "attn_mask")
        if attn_mask.dim() == 2:
            if tuple(attn_mask.shape) != (lq, s):
                raise RuntimeError(
                    f"The shape of the 2D attn_mask is {tuple(attn_mask.shape)}, but should be {(lq, s)}."
                )
            view = (1, 1, lq, lk)
        elif attn_mask.dim() == 3:
            if tuple(attn_mask.shape) == (1, lq, s):
                view = (1, 1, lq, lk)
            elif tuple(attn_mask.shape) == (batch * heads, lq, s):
                view = (batch, heads, lq, lk)
            else:
                raise RuntimeError(
                    f"The shape of the 3D attn_mask is {tuple(attn_mask.shape)}, but should be {(batch * heads, lq, s)}."
                )
        else:
            raise RuntimeError(f"attn_mask's dimension {attn_mask.dim()} is not supported")
        masks.append(_pad_keys(attn_mask, extra_keys).reshape(view))
    if key_padding_mask is not None:
        _check_mask_dtype(key_padding_mask, "key_padding_mask")
        if tuple(key_padding_mask.shape) != (batch, s):
            raise RuntimeError(
                f"expecting key_padding_mask shape of {(batch, s)}, but got {tuple(key_padding_mask.shape)}"
            )
        masks.append(_pad_keys(key_padding_mask, extra_keys).reshape(batch, 1, 1, lk))
    if not masks:
        return None
    if all(m.dtype == torch.bool for m in masks):
        blocked = masks[0] if len(masks) == 1 else masks[0] | masks[1]
        return ~blocked
    additive = [
        torch.zeros(m.shape, dtype=torch.float32, device=m.device).masked_fill_(m, float("-inf"))
        if m.dtype == torch.bool
        else m
        for m in masks
    ]
    return additive[0] if len(additive) == 1 else additive[0] + additive[1]


class MultiheadAttention(torch.nn.MultiheadAttention):
    """:class:`torch.nn.MultiheadAttention` whose attention is fastattn's fused kernel.

    Same constructor (plus ``backend=``), parameters, state_dict and forward signature as
    PyTorch's, with PyTorch's mask meanings (bool True = may NOT attend, float = added;
    ``attn_mask`` (L, S) or (N * num_heads, L, S), ``key_padding_mask`` (N, S)). The masks are
    merged into one fastattn mask of the smallest broadcast shape; ``is_causal=True`` uses the
    causal band (as in PyTorch it is a hint that ``attn_mask`` is the causal mask, which may then
    be omitted). With ``need_weights=True`` the weights are computed separately by
    :func:`fastattn.scaled_masked_softmax` (averaged over heads when ``average_attn_weights``);
    the output always comes from the fused attention. Dropout (``dropout``) applies in
    training mode only. Differences: a query that may attend no key outputs 0, not NaN; and
    with ``add_bias_kv`` / ``add_zero_attn`` and ``is_causal=True`` the appended keys are visible
    to every query whatever ``need_weights`` (torch keeps them visible with ``need_weights=True``
    and hides them from the first queries with ``need_weights=False``, where its fast path puts
    the causal band over all keys).
    """

    backend: str | None = None

    def __init__(self, *args, backend: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.backend = backend

    def extra_repr(self) -> str:
        return (
            f"embed_dim={self.embed_dim}, num_heads={self.num_heads}, dropout={self.dropout}, "
            f"batch_first={self.batch_first}, backend={self.backend!r}"
        )

    def _project(self, query: Tensor, key: Tensor, value: Tensor) -> tuple[Tensor, Tensor, Tensor]:
        E = self.embed_dim
        b = self.in_proj_bias
        bq, bk, bv = (None, None, None) if b is None else b.chunk(3)
        if self._qkv_same_embed_dim:
            w = self.in_proj_weight
            if query is key and key is value:
                return F.linear(query, w, b).chunk(3, dim=-1)
            q = F.linear(query, w[:E], bq)
            if key is value:
                k, v = F.linear(key, w[E:], None if b is None else b[E:]).chunk(2, dim=-1)
                return q, k, v
            return q, F.linear(key, w[E : 2 * E], bk), F.linear(value, w[2 * E :], bv)
        return (
            F.linear(query, self.q_proj_weight, bq),
            F.linear(key, self.k_proj_weight, bk),
            F.linear(value, self.v_proj_weight, bv),
        )

    def forward(
        self,
        query: Tensor,
        key: Tensor,
        value: Tensor,
        key_padding_mask: Tensor | None = None,
        need_weights: bool = True,
        attn_mask: Tensor | None = None,
        average_attn_weights: bool = True,
        is_causal: bool = False,
    ) -> tuple[Tensor, Tensor | None]:
        if query.dim() not in (2, 3) or key.dim() != query.dim() or value.dim() != query.dim():
            raise ValueError(
                "query, key and value must all be 3-D (batched) or 2-D (unbatched), got shapes "
                f"{list(query.shape)}, {list(key.shape)}, {list(value.shape)}"
            )
        batched = query.dim() == 3
        if query.shape[-1] != self.embed_dim:
            raise ValueError(f"query's last dim is {query.shape[-1]}, expected embed_dim={self.embed_dim}")
        if key.shape[-1] != self.kdim or value.shape[-1] != self.vdim:
            raise ValueError(
                f"key and value last dims are {key.shape[-1]} and {value.shape[-1]}, "
                f"expected kdim={self.kdim} and vdim={self.vdim}"
            )
        if key.shape[:-1] != value.shape[:-1]:
            raise ValueError(
                f"key {list(key.shape)} and value {list(value.shape)} must share their batch and length dims"
            )
        bdim = 0 if self.batch_first else 1
        if batched and query.shape[bdim] != key.shape[bdim]:
            raise ValueError(
                f"query {list(query.shape)} and key {list(key.shape)} must share their batch dim "
                f"(dim {bdim}, batch_first={self.batch_first})"
            )
        if not batched and key_padding_mask is not None and key_padding_mask.dim() != 1:
            raise ValueError(
                "for an unbatched (2-D) query, key_padding_mask must be None or 1-D (S,), got shape "
                f"{list(key_padding_mask.shape)}"
            )

        # Batch-first views, identity (self-attention) preserved for the packed projection.
        def batch_major(t: Tensor) -> Tensor:
            if not batched:
                return t.unsqueeze(0)
            return t if self.batch_first else t.transpose(0, 1)

        same_qk, same_kv = query is key, key is value
        q_in = batch_major(query)
        k_in = q_in if same_qk else batch_major(key)
        v_in = k_in if same_kv else batch_major(value)
        if key_padding_mask is not None and not batched:
            key_padding_mask = key_padding_mask.unsqueeze(0)

        q, k, v = self._project(q_in, k_in, v_in)
        N, L, E = q.shape
        H, D = self.num_heads, self.head_dim
        extra = 0
        if self.bias_k is not None and self.bias_v is not None:
            k = torch.cat([k, self.bias_k.reshape(1, 1, E).expand(N, 1, E)], dim=1)
            v = torch.cat([v, self.bias_v.reshape(1, 1, E).expand(N, 1, E)], dim=1)
            extra += 1
        if self.add_zero_attn:
            k = torch.cat([k, k.new_zeros(N, 1, E)], dim=1)
            v = torch.cat([v, v.new_zeros(N, 1, E)], dim=1)
            extra += 1
        S = k.shape[1]
        causal = bool(is_causal)
        if causal:
            # is_causal: attn_mask (if any) is the causal mask, and the band replaces it; but the
            # keys appended by add_bias_kv / add_zero_attn stay visible to every query (as with
            # torch's padded mask), which the band cannot say: then an explicit mask.
            attn_mask = None
            if extra:
                attn_mask = torch.ones(L, S - extra, dtype=torch.bool, device=q.device).triu(1)
                causal = False
        # (a float mask of any dtype goes as it is: attention adds it in float32 or better)
        mask = merge_mha_masks(attn_mask, key_padding_mask, N, H, L, S, extra)

        q, k, v = (t.unflatten(-1, (H, D)).transpose(1, 2) for t in (q, k, v))  # (N, H, len, D)
        dropout_p = float(self.dropout) if self.training else 0.0
        seed = int(torch.randint(0, 2**31 - 1, (), device="cpu")) if dropout_p > 0 else None
        out = attention(
            q, k, v, mask, causal=causal, dropout_p=dropout_p, seed=seed, backend=self.backend
        )
        out = F.linear(out.transpose(1, 2).reshape(N, L, E), self.out_proj.weight, self.out_proj.bias)
        if not batched:
            out = out.squeeze(0)
        elif not self.batch_first:
            out = out.transpose(0, 1)

        weights = None
        if need_weights:
            weights = self._weights(q, k, mask, causal, dropout_p, seed)
            if average_attn_weights:
                weights = weights.mean(dim=1)
            if not batched:
                weights = weights.squeeze(0)
        return out, weights

    def _weights(self, q, k, mask, is_causal, dropout_p, seed) -> Tensor:
        """The attention probabilities (N, H, L, S) in q's dtype, computed in float32 or better."""
        if dropout_p > 0:
            # With dropout, the weights the output used are the probabilities times the dropout
            # multiplier; attending an identity "value" with the same seed returns exactly them
            # (the keep-mask depends on (batch, head, query, key) only). Columns in chunks of 64,
            # so the value head dim stays small for every kernel.
            N, H, _, _ = q.shape
            S = k.shape[2]
            eye = torch.eye(S, dtype=q.dtype, device=q.device)
            chunks = [
                attention(
                    q, k, eye[:, j : j + 64].expand(N, H, S, -1).contiguous(), mask, causal=is_causal,
                    dropout_p=dropout_p, seed=seed, backend=self.backend,
                )
                for j in range(0, S, 64)
            ]
            return torch.cat(chunks, dim=-1)
        acc = torch.promote_types(q.dtype, torch.float32)
        scores = q.to(acc) @ k.to(acc).transpose(-1, -2)
        if mask is not None and mask.is_floating_point():
            mask = mask.to(acc)
        p = scaled_masked_softmax(scores, mask, q.shape[-1] ** -0.5, is_causal, backend=self.backend)
        return p.to(q.dtype)
