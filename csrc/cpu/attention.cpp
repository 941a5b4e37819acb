// Fused scaled dot-product attention on CPU (fastattn::attention_fwd / attention_bwd).
//
// Math (per batch b and query head h; key/value head g = h / (H / Hkv)), as docs/numerics.md:
//
//   S   = scale * Q K^T + M         M: the float mask, or 0 / -inf from a bool mask, and -inf
//                                   outside the band  i + offset - left <= j <= i + offset + right
//   lse = log sum_j exp(S_ij)       float32; -inf for a row with nothing to attend (its O is 0)
//   P   = exp(S - lse),  O = (P * Z) V      Z = keep / (1 - p) from fastattn/rng.h (1 if p = 0)
//
//   delta = rowsum(dO * O),  dV = (P * Z)^T dO,  dS = P * (Z * (dO V^T) - delta),
//   dQ = scale * dS K,  dK = scale * dS^T Q,  dmask = dS (in the accumulation type: float32,
//   float64 for float64 inputs; when asked)
//
// Algorithm: flash attention with O(L) extra memory; no Lq x Lk matrix is ever formed (dmask,
// an output, excepted).
//
// * Packing (memory-bound, parallel): q, k, v (and dout) are converted once to the accumulation
//   type A (float; double for float64) into the layouts the tile GEMMs stream: row-major, the
//   head dim zero-padded to whole 64-byte lines, or transposed tiles (dim x tile). Rows that the
//   GEMMs read as B are spaced by cpu::gemm_ld, never a multiple of 512 bytes apart (at 1 KB, the
//   forward's 256-key K^T tile thrashed L1: cpu_gemm.h). Q is packed times `scale`.
//   That is O((Lq + Lk) * D) memory. The workers depend on A only; float16 / bfloat16 outputs are
//   computed in A and rounded once at the end. In the forward a key tile serves nqb * G tasks;
//   where that is at most two, each task packs the k / v tiles it uses into its own buffers
//   instead (pack_kv_tile), in cache, and only q is packed first; where the kv heads also
//   outnumber the threads, a worker takes all tasks of one kv head at once (whole_kv_head), so
//   each tile is packed once.
// * On Intel CPUs the non-causal forward with no mask and no dropout (H == Hkv,
//   D == Dv, float32 or bfloat16) runs torch's own CPU flash attention, the faster kernel there
//   (torch_forward_applies, below); the NaN rule is checked on its output.
// * Few queries (at most kDecodeRows rows per kv head, no mask, no dropout): the forward runs as
//   decoding, through the paged forward's split-KV worker reading k and v rows in place
//   (cpu::dense_decode_fwd, csrc/cpu/varlen.cpp). Packing costs O(Lk * D), as much as the
//   attention itself at one query.
// * Forward: one task per (query block, b, h): 64 query rows, or up to 256 where no band limits
//   the keys (fwd_block_q). It visits only the key tiles (kFwdBlockK keys, or Lk rounded up to
//   16 when shorter) that intersect the band, each cut to the keys some row of the block can see
//   (trim_to_band), and none that a key-padding mask removes whole (masked_key_tiles; both
//   exact: what is left out adds nothing to any row); per tile S = (scale Q) K^T
//   (register-blocked GEMM, cpu_gemm.h), the mask (read through its strides), the band (edge
//   tiles only: tiles fully inside it skip the test), online softmax (running max / sum,
//   vectorized exp), dropout, and O += P V. Rows that saw no key end with l = 0: O = 0 and
//   lse = -inf.
// * Backward: delta = rowsum(dO * O), then P is recomputed from lse per tile (64 x 64 tiles).
//   No atomics: every output element has one owner, so results are deterministic.
//   - one pass, when the (b, kv head) pairs keep the threads busy: one task per (b, kv head) owns
//     dK / dV of the whole head (task-local O(Lk * D) buffers) and walks the group's query heads,
//     their query tiles and the key tiles inside the band: S, P, dV += (P Z)^T dO, dP = dO V^T,
//     dS, dQ += dS K (the query tile's buffer), dK += dS^T (scale Q). Five GEMMs per tile pair.
//   - two passes, otherwise (few (b, kv head) pairs for the threads): dK/dV tasks per (key block,
//     b, kv head) loop over the group's query heads and query tiles (S^T = K Q^T, P^T, dV, dP^T,
//     dS^T, dK), then dQ tasks per (query block, b, h) loop over key tiles (S, P, dP, dS, dQ).
//     Seven GEMMs per tile pair, but B * H * Lq / 64 and B * Hkv * Lk / 64 tasks.
//   dmask, when asked, is written by whichever task computes dS (it starts as zeros, so tiles
//   outside the band and masked entries are 0). float64 inputs first recompute lse in float64 (a
//   statistics-only forward sweep): the saved lse is float32, and float64 gradients should be
//   exact to float64 rounding.
// * Threads: at::parallel_for starts one worker per thread; workers take tasks from an atomic
//   counter, head by head (the threads share a head's tiles in cache) and within a head the
//   longest (most tiles inside the band) first, so causal / windowed work balances.
//   Which backward variant runs depends on the thread count (rounding may differ between them).
// * SIMD: cpu_simd.h (AVX-512 / AVX2 / baseline chosen at run time).
//
// Precision: float32 / float16 / bfloat16 compute in float32 (inputs converted once), float64 in
// float64; outputs are rounded once. Limits: none on head dims or lengths beyond memory; all
// index arithmetic is int64 (the dropout counter i * Lk + j wraps mod 2^32 by definition).
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/_scaled_dot_product_flash_attention_for_cpu_ops.h>
#include <ATen/ops/isfinite_ops.h>
#include <c10/util/Logging.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <mutex>
#include <numeric>
#include <vector>

#include "fastattn/common.h"
#include "fastattn/cpu_choices.h"
#include "fastattn/cpu_gemm.h"
#include "fastattn/cpu_mask.h"
#include "fastattn/rng.h"
#include "attention_common.h"

