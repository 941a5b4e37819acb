"""Counter-based dropout RNG shared by the Triton kernels (docs/numerics.md, "Dropout").

All arithmetic is on uint32 and wraps mod 2**32::

    fmix32(x)     = MurmurHash3's 32-bit finaliser
    stream(b, h)  = fmix32(seed + 0x9E3779B9 * (b * H + h))
    r(b, h, i, j) = fmix32(fmix32(i * Lk + j) ^ stream(b, h))
    keep          = r >= threshold,  threshold = floor(p * 2**32)

Launchers pass ``seed`` and ``threshold`` as 32-bit integers (a value >= 2**31 as its int32 bit
pattern); the helpers reinterpret them as uint32, so the mask is bit-identical to the NumPy
reference and to the other backends.
"""

import triton
import triton.language as tl


@triton.jit
def fmix32(x):
    """MurmurHash3's 32-bit finaliser on a uint32 tensor."""
    x = x ^ (x >> 16)
    x = x * tl.cast(0x85EBCA6B, tl.uint32)
    x = x ^ (x >> 13)
    x = x * tl.cast(0xC2B2AE35, tl.uint32)
    x = x ^ (x >> 16)
    return x


@triton.jit
def dropout_keep(seed, bh, rows, cols, Lk, threshold):
    """Keep-mask of the query rows ``rows`` and key columns ``cols`` (broadcast together) of the
    flat (batch, query head) index ``bh = b * H + h``:
    ``fmix32(fmix32(i * Lk + j) ^ stream(bh)) >= threshold``.
    """
    seed_u = tl.cast(seed, tl.uint32, bitcast=True)
    threshold_u = tl.cast(threshold, tl.uint32, bitcast=True)
    stream = fmix32(seed_u + tl.cast(0x9E3779B9, tl.uint32) * tl.cast(bh, tl.uint32))
    counter = tl.cast(rows, tl.uint32) * tl.cast(Lk, tl.uint32) + tl.cast(cols, tl.uint32)
    return fmix32(fmix32(counter) ^ stream) >= threshold_u
