"""Fused scaled dot-product attention (forward and backward) in Triton.

Math (per batch ``b`` and query head ``h``; kv head ``h // (H // Hkv)``)::

    S   = scale * Q K^T + M          M: float mask, or 0 / -inf from a bool mask, and -inf
                                     outside the band  i + offset - left <= j <= i + offset + right
    lse = log sum_j exp(S_ij)        -inf for a row with nothing to attend
    P   = exp(S - lse)               0 for such a row
    O   = (P * Z) V                  Z = keep / (1 - p), keep from rng.dropout_keep (1 if p = 0)

    delta = rowsum(dO * O)
    dV    = (P * Z)^T dO
    dS    = P * (Z * (dO V^T) - delta)          (also the gradient of a float mask)
    dQ    = scale * dS K,     dK = scale * dS^T Q

Work split (all grids are 1-D, query/key blocks fastest so programs of one head run together):

* forward: one program per (BLOCK_M query rows, b, h). It streams over the BLOCK_N key tiles
  that intersect the band with an online softmax (running max and sum, exp2 with log2(e)
  folded into the scale) and writes O and lse;
* backward, three kernels and no atomics, so the result is deterministic:
  - preprocess: delta = rowsum(dO * O), one program per (BLOCK_M rows, b, h);
  - dK/dV: one program per (BLOCK_N keys, b, kv head); it loops over the query heads of its GQA
    group and, for each, over the query tiles inside the band, so dK and dV are reduced over the
    group in registers;
  - dQ: one program per (BLOCK_M rows, b, h), looping over the key tiles inside the band; it
    also writes dS (the float-mask gradient) when asked, zeros outside the band included.

Tile loops are split into [edge, interior, edge] ranges: tiles fully outside the band are never
visited, and tiles fully inside it (no padding keys, nor padding queries where they matter) run
without band or bounds arithmetic. Each loop (``_fwd_tiles``, ``_dkdv_tiles``, ``_dq_tiles``,
over one step ``_*_tile``) is written once and unrolled over constexpr stages
(:func:`_stage_bounds`); the careful path and the warp-specialized loop run one stage of edge
tiles. A mask tensor, when given, is read through its four strides
(stride 0 on broadcast dimensions) in every tile.

Block sizes, warps and stages are autotuned on GPU (keys: Lq and Lk rounded up to powers of two
(``kernels.tuning.bucket``), head dims, dtypes, mask, band, dropout and descriptor flags); under
TRITON_INTERPRET a single 16 x 16 config is used. The pruner keeps configs whose live tile values
fit the registers (no spills for sm_90; ``python -m fastattn.aot`` checks every kept config).

Hopper path (USE_TMA): the q/k/v/dO row tiles are read through tensor descriptors built in the
kernel over each (batch, head) slice, so Triton issues TMA bulk copies, and rows or columns past
the slice read as zero without masks. Taken by default on compute capability >= 9 when the
installed Triton has ``tl.make_tensor_descriptor`` and the tensors are 16-byte aligned (base
and row strides), never while torch.compile traces (FASTATTN_TRITON_TMA /
``kernels.descriptors.TMA``: auto, 1, 0).
On it, the forward also autotunes warp-specialized variants of its interior key loop
(``tl.range(warp_specialize=True)``, Triton >= 3.4) when there is no mask tensor and no dropout.
Should Triton fail to build either feature on this GPU, it is switched off for the process
(logged at debug level, reported by ``kernels.descriptors.tma_status``) and the pointer kernels
run instead.

Files: this one holds the kernels, their autotuning configs and pruner; the launchers
(``attention_forward``, ``attention_backward``) are in kernels/attention_launch.py, the policy of
the descriptor path in kernels/descriptors.py.

NaN rule (docs/numerics.md: an attended NaN propagates, a masked-out one never leaks). Pairs
outside the attended set only meet other pairs in the contractions over keys (``P V``, ``dS K``)
and over queries (``P^T dO``, ``dS^T Q``); everything else is per pair or per row. There a
masked-out 0 of P or dS that meets a NaN or inf gives NaN (IEEE ``0 * NaN``), and a NaN survives
every later step of an accumulation (``acc * alpha + x``, ``acc / l``, the store), as does the
NaN a masked score picks up (``NaN + -inf`` of a float mask, ``exp2(-inf - NaN)``): a leak always
shows as a NaN in the program's output. Hence *detect, then recompute*:

* the fast path is the tile loop above, unchanged. After it each program checks its output tile
  (forward O; dK/dV kernel dK and dV; dQ kernel dQ) for a NaN in its valid rows: the row sums
  of a [BLOCK, D] tile (a NaN makes its row's sum NaN) and a reduction, once per program, then a
  uniform branch. No NaN: the result is exact (no pair outside the attended set touched it) and
  is stored;
* a NaN (an attended one, or a leak): the program recomputes its block on the *careful* path
  (``CAREFUL`` tile steps; :func:`_fwd_careful`, :func:`_dkdv_careful`, :func:`_dq_careful`),
  in pieces of 16 rows (dK/dV: 16 keys) by 16-wide tiles on the pointer path, so that few of
  its values are live at once (whole blocks cost up to 100 registers more): scores of the pairs not attended selected to -inf
  (:func:`_attended`: bounds, band, bool mask, float mask -inf), P and dS selected to 0 there,
  dropout applied as the product P Z (IEEE: NaN * 0 is NaN), and each contraction through
  :func:`_masked_dot`: a tensor-core dot over the finite part of its second operand plus a
  rank-1 term for each row of that operand holding a NaN or inf (exact IEEE over the attended
  pairs only). dS for the float-mask gradient is re-stored. The row max needs no NaN handling:
  a NaN score's own P is ``exp2(NaN - m)`` = NaN whatever the max did with it, so l, lse and O
  of that row are NaN; an empty row is ``l == 0``;
* warp-specialized forward configs cannot hold the careful loops (Triton then does not
  specialize the kernel): they store their result unchecked, and when the autotuner picked one,
  :func:`kernels.attention_launch.attention_forward` follows with a ``FIXUP`` launch of the same kernel that re-reads
  each block's O and recomputes the blocks holding a NaN (one more launch and one read of O, on
  that path only).

Cost (predicted): the common path (no NaN in the outputs) adds no MMA, no load and no per-tile
work, only the check above once per program: about 3 operations on each of BLOCK_M x Dv values
against about 8 on each of BLOCK_M x BLOCK_N scores per key tile, i.e. 3 Dv / (8 BLOCK_N T)
of the loop's element-wise work for T key tiles: ~1% at Lk = 4096 (D 128, 64-key tiles), more
only where there are few tiles (decoding), where the kernel is bound by loading K and V anyway.
Registers: the careful branch is compiled into the same kernel (measured below). A block whose
output holds a NaN pays its fast pass plus a careful pass at small-tile speed (several times
the block's fast cost): the price falls only on inputs that already hold NaN or inf. No host
synchronisation; nothing at launch changes (torch.compile and fake tensors trace as before).

Measured (``fastattn.aot --triton --quick``: sm_90, Triton 3.6, bf16 D64 / D128, L 4096, plain
and causal; registers before -> after, 0 spills before and after in every row): forward on
the descriptor path 195-206 -> 199-206 (D64), 149-156 -> 141-148 (D128), pointer path D128
255 -> 255, warp-specialized 168 -> 168 (still specialized); the pointer-path D64 128x64 w4
config (255 before) spilled 4-28 B with the branch and is pruned (``_FWD_POINTER_VALUES``), so
128x64 w8 runs there (126). dK/dV 207-224 -> 205-242 (descriptor), 129-222 -> 166-209
(pointer); dQ 122-136 -> 128-148 (descriptor), 126-187 -> 160-184 (pointer); packed kernels
unchanged (255, 255, 168); paged 128 -> 149; the FIXUP launch 112-122. Occupancy drops only
for dQ at D64 (2 -> 1 CTA per SM on the pointer path and the causal descriptor path): to be
timed on a GPU, with the forward's D64 pointer-path config change.

Measured again (2026-11-23, every config the pruners keep, bf16; bench/aot/README.md): the
branch did cost small tiles registers after all. ptxas holds them to an occupancy tier of its
own (128 or 168 registers), and 42 bf16 variants spilled 4-92 B there (none inside a tile loop:
values kept across it for the branch, or inside the branch) plus D256 descriptor-path tiles
spilling 28 B-1.5 KB inside their loops. Now: the careful dQ re-reads the rows of k that hold a
non-finite value instead of picking them out of the register tile (:func:`_masked_dot`; dQ 16x32
w4 at D80/D128: 20-28 B -> 0), configs get ``maxnreg`` where their shared memory already bounds
the blocks per SM (:func:`_maxnreg`), and the configs that still spill are pruned (``_prune``,
:func:`_spills`). The quick set (above) compiles to the same SASS except dQ (registers 128-184 ->
122-188, same blocks per SM).

Precision: scores, softmax statistics and all accumulators are float32 (float32 inputs use
IEEE float32 dots, not TF32); P and dS are cast to the input dtype for the tensor-core dots; lse is
float32 (natural log). Fully masked rows give O = 0, lse = -inf and zero gradients, never NaN.

Limits: q/k/v in float16, bfloat16 or float32 with a unit stride on the last dimension (copied
otherwise); head dims up to 256 (padded to a power of two >= 16 with masked loads); offsets
within one (batch, head) slice must fit in int32. The pointer kernels run on every GPU that
Triton supports; the descriptor path has been checked under the interpreter only so far.
"""

import functools

import torch
import triton
import triton.language as tl

from . import descriptors, tuning
from .rng import dropout_keep

_LOG2E = tl.constexpr(1.4426950408889634)
_LN2 = tl.constexpr(0.6931471805599453)

_DTYPES = (torch.float16, torch.bfloat16, torch.float32)
_MAX_HEAD_DIM = 256

_INTERPRET = tuning.INTERPRET
# Triton's CPU interpreter multiplies the raw uint16 bits of bfloat16 dot operands
# (triton-lang/triton#11584), so under it those operands are widened to float32 first (exact).
_WIDEN_BF16_DOTS = tl.constexpr(_INTERPRET)


def _configs(gpu_shapes, interpret_shape, **extra):
    """Autotuning configs: one small fixed config under the interpreter, else ``gpu_shapes``
    as ``(BLOCK_M, BLOCK_N, num_warps, num_stages)``; ``extra`` constexprs go into each."""
    if _INTERPRET:
        gpu_shapes = [interpret_shape]
    return [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, **extra}, num_warps=w, num_stages=s)
        for bm, bn, w, s in gpu_shapes
    ]


# Warp-specialized variants exist only on GPUs and where tl.range takes the keyword; _prune
# keeps them only where they may run. Only 4-warp WS configs: Triton (3.6) does not specialize
# the 8-warp one (its SASS has no setmaxnreg; fastattn.aot checks).
_FWD_CONFIGS = _configs(
    [
        (128, 64, 4, 3), (128, 64, 8, 3), (128, 128, 8, 3), (128, 32, 4, 4),
        (64, 64, 4, 3), (64, 128, 4, 3), (64, 64, 8, 2), (64, 32, 4, 2), (32, 64, 4, 3),
        (16, 64, 4, 3), (16, 128, 4, 3), (32, 32, 4, 1), (16, 32, 4, 1),
        # decoding at head dims that are not multiples of 16 (_ragged; the 4-warp 16-row tiles
        # spill there), last so that no other launch's first config changes
        (16, 64, 8, 3),
    ],
    (16, 16, 4, 1), WARP_SPECIALIZE=False,
) + (_configs([(128, 64, 4, 3), (128, 128, 4, 2)], None, WARP_SPECIALIZE=True)
     if descriptors.HAS_WARP_SPECIALIZE and not _INTERPRET else [])
