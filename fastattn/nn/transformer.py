"""Drop-in :class:`torch.nn.TransformerEncoderLayer` / :class:`torch.nn.TransformerDecoderLayer`.

They subclass torch's layers: same constructor (plus ``backend=``), the same submodules
(``self_attn``, ``multihead_attn``, ``linear1``, ``dropout``, ``linear2``, ``norm1/2/3``,
``dropout1/2/3``) and state_dict. The attention modules are :class:`fastattn.nn.MultiheadAttention`,
the norms :class:`fastattn.nn.LayerNorm`, and the feed-forward block is one :func:`fastattn.ffn`
call whenever the dropout between ``linear1`` and ``linear2`` is inactive (eval mode or
``dropout=0``); otherwise it runs as separate ops so that dropout sits where PyTorch puts it.
The activation is a name or, as in torch, any callable: torch's relu / gelu / silu (functions or
modules) run fused, any other runs the feed-forward block as torch ops; reassigning
``layer.activation`` takes effect, as in torch.
PyTorch's fused inference fast path is never taken: forward always runs fastattn's kernels.
"""

from __future__ import annotations

import functools
from typing import Callable

import torch
import torch.nn.functional as F
from torch import Tensor

from fastattn.nn.attention import MultiheadAttention
from fastattn.nn.norm import LayerNorm
from fastattn.activations import ACTIVATIONS, GATED
from fastattn.ops.ffn import activate, ffn

__all__ = ["TransformerDecoderLayer", "TransformerEncoderLayer", "activation_name"]


#: Eager PyTorch of each activation, for the unfused path (``fused_ffn = False`` or dropout).
_CALLABLES: dict[str, Callable[[Tensor], Tensor]] = {name: functools.partial(activate, name) for name in ACTIVATIONS}


def activation_name(activation) -> str:
    """The fastattn activation name of ``activation``: a name from ``fastattn.activations.ACTIVATIONS``,
    or one of the callables torch's layers accept for them (``F.relu``, ``torch.relu``,
    ``F.gelu``, ``F.silu``, ``nn.ReLU()``, ``nn.GELU()`` (either approximation), ``nn.SiLU()``).
    Anything else raises ValueError: the fused FFN only has these activations."""
    if isinstance(activation, str):
        if activation in ACTIVATIONS:
            return activation
        raise ValueError(f"activation {activation!r} is not supported; choose from {list(ACTIVATIONS)}")
    if activation in (F.relu, torch.relu) or isinstance(activation, torch.nn.ReLU):
        return "relu"
    if activation is F.gelu or (isinstance(activation, torch.nn.GELU) and activation.approximate == "none"):
        return "gelu"
    if isinstance(activation, torch.nn.GELU) and activation.approximate == "tanh":
        return "gelu_tanh"
    if activation is F.silu or isinstance(activation, torch.nn.SiLU):
        return "silu"
    for name, fn in _CALLABLES.items():
        if activation is fn:
            return name
    raise ValueError(
        f"activation {activation!r} is not supported by fastattn's fused feed-forward; pass one of "
        f"{list(ACTIVATIONS)} (or F.relu / F.gelu / F.silu / nn.ReLU() / nn.GELU() / nn.SiLU())"
    )


