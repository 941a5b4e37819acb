// Fused scaled dot-product attention, forward and backward (CUDA backend): the kernels and their
// launchers, shared by csrc/cuda/attention.cu (fastattn::attention_fwd / _bwd, dense batches)
// and csrc/cuda/varlen.cu (varlen_attention_fwd / _bwd, packed sequences of different lengths:
// the same kernels' PACKED instances, each CTA narrowed to its sequence by seq_view;
// docs/cuda_attention.md). Each file instantiates only its own kernels, so the two compile in
// parallel (attention.cu alone was most of the extension's build). FlashAttention-2 recipe: no (Lq, Lk) buffer (except
// dmask, an output), tensor cores through PTX mma.sync.m16n8k16 fed by ldmatrix, tiles brought to
// shared memory by cp.async into XOR-swizzled layouts, no cuBLAS, no atomics.
//
// Math (per batch b and query head h; kv head h / (H / Hkv)), as kernels/attention.py:
//
//     S   = scale * Q K^T + M          M: float mask, or 0 / -inf from a bool mask, and -inf
//                                      outside the band  i + offset - left <= j <= i + offset + right
//     lse = log sum_j exp(S_ij)        -inf for a row with nothing to attend
//     P   = exp(S - lse)               0 for such a row
//     O   = (P * Z) V                  Z = keep / (1 - p), keep from rng.h (all ones if p = 0)
//     delta = rowsum(dO * O)
//     dV  = (P * Z)^T dO,   dS = P * (Z * (dO V^T) - delta)   (dS is also the float mask's grad)
//     dQ  = scale * dS K,   dK = scale * dS^T Q
//
// DTYPES: q, k, v in float16 or bfloat16 (the tensor-core operand types). float32 inputs are
// REJECTED with an error naming the dtype (use backend="triton" or backend="cpu", or cast to
// bfloat16 / float16): computing them through a bf16/fp16 (or TF32) conversion would silently
// miss the float32 tolerance of docs/numerics.md. The mask may be bool or any float dtype.
// Statistics, scores and all accumulators are float32; P and dS are rounded to the input dtype
// for the tensor-core products (as in FlashAttention-2 and the Triton kernels).
//
// Head dims: D (q, k) and Dv (v) anything in 1 .. 256, independently; kernels are templated on a
// padded bucket DP = 64, 128 or 256 >= max(D, Dv). Tiles are loaded into shared memory
// zero-filled beyond D / Dv and beyond Lq / Lk, so the padding contributes exact zeros.
//
// Shared-memory layout and fragments (csrc/include/fastattn/cuda_layout.cuh, proven on the host
// by tests/test_cuda_layouts.py): every 16-bit tile is ROWS x DP elements, dense, its 16-byte
// chunks XOR-swizzled (chunk c of row r at c ^ (r % 8)), which makes the 16-byte cp.async stores
// and every ldmatrix phase bank-conflict free. Operands are read with ldmatrix.x4: A fragments
// (ldsm_a), B = X^T from X's rows (ldsm_b: K in Q K^T, Q in K Q^T, V in dO V^T, dO in V dO^T) and
// B = X with .trans (ldsm_bt: V in P V -- V stays row-major --, dO in P^T dO, Q in dS^T Q, K in
// dS K). P (and dS) are reused from the accumulator registers as the A operand of the next mma.
//
// Work split (all grids 1-D, the block index fastest so the blocks of one head run together);
// tile shapes per head-dim bucket are in ONE table, `Configs<DP>` below:
// - forward: one CTA of BM / RW warps per (BM query rows, b, h); each warp owns RW = 16 MT rows,
//   MT m16 tiles (1 by default; 2 in the FA2-split config FwdWide, under test: every K and V
//   fragment a warp reads from shared memory then feeds two tiles' mma). Q is loaded once
//   (cp.async) and, for DP <= 128 with MT = 1, held in registers as A fragments for the whole key
//   loop (DP = 256 and MT = 2 re-read it with ldmatrix: O fills the registers). The CTA walks the
//   BN-key tiles that intersect the band (tiles entirely outside it are skipped), K and V
//   (both row-major) double-buffered: the cp.async of tile n+1 is in flight while tile n is
//   computed. Per tile: S = Q K^T, then (only on tiles a warp does not see whole: bounds, band
//   edge, user mask, per element) scale and mask, online softmax in log2 units (exp2f, log2(e)
//   folded into the scale, which a whole tile applies in the exponent's FMA; running max per row
//   in registers, per-lane partial sums reduced over the quad at the end), dropout on the
//   probabilities that feed P V (the row sums use the undropped P), O rescaled and O += P V.
//   Epilogue: O * (1/(1-p)) / l staged through the warp's own rows of the Q tile and written as
//   16-byte vectors, lse = (m + log2 l) * ln 2.
//   Instructions per key tile and warp on that path (D128, whole tile, no dropout; sm_90a SASS
//   read along it): 580, 128 of them HMMA; 1049 before the loads' addresses were split into a
//   lane part and a constant (Swizzled::fragment_offset, copy_offset) and the scale moved into
//   the FMA. `make check-cuda` bounds the address arithmetic left around the mma.
// - backward, three kernels, deterministic:
//   * delta = rowsum(dO * O), one warp per row;
//   * dK/dV: one CTA per (BN keys, b, kv head), BN / 16 warps of 16 keys each. It loops over
//     the GQA group's query heads and, for each, over the BM-query blocks inside the band,
//     recomputing S^T = K Q^T and dP^T = V dO^T with mma, P^T = exp2(S^T - lse), dS^T, and
//     accumulating dV += (P Z)^T dO and dK += dS^T Q: in registers for DP <= 128, in float32
//     shared memory for DP = 256 (each element owned by one lane: no races, no atomics; float2
//     read-modify-writes, conflict free), so no DP spills;
//   * dQ: one CTA per (BM queries, b, h), looping over the band's key tiles; dQ += dS K in
//     registers at DP = 128, in shared float32 accumulators at DP = 64 and 256. When
//     need_dmask, it writes dS (float32) for every visited (i, j) of dmask; dmask is
//     zero-initialised, which covers the tiles outside the band.
//   Backward tiles come by cp.async, double-buffered: the dQ kernel's K / V tiles like the
//   forward's, the dK/dV kernel's Q / dO blocks (with their lse / delta) one block ahead.
// Shared memory per CTA is computed from the template parameters (Cfg::SMEM), static_asserted to
// fit the sm_80 opt-in limit of 163 KiB and carried in each kernel's template arguments (so the
// compile gate, fastattn/aot/cuda.py, reads it from the symbol). GPUs with less (sm_86 / sm_89:
// 99 KiB) get a clear error for the larger buckets.
//
// Barriers: one __syncthreads per key tile (forward, dQ) or query block (dK/dV), after the wait
// for tile n: it makes tile n's copies visible to every thread and puts every thread past its
// reads of tile n - 1, so the prefetch of tile n + 1 issued right after it may refill that
// stage (two barriers a tile until session 31); every cp.async group is waited for before the
// CTA exits. The
// forward epilogue reuses only the warp's own rows of the Q tile (ordered by __syncwarp; a warp's
// ldmatrix reads of Q, once or per key tile, touch only its own rows). Every shared and global
// access is bounds-checked or covered by a static_assert on the tile shapes. CI runs these
// kernels on the host emulator (cuda_emulator.h, tests/test_cuda_emulated.py), whose race check
// sees ldmatrix, cp.async and the plain shared accesses -- so every plain one goes through
// st_shared / ld_shared (cuda_mma.cuh); a raw pointer access to shared memory escapes it.
//
// NaN rule (docs/numerics.md): a non-finite value a row attends reaches it as IEEE arithmetic
// says; one held only at pairs the row does not attend never does. The tile loops above do not
// hold it alone (a bool False is *added* as -inf, NaN + -inf = NaN; the masked-out zeros of P and
// dS meet NaN rows of V, dO, K, Q in the mma products; fmaxf drops a NaN). Every such leak, and
// every attended NaN, leaves a NaN in what the warp (forward) or CTA (dK/dV, dQ) computed, so
// each checks that once (a sum of its accumulators / outputs, then one vote) and, only if it is
// NaN, recomputes its rows (keys) on a careful scalar path over the attended pairs only (see
// "The NaN rule" below). Inputs without NaN pay one add per output element and the vote.
// The careful paths passed tests/test_nan.py's cuda cases on an H100 (2026-11-27,
// bench/results/gpu-notes.md) and run in every CI on the host emulator (test_cuda_emulated.py).
//
// Limits: Lq, Lk <= 2^29; head dims <= 256; H a multiple of Hkv; q / k / v / dout with a unit
// last stride (any other strides; 16-byte cp.async when the base and strides allow it, element
// loads otherwise); lse contiguous float32. Offsets are int64.
#pragma once

#include "fastattn/cuda_helpers.cuh"  // first: it prepares the c10/cuda includes

#include <algorithm>
#include <cstdlib>
#include <cstring>
#include <tuple>
#include <type_traits>

#include "fastattn/common.h"
#include "fastattn/cuda_layout.cuh"
#include "fastattn/cuda_mma.cuh"
#include "fastattn/rng.h"

namespace fastattn {
namespace cuda {
namespace {

using namespace ::fastattn::cuda_helpers;

constexpr int kMaxHeadDim = 256;
constexpr int64_t kMaxSeqLen = int64_t{1} << 29;
constexpr int kSm80SmemOptin = 166912;  // 163 KB: the largest opt-in shared memory on sm_80

// Element (b, h, i) of a (batch, head, row)-strided tensor: an output's or a statistic's
// layout, dense (contiguous (B, H, L, ·)) or packed ((total, H, ·), batch stride 0).
struct Rows {
  int64_t sb, sh, sl;
  __host__ __device__ __forceinline__ int64_t at(int64_t b, int64_t h, int64_t i) const {
    return b * sb + h * sh + i * sl;
  }
};

struct AttnParams {
  // Inputs (16-bit element patterns), strides in elements for (batch, head, row).
  const uint16_t* q;
  const uint16_t* k;
  const uint16_t* v;
  int64_t q_sb, q_sh, q_sl;
  int64_t k_sb, k_sh, k_sl;
  int64_t v_sb, v_sh, v_sl;
  bool vec_q, vec_k, vec_v, vec_do;  // 16-byte vector loads allowed

  const void* mask;  // nullptr when mask_kind == kNone
  MaskKind mask_kind;
  int64_t m_sb, m_sh, m_sl, m_sk;

  int B, H, Hkv, group, Lq, Lk, D, Dv;
  int band_lo, band_hi;  // offset - left, offset + right, clamped to +-(Lq + Lk + 1)
  float scale, scale_log2;
  bool dropout;
  int64_t seed;
  uint32_t threshold;
  float rcp_keep;  // 1 / (1 - p); 1 without dropout

  // Forward outputs: out (B, H, Lq, Dv) and lse (B, H, Lq); packed: (total_q, H, Dv) and
  // (H, total_q). Element (b, h, i) of a statistic (lse, lse_in, delta) is at st.at(b, h, i).
  uint16_t* out;
  Rows out_s;
  float* lse;
  Rows st;

  // Backward inputs and outputs.
  const uint16_t* dout;
  int64_t do_sb, do_sh, do_sl;
  const uint16_t* o;  // the forward output
  int64_t o_sb, o_sh, o_sl;
  const float* lse_in;  // laid out as lse
  float* delta;         // scratch, laid out as lse
  uint16_t* dq;         // like q: (B, H, Lq, D) or (total_q, H, D), strides dq_s
  uint16_t* dk;         // like k: (B, Hkv, Lk, D) or (total_k, Hkv, D), strides dk_s
  uint16_t* dv;         // like v, with Dv, strides dv_s
  Rows dq_s, dk_s, dv_s;
  float* dmask;         // (B, H, Lq, Lk) contiguous, or nullptr (never with packed sequences)

