"""Launchers of the dense attention kernels (:mod:`kernels.attention`): forward and backward.

Each turns torch tensors into the kernels' arguments (strides, band, mask and dropout arguments,
block sizes of the head dims), allocates the outputs, and launches through
:func:`kernels.descriptors.launch` (the descriptor path where :func:`kernels.descriptors.use_tma`
says so, else the pointer path). Arguments are checked by fastattn.ops; these functions check
only the kernels' own limits (:func:`_dims`).
"""

import dataclasses
import math
import operator

import torch

from . import descriptors, tuning
from .attention import (
    _DTYPES, _LOG2E, _MAX_HEAD_DIM, _PRE_BLOCK_M, _attn_bwd_dkdv_kernel, _attn_bwd_dq_kernel,
    _attn_bwd_preprocess_kernel, _attn_fwd_kernel,
)

#: Re-exported: the descriptor path's state on this machine.
tma_status = descriptors.tma_status

def _dims(q, k, v, mask=None):
    """``(B, H, Hkv, Lq, Lk, D, Dv)`` of q, k, v, and the limits of these kernels. The arguments
    themselves (ranks, shapes, dtypes, devices, mask, dropout_p) are checked once, in
    fastattn.ops before any backend runs, which also gives every tensor a unit last stride;
    what only the kernels know is checked here, cheaply: the dtypes and layout they are built
    for, head dims up to 256, and offsets within one (batch, head) slice that fit in int32 (the
    kernels add ``row * stride`` in 32 bits to an int64 slice base)."""
    B, H, Lq, D = q.shape
    _, Hkv, Lk, Dv = v.shape
    for name, x in (("q", q), ("k", k), ("v", v)):
        tuning.check_layout("attention", name, x, _DTYPES)
    if max(D, Dv) > _MAX_HEAD_DIM:
        raise ValueError(f"the triton attention kernels take head dims up to {_MAX_HEAD_DIM}: "
                         f"q {tuple(q.shape)}, v {tuple(v.shape)}")
    slices = [("q", q), ("k", k), ("v", v)] + ([("mask", mask)] if mask is not None else [])
    for name, x in slices:
        if (x.shape[-2] - 1) * abs(x.stride(-2)) + (x.shape[-1] - 1) * abs(x.stride(-1)) >= 2**31:
            raise ValueError(f"{name} {tuple(x.shape)} with strides {x.stride()}: offsets within "
                             f"one (batch, head) slice must fit in int32")
    return B, H, Hkv, Lq, Lk, D, Dv


def _band(Lq, Lk, offset, left, right):
    """Kernel band ``(band_lo, band_hi)``: key j is allowed for query i iff
    ``i + band_lo <= j <= i + band_hi``, clamped to [-Lq, Lk] (int32-safe, same meaning), plus
    whether each side cuts any row."""
    try:
        offset, left, right = operator.index(offset), operator.index(left), operator.index(right)
    except TypeError:
        raise TypeError(f"offset, left, right must be integers, got {offset!r}, {left!r}, "
                        f"{right!r}") from None
    lo = min(max(offset - left, -Lq), Lk)
    hi = min(max(offset + right, -Lq), Lk)
    return lo, hi, lo > 1 - Lq, hi < Lk - 1


#: Whether :func:`_mask_args` gives the kernels a mask whose rows start on 16-element boundaries
#: (a copy where the caller's do not). Off only to study the unaligned loads
#: (bench/triton_bounds.py --unaligned-mask).
ALIGN_MASK = True


