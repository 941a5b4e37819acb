"""Drop-in normalization modules: subclasses of torch's, so arguments, parameters, state_dict and
isinstance checks are unchanged; only forward runs fastattn's kernels."""

from __future__ import annotations

import torch

from fastattn.ops.layer_norm import layer_norm, rms_norm


class LayerNorm(torch.nn.LayerNorm):
    """:class:`torch.nn.LayerNorm` computed by a fastattn backend (``backend=None``: automatic)."""

    def __init__(self, *args, backend: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.backend = backend

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return layer_norm(
            input, self.normalized_shape, self.weight, self.bias, self.eps, backend=self.backend
        )

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, backend={self.backend!r}"


class RMSNorm(torch.nn.RMSNorm):
    """:class:`torch.nn.RMSNorm` computed by a fastattn backend (``backend=None``: automatic)."""

    def __init__(self, *args, backend: str | None = None, **kwargs):
        super().__init__(*args, **kwargs)
        self.backend = backend

    def forward(self, input: torch.Tensor) -> torch.Tensor:
        return rms_norm(input, self.normalized_shape, self.weight, self.eps, backend=self.backend)

    def extra_repr(self) -> str:
        return f"{super().extra_repr()}, backend={self.backend!r}"
