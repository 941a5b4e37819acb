"""``ScaledMaskedSoftmax``: the module form of :func:`fastattn.scaled_masked_softmax`."""

from __future__ import annotations

import torch
from torch import Tensor

from fastattn.ops.softmax import scaled_masked_softmax

__all__ = ["ScaledMaskedSoftmax"]


class ScaledMaskedSoftmax(torch.nn.Module):
    """``softmax(scale * x + mask)`` over the last dim, fused (see :func:`fastattn.scaled_masked_softmax`).

    ``mask`` (forward argument) is bool (True = keep) or float (added after scaling),
    broadcastable to ``x``; ``is_causal`` masks key ``j > i`` of the last two dims (top-left).
    Rows with nothing kept are all zeros.
    """

    def __init__(self, scale: float = 1.0, is_causal: bool = False, backend: str | None = None):
        super().__init__()
        self.scale = float(scale)
        self.is_causal = bool(is_causal)
        self.backend = backend

    def forward(self, x: Tensor, mask: Tensor | None = None) -> Tensor:
        return scaled_masked_softmax(x, mask, self.scale, self.is_causal, backend=self.backend)

    def extra_repr(self) -> str:
        return f"scale={self.scale}, is_causal={self.is_causal}, backend={self.backend!r}"