class _FastLayerMixin:
    """Shared by both layers: the fastattn submodules, the activation and the FFN block."""

    backend: str | None = None
    fused_ffn: bool = True  # False: the feed-forward runs as torch ops with ``self.activation``

    # torch.nn.TransformerEncoderLayer and TransformerDecoderLayer share this signature; ours
    # adds ``backend`` and more activation names (torch's layer is built with relu, then patched).
    def __init__(
        self,
        d_model: int,
        nhead: int,
        dim_feedforward: int = 2048,
        dropout: float = 0.1,
        activation: str | Callable[[Tensor], Tensor] = "relu",
        layer_norm_eps: float = 1e-5,
        batch_first: bool = False,
        norm_first: bool = False,
        bias: bool = True,
        device=None,
        dtype=None,
        backend: str | None = None,
    ) -> None:
        if isinstance(activation, str):
            activation_name(activation)  # fail early, with our message
        super().__init__(
            d_model, nhead, dim_feedforward, dropout, "relu", layer_norm_eps, batch_first, norm_first,
            bias, device, dtype,
        )
        self._fastattn_init(activation, backend, dim_feedforward, bias, {"device": device, "dtype": dtype})

    def _fastattn_init(self, activation, backend, dim_feedforward, bias, factory) -> None:
        self.backend = backend
        self.activation = _CALLABLES[activation] if isinstance(activation, str) else activation
        # torch's TransformerEncoder takes its nested-tensor fast path only for relu/gelu layers
        # (flag 1/2); 0 keeps it off, so our forward always runs.
        self.activation_relu_or_gelu = 0
        if self.activation_name in GATED:  # [gate; up] rows: linear1 produces 2 * dim_feedforward features
            self.linear1 = torch.nn.Linear(self.linear1.in_features, 2 * dim_feedforward, bias=bias, **factory)
        _convert_submodules(self, backend)

    @property
    def activation_name(self) -> str | None:
        """The fused FFN's name for ``self.activation``, read on every call (torch's layers let
        ``activation`` be reassigned); None for a callable it does not have (the FFN then runs
        as torch ops with it, as torch's layer would)."""
        try:
            return activation_name(self.activation)
        except ValueError:
            return None

    def _ff(self, x: Tensor) -> Tensor:
        """``linear2(dropout(act(linear1(x))))``, fused when that dropout is inactive and the
        activation is one the fused FFN has."""
        name = self.activation_name
        if name is not None and self.fused_ffn and (not self.training or self.dropout.p == 0):
            return ffn(
                x, self.linear1.weight, self.linear1.bias, self.linear2.weight, self.linear2.bias,
                name, backend=self.backend,
            )
        return self.linear2(self.dropout(self.activation(self.linear1(x))))

    def extra_repr(self) -> str:
        act = self.activation_name or f"{self.activation!r} (unfused)"
        return f"activation={act!r}, backend={self.backend!r}"


def _convert_submodules(layer: torch.nn.Module, backend: str | None) -> None:
    """Turn the layer's torch MultiheadAttention / LayerNorm children into fastattn's (in place,
    keeping their parameters)."""
    for name, child in list(layer.named_children()):
        if type(child) is torch.nn.MultiheadAttention:
            child.__class__ = MultiheadAttention
            child.backend = backend
        elif type(child) is torch.nn.LayerNorm:
            child.__class__ = LayerNorm
            child.backend = backend


class TransformerEncoderLayer(_FastLayerMixin, torch.nn.TransformerEncoderLayer):
    """:class:`torch.nn.TransformerEncoderLayer` on fastattn's kernels (see the module docstring).

    ``activation`` is a name (relu, gelu, gelu_tanh, silu, swiglu, geglu; the gated two give
    ``linear1`` ``2 * dim_feedforward`` outputs) or any callable (see the module docstring).
    """

    def forward(
        self,
        src: Tensor,
        src_mask: Tensor | None = None,
        src_key_padding_mask: Tensor | None = None,
        is_causal: bool = False,
    ) -> Tensor:
        x = src
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), src_mask, src_key_padding_mask, is_causal=is_causal)
            x = x + self._ff_block(self.norm2(x))
        else:
            x = self.norm1(x + self._sa_block(x, src_mask, src_key_padding_mask, is_causal=is_causal))
            x = self.norm2(x + self._ff_block(x))
        return x

    def _ff_block(self, x: Tensor) -> Tensor:
        return self.dropout2(self._ff(x))


class TransformerDecoderLayer(_FastLayerMixin, torch.nn.TransformerDecoderLayer):
    """:class:`torch.nn.TransformerDecoderLayer` on fastattn's kernels (see the module docstring).

    ``tgt_is_causal=True`` applies the causal band to the self-attention even without a
    ``tgt_mask``.
    """

    def forward(
        self,
        tgt: Tensor,
        memory: Tensor,
        tgt_mask: Tensor | None = None,
        memory_mask: Tensor | None = None,
        tgt_key_padding_mask: Tensor | None = None,
        memory_key_padding_mask: Tensor | None = None,
        tgt_is_causal: bool = False,
        memory_is_causal: bool = False,
    ) -> Tensor:
        x = tgt
        if self.norm_first:
            x = x + self._sa_block(self.norm1(x), tgt_mask, tgt_key_padding_mask, tgt_is_causal)
            x = x + self._mha_block(self.norm2(x), memory, memory_mask, memory_key_padding_mask, memory_is_causal)
            x = x + self._ff_block(self.norm3(x))
        else:
            x = self.norm1(x + self._sa_block(x, tgt_mask, tgt_key_padding_mask, tgt_is_causal))
            x = self.norm2(x + self._mha_block(x, memory, memory_mask, memory_key_padding_mask, memory_is_causal))
            x = self.norm3(x + self._ff_block(x))
        return x

    def _ff_block(self, x: Tensor) -> Tensor:
        return self.dropout3(self._ff(x))