_DKDV_CONFIGS = _configs(
    [
        (32, 128, 8, 3), (64, 128, 8, 3), (64, 64, 8, 3), (32, 64, 8, 3), (32, 64, 4, 3),
        (64, 64, 4, 3), (16, 64, 4, 3), (32, 32, 8, 2), (32, 32, 4, 2), (32, 32, 4, 1),
        (16, 32, 4, 1), (32, 16, 8, 2),
        # 64 query rows a step at D128, where the pruner kept only 32 (issue 12's first GPU run:
        # the backward at 0.33-0.45 of cuDNN there); last, so the first kept config is unchanged
        (64, 64, 8, 2), (64, 32, 8, 3),
    ],
    (16, 16, 4, 1),
)
_DQ_CONFIGS = _configs(
    [
        (128, 64, 8, 3), (128, 32, 8, 3), (64, 64, 8, 3), (64, 64, 4, 3), (64, 32, 4, 2),
        (32, 64, 4, 3), (16, 64, 4, 3), (16, 32, 4, 2), (32, 32, 4, 1), (16, 32, 4, 1),
    ],
    (16, 16, 4, 1),
)

# float32 inputs have configs of their own: their IEEE dots lower to FMA loops (no tensor cores),
# where each thread holds whole rows of both operands, so the register model below does not
# apply. These are the configs that compiled with 0 spills at head dims 64, 80, 128 and 256 on
# sm_90 (Triton 3.6, pointer path, which float32 takes: kernels.descriptors.use_tma), out of 12
# small tiles tried per kernel (bench/aot/README.md); the first runs untuned. 32-row forward tiles
# for decoding too: no 16-row one was clean at every head dim.
_FP32_CONFIGS = {
    "fwd": _configs([(32, 16, 8, 2), (32, 16, 8, 3), (32, 16, 8, 1)], (16, 16, 4, 1),
                    WARP_SPECIALIZE=False),
    "dkdv": _configs([(32, 16, 8, 1)], (16, 16, 4, 1)),
    "dq": _configs([(16, 16, 4, 2), (16, 16, 4, 1)], (16, 16, 4, 1)),
}

# Register budget per kernel, in live tile values per thread (a float32 value is one register,
# a 16-bit one half): what each program keeps across its key/query loop, divided by its
# threads. The limits are the largest that compile without spills for sm_90 (fastattn.aot
# checks every kept config): forward 160 (bf16 D64 128x64 w4 = 160 holds, D128 = 256 spills),
# dK/dV 136 (D64 32x128 w8 = 136 holds; D64 64x128 w8 = 176 and D128 64x64 w8 = 160 spill, but
# for the 2-stage descriptor-path one: _measured_clean),
# dQ 160 (D128 128x64 w8 = 192 spills on the pointer path). The pointer path at head dims > 128
# also holds 256-wide pointer tensors: there a budget is POINTER_WIDE of that (D256 forward
# 64x64 w8 = 112, dK/dV 32x32 w8 = 136 and dQ 64x64 w8 = 160 spilled 4-104 B).
_VALUES_PER_THREAD = {"fwd": 160, "dkdv": 136, "dq": 160}
_POINTER_WIDE = 0.65
# The forward on the pointer path, less: its NaN-rule branch (the careful path, module docstring)
# costs the D64 128x64 w4 config (160, 255 registers before the branch) 4-28 B of spills.
_FWD_POINTER_VALUES = 150
# The forward with a mask tensor on the pointer path counts the mask tile's addresses too (one
# value per element), within the forward's own limit: bf16 D64 64x128 w4 and 128x128 w8 (112 +
# 64) with a bool or float mask sat at 255 registers and spilled 16-92 B; 128x64 w8 (D128,
# 128 + 32) and 128x32 w4 (D64, 128 + 32) fit.
# Tiles of fewer than 64 query rows on the descriptor path (no wgmma: Triton 3.6 lowers their dots
# to mma.sync and holds each step's key and value tiles in registers) count those tiles too, with
# this limit (fwd and dQ): dQ bf16 D256 16x32 (136) fits; dQ D128 32x64 (160), D256 16x64 and
# 32x32 (208), forward D256 32x32 (168) and 32x64 (240) spilled 28-1548 B inside the tile loop;
# two that fit go with them: forward D128 16x128 (168; 156 registers with its maxnreg) and D256
# 16x64 (184; 187 registers).
_OPERAND_VALUES = 144
# Shared memory a block may have on sm_90 (227 KiB): the streamed tiles times num_stages plus the
# resident ones (bf16 D256 dQ 64x64 with 3 stages asked 257 KiB and cannot launch).
_SHARED_BYTES = 227 * 1024


def _shared_bytes(kernel, bm, bn, block_d, block_dv, elem_bytes, stages, mask_bytes=0):
    """Shared memory of one program: the key/value (dK/dV: query/dO) tiles of every pipeline
    stage, and the tiles that stay (forward: q; dQ: q and dO; dK/dV: k and v); with a mask
    tensor of ``mask_bytes`` an element, the forward and dQ also stage its BM x BN tiles in all
    stages but one. Exact for every 64- and 128-row forward and dQ config of the gate's mask
    cases (Triton 3.6, sm_90, 2026-11-26: e.g. forward 128x64 w8s3 D128, 131,072 B plain,
    163,840 with a bf16 mask, 196,608 with a float32 one); above what Triton asks for on
    smaller tiles."""
    width = (block_d + block_dv) * elem_bytes
    if kernel == "dkdv":
        return stages * bm * width + bn * width
    resident = block_d if kernel == "fwd" else block_d + block_dv
    return (stages * bn * width + bm * resident * elem_bytes
            + max(stages - 1, 0) * bm * bn * mask_bytes)


def _live_values(kernel, bm, bn, block_d, block_dv, elem_bytes, warps, mask=False,
                 operands=False):
    """Live values per thread of one program of ``kernel`` with a BM x BN tile; ``mask``: the
    forward reads a mask tensor (its BM x BN addresses); ``operands``: the key and value tiles
    of each step are held in registers too (:data:`_OPERAND_VALUES`)."""
    half = elem_bytes / 4   # registers per input element
    if kernel == "fwd":     # acc (BM x DV), scores/probabilities (BM x BN), q (BM x D)
        live = bm * block_dv + bm * bn + bm * block_d * half + (bm * bn if mask else 0)
        live += bn * (block_d + block_dv) * half if operands else 0
    elif kernel == "dkdv":  # dk, dv accumulators, k and v tiles, scores and dS, q and dO tiles
        live = (bn * (block_d + block_dv) * (1 + half) + 2 * bm * bn
                + bm * (block_d + block_dv) * half)
    else:                   # dq accumulator, q and dO tiles, scores and dS
        live = bm * block_d + bm * (block_d + block_dv) * half + 2 * bm * bn
        live += bn * (block_d + block_dv) * half if operands else 0
    return live / (32 * warps)


def _mask_bytes(args):
    """Bytes of a mask element of the launch (0 without a mask tensor)."""
    return args["Mask"].element_size() if args["HAS_MASK"] and "Mask" in args else 0


def _spills(kernel, config, args):
    """Configs the register model above keeps but that spill on sm_90 (Triton 3.6; measured
    with ``fastattn.aot``, bench/aot/README.md), each for the launches it was measured on:
    small tiles that ptxas holds to its 128- or 168-register tier, where nothing in the cold
    NaN-rule branch or the tile loop is left to trim."""
    bm, bn, warps = config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps
    float_mask = args["HAS_MASK"] and not args.get("MASK_BOOL", True) and not args["USE_TMA"]
    fp32_mask_dropout = (args["HAS_DROPOUT"] and _mask_bytes(args) == 4
                         and args["Q"].element_size() == 2)
    ragged, wide_d, wide = _ragged(args), args["BLOCK_D"] >= 128, _wide(args)
    return (
        # Head dims that are not multiples of 16 (_ragged), measured at D40, D72, D100 (and
        # D100 with Dv 1, a bool mask and a window) and D200 (2026-11-27): the forward's 4-warp
        # 16-row tiles of 64 keys or more (16x64 8-32 B, 16x128 24-1288 B; the 8-warp 16x64 is
        # clean up to BLOCK_D 128, and at D200 16x32 w4s1 is), 64x128 w4 (40 B), 64x64 w4 at
        # BLOCK_D 128 (12-16 B); dK/dV 64-row tiles at BLOCK_D 128 (8-156 B); dQ 64x64 w8s3
        # (140 B), 32x64 w4 and 16x64 w4 (4-16 B) there. Elsewhere the 8-warp 16x64 forward is
        # the one that spills (D64 decoding: 12/24 B at 80 registers; D200: 20/24 B).
        (kernel == "fwd" and bm == 16 and warps == 8 and not (ragged and not wide))
        or (ragged and kernel == "fwd" and bm == 16 and warps == 4 and bn >= 64)
        or (ragged and kernel == "fwd" and warps == 4
            and ((bm, bn) == (64, 128) or (wide_d and (bm, bn) == (64, 64))))
        or (ragged and wide_d and kernel == "dkdv" and bm == 64)
        or (ragged and wide_d and kernel == "dq"
            and (bm, bn, warps) in ((64, 64, 8), (32, 64, 4), (16, 64, 4)))
        # dQ 32x64 w4 on the descriptor path: spills inside its loop at every head dim (D64 at
        # ptxas's 168 tier, 16/24 B; D80/D128 at 255, 8/12 B; D256 1.5 KB)
        or (kernel == "dq" and args["USE_TMA"] and (bm, bn, warps) == (32, 64, 4))
        # dK/dV 32x32 and 32x16 w8 (8 warps on a tiny tile): ptxas holds them to 128
        # registers (2 blocks of 8 warps; its next tier, 255, halves the blocks per SM) and the
        # careful branch does not fit there: at BLOCK_D 128 (32x32: 16-44 B, 32x16: 36/44 B on
        # the pointer path) and, 32x32, with a mask tensor at D64 (12/32 B)
        or (kernel == "dkdv" and (bm, bn, warps) == (32, 32, 8)
            and (args["BLOCK_D"] == 128 or args["HAS_MASK"]))
        or (kernel == "dkdv" and (bm, bn, warps) == (32, 16, 8) and args["BLOCK_D"] == 128
            and not args["USE_TMA"])
        # dQ 32x64 w4 with a bool mask at D64, pointer path: 8/8 B since the careful dot
        # re-reads k's rows (which took dQ 16x32 w4 at D80/D128 from 20-28 B to 0)
        or (kernel == "dq" and not args["USE_TMA"] and args["HAS_MASK"]
            and args["BLOCK_D"] == 64 and (bm, bn, warps) == (32, 64, 4))
        # forward 16x64 w4 at head dim 80 on the descriptor path: 128 registers, 4/4 B
        or (kernel == "fwd" and args["USE_TMA"] and args.get("HEAD_DIM") == 80
            and (bm, bn, warps) == (16, 64, 4))
        # forward D256 32x32 w4s1 on the pointer path: 168 registers (ptxas's tier), 20/20 B
        or (kernel == "fwd" and not args["USE_TMA"] and args["BLOCK_D"] == 256
            and (bm, bn, warps, config.num_stages) == (32, 32, 4, 1))
        # forward with a float mask on the pointer path: D64 32x64 w4 (128 registers, 16/24 B),
        # D128 64x64 w4 (255 registers, 4/4 B)
        or (kernel == "fwd" and float_mask and warps == 4
            and (bm, bn, args["BLOCK_D"]) in ((32, 64, 64), (64, 64, 128)))
        # a float32 mask with 16-bit inputs and dropout, L1k (2026-11-26): forward D64 16x128
        # w4 (168 registers, 4/4 B); dK/dV D64 32x16 w8 (128, 4/8 B)
        or (fp32_mask_dropout
            and (kernel, bm, bn, warps, args["BLOCK_D"]) in (
                ("fwd", 16, 128, 4, 64), ("dkdv", 32, 16, 8, 64)))
        # a mask tensor (pointer path) with a causal band or a window (2026-11-27, the gate's
        # "causal bool mask" and "L33x40 window bool mask" cases): dK/dV D128 64x32 w8s3
        # (255 registers, 20-32 B; with a float32 mask and dropout 20 B); with both band sides
        # bounded, the forward's 16-row tiles at ptxas's 168 tier, 16x128 at D64 (20 B) and
        # 16x64 at D128 (12 B), and dQ 16x64 w4 at D128 (8/16 B); dQ 16x32 w4s2 at D64, causal
        # (96 registers, 16/28 B)
        or (args["HAS_MASK"] and not args["USE_TMA"]
            and ((kernel, bm, bn, warps, args["BLOCK_D"]) in (
                ("dkdv", 64, 32, 8, 128), ("dq", 16, 32, 4, 64))
                 or (args.get("LO_BOUNDED") and args.get("HI_BOUNDED") and warps == 4
                     and (kernel, bm, bn, args["BLOCK_D"]) in (
                         ("fwd", 16, 128, 64), ("fwd", 16, 64, 128), ("dq", 16, 64, 128)))))
    )