namespace fastattn {
namespace {

using namespace cpu_attention;  // csrc/cpu/attention_common.h

// ---------------------------------------------------------------------------------------------
// Forward. The workers depend only on the accumulation type A: inputs arrive packed in A and
// outputs leave in A (the op converts them when the dtype is float16 / bfloat16).

template <class A>
struct FwdArgs {
  Shape sh;
  Band band;
  Dropout drop;
  cpu::MaskView mask;
  A scale;
  const A* qp;  // (B * H * Lq + pad, qld) queries, row-major
  int64_t qld;
  const A* kt;  // (B * Hkv, nkb, D, ldk) transposed key tiles (BK keys, rows ldk apart)
  const A* vp;  // (B * Hkv * Lk + pad, Dvp)
  int64_t Dvp, BQ, BK, ldk, nqb, nkb;
  const int64_t* qb_order;
  const uint8_t* v_bad;  // nonfinite_tiles of vp with tile BK, or null
  const uint8_t* dead;   // masked_key_tiles (per b * H + h and key tile), or null
  // outputs: out (B, H, Lq, Dv) and lse (B, H, Lq); or, for the statistics-only sweep of the
  // float64 backward, lse_acc (B * H, lse_ld) with +inf for rows with nothing to attend.
  void* out;  // of the output's dtype T: written by out_row (below)
  float* lse;
  A* lse_acc;
  int64_t lse_ld;
  // Set when each task packs the key tiles it uses (kt, vp and v_bad are then unused):
  // pack_tile(pack_ctx, bg, kb, kt, vp, buf) writes tile kb of kv head bg as pack_kv_tile does.
  void (*pack_tile)(const void*, int64_t, int64_t, A*, A*, A*) = nullptr;
  const void* pack_ctx = nullptr;
  // Set with pack_tile where the kv heads outnumber the threads: a worker claims the G * nqb
  // tasks of one kv head at a time (tasks are head-major: query_task), so its key tiles are
  // packed once, not once per task (a task per (b, h, query block) otherwise).
  bool whole_kv_head = false;
  // Stores row `index` of the output (Dv values o * inv, rounded once to T: a float16 / bfloat16
  // output needs no A copy and no second pass); set wherever out is (store_out_row<T, A>).
  void (*out_row)(void* out, int64_t index, const A* o, A inv, int64_t Dv) = nullptr;
};

template <class V, bool kStats>
FASTATTN_INLINE void fwd_worker(const FwdArgs<typename V::value_type>& p, std::atomic<int64_t>& next) {
  using A = typename V::value_type;
  constexpr int64_t W = V::size, R = cpu::kGemmRowPad;
  const Shape& sh = p.sh;
  const int64_t D = sh.D, Dv = sh.Dv, Dvp = p.Dvp, BQ = p.BQ, BK = p.BK, ldk = p.ldk;
  const int64_t Dvw = round_up(Dv, W);  // the columns of O computed (Dvp: the row stride)
  const A neg_inf = -std::numeric_limits<A>::infinity();
  std::vector<A> sbuf((BQ + R) * BK), obuf(kStats ? 0 : (BQ + R) * std::max(Dvp, W));
  std::vector<A> m(BQ), l(BQ), z(p.drop.on ? BK : 0);
  const bool local = p.pack_tile != nullptr;
  std::vector<A> ktile(local ? D * ldk : 0), vtile(local ? (BK + R) * Dvp : 0, A(0));
  std::vector<A> kbuf(local ? kColumnGroup * D : 0);
  int64_t held = -1;  // the tile ktile / vtile hold (bg * nkb + kb)
  bool held_bad = false;
  const int64_t ntasks = sh.B * sh.H * p.nqb, chunk = p.whole_kv_head ? sh.G * p.nqb : 1;
  for (int64_t t0; (t0 = next.fetch_add(chunk, std::memory_order_relaxed)) < ntasks;)
  for (int64_t t = t0; t < std::min(t0 + chunk, ntasks); ++t) {
    const auto [qb, bh, b, h, bg, i0, nq, stream] = query_task(t, sh, p.qb_order, BQ, p.drop);
    const A* qblk = p.qp + (bh * sh.Lq + i0) * p.qld;
    std::fill(m.begin(), m.begin() + nq, neg_inf);
    std::fill(l.begin(), l.begin() + nq, A(0));
    if constexpr (!kStats) std::fill(obuf.begin(), obuf.end(), A(0));

    const TileSpan ks = key_tile_span(p.band, i0, nq, sh.Lk, BK);
    for (int64_t kb = ks.first; kb <= ks.last; ++kb) {
      if (flagged(p.dead, bh * p.nkb + kb)) continue;  // a key-padding mask removes the whole tile
      const KeyTile tile = trim_to_band(key_tile(p.band, i0, nq, kb, BK, sh.Lk, W), p.band, i0, nq, W);
      const auto [j0, nk, nkp, full] = tile;
      const int64_t id = bg * p.nkb + kb;
      if (local && held != id) {
        p.pack_tile(p.pack_ctx, bg, kb, ktile.data(), vtile.data(), kbuf.data());
        held = id;
        held_bad = any_nonfinite(vtile.data(), std::min(BK, sh.Lk - kb * BK) * Dvp);
      }
      const A* kt = local ? ktile.data() : p.kt + id * D * ldk;  // (the tile's key kb * BK first)
      const A* vrows = local ? vtile.data() : p.vp + (bg * sh.Lk + kb * BK) * Dvp;
      A* s = sbuf.data();
      cpu::gemm<V>(nq, nkp, D, qblk, p.qld, kt + (j0 - kb * BK), ldk, s, BK, false);
      for (int64_t r = 0; r < nq; ++r) {
        A* sr = s + r * BK;
        const int64_t i = i0 + r;
        const A mx = mask_band_max_row<V>(sr, p.mask, p.band, b, h, i, tile);
        A alpha;
        if (!online_softmax_row<V>(sr, nk, nkp, mx, m[r], l[r], alpha)) {
          if constexpr (!kStats) std::fill(sr, sr + nk, -A(0));  // nothing visible yet: P = -0.0
          continue;
        }
        if constexpr (!kStats) {
          if (alpha != A(1)) scale_row<V>(obuf.data() + r * Dvp, Dvw, alpha);
          if (p.drop.on) {
            dropout_row<A>(z.data(), nk, dropout_row_base(i, sh.Lk) + static_cast<uint32_t>(j0), 1,
                           stream, p.drop.threshold, static_cast<A>(p.drop.inv_keep));
            for (int64_t c = 0; c < nk; ++c) sr[c] *= z[c];
          }
        }
      }
      if constexpr (!kStats) {
        gemm_acc<V>(local ? held_bad : flagged(p.v_bad, id), nq, Dvw, nk, s, BK,
                    vrows + (j0 - kb * BK) * Dvp, Dvp, obuf.data(), Dvp);
      }
    }

    for (int64_t r = 0; r < nq; ++r) {
      const int64_t i = i0 + r;
      const bool dead = l[r] == A(0);  // nothing attended (a NaN l is a NaN row, not dead)
      const A lse = dead ? neg_inf : m[r] + std::log(l[r]);
      if constexpr (kStats) {
        p.lse_acc[bh * p.lse_ld + i] = dead ? -neg_inf : lse;
      } else {
        const A inv = dead ? A(0) : A(1) / l[r];
        const A* o = obuf.data() + r * Dvp;
        p.out_row(p.out, bh * sh.Lq + i, o, inv, Dv);
        p.lse[bh * sh.Lq + i] = static_cast<float>(lse);
      }
    }
  }
}

// The worker for the ISA trampoline (cpu::isa_dispatch): compiled for AVX-512, AVX2 and the
// baseline.
template <class A, bool kStats>
struct FwdKernel {
  template <int kBytes>
  FASTATTN_INLINE static void run(const FwdArgs<A>& p, std::atomic<int64_t>& next) {
    fwd_worker<Vec<A, kBytes / sizeof(A)>, kStats>(p, next);
  }
};
template <class A, bool kStats>
void fwd_dispatch(const FwdArgs<A>& p, std::atomic<int64_t>& next) {
  cpu::isa_dispatch<FwdKernel<A, kStats>>(p, next);
}

// ---------------------------------------------------------------------------------------------
// Backward.

template <class A>
struct BwdArgs {
  Shape sh;
  Band band;
  Dropout drop;
  cpu::MaskView mask;
  A scale;
  int64_t Dp, Dvp, TQ, TK, nqb, nkb, Lq_pad;
  const A *qp, *qt, *kp, *kt, *vp, *vt, *dop, *dot;
  const A* lse;    // (B * H, Lq_pad): +inf for rows with nothing to attend and padding
  const A* delta;  // (B * H, Lq_pad): rowsum(dO * O), 0 for padding
  const int64_t* kb_order;
  const int64_t* qb_order;
  // nonfinite_tiles of qp, dop (tile TQ) and kp (tile TK), or null: their GEMMs take gemm_acc's
  // careful path so that masked-out entries never pass a NaN on.
  const uint8_t *q_bad, *do_bad, *k_bad;
  // masked_key_tiles with tile TK (per b * H + h and key tile), or null: the tiles a key-padding
  // mask removes whole, which every worker skips (exact: their P and dS are 0, their dK and dV
  // rows stay 0, and dmask there starts as 0).
  const uint8_t* dead;
  A *dq, *dk, *dv;  // contiguous, shaped like q, k, v
  A* dmask;         // (B, H, Lq, Lk) or null
};

template <class V>
FASTATTN_INLINE void dkdv_worker(const BwdArgs<typename V::value_type>& p, std::atomic<int64_t>& next) {
  using A = typename V::value_type;
  constexpr int64_t W = V::size, R = cpu::kGemmRowPad;
  const Shape& sh = p.sh;
  const int64_t D = sh.D, Dv = sh.Dv, Dp = p.Dp, Dvp = p.Dvp, TQ = p.TQ, TK = p.TK;
  const int64_t Dw = round_up(D, W), Dvw = round_up(Dv, W);  // columns computed (Dp, Dvp: strides)
  const bool drop = p.drop.on;
  std::vector<A> st((TK + R) * TQ), dpt((TK + R) * TQ), pz(drop ? (TK + R) * TQ : 0);
  std::vector<A> z(drop ? TK * TQ : 0);
  std::vector<A> dk_acc((TK + R) * std::max(Dp, W)), dv_acc((TK + R) * std::max(Dvp, W));
  const int64_t BG = sh.B * sh.Hkv, ntasks = BG * p.nkb;
  for (int64_t t; (t = next.fetch_add(1, std::memory_order_relaxed)) < ntasks;) {
    // (kv head-major, as query_task: the threads share one head's q / dO tiles)
    const int64_t kb = p.kb_order[t % p.nkb], bg = t / p.nkb, b = bg / sh.Hkv, g = bg % sh.Hkv;
    const int64_t j0 = kb * TK, nk = std::min(TK, sh.Lk - j0);
    std::fill(dk_acc.begin(), dk_acc.end(), A(0));
    std::fill(dv_acc.begin(), dv_acc.end(), A(0));
    const A* kblk = p.kp + (bg * sh.Lk + j0) * Dp;
    const A* vblk = p.vp + (bg * sh.Lk + j0) * Dvp;
    const TileSpan qs = query_tile_span(p.band, j0, nk, sh.Lq, TQ);
    for (int64_t h = g * sh.G; qs.first <= qs.last && h < (g + 1) * sh.G; ++h) {
      const int64_t bh = b * sh.H + h;
      if (flagged(p.dead, bh * p.nkb + kb)) continue;
      const uint32_t stream = drop ? dropout_stream(p.drop.seed, b, h, sh.H) : 0;
      for (int64_t qb = qs.first; qb <= qs.last; ++qb) {
        const int64_t i0 = qb * TQ, nq = std::min(TQ, sh.Lq - i0), nqp = round_up(nq, W);
        const bool full = inside_band(p.band, i0, nq, j0, nk);
        const A* lse = p.lse + bh * p.Lq_pad + i0;
        const A* delta = p.delta + bh * p.Lq_pad + i0;
        // S^T = K Q^T, P^T = exp(S^T - lse)
        cpu::gemm<V>(nk, nqp, D, kblk, Dp, p.qt + (bh * p.nqb + qb) * D * TQ, TQ, st.data(), TQ,
                     false);
        if (p.mask.defined()) {
          cpu::apply_mask_tile_t(st.data(), TQ, nk, nq, p.mask, p.mask.offset(b, h, i0, j0),
                                 p.mask.stride[2], p.mask.stride[3]);
        }
        for (int64_t r = 0; r < nk; ++r) {
          A* sr = st.data() + r * TQ;
          const int64_t j = j0 + r;
          if (!full || nq < nqp) {
            band_row(sr, nq, nqp, full ? 0 : j - p.band.hi - i0, full ? nq : j - p.band.lo - i0 + 1);
          }
          exp_row_cols<V>(sr, nqp, lse);
          if (drop) {
            A* zr = z.data() + r * TQ;
            dropout_row<A>(zr, nq, dropout_row_base(i0, sh.Lk) + static_cast<uint32_t>(j),
                           static_cast<uint32_t>(sh.Lk), stream, p.drop.threshold,
                           static_cast<A>(p.drop.inv_keep));
            std::fill(zr + nq, zr + nqp, A(0));
            mul_row_to<V>(pz.data() + r * TQ, sr, nqp, zr);
          }
        }
        // dV += (P Z)^T dO
        gemm_acc<V>(flagged(p.do_bad, bh * p.nqb + qb), nk, Dvw, nq, drop ? pz.data() : st.data(),
                    TQ, p.dop + (bh * sh.Lq + i0) * Dvp, Dvp, dv_acc.data(), Dvp);
        // dP^T = V dO^T, dS^T = P^T (Z dP^T - delta)
        cpu::gemm<V>(nk, nqp, Dv, vblk, Dvp, p.dot + (bh * p.nqb + qb) * Dv * TQ, TQ, dpt.data(),
                     TQ, false);
        for (int64_t r = 0; r < nk; ++r) {
          ds_row_cols<V>(dpt.data() + r * TQ, st.data() + r * TQ, drop ? z.data() + r * TQ : nullptr,
                         nqp, delta);
        }
        // dK += dS^T Q
        gemm_acc<V>(flagged(p.q_bad, bh * p.nqb + qb), nk, Dw, nq, dpt.data(), TQ,
                    p.qp + (bh * sh.Lq + i0) * Dp, Dp, dk_acc.data(), Dp);
      }
    }
    for (int64_t r = 0; r < nk; ++r) {
      A* dk = p.dk + (bg * sh.Lk + j0 + r) * D;
      A* dv = p.dv + (bg * sh.Lk + j0 + r) * Dv;
      for (int64_t d = 0; d < D; ++d) dk[d] = dk_acc[r * Dp + d];  // Q was packed scaled
      for (int64_t d = 0; d < Dv; ++d) dv[d] = dv_acc[r * Dvp + d];
    }
  }
}

// The mask rows of one query block's walk over its key tiles (ks), staged kMaskStageTiles tiles
// at a time by cpu::stage_rows: `at(kb)` before each tile kb of the walk gives the view to read.
// (The walk reads each mask row in TK-key pieces; the staged copy reads it in long runs.)
constexpr int64_t kMaskStageTiles = 8;
struct StagedMask {
  std::vector<unsigned char> buf;
  cpu::MaskView view;
  const cpu::MaskView& at(const cpu::MaskView& mask, int64_t b, int64_t h, int64_t i0, int64_t nq,
                          const TileSpan& ks, int64_t kb, int64_t TK, int64_t Lk) {
    if ((kb - ks.first) % kMaskStageTiles == 0) {
      const int64_t j0 = kb * TK;
      const int64_t j1 = std::min({(ks.last + 1) * TK, j0 + kMaskStageTiles * TK, Lk});
      view = cpu::stage_rows(mask, b, h, i0, nq, j0, j1 - j0, buf);
    }
    return view;
  }
};

// S = (scale Q) K^T and P = exp(S - lse) on the tile of query rows [i0, i0 + nq) of (b, h) by
// key tile kb of kv head bg (s: rows of p.TK values), the mask and the band applied in between;
// with dropout, each row's keep-mask Z in z (0 on the padding) and, when kPZ, P Z in pz.
template <class V, bool kPZ>
FASTATTN_INLINE void probs_tile(const BwdArgs<typename V::value_type>& p, const cpu::MaskView& mask,
                                int64_t b, int64_t h, int64_t bg, int64_t kb, uint32_t stream,
                                int64_t i0, int64_t nq,
                                const KeyTile& tile, const typename V::value_type* qblk,
                                const typename V::value_type* lse, typename V::value_type* s,
                                typename V::value_type* z, typename V::value_type* pz) {
  using A = typename V::value_type;
  const int64_t D = p.sh.D, TK = p.TK;
  cpu::gemm<V>(nq, tile.nkp, D, qblk, p.Dp, p.kt + (bg * p.nkb + kb) * D * TK, TK, s, TK, false);
  for (int64_t r = 0; r < nq; ++r) {
    A* sr = s + r * TK;
    const int64_t i = i0 + r;
    mask_band_row(sr, mask, p.band, b, h, i, tile);
    exp_row<V>(sr, tile.nkp, lse[r]);
    if (p.drop.on) {
      A* zr = z + r * TK;
      dropout_row<A>(zr, tile.nk, dropout_row_base(i, p.sh.Lk) + static_cast<uint32_t>(tile.j0), 1,
                     stream, p.drop.threshold, static_cast<A>(p.drop.inv_keep));
      std::fill(zr + tile.nk, zr + tile.nkp, A(0));
      if constexpr (kPZ) mul_row_to<V>(pz + r * TK, sr, tile.nkp, zr);
    }
  }
}

// dP = dO V^T, then dS = P (Z dP - delta) in place in dp on the same tile (P in s, Z in z);
// dmask = dS (-0 -> 0) when asked.
template <class V>
FASTATTN_INLINE void dscores_tile(const BwdArgs<typename V::value_type>& p, int64_t bh, int64_t bg,
                                  int64_t kb, int64_t i0, int64_t nq, const KeyTile& tile,
                                  const typename V::value_type* doblk,
                                  const typename V::value_type* delta,
                                  const typename V::value_type* s, const typename V::value_type* z,
                                  typename V::value_type* dp) {
  using A = typename V::value_type;
  const int64_t Dv = p.sh.Dv, TK = p.TK;
  cpu::gemm<V>(nq, tile.nkp, Dv, doblk, p.Dvp, p.vt + (bg * p.nkb + kb) * Dv * TK, TK, dp, TK,
               false);
  for (int64_t r = 0; r < nq; ++r) {
    ds_row<V>(dp + r * TK, s + r * TK, p.drop.on ? z + r * TK : nullptr, tile.nkp, delta[r]);
    if (p.dmask != nullptr) {
      A* dst = p.dmask + (bh * p.sh.Lq + i0 + r) * p.sh.Lk + tile.j0;
      const A* src = dp + r * TK;
      for (int64_t c = 0; c < tile.nk; ++c) dst[c] = src[c] + A(0);  // -0 -> 0
    }
  }
}

// dQ = scale * (dS K) for query rows [i0, i0 + nq) of head bh, from their accumulator (rows of p.Dp).
template <class A>
FASTATTN_INLINE void store_dq(const BwdArgs<A>& p, int64_t bh, int64_t i0, int64_t nq, const A* dq_acc) {
  for (int64_t r = 0; r < nq; ++r) {
    A* dst = p.dq + (bh * p.sh.Lq + i0 + r) * p.sh.D;
    for (int64_t d = 0; d < p.sh.D; ++d) dst[d] = dq_acc[r * p.Dp + d] * p.scale;
  }
}

template <class V>
FASTATTN_INLINE void dq_worker(const BwdArgs<typename V::value_type>& p, std::atomic<int64_t>& next) {
  using A = typename V::value_type;
  constexpr int64_t W = V::size, R = cpu::kGemmRowPad;
  const Shape& sh = p.sh;
  const int64_t Dp = p.Dp, Dvp = p.Dvp, TQ = p.TQ, TK = p.TK;
  const int64_t Dw = round_up(sh.D, W);  // the columns of dQ computed (Dp: the row stride)
  const bool drop = p.drop.on;
  std::vector<A> s((TQ + R) * TK), dp((TQ + R) * TK), z(drop ? TQ * TK : 0);
  std::vector<A> dq_acc((TQ + R) * std::max(Dp, W));
  StagedMask staged;
  const int64_t ntasks = sh.B * sh.H * p.nqb;
  for (int64_t t; (t = next.fetch_add(1, std::memory_order_relaxed)) < ntasks;) {
    const auto [qb, bh, b, h, bg, i0, nq, stream] = query_task(t, sh, p.qb_order, TQ, p.drop);
    std::fill(dq_acc.begin(), dq_acc.end(), A(0));
    const A* qblk = p.qp + (bh * sh.Lq + i0) * Dp;
    const A* doblk = p.dop + (bh * sh.Lq + i0) * Dvp;
    const A* lse = p.lse + bh * p.Lq_pad + i0;
    const A* delta = p.delta + bh * p.Lq_pad + i0;
    const TileSpan ks = key_tile_span(p.band, i0, nq, sh.Lk, TK);
    for (int64_t kb = ks.first; kb <= ks.last; ++kb) {
      const cpu::MaskView& mask = staged.at(p.mask, b, h, i0, nq, ks, kb, TK, sh.Lk);
      if (flagged(p.dead, bh * p.nkb + kb)) continue;  // (after staged.at: it stages every 8th)
      const KeyTile tile = key_tile(p.band, i0, nq, kb, TK, sh.Lk, W);
      probs_tile<V, false>(p, mask, b, h, bg, kb, stream, i0, nq, tile, qblk, lse, s.data(),
                           z.data(), nullptr);
      dscores_tile<V>(p, bh, bg, kb, i0, nq, tile, doblk, delta, s.data(), z.data(), dp.data());
      // dQ += dS K
      gemm_acc<V>(flagged(p.k_bad, bg * p.nkb + kb), nq, Dw, tile.nk, dp.data(), TK,
                  p.kp + (bg * sh.Lk + tile.j0) * Dp, Dp, dq_acc.data(), Dp);
    }
    store_dq(p, bh, i0, nq, dq_acc.data());
  }
}

// One pass (used when the (b, kv head) pairs alone keep the threads busy): one task per
// (b, kv head) owns dK / dV of the whole head in its buffers and loops over the group's query
// heads, their query tiles and the key tiles inside the band: S, P, dV += (P Z)^T dO, dP, dS,
// dQ += dS K (the query tile's own buffer) and dK += dS^T (scale Q). Five GEMMs per tile pair
// instead of the two passes' seven; still no atomics.
template <class V>
FASTATTN_INLINE void fused_bwd_worker(const BwdArgs<typename V::value_type>& p,
                                      std::atomic<int64_t>& next) {
  using A = typename V::value_type;
  constexpr int64_t W = V::size, R = cpu::kGemmRowPad;
  const Shape& sh = p.sh;
  const int64_t D = sh.D, Dv = sh.Dv, Dp = p.Dp, Dvp = p.Dvp, TQ = p.TQ, TK = p.TK;
  const int64_t Dw = round_up(D, W), Dvw = round_up(Dv, W);  // columns computed (Dp, Dvp: strides)
  const bool drop = p.drop.on;
  std::vector<A> s((TQ + R) * TK), dp((TQ + R) * TK), pz(drop ? (TQ + R) * TK : 0);
  std::vector<A> z(drop ? TQ * TK : 0), dq_acc(TQ * std::max(Dp, W));
  std::vector<A> dk_acc(sh.Lk * std::max(Dp, W)), dv_acc(sh.Lk * std::max(Dvp, W));
  StagedMask staged;
  const int64_t BG = sh.B * sh.Hkv;
  for (int64_t bg; (bg = next.fetch_add(1, std::memory_order_relaxed)) < BG;) {
    const int64_t b = bg / sh.Hkv, g = bg % sh.Hkv;
    std::fill(dk_acc.begin(), dk_acc.end(), A(0));
    std::fill(dv_acc.begin(), dv_acc.end(), A(0));
    for (int64_t h = g * sh.G; h < (g + 1) * sh.G; ++h) {
      const int64_t bh = b * sh.H + h;
      const uint32_t stream = drop ? dropout_stream(p.drop.seed, b, h, sh.H) : 0;
      for (int64_t qb = 0; qb < p.nqb; ++qb) {
        const int64_t i0 = qb * TQ, nq = std::min(TQ, sh.Lq - i0);
        const A* qblk = p.qp + (bh * sh.Lq + i0) * Dp;
        const A* doblk = p.dop + (bh * sh.Lq + i0) * Dvp;
        const A* lse = p.lse + bh * p.Lq_pad + i0;
        const A* delta = p.delta + bh * p.Lq_pad + i0;
        std::fill(dq_acc.begin(), dq_acc.end(), A(0));
        const TileSpan ks = key_tile_span(p.band, i0, nq, sh.Lk, TK);
        for (int64_t kb = ks.first; kb <= ks.last; ++kb) {
          const cpu::MaskView& mask = staged.at(p.mask, b, h, i0, nq, ks, kb, TK, sh.Lk);
          if (flagged(p.dead, bh * p.nkb + kb)) continue;
          const KeyTile tile = key_tile(p.band, i0, nq, kb, TK, sh.Lk, W);
          const int64_t j0 = tile.j0, nk = tile.nk;
          probs_tile<V, true>(p, mask, b, h, bg, kb, stream, i0, nq, tile, qblk, lse, s.data(),
                              z.data(), pz.data());
          // dV += (P Z)^T dO
          gemm_acc<V, true>(flagged(p.do_bad, bh * p.nqb + qb), nk, Dvw, nq,
                            drop ? pz.data() : s.data(), TK, doblk, Dvp, dv_acc.data() + j0 * Dvp, Dvp);
          dscores_tile<V>(p, bh, bg, kb, i0, nq, tile, doblk, delta, s.data(), z.data(), dp.data());
          // dQ += dS K, dK += dS^T (scale Q)
          gemm_acc<V>(flagged(p.k_bad, bg * p.nkb + kb), nq, Dw, nk, dp.data(), TK,
                      p.kp + (bg * sh.Lk + j0) * Dp, Dp, dq_acc.data(), Dp);
          gemm_acc<V, true>(flagged(p.q_bad, bh * p.nqb + qb), nk, Dw, nq, dp.data(), TK, qblk, Dp,
                            dk_acc.data() + j0 * Dp, Dp);
        }
        store_dq(p, bh, i0, nq, dq_acc.data());
      }
    }
    for (int64_t j = 0; j < sh.Lk; ++j) {
      std::copy(dk_acc.data() + j * Dp, dk_acc.data() + j * Dp + D, p.dk + (bg * sh.Lk + j) * D);
      std::copy(dv_acc.data() + j * Dvp, dv_acc.data() + j * Dvp + Dv, p.dv + (bg * sh.Lk + j) * Dv);
    }
  }
}

// The backward workers for the ISA trampoline (cpu::isa_dispatch).
#define FASTATTN_BWD_KERNEL(Kernel, worker)                                        \
  template <class A>                                                             \
  struct Kernel {                                                                \
    template <int kBytes>                                                        \
    FASTATTN_INLINE static void run(const BwdArgs<A>& p, std::atomic<int64_t>& next) { \
      worker<Vec<A, kBytes / sizeof(A)>>(p, next);                              \
    }                                                                            \
  };
FASTATTN_BWD_KERNEL(FusedBwdKernel, fused_bwd_worker)
FASTATTN_BWD_KERNEL(DkdvKernel, dkdv_worker)
FASTATTN_BWD_KERNEL(DqKernel, dq_worker)
#undef FASTATTN_BWD_KERNEL

template <class A>
void fused_bwd_dispatch(const BwdArgs<A>& p, std::atomic<int64_t>& next) {
  cpu::isa_dispatch<FusedBwdKernel<A>>(p, next);
}
template <class A>
void dkdv_dispatch(const BwdArgs<A>& p, std::atomic<int64_t>& next) {
  cpu::isa_dispatch<DkdvKernel<A>>(p, next);
}
template <class A>
void dq_dispatch(const BwdArgs<A>& p, std::atomic<int64_t>& next) {
  cpu::isa_dispatch<DqKernel<A>>(p, next);
}

// ---------------------------------------------------------------------------------------------
// torch's own CPU flash attention forward (aten::_scaled_dot_product_flash_attention_for_cpu), for
// the one case where it is the faster kernel on some CPUs and computes exactly this op's contract:
// the forward of non-causal attention (the band is everything) with no mask, no dropout,
// H == Hkv, D == Dv, float32 or bfloat16. No key is masked out there, so the NaN rule is plain
// IEEE arithmetic, which torch's kernel follows but for a query row with a NaN or an infinity on
// AVX-512 (torch_forward_kept). Same lse convention (natural log, float32, (B, H, Lq)), so our
// backward takes its output.
// Where: on Intel CPUs, whose MKL GEMMs inside torch's kernel outrun our tile GEMMs (Xeon,
// AVX-512 and AVX2: ours took 1.23-1.33x its time at 4x4x256x64 float32 on one thread; the
// bench's plain forwards read 0.78-0.95x torch); not on AMD CPUs: on Zen 2 and Zen 4 ours is
// 7-15% faster, and on Zen 3 (EPYC, AVX2), where torch's kernel was taken in sessions 27-28,
// ours with 256-row blocks and head-major tasks reads 1.01-1.22x this path at L 256-4096, D 64
// and 128, float32 and bfloat16, and 0.99-1.00 at L 1024 D 128, where both run at the two cores'
// FMA peak (bench/results/cpu-notes.md, sessions 17, 19, 27, 29 and 30).
// FASTATTN_CPU_TORCH_ATTENTION=0 / 1 turns it off / on whatever the CPU (read on every call); the
// first call that takes it is logged (INFO).

bool torch_forward_applies(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                           bool plain, const Band& band) {
  const auto st = q.scalar_type();
  if (!cpu::torch_plain_forward() || !plain || q.size(1) != k.size(1) || q.size(3) != v.size(3) ||
      !(st == at::kFloat || st == at::kBFloat16)) {
    return false;
  }
  return inside_band(band, 0, q.size(2), 0, k.size(2));  // every query sees every key
}

// Whether torch's forward output may be kept. A NaN in a query row: torch 2.13's AVX-512 kernel
// outputs 0 for that row with lse 0, where IEEE arithmetic, the NaN rule and its own AVX2 kernel
// give NaN (tests/test_nan.py, full-band); so does a row with an infinity. Such a row leaves an
// lse of 0 or a non-finite one, so q itself (D times the lse's size) is checked only when some
// lse is: then a q with a NaN or an infinity takes our kernel. (lse: float32, contiguous.)
bool torch_forward_kept(const at::Tensor& q, const at::Tensor& lse) {
  const float* l = lse.const_data_ptr<float>();
  bool suspect = false;
  for (int64_t i = 0; i < lse.numel(); ++i) suspect |= !std::isfinite(l[i]) || l[i] == 0.0f;
  return !suspect || at::_ops::isfinite::call(q).all().item<bool>();
}

void log_torch_kernel() {
  static std::once_flag once;
  std::call_once(once, [] {
    LOG(INFO) << "fastattn cpu attention: the forward of non-causal attention without mask or "
              << "dropout runs on torch's own CPU flash attention kernel, the faster one on this CPU "
              << "(FASTATTN_CPU_TORCH_ATTENTION=0 turns this off)";
  });
}

// ---------------------------------------------------------------------------------------------
// Ops.

// Forwards of at most this many query rows per kv head (Lq * G), with no mask and no dropout,
// run as decoding (cpu::dense_decode_fwd). Measured against this file's forward (2 threads,
// f32, Lk 16-4096): the decode worker takes 0.44x its time at 1 row, 0.8x at 8, 0.9-1.03x at 16,
// 1.0-1.3x at 32 and 1.05-1.6x at 64.
constexpr int64_t kDecodeRows = 16;

// The source of FwdArgs::pack_tile: k and v as the op received them.
template <class T, class A>
struct KvTiles {
  const T* k;
  Strided4 ks;
  const T* v;
  Strided4 vs;
  Shape sh;
  int64_t tile, ldk, Dvp;
  static void pack(const void* self, int64_t bg, int64_t kb, A* kt, A* vp, A* buf) {
    const auto& t = *static_cast<const KvTiles*>(self);
    pack_kv_tile<T, A>(t.k, t.ks, t.v, t.vs, t.sh, t.tile, t.ldk, bg, kb, kt, vp, t.Dvp, buf);
  }
};

// One output row of the forward in T: o * inv rounded once (as A's copy into T rounded it).
template <class T, class A>
void store_out_row(void* out, int64_t index, const A* o, A inv, int64_t Dv) {
  T* dst = static_cast<T*>(out) + index * Dv;
  for (int64_t d = 0; d < Dv; ++d) dst[d] = static_cast<T>(o[d] * inv);
}

// Query rows per forward task. Each task reads all of its key tiles once, so a taller block
// reads k and v fewer times and keeps each tile's GEMM panels in L1 for more rows: where every
// query sees every key, 256 rows, not 64 (AVX2 Zen 3, 2 threads, B1 H8 L2048, float32, x torch's
// kernel: D 64 0.90 -> 1.00-1.10, D 128 0.89 -> 1.01-1.02; one thread, D 128: 0.89 -> 0.99).
// With a causal or windowed band a tall block does not pay: the tiles on its edge are computed
// whole and half thrown away (causal L2048: 1.08-1.22 at 64 rows, 1.09-1.12 at 256). Halved
// while that would leave fewer than four tasks a thread.
inline int64_t fwd_block_q(const Shape& sh, const Band& band) {
  if (!inside_band(band, 0, sh.Lq, 0, sh.Lk)) return kFwdBlockQ;  // (a band limits the keys)
  const int64_t enough = 4 * std::max<int64_t>(1, at::get_num_threads());
  int64_t bq = 4 * kFwdBlockQ;
  while (bq > kFwdBlockQ && sh.B * sh.H * ceil_div(sh.Lq, bq) < enough) bq /= 2;
  return bq;
}

template <class T>
void attention_fwd_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const cpu::MaskView& mask, double scale, const Band& band,
                        const Dropout& drop, at::Tensor& out, at::Tensor& lse) {
  using A = acc_t<T>;
  const auto acc_opts = q.options().dtype(c10::CppTypeToScalarType<A>::value);
  const Shape sh{q.size(0), q.size(1), k.size(1), q.size(1) / k.size(1), q.size(2), k.size(2),
                 q.size(3), v.size(3)};
  // (key tiles no wider than the keys: a 128-key head in one 128-key tile, not half a 256 one)
  const int64_t BQ = fwd_block_q(sh, band);
  const int64_t BK = std::min(kFwdBlockK, round_up(sh.Lk, kColumnGroup));
  const int64_t nqb = ceil_div(sh.Lq, BQ), nkb = ceil_div(sh.Lk, BK);
  const int64_t ldk = cpu::gemm_ld<A>(BK), Dvp = cpu::gemm_ld<A>(sh.Dv);
  // A key tile serves the nqb * G tasks of its kv head. Where that is at most two, each task packs
  // the tiles it uses into its own buffers, in cache: packing all of k and v first writes them
  // out and reads them back once more, which few queries never earn back (a third of the
  // forward's time at 64 queries against 1024 keys).
  const bool local = nqb * sh.G <= 2;
  at::Tensor qp = empty_tensor({packed_rows_size(sh.B * sh.H * sh.Lq, sh.D)}, acc_opts);
  at::Tensor kt, vp;
  const KvTiles<T, A> tiles{k.const_data_ptr<T>(), strides_of(k), v.const_data_ptr<T>(),
                            strides_of(v), sh, BK, ldk, Dvp};
  if (local) {
    pack_rows<T, A>(q.const_data_ptr<T>(), strides_of(q), sh.B, sh.H, sh.Lq, sh.D, sh.D,
                    qp.data_ptr<A>(), static_cast<A>(scale));
  } else {
    kt = empty_tensor({sh.B * sh.Hkv * nkb * sh.D * ldk}, acc_opts);
    vp = empty_tensor({packed_rows_size(sh.B * sh.Hkv * sh.Lk, Dvp)}, acc_opts);
    pack_qkv<T, A>(q.const_data_ptr<T>(), strides_of(q), k.const_data_ptr<T>(), strides_of(k),
                   v.const_data_ptr<T>(), strides_of(v), sh, BK, ldk, static_cast<A>(scale),
                   qp.data_ptr<A>(), kt.data_ptr<A>(), vp.data_ptr<A>(), Dvp);
  }
  const std::vector<int64_t> order = query_order(band, sh.Lq, sh.Lk, BQ, BK);
  const std::vector<uint8_t> v_bad =
      local ? std::vector<uint8_t>{} : nonfinite_tiles(vp.const_data_ptr<A>(), sh.B * sh.Hkv, sh.Lk, Dvp, BK);
  const std::vector<uint8_t> dead = masked_key_tiles(mask, sh.B, sh.H, sh.Lk, BK);
  FwdArgs<A> p{sh, band, drop, mask, static_cast<A>(scale), qp.const_data_ptr<A>(), sh.D,
               local ? nullptr : kt.const_data_ptr<A>(), local ? nullptr : vp.const_data_ptr<A>(),
               Dvp, BQ, BK, ldk, nqb, nkb, order.data(), v_bad.empty() ? nullptr : v_bad.data(),
               dead.empty() ? nullptr : dead.data(), out.data_ptr<T>(), lse.data_ptr<float>(),
               nullptr, 0};
  p.out_row = &store_out_row<T, A>;
  if (local) {
    p.pack_tile = &KvTiles<T, A>::pack;
    p.pack_ctx = &tiles;
    p.whole_kv_head = nqb * sh.G > 1 && sh.B * sh.Hkv >= 4 * at::get_num_threads();
  }
  run_workers(sh.B * sh.H * nqb, [&](std::atomic<int64_t>& next) { fwd_dispatch<A, false>(p, next); });
}

std::tuple<at::Tensor, at::Tensor> attention_fwd_cpu(const at::Tensor& q_in, const at::Tensor& k_in,
                                                     const at::Tensor& v_in,
                                                     const std::optional<at::Tensor>& mask,
                                                     double scale, int64_t offset, int64_t left,
                                                     int64_t right, double dropout_p, int64_t seed) {
  check_qkv(q_in, k_in, v_in);
  const at::Tensor q = unit_last(q_in), k = unit_last(k_in), v = unit_last(v_in);
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), Lk = k.size(2), Dv = v.size(3);
  const cpu::MaskView mview = cpu::make_mask_view(mask, {B, H, Lq, Lk}, q, "q");
  const Dropout drop = make_dropout(dropout_p, seed);
  const Band band = make_band(offset, left, right, Lq, Lk);
  const bool plain = !(mask.has_value() && mask->defined()) && dropout_p == 0.0;
  const bool decode = plain && (offset == 0 || offset == Lk - Lq) && Lq * (H / k.size(1)) <= kDecodeRows;
  if (B * H * Lq > 0 && Lk > 0 && !decode && torch_forward_applies(q, k, v, plain, band)) {
    auto [o, l] = at::_ops::_scaled_dot_product_flash_attention_for_cpu::call(
        q, k, v, 0.0, false, std::nullopt, scale);
    l = l.contiguous();
    if (torch_forward_kept(q, l)) {
      log_torch_kernel();
      return {o.contiguous(), l};
    }
  }
  // (allocated only when our kernels write them: torch's returns its own)
  at::Tensor out = empty_tensor({B, H, Lq, Dv}, q.options());
  at::Tensor lse = empty_tensor({B, H, Lq}, q.options().dtype(at::kFloat));
  if (B * H * Lq == 0) return {out, lse};
  if (Lk == 0) {
    out.zero_();
    lse.fill_(-std::numeric_limits<float>::infinity());
    return {out, lse};
  }
  if (decode) {
    cpu::dense_decode_fwd(q, k, v, scale, /*bottom_right=*/offset != 0, left, right, out, lse);
    return {out, lse};
  }
  FASTATTN_DISPATCH_FLOATING_HALF_BF16(q.scalar_type(), "attention_fwd_cpu", [&] {
    attention_fwd_impl<scalar_t>(q, k, v, mview, scale, band, drop, out, lse);
  });
  return {out, lse};
}