def _aligned_mask(mask):
    """``mask``, or a copy of it whose data pointer is 16-byte aligned and whose strides but the
    last are multiples of 16 elements: rows padded to a multiple of 16 elements, broadcast
    dimensions left broadcast (only the distinct elements are copied).

    Triton specializes an integer argument on its divisibility by 16, and only then can it load a
    mask tile in 16-byte vectors (cp.async, pipelined through shared memory). A mask whose row
    stride is the key length is not aligned for most lengths (a (B, 1, Lq, Lk) padding mask at
    Lk = 40): each element is then a load of its own with a 64-bit address, and on sm_90
    (Triton 3.6, fastattn.aot) the forward spilled 0.7-1.3 KB at 255 registers (bf16 D128
    64x64 w4s3, 1284/2428 B; the same launch at Lk = 48: none); the backward kernels 4-84 B.
    PyTorch pads the bias of its memory-efficient kernel the same way. Not while torch.compile
    traces (sizes and pointers are symbolic there)."""
    strides = mask.stride()
    if (not ALIGN_MASK or descriptors.traced(mask)
            or (mask.data_ptr() % 16 == 0 and all(s % 16 == 0 for s in strides[:-1]))):
        return mask
    distinct = mask[tuple(slice(None) if s else slice(0, 1) for s in strides)]
    width = tuning.cdiv(mask.shape[-1], 16) * 16
    padded = torch.empty((*distinct.shape[:-1], width), dtype=mask.dtype, device=mask.device)
    padded = padded[..., :mask.shape[-1]]
    padded.copy_(distinct)
    return padded.expand(mask.shape)


def _mask_args(mask, q):
    """(tensor, its 4 strides, HAS_MASK, MASK_BOOL); q stands in as an unused pointer. The
    tensor is :func:`_aligned_mask`'s."""
    if mask is None:
        return q, (0, 0, 0, 0), False, False
    if mask.dtype == torch.bool:
        mask = mask.view(torch.uint8)
    mask = _aligned_mask(mask)
    return mask, mask.stride(), True, mask.dtype == torch.uint8


def _dropout_args(dropout_p, seed):
    """(seed and threshold as int32 bit patterns, 1 / (1 - p), HAS_DROPOUT)."""
    if dropout_p == 0:
        return 0, 0, 1.0, False
    if isinstance(seed, bool) or not isinstance(seed, int):
        raise TypeError(f"seed must be an int when dropout_p > 0, got {type(seed).__name__}")
    threshold = math.floor(dropout_p * 2.0**32)

    def as_i32(x):
        x %= 2**32
        return x - 2**32 if x >= 2**31 else x

    return as_i32(seed), as_i32(threshold), 1.0 / (1.0 - dropout_p), True


def _head_block(d):
    return max(16, tuning.next_power_of_2(d))


def _dot_precision(dtype):
    return "ieee" if dtype == torch.float32 else "tf32"


def _bwd_delta(out, dout, delta, strides, slices, H, Lq, Dv):
    """delta[slice, row] = rowsum(dO * O) in float32, the backward's first launch (dense and
    packed): ``slices`` (batch, head) slices of Lq rows, ``strides`` the batch, head and row
    strides of out, then of dout. float32 rows at 8 warps: at 4, the 64 x 128 float32 tiles of
    O and dO spilled 4/4 B on sm_90 (D80, D128)."""
    tuning.wrap_triton(_attn_bwd_preprocess_kernel)[(tuning.cdiv(Lq, _PRE_BLOCK_M) * slices,)](
        out, dout, delta, *strides, H, Lq,
        HEAD_DIM_V=Dv, BLOCK_DV=_head_block(Dv), BLOCK_M=_PRE_BLOCK_M,
        num_warps=8 if out.dtype == torch.float32 else 4,
    )


def _strides3(*tensors):
    """The batch, head and row strides of each (B, H, L, D) tensor, in order."""
    return tuple(s for t in tensors for s in t.stride()[:3])


@dataclasses.dataclass
class _Call:
    """What every launcher of these kernels (forward, backward, JVP) derives from its arguments
    in the same way: the dims, q/k/v, the mask tensor and its strides,
    the scalar arguments and the constexprs they share."""
    B: int
    H: int
    Hkv: int
    Lq: int
    Lk: int
    D: int
    Dv: int
    q: torch.Tensor
    k: torch.Tensor
    v: torch.Tensor
    mask: torch.Tensor
    mask_strides: tuple
    scalars: tuple  # H, GROUP, Lq, Lk, lq_bucket, lk_bucket, scale, qk_scale, band, dropout
    consts: dict    # HEAD_DIM ... DOT_PRECISION

    @property
    def fwd_scalars(self):
        """:attr:`scalars` less the plain scale (the forward uses only qk_scale)."""
        return self.scalars[:6] + self.scalars[7:]