  // Packed variable-length sequences (varlen_attention): sequence b is rows cu_q[b] ..
  // cu_q[b + 1] of q, dout, out, dq (and of lse's row axis), rows cu_k[b] .. of k, v, dk, dv;
  // nullptr for a batch. The launch's Lq / Lk are the longest lengths (they size the grid), its
  // batch strides are 0, and each CTA narrows p to its sequence with seq_view<true>() (the tile
  // kernels' PACKED instances: the dense ones keep every length and pointer in the constant
  // bank, where a runtime switch cost up to 40 registers and spills). The band of a
  // sequence comes from its own lengths: offset Lk_b - Lq_b when bottom_right, else 0.
  const int* cu_q;
  const int* cu_k;
  int total_q, total_k;
  bool bottom_right;
  int left, right;  // clamped to max Lq + max Lk + 1
  // The sequence's first query / key row in the outputs and statistics (seq_view sets them;
  // 0 for a batch). Its inputs' pointers move instead: they are the tile loads' bases anyway,
  // while one int a side, not a pointer a tensor, is what the packed kernels can afford to keep.
  int q0, k0;
};

// Sequence b's params: the dense batch's p unchanged; of a packed launch, the input pointers
// moved to the sequence's first row, q0 / k0 that row for the outputs, Lq / Lk its lengths and
// the band from them. Everything
// after it -- bounds, whole tiles, the band, dropout's counter i Lk + j -- is the dense code.
// (Dense: the launch's params themselves, not a copy, so that they stay in the constant bank.)
template <bool PACKED>
__device__ __forceinline__ std::conditional_t<PACKED, AttnParams, const AttnParams&> seq_view(
    const AttnParams& launch, int b) {
  if constexpr (!PACKED) {
    return launch;
  } else {
    AttnParams p = launch;
    const int q0 = p.cu_q[b], k0 = p.cu_k[b];
    p.Lq = p.cu_q[b + 1] - q0;
    p.Lk = p.cu_k[b + 1] - k0;
    // cu_seqlens the public function refuses (decreasing, past the totals, longer than the
    // launch's max) leave the sequence empty (its rows unwritten): never an access out of bounds.
    if (q0 < 0 || p.Lq < 0 || q0 + p.Lq > p.total_q || p.Lq > launch.Lq || k0 < 0 || p.Lk < 0 ||
        k0 + p.Lk > p.total_k || p.Lk > launch.Lk) {
      p.Lq = p.Lk = 0;
      return p;
    }
    const int offset = p.bottom_right ? p.Lk - p.Lq : 0;
    p.band_lo = offset - p.left;
    p.band_hi = offset + p.right;
    p.q += q0 * p.q_sl;
    p.k += k0 * p.k_sl;
    p.v += k0 * p.v_sl;
    p.dout += q0 * p.do_sl;
    p.q0 = q0;
    p.k0 = k0;
    return p;
  }
}


using ::fastattn::cuda_layout::AccTile;
using ::fastattn::cuda_layout::ldsm_a_chunk;
using ::fastattn::cuda_layout::ldsm_a_row;
using ::fastattn::cuda_layout::ldsm_b_chunk;
using ::fastattn::cuda_layout::ldsm_b_row;
using ::fastattn::cuda_layout::Swizzled;

// ---------------------------------------------------------------------------------------------
// Global -> shared tile copies into a swizzled ROWS x DP tile: global rows row0 + r (r < ROWS)
// with the given stride; rows >= n_rows and columns >= n_cols are zero. Whole in-bounds 16-byte
// chunks go by cp.async when `vec` (base and strides 16-byte aligned), the rest by element loads
// and plain 16-byte shared stores. The caller commits, waits (cp_async_wait) and syncs.

template <int ROWS, int DP, int NTHREADS>
__device__ __forceinline__ void load_tile_async(uint16_t* __restrict__ s,
                                                const uint16_t* __restrict__ g,
                                                int64_t row_stride, int row0, int n_rows,
                                                int n_cols, bool vec) {
  using L = Swizzled<DP>;
  constexpr int TOTAL = ROWS * L::CHUNKS;
  // Thread tid copies chunks tid, tid + NTHREADS, ... (cuda_layout::copy_chunk_index).
  if constexpr (NTHREADS % L::CHUNKS == 0) {
    // Then the thread's chunk of a row is the same in every pass and its rows step by RSTEP:
    // when its 16-byte chunk is whole and all ROWS rows are in bounds (every tile but a
    // sequence's last, at D == DP), each pass is one cp.async at addresses stepped by constants
    // (Swizzled::copy_offset), no bounds test: this loop was ~25 instructions a chunk.
    constexpr int RSTEP = NTHREADS / L::CHUNKS;
    const int r_t = static_cast<int>(threadIdx.x) / L::CHUNKS;
    const int ch = static_cast<int>(threadIdx.x) % L::CHUNKS;
    if (vec && ch * 8 + 8 <= n_cols && row0 + ROWS <= n_rows) {
      const uint16_t* src = g + int64_t{row0 + r_t} * row_stride + ch * 8;
      const int64_t step = int64_t{RSTEP} * row_stride;
#pragma unroll
      for (int it = 0; it < (ROWS + RSTEP - 1) / RSTEP; ++it) {
        if (ROWS % RSTEP != 0 && r_t + it * RSTEP >= ROWS) break;
        cp_async_16(s + L::template copy_offset<RSTEP>(r_t, ch, it), src + it * step);
      }
      return;
    }
  }
  for (int idx = threadIdx.x; idx < TOTAL; idx += NTHREADS) {
    const int r = idx / L::CHUNKS, ch = idx % L::CHUNKS;
    const int gr = row0 + r, col = ch * 8;
    uint16_t* dst = s + L::chunk_offset(r, ch);
    if (gr < n_rows && col < n_cols) {
      const uint16_t* src = g + int64_t{gr} * row_stride + col;
      if (vec && col + 8 <= n_cols) {
        cp_async_16(dst, src);
      } else {
        uint32_t w[4];
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const uint32_t lo = col + 2 * e < n_cols ? src[2 * e] : 0u;
          const uint32_t hi = col + 2 * e + 1 < n_cols ? src[2 * e + 1] : 0u;
          w[e] = lo | (hi << 16);
        }
        st_shared(dst, make_uint4(w[0], w[1], w[2], w[3]));
      }
    } else {
      st_shared(dst, make_uint4(0u, 0u, 0u, 0u));
    }
  }
}

// Operand loads from a swizzled tile with row length DP (cuda_layout.cuh, section 3).
// The address of the lane that reads row lr, chunk lc of the 16 x 16 block at (r0, chunk c0): its
// lane part and the block's constant (Swizzled::fragment_offset; r0, k0, n0 are multiples of 16
// at every call), which ptxas folds into the ldmatrix.
template <int DP>
__device__ __forceinline__ const uint16_t* operand_at(const uint16_t* tile, int lr, int lc, int r0,
                                                      int c0) {
  using L = Swizzled<DP>;
  return tile + L::fragment_offset(L::lane_offset(lr, lc), r0, c0);
}
// A fragment of rows [r0, r0 + 16) x k [k0, k0 + 16).
template <int DP>
__device__ __forceinline__ void ldsm_a(uint32_t (&a)[4], const uint16_t* tile, int r0, int k0,
                                       int lane) {
  ldsm_x4(a, operand_at<DP>(tile, ldsm_a_row(lane), ldsm_a_chunk(lane), r0, k0 / 8));
}
// B = X^T (B[k][n] = X[n0 + n][k0 + k]) for the two n-tiles n0, n0 + 8: b[0..1], b[2..3].
template <int DP>
__device__ __forceinline__ void ldsm_b(uint32_t (&b)[4], const uint16_t* tile, int n0, int k0,
                                       int lane) {
  ldsm_x4(b, operand_at<DP>(tile, ldsm_b_row(lane), ldsm_b_chunk(lane), n0, k0 / 8));
}
// B = X (B[k][n] = X[k0 + k][n0 + n]) for the two n-tiles n0, n0 + 8: b[0..1], b[2..3].
template <int DP>
__device__ __forceinline__ void ldsm_bt(uint32_t (&b)[4], const uint16_t* tile, int k0, int n0,
                                        int lane) {
  ldsm_x4_trans(b, operand_at<DP>(tile, ldsm_a_row(lane), ldsm_a_chunk(lane), k0, n0 / 8));
}

// The A fragment of k-step ks made of the accumulators of n-tiles 2 ks and 2 ks + 1 (P reuse).
template <typename M16, int N>
__device__ __forceinline__ void acc_to_a(uint32_t (&a)[4], const float (&c)[N][4], int ks) {
  a[0] = M16::pack(c[2 * ks][0], c[2 * ks][1]);
  a[1] = M16::pack(c[2 * ks][2], c[2 * ks][3]);
  a[2] = M16::pack(c[2 * ks + 1][0], c[2 * ks + 1][1]);
  a[3] = M16::pack(c[2 * ks + 1][2], c[2 * ks + 1][3]);
}

// c0 / c1 += a * B for the two n-tiles of a B read from the 16 x 16 block of X at rows r0,
// columns c0: B = X^T when XT (B[k][n] = X[r0 + n][c0 + k]; ldsm_b), else B = X
// (B[k][n] = X[r0 + k][c0 + n]; ldsm_bt).
template <int DP, bool XT>
__device__ __forceinline__ void ldsm_block(uint32_t (&b)[4], const uint16_t* tile, int r0, int c0,
                                           int lane) {
  if constexpr (XT) {
    ldsm_b<DP>(b, tile, r0, c0, lane);
  } else {
    ldsm_bt<DP>(b, tile, r0, c0, lane);
  }
}
template <typename M16, int DP, bool XT>
__device__ __forceinline__ void mma_block(float (&acc0)[4], float (&acc1)[4],
                                          const uint32_t (&a)[4], const uint16_t* tile, int r0,
                                          int c0, int lane) {
  uint32_t b[4];
  ldsm_block<DP, XT>(b, tile, r0, c0, lane);
  M16::mma(acc0, a, b[0], b[1]);
  M16::mma(acc1, a, b[2], b[3]);
}
// The same for MT m16 tiles of rows at once: c[t][n] / c[t][n + 1] += a[t] * B for t < MT. The
// B fragment is read from shared memory once for all MT tiles (the forward's K and V reads per
// mma fall by MT; FA2's warps hold MT = 2).
template <typename M16, int DP, bool XT, int MT, int N>
__device__ __forceinline__ void mma_block_tiles(float (&c)[MT][N][4], int n,
                                                const uint32_t (&a)[MT][4], const uint16_t* tile,
                                                int r0, int c0, int lane) {
  uint32_t b[4];
  ldsm_block<DP, XT>(b, tile, r0, c0, lane);
#pragma unroll
  for (int t = 0; t < MT; ++t) {
    M16::mma(c[t][n], a[t], b[0], b[1]);
    M16::mma(c[t][n + 1], a[t], b[2], b[3]);
  }
}
// One 16-deep step of C = A X^T over N rows of X: c[0 .. N / 8) += a * X[0 .. N, k0 .. k0 + 16)^T.
template <typename M16, int DP, int N>
__device__ __forceinline__ void mma_xt_step(float (&c)[N / 8][4], const uint32_t (&a)[4],
                                            const uint16_t* tile, int k0, int lane) {
#pragma unroll
  for (int np = 0; np < N / 16; ++np) {
    mma_block<M16, DP, true>(c[2 * np], c[2 * np + 1], a, tile, np * 16, k0, lane);
  }
}
// The two products of a backward kernel, for this warp's 16 rows (from wrow) of A1 and A2 and
// N rows of X1 and X2: c1 += A1 X1^T and c2 += A2 X2^T, k-step by k-step.
template <typename M16, int DP, int N>
__device__ __forceinline__ void mma_two_xt(float (&c1)[N / 8][4], const uint16_t* a1,
                                           const uint16_t* x1, float (&c2)[N / 8][4],
                                           const uint16_t* a2, const uint16_t* x2, int wrow,
                                           int lane) {
#pragma unroll
  for (int kk = 0; kk < DP / 16; ++kk) {
    uint32_t a[4];
    ldsm_a<DP>(a, a1, wrow, kk * 16, lane);
    mma_xt_step<M16, DP, N>(c1, a, x1, kk * 16, lane);
    ldsm_a<DP>(a, a2, wrow, kk * 16, lane);
    mma_xt_step<M16, DP, N>(c2, a, x2, kk * 16, lane);
  }
}

// This lane's place in a CTA of warps of `rw` rows each (16 unless a forward config holds more
// m16 tiles per warp): t = lane % 4 (the column pair of its accumulator elements), wrow = the
// warp's first tile row, row[0] / row[1] = the tile rows it holds in its first m16 tile (in tile
// mt: row[] + 16 mt).
struct WarpRows {
  int lane, t, wrow, row[2];
};
__device__ __forceinline__ WarpRows warp_rows(int rw = 16) {
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int wrow = warp * rw;
  return {lane, lane & 3, wrow, {wrow + (lane >> 2), wrow + (lane >> 2) + 8}};
}

// A 1-D grid over (blocks of ROWS rows of a length `len`) x (batch x `heads`), the block index
// fastest: this CTA's block and its (batch, head).
struct GridBlock {
  int blk;
  int64_t bh;  // batch * heads + head
  int b, h;
};
__device__ __forceinline__ GridBlock grid_block(int len, int rows, int heads) {
  const int num = (len + rows - 1) / rows;
  const int64_t bh = blockIdx.x / num;
  return {static_cast<int>(blockIdx.x % num), bh, static_cast<int>(bh / heads),
          static_cast<int>(bh % heads)};
}

// A query-block CTA (forward, dQ): its (b, h), kv head hk and first query m0, this lane's place
// w, and the queries i_row[] of the tile rows w.row[] it holds.
struct QueryCta {
  int64_t bh;
  int b, h, hk, m0;
  WarpRows w;
  int i_row[2];
};
__device__ __forceinline__ QueryCta query_cta(const AttnParams& p, int bm, int rw = 16) {
  const GridBlock blk = grid_block(p.Lq, bm, p.H);
  const WarpRows w = warp_rows(rw);
  const int m0 = blk.blk * bm;
  return {blk.bh, blk.b, blk.h, blk.h / p.group, m0, w, {m0 + w.row[0], m0 + w.row[1]}};
}

// A visible score in log2 units: scale * s * log2(e) plus the user mask's term at `mask_off`.
__device__ __forceinline__ float score_log2(const AttnParams& p, float s, int64_t mask_off) {
  float v = s * p.scale_log2;
  if (p.mask_kind != MaskKind::kNone) {
    v += mask_additive(p.mask, p.mask_kind, mask_off) * kLog2e;
  }
  return v;
}

// The dropout factor Z of key j in the row with dropout_row_base `rng_row`: 1 / (1 - p) where
// kept, 0 where dropped; 1 without dropout.
__device__ __forceinline__ float dropout_scale(const AttnParams& p, uint32_t stream,
                                               uint32_t rng_row, int j) {
  float z = 1.f;
  if (p.dropout) {
    const bool keep = dropout_bits(stream, rng_row, static_cast<uint32_t>(j)) >= p.threshold;
    z = keep ? p.rcp_keep : 0.f;
  }
  return z;
}

// Whether key j is visible to query i (bounds and band); the caller adds the user mask.
__device__ __forceinline__ bool visible(const AttnParams& p, int i, int j) {
  return i < p.Lq && j < p.Lk && j >= i + p.band_lo && j <= i + p.band_hi;
}

// Whether every (i, j) of queries [m0, m0 + rows) x keys [n0, n0 + cols) is visible and unmasked,
// so the per-element masking can be skipped (the common interior tile).
__device__ __forceinline__ bool tile_whole(const AttnParams& p, int m0, int rows, int n0, int cols) {
  return p.mask_kind == MaskKind::kNone && m0 + rows <= p.Lq && n0 + cols <= p.Lk &&
         n0 >= m0 + rows - 1 + p.band_lo && n0 + cols - 1 <= m0 + p.band_hi;
}

// The key range [n_begin, n_end) that queries [m0, m0 + rows) may see (empty if n_begin >= n_end).
__device__ __forceinline__ void key_range(const AttnParams& p, int m0, int rows, int& n_begin,
                                          int& n_end) {
  const int m_last = min(m0 + rows, p.Lq) - 1;
  n_begin = max(0, m0 + p.band_lo);
  n_end = min(p.Lk, m_last + p.band_hi + 1);
}

// The query range [i_begin, i_end) that may see keys [n0, n0 + rows).
__device__ __forceinline__ void query_range(const AttnParams& p, int n0, int rows, int& i_begin,
                                            int& i_end) {
  const int n_last = min(n0 + rows, p.Lk) - 1;
  i_begin = max(0, n0 - p.band_hi);
  i_end = min(p.Lq, n_last - p.band_lo + 1);
}

// The BN-key tiles that queries [m0, m0 + rows) may see: `num` tiles from key `first` on (tiles
// entirely outside the band are skipped).
struct KeyTiles {
  int first, num;
};
__device__ __forceinline__ KeyTiles key_tiles(const AttnParams& p, int m0, int rows, int bn) {
  int n_begin, n_end;
  key_range(p, m0, rows, n_begin, n_end);
  const int first = (n_begin / bn) * bn;
  return {first, n_begin < n_end ? (n_end - first + bn - 1) / bn : 0};
}

// ---------------------------------------------------------------------------------------------
// Tile configurations.

// MT: m16 tiles of query rows per warp (RW = 16 MT rows). A warp reads the whole K and V tile
// from shared memory whatever its rows, so MT = 2 halves those reads per mma (the split of FA2's
// forward); its accumulators then leave no room for Q's fragments, which are read from shared
// memory per key tile instead.
template <int DP_, int BM_, int BN_, bool Q_IN_REGS_, int MT_ = 1>
struct FwdCfg {
  static constexpr int DP = DP_, BM = BM_, BN = BN_, MT = MT_, RW = 16 * MT;
  static constexpr int NWARPS = BM / RW, NTHREADS = 32 * NWARPS;
  static constexpr int STAGES = 2;  // K / V double buffer
  static constexpr bool Q_IN_REGS = Q_IN_REGS_;
  static constexpr int Q_ELEMS = BM * DP, KV_ELEMS = BN * DP;
  static constexpr int SMEM = (Q_ELEMS + STAGES * 2 * KV_ELEMS) * 2;
  static_assert(DP % 64 == 0 && BN % 16 == 0 && BM % RW == 0, "swizzled rows, 16-deep mma");
  static_assert(!Q_IN_REGS || MT == 1, "Q fragments stay in registers for one m16 tile only");
  static_assert(SMEM <= kSm80SmemOptin, "forward tile does not fit in sm_80 shared memory");
};

template <int DP_, int BN_, int BM_>
struct BwdKVCfg {
  static constexpr int DP = DP_, BN = BN_, BM = BM_, NWARPS = BN / 16, NTHREADS = 32 * NWARPS;
  // dK / dV accumulate in registers (2 x DP / 2 floats per lane) where they fit beside the
  // S^T / dP^T tiles: DP <= 128; in float32 shared memory otherwise.
  static constexpr bool ACC_IN_REGS = DP <= 128;
  static constexpr int K_ELEMS = BN * DP, Q_ELEMS = BM * DP;
  static constexpr int ACC_ELEMS = ACC_IN_REGS ? 0 : BN * AccTile<DP>::LD;
  // Q / dO blocks (and their lse / delta) double-buffered: block it + 1 in flight while block it
  // is computed, as K / V tiles are in the forward.
  static constexpr int STAGES = 2;
  static constexpr int SMEM =
      (2 * K_ELEMS + STAGES * 2 * Q_ELEMS) * 2 + (2 * ACC_ELEMS + STAGES * 2 * BM) * 4;
  static_assert(DP % 64 == 0 && BN % 16 == 0 && BM % 16 == 0, "swizzled rows, 16-deep mma");
  static_assert(BM <= NTHREADS, "one thread per query row fetches its lse and delta");
  static_assert(SMEM <= kSm80SmemOptin, "dK/dV tile does not fit in sm_80 shared memory");
};

template <int DP_, int BM_, int BN_, int MIN_CTAS_ = 1>
struct BwdQCfg {
  static constexpr int DP = DP_, BM = BM_, BN = BN_, NWARPS = BM / 16, NTHREADS = 32 * NWARPS;
  static constexpr int MIN_CTAS = MIN_CTAS_;  // __launch_bounds__' CTAs per SM (see Configs)
  static constexpr int STAGES = 2;  // K / V double buffer, as in the forward
  // dQ accumulates in registers at DP = 128 (64 floats a lane): that frees the 34 KiB float32
  // tile, so two CTAs fit an SM where one did (and sm_86 / sm_89's 99 KiB take the kernel). At
  // DP = 64 three CTAs an SM with the shared tile beat two with it in registers (launch bounds
  // cap those at 170 registers); at DP = 256 it would be 128 floats a lane.
  static constexpr bool ACC_IN_REGS = DP == 128;
  static constexpr int Q_ELEMS = BM * DP, KV_ELEMS = BN * DP;
  static constexpr int ACC_ELEMS = ACC_IN_REGS ? 0 : BM * AccTile<DP>::LD;
  static constexpr int SMEM = (2 * Q_ELEMS + STAGES * 2 * KV_ELEMS) * 2 + ACC_ELEMS * 4;
  static_assert(DP % 64 == 0 && BN % 16 == 0 && BM % 16 == 0, "swizzled rows, 16-deep mma");
  static_assert(SMEM <= kSm80SmemOptin, "dQ tile does not fit in sm_80 shared memory");
};

// THE heuristics table: tile shapes and warps per padded head dim (queries x keys).
//   DP   forward (BM x BN, warps, Q)      dK/dV (BN keys x BM queries)   dQ (BM x BN)
//   64   128 x 64, 8 warps, Q in regs     64 x 64, 4 warps, dK/dV regs   64 x 64, 4 warps
//   128  128 x 64, 8 warps, Q in regs     64 x 32, 4 warps, dK/dV regs   64 x 64, 4 warps, dQ regs
//   256   64 x 32, 4 warps, Q in smem     32 x 32, 2 warps, dK/dV smem   32 x 32, 2 warps
// Forward shared memory: 48 / 96 / 96 KiB; registers (sm_90a: 165 / 215 / 238 per lane, see
// `make check-cuda`) leave one CTA per SM: 8 / 8 / 4 warps. Registers decide DP = 256: O alone is
// 128 floats per lane, so Q stays in shared memory there. dQ at DP = 64 (66 KiB) fits three CTAs
// in an sm_90 SM's shared memory; its launch bounds ask for three, which keeps it at <= 168
// registers (162; without the bound the NaN rule's careful path took it from 168 to 172, and
// 176 allocated registers leave room for two).
// FwdWide (DP <= 128): 128 queries on 4 warps of 32 rows (MT = 2), Q in shared memory, the FA2
// split; 64 keys a tile at DP = 64 (230-240 registers), 32 at DP = 128 (64 keys: 255 and 36-48
// bytes of spills; 32: 240, none). Shared-memory reads per mma fall from 61 to 38 (DP = 64) and
// 46 (DP = 128) KB per MFLOP. Taken with FASTATTN_CUDA_FWD_ROWS=32 until a GPU has tested and
// timed it against Fwd (gpu-notes: at 16 rows a warp the forward is predicted to be bound by
// shared-memory reads).
template <int DP>
struct Configs;
template <>
struct Configs<64> {
  using Fwd = FwdCfg<64, 128, 64, true>;
  using FwdWide = FwdCfg<64, 128, 64, false, 2>;
  using KV = BwdKVCfg<64, 64, 64>;
  using Q = BwdQCfg<64, 64, 64, 3>;
};
template <>
struct Configs<128> {
  using Fwd = FwdCfg<128, 128, 64, true>;
  using FwdWide = FwdCfg<128, 128, 32, false, 2>;
  using KV = BwdKVCfg<128, 64, 32>;
  using Q = BwdQCfg<128, 64, 64>;
};
template <>
struct Configs<256> {
  using Fwd = FwdCfg<256, 64, 32, false>;
  using KV = BwdKVCfg<256, 32, 32>;
  using Q = BwdQCfg<256, 32, 32>;
};

// ---------------------------------------------------------------------------------------------
// The key-tile walk of the forward and the dQ kernel: K and V tiles of Cfg::KV_ELEMS elements,
// double-buffered in sKV (stage s: K at sKV + 2 s KV_ELEMS, V right after it).

// Issues the cp.async of the K and V tiles of keys [n0, n0 + BN) into `stage` (not committed).
template <typename Cfg>
__device__ __forceinline__ void load_kv_async(uint16_t* sKV, int stage, const AttnParams& p,
                                              const uint16_t* k_base, const uint16_t* v_base,
                                              int n0) {
  uint16_t* sK = sKV + stage * 2 * Cfg::KV_ELEMS;
  load_tile_async<Cfg::BN, Cfg::DP, Cfg::NTHREADS>(sK, k_base, p.k_sl, n0, p.Lk, p.D, p.vec_k);
  load_tile_async<Cfg::BN, Cfg::DP, Cfg::NTHREADS>(sK + Cfg::KV_ELEMS, v_base, p.v_sl, n0, p.Lk,
                                                   p.Dv, p.vec_v);
}

// Calls body(n0, sK, sV) for each tile of `tiles`, tile 0 already issued and committed by the
// caller as its last group. One barrier per tile (FlashAttention-2's order): wait for tile it
// (this thread's copies), barrier (every thread's copies; and every thread is past body(it - 1),
// the last reader of the other stage), prefetch tile it + 1 into that stage, body(it). The
// prefetch overlaps body(it) as before; the barrier after each body that the old order needed
// (the prefetch was issued before the wait, while slow warps could still read its stage) is
// gone. Nothing after the loop may assume a barrier after the last body. The caller waits for
// the last (empty) group before the CTA exits.
template <typename Cfg, typename Body>
__device__ __forceinline__ void for_each_key_tile(const AttnParams& p, const KeyTiles& tiles,
                                                  uint16_t* sKV, const uint16_t* k_base,
                                                  const uint16_t* v_base, Body&& body) {
  for (int it = 0; it < tiles.num; ++it) {
    const int n0 = tiles.first + it * Cfg::BN;
    cp_async_wait<0>();  // tile it has landed (this thread's part) ...
    __syncthreads();     // ... in every thread, and nobody reads the other stage any more
    if (it + 1 < tiles.num) load_kv_async<Cfg>(sKV, (it + 1) & 1, p, k_base, v_base, n0 + Cfg::BN);
    cp_async_commit();
    const uint16_t* sK = sKV + (it & 1) * 2 * Cfg::KV_ELEMS;
    body(n0, sK, sK + Cfg::KV_ELEMS);
  }
}

// ---------------------------------------------------------------------------------------------
// The NaN rule (docs/numerics.md): detect, then recompute. The tile loops above run over every
// pair of a tile, so a non-finite value at a pair a row does not attend can leak into its output:
// a bool False (or a float -inf) is *added* to the score (NaN + -inf = NaN), and the masked-out
// zeros of P and dS meet the NaN / inf rows of V, dO, K and Q in the mma products (0 * NaN =
// NaN). A leak, like an attended NaN, always leaves a NaN in the output of the warp (forward) or
// CTA (backward), and the fast path's output is right whenever it holds none. So each kernel
// checks what it writes once and, only when it finds a NaN, recomputes it below: one row (key)
// at a time per warp, over the attended pairs only (visible, and the user mask not -inf), in
// float32 scalar arithmetic, the lanes splitting the head dims (feature d = lane + 32 u) and
// each dot product reduced over the warp. Every product is formed pairwise, so IEEE arithmetic
// decides what an attended non-finite value gives, exactly as in the reference. Slow (no tensor
// cores), but only blocks holding a NaN pay for it.

// (is_nan, max_nan: cuda_helpers.cuh.)

// Features d = lane + 32 u < n of the 16-bit row `row` as float32 (0 beyond n).
template <typename M16, int DP>
__device__ __forceinline__ void load_row_features(float (&x)[DP / 32], const uint16_t* row, int n,
                                                  int lane) {
#pragma unroll
  for (int u = 0; u < DP / 32; ++u) {
    const int d = lane + 32 * u;
    x[u] = d < n ? M16::to_float(row[d]) : 0.f;
  }
}

// The warp's dot product of x (features split over the lanes) with the 16-bit row `row`.
template <typename M16, int DP>
__device__ __forceinline__ float warp_dot(const float (&x)[DP / 32], const uint16_t* row, int n,
                                          int lane) {
  float acc = 0.f;
#pragma unroll
  for (int u = 0; u < DP / 32; ++u) {
    const int d = lane + 32 * u;
    if (d < n) acc += x[u] * M16::to_float(row[d]);
  }
  return warp_sum(acc);
}

// acc[u] += c * row[d] for the lane's features d < n.
template <typename M16, int DP>
__device__ __forceinline__ void axpy_row(float (&acc)[DP / 32], float c, const uint16_t* row,
                                         int n, int lane) {
#pragma unroll
  for (int u = 0; u < DP / 32; ++u) {
    const int d = lane + 32 * u;
    if (d < n) acc[u] += c * M16::to_float(row[d]);
  }
}

// Whether query i attends key j and, if it does, the score S_ij in log2 units (s): the warp's
// dot of x (q_i or k_j, split over the lanes) with `row` (the other one), scaled, plus the mask.
template <typename M16, int DP>
__device__ __forceinline__ bool attended_score(const AttnParams& p, const float (&x)[DP / 32],
                                               const uint16_t* row, int i, int j,
                                               int64_t mask_off, int lane, float& s) {
  if (!visible(p, i, j)) return false;
  float mask = 0.f;
  if (p.mask_kind != MaskKind::kNone) {
    mask = mask_additive(p.mask, p.mask_kind, mask_off);
    if (mask == -INFINITY) return false;  // bool False or a float -inf: not attended
  }
  s = warp_dot<M16, DP>(x, row, p.D, lane) * p.scale_log2 + mask * kLog2e;
  return true;
}

// Query row i of (b, h) on the careful paths: its kv head's K and V, its mask row, its dropout
// row, q_i (features split over the lanes) and the keys [n_begin, n_end) its band allows.
template <typename M16, int DP>
struct CarefulQuery {
  const uint16_t* k_base;
  const uint16_t* v_base;
  int64_t mask_row;
  uint32_t rng_row;
  int i, n_begin, n_end;
  float qd[DP / 32];