def _measured_clean(kernel, config, args):
    """Configs the register model rejects that compile without spills on sm_90 (Triton 3.6,
    ``fastattn.aot``, 2026-11-26): dK/dV 64x64 w8 with two stages at BLOCK_D 128 on the
    descriptor path, 16-bit (252-255 registers, 0 B, every D128 case of the gate: plain, causal,
    window; with three stages it spills 56-76 B, on the pointer path 60-136 B). Not with a mask
    tensor or dropout: with a float32 bias and dropout it spills 80/124 B (the same day)."""
    return (kernel == "dkdv" and args["USE_TMA"] and args["BLOCK_D"] == 128
            and not args["HAS_MASK"] and not args["HAS_DROPOUT"]
            and args["BLOCK_DV"] == 128 and args["Q"].element_size() == 2
            and (config.kwargs["BLOCK_M"], config.kwargs["BLOCK_N"], config.num_warps,
                 config.num_stages) == (64, 64, 8, 2))


def _plain_copy(config):
    return triton.Config({**config.kwargs, "WARP_SPECIALIZE": False},
                         num_warps=config.num_warps, num_stages=config.num_stages)


# Registers per SM and shared memory per SM on sm_80 / sm_90 (the 227 KiB a block may have, plus
# the 1 KiB the driver reserves per block).
_REGS_PER_SM = 65536
_SHARED_PER_SM = 228 * 1024


def _maxnreg(kernel, bm, bn, block_d, block_dv, elem_bytes, stages, warps, live):
    """The register limit a config runs with (``triton.Config(maxnreg=...)``), or None.

    ptxas, left alone, holds small-tile kernels to an occupancy tier of its own choosing
    (128 registers: 4 blocks of 4 warps or 2 of 8 per SM; or 168: 3 of 4 warps), whatever the
    shared memory allows; the NaN rule's careful branch (cold, after the tile loop) no longer
    fits there, and these variants spilled 4-92 B (bench/aot/README.md, 2026-11-23 second
    section: no spill was inside a tile loop). Rule: where the config's shared memory already
    allows no more blocks per SM than a higher register count would, give it that count -- the
    most registers per thread that keep as many blocks per SM as the shared memory allows (at
    most 255). Occupancy is unchanged by construction. Only where that is above ptxas's 128
    tier, and a limit below 255 only for tiles of at most 64 ``live`` values per thread: ptxas
    gives larger tiles 255 registers by itself where they need them, and a 168 limit there
    cut fwd bf16 D64 64x128 w4 (bool mask, 255 registers) to 168 and doubled its spills.
    Shared memory per block as Triton 3.6 lays it out on sm_90: the streamed tiles of
    ``stages - 1`` buffers plus the resident ones (within a few KiB of ``metadata.shared`` over
    the gate's cases)."""
    if kernel == "fwd" and bm == 16 and max(block_d, block_dv) > 128:
        # Decoding at head dims > 128 (16-row tiles are all a single query keeps): ptxas holds
        # fp16 16x32 w4s1 at its 168 tier and spills 24-40 B; bf16 takes 191-193 registers by
        # itself, i.e. the 2 blocks of 4 warps per SM that 255 gives both.
        return 255
    streamed = _shared_bytes(kernel, bm, bn, block_d, block_dv, elem_bytes, max(stages - 1, 1))
    blocks = max(1, _SHARED_PER_SM // (streamed + 1024))
    regs = min(255, _REGS_PER_SM // (blocks * 32 * warps) // 8 * 8)
    if regs <= 128 or (regs < 255 and live > 64):
        return None
    return regs


def _wide(args):
    """Whether a head dim of the launch is above 128 (BLOCK_D or BLOCK_DV 256)."""
    return max(args["BLOCK_D"], args["BLOCK_DV"]) > 128


def _ragged(args):
    """Whether a head dim of the launch is not a multiple of 16 (40, 100, ...): then neither are
    the row strides of q, k or v, their tiles are loaded element by element into registers
    (no cp.async), and a register limit below 255 spilled KBs."""
    return bool(args.get("HEAD_DIM", args["BLOCK_D"]) % 16
                or args.get("HEAD_DIM_V", args["BLOCK_DV"]) % 16)


def _with_maxnreg(config, maxnreg):
    return triton.Config(dict(config.kwargs), num_warps=config.num_warps,
                         num_stages=config.num_stages, maxnreg=maxnreg)


def _prune(configs, named_args, kernel, **kwargs):
    """Configs of ``kernel`` ("fwd", "dkdv", "dq") worth timing for this launch: query tiles not
    much taller than Lq (decoding), live values per thread within the kernel's register budget
    (:data:`_VALUES_PER_THREAD`; less on the pointer path at head dims > 128, and for its
    forward; no spills), tiles within the shared memory of a block, more than one stage unless
    the head dim is > 128.
    Configs that :func:`_spills` names are dropped, those that :func:`_measured_clean` names
    are kept over the register model; the others get ``maxnreg`` by :func:`_maxnreg`.
    Warp-specialized configs (Triton places their registers itself; fastattn.aot checks them)
    stay only on the descriptor path, with 16-bit inputs (float32's IEEE dots are not
    specialized), without a mask tensor or dropout (the plain loop that Triton's automatic warp
    specialization handles), where :func:`descriptors.warp_specialize_ok`.
    float32 takes :data:`_FP32_CONFIGS` instead. Never returns nothing (the config with the
    fewest live values); only the first config when autotuning is off (kernels.tuning)."""
    args = {**named_args, **kwargs}
    elem_bytes = args["Q"].element_size()
    if elem_bytes == 4 and not _INTERPRET:  # with only the constexprs the caller's kernel takes
        keys = configs[0].kwargs.keys()     # (the JVP's forward has no WARP_SPECIALIZE)
        return tuning.limit([triton.Config({k: v for k, v in c.kwargs.items() if k in keys},
                                           num_warps=c.num_warps, num_stages=c.num_stages)
                             for c in _FP32_CONFIGS[kernel]])
    rows = max(16, args["lq_bucket"])
    wide = _wide(args)
    ws_ok = (args["USE_TMA"] and not args["HAS_MASK"] and not args["HAS_DROPOUT"]
             and elem_bytes == 2 and descriptors.warp_specialize_ok())

    def operands(c):
        return args["USE_TMA"] and kernel != "dkdv" and c.kwargs["BLOCK_M"] < 64

    def live(c):
        return _live_values(kernel, c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], args["BLOCK_D"],
                            args["BLOCK_DV"], elem_bytes, c.num_warps,
                            mask=args["HAS_MASK"] and not args["USE_TMA"], operands=operands(c))

    mask_bytes = _mask_bytes(args)

    def fits_shared(c):
        return _shared_bytes(kernel, c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], args["BLOCK_D"],
                             args["BLOCK_DV"], elem_bytes, c.num_stages,
                             mask_bytes) <= _SHARED_BYTES

    limit = _VALUES_PER_THREAD[kernel] * (_POINTER_WIDE if wide and not args["USE_TMA"] else 1)
    mask_limit = limit  # (the forward's mask tile on the pointer path, above)
    if kernel == "fwd" and not args["USE_TMA"]:
        limit = min(limit, _FWD_POINTER_VALUES)

    def fits(c):
        if operands(c):
            return live(c) <= min(limit, _OPERAND_VALUES)
        if args["HAS_MASK"] and kernel == "fwd" and not args["USE_TMA"]:
            return _live_values(kernel, c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"],
                                args["BLOCK_D"], args["BLOCK_DV"], elem_bytes,
                                c.num_warps) <= limit and live(c) <= mask_limit
        return live(c) <= limit
    plain = ([c for c in configs if not c.kwargs.get("WARP_SPECIALIZE", False)]
             or [_plain_copy(c) for c in configs])  # WS-only lists run as the plain loop
    kept = [c for c in plain
            if c.kwargs["BLOCK_M"] <= rows and fits_shared(c) and (wide or c.num_stages > 1)
            and (fits(c) or _measured_clean(kernel, c, args)) and not _spills(kernel, c, args)]
    if not _INTERPRET and not _ragged(args):  # (WS configs: Triton sizes their registers)
        kept = [_with_maxnreg(c, n) if (n := _maxnreg(
            kernel, c.kwargs["BLOCK_M"], c.kwargs["BLOCK_N"], args["BLOCK_D"], args["BLOCK_DV"],
            elem_bytes, c.num_stages, c.num_warps, live(c))) else c for c in kept]
    if ws_ok:  # after the plain ones: the first kept config is what runs untuned (the tests)
        kept += [c for c in configs if c.kwargs.get("WARP_SPECIALIZE", False)
                 and c.kwargs["BLOCK_M"] <= rows and not wide]
    return tuning.limit(kept or [min(plain, key=live)])


_PRE_BLOCK_M = 16 if _INTERPRET else 64

_BAND_KEYS = ["HEAD_DIM", "HEAD_DIM_V", "HAS_MASK", "LO_BOUNDED", "HI_BOUNDED", "HAS_DROPOUT"]


# ---------------------------------------------------------------------------------------------
# Device helpers
# ---------------------------------------------------------------------------------------------

@triton.jit
def _load_rows(base, offs_r, stride_r, offs_d, n_rows, DIM: tl.constexpr, BLOCK_D: tl.constexpr,
               CHECK_ROWS: tl.constexpr):
    """Load the [len(offs_r), BLOCK_D] tile ``base[r * stride_r + d]``, zero-filled for
    ``d >= DIM`` and (when CHECK_ROWS) for ``r >= n_rows``."""
    ptrs = base + offs_r[:, None] * stride_r + offs_d[None, :]
    if CHECK_ROWS:
        if DIM == BLOCK_D:
            tile = tl.load(ptrs, mask=offs_r[:, None] < n_rows, other=0.0)
        else:
            in_bounds = (offs_r[:, None] < n_rows) & (offs_d[None, :] < DIM)
            tile = tl.load(ptrs, mask=in_bounds, other=0.0)
    else:
        if DIM == BLOCK_D:
            tile = tl.load(ptrs)
        else:
            tile = tl.load(ptrs, mask=offs_d[None, :] < DIM, other=0.0)
    return tile


@triton.jit
def _rows_source(base, n_rows, stride_r, DIM: tl.constexpr, BLOCK_R: tl.constexpr,
                 BLOCK_D: tl.constexpr, USE_TMA: tl.constexpr):
    """Where :func:`_load_tile` reads [BLOCK_R, BLOCK_D] row tiles of one (batch, head) slice
    ``base[r * stride_r + d]`` (r < n_rows, d < DIM) from: a tensor descriptor over the slice
    when USE_TMA (loads become TMA copies on Hopper; rows and columns past the slice read as
    zero), else the base pointer itself."""
    if USE_TMA:
        return tl.make_tensor_descriptor(base, shape=[n_rows, DIM], strides=[stride_r, 1],
                                         block_shape=[BLOCK_R, BLOCK_D])
    else:
        return base