def _prepare(q, k, v, mask, scale, offset, left, right, dropout_p, seed):
    B, H, Hkv, Lq, Lk, D, Dv = _dims(q, k, v, mask)
    scale = float(scale)
    band_lo, band_hi, lo_bounded, hi_bounded = _band(Lq, Lk, offset, left, right)
    mask_t, mask_strides, has_mask, mask_bool = _mask_args(mask, q)
    seed32, threshold, rcp_keep, has_dropout = _dropout_args(dropout_p, seed)
    scalars = (H, H // Hkv, Lq, Lk, tuning.bucket(Lq), tuning.bucket(Lk), scale,
               scale * _LOG2E.value, band_lo, band_hi, seed32, threshold, rcp_keep)
    consts = dict(
        HEAD_DIM=D, HEAD_DIM_V=Dv, BLOCK_D=_head_block(D), BLOCK_DV=_head_block(Dv),
        HAS_MASK=has_mask, MASK_BOOL=mask_bool, LO_BOUNDED=lo_bounded, HI_BOUNDED=hi_bounded,
        HAS_DROPOUT=has_dropout, DOT_PRECISION=_dot_precision(q.dtype),
    )
    return _Call(B, H, Hkv, Lq, Lk, D, Dv, q, k, v, mask_t, mask_strides, scalars, consts)


def attention_forward(q, k, v, mask, scale, offset, left, right, dropout_p, seed):
    """Attention forward; returns ``(out, lse)``.

    q (B, H, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv) with H % Hkv == 0; mask None or
    (B, H, Lq, Lk) bool (True = allowed) or float (added to the scores), usually a broadcast
    view; scale a float (fastattn.ops passes 1/sqrt(D) by default); band (offset, left, right)
    as in docs/numerics.md;
    dropout_p in [0, 1) with an int seed. out is (B, H, Lq, Dv) in q's dtype, lse (B, H, Lq)
    float32.
    """
    c = _prepare(q, k, v, mask, scale, offset, left, right, dropout_p, seed)
    B, H, Lq, q = c.B, c.H, c.Lq, c.q
    out = torch.empty((B, H, Lq, c.Dv), dtype=q.dtype, device=q.device)
    lse = torch.empty((B, H, Lq), dtype=torch.float32, device=q.device)
    if B * H == 0:
        return out, lse

    def grid(meta):
        return (tuning.cdiv(Lq, meta["BLOCK_M"]) * B * H,)

    args = (q, c.k, c.v, out, lse, c.mask, *_strides3(q, c.k, c.v, out), *c.mask_strides,
            *c.fwd_scalars)
    consts = c.consts
    kernel = tuning.wrap_triton(_attn_fwd_kernel)[grid]

    def launch(use_tma):
        kernel(*args, USE_TMA=use_tma, FIXUP=False, **consts)
        if use_tma and _picked_warp_specialized():
            _fwd_fixup(args, consts, tuning.cdiv(Lq, 64) * B * H)

    descriptors.launch(launch, descriptors.use_tma(q, c.k, c.v),
                       ws_candidate=not (consts["HAS_MASK"] or consts["HAS_DROPOUT"]))
    return out, lse


def _picked_warp_specialized():
    """Whether the forward's autotuner ran a warp-specialized config last (never while
    torch.compile traces: those configs need the descriptor path)."""
    config = getattr(_attn_fwd_kernel, "best_config", None)
    return config is not None and config.kwargs.get("WARP_SPECIALIZE", False)