  __device__ __forceinline__ CarefulQuery(const AttnParams& p, int b, int h, int i_, int lane)
      : i(i_) {
    const int hk = h / p.group;
    k_base = p.k + b * p.k_sb + hk * p.k_sh;
    v_base = p.v + b * p.v_sb + hk * p.v_sh;
    mask_row = b * p.m_sb + h * p.m_sh + int64_t{i} * p.m_sl;
    rng_row = dropout_row_base(i, p.Lk);
    load_row_features<M16, DP>(qd, p.q + b * p.q_sb + h * p.q_sh + int64_t{i} * p.q_sl, p.D,
                               lane);
    key_range(p, i, 1, n_begin, n_end);
  }
  __device__ __forceinline__ const uint16_t* k_row(const AttnParams& p, int j) const {
    return k_base + int64_t{j} * p.k_sl;
  }
  __device__ __forceinline__ const uint16_t* v_row(const AttnParams& p, int j) const {
    return v_base + int64_t{j} * p.v_sl;
  }
  // Whether row i attends key j and, if it does, S_ij in log2 units (s).
  __device__ __forceinline__ bool score(const AttnParams& p, int j, int lane, float& s) const {
    return attended_score<M16, DP>(p, qd, k_row(p, j), i, j, mask_row + int64_t{j} * p.m_sk,
                                   lane, s);
  }
};

// Forward, careful: out[i] and lse[i] of query i of (b, h). Two passes over the attended keys:
// the row max m (NaN if any attended score is NaN; -inf when nothing is attended: a dead row),
// then l = sum exp2(S - m) and out = sum exp2(S - m) Z v / l. A dead row outputs sum 0 * Z v
// (0, or NaN from an attended non-finite v) and lse -inf.
template <typename M16, int DP>
__device__ void fwd_row_careful(const AttnParams& p, int b, int h, int i,
                                uint32_t stream, int lane) {
  constexpr int U = DP / 32;
  const CarefulQuery<M16, DP> row(p, b, h, i, lane);
  float m = -INFINITY, s;
  for (int j = row.n_begin; j < row.n_end; ++j) {
    if (row.score(p, j, lane, s)) m = max_nan(m, s);
  }
  const bool dead = m == -INFINITY;
  const float m_safe = dead ? 0.f : m;
  float l = 0.f, acc[U] = {};
  for (int j = row.n_begin; j < row.n_end; ++j) {
    if (row.score(p, j, lane, s)) {
      const float e = exp2f(s - m_safe);  // 0 in a dead row
      l += e;
      axpy_row<M16, DP>(acc, e * dropout_scale(p, stream, row.rng_row, j), row.v_row(p, j), p.Dv,
                        lane);
    }
  }
  uint16_t* out = p.out + p.out_s.at(b, h, p.q0 + i);
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int d = lane + 32 * u;
    if (d < p.Dv) out[d] = M16::from_float(dead ? acc[u] : acc[u] / l);
  }
  if (lane == 0) p.lse[p.st.at(b, h, p.q0 + i)] = dead ? -INFINITY : (m + log2f(l)) * kLn2;
}

// dQ, careful: dq[i] of query i of (b, h), and the dmask entries of its visible keys (dS where
// attended, 0 elsewhere). A row with lse = -inf attends nothing: dq 0.
template <typename M16, int DP>
__device__ void dq_row_careful(const AttnParams& p, int64_t bh, int b, int h, int i,
                               uint32_t stream, int lane) {
  constexpr int U = DP / 32;
  const CarefulQuery<M16, DP> row(p, b, h, i, lane);
  const float lse2 = p.lse_in[p.st.at(b, h, p.q0 + i)] * kLog2e;
  const float delta = p.delta[p.st.at(b, h, p.q0 + i)];
  float dod[U], acc[U] = {};
  load_row_features<M16, DP>(dod, p.dout + b * p.do_sb + h * p.do_sh + int64_t{i} * p.do_sl,
                             p.Dv, lane);
  float* dmask_row = p.dmask != nullptr ? p.dmask + (bh * p.Lq + i) * p.Lk : nullptr;
  for (int j = row.n_begin; j < row.n_end && lse2 != -INFINITY; ++j) {
    float s, ds = 0.f;
    if (row.score(p, j, lane, s)) {
      const float dp = warp_dot<M16, DP>(dod, row.v_row(p, j), p.Dv, lane);
      ds = exp2f(s - lse2) * (dp * dropout_scale(p, stream, row.rng_row, j) - delta);
      axpy_row<M16, DP>(acc, ds, row.k_row(p, j), p.D, lane);
    }
    if (dmask_row != nullptr && lane == 0) dmask_row[j] = ds;
  }
  uint16_t* dq = p.dq + p.dq_s.at(b, h, p.q0 + i);
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int d = lane + 32 * u;
    if (d < p.D) dq[d] = M16::from_float(acc[u] * p.scale);
  }
}