@triton.jit
def _load_tile(src, r0, offs_r, stride_r, offs_d, n_rows, DIM: tl.constexpr,
               BLOCK_D: tl.constexpr, CHECK_ROWS: tl.constexpr, USE_TMA: tl.constexpr):
    """The row tile starting at row ``r0`` (``offs_r = r0 + arange``) from a
    :func:`_rows_source`, zero-filled outside the slice."""
    if USE_TMA:
        tile = src.load([r0, 0])
    else:
        tile = _load_rows(src, offs_r, stride_r, offs_d, n_rows, DIM, BLOCK_D, CHECK_ROWS)
    return tile


@triton.jit
def _dot(a, b, DOT_PRECISION: tl.constexpr):
    """``a @ b`` with float32 accumulation."""
    if _WIDEN_BF16_DOTS:
        if a.dtype == tl.bfloat16:
            a = a.to(tl.float32)
            b = b.to(tl.float32)
    return tl.dot(a, b, input_precision=DOT_PRECISION)


@triton.jit
def _load_vec(ptr, offs, n, CHECK: tl.constexpr):
    """Load ``ptr[offs]``, zero-filled for ``offs >= n`` when CHECK."""
    if CHECK:
        vec = tl.load(ptr + offs, mask=offs < n, other=0.0)
    else:
        vec = tl.load(ptr + offs)
    return vec


@triton.jit
def _scores(q, k, offs_m, offs_n, mask_base, stride_mask_m, stride_mask_n, Lq, Lk, qk_scale,
            band_lo, band_hi, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr,
            LO_BOUNDED: tl.constexpr, HI_BOUNDED: tl.constexpr, EDGE: tl.constexpr,
            CHECK_ROWS: tl.constexpr, DOT_PRECISION: tl.constexpr):
    """Masked scores of one [BLOCK_M, BLOCK_N] tile in log2 units: log2(e) * S, -inf where
    attention is not allowed. Band and bounds are only applied to EDGE tiles."""
    s = _dot(q, tl.trans(k), DOT_PRECISION) * qk_scale
    if HAS_MASK:
        in_bounds = (offs_m[:, None] < Lq) & (offs_n[None, :] < Lk)
        mask_ptrs = mask_base + offs_m[:, None] * stride_mask_m + offs_n[None, :] * stride_mask_n
        mask = tl.load(mask_ptrs, mask=in_bounds, other=0)
        if MASK_BOOL:
            s = tl.where(mask != 0, s, float("-inf"))
        else:
            s = s + mask.to(tl.float32) * _LOG2E
    if EDGE:
        allowed = _in_band(offs_m, offs_n, Lq, Lk, band_lo, band_hi, LO_BOUNDED, HI_BOUNDED,
                           CHECK_ROWS)
        s = tl.where(allowed, s, float("-inf"))
    return s


@triton.jit
def _in_band(offs_m, offs_n, Lq, Lk, band_lo, band_hi, LO_BOUNDED: tl.constexpr,
             HI_BOUNDED: tl.constexpr, CHECK_ROWS: tl.constexpr):
    """[BLOCK_M, BLOCK_N] bool: key in bounds (and row, when CHECK_ROWS) and inside the band."""
    allowed = offs_n[None, :] < Lk
    if CHECK_ROWS:
        allowed = allowed & (offs_m[:, None] < Lq)
    if LO_BOUNDED:
        allowed = allowed & (offs_n[None, :] >= offs_m[:, None] + band_lo)
    if HI_BOUNDED:
        allowed = allowed & (offs_n[None, :] <= offs_m[:, None] + band_hi)
    return allowed


@triton.jit
def _attended(offs_m, offs_n, mask_base, stride_mask_m, stride_mask_n, Lq, Lk, band_lo, band_hi,
              HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, LO_BOUNDED: tl.constexpr,
              HI_BOUNDED: tl.constexpr):
    """[BLOCK_M, BLOCK_N] bool: the pairs (i, j) with j in A_i (docs/numerics.md, NaN): row and
    key in bounds, inside the band, bool mask True, float mask not -inf. The careful path's
    selector (the fast path gets the same pairs from -inf scores)."""
    allowed = _in_band(offs_m, offs_n, Lq, Lk, band_lo, band_hi, LO_BOUNDED, HI_BOUNDED, True)
    if HAS_MASK:
        mask_ptrs = mask_base + offs_m[:, None] * stride_mask_m + offs_n[None, :] * stride_mask_n
        mask = tl.load(mask_ptrs, mask=allowed, other=0)
        if MASK_BOOL:
            allowed = allowed & (mask != 0)
        else:
            allowed = allowed & (mask.to(tl.float32) != float("-inf"))
    return allowed


@triton.jit
def _masked_dot(acc, a, b, allowed, DOT_PRECISION: tl.constexpr, BLOCK_K: tl.constexpr,
                b_rows=None, stride_b=0, offs_col=None, n_cols=0):
    """``acc + sum_k [allowed_ik] a_ik b_kd`` (a [M, BLOCK_K], b [BLOCK_K, D]) in which a pair
    outside ``allowed`` is skipped, not multiplied by 0 (IEEE 0 * NaN is NaN). The finite part
    of b goes through one tensor-core dot with a's skipped entries set to 0 (exact: 0 * finite
    = 0); each row k of b that holds a non-finite value then adds, for its non-finite features
    only, ``a_ik b_kd`` on the allowed rows i (an inf or NaN added to the finite sum gives what
    IEEE summation in any order gives). The careful path's product; its rank-1 loop runs once
    per non-finite row of b. Given ``b_rows`` it reads that row again from memory (b's row k is
    ``b_rows[k * stride_b + offs_col]``, columns ``>= n_cols`` are padding): picking it out of
    the register tile b needs a cross-thread reduction of all of b and a layout change, whose
    registers the fast kernel that holds this cold branch would have to reserve (dQ bf16 D128
    16x32 w4: 20/24 B of spills at ptxas's 128-register tier, 0 with the reload). Without
    (b's rows not at a stride: the paged kernel) it picks the row out of b."""
    a = tl.where(allowed, a, 0.0).to(b.dtype)
    bf = b.to(tl.float32)
    finite = bf * 0.0 == 0.0
    acc += _dot(a, tl.where(finite, b, tl.zeros_like(b)), DOT_PRECISION)
    offs_k = tl.arange(0, BLOCK_K)
    bad = tl.max(tl.where(finite, 0, 1), 1)
    n_bad = tl.sum(bad, 0)
    while n_bad > 0:
        k = tl.min(tl.where(bad > 0, offs_k, BLOCK_K), 0)
        col = offs_k == k
        a_k = tl.sum(tl.where(col[None, :], a.to(tl.float32), 0.0), 1)
        ok_k = tl.max(tl.where(col[None, :] & allowed, 1, 0), 1) > 0
        if b_rows is None:
            b_k = tl.sum(tl.where(col[:, None], bf, 0.0), 0)
        else:
            b_k = tl.load(b_rows + k * stride_b + offs_col, mask=offs_col < n_cols,
                          other=0.0).to(tl.float32)
        acc += tl.where(ok_k[:, None] & (b_k * 0.0 != 0.0)[None, :], a_k[:, None] * b_k[None, :],
                        0.0)
        bad = tl.where(col, 0, bad)
        n_bad -= 1
    return acc


@triton.jit
def _any_nan(x, rows_ok):
    """Whether the [R, C] tile x holds a NaN in a row where rows_ok (a scalar bool), tested on
    the row sums: a NaN makes its row's sum NaN (so does a +inf with a -inf, which only costs a
    needless careful pass). Sums, not a per-element test: no [R, C] temporary."""
    row = tl.sum(x, 1)
    return tl.max(tl.where(rows_ok & (row != row), 1, 0), 0) > 0


