"""Rotary position embedding as a module: :func:`fastattn.rope` with cached cos/sin tables."""

from __future__ import annotations

import torch
from torch import Tensor

from fastattn.ops.rope import rope, rotary_cos_sin

__all__ = ["RotaryEmbedding"]


class RotaryEmbedding(torch.nn.Module):
    """Applies :func:`rope` with cached cos/sin tables (non-persistent buffers ``cos``, ``sin``).

    ``dim`` is the head dim D. The tables cover positions ``0 .. max_seq_len - 1`` and grow on
    demand for calls by ``offset``; with an explicit ``positions`` tensor on the GPU, positions
    must stay below ``max_seq_len`` (they are not checked there, see :func:`rope`). The tables
    stay float32 (float64 inputs get exact float64 tables per call), whatever ``module.to(dtype)``
    does to the buffers.

    Typical use in attention (``q``, ``k`` (B, H, L, D); ``start`` = tokens already cached)::

        q, k = rotary(q, offset=start), rotary(k, offset=start)
    """

    def __init__(
        self,
        dim: int,
        max_seq_len: int = 2048,
        base: float = 10000.0,
        *,
        interleaved: bool = False,
        backend: str | None = None,
        device: torch.device | str | None = None,
    ) -> None:
        super().__init__()
        self.dim = dim
        self.base = float(base)
        self.interleaved = interleaved
        self.backend = backend
        cos, sin = rotary_cos_sin(max_seq_len, dim, self.base, device)
        self.register_buffer("cos", cos, persistent=False)
        self.register_buffer("sin", sin, persistent=False)

    def extra_repr(self) -> str:
        return (f"dim={self.dim}, max_seq_len={self.cos.shape[0]}, base={self.base:g}, "
                f"interleaved={self.interleaved}")

    def _ensure(self, length: int) -> None:
        """Tables covering ``length`` positions, in float32 (``module.to(torch.bfloat16)`` casts
        floating-point buffers too; bfloat16 tables would cost the rotation its precision)."""
        n = self.cos.shape[0]
        if length > n or self.cos.dtype != torch.float32:
            n = max(length, 2 * n) if length > n else n
            self.cos, self.sin = rotary_cos_sin(n, self.dim, self.base, self.cos.device)

    def forward(self, x: Tensor, *, offset: int = 0, positions: Tensor | None = None) -> Tensor:
        """``rope(x)`` at positions ``offset + l`` (or ``positions``) with the cached tables."""
        if isinstance(x, Tensor) and x.dtype == torch.float64:
            # float64 inputs get exact float64 tables, computed for this call.
            return rope(x, positions=positions, offset=offset, base=self.base,
                        interleaved=self.interleaved, backend=self.backend)
        if positions is None:
            self._ensure(offset + x.shape[-2])
        elif positions.device.type != "cuda" and positions.numel() > 0:
            self._ensure(int(positions.max()) + 1)
        else:
            self._ensure(0)
        return rope(x, self.cos, self.sin, positions=positions, offset=offset,
                    interleaved=self.interleaved, backend=self.backend)
