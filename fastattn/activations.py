"""The FFN's activations: one table that the ops, the nn modules, the NumPy reference and the
Triton kernels read, mirrored by ``csrc/include/fastattn/activation.h`` for the C++ kernels
(tests/test_activations.py checks the two agree).

Each name maps to the elementwise function ``f`` it applies (by code: the kernels' id, 0 being the
identity) and whether it is gated: a gated activation splits the first layer's output ``h`` of
width ``2F`` into ``[gate, up]`` and returns ``f(gate) * up``.
"""

from __future__ import annotations

from dataclasses import dataclass

#: Codes of the elementwise functions (the C++ ``enum Act`` and the Triton constexpr ids).
IDENTITY, GELU, GELU_TANH, RELU, SILU = range(5)


@dataclass(frozen=True)
class Activation:
    name: str
    code: int  # the elementwise function f
    gated: bool


TABLE: dict[str, Activation] = {
    a.name: a
    for a in (
        Activation("gelu", GELU, False),  # exact, erf
        Activation("gelu_tanh", GELU_TANH, False),
        Activation("relu", RELU, False),
        Activation("silu", SILU, False),
        Activation("swiglu", SILU, True),
        Activation("geglu", GELU, True),
    )
}

#: Every activation name, and the gated ones.
ACTIVATIONS: tuple[str, ...] = tuple(TABLE)
GATED: tuple[str, ...] = tuple(n for n, a in TABLE.items() if a.gated)


def lookup(name: str) -> Activation:
    """The activation ``name``; ValueError naming the choices for anything else."""
    try:
        return TABLE[name]
    except (KeyError, TypeError):
        raise ValueError(f"unknown activation {name!r}; expected one of {list(ACTIVATIONS)}") from None
