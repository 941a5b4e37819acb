"""Float64 NumPy reference of the rotary position embedding (RoPE): the ground truth for
:func:`fastattn.rope` on every backend.

Convention (the one :func:`fastattn.rope` implements). ``x`` is ``(B, H, L, D)`` with ``D`` even,
``half = D // 2``. Pair ``i`` (``0 <= i < half``) of a head row is

* ``(i, i + half)`` — GPT-NeoX / Hugging Face LLaMA, ``rotate_half`` (the default), or
* ``(2 i, 2 i + 1)`` — GPT-J, with ``interleaved=True``,

and is rotated by the angle ``theta[p, i] = p * base ** (-2 i / D)`` of the token's position ``p``::

    y[first_i]  = x[first_i] * cos(theta) - x[second_i] * sin(theta)
    y[second_i] = x[second_i] * cos(theta) + x[first_i] * sin(theta)

Token ``l`` of batch row ``b`` has position ``offset + l``, or ``positions[b, l]`` when a
``positions`` array ((L,) or (B, L)) is given. ``cos`` / ``sin`` may be passed as ``(P, half)``
tables indexed by position instead of being computed from ``base``.

The rotation is orthogonal, so the gradient with respect to ``x`` is the inverse rotation (angle
``-theta``) of the output gradient. The gradients with respect to given tables are

    dcos[p, i] = sum over tokens at p, heads:   dy[first] * x[first] + dy[second] * x[second]
    dsin[p, i] = sum over tokens at p, heads:   dy[second] * x[first] - dy[first] * x[second]

NumPy only; every function computes in float64 and returns float64 arrays.
"""

import numpy as np

__all__ = [
    "pair_indices",
    "rope",
    "rope_backward",
    "rotary_angles",
    "rotary_cos_sin",
]


def _f64(x):
    return np.asarray(x, dtype=np.float64)


def pair_indices(dim, interleaved=False):
    """The index arrays ``(first, second)`` of the ``dim // 2`` rotated pairs of a head row."""
    if dim % 2:
        raise ValueError(f"the head dim must be even, got {dim}")
    half = dim // 2
    i = np.arange(half)
    return (2 * i, 2 * i + 1) if interleaved else (i, i + half)


def rotary_angles(positions, dim, base=10000.0):
    """``theta[..., i] = positions[...] * base ** (-2 i / dim)``: shape ``positions.shape + (dim // 2,)``."""
    if dim % 2:
        raise ValueError(f"the head dim must be even, got {dim}")
    inv_freq = float(base) ** (-np.arange(0, dim, 2, dtype=np.float64) / dim)
    return _f64(positions)[..., None] * inv_freq


def rotary_cos_sin(length, dim, base=10000.0, offset=0):
    """``(cos, sin)`` tables of shape ``(length, dim // 2)`` for positions ``offset .. offset + length - 1``."""
    theta = rotary_angles(np.arange(offset, offset + length), dim, base)
    return np.cos(theta), np.sin(theta)


def _token_positions(B, L, positions, offset):
    """(B, L) integer positions of every token."""
    if positions is None:
        return np.broadcast_to(np.arange(offset, offset + L), (B, L))
    pos = np.asarray(positions)
    if pos.ndim == 1:
        pos = pos[None, :]
    return np.broadcast_to(pos, (B, L))


def _tables(x, cos, sin, positions, offset, base):
    """cos, sin of every token: (B, 1, L, half) arrays."""
    B, _, L, D = x.shape
    pos = _token_positions(B, L, positions, offset)
    if cos is None and sin is None:
        theta = rotary_angles(pos, D, base)
        return np.cos(theta)[:, None], np.sin(theta)[:, None]
    if cos is None or sin is None:
        raise ValueError("pass both cos and sin, or neither")
    cos, sin = _f64(cos), _f64(sin)
    return cos[pos][:, None], sin[pos][:, None]


def rope(x, cos=None, sin=None, positions=None, offset=0, base=10000.0, interleaved=False):
    """Rotary position embedding of ``x`` (B, H, L, D): see the module docstring."""
    x = _f64(x)
    c, s = _tables(x, cos, sin, positions, offset, base)
    first, second = pair_indices(x.shape[-1], interleaved)
    a, b = x[..., first], x[..., second]
    y = np.empty_like(x)
    y[..., first] = a * c - b * s
    y[..., second] = b * c + a * s
    return y


def rope_backward(dy, x, cos=None, sin=None, positions=None, offset=0, base=10000.0, interleaved=False):
    """Gradients of :func:`rope` for the output gradient ``dy``: ``(dx, dcos, dsin)``.

    ``dx`` is the inverse rotation of ``dy``; ``dcos`` / ``dsin`` are the gradients of the given
    tables (same shape as ``cos``), or None when the tables were computed from ``base``.
    """
    dy, x = _f64(dy), _f64(x)
    c, s = _tables(x, cos, sin, positions, offset, base)
    first, second = pair_indices(x.shape[-1], interleaved)
    da, db = dy[..., first], dy[..., second]
    dx = np.empty_like(dy)
    dx[..., first] = da * c + db * s
    dx[..., second] = db * c - da * s
    if cos is None:
        return dx, None, None
    a, b = x[..., first], x[..., second]
    gc = (da * a + db * b).sum(axis=1)  # (B, L, half): summed over heads
    gs = (db * a - da * b).sum(axis=1)
    B, _, L, _ = x.shape
    pos = _token_positions(B, L, positions, offset)
    dcos = np.zeros(np.shape(cos), dtype=np.float64)
    dsin = np.zeros(np.shape(sin), dtype=np.float64)
    np.add.at(dcos, pos, gc)
    np.add.at(dsin, pos, gs)
    return dx, dcos, dsin