// dK / dV, careful: dk[j] and dv[j] of key j of (b, kv head hk), summed over the GQA group's
// query heads and their queries attending j (rows with lse = -inf attend nothing).
template <typename M16, int DP>
__device__ void dkdv_key_careful(const AttnParams& p, int b, int hk, int j, int lane) {
  constexpr int U = DP / 32;
  float kd[U], vd[U], adk[U] = {}, adv[U] = {};
  load_row_features<M16, DP>(kd, p.k + b * p.k_sb + hk * p.k_sh + int64_t{j} * p.k_sl, p.D, lane);
  load_row_features<M16, DP>(vd, p.v + b * p.v_sb + hk * p.v_sh + int64_t{j} * p.v_sl, p.Dv, lane);
  int i_begin, i_end;
  query_range(p, j, 1, i_begin, i_end);
  for (int gi = 0; gi < p.group; ++gi) {
    const int h = hk * p.group + gi;
    const uint16_t* q_base = p.q + b * p.q_sb + h * p.q_sh;
    const uint16_t* do_base = p.dout + b * p.do_sb + h * p.do_sh;
    const int64_t mask_base = b * p.m_sb + h * p.m_sh + int64_t{j} * p.m_sk;
    const uint32_t stream = dropout_stream(p.seed, b, h, p.H);
    for (int i = i_begin; i < i_end; ++i) {
      const float lse2 = p.lse_in[p.st.at(b, h, p.q0 + i)] * kLog2e;
      const uint16_t* q_row = q_base + int64_t{i} * p.q_sl;
      float s;
      if (lse2 == -INFINITY ||
          !attended_score<M16, DP>(p, kd, q_row, i, j, mask_base + int64_t{i} * p.m_sl, lane, s)) {
        continue;
      }
      const uint16_t* do_row = do_base + int64_t{i} * p.do_sl;
      const float pr = exp2f(s - lse2);
      const float z = dropout_scale(p, stream, dropout_row_base(i, p.Lk), j);
      const float dp = warp_dot<M16, DP>(vd, do_row, p.Dv, lane);
      axpy_row<M16, DP>(adv, pr * z, do_row, p.Dv, lane);
      axpy_row<M16, DP>(adk, pr * (dp * z - p.delta[p.st.at(b, h, p.q0 + i)]), q_row, p.D, lane);
    }
  }
  uint16_t* dk = p.dk + p.dk_s.at(b, hk, p.k0 + j);
  uint16_t* dv = p.dv + p.dv_s.at(b, hk, p.k0 + j);
#pragma unroll
  for (int u = 0; u < U; ++u) {
    const int d = lane + 32 * u;
    if (d < p.D) dk[d] = M16::from_float(adk[u] * p.scale);
    if (d < p.Dv) dv[d] = M16::from_float(adv[u]);
  }
}

