"""Megatron-LM / Apex fused-softmax entry points on fastattn's kernel, for a one-import switch.

Megatron's conventions are kept: argument order ``(inputs, mask, scale)`` and a mask that is
True where a score is **masked out** (fastattn's own mask is True where a score is kept).
Unlike Megatron's kernels there is no limit on row length or on the number of rows, any
leading shape works, and a fully masked row is all zeros (Megatron's fills masked scores with
-10000 and so returns a uniform row).

    from fastattn.integrations.megatron import ScaledMaskedSoftmax
    probs = ScaledMaskedSoftmax.apply(scores, mask, scale)
"""

from __future__ import annotations

from torch import Tensor

from fastattn.ops.softmax import scaled_masked_softmax as _softmax


def scaled_masked_softmax(inputs: Tensor, mask: Tensor | None, scale: float, *, backend: str | None = None) -> Tensor:
    """``softmax(scale * inputs)`` with ``mask`` True = masked out (Megatron's meaning)."""
    return _softmax(inputs, None if mask is None else ~mask.bool(), scale, backend=backend)


def scaled_upper_triang_masked_softmax(inputs: Tensor, scale: float, *, backend: str | None = None) -> Tensor:
    """Causal ``softmax(scale * inputs)``: key j > query i masked (Megatron's upper-triangular)."""
    return _softmax(inputs, None, scale, is_causal=True, backend=backend)


def scaled_softmax(inputs: Tensor, scale: float, *, backend: str | None = None) -> Tensor:
    """``softmax(scale * inputs)`` without a mask."""
    return _softmax(inputs, None, scale, backend=backend)


class ScaledMaskedSoftmax:
    """``ScaledMaskedSoftmax.apply(inputs, mask, scale)`` as in Megatron (differentiable)."""

    apply = staticmethod(scaled_masked_softmax)


class ScaledUpperTriangMaskedSoftmax:
    """``ScaledUpperTriangMaskedSoftmax.apply(inputs, scale)`` as in Megatron (differentiable)."""

    apply = staticmethod(scaled_upper_triang_masked_softmax)


class ScaledSoftmax:
    """``ScaledSoftmax.apply(inputs, scale)`` as in Megatron (differentiable)."""

    apply = staticmethod(scaled_softmax)