template <class T>
void attention_bwd_impl(const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k,
                        const at::Tensor& v, const at::Tensor& out, const at::Tensor& lse_in,
                        const cpu::MaskView& mask, double scale, const Band& band,
                        const Dropout& drop, at::Tensor& dq, at::Tensor& dk, at::Tensor& dv,
                        acc_t<T>* dmask) {
  using A = acc_t<T>;
  const auto acc_opts = q.options().dtype(c10::CppTypeToScalarType<A>::value);
  const Shape sh{q.size(0), q.size(1), k.size(1), q.size(1) / k.size(1), q.size(2), k.size(2),
                 q.size(3), v.size(3)};
  const int64_t TQ = kBwdBlockQ, TK = kBwdBlockK;
  const int64_t nqb = ceil_div(sh.Lq, TQ), nkb = ceil_div(sh.Lk, TK), Lq_pad = nqb * TQ;
  const int64_t Dp = cpu::gemm_ld<A>(sh.D), Dvp = cpu::gemm_ld<A>(sh.Dv);
  const int64_t BH = sh.B * sh.H, BG = sh.B * sh.Hkv;
  // One pass when the (b, kv head) tasks balance over the threads: its tasks cost about 0.6 of
  // the two passes' work per head (5 GEMMs instead of 7, one exp instead of two).
  const int64_t threads = std::max<int64_t>(1, at::get_num_threads());
  const bool two_pass =
      static_cast<double>(ceil_div(BG, threads) * threads) * 0.6 > static_cast<double>(BG);
  at::Tensor qp = empty_tensor({packed_rows_size(BH * sh.Lq, Dp)}, acc_opts);
  at::Tensor qt = empty_tensor({two_pass ? BH * nqb * sh.D * TQ : 0}, acc_opts);
  at::Tensor dop = empty_tensor({packed_rows_size(BH * sh.Lq, Dvp)}, acc_opts);
  at::Tensor dot = empty_tensor({two_pass ? BH * nqb * sh.Dv * TQ : 0}, acc_opts);
  at::Tensor kp = empty_tensor({packed_rows_size(BG * sh.Lk, Dp)}, acc_opts);
  at::Tensor kt = empty_tensor({BG * nkb * sh.D * TK}, acc_opts);
  at::Tensor vp = empty_tensor({two_pass ? packed_rows_size(BG * sh.Lk, Dvp) : 0}, acc_opts);
  at::Tensor vt = empty_tensor({BG * nkb * sh.Dv * TK}, acc_opts);
  at::Tensor lse = empty_tensor({BH * Lq_pad}, acc_opts);
  at::Tensor delta = empty_tensor({BH * Lq_pad}, acc_opts);
  // Q is packed times scale: S = (scale Q) K^T, and dK = dS^T (scale Q).
  const A sc = static_cast<A>(scale);
  pack_rows<T, A>(q.const_data_ptr<T>(), strides_of(q), sh.B, sh.H, sh.Lq, sh.D, Dp, qp.data_ptr<A>(), sc);
  pack_rows<T, A>(dout.const_data_ptr<T>(), strides_of(dout), sh.B, sh.H, sh.Lq, sh.Dv, Dvp, dop.data_ptr<A>());
  pack_rows<T, A>(k.const_data_ptr<T>(), strides_of(k), sh.B, sh.Hkv, sh.Lk, sh.D, Dp, kp.data_ptr<A>());
  pack_transposed<T, A>(k.const_data_ptr<T>(), strides_of(k), sh.B, sh.Hkv, sh.Lk, sh.D, TK, kt.data_ptr<A>());
  pack_transposed<T, A>(v.const_data_ptr<T>(), strides_of(v), sh.B, sh.Hkv, sh.Lk, sh.Dv, TK, vt.data_ptr<A>());
  if (two_pass) {
    pack_transposed<T, A>(q.const_data_ptr<T>(), strides_of(q), sh.B, sh.H, sh.Lq, sh.D, TQ, qt.data_ptr<A>(), sc);
    pack_transposed<T, A>(dout.const_data_ptr<T>(), strides_of(dout), sh.B, sh.H, sh.Lq, sh.Dv, TQ, dot.data_ptr<A>());
    pack_rows<T, A>(v.const_data_ptr<T>(), strides_of(v), sh.B, sh.Hkv, sh.Lk, sh.Dv, Dvp, vp.data_ptr<A>());
  }

  // delta = rowsum(dO * O) (O as returned by forward), and lse with +inf for empty rows / padding.
  {
    const T* o = out.const_data_ptr<T>();
    const Strided4 os = strides_of(out);
    const A* dop_ptr = dop.const_data_ptr<A>();
    const float* lse_src = lse_in.const_data_ptr<float>();
    const Strided4 ls{lse_in.stride(0), lse_in.stride(1), lse_in.stride(2)};
    A* delta_ptr = delta.data_ptr<A>();
    A* lse_ptr = lse.data_ptr<A>();
    const bool need_lse = !std::is_same_v<T, double>;
    const A inf = std::numeric_limits<A>::infinity();
    at::parallel_for(0, BH, 1, [&](int64_t r0, int64_t r1) {
      std::vector<A> row(sh.Dv);
      for (int64_t bh = r0; bh < r1; ++bh) {
        const int64_t b = bh / sh.H, h = bh % sh.H;
        for (int64_t i = 0; i < sh.Lq; ++i) {
          cpu::convert_to_acc(o + b * os.s0 + h * os.s1 + i * os.s2, row.data(), sh.Dv);
          const A* d = dop_ptr + (bh * sh.Lq + i) * Dvp;
          A acc = 0;
          for (int64_t c = 0; c < sh.Dv; ++c) acc += row[c] * d[c];
          delta_ptr[bh * Lq_pad + i] = acc;
          if (need_lse) {
            const float l = lse_src[b * ls.s0 + h * ls.s1 + i * ls.s2];
            lse_ptr[bh * Lq_pad + i] = l == -std::numeric_limits<float>::infinity() ? inf : A(l);
          }
        }
        std::fill(delta_ptr + bh * Lq_pad + sh.Lq, delta_ptr + (bh + 1) * Lq_pad, A(0));
        std::fill(lse_ptr + bh * Lq_pad + (need_lse ? sh.Lq : 0), lse_ptr + (bh + 1) * Lq_pad, inf);
      }
    });
  }
  if constexpr (std::is_same_v<T, double>) {
    // float64: recompute lse in float64 (the saved one is float32).
    const std::vector<int64_t> order = query_order(band, sh.Lq, sh.Lk, TQ, TK);
    const FwdArgs<A> p{sh, band, drop, mask, static_cast<A>(scale), qp.const_data_ptr<A>(), Dp,
                       kt.const_data_ptr<A>(), nullptr, Dvp, TQ, TK, TK, nqb, nkb, order.data(),
                       nullptr, nullptr, nullptr, nullptr, lse.data_ptr<A>(), Lq_pad};
    run_workers(BH * nqb, [&](std::atomic<int64_t>& next) { fwd_dispatch<A, true>(p, next); });
  }

  at::Tensor dq_acc = acc_output<T, A>(dq), dk_acc = acc_output<T, A>(dk), dv_acc = acc_output<T, A>(dv);
  const std::vector<int64_t> kb_order = key_order(band, sh.Lq, sh.Lk, TQ, TK);
  const std::vector<int64_t> qb_order = query_order(band, sh.Lq, sh.Lk, TQ, TK);
  const std::vector<uint8_t> q_bad = nonfinite_tiles(qp.const_data_ptr<A>(), BH, sh.Lq, Dp, TQ);
  const std::vector<uint8_t> do_bad = nonfinite_tiles(dop.const_data_ptr<A>(), BH, sh.Lq, Dvp, TQ);
  const std::vector<uint8_t> k_bad = nonfinite_tiles(kp.const_data_ptr<A>(), BG, sh.Lk, Dp, TK);
  const std::vector<uint8_t> dead = masked_key_tiles(mask, sh.B, sh.H, sh.Lk, TK);
  auto ptr = [](const std::vector<uint8_t>& f) { return f.empty() ? nullptr : f.data(); };
  const BwdArgs<A> p{sh, band, drop, mask, static_cast<A>(scale), Dp, Dvp, TQ, TK, nqb, nkb, Lq_pad,
                     qp.const_data_ptr<A>(), qt.const_data_ptr<A>(), kp.const_data_ptr<A>(),
                     kt.const_data_ptr<A>(), vp.const_data_ptr<A>(), vt.const_data_ptr<A>(),
                     dop.const_data_ptr<A>(), dot.const_data_ptr<A>(), lse.const_data_ptr<A>(),
                     delta.const_data_ptr<A>(), kb_order.data(), qb_order.data(), ptr(q_bad),
                     ptr(do_bad), ptr(k_bad), ptr(dead), dq_acc.data_ptr<A>(), dk_acc.data_ptr<A>(),
                     dv_acc.data_ptr<A>(), dmask};
  if (two_pass) {
    run_workers(BG * nkb, [&](std::atomic<int64_t>& next) { dkdv_dispatch<A>(p, next); });
    run_workers(BH * nqb, [&](std::atomic<int64_t>& next) { dq_dispatch<A>(p, next); });
  } else {
    run_workers(BG, [&](std::atomic<int64_t>& next) { fused_bwd_dispatch<A>(p, next); });
  }
  if (!dq_acc.is_same(dq)) {
    dq.copy_(dq_acc);
    dk.copy_(dk_acc);
    dv.copy_(dv_acc);
  }
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_bwd_cpu(
    const at::Tensor& dout_in, const at::Tensor& q_in, const at::Tensor& k_in,
    const at::Tensor& v_in, const at::Tensor& out_in, const at::Tensor& lse,
    const std::optional<at::Tensor>& mask, double scale, int64_t offset, int64_t left,
    int64_t right, double dropout_p, int64_t seed, bool need_dmask) {
  check_qkv(q_in, k_in, v_in);
  const int64_t B = q_in.size(0), H = q_in.size(1), Lq = q_in.size(2), Lk = k_in.size(2);
  const int64_t Dv = v_in.size(3);
  check_like(dout_in, q_in, {B, H, Lq, Dv}, q_in.scalar_type(), "dout", "q");
  check_like(out_in, q_in, {B, H, Lq, Dv}, q_in.scalar_type(), "out", "q");
  check_like(lse, q_in, {B, H, Lq}, at::kFloat, "lse", "q");
  const at::Tensor q = unit_last(q_in), k = unit_last(k_in), v = unit_last(v_in);
  const at::Tensor dout = unit_last(dout_in), out = unit_last(out_in);
  const cpu::MaskView mview = cpu::make_mask_view(mask, {B, H, Lq, Lk}, q, "q");
  const Dropout drop = make_dropout(dropout_p, seed);
  at::Tensor dq = empty_tensor(q.sizes(), q.options());
  at::Tensor dk = empty_tensor(k.sizes(), k.options());
  at::Tensor dv = empty_tensor(v.sizes(), v.options());
  const auto dmask_dtype = acc_dtype(q.scalar_type());
  const auto dmask_opts = q.options().dtype(dmask_dtype);
  at::Tensor dmask = need_dmask ? empty_tensor({B, H, Lq, Lk}, dmask_opts).zero_()
                                : empty_tensor({0}, dmask_opts);
  if (B * H * Lq == 0 || Lk == 0) {
    dq.zero_();
    dk.zero_();
    dv.zero_();
    return {dq, dk, dv, dmask};
  }
  const Band band = make_band(offset, left, right, Lq, Lk);
  FASTATTN_DISPATCH_FLOATING_HALF_BF16(q.scalar_type(), "attention_bwd_cpu", [&] {
    attention_bwd_impl<scalar_t>(dout, q, k, v, out, lse, mview, scale, band, drop, dq, dk, dv,
                                 need_dmask ? dmask.data_ptr<acc_t<scalar_t>>() : nullptr);
  });
  return {dq, dk, dv, dmask};
}

}  // namespace

// (torch_forward_applies's CPU part; the comment above it says where and why.)
bool cpu::torch_plain_forward() {
  const char* env = std::getenv("FASTATTN_CPU_TORCH_ATTENTION");
  if (env != nullptr && env[0] != '\0') return std::strcmp(env, "0") != 0;
  return cpu::intel_cpu();
}

TORCH_LIBRARY_IMPL(fastattn, CPU, m) {
  m.impl("attention_fwd", &attention_fwd_cpu);
  m.impl("attention_bwd", &attention_bwd_cpu);
}

}  // namespace fastattn