// The opening of the three tile kernels (template <typename T, typename Cfg, bool PACKED,
// int SMEM_BYTES>; PACKED: a varlen launch, each CTA narrowed to its sequence by seq_view):
// the symbol's shared memory checked against the launch's, the operand type, the tile shapes
// and the dynamic shared memory.
#define FASTATTN_ATTN_TILE_KERNEL_SETUP()                                                      \
  static_assert(SMEM_BYTES == Cfg::SMEM, "the symbol's shared memory must be the launch's");  \
  using M16 = Mma16<T>;                                                                      \
  constexpr int DP = Cfg::DP, BN = Cfg::BN, BM = Cfg::BM, NT = Cfg::NTHREADS;                \
  FASTATTN_DYNAMIC_SMEM(unsigned char, smem_raw)

// ---------------------------------------------------------------------------------------------
// Forward. SMEM_BYTES == Cfg::SMEM: it is a template argument so that the symbol carries the
// dynamic shared memory the launch asks for (the compile gate reports it).

template <typename T, typename Cfg, bool PACKED, int SMEM_BYTES>
__global__ void __launch_bounds__(Cfg::NTHREADS, 1) attn_fwd_kernel(const AttnParams launch) {
  FASTATTN_ATTN_TILE_KERNEL_SETUP();
  using L = Swizzled<DP>;
  constexpr int MT = Cfg::MT, RW = Cfg::RW;  // m16 tiles and rows per warp
  uint16_t* sQ = reinterpret_cast<uint16_t*>(smem_raw);
  uint16_t* sKV = sQ + Cfg::Q_ELEMS;  // stage s: K at sKV + 2 s KV_ELEMS, V right after it

  const QueryCta cta = query_cta(launch, BM, RW);
  const AttnParams& p = seq_view<PACKED>(launch, cta.b);
  if (PACKED && cta.m0 >= p.Lq) return;  // past its sequence's end (the whole CTA, no barrier yet)
  const int b = cta.b, h = cta.h, hk = cta.hk, m0 = cta.m0, lane = cta.w.lane, t = cta.w.t,
            wrow = cta.w.wrow;
  // The queries of this lane's rows: tile mt, accumulator row r (cta.i_row[] + 16 mt).
  int i_row[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    i_row[mt][0] = cta.i_row[0] + 16 * mt;
    i_row[mt][1] = cta.i_row[1] + 16 * mt;
  }

  const uint16_t* q_base = p.q + b * p.q_sb + h * p.q_sh;
  const uint16_t* k_base = p.k + b * p.k_sb + hk * p.k_sh;
  const uint16_t* v_base = p.v + b * p.v_sb + hk * p.v_sh;
  const KeyTiles tiles = key_tiles(p, m0, BM, BN);

  // Prologue: group 0 = Q, group 1 = key tile 0 (empty when there is none).
  load_tile_async<BM, DP, NT>(sQ, q_base, p.q_sl, m0, p.Lq, p.D, p.vec_q);
  cp_async_commit();
  if (tiles.num > 0) load_kv_async<Cfg>(sKV, 0, p, k_base, v_base, tiles.first);
  cp_async_commit();
  cp_async_wait<1>();  // Q has landed (this thread's part) ...
  __syncthreads();     // ... and every thread's

  uint32_t qf[Cfg::Q_IN_REGS ? DP / 16 : 1][4];
  if constexpr (Cfg::Q_IN_REGS) {
#pragma unroll
    for (int kk = 0; kk < DP / 16; ++kk) ldsm_a<DP>(qf[kk], sQ, wrow, kk * 16, lane);
  }

  int64_t mask_row[MT][2];
  uint32_t rng_row[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      mask_row[mt][r] = b * p.m_sb + h * p.m_sh + int64_t{i_row[mt][r]} * p.m_sl;
      rng_row[mt][r] = dropout_row_base(i_row[mt][r], p.Lk);
    }
  }
  const uint32_t stream = dropout_stream(p.seed, b, h, p.H);

  float o[MT][DP / 8][4] = {};
  float m_run[MT][2], l_run[MT][2];  // l_run: per-lane partial row sums (quad-reduced at the end)
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
    m_run[mt][0] = m_run[mt][1] = -INFINITY;
    l_run[mt][0] = l_run[mt][1] = 0.f;
  }

  for_each_key_tile<Cfg>(p, tiles, sKV, k_base, v_base, [&](int n0, const uint16_t* sK,
                                                            const uint16_t* sV) {
    // S = Q K^T for this warp's RW rows x BN keys, each K fragment read once for the MT tiles.
    float s[MT][BN / 8][4] = {};
#pragma unroll
    for (int kk = 0; kk < DP / 16; ++kk) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) {
        if constexpr (Cfg::Q_IN_REGS) {
#pragma unroll
          for (int e = 0; e < 4; ++e) a[mt][e] = qf[kk][e];
        } else {
          ldsm_a<DP>(a[mt], sQ, wrow + 16 * mt, kk * 16, lane);
        }
      }
#pragma unroll
      for (int np = 0; np < BN / 16; ++np) {
        mma_block_tiles<M16, DP, true>(s, 2 * np, a, sK, np * 16, kk * 16, lane);
      }
    }

#pragma unroll
    for (int mt = 0; mt < MT; ++mt) {
      // The online softmax of the tile's rows, given its scores in log2 units as sc * s (-inf
      // where not visible) and their row maxima mx: the running max and sum, alpha (the factor
      // O is rescaled by), and P (relative to the running max) in s.
      float alpha[2];
      auto softmax_rows = [&](float (&mx)[2], float sc) {
        float m_safe[2];
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          const float m_new = fmaxf(m_run[mt][r], quad_max(mx[r]));
          m_safe[r] = m_new == -INFINITY ? 0.f : m_new;
          alpha[r] = exp2f(m_run[mt][r] - m_safe[r]);  // 0 while the row was empty
          m_run[mt][r] = m_new;
          l_run[mt][r] *= alpha[r];
        }
#pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            // exp2(-inf) = 0 where not visible
            const float pr = exp2f(fmaf(s[mt][nt][e], sc, -m_safe[e >> 1]));
            l_run[mt][e >> 1] += pr;
            s[mt][nt][e] = pr;
          }
        }
      };
      float mx[2] = {-INFINITY, -INFINITY};
      if (p.scale_log2 > 0.f && tile_whole(p, m0 + wrow + 16 * mt, 16, n0, BN)) {  // warp-uniform
        // A whole tile keeps the raw products: the row max of the raw products times the
        // (positive) scale is the max of the scaled ones, rounding being monotonic, and the
        // scale rides in the exponent's FMA -- one instruction an element, not a multiply and a
        // subtraction. (softmax_rows is written out in each branch: joined, the branches' s
        // would need ~32 register moves.)
#pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) mx[e >> 1] = fmaxf(mx[e >> 1], s[mt][nt][e]);
        }
        mx[0] *= p.scale_log2;
        mx[1] *= p.scale_log2;
        softmax_rows(mx, p.scale_log2);
      } else {
#pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int r = e >> 1;
            const int j = n0 + nt * 8 + 2 * t + (e & 1);
            const float v = visible(p, i_row[mt][r], j)
                                ? score_log2(p, s[mt][nt][e], mask_row[mt][r] + int64_t{j} * p.m_sk)
                                : -INFINITY;
            s[mt][nt][e] = v;
            mx[r] = fmaxf(mx[r], v);
          }
        }
        softmax_rows(mx, 1.f);
      }
      // Dropout on P (the row sums above are of the undropped P): one block-uniform branch a
      // tile, not one per element pair.
      if (p.dropout) {
#pragma unroll
        for (int nt = 0; nt < BN / 8; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const uint32_t j = static_cast<uint32_t>(n0 + nt * 8 + 2 * t + (e & 1));
            if (dropout_bits(stream, rng_row[mt][e >> 1], j) < p.threshold) s[mt][nt][e] = 0.f;
          }
        }
      }
#pragma unroll
      for (int dt = 0; dt < DP / 8; ++dt) {
        o[mt][dt][0] *= alpha[0];
        o[mt][dt][1] *= alpha[0];
        o[mt][dt][2] *= alpha[1];
        o[mt][dt][3] *= alpha[1];
      }
    }
    // O += P V: P from the accumulators (A), V row-major through ldmatrix.trans (B), each V
    // fragment read once for the MT tiles.
#pragma unroll
    for (int ks = 0; ks < BN / 16; ++ks) {
      uint32_t a[MT][4];
#pragma unroll
      for (int mt = 0; mt < MT; ++mt) acc_to_a<M16>(a[mt], s[mt], ks);
#pragma unroll
      for (int dp = 0; dp < DP / 16; ++dp) {
        mma_block_tiles<M16, DP, false>(o, 2 * dp, a, sV, ks * 16, dp * 16, lane);
      }
    }
  });
  cp_async_wait<0>();  // nothing may land after the CTA exits (the last group is empty anyway)

  // The NaN rule: a NaN in this warp's accumulators (O or a row sum, rows < Lq) is an attended
  // non-finite value or a leak; then the warp recomputes its rows on the careful path.
  float probe = 0.f;
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      if (i_row[mt][r] >= p.Lq) continue;
      probe += l_run[mt][r];
#pragma unroll
      for (int dt = 0; dt < DP / 8; ++dt) probe += o[mt][dt][2 * r] + o[mt][dt][2 * r + 1];
    }
  }
  if (__any_sync(0xffffffffu, is_nan(probe))) {  // NaN + anything is NaN (so is inf - inf)
    for (int row = 0; row < RW; ++row) {
      const int i = m0 + wrow + row;
      if (i < p.Lq) fwd_row_careful<M16, DP>(p, b, h, i, stream, lane);
    }
    return;
  }

  // Epilogue: normalize; stage O (16-bit) in this warp's own RW rows of the Q tile (no other
  // warp reads them any more: Q fragments of a warp come from its own rows), then write whole
  // 16-byte chunks of the rows < Lq, columns < Dv.
  float inv[MT][2];
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const float l = quad_sum(l_run[mt][r]);
      inv[mt][r] = l > 0.f ? p.rcp_keep / l : 0.f;  // fully masked row: O = 0
      if (t == 0 && i_row[mt][r] < p.Lq) {
        p.lse[p.st.at(b, h, p.q0 + i_row[mt][r])] =
            l > 0.f ? (m_run[mt][r] + log2f(l)) * kLn2 : -INFINITY;
      }
    }
  }
  __syncwarp();  // this warp's ldmatrix reads of its Q rows are done before they are overwritten