@triton.jit
def _interior_tiles(base, num, first, last, BLOCK: tl.constexpr):
    """Of the ``num`` tiles starting at ``base + t * BLOCK``, those with ``first <= start <= last``
    are ``t`` in ``[t1, t2)`` (a contiguous range, empty when t1 == t2)."""
    t_first = tl.cdiv(tl.maximum(first - base, 0), BLOCK)
    t_last = tl.where(last >= base, (last - base) // BLOCK + 1, 0)
    t1 = tl.minimum(t_first, num)
    t2 = tl.maximum(t1, tl.minimum(t_last, num))
    return t1, t2


@triton.jit
def _query_block(H, GROUP, Lq, BLOCK_M: tl.constexpr):
    """The query block of this program (grid: query blocks fastest, then b * H + h): its
    ``bh = b * H + h``, ``b``, ``h`` and kv head (int64, for offsets) and first row ``m0``."""
    pid = tl.program_id(0)
    num_m = tl.cdiv(Lq, BLOCK_M)
    bh = pid // num_m
    m0 = (pid % num_m) * BLOCK_M
    b = (bh // H).to(tl.int64)
    h = (bh % H).to(tl.int64)
    return bh, b, h, h // GROUP, m0


@triton.jit
def _key_tiles(m0, Lq, Lk, band_lo, band_hi, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Key tiles of the query block starting at m0 that intersect the band: the tiles start at
    ``n_base + t * BLOCK_N`` for ``t < num``; ``[t1, t2)`` are fully inside it (all keys valid)."""
    m_last = tl.minimum(m0 + BLOCK_M, Lq) - 1
    n_base = (tl.maximum(m0 + band_lo, 0) // BLOCK_N) * BLOCK_N
    n_end = tl.minimum(m_last + band_hi + 1, Lk)
    num = tl.cdiv(tl.maximum(n_end - n_base, 0), BLOCK_N)
    first = m_last + band_lo
    last = tl.minimum(m0 + band_hi - BLOCK_N + 1, Lk - BLOCK_N)
    t1, t2 = _interior_tiles(n_base, num, first, last, BLOCK_N)
    return n_base, num, t1, t2


@triton.jit
def _query_tiles(n0, Lq, Lk, band_lo, band_hi, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr):
    """Query tiles of the key block starting at n0 that intersect the band: the tiles start at
    ``m_base + t * BLOCK_M`` for ``t < num``; ``[t1, t2)`` have every (row, key) pair inside it
    and no padding row (they exist only when the key block has no padding key)."""
    n_last = tl.minimum(n0 + BLOCK_N, Lk) - 1
    m_base = (tl.maximum(n0 - band_hi, 0) // BLOCK_M) * BLOCK_M
    m_end = tl.minimum(n_last - band_lo + 1, Lq)
    num = tl.cdiv(tl.maximum(m_end - m_base, 0), BLOCK_M)
    first = n0 + BLOCK_N - 1 - band_hi
    last = tl.where(n0 + BLOCK_N <= Lk, tl.minimum(n0 - band_lo - BLOCK_M + 1, Lq - BLOCK_M), -1)
    t1, t2 = _interior_tiles(m_base, num, first, last, BLOCK_M)
    return m_base, num, t1, t2


@triton.jit
def _stage_bounds(stage: tl.constexpr, num, t1, t2, SPLIT: tl.constexpr):
    """The tiles ``[begin, end)`` that loop stage ``stage`` visits. SPLIT: three stages, edge
    tiles [0, t1), interior tiles [t1, t2) (stage 1, no band or bounds arithmetic), edge tiles
    [t2, num); otherwise one stage of edge tiles [0, num). Each ``*_tiles`` loop is written once
    and unrolled over ``tl.static_range(3 if SPLIT else 1)`` stages (the constexpr STAGE of
    Triton's fused-attention tutorial), with ``EDGE = stage != 1 or not SPLIT``."""
    if not SPLIT:
        begin = 0
        end = num
    elif stage == 0:
        begin = 0
        end = t1
    elif stage == 1:
        begin = t1
        end = t2
    else:
        begin = t2
        end = num
    return begin, end


# ---------------------------------------------------------------------------------------------
# Forward
# ---------------------------------------------------------------------------------------------

@triton.jit
def _fwd_tile(acc, m_i, l_i, q, k_src, v_src, mask_base, offs_m, offs_d, offs_dv, n0,
              stride_k_n, stride_v_n, stride_mask_m, stride_mask_n, Lq, Lk, qk_scale, band_lo,
              band_hi, seed, bh, threshold,
              HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
              BLOCK_DV: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr,
              LO_BOUNDED: tl.constexpr, HI_BOUNDED: tl.constexpr, HAS_DROPOUT: tl.constexpr,
              DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, EDGE: tl.constexpr,
              USE_TMA: tl.constexpr, CAREFUL: tl.constexpr = False):
    """One online-softmax step over the key tile starting at n0. CAREFUL (the NaN-safe path,
    every tile an edge tile): scores and probabilities of the pairs not attended are selected
    to -inf and 0, and ``p @ v`` skips them (:func:`_masked_dot`)."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    k = _load_tile(k_src, n0, offs_n, stride_k_n, offs_d, Lk, HEAD_DIM, BLOCK_D, EDGE, USE_TMA)
    s = _scores(q, k, offs_m, offs_n, mask_base, stride_mask_m, stride_mask_n, Lq, Lk,
                qk_scale, band_lo, band_hi, HAS_MASK, MASK_BOOL, LO_BOUNDED, HI_BOUNDED,
                EDGE, False, DOT_PRECISION)
    if CAREFUL:
        allowed = _attended(offs_m, offs_n, mask_base, stride_mask_m, stride_mask_n, Lq, Lk,
                            band_lo, band_hi, HAS_MASK, MASK_BOOL, LO_BOUNDED, HI_BOUNDED)
        s = tl.where(allowed, s, float("-inf"))
    m_new = tl.maximum(m_i, tl.max(s, 1))
    m_safe = tl.where(m_new == float("-inf"), 0.0, m_new)
    alpha = tl.exp2(m_i - m_safe)
    p = tl.exp2(s - m_safe[:, None])
    if CAREFUL:
        p = tl.where(allowed, p, 0.0)
    l_i = l_i * alpha + tl.sum(p, 1)
    if HAS_DROPOUT:
        keep = dropout_keep(seed, bh, offs_m[:, None], offs_n[None, :], Lk, threshold)
        if CAREFUL:  # P Z as IEEE gives it (NaN * 0 is NaN; the select differs only there)
            p = p * keep.to(tl.float32)
        else:
            p = tl.where(keep, p, 0.0)
    v = _load_tile(v_src, n0, offs_n, stride_v_n, offs_dv, Lk, HEAD_DIM_V, BLOCK_DV, EDGE,
                   USE_TMA)
    if CAREFUL:
        # (v's row picked out of the tile: re-reading it cost the forward registers, D64 32x64
        # w4 0 -> 12 B of spills; it helps the backward's, see _masked_dot)
        acc = _masked_dot(acc * alpha[:, None], p, v, allowed, DOT_PRECISION, BLOCK_N)
    else:
        acc = acc * alpha[:, None] + _dot(p.to(v.dtype), v, DOT_PRECISION)
    return acc, m_new, l_i


@triton.jit
def _fwd_finish(acc, m_i, l_i, rcp_keep, HAS_DROPOUT: tl.constexpr):
    """The online softmax's end: ``out = acc / l`` (scaled by 1 / (1 - p) under dropout) and the
    natural-log ``lse``; a row with nothing to attend (l == 0) gives 0 and -inf."""
    dead = l_i == 0.0
    l_safe = tl.where(dead, 1.0, l_i)
    out = acc / l_safe[:, None]
    if HAS_DROPOUT:
        out = out * rcp_keep
    lse = tl.where(dead, float("-inf"), (m_i + tl.log2(l_safe)) * _LN2)
    return out, lse


@triton.jit
def _store_rows(out_base, offs_m, stride_o_m, offs_dv, out, lse_base, lse, Lq,
                HEAD_DIM_V: tl.constexpr):
    """Store the rows offs_m (< Lq) of O (features < HEAD_DIM_V) and of lse."""
    row_ok = offs_m < Lq
    tl.store(out_base + offs_m[:, None] * stride_o_m + offs_dv[None, :],
             out.to(out_base.dtype.element_ty),
             mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V))
    tl.store(lse_base + offs_m, lse, mask=row_ok)


# The careful path runs in pieces of _CAREFUL x _CAREFUL (rows x keys) on the pointer path: its
# live values stay far below the fast loop's, so the branch that holds it adds (almost) no
# register to the kernel; it is only taken by blocks whose output holds a NaN.
_CAREFUL = tl.constexpr(16)


@triton.jit
def _fwd_careful(q_base, stride_q_m, k_base, v_base, out_base, stride_o_m, lse_base, mask_base,
                 m0, offs_d, offs_dv, stride_k_n, stride_v_n, stride_mask_m, stride_mask_n, Lq,
                 Lk, qk_scale, band_lo, band_hi, seed, bh, threshold, rcp_keep,
                 HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
                 BLOCK_DV: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr,
                 LO_BOUNDED: tl.constexpr, HI_BOUNDED: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                 DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr):
    """The careful forward of the query block at m0 (BLOCK_M rows): O and lse of its rows,
    written to out_base / lse_base (row i at ``i * stride_o_m`` and ``i``)."""
    for r in range(0, BLOCK_M, _CAREFUL):
        offs_m = m0 + r + tl.arange(0, _CAREFUL)
        q = _load_rows(q_base, offs_m, stride_q_m, offs_d, Lq, HEAD_DIM, BLOCK_D, True)
        acc = tl.zeros([_CAREFUL, BLOCK_DV], dtype=tl.float32)
        m_i = tl.full([_CAREFUL], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([_CAREFUL], dtype=tl.float32)
        n_base, num, t1, t2 = _key_tiles(m0 + r, Lq, Lk, band_lo, band_hi, _CAREFUL, _CAREFUL)
        acc, m_i, l_i = _fwd_tiles(
            acc, m_i, l_i, q, k_base, v_base, mask_base, offs_m, offs_d, offs_dv, n_base, num,
            t1, t2, stride_k_n, stride_v_n, stride_mask_m, stride_mask_n, Lq, Lk, qk_scale,
            band_lo, band_hi, seed, bh, threshold, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV,
            HAS_MASK, MASK_BOOL, LO_BOUNDED, HI_BOUNDED, HAS_DROPOUT, DOT_PRECISION, _CAREFUL,
            False, False, False, True)
        out, lse = _fwd_finish(acc, m_i, l_i, rcp_keep, HAS_DROPOUT)
        _store_rows(out_base, offs_m, stride_o_m, offs_dv, out, lse_base, lse, Lq, HEAD_DIM_V)


@triton.jit
def _fwd_tiles(acc, m_i, l_i, q, k_src, v_src, mask_base, offs_m, offs_d, offs_dv, n_base,
               num, t1, t2, stride_k_n, stride_v_n, stride_mask_m, stride_mask_n, Lq, Lk,
               qk_scale, band_lo, band_hi, seed, bh, threshold,
               HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_DV: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr,
               LO_BOUNDED: tl.constexpr, HI_BOUNDED: tl.constexpr, HAS_DROPOUT: tl.constexpr,
               DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr, SPLIT: tl.constexpr,
               USE_TMA: tl.constexpr, WARP_SPECIALIZE: tl.constexpr,
               CAREFUL: tl.constexpr = False):
    """The key tiles ``t < num`` of :func:`_key_tiles`, in the stages of :func:`_stage_bounds`.
    WARP_SPECIALIZE (one stage: Triton 3.6 cannot warp-specialize a loop that has sibling loops)
    asks Triton to split the loop into producer (TMA) and consumer warps (the keyword exists only
    in Triton >= 3.4, so the plain loop never spells it); CAREFUL: see :func:`_fwd_tile`."""
    for stage in tl.static_range(3 if SPLIT else 1):
        t_begin, t_end = _stage_bounds(stage, num, t1, t2, SPLIT)
        if WARP_SPECIALIZE:
            for t in tl.range(t_begin, t_end, warp_specialize=True):
                acc, m_i, l_i = _fwd_tile(
                    acc, m_i, l_i, q, k_src, v_src, mask_base, offs_m, offs_d, offs_dv,
                    n_base + t * BLOCK_N, stride_k_n, stride_v_n, stride_mask_m, stride_mask_n,
                    Lq, Lk, qk_scale, band_lo, band_hi, seed, bh, threshold, HEAD_DIM,
                    HEAD_DIM_V, BLOCK_D, BLOCK_DV, HAS_MASK, MASK_BOOL, LO_BOUNDED, HI_BOUNDED,
                    HAS_DROPOUT, DOT_PRECISION, BLOCK_N, stage != 1 or not SPLIT, USE_TMA,
                    CAREFUL)
        else:
            for t in tl.range(t_begin, t_end, num_stages=1 if CAREFUL else None):
                acc, m_i, l_i = _fwd_tile(
                    acc, m_i, l_i, q, k_src, v_src, mask_base, offs_m, offs_d, offs_dv,
                    n_base + t * BLOCK_N, stride_k_n, stride_v_n, stride_mask_m, stride_mask_n,
                    Lq, Lk, qk_scale, band_lo, band_hi, seed, bh, threshold, HEAD_DIM,
                    HEAD_DIM_V, BLOCK_D, BLOCK_DV, HAS_MASK, MASK_BOOL, LO_BOUNDED, HI_BOUNDED,
                    HAS_DROPOUT, DOT_PRECISION, BLOCK_N, stage != 1 or not SPLIT, USE_TMA,
                    CAREFUL)
    return acc, m_i, l_i


@triton.autotune(configs=_FWD_CONFIGS, key=["lq_bucket", "lk_bucket", *_BAND_KEYS, "USE_TMA"],
                 prune_configs_by={"early_config_prune": functools.partial(_prune, kernel="fwd")},
                 do_bench=tuning.do_bench)
@triton.jit(do_not_specialize=["lq_bucket", "lk_bucket", "seed", "threshold"])
def _attn_fwd_kernel(
    Q, K, V, Out, Lse, Mask,
    stride_q_b, stride_q_h, stride_q_m,
    stride_k_b, stride_k_h, stride_k_n,
    stride_v_b, stride_v_h, stride_v_n,
    stride_o_b, stride_o_h, stride_o_m,
    stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n,
    H, GROUP, Lq, Lk, lq_bucket, lk_bucket, qk_scale, band_lo, band_hi, seed, threshold, rcp_keep,
    HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr,
    LO_BOUNDED: tl.constexpr, HI_BOUNDED: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr, WARP_SPECIALIZE: tl.constexpr, FIXUP: tl.constexpr = False,
):
    bh, b, h, hkv, m0 = _query_block(H, GROUP, Lq, BLOCK_M)

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k_base = K + b * stride_k_b + hkv * stride_k_h
    v_base = V + b * stride_v_b + hkv * stride_v_h
    k_src = _rows_source(k_base, Lk, stride_k_n, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA)
    v_src = _rows_source(v_base, Lk, stride_v_n, HEAD_DIM_V, BLOCK_N, BLOCK_DV, USE_TMA)
    mask_base = Mask + b * stride_mask_b + h * stride_mask_h
    if FIXUP:
        # After a warp-specialized run (attention_forward): its output, checked as below.
        row_ok = offs_m < Lq
        q_base = Q + b * stride_q_b + h * stride_q_h
        out_base = Out + b * stride_o_b + h * stride_o_h
        lse_base = Lse + bh.to(tl.int64) * Lq
        out = tl.load(out_base + offs_m[:, None] * stride_o_m + offs_dv[None, :],
                      mask=row_ok[:, None] & (offs_dv[None, :] < HEAD_DIM_V), other=0.0)
        if _any_nan(out.to(tl.float32), row_ok):
            _fwd_careful(q_base, stride_q_m, k_base, v_base, out_base, stride_o_m, lse_base,
                         mask_base, m0, offs_d, offs_dv, stride_k_n, stride_v_n, stride_mask_m,
                         stride_mask_n, Lq, Lk, qk_scale, band_lo, band_hi, seed, bh, threshold,
                         rcp_keep, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, HAS_MASK, MASK_BOOL,
                         LO_BOUNDED, HI_BOUNDED, HAS_DROPOUT, DOT_PRECISION, BLOCK_M)
    else:
        q_src = _rows_source(Q + b * stride_q_b + h * stride_q_h, Lq, stride_q_m, HEAD_DIM,
                             BLOCK_M, BLOCK_D, USE_TMA)
        q = _load_tile(q_src, m0, offs_m, stride_q_m, offs_d, Lq, HEAD_DIM, BLOCK_D, True,
                       USE_TMA)

        acc = tl.zeros([BLOCK_M, BLOCK_DV], dtype=tl.float32)
        m_i = tl.full([BLOCK_M], float("-inf"), dtype=tl.float32)
        l_i = tl.zeros([BLOCK_M], dtype=tl.float32)
        n_base, num, t1, t2 = _key_tiles(m0, Lq, Lk, band_lo, band_hi, BLOCK_M, BLOCK_N)
        acc, m_i, l_i = _fwd_tiles(
            acc, m_i, l_i, q, k_src, v_src, mask_base, offs_m, offs_d, offs_dv, n_base, num, t1,
            t2, stride_k_n, stride_v_n, stride_mask_m, stride_mask_n, Lq, Lk, qk_scale, band_lo,
            band_hi, seed, bh, threshold, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, HAS_MASK,
            MASK_BOOL, LO_BOUNDED, HI_BOUNDED, HAS_DROPOUT, DOT_PRECISION, BLOCK_N,
            not WARP_SPECIALIZE, USE_TMA, WARP_SPECIALIZE)

        out, lse = _fwd_finish(acc, m_i, l_i, rcp_keep, HAS_DROPOUT)
        # (bases computed after the loop: nothing more lives across it than before)
        row_ok = offs_m < Lq
        q_base = Q + b * stride_q_b + h * stride_q_h
        out_base = Out + b * stride_o_b + h * stride_o_h
        lse_base = Lse + bh.to(tl.int64) * Lq
        if WARP_SPECIALIZE:
            # The careful path's loops would stop Triton from specializing this one: it runs
            # in a FIXUP launch of this kernel when the autotuner picked such a config.
            _store_rows(out_base, offs_m, stride_o_m, offs_dv, out, lse_base, lse, Lq,
                        HEAD_DIM_V)
        elif _any_nan(out, row_ok):
            # A NaN in the block's output: an attended NaN, or a masked-out zero of P that met
            # a non-finite v in the dot. Recompute the block on the careful path (docstring).
            _fwd_careful(q_base, stride_q_m, k_base, v_base, out_base, stride_o_m, lse_base,
                         mask_base, m0, offs_d, offs_dv, stride_k_n, stride_v_n, stride_mask_m,
                         stride_mask_n, Lq, Lk, qk_scale, band_lo, band_hi, seed, bh, threshold,
                         rcp_keep, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, HAS_MASK, MASK_BOOL,
                         LO_BOUNDED, HI_BOUNDED, HAS_DROPOUT, DOT_PRECISION, BLOCK_M)
        else:
            _store_rows(out_base, offs_m, stride_o_m, offs_dv, out, lse_base, lse, Lq,
                        HEAD_DIM_V)


# ---------------------------------------------------------------------------------------------
# Backward
# ---------------------------------------------------------------------------------------------

@triton.jit
def _attn_bwd_preprocess_kernel(
    Out, DOut, Delta,
    stride_o_b, stride_o_h, stride_o_m,
    stride_do_b, stride_do_h, stride_do_m,
    H, Lq,
    HEAD_DIM_V: tl.constexpr, BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr,
):
    bh, b, h, _, m0 = _query_block(H, 1, Lq, BLOCK_M)
    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_dv = tl.arange(0, BLOCK_DV)
    o = _load_rows(Out + b * stride_o_b + h * stride_o_h, offs_m, stride_o_m, offs_dv, Lq,
                   HEAD_DIM_V, BLOCK_DV, True)
    do = _load_rows(DOut + b * stride_do_b + h * stride_do_h, offs_m, stride_do_m, offs_dv, Lq,
                    HEAD_DIM_V, BLOCK_DV, True)
    delta = tl.sum(o.to(tl.float32) * do.to(tl.float32), 1)
    tl.store(Delta + bh.to(tl.int64) * Lq + offs_m, delta, mask=offs_m < Lq)


@triton.jit
def _dkdv_tile(dk, dv, k, v, q_src, do_src, lse_ptr, delta_ptr, mask_base, offs_n, offs_d,
               offs_dv, m0, stride_q_m, stride_do_m, stride_mask_m, stride_mask_n, Lq, Lk,
               qk_scale, band_lo, band_hi, seed, bh, threshold, rcp_keep,
               HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_DV: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr,
               LO_BOUNDED: tl.constexpr, HI_BOUNDED: tl.constexpr, HAS_DROPOUT: tl.constexpr,
               DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr, EDGE: tl.constexpr,
               USE_TMA: tl.constexpr, CAREFUL: tl.constexpr):
    """One step of :func:`_dkdv_tiles`: the query tile starting at m0. CAREFUL (the NaN-safe
    path, every tile an edge tile): P and dS of the pairs not attended are selected to 0 and the
    dots skip them (:func:`_masked_dot`)."""
    offs_m = m0 + tl.arange(0, BLOCK_M)
    q = _load_tile(q_src, m0, offs_m, stride_q_m, offs_d, Lq, HEAD_DIM, BLOCK_D, EDGE, USE_TMA)
    do = _load_tile(do_src, m0, offs_m, stride_do_m, offs_dv, Lq, HEAD_DIM_V, BLOCK_DV, EDGE,
                    USE_TMA)
    lse = _load_vec(lse_ptr, offs_m, Lq, EDGE)
    delta = _load_vec(delta_ptr, offs_m, Lq, EDGE)
    lse = tl.where(lse == float("-inf"), 0.0, lse * _LOG2E)
    s = _scores(q, k, offs_m, offs_n, mask_base, stride_mask_m, stride_mask_n, Lq, Lk,
                qk_scale, band_lo, band_hi, HAS_MASK, MASK_BOOL, LO_BOUNDED, HI_BOUNDED,
                EDGE, True, DOT_PRECISION)
    p = tl.exp2(s - lse[:, None])
    if CAREFUL:
        allowed = _attended(offs_m, offs_n, mask_base, stride_mask_m, stride_mask_n, Lq, Lk,
                            band_lo, band_hi, HAS_MASK, MASK_BOOL, LO_BOUNDED, HI_BOUNDED)
        p = tl.where(allowed, p, 0.0)
    dp = _dot(do, tl.trans(v), DOT_PRECISION)
    if HAS_DROPOUT:
        keep = dropout_keep(seed, bh, offs_m[:, None], offs_n[None, :], Lk, threshold)
        if CAREFUL:  # Z P and Z dP as IEEE gives them (NaN * 0 is NaN)
            z = tl.where(keep, rcp_keep, 0.0)
            p_drop = p * z
            dp = dp * z
        else:
            p_drop = tl.where(keep, p * rcp_keep, 0.0)
            dp = tl.where(keep, dp * rcp_keep, 0.0)
    else:
        p_drop = p
    ds = p * (dp - delta[:, None])
    if CAREFUL:
        ds = tl.where(allowed, ds, 0.0)
        # (rows picked out of the tiles, as in the forward: re-reading them moved dK/dV's
        # spills around, D64 32x32 w4 0 -> 8-36 B, instead of removing them)
        dv = _masked_dot(dv, tl.trans(p_drop), do, tl.trans(allowed), DOT_PRECISION, BLOCK_M)
        dk = _masked_dot(dk, tl.trans(ds), q, tl.trans(allowed), DOT_PRECISION, BLOCK_M)
    else:
        dv += _dot(tl.trans(p_drop.to(do.dtype)), do, DOT_PRECISION)
        dk += _dot(tl.trans(ds.to(q.dtype)), q, DOT_PRECISION)
    return dk, dv


@triton.jit
def _dkdv_tiles(dk, dv, k, v, q_src, do_src, lse_ptr, delta_ptr, mask_base, offs_n, offs_d,
                offs_dv, m_base, num, t1, t2, stride_q_m, stride_do_m, stride_mask_m,
                stride_mask_n, Lq, Lk, qk_scale, band_lo, band_hi, seed, bh, threshold,
                rcp_keep, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr,
                BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr, HAS_MASK: tl.constexpr,
                MASK_BOOL: tl.constexpr, LO_BOUNDED: tl.constexpr, HI_BOUNDED: tl.constexpr,
                HAS_DROPOUT: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr,
                SPLIT: tl.constexpr, USE_TMA: tl.constexpr, CAREFUL: tl.constexpr = False):
    """dK, dV of one key block over the query tiles ``t < num`` of :func:`_query_tiles` (one
    query head), in the stages of :func:`_stage_bounds`; CAREFUL: see :func:`_dkdv_tile`."""
    for stage in tl.static_range(3 if SPLIT else 1):
        t_begin, t_end = _stage_bounds(stage, num, t1, t2, SPLIT)
        for t in tl.range(t_begin, t_end, num_stages=1 if CAREFUL else None):
            dk, dv = _dkdv_tile(
                dk, dv, k, v, q_src, do_src, lse_ptr, delta_ptr, mask_base, offs_n, offs_d,
                offs_dv, m_base + t * BLOCK_M, stride_q_m, stride_do_m, stride_mask_m,
                stride_mask_n, Lq, Lk, qk_scale, band_lo, band_hi, seed, bh, threshold, rcp_keep,
                HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, HAS_MASK, MASK_BOOL, LO_BOUNDED,
                HI_BOUNDED, HAS_DROPOUT, DOT_PRECISION, BLOCK_M, stage != 1 or not SPLIT, USE_TMA,
                CAREFUL)
    return dk, dv


@triton.jit
def _store_dkdv(dk_base, dv_base, offs_n, stride_dk_n, stride_dv_n, offs_d, offs_dv, dk, dv,
                scale, Lk, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr):
    """Store the rows offs_n (< Lk) of dK (times scale) and dV."""
    row_ok = offs_n[:, None] < Lk
    tl.store(dk_base + offs_n[:, None] * stride_dk_n + offs_d[None, :],
             (dk * scale).to(dk_base.dtype.element_ty),
             mask=row_ok & (offs_d[None, :] < HEAD_DIM))
    tl.store(dv_base + offs_n[:, None] * stride_dv_n + offs_dv[None, :],
             dv.to(dv_base.dtype.element_ty), mask=row_ok & (offs_dv[None, :] < HEAD_DIM_V))


@triton.jit
def _dkdv_careful(q_base, stride_q_h, stride_q_m, do_base, stride_do_h, stride_do_m, lse_base,
                  delta_base, stride_lse_h, k_base, v_base, stride_k_n, stride_v_n, dk_base,
                  stride_dk_n, dv_base, stride_dv_n, mask_base, stride_mask_h, stride_mask_m,
                  stride_mask_n, n0, bh0, GROUP, offs_d, offs_dv, Lq, Lk, scale, qk_scale,
                  band_lo, band_hi, seed, threshold, rcp_keep, HEAD_DIM: tl.constexpr,
                  HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                  HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, LO_BOUNDED: tl.constexpr,
                  HI_BOUNDED: tl.constexpr, HAS_DROPOUT: tl.constexpr,
                  DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr):
    """The careful dK/dV of the key block at n0 (BLOCK_N keys), _CAREFUL keys at a time over
    the GROUP query heads whose q, dO, lse/delta rows and mask slice start at the ``*_base``
    pointers (head g at ``g * stride_*_h``; its dropout stream is ``bh0 + g``)."""
    for r in range(0, BLOCK_N, _CAREFUL):
        offs_n = n0 + r + tl.arange(0, _CAREFUL)
        k = _load_rows(k_base, offs_n, stride_k_n, offs_d, Lk, HEAD_DIM, BLOCK_D, True)
        v = _load_rows(v_base, offs_n, stride_v_n, offs_dv, Lk, HEAD_DIM_V, BLOCK_DV, True)
        dk = tl.zeros([_CAREFUL, BLOCK_D], dtype=tl.float32)
        dv = tl.zeros([_CAREFUL, BLOCK_DV], dtype=tl.float32)
        m_base, num, t1, t2 = _query_tiles(n0 + r, Lq, Lk, band_lo, band_hi, _CAREFUL, _CAREFUL)
        for g in range(0, GROUP):
            dk, dv = _dkdv_tiles(
                dk, dv, k, v, q_base + g * stride_q_h, do_base + g * stride_do_h,
                lse_base + g * stride_lse_h, delta_base + g * stride_lse_h,
                mask_base + g * stride_mask_h, offs_n, offs_d, offs_dv, m_base, num, t1, t2,
                stride_q_m, stride_do_m, stride_mask_m, stride_mask_n, Lq, Lk, qk_scale,
                band_lo, band_hi, seed, bh0 + g, threshold, rcp_keep, HEAD_DIM, HEAD_DIM_V,
                BLOCK_D, BLOCK_DV, HAS_MASK, MASK_BOOL, LO_BOUNDED, HI_BOUNDED, HAS_DROPOUT,
                DOT_PRECISION, _CAREFUL, False, False, True)
        _store_dkdv(dk_base, dv_base, offs_n, stride_dk_n, stride_dv_n, offs_d, offs_dv, dk, dv,
                    scale, Lk, HEAD_DIM, HEAD_DIM_V)


@triton.jit
def _dkdv_head(Q, DOut, Lse, Delta, Mask, b, h, H, Lq, stride_q_b, stride_q_h, stride_q_m,
               stride_do_b, stride_do_h, stride_do_m, stride_mask_b, stride_mask_h,
               HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
               BLOCK_DV: tl.constexpr, BLOCK_M: tl.constexpr, USE_TMA: tl.constexpr):
    """Where the dK/dV kernel reads query head h of batch b: its ``bh``, q and dO row sources,
    lse and delta rows, and mask slice."""
    bh = b * H + h
    q_src = _rows_source(Q + b * stride_q_b + h * stride_q_h, Lq, stride_q_m, HEAD_DIM,
                         BLOCK_M, BLOCK_D, USE_TMA)
    do_src = _rows_source(DOut + b * stride_do_b + h * stride_do_h, Lq, stride_do_m,
                          HEAD_DIM_V, BLOCK_M, BLOCK_DV, USE_TMA)
    return (bh, q_src, do_src, Lse + bh * Lq, Delta + bh * Lq,
            Mask + b * stride_mask_b + h * stride_mask_h)


@triton.autotune(configs=_DKDV_CONFIGS, key=["lq_bucket", "lk_bucket", *_BAND_KEYS, "USE_TMA"],
                 prune_configs_by={"early_config_prune": functools.partial(_prune, kernel="dkdv")},
                 do_bench=tuning.do_bench)
@triton.jit(do_not_specialize=["lq_bucket", "lk_bucket", "seed", "threshold"])
def _attn_bwd_dkdv_kernel(
    Q, K, V, DOut, Lse, Delta, DK, DV, Mask,
    stride_q_b, stride_q_h, stride_q_m,
    stride_k_b, stride_k_h, stride_k_n,
    stride_v_b, stride_v_h, stride_v_n,
    stride_do_b, stride_do_h, stride_do_m,
    stride_dk_b, stride_dk_h, stride_dk_n,
    stride_dv_b, stride_dv_h, stride_dv_n,
    stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n,
    H, GROUP, Lq, Lk, lq_bucket, lk_bucket, scale, qk_scale, band_lo, band_hi, seed, threshold,
    rcp_keep, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr,
    LO_BOUNDED: tl.constexpr, HI_BOUNDED: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr, BLOCK_M: tl.constexpr,
    BLOCK_N: tl.constexpr,
):
    pid = tl.program_id(0)
    num_n = tl.cdiv(Lk, BLOCK_N)
    bhkv = pid // num_n
    n0 = (pid % num_n) * BLOCK_N
    Hkv = H // GROUP
    b = (bhkv // Hkv).to(tl.int64)
    hkv = (bhkv % Hkv).to(tl.int64)

    offs_n = n0 + tl.arange(0, BLOCK_N)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k_base = K + b * stride_k_b + hkv * stride_k_h
    v_base = V + b * stride_v_b + hkv * stride_v_h
    k_src = _rows_source(k_base, Lk, stride_k_n, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA)
    v_src = _rows_source(v_base, Lk, stride_v_n, HEAD_DIM_V, BLOCK_N, BLOCK_DV, USE_TMA)
    k = _load_tile(k_src, n0, offs_n, stride_k_n, offs_d, Lk, HEAD_DIM, BLOCK_D, True, USE_TMA)
    v = _load_tile(v_src, n0, offs_n, stride_v_n, offs_dv, Lk, HEAD_DIM_V, BLOCK_DV, True,
                   USE_TMA)
    dk = tl.zeros([BLOCK_N, BLOCK_D], dtype=tl.float32)
    dv = tl.zeros([BLOCK_N, BLOCK_DV], dtype=tl.float32)

    m_base, num, t1, t2 = _query_tiles(n0, Lq, Lk, band_lo, band_hi, BLOCK_M, BLOCK_N)

    for g in range(0, GROUP):
        bh, q_src, do_src, lse_ptr, delta_ptr, mask_base = _dkdv_head(
            Q, DOut, Lse, Delta, Mask, b, hkv * GROUP + g, H, Lq, stride_q_b, stride_q_h,
            stride_q_m, stride_do_b, stride_do_h, stride_do_m, stride_mask_b, stride_mask_h,
            HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, BLOCK_M, USE_TMA)
        dk, dv = _dkdv_tiles(
            dk, dv, k, v, q_src, do_src, lse_ptr, delta_ptr, mask_base, offs_n, offs_d,
            offs_dv, m_base, num, t1, t2, stride_q_m, stride_do_m, stride_mask_m, stride_mask_n,
            Lq, Lk, qk_scale, band_lo, band_hi, seed, bh, threshold, rcp_keep, HEAD_DIM,
            HEAD_DIM_V, BLOCK_D, BLOCK_DV, HAS_MASK, MASK_BOOL, LO_BOUNDED, HI_BOUNDED,
            HAS_DROPOUT, DOT_PRECISION, BLOCK_M, True, USE_TMA)
    dk_base = DK + b * stride_dk_b + hkv * stride_dk_h
    dv_base = DV + b * stride_dv_b + hkv * stride_dv_h
    if _any_nan(dk, offs_n < Lk) | _any_nan(dv, offs_n < Lk):
        # A NaN in the block's dK or dV: recompute it on the careful path (module docstring).
        h0 = hkv * GROUP
        _dkdv_careful(
            Q + b * stride_q_b + h0 * stride_q_h, stride_q_h, stride_q_m,
            DOut + b * stride_do_b + h0 * stride_do_h, stride_do_h, stride_do_m,
            Lse + (b * H + h0) * Lq, Delta + (b * H + h0) * Lq, Lq, k_base, v_base, stride_k_n,
            stride_v_n, dk_base, stride_dk_n, dv_base, stride_dv_n,
            Mask + b * stride_mask_b + h0 * stride_mask_h, stride_mask_h, stride_mask_m,
            stride_mask_n, n0, b * H + h0, GROUP, offs_d, offs_dv, Lq, Lk, scale, qk_scale,
            band_lo, band_hi, seed, threshold, rcp_keep, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV,
            HAS_MASK, MASK_BOOL, LO_BOUNDED, HI_BOUNDED, HAS_DROPOUT, DOT_PRECISION, BLOCK_N)
    else:
        _store_dkdv(dk_base, dv_base, offs_n, stride_dk_n, stride_dv_n, offs_d, offs_dv, dk, dv,
                    scale, Lk, HEAD_DIM, HEAD_DIM_V)


@triton.jit
def _dq_tile(dq, q, do, lse, delta, k_src, v_src, mask_base, dmask_base, offs_m, offs_d,
             offs_dv, n0, stride_k_n, stride_v_n, stride_mask_m, stride_mask_n, Lq, Lk, qk_scale,
             band_lo, band_hi, seed, bh, threshold, rcp_keep,
             HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
             BLOCK_DV: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr,
             LO_BOUNDED: tl.constexpr, HI_BOUNDED: tl.constexpr, HAS_DROPOUT: tl.constexpr,
             NEED_DMASK: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr,
             EDGE: tl.constexpr, USE_TMA: tl.constexpr, CAREFUL: tl.constexpr):
    """One step of :func:`_dq_tiles`: the key tile starting at n0. CAREFUL: as in
    :func:`_dkdv_tile`."""
    offs_n = n0 + tl.arange(0, BLOCK_N)
    k = _load_tile(k_src, n0, offs_n, stride_k_n, offs_d, Lk, HEAD_DIM, BLOCK_D, EDGE, USE_TMA)
    v = _load_tile(v_src, n0, offs_n, stride_v_n, offs_dv, Lk, HEAD_DIM_V, BLOCK_DV, EDGE,
                   USE_TMA)
    s = _scores(q, k, offs_m, offs_n, mask_base, stride_mask_m, stride_mask_n, Lq, Lk,
                qk_scale, band_lo, band_hi, HAS_MASK, MASK_BOOL, LO_BOUNDED, HI_BOUNDED,
                EDGE, False, DOT_PRECISION)
    p = tl.exp2(s - lse[:, None])
    dp = _dot(do, tl.trans(v), DOT_PRECISION)
    if HAS_DROPOUT:
        keep = dropout_keep(seed, bh, offs_m[:, None], offs_n[None, :], Lk, threshold)
        if CAREFUL:  # as in _dkdv_tile
            dp = dp * tl.where(keep, rcp_keep, 0.0)
        else:
            dp = tl.where(keep, dp * rcp_keep, 0.0)
    ds = p * (dp - delta[:, None])
    if CAREFUL:
        allowed = _attended(offs_m, offs_n, mask_base, stride_mask_m, stride_mask_n, Lq, Lk,
                            band_lo, band_hi, HAS_MASK, MASK_BOOL, LO_BOUNDED, HI_BOUNDED)
        ds = tl.where(allowed, ds, 0.0)
    if NEED_DMASK:
        tl.store(dmask_base + offs_m[:, None] * Lk + offs_n[None, :], ds,
                 mask=(offs_m[:, None] < Lq) & (offs_n[None, :] < Lk))
    if CAREFUL and BLOCK_D <= 128:
        dq = _masked_dot(dq, ds, k, allowed, DOT_PRECISION, BLOCK_N, k_src + n0 * stride_k_n,
                         stride_k_n, offs_d, HEAD_DIM)
    elif CAREFUL:  # (at D256 the re-read cost registers: 16x32 w4, 0 -> 4-16 B of spills)
        dq = _masked_dot(dq, ds, k, allowed, DOT_PRECISION, BLOCK_N)
    else:
        dq += _dot(ds.to(k.dtype), k, DOT_PRECISION)
    return dq


@triton.jit
def _dq_tiles(dq, q, do, lse, delta, k_src, v_src, mask_base, dmask_base, offs_m, offs_d,
              offs_dv, n_base, num, t1, t2, stride_k_n, stride_v_n, stride_mask_m,
              stride_mask_n, Lq, Lk, qk_scale, band_lo, band_hi, seed, bh, threshold, rcp_keep,
              HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
              BLOCK_DV: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr,
              LO_BOUNDED: tl.constexpr, HI_BOUNDED: tl.constexpr, HAS_DROPOUT: tl.constexpr,
              NEED_DMASK: tl.constexpr, DOT_PRECISION: tl.constexpr, BLOCK_N: tl.constexpr,
              SPLIT: tl.constexpr, USE_TMA: tl.constexpr, CAREFUL: tl.constexpr = False):
    """dQ (and dS when NEED_DMASK) of one query block over the key tiles ``t < num`` of
    :func:`_key_tiles`, in the stages of :func:`_stage_bounds`."""
    for stage in tl.static_range(3 if SPLIT else 1):
        t_begin, t_end = _stage_bounds(stage, num, t1, t2, SPLIT)
        for t in tl.range(t_begin, t_end, num_stages=1 if CAREFUL else None):
            dq = _dq_tile(
                dq, q, do, lse, delta, k_src, v_src, mask_base, dmask_base, offs_m, offs_d,
                offs_dv, n_base + t * BLOCK_N, stride_k_n, stride_v_n, stride_mask_m,
                stride_mask_n, Lq, Lk, qk_scale, band_lo, band_hi, seed, bh, threshold, rcp_keep,
                HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, HAS_MASK, MASK_BOOL, LO_BOUNDED,
                HI_BOUNDED, HAS_DROPOUT, NEED_DMASK, DOT_PRECISION, BLOCK_N,
                stage != 1 or not SPLIT, USE_TMA, CAREFUL)
    return dq


@triton.jit
def _store_dq(dq_base, offs_m, stride_dq_m, offs_d, dq, scale, Lq, HEAD_DIM: tl.constexpr):
    """Store the rows offs_m (< Lq) of dQ (times scale)."""
    tl.store(dq_base + offs_m[:, None] * stride_dq_m + offs_d[None, :],
             (dq * scale).to(dq_base.dtype.element_ty),
             mask=(offs_m[:, None] < Lq) & (offs_d[None, :] < HEAD_DIM))


@triton.jit
def _dq_careful(q_base, stride_q_m, do_base, stride_do_m, lse_ptr, delta_ptr, k_base, v_base,
                dq_base, stride_dq_m, mask_base, dmask_base, m0, offs_d, offs_dv, stride_k_n,
                stride_v_n, stride_mask_m, stride_mask_n, Lq, Lk, scale, qk_scale, band_lo,
                band_hi, seed, bh, threshold, rcp_keep, HEAD_DIM: tl.constexpr,
                HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr, BLOCK_DV: tl.constexpr,
                HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr, LO_BOUNDED: tl.constexpr,
                HI_BOUNDED: tl.constexpr, HAS_DROPOUT: tl.constexpr, NEED_DMASK: tl.constexpr,
                DOT_PRECISION: tl.constexpr, BLOCK_M: tl.constexpr):
    """The careful dQ (and dS, when NEED_DMASK: whole rows, zeros outside the band) of the
    query block at m0 (BLOCK_M rows), _CAREFUL rows at a time."""
    for r in range(0, BLOCK_M, _CAREFUL):
        offs_m = m0 + r + tl.arange(0, _CAREFUL)
        q = _load_rows(q_base, offs_m, stride_q_m, offs_d, Lq, HEAD_DIM, BLOCK_D, True)
        do = _load_rows(do_base, offs_m, stride_do_m, offs_dv, Lq, HEAD_DIM_V, BLOCK_DV, True)
        lse = _load_vec(lse_ptr, offs_m, Lq, True)
        lse = tl.where(lse == float("-inf"), 0.0, lse * _LOG2E)
        delta = _load_vec(delta_ptr, offs_m, Lq, True)
        if NEED_DMASK:
            _store_zero_columns(dmask_base, offs_m, 0, Lk, Lq, Lk, _CAREFUL, _CAREFUL)
        n_base, num, t1, t2 = _key_tiles(m0 + r, Lq, Lk, band_lo, band_hi, _CAREFUL, _CAREFUL)
        dq = _dq_tiles(
            tl.zeros([_CAREFUL, BLOCK_D], dtype=tl.float32), q, do, lse, delta, k_base, v_base,
            mask_base, dmask_base, offs_m, offs_d, offs_dv, n_base, num, t1, t2, stride_k_n,
            stride_v_n, stride_mask_m, stride_mask_n, Lq, Lk, qk_scale, band_lo, band_hi, seed,
            bh, threshold, rcp_keep, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, HAS_MASK,
            MASK_BOOL, LO_BOUNDED, HI_BOUNDED, HAS_DROPOUT, NEED_DMASK, DOT_PRECISION, _CAREFUL,
            False, False, True)
        _store_dq(dq_base, offs_m, stride_dq_m, offs_d, dq, scale, Lq, HEAD_DIM)


@triton.jit
def _store_zero_columns(dmask_base, offs_m, n_begin, n_end, Lq, Lk, BLOCK_M: tl.constexpr,
                        BLOCK_N: tl.constexpr):
    """Write zeros to columns [n_begin, n_end) of the rows offs_m of dS (keys outside the band)."""
    zeros = tl.zeros([BLOCK_M, BLOCK_N], dtype=tl.float32)
    for n in range(n_begin, n_end, BLOCK_N):
        offs_n = n + tl.arange(0, BLOCK_N)
        tl.store(dmask_base + offs_m[:, None] * Lk + offs_n[None, :], zeros,
                 mask=(offs_m[:, None] < Lq) & (offs_n[None, :] < tl.minimum(n_end, Lk)))


@triton.autotune(configs=_DQ_CONFIGS,
                 key=["lq_bucket", "lk_bucket", *_BAND_KEYS, "NEED_DMASK", "USE_TMA"],
                 prune_configs_by={"early_config_prune": functools.partial(_prune, kernel="dq")},
                 do_bench=tuning.do_bench)
@triton.jit(do_not_specialize=["lq_bucket", "lk_bucket", "seed", "threshold"])
def _attn_bwd_dq_kernel(
    Q, K, V, DOut, Lse, Delta, DQ, DMask, Mask,
    stride_q_b, stride_q_h, stride_q_m,
    stride_k_b, stride_k_h, stride_k_n,
    stride_v_b, stride_v_h, stride_v_n,
    stride_do_b, stride_do_h, stride_do_m,
    stride_dq_b, stride_dq_h, stride_dq_m,
    stride_mask_b, stride_mask_h, stride_mask_m, stride_mask_n,
    H, GROUP, Lq, Lk, lq_bucket, lk_bucket, scale, qk_scale, band_lo, band_hi, seed, threshold,
    rcp_keep, HEAD_DIM: tl.constexpr, HEAD_DIM_V: tl.constexpr, BLOCK_D: tl.constexpr,
    BLOCK_DV: tl.constexpr, HAS_MASK: tl.constexpr, MASK_BOOL: tl.constexpr,
    LO_BOUNDED: tl.constexpr, HI_BOUNDED: tl.constexpr, HAS_DROPOUT: tl.constexpr,
    NEED_DMASK: tl.constexpr, DOT_PRECISION: tl.constexpr, USE_TMA: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
):
    bh, b, h, hkv, m0 = _query_block(H, GROUP, Lq, BLOCK_M)

    offs_m = m0 + tl.arange(0, BLOCK_M)
    offs_d = tl.arange(0, BLOCK_D)
    offs_dv = tl.arange(0, BLOCK_DV)
    k_base = K + b * stride_k_b + hkv * stride_k_h
    v_base = V + b * stride_v_b + hkv * stride_v_h
    q_base = Q + b * stride_q_b + h * stride_q_h
    do_base = DOut + b * stride_do_b + h * stride_do_h
    k_src = _rows_source(k_base, Lk, stride_k_n, HEAD_DIM, BLOCK_N, BLOCK_D, USE_TMA)
    v_src = _rows_source(v_base, Lk, stride_v_n, HEAD_DIM_V, BLOCK_N, BLOCK_DV, USE_TMA)
    mask_base = Mask + b * stride_mask_b + h * stride_mask_h
    dmask_base = DMask + bh.to(tl.int64) * Lq * Lk
    q_src = _rows_source(q_base, Lq, stride_q_m, HEAD_DIM, BLOCK_M, BLOCK_D, USE_TMA)
    do_src = _rows_source(do_base, Lq, stride_do_m, HEAD_DIM_V, BLOCK_M, BLOCK_DV, USE_TMA)
    q = _load_tile(q_src, m0, offs_m, stride_q_m, offs_d, Lq, HEAD_DIM, BLOCK_D, True, USE_TMA)
    do = _load_tile(do_src, m0, offs_m, stride_do_m, offs_dv, Lq, HEAD_DIM_V, BLOCK_DV, True,
                    USE_TMA)
    lse = _load_vec(Lse + bh.to(tl.int64) * Lq, offs_m, Lq, True)
    lse = tl.where(lse == float("-inf"), 0.0, lse * _LOG2E)
    delta = _load_vec(Delta + bh.to(tl.int64) * Lq, offs_m, Lq, True)

    dq = tl.zeros([BLOCK_M, BLOCK_D], dtype=tl.float32)
    n_base, num, t1, t2 = _key_tiles(m0, Lq, Lk, band_lo, band_hi, BLOCK_M, BLOCK_N)
    dq = _dq_tiles(
        dq, q, do, lse, delta, k_src, v_src, mask_base, dmask_base, offs_m, offs_d, offs_dv,
        n_base, num, t1, t2, stride_k_n, stride_v_n, stride_mask_m, stride_mask_n, Lq, Lk,
        qk_scale, band_lo, band_hi, seed, bh, threshold, rcp_keep, HEAD_DIM, HEAD_DIM_V, BLOCK_D,
        BLOCK_DV, HAS_MASK, MASK_BOOL, LO_BOUNDED, HI_BOUNDED, HAS_DROPOUT, NEED_DMASK,
        DOT_PRECISION, BLOCK_N, True, USE_TMA)
    if NEED_DMASK:
        _store_zero_columns(dmask_base, offs_m, 0, n_base, Lq, Lk, BLOCK_M, BLOCK_N)
        _store_zero_columns(dmask_base, offs_m, n_base + num * BLOCK_N, Lk, Lq, Lk, BLOCK_M,
                            BLOCK_N)
    dq_base = DQ + b * stride_dq_b + h * stride_dq_h
    if _any_nan(dq, offs_m < Lq):
        # A NaN in the block's dQ: recompute it (and dS) on the careful path (module docstring).
        _dq_careful(q_base, stride_q_m, do_base, stride_do_m, Lse + bh.to(tl.int64) * Lq,
                    Delta + bh.to(tl.int64) * Lq, k_base, v_base, dq_base, stride_dq_m,
                    mask_base, dmask_base, m0, offs_d, offs_dv, stride_k_n, stride_v_n,
                    stride_mask_m, stride_mask_n, Lq, Lk, scale, qk_scale, band_lo, band_hi, seed,
                    bh, threshold, rcp_keep, HEAD_DIM, HEAD_DIM_V, BLOCK_D, BLOCK_DV, HAS_MASK,
                    MASK_BOOL, LO_BOUNDED, HI_BOUNDED, HAS_DROPOUT, NEED_DMASK, DOT_PRECISION,
                    BLOCK_M)
    else:
        _store_dq(dq_base, offs_m, stride_dq_m, offs_d, dq, scale, Lq, HEAD_DIM)


def __getattr__(name):
    # The launchers and the descriptor policy were split out of this file (kernels/
    # attention_launch.py, kernels/descriptors.py); their public names still resolve here.
    if name in ("attention_forward", "attention_backward", "tma_status"):
        from . import attention_launch
        return getattr(attention_launch, name)
    raise AttributeError(f"module {__name__!r} has no attribute {name!r}")
