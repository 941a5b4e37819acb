"""``FeedForward``: the transformer MLP ``dropout(fc2(act(fc1(x))))`` as one fused fastattn op."""

from __future__ import annotations

import torch
from torch import Tensor

from fastattn.activations import ACTIVATIONS, GATED
from fastattn.ops.ffn import ffn

__all__ = ["FeedForward"]


def active_dropout(module: torch.nn.Dropout, x: Tensor) -> Tensor:
    """``module(x)`` when that dropout does something (training, p > 0), else ``x`` without the
    module call: on a CPU an identity nn.Dropout call costs several us of Python, five a
    forward in the reference GPT."""
    return module(x) if module.training and module.p > 0 else x


class FeedForward(torch.nn.Module):
    """``dropout(fc2(act(fc1(x))))`` computed by :func:`fastattn.ffn`, then dropout.

    ``fc1`` and ``fc2`` are :class:`torch.nn.Linear` (state_dict keys ``fc1.weight``,
    ``fc1.bias``, ``fc2.weight``, ``fc2.bias``). ``fc1`` has ``hidden`` outputs, or
    ``2 * hidden`` for the gated ``swiglu`` / ``geglu`` (rows ``[gate; up]``); ``fc2`` maps
    ``hidden`` to ``out_features`` (default ``d_model``). Activations: gelu (exact), gelu_tanh,
    relu, silu, swiglu, geglu.
    """

    def __init__(
        self,
        d_model: int,
        hidden: int,
        activation: str = "gelu",
        bias: bool = True,
        dropout: float = 0.0,
        out_features: int | None = None,
        backend: str | None = None,
        device=None,
        dtype=None,
    ):
        super().__init__()
        if activation not in ACTIVATIONS:
            raise ValueError(f"unknown activation {activation!r}; choose from {list(ACTIVATIONS)}")
        factory = {"device": device, "dtype": dtype}
        self.activation = activation
        self.backend = backend
        width = 2 * hidden if activation in GATED else hidden
        self.fc1 = torch.nn.Linear(d_model, width, bias=bias, **factory)
        self.fc2 = torch.nn.Linear(hidden, d_model if out_features is None else out_features, bias=bias, **factory)
        self.dropout = torch.nn.Dropout(dropout)

    def forward(self, x: Tensor) -> Tensor:
        y = ffn(x, self.fc1.weight, self.fc1.bias, self.fc2.weight, self.fc2.bias, self.activation, backend=self.backend)
        return active_dropout(self.dropout, y)

    def extra_repr(self) -> str:
        return f"activation={self.activation!r}, backend={self.backend!r}"