#pragma unroll
  for (int mt = 0; mt < MT; ++mt) {
#pragma unroll
    for (int dt = 0; dt < DP / 8; ++dt) {
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        st_shared(sQ + L::offset(cta.w.row[r] + 16 * mt, dt * 8 + 2 * t),
                  M16::pack(o[mt][dt][2 * r] * inv[mt][r], o[mt][dt][2 * r + 1] * inv[mt][r]));
      }
    }
  }
  __syncwarp();
  const bool vec_out = p.Dv % 8 == 0;
  for (int idx = lane; idx < RW * L::CHUNKS; idx += 32) {
    const int row = idx / L::CHUNKS, ch = idx % L::CHUNKS;
    const int i = m0 + wrow + row, col = ch * 8;
    if (i >= p.Lq || col >= p.Dv) continue;
    const uint4 v = ld_shared<uint4>(sQ + L::chunk_offset(wrow + row, ch));
    uint16_t* dst = p.out + p.out_s.at(b, h, p.q0 + i) + col;
    if (vec_out) {
      *reinterpret_cast<uint4*>(dst) = v;
    } else {
      const uint32_t words[4] = {v.x, v.y, v.z, v.w};
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        if (col + e < p.Dv) dst[e] = static_cast<uint16_t>(words[e / 2] >> (16 * (e % 2)));
      }
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Backward 1/3: delta = rowsum(dO * O), float32, one warp per (b, h, i) row.

template <typename T>
__global__ void __launch_bounds__(128) attn_bwd_delta_kernel(const AttnParams p) {
  using M16 = Mma16<T>;
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  const int64_t rows = int64_t{p.B} * p.H * p.Lq;
  for (int64_t row = int64_t{blockIdx.x} * 4 + warp; row < rows; row += int64_t{gridDim.x} * 4) {
    const int64_t bh = row / p.Lq;
    const int64_t i = row % p.Lq;
    const int64_t b = bh / p.H, h = bh % p.H;
    const uint16_t* dO = p.dout + b * p.do_sb + h * p.do_sh + i * p.do_sl;
    const uint16_t* O = p.o + b * p.o_sb + h * p.o_sh + i * p.o_sl;
    float acc = 0.f;
    for (int d = lane; d < p.Dv; d += 32) acc += M16::to_float(dO[d]) * M16::to_float(O[d]);
    acc = warp_sum(acc);
    if (lane == 0) p.delta[row] = acc;
  }
}

// acc[row][col .. col + 1] += (x, y) as one float2 (cuda_layout.cuh, section 4).
template <int DP>
__device__ __forceinline__ void acc_add2(float* acc, int row, int col, float x, float y) {
  float* q = acc + AccTile<DP>::offset(row, col);
  float2 v = ld_shared<float2>(q);
  v.x += x;
  v.y += y;
  st_shared(q, v);
}

// Calls f(whole, plain) with compile-time flags for a warp's tile (warp-uniform arguments):
// whole tiles (tile_whole) skip the per-element bounds / band / mask tests, and plain ones (no
// dropout, no dmask) the per-element dropout and dmask work too; other tiles take the general
// path. The backward kernels' dS loops are written once for the three.
template <typename F>
__device__ __forceinline__ void by_tile_kind(bool whole, bool plain, F&& f) {
  if (!whole) {
    f(std::false_type{}, std::false_type{});
  } else if (plain) {
    f(std::true_type{}, std::true_type{});
  } else {
    f(std::true_type{}, std::false_type{});
  }
}

// ---------------------------------------------------------------------------------------------
// Backward 2/3: dK and dV, one CTA per (BN keys, b, kv head).

template <typename T, typename Cfg, bool PACKED, int SMEM_BYTES>
__global__ void __launch_bounds__(Cfg::NTHREADS, 1) attn_bwd_dkdv_kernel(const AttnParams launch) {
  FASTATTN_ATTN_TILE_KERNEL_SETUP();
  using A = AccTile<DP>;
  uint16_t* sK = reinterpret_cast<uint16_t*>(smem_raw);
  uint16_t* sV = sK + Cfg::K_ELEMS;
  uint16_t* sQdO = sV + Cfg::K_ELEMS;  // stage s: Q at sQdO + 2 s Q_ELEMS, dO right after it
  float* sdK = reinterpret_cast<float*>(sQdO + Cfg::STAGES * 2 * Cfg::Q_ELEMS);
  float* sdV = sdK + Cfg::ACC_ELEMS;
  float* sStats = sdV + Cfg::ACC_ELEMS;  // stage s: lse * log2(e) at sStats + 2 s BM, delta after

  // Decoded here rather than by grid_block() / warp_rows(): with those, ptxas gives the DP = 256
  // variant 2 more registers (146, against 144; fastattn/aot/cuda.py).
  const int num_kb = (launch.Lk + BN - 1) / BN;
  const int kb = static_cast<int>(blockIdx.x % num_kb);
  const int64_t bhk = blockIdx.x / num_kb;
  const int b = static_cast<int>(bhk / launch.Hkv), hk = static_cast<int>(bhk % launch.Hkv);
  const int n0 = kb * BN;
  const AttnParams& p = seq_view<PACKED>(launch, b);
  if (PACKED && n0 >= p.Lk) return;  // past its sequence's end (the whole CTA, no barrier yet)
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32, t = lane & 3;
  const int wrow = warp * 16;
  const int kr[2] = {wrow + (lane >> 2), wrow + (lane >> 2) + 8};  // local key rows
  const int j_row[2] = {n0 + kr[0], n0 + kr[1]};

  load_tile_async<BN, DP, NT>(sK, p.k + b * p.k_sb + hk * p.k_sh, p.k_sl, n0, p.Lk, p.D, p.vec_k);
  load_tile_async<BN, DP, NT>(sV, p.v + b * p.v_sb + hk * p.v_sh, p.v_sl, n0, p.Lk, p.Dv, p.vec_v);
  cp_async_commit();
  for (int i = threadIdx.x; i < 2 * Cfg::ACC_ELEMS; i += NT) st_shared(sdK + i, 0.f);  // sdK, sdV adjacent
  constexpr int NACC = Cfg::ACC_IN_REGS ? DP / 8 : 1;
  float acc_dk[NACC][4] = {}, acc_dv[NACC][4] = {};  // ACC_IN_REGS: C fragments, keys x dims

  // The query blocks this CTA visits, one sequence for the whole GQA group: block `it` is
  // queries [m_first + (it % per_head) BM, + BM) of query head hk * group + it / per_head.
  int i_begin, i_end;
  query_range(p, n0, BN, i_begin, i_end);
  const int m_first = (i_begin / BM) * BM;
  const int per_head = i_begin < i_end ? (i_end - m_first + BM - 1) / BM : 0;
  const int num_blocks = per_head * p.group;
  // Block it's Q / dO copies into stage it % 2 (issued, not committed), and its lse / delta
  // (thread r < BM: row r) into registers; stash_stats moves those into the stage. The loads
  // are issued a whole block's compute before their use, so their latency is hidden.
  // Block it is (gi, bi) = (it / per_head, it % per_head), stepped rather than divided (a
  // division by a runtime value is ~35 instructions; two a block were ~10% of the loop's).
  float lse_next = -INFINITY, delta_next = 0.f;
  auto fetch_block = [&](int it, int gi, int bi) {
    const int h = hk * p.group + gi, m0 = m_first + bi * BM;
    uint16_t* s = sQdO + (it & 1) * 2 * Cfg::Q_ELEMS;
    load_tile_async<BM, DP, NT>(s, p.q + b * p.q_sb + h * p.q_sh, p.q_sl, m0, p.Lq, p.D, p.vec_q);
    load_tile_async<BM, DP, NT>(s + Cfg::Q_ELEMS, p.dout + b * p.do_sb + h * p.do_sh, p.do_sl, m0,
                                p.Lq, p.Dv, p.vec_do);
    const int i = m0 + static_cast<int>(threadIdx.x);
    if (threadIdx.x < BM && i < p.Lq) {
      const int64_t row = p.st.at(b, h, p.q0 + i);
      lse_next = p.lse_in[row] * kLog2e;
      delta_next = p.delta[row];
    } else {
      lse_next = -INFINITY;
      delta_next = 0.f;
    }
  };
  auto stash_stats = [&](int it) {
    if (threadIdx.x < BM) {
      float* st = sStats + (it & 1) * 2 * BM;
      st_shared(st + threadIdx.x, lse_next);
      st_shared(st + BM + threadIdx.x, delta_next);
    }
  };
  // Groups: K / V (committed above), then block 0 (empty when there is none).
  if (num_blocks > 0) {
    fetch_block(0, 0, 0);
    stash_stats(0);  // ordered before its readers by iteration 0's first barrier
  }
  cp_async_commit();
  auto step = [&](int& g, int& blk) {  // (g, blk) <- the block after it
    if (++blk == per_head) {
      blk = 0;
      ++g;
    }
  };
  int gi = 0, bi = 0, gi_next = 0, bi_next = 0;  // blocks it and it + 1
  step(gi_next, bi_next);
  for (int it = 0; it < num_blocks; ++it) {
    // One barrier per block, as for_each_key_tile: wait for block it, barrier, prefetch block
    // it + 1 into the other stage (its last reader, block it - 1, is behind every thread).
    cp_async_wait<0>();  // block it (and K / V) landed here ...
    __syncthreads();     // ... and in every thread, its stats are stashed, block it - 1 is done
    if (it + 1 < num_blocks) fetch_block(it + 1, gi_next, bi_next);
    cp_async_commit();
    {
      const int m0 = m_first + bi * BM;
      const int h = hk * p.group + gi;
      const int64_t mask_base = b * p.m_sb + h * p.m_sh;
      const uint32_t stream = dropout_stream(p.seed, b, h, p.H);
      const uint16_t* sQ = sQdO + (it & 1) * 2 * Cfg::Q_ELEMS;
      const uint16_t* sdO = sQ + Cfg::Q_ELEMS;
      const float* sLse = sStats + (it & 1) * 2 * BM;
      const float* sDelta = sLse + BM;

      // S^T = K Q^T and dP^T = V dO^T for this warp's 16 keys x BM queries.
      float st[BM / 8][4] = {};
      float dpt[BM / 8][4] = {};
      mma_two_xt<M16, DP, BM>(st, sK, sQ, dpt, sV, sdO, wrow, lane);
      // st <- P^T * Z (operand of dV), dpt <- dS^T (operand of dK). Per element tests only on
      // tiles the warp does not see whole (bounds, band edge, user mask), as in the forward;
      // without dropout (`plain`) whole tiles take no per-element branch at all.
      auto to_grads = [&](auto whole, auto plain) {
#pragma unroll
        for (int nt = 0; nt < BM / 8; ++nt) {
#pragma unroll
          for (int e = 0; e < 4; ++e) {
            const int j = j_row[e >> 1];
            const int qc = nt * 8 + 2 * t + (e & 1);
            const int i = m0 + qc;
            const float lse2 = ld_shared<float>(sLse + qc);
            float pz = 0.f, ds = 0.f;
            if (decltype(whole)::value || (visible(p, i, j) && lse2 != -INFINITY)) {
              const int64_t mask_off = mask_base + int64_t{i} * p.m_sl + int64_t{j} * p.m_sk;
              const float s2 = decltype(whole)::value ? st[nt][e] * p.scale_log2
                                                      : score_log2(p, st[nt][e], mask_off);
              const float pr = exp2f(s2 - lse2);
              const float z = decltype(plain)::value
                                  ? 1.f
                                  : dropout_scale(p, stream, dropout_row_base(i, p.Lk), j);
              pz = pr * z;
              ds = pr * (dpt[nt][e] * z - ld_shared<float>(sDelta + qc));
            }
            st[nt][e] = pz;
            dpt[nt][e] = ds;
          }
        }
      };
      by_tile_kind(tile_whole(p, m0, BM, n0 + wrow, 16), !p.dropout, to_grads);
      // A fragments (rows = keys, k = queries) of P^T Z and dS^T.
      uint32_t a_p[BM / 16][4], a_ds[BM / 16][4];
#pragma unroll
      for (int ks = 0; ks < BM / 16; ++ks) {
        acc_to_a<M16>(a_p[ks], st, ks);
        acc_to_a<M16>(a_ds[ks], dpt, ks);
      }
      // dV += (P Z)^T dO and dK += dS^T Q, 16 columns at a time, into this lane's own
      // accumulator elements (rows kr[0] / kr[1], columns dp * 16 + nt * 8 + 2t, +1).
#pragma unroll
      for (int dp = 0; dp < DP / 16; ++dp) {
        if constexpr (Cfg::ACC_IN_REGS) {
#pragma unroll
          for (int ks = 0; ks < BM / 16; ++ks) {
            mma_block<M16, DP, false>(acc_dv[2 * dp], acc_dv[2 * dp + 1], a_p[ks], sdO, ks * 16,
                                      dp * 16, lane);
            mma_block<M16, DP, false>(acc_dk[2 * dp], acc_dk[2 * dp + 1], a_ds[ks], sQ, ks * 16,
                                      dp * 16, lane);
          }
          continue;
        }
        float cv[2][4] = {}, ck[2][4] = {};
#pragma unroll
        for (int ks = 0; ks < BM / 16; ++ks) {
          mma_block<M16, DP, false>(cv[0], cv[1], a_p[ks], sdO, ks * 16, dp * 16, lane);
          mma_block<M16, DP, false>(ck[0], ck[1], a_ds[ks], sQ, ks * 16, dp * 16, lane);
        }
#pragma unroll
        for (int nt = 0; nt < 2; ++nt) {
          const int c = dp * 16 + nt * 8 + 2 * t;
#pragma unroll
          for (int r = 0; r < 2; ++r) {
            acc_add2<DP>(sdV, kr[r], c, cv[nt][2 * r], cv[nt][2 * r + 1]);
            acc_add2<DP>(sdK, kr[r], c, ck[nt][2 * r], ck[nt][2 * r + 1]);
          }
        }
      }
    }
    if (it + 1 < num_blocks) stash_stats(it + 1);  // that stage's last reader was block it - 1
    gi = gi_next;
    bi = bi_next;
    step(gi_next, bi_next);
  }
  cp_async_wait<0>();  // K / V landed even when no query block was visited
  uint16_t* dk = p.dk + p.dk_s.at(b, hk, p.k0);
  uint16_t* dv = p.dv + p.dv_s.at(b, hk, p.k0);
  float probe = 0.f;  // the sum of what this thread writes: NaN if any of it is NaN
  if constexpr (Cfg::ACC_IN_REGS) {
    // Lane (g, t) holds keys kr[0], kr[1] x columns dt * 8 + 2t, +1 of dK and dV.
#pragma unroll
    for (int r = 0; r < 2; ++r) {
      const int j = j_row[r];
      if (j >= p.Lk) continue;
#pragma unroll
      for (int dt = 0; dt < DP / 8; ++dt) {
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          const int c = dt * 8 + 2 * t + e;
          const float gk = acc_dk[dt][2 * r + e] * p.scale, gv = acc_dv[dt][2 * r + e];
          if (c < p.D) dk[j * p.dk_s.sl + c] = M16::from_float(gk);
          if (c < p.Dv) dv[j * p.dv_s.sl + c] = M16::from_float(gv);
          probe += (c < p.D ? gk : 0.f) + (c < p.Dv ? gv : 0.f);
        }
      }
    }
  } else {
    __syncthreads();  // all warps' shared accumulators (and the zero fill) are complete
    for (int idx = threadIdx.x; idx < BN * DP; idx += NT) {
      const int r = idx / DP, c = idx % DP;
      const int j = n0 + r;
      if (j >= p.Lk) continue;
      const float gk = ld_shared<float>(sdK + A::offset(r, c)) * p.scale,
                  gv = ld_shared<float>(sdV + A::offset(r, c));
      if (c < p.D) dk[j * p.dk_s.sl + c] = M16::from_float(gk);
      if (c < p.Dv) dv[j * p.dv_s.sl + c] = M16::from_float(gv);
      probe += (c < p.D ? gk : 0.f) + (c < p.Dv ? gv : 0.f);
    }
  }
  // The NaN rule: a NaN in what the CTA wrote is an attended non-finite value or a leak; then
  // every warp rewrites its 16 keys on the careful path (the barrier orders the writes).
  if (__syncthreads_or(is_nan(probe))) {
    for (int row = 0; row < 16; ++row) {
      const int j = n0 + wrow + row;
      if (j < p.Lk) dkdv_key_careful<M16, DP>(p, b, hk, j, lane);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Backward 3/3: dQ (and dmask), one CTA per (BM queries, b, h).

template <typename T, typename Cfg, bool PACKED, int SMEM_BYTES>
__global__ void __launch_bounds__(Cfg::NTHREADS, Cfg::MIN_CTAS)
    attn_bwd_dq_kernel(const AttnParams launch) {
  FASTATTN_ATTN_TILE_KERNEL_SETUP();
  using A = AccTile<DP>;
  uint16_t* sQ = reinterpret_cast<uint16_t*>(smem_raw);
  uint16_t* sdO = sQ + Cfg::Q_ELEMS;
  uint16_t* sKV = sdO + Cfg::Q_ELEMS;  // stage s: K at sKV + 2 s KV_ELEMS, V right after it
  float* sdQ = reinterpret_cast<float*>(sKV + Cfg::STAGES * 2 * Cfg::KV_ELEMS);

  const QueryCta cta = query_cta(launch, BM);
  const AttnParams& p = seq_view<PACKED>(launch, cta.b);
  if (PACKED && cta.m0 >= p.Lq) return;  // past its sequence's end (the whole CTA, no barrier yet)
  const int64_t bh = cta.bh;
  const int b = cta.b, h = cta.h, hk = cta.hk, m0 = cta.m0, lane = cta.w.lane, t = cta.w.t,
            wrow = cta.w.wrow;
  const int i_row[2] = {cta.i_row[0], cta.i_row[1]};

  load_tile_async<BM, DP, NT>(sQ, p.q + b * p.q_sb + h * p.q_sh, p.q_sl, m0, p.Lq, p.D, p.vec_q);
  load_tile_async<BM, DP, NT>(sdO, p.dout + b * p.do_sb + h * p.do_sh, p.do_sl, m0, p.Lq, p.Dv,
                              p.vec_do);
  cp_async_commit();
  for (int i = threadIdx.x; i < Cfg::ACC_ELEMS; i += NT) st_shared(sdQ + i, 0.f);
  const uint16_t* k_base = p.k + b * p.k_sb + hk * p.k_sh;
  const uint16_t* v_base = p.v + b * p.v_sb + hk * p.v_sh;

  float lse2[2], delta[2];
  int64_t mask_row[2];
  uint32_t rng_row[2];
#pragma unroll
  for (int r = 0; r < 2; ++r) {
    const int i = i_row[r];
    lse2[r] = i < p.Lq ? p.lse_in[p.st.at(b, h, p.q0 + i)] * kLog2e : -INFINITY;
    delta[r] = i < p.Lq ? p.delta[p.st.at(b, h, p.q0 + i)] : 0.f;
    mask_row[r] = b * p.m_sb + h * p.m_sh + int64_t{i} * p.m_sl;
    rng_row[r] = dropout_row_base(i, p.Lk);
  }
  const uint32_t stream = dropout_stream(p.seed, b, h, p.H);
  float* dmask_rows = p.dmask != nullptr ? p.dmask + bh * p.Lq * p.Lk : nullptr;

  // Groups: Q / dO (committed above), then key tile 0 (empty when there is none).
  const KeyTiles tiles = key_tiles(p, m0, BM, BN);
  if (tiles.num > 0) load_kv_async<Cfg>(sKV, 0, p, k_base, v_base, tiles.first);
  cp_async_commit();
  // dQ of this lane's rows (w.row[0], w.row[1]) and columns nd * 8 + 2t, +1, at DP = 128.
  float acc_dq[Cfg::ACC_IN_REGS ? DP / 8 : 1][4] = {};
  // The first wait also covers Q / dO, and its barrier sdQ's zero fill.
  for_each_key_tile<Cfg>(p, tiles, sKV, k_base, v_base, [&](int n0, const uint16_t* sK,
                                                            const uint16_t* sV) {
    float s[BN / 8][4] = {};
    float dp[BN / 8][4] = {};
    mma_two_xt<M16, DP, BN>(s, sQ, sK, dp, sdO, sV, wrow, lane);
    // s <- dS = P * (Z dP - delta); dmask gets dS for every in-bounds (i, j) of the tile. Per
    // element tests only on tiles the warp does not see whole, as in the forward; with neither
    // dropout nor dmask (`plain`) whole tiles take no per-element branch at all.
    auto to_ds = [&](auto whole, auto plain) {
#pragma unroll
      for (int nt = 0; nt < BN / 8; ++nt) {
#pragma unroll
        for (int e = 0; e < 4; ++e) {
          const int r = e >> 1;
          const int i = i_row[r];
          const int j = n0 + nt * 8 + 2 * t + (e & 1);
          float ds = 0.f;
          if (decltype(whole)::value || (visible(p, i, j) && lse2[r] != -INFINITY)) {
            const float s2 = decltype(whole)::value
                                 ? s[nt][e] * p.scale_log2
                                 : score_log2(p, s[nt][e], mask_row[r] + int64_t{j} * p.m_sk);
            const float pr = exp2f(s2 - lse2[r]);
            const float z = decltype(plain)::value ? 1.f : dropout_scale(p, stream, rng_row[r], j);
            ds = pr * (dp[nt][e] * z - delta[r]);
          }
          if (!decltype(plain)::value && dmask_rows != nullptr && i < p.Lq && j < p.Lk) {
            dmask_rows[int64_t{i} * p.Lk + j] = ds;
          }
          s[nt][e] = ds;
        }
      }
    };
    by_tile_kind(tile_whole(p, m0 + wrow, 16, n0, BN), !p.dropout && dmask_rows == nullptr, to_ds);
    // dQ += dS K: A = dS (rows = queries, k = keys), B = K (k = key, n = dim) via .trans.
    uint32_t a_ds[BN / 16][4];
#pragma unroll
    for (int ks = 0; ks < BN / 16; ++ks) acc_to_a<M16>(a_ds[ks], s, ks);
#pragma unroll
    for (int dq = 0; dq < DP / 16; ++dq) {
      if constexpr (Cfg::ACC_IN_REGS) {
#pragma unroll
        for (int ks = 0; ks < BN / 16; ++ks) {
          mma_block<M16, DP, false>(acc_dq[2 * dq], acc_dq[2 * dq + 1], a_ds[ks], sK, ks * 16,
                                    dq * 16, lane);
        }
        continue;
      }
      float c[2][4] = {};
#pragma unroll
      for (int ks = 0; ks < BN / 16; ++ks) {
        mma_block<M16, DP, false>(c[0], c[1], a_ds[ks], sK, ks * 16, dq * 16, lane);
      }
#pragma unroll
      for (int nt = 0; nt < 2; ++nt) {
        const int col = dq * 16 + nt * 8 + 2 * t;
#pragma unroll
        for (int r = 0; r < 2; ++r) {
          acc_add2<DP>(sdQ, cta.w.row[r], col, c[nt][2 * r], c[nt][2 * r + 1]);
        }
      }
    }
  });
  cp_async_wait<0>();  // nothing may land after the CTA exits
  __syncthreads();     // every lane's dQ accumulators (or the zero fill) complete
  uint16_t* dq = p.dq + p.dq_s.at(b, h, p.q0);
  float probe = 0.f;  // the sum of what this thread writes: NaN if any of it is NaN
  if constexpr (Cfg::ACC_IN_REGS) {
#pragma unroll
    for (int nd = 0; nd < DP / 8; ++nd) {
      const int c = nd * 8 + 2 * t;
#pragma unroll
      for (int r = 0; r < 2; ++r) {
        const int i = i_row[r];
        if (i >= p.Lq) continue;
#pragma unroll
        for (int e = 0; e < 2; ++e) {
          if (c + e < p.D) {
            const float g = acc_dq[nd][2 * r + e] * p.scale;
            dq[i * p.dq_s.sl + c + e] = M16::from_float(g);
            probe += g;
          }
        }
      }
    }
  } else {
    for (int idx = threadIdx.x; idx < BM * DP; idx += NT) {
      const int r = idx / DP, c = idx % DP;
      const int i = m0 + r;
      if (i < p.Lq && c < p.D) {
        const float g = ld_shared<float>(sdQ + A::offset(r, c)) * p.scale;
        dq[i * p.dq_s.sl + c] = M16::from_float(g);
        probe += g;
      }
    }
  }
  // The NaN rule: a NaN in the CTA's dQ is an attended non-finite value or a leak (a leaked dS
  // also reaches dQ); then every warp rewrites its 16 rows (and their dmask) carefully.
  if (__syncthreads_or(is_nan(probe))) {
    for (int row = 0; row < 16; ++row) {
      const int i = m0 + wrow + row;
      if (i < p.Lq) dq_row_careful<M16, DP>(p, bh, b, h, i, stream, lane);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Host side.

template <typename Fn>
void with_head_bucket(int64_t d_max, Fn&& fn) {
  if (d_max <= 64) {
    fn(std::integral_constant<int, 64>{});
  } else if (d_max <= 128) {
    fn(std::integral_constant<int, 128>{});
  } else {
    fn(std::integral_constant<int, 256>{});
  }
}

// Launches `kernel` with `smem` bytes of dynamic shared memory on `blocks` 1-D blocks.
template <typename Kernel>
void launch(Kernel kernel, int64_t blocks, int threads, int smem, const AttnParams& p,
            int device, cudaStream_t stream, const char* what) {
  if (blocks == 0) return;
  TORCH_CHECK(blocks <= int64_t{0x7fffffff}, what, ": too many blocks (", blocks,
              "); reduce batch * heads * sequence length");
  const int limit = max_smem_optin(device);
  TORCH_CHECK(smem <= limit, what, " needs ", smem, " bytes of shared memory per block but this ",
              "GPU allows ", limit, "; use a smaller head dim or backend=\"triton\"");
  opt_in_smem(kernel, smem);
  launch_kernel(kernel, static_cast<unsigned>(blocks), threads, smem, stream, p);
}

// q, k, v, dout, out: on q's device, 4-D (batch, heads, length, head_dim) or, packed, 3-D
// (total, heads, head_dim), a unit last stride, float16 / bfloat16 like q.
void check_qkv(const at::Tensor& t, const char* name, const at::Tensor& q, bool packed = false) {
  check_cuda_tensor(t, name);
  check_device(t, q, name, "q");
  if (packed) {
    TORCH_CHECK(t.dim() == 3, name, " must be 3-D (total, heads, head_dim), got shape ", t.sizes());
  } else {
    TORCH_CHECK(t.dim() == 4, name, " must be 4-D (batch, heads, length, head_dim), got shape ",
                t.sizes());
  }
  TORCH_CHECK(t.size(-1) <= 1 || t.stride(-1) == 1, name,
              " must have a contiguous last dimension, got shape ", t.sizes(), " and strides ",
              t.strides());
  const auto dt = t.scalar_type();
  TORCH_CHECK(dt != at::kFloat, "the cuda attention kernels take float16 or bfloat16; ", name,
              " is float32 (shape ", t.sizes(), "). Use backend=\"triton\" or backend=\"cpu\" ",
              "for float32, or cast q, k, v to bfloat16 / float16");
  TORCH_CHECK(dt == at::kHalf || dt == at::kBFloat16, name,
              " must be float16 or bfloat16 for the cuda attention kernels, got ", dt, " (shape ",
              t.sizes(), ")");
  check_dtype(t, q.scalar_type(), name);
}

// The Rows of an output shaped like its input: dense (B, H, L, ·), packed (total, H, ·).
Rows rows_of(const at::Tensor& t) {
  return t.dim() == 4 ? Rows{t.stride(0), t.stride(1), t.stride(2)}
                      : Rows{0, t.stride(1), t.stride(0)};
}

// The Rows of a statistic (unit row stride): dense (B, H, Lq), packed (H, total_q).
Rows stat_rows(const at::Tensor& t) {
  return t.dim() == 3 ? Rows{t.stride(0), t.stride(1), 1} : Rows{0, t.stride(0), 1};
}

// The scalars shared by the dense and packed params: scale and dropout.
void set_scalars(AttnParams& p, double scale, double dropout_p, int64_t seed) {
  TORCH_CHECK(dropout_p >= 0.0 && dropout_p < 1.0, "dropout_p must be in [0, 1), got ", dropout_p);
  p.scale = static_cast<float>(scale);
  p.scale_log2 = static_cast<float>(scale) * kLog2e;
  p.dropout = dropout_p > 0.0;
  p.seed = seed;
  p.threshold = dropout_threshold(dropout_p);
  p.rcp_keep = p.dropout ? static_cast<float>(1.0 / (1.0 - dropout_p)) : 1.f;
}

// Head counts and dims of q (.., H, .., D), k (Hkv, D) and v (Hkv, Dv), checked.
void set_heads(AttnParams& p, int64_t H, int64_t Hkv, int64_t D, int64_t Dv) {
  TORCH_CHECK((Hkv >= 1 && H % Hkv == 0) || (H == 0 && Hkv == 0),
              "the number of query heads (", H, ") must be a multiple of the key/value heads (",
              Hkv, ")");
  TORCH_CHECK(D <= kMaxHeadDim && Dv <= kMaxHeadDim, "head dims up to ", kMaxHeadDim,
              " are supported, got q/k head dim ", D, " and v head dim ", Dv);
  TORCH_CHECK(H <= 0x7fffffff, "heads must fit in int32, got ", H);
  p.H = static_cast<int>(H), p.Hkv = static_cast<int>(Hkv);
  p.group = Hkv > 0 ? static_cast<int>(H / Hkv) : 1;
  p.D = static_cast<int>(D), p.Dv = static_cast<int>(Dv);
}


// FASTATTN_CUDA_FWD_ROWS=32: the forward on 32 query rows a warp (Configs<DP>::FwdWide, head
// dims up to 128), read at each call, so that a GPU session tests and times it beside the default.
bool wide_forward() {
  const char* rows = std::getenv("FASTATTN_CUDA_FWD_ROWS");
  return rows != nullptr && std::strcmp(rows, "32") == 0;
}

template <typename T, typename Cfg, bool PACKED>
void launch_fwd(const AttnParams& p, int device, cudaStream_t stream) {
  const int64_t blocks = ceil_div(p.Lq, Cfg::BM) * p.B * p.H;
  launch(attn_fwd_kernel<T, Cfg, PACKED, Cfg::SMEM>, blocks, Cfg::NTHREADS, Cfg::SMEM, p, device,
         stream, "attention_fwd");
}

// PACKED: varlen launches, on the default configs only.
template <typename T, int DP, bool PACKED>
void run_fwd(const AttnParams& p, int device, cudaStream_t stream) {
  if constexpr (DP <= 128 && !PACKED) {
    if (wide_forward()) {
      return launch_fwd<T, typename Configs<DP>::FwdWide, false>(p, device, stream);
    }
  }
  launch_fwd<T, typename Configs<DP>::Fwd, PACKED>(p, device, stream);
}

template <typename T, int DP, bool PACKED>
void run_bwd(const AttnParams& p, int device, cudaStream_t stream) {
  using KV = typename Configs<DP>::KV;
  using Q = typename Configs<DP>::Q;
  // delta's rows: a packed launch's are one batch row of total_q queries (batch strides 0).
  AttnParams by_row = p;
  if constexpr (PACKED) by_row.B = 1, by_row.Lq = p.total_q;
  const int64_t rows = int64_t{by_row.B} * by_row.H * by_row.Lq;
  if (rows > 0) {
    launch_kernel(attn_bwd_delta_kernel<T>, grid_1d(ceil_div(rows, 4)), 128, 0, stream, by_row);
  }
  launch(attn_bwd_dkdv_kernel<T, KV, PACKED, KV::SMEM>, ceil_div(p.Lk, KV::BN) * p.B * p.Hkv,
         KV::NTHREADS, KV::SMEM, p, device, stream, "attention_bwd (dK/dV)");
  launch(attn_bwd_dq_kernel<T, Q, PACKED, Q::SMEM>, ceil_div(p.Lq, Q::BM) * p.B * p.H, Q::NTHREADS,
         Q::SMEM, p, device, stream, "attention_bwd (dQ)");
}

// Runs the forward (kBwd false) or backward kernels of p on q's device and current stream, for
// q's dtype and the head-dim bucket of max(D, Dv); PACKED: a varlen launch (p.cu_q set).
template <bool kBwd, bool PACKED>
void run(const AttnParams& p, const at::Tensor& q) {
  const int device = q.device().index();
  const cudaStream_t stream = current_stream(device);
  auto with_bucket = [&](auto tag) {
    using T = decltype(tag);
    with_head_bucket(std::max(p.D, p.Dv), [&](auto dp_const) {
      constexpr int DP = decltype(dp_const)::value;
      if constexpr (kBwd) {
        run_bwd<T, DP, PACKED>(p, device, stream);
      } else {
        run_fwd<T, DP, PACKED>(p, device, stream);
      }
    });
  };
  if (q.scalar_type() == at::kHalf) {
    with_bucket(c10::Half{});
  } else {
    with_bucket(c10::BFloat16{});
  }
}

// The forward of p (inputs set) into out / lse (dense or packed).
template <bool PACKED>
std::tuple<at::Tensor, at::Tensor> forward(AttnParams& p, const at::Tensor& q, at::Tensor out,
                                           at::Tensor lse) {
  if (lse.numel() == 0) return {out, lse};
  p.out = reinterpret_cast<uint16_t*>(out.data_ptr());
  p.out_s = rows_of(out);
  p.lse = lse.data_ptr<float>();
  p.st = stat_rows(lse);
  run</*kBwd=*/false, PACKED>(p, q);
  return {out, lse};
}

// The backward of p (inputs set): dout, out and lse checked against q's layout (dense or
// packed), dq / dk / dv allocated like q / k / v; dmask set by the caller.
template <bool PACKED>
std::tuple<at::Tensor, at::Tensor, at::Tensor> backward(AttnParams& p, const at::Tensor& dout,
                                                        const at::Tensor& q, const at::Tensor& k,
                                                        const at::Tensor& v,
                                                        const at::Tensor& out,
                                                        const at::Tensor& lse) {
  std::vector<int64_t> o_shape = q.sizes().vec();
  o_shape.back() = p.Dv;
  for (const auto& [t, name] : {std::pair{&dout, "dout"}, std::pair{&out, "out"}}) {
    check_qkv(*t, name, q, PACKED);
    check_shape(*t, o_shape, name);
  }
  check_cuda_tensor(lse, "lse");
  check_device(lse, q, "lse", "q");
  if constexpr (PACKED) {
    check_shape(lse, {p.H, p.total_q}, "lse");
  } else {
    check_shape(lse, {p.B, p.H, p.Lq}, "lse");
  }
  check_dtype(lse, at::kFloat, "lse");
  check_contiguous(lse, "lse");

  at::Tensor dq = empty_tensor(q.sizes(), q.options());
  at::Tensor dk = empty_tensor(k.sizes(), q.options());
  at::Tensor dv = empty_tensor(v.sizes(), q.options());
  at::Tensor delta = empty_tensor(lse.sizes(), lse.options());
  if (dq.numel() == 0 && dk.numel() == 0 && dv.numel() == 0) return {dq, dk, dv};

  p.dout = reinterpret_cast<const uint16_t*>(dout.const_data_ptr());
  const Rows dos = rows_of(dout), os = rows_of(out);
  p.do_sb = dos.sb, p.do_sh = dos.sh, p.do_sl = dos.sl;
  p.vec_do = is_aligned(p.dout, 16) && strides_multiple_of({p.do_sb, p.do_sh, p.do_sl}, 8);
  p.o = reinterpret_cast<const uint16_t*>(out.const_data_ptr());
  p.o_sb = os.sb, p.o_sh = os.sh, p.o_sl = os.sl;
  p.lse_in = lse.const_data_ptr<float>();
  p.st = stat_rows(lse);
  p.delta = delta.data_ptr<float>();
  p.dq = reinterpret_cast<uint16_t*>(dq.data_ptr());
  p.dk = reinterpret_cast<uint16_t*>(dk.data_ptr());
  p.dv = reinterpret_cast<uint16_t*>(dv.data_ptr());
  p.dq_s = rows_of(dq), p.dk_s = rows_of(dk), p.dv_s = rows_of(dv);
  run</*kBwd=*/true, PACKED>(p, q);
  return {dq, dk, dv};
}

}  // namespace
}  // namespace cuda
}  // namespace fastattn
