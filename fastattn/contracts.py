"""The backend contract of each op, typed: what every backend function of the op receives.

A backend of op ``name`` is a function ``fn`` passed to
``fastattn.register_backend(name, backend, fn)`` (or registered by ``define_op`` for the built-in
ones). The public function validates the user's arguments, reshapes them to the contract below and
calls ``fn`` positionally; ``fn`` returns the contract's outputs. Each contract is a
:class:`typing.Protocol` whose ``__call__`` is the signature (positional-only, in order);
:func:`fastattn.backends.register_backend` checks that ``fn`` can be called that way and raises a
TypeError naming the contract when it cannot, at registration rather than at the first call.

Shapes, dtypes and meaning of each argument are in the docstring of the op's module
(``fastattn.ops.<op>``, "Backend contract").
"""

from __future__ import annotations

import inspect
from typing import Callable, Optional, Protocol

from torch import Tensor


class AttentionBackend(Protocol):
    """q (B, H, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv), mask None or a (B, H, Lq, Lk)
    view, the band (offset, left, right) -> out (B, H, Lq, Dv), lse (B, H, Lq) float32."""

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, mask: Optional[Tensor], scale: float,
                 offset: int, left: int, right: int, dropout_p: float, seed: int, /,
                 ) -> tuple[Tensor, Tensor]: ...


class VarlenAttentionBackend(Protocol):
    """Packed q (total_q, H, D), k, v (total_k, Hkv, D / Dv) -> out (total_q, H, Dv), lse
    (H, total_q) float32."""

    def __call__(self, q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor,
                 cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int, scale: float,
                 bottom_right: bool, left: int, right: int, dropout_p: float, seed: int, /,
                 ) -> tuple[Tensor, Tensor]: ...


class PagedAttentionBackend(Protocol):
    """q (B, H, Lq, D) over paged caches -> out (B, H, Lq, Dv), lse (B, H, Lq) float32."""

    def __call__(self, q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor,
                 cache_seqlens: Tensor, scale: float, bottom_right: bool, left: int, right: int,
                 /) -> tuple[Tensor, Tensor]: ...


class SoftmaxBackend(Protocol):
    """x (L0, L1, Lq, Lk), mask None or a broadcast view -> y like x."""

    def __call__(self, x: Tensor, mask: Optional[Tensor], scale: float, is_causal: bool, /,
                 ) -> Tensor: ...


class LayerNormBackend(Protocol):
    """x (..., *normalized_shape) (+ residual), weight / bias of normalized_shape or None ->
    y like x, and h = x + residual when there is a residual (else None)."""

    def __call__(self, x: Tensor, residual: Optional[Tensor], normalized_shape: tuple[int, ...],
                 weight: Optional[Tensor], bias: Optional[Tensor], eps: float, rms: bool, /,
                 ) -> tuple[Tensor, Optional[Tensor]]: ...


class FFNBackend(Protocol):
    """x (M, D), nn.Linear weights and biases, an activation name -> out (M, D2)."""

    def __call__(self, x: Tensor, w1: Tensor, b1: Optional[Tensor], w2: Tensor,
                 b2: Optional[Tensor], activation: str, /) -> Tensor: ...


class RopeBackend(Protocol):
    """x (B, H, L, D), cos / sin (P, D/2) tables, positions None or (B, L) int64 -> y like x."""

    def __call__(self, x: Tensor, cos: Tensor, sin: Tensor, positions: Optional[Tensor],
                 interleaved: bool, /) -> Tensor: ...


#: op name -> its contract.
CONTRACTS: dict[str, type] = {
    "attention": AttentionBackend,
    "varlen_attention": VarlenAttentionBackend,
    "paged_attention": PagedAttentionBackend,
    "softmax": SoftmaxBackend,
    "layer_norm": LayerNormBackend,
    "ffn": FFNBackend,
    "rope": RopeBackend,
}


def arguments(op: str) -> list[str]:
    """The names of the arguments a backend of ``op`` receives, in order."""
    params = list(inspect.signature(CONTRACTS[op].__call__).parameters)
    return params[1:]  # less self


def mismatch(op: str, fn: Callable) -> str | None:
    """Why ``fn`` cannot be called as ``op``'s contract says (positionally, with its arguments),
    or None when it can or when ``fn`` does not expose a signature (a torch op overload, a C
    function): those are checked by their own schema."""
    if op not in CONTRACTS:
        return None
    try:
        sig = inspect.signature(fn)
    except (TypeError, ValueError):
        return None
    names = arguments(op)
    try:
        sig.bind(*names)
    except TypeError as exc:
        return (f"{exc}; a backend of {op!r} is called as fn({', '.join(names)}) "
                f"(fastattn.contracts.{CONTRACTS[op].__name__}), got fn{sig}")
    return None