def _fwd_fixup(args, consts, programs):
    """The careful pass of the NaN rule after a warp-specialized forward (which cannot hold it
    in its own program): a FIXUP launch of the forward kernel, 64-row blocks on the pointer
    path, that re-reads each block's output and recomputes only blocks that hold a NaN. Costs a
    launch and one read of O, on that path only. 8 warps: with 4 its careful branch spilled
    12 B at D128 (fastattn.aot on the FIXUP variant: 112-122 registers, no spills at D64 and
    D128; warp-specialized configs exist only up to D128)."""
    _attn_fwd_kernel.fn[(programs,)](
        *args, USE_TMA=False, FIXUP=True, BLOCK_M=64, BLOCK_N=64, WARP_SPECIALIZE=False,
        num_warps=8, num_stages=1, **consts)


def attention_backward(dout, q, k, v, out, lse, mask, scale, offset, left, right, dropout_p, seed,
                       need_dmask):
    """Attention backward; returns ``(dq, dk, dv, dmask)``.

    Arguments as for :func:`attention_forward`, plus dout and the forward's out (both
    (B, H, Lq, Dv)) and lse ((B, H, Lq) float32). dq, dk, dv have the shapes and dtypes of
    q, k, v (dk, dv summed over each GQA group). dmask is the float32 (B, H, Lq, Lk) tensor dS,
    the gradient of the scores after the mask is added, when need_dmask, else None; the caller
    reduces it to the mask's shape.
    """
    c = _prepare(q, k, v, mask, scale, offset, left, right, dropout_p, seed)
    B, H, Hkv, Lq, Lk, D, Dv, q, k, v = c.B, c.H, c.Hkv, c.Lq, c.Lk, c.D, c.Dv, c.q, c.k, c.v
    for name, x in (("out", out), ("dout", dout)):
        tuning.check_layout("attention", name, x, (q.dtype,))
    lse = lse.contiguous()
    dq = torch.empty((B, H, Lq, D), dtype=q.dtype, device=q.device)
    dk = torch.empty((B, Hkv, Lk, D), dtype=k.dtype, device=q.device)
    dv = torch.empty((B, Hkv, Lk, Dv), dtype=v.dtype, device=q.device)
    dmask = None
    if need_dmask:
        if Lq * Lk >= 2**31:  # dS rows are addressed as row * Lk + key in int32
            raise ValueError(f"the float-mask gradient needs Lq * Lk < 2**31, got {Lq} * {Lk}")
        dmask = torch.empty((B, H, Lq, Lk), dtype=torch.float32, device=q.device)
    if B * H == 0:
        return dq, dk, dv, dmask
    delta = torch.empty((B, H, Lq), dtype=torch.float32, device=q.device)

    _bwd_delta(out, dout, delta, _strides3(out, dout), B * H, H, Lq, Dv)

    def grid_kv(meta):
        return (tuning.cdiv(Lk, meta["BLOCK_N"]) * B * Hkv,)

    def grid_q(meta):
        return (tuning.cdiv(Lq, meta["BLOCK_M"]) * B * H,)

    tma = descriptors.use_tma(q, k, v, dout)
    dkdv_kernel = tuning.wrap_triton(_attn_bwd_dkdv_kernel)[grid_kv]
    dkdv_args = (q, k, v, dout, lse, delta, dk, dv, c.mask, *_strides3(q, k, v, dout, dk, dv),
                 *c.mask_strides, *c.scalars)
    descriptors.launch(lambda use_tma: dkdv_kernel(*dkdv_args, USE_TMA=use_tma, **c.consts), tma)
    dq_kernel = tuning.wrap_triton(_attn_bwd_dq_kernel)[grid_q]
    dq_args = (q, k, v, dout, lse, delta, dq, dq if dmask is None else dmask, c.mask,
               *_strides3(q, k, v, dout, dq), *c.mask_strides, *c.scalars)
    descriptors.launch(lambda use_tma: dq_kernel(*dq_args, USE_TMA=use_tma, NEED_DMASK=need_dmask,
                                                 **c.consts), tma)
    return dq, dk, dv, dmask
