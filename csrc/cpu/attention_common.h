// Helpers shared by the CPU attention kernels (csrc/cpu/attention.cpp: forward and backward;
// csrc/cpu/attention_jvp.cpp: forward-mode AD): tile sizes, the band and the tiles inside it,
// dropout, task scheduling, packing into the accumulation type, SIMD row helpers (the mask / band
// and the online-softmax step of a score row included) and argument checks. Internal to csrc/cpu
// (not installed with csrc/include): everything lives in an unnamed namespace, so each kernel
// file gets its own copy compiled for its workers' ISA targets.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <limits>
#include <numeric>
#include <vector>

#include "fastattn/common.h"
#include "fastattn/cpu_gemm.h"
#include "fastattn/cpu_mask.h"
#include "fastattn/rng.h"

namespace fastattn {
namespace {
namespace cpu_attention {

using cpu::acc_t;
using cpu::ceil_div;
using cpu::round_up;
using cpu::Vec;

// Tile sizes (multiples of 16, the widest vector in floats).
constexpr int64_t kFwdBlockQ = 64;   // forward: query rows per task (fwd_block_q: up to 256)
constexpr int64_t kFwdBlockK = 256;  // forward: keys per tile
constexpr int64_t kBwdBlockQ = 64;   // backward: query rows per tile
constexpr int64_t kBwdBlockK = 64;   // backward: keys per tile

// Padding of packed rows: 64 bytes (16 floats, 8 doubles), a multiple of every vector width.
template <class A>
constexpr int64_t kPad = 64 / sizeof(A);

// ---------------------------------------------------------------------------------------------
// Band, dropout and shapes.

// Key j is visible to query i iff i + lo <= j <= i + hi. lo and hi are clamped to
// [-(Lq + Lk + 1), Lq + Lk + 1], which changes no answer and keeps all arithmetic in range.
struct Band {
  int64_t lo, hi;
};

inline int64_t saturating_add(int64_t a, int64_t b) {
#if defined(__GNUC__) || defined(__clang__)
  int64_t r;
  if (__builtin_add_overflow(a, b, &r)) {
    return b > 0 ? std::numeric_limits<int64_t>::max() : std::numeric_limits<int64_t>::min();
  }
  return r;
#else
  const int64_t lim = int64_t(1) << 61;
  return std::clamp(a, -lim, lim) + std::clamp(b, -lim, lim);
#endif
}

inline Band make_band(int64_t offset, int64_t left, int64_t right, int64_t lq, int64_t lk) {
  const int64_t lim = lq + lk + 1;
  const int64_t neg_left = left == std::numeric_limits<int64_t>::min()
                               ? std::numeric_limits<int64_t>::max()
                               : -left;
  return {std::clamp(saturating_add(offset, neg_left), -lim, lim),
          std::clamp(saturating_add(offset, right), -lim, lim)};
}

struct Dropout {
  bool on = false;
  int64_t seed = 0;
  uint32_t threshold = 0;
  double inv_keep = 1.0;
};

struct Shape {
  int64_t B, H, Hkv, G, Lq, Lk, D, Dv;
};

// Task t of the workers over query blocks (forward, JVP, dQ): head bh = t / nqb = (b, h), kv
// head bg = (b, g), query block qb = qb_order[t % nqb] (rows [i0, i0 + nq), of bq), and the
// dropout stream of (b, h) (0 without dropout). Head-major: the threads work through one head's
// query blocks together, so the k / v tiles they stream are the same few MB in the shared cache,
// not those of every head at once (query block-major order, before: 3-5% slower at B1 H8 L2048-4096
// and 8-11% causal; AVX2 Zen 3, 2 threads, float32). Within a head the longest blocks come first.
struct QueryTask {
  int64_t qb, bh, b, h, bg, i0, nq;
  uint32_t stream;
};

inline QueryTask query_task(int64_t t, const Shape& sh, const int64_t* qb_order, int64_t bq,
                            const Dropout& drop) {
  const int64_t nqb = ceil_div(sh.Lq, bq);
  const int64_t qb = qb_order[t % nqb], bh = t / nqb, b = bh / sh.H, h = bh % sh.H;
  const int64_t i0 = qb * bq;
  return {qb, bh, b, h, b * sh.Hkv + h / sh.G, i0, std::min(bq, sh.Lq - i0),
          drop.on ? dropout_stream(drop.seed, b, h, sh.H) : 0};
}

// Tasks handed out by an atomic counter (dynamic scheduling; each task writes distinct outputs).
template <class Worker>
void run_workers(int64_t ntasks, const Worker& worker) {
  if (ntasks <= 0) return;
  std::atomic<int64_t> next{0};
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), ntasks));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) { worker(next); });
}

// The tiles of the other side that a block visits: tile indices [first, last] (none when
// first > last).
struct TileSpan {
  int64_t first, last;
  int64_t count() const { return last - first + 1; }
};

// Key tiles (of `tile` keys, lk in all) visited by query block [i0, i0 + n).
inline TileSpan key_tile_span(const Band& band, int64_t i0, int64_t n, int64_t lk, int64_t tile) {
  const int64_t jlo = std::max<int64_t>(0, i0 + band.lo);
  const int64_t jhi = std::min<int64_t>(lk - 1, i0 + n - 1 + band.hi);
  return jlo > jhi ? TileSpan{0, -1} : TileSpan{jlo / tile, jhi / tile};
}

// Query tiles (of `tile` rows, lq in all) visited by key block [j0, j0 + n).
inline TileSpan query_tile_span(const Band& band, int64_t j0, int64_t n, int64_t lq, int64_t tile) {
  const int64_t ilo = std::max<int64_t>(0, j0 - band.hi);
  const int64_t ihi = std::min<int64_t>(lq - 1, j0 + n - 1 - band.lo);
  return ilo > ihi ? TileSpan{0, -1} : TileSpan{ilo / tile, ihi / tile};
}

// Whether every pair of query rows [i0, i0 + nq) and keys [j0, j0 + nk) is inside the band (then
// the tile needs no band test).
inline bool inside_band(const Band& band, int64_t i0, int64_t nq, int64_t j0, int64_t nk) {
  return j0 >= i0 + nq - 1 + band.lo && j0 + nk - 1 <= i0 + band.hi;
}

// Key tile kb (of bk keys, lk in all) seen from query rows [i0, i0 + nq): keys [j0, j0 + nk),
// padded to nkp (a multiple of the vector width w); `full` when it is inside the band.
struct KeyTile {
  int64_t j0, nk, nkp;
  bool full;
};

inline KeyTile key_tile(const Band& band, int64_t i0, int64_t nq, int64_t kb, int64_t bk,
                        int64_t lk, int64_t w) {
  const int64_t j0 = kb * bk, nk = std::min(bk, lk - j0);
  return {j0, nk, round_up(nk, w), inside_band(band, i0, nq, j0, nk)};
}

// Key tile t cut to the keys that some row of [i0, i0 + nq) can see: from the first row's first
// key (rounded down to whole vectors of w from the tile's start, so the transposed tile's columns
// stay aligned) to the last row's last key. A causal block on the diagonal of a wide tile then
// computes only its triangle's columns (64 rows by 256 keys: 64 to 256 columns, not always 256).
inline KeyTile trim_to_band(const KeyTile& t, const Band& band, int64_t i0, int64_t nq, int64_t w) {
  if (t.full) return t;
  const int64_t first = std::max(t.j0, std::min(i0 + band.lo, t.j0 + t.nk - 1));
  const int64_t j0 = t.j0 + (first - t.j0) / w * w;
  const int64_t end = std::max(j0 + 1, std::min(t.j0 + t.nk, i0 + nq + band.hi));
  return {j0, end - j0, round_up(end - j0, w), inside_band(band, i0, nq, j0, end - j0)};
}

// The blocks of a length `len` cut into blocks of `block`, sorted by decreasing work
// `tiles(start, n)` (the tiles of the other side inside the band), ties in increasing order: the
// longest tasks start first.
template <class Tiles>
std::vector<int64_t> order_by_work(int64_t len, int64_t block, const Tiles& tiles) {
  const int64_t nblocks = ceil_div(len, block);
  std::vector<int64_t> work(nblocks), order(nblocks);
  for (int64_t x = 0; x < nblocks; ++x) work[x] = tiles(x * block, std::min(block, len - x * block));
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(),
                   [&](int64_t x, int64_t y) { return work[x] > work[y]; });
  return order;
}

// Query blocks (of bq rows) by the key tiles (of bk keys) they visit; key blocks likewise.
inline std::vector<int64_t> query_order(const Band& band, int64_t lq, int64_t lk, int64_t bq, int64_t bk) {
  return order_by_work(lq, bq, [&](int64_t i0, int64_t n) {
    return key_tile_span(band, i0, n, lk, bk).count();
  });
}

inline std::vector<int64_t> key_order(const Band& band, int64_t lq, int64_t lk, int64_t bq, int64_t bk) {
  return order_by_work(lk, bk, [&](int64_t j0, int64_t n) {
    return query_tile_span(band, j0, n, lq, bq).count();
  });
}

// ---------------------------------------------------------------------------------------------
// Packing (memory-bound, baseline ISA). `src` is (B, heads, L, dim) with strides s (unit stride
// on dim); rows are indexed bh = b * heads + head.

struct Strided4 {
  int64_t s0, s1, s2;  // strides of dims 0, 1, 2 (dim 3 has stride 1)
};

// out[d] = scale * in[d] converted to A for d < dim, zero up to dpad, in 16-byte vectors
// (memory-bound work, left at the baseline ISA, where wider generic vectors go through the
// stack); bfloat16 first in 64-byte ones (16 conversions at a time), float16 in 16-byte ones.
// Measured against per-element conversion and scaling, one thread, 2048 rows of 32: float
// 32-68 -> 11-12 us, bfloat16 15 -> 12 us.
template <class T, class A>
inline void pack_row(const T* in, A* out, int64_t dim, int64_t dpad, A scale) {
  using V = Vec<A, (std::is_same_v<T, c10::BFloat16> ? 64 : 16) / sizeof(A)>;
  using V1 = Vec<A, 16 / sizeof(A)>;
  int64_t d = 0;
  for (; d + V::size <= dim; d += V::size) (cpu::load_as<V>(in + d) * V(scale)).store(out + d);
  for (; d + V1::size <= dim; d += V1::size) (cpu::load_as<V1>(in + d) * V1(scale)).store(out + d);
  for (; d < dim; ++d) out[d] = cpu::to_acc<A>(in[d]) * scale;
  std::fill(out + dim, out + dpad, A(0));
}

// dst[(bh * L + r) * dpad + d] = scale * src[b, head, r, d], zero for d >= dim; then kGemmRowPad zero
// rows (dst holds (B * heads * L + kGemmRowPad) * dpad values), so any row block of it can be a
// GEMM's A operand. (A chunk of rows finds its head once and steps through it: four integer
// divisions a row were a third of the cost at D = 32.)
template <class T, class A>
void pack_rows(const T* src, Strided4 s, int64_t B, int64_t heads, int64_t L, int64_t dim,
               int64_t dpad, A* dst, A scale = A(1)) {
  const int64_t rows = B * heads * L;
  auto head = [&](int64_t bh) { return src + (bh / heads) * s.s0 + (bh % heads) * s.s1; };
  at::parallel_for(0, rows, std::max<int64_t>(1, 4096 / std::max<int64_t>(1, dpad)),
                   [&](int64_t r0, int64_t r1) {
    int64_t bh = r0 / L, r = r0 % L;
    const T* in = head(bh);
    for (int64_t row = r0; row < r1; ++row) {
      pack_row(in + r * s.s2, dst + row * dpad, dim, dpad, scale);
      if (++r == L && row + 1 < r1) {
        r = 0;
        in = head(++bh);
      }
    }
  });
  std::fill(dst + rows * dpad, dst + (rows + cpu::kGemmRowPad) * dpad, A(0));
}

// Elements of a pack_rows buffer.
inline int64_t packed_rows_size(int64_t rows, int64_t dpad) { return (rows + cpu::kGemmRowPad) * dpad; }

// Whether x[0, n) holds a NaN or an infinity; n a multiple of 32 bytes of A (a pack_rows
// buffer's rows are).
template <class A>
bool any_nonfinite(const A* x, int64_t n) {
  using V = Vec<A, 16 / sizeof(A)>;
  V a0(A(0)), a1(A(0));  // x - x is 0, or NaN for NaN and +-inf
  for (int64_t e = 0; e < n; e += 2 * V::size) {
    const V x0 = V::load(x + e), x1 = V::load(x + e + V::size);
    a0 = a0 + (x0 - x0);
    a1 = a1 + (x1 - x1);
  }
  const A r = (a0 + a1).sum();
  return r != r;
}

// flags[bh * ntiles + t] = 1 iff rows [t * tile, (t + 1) * tile) of head bh of a pack_rows buffer
// (heads * L rows of ld values, ld a multiple of kPad<A>) hold a NaN or an infinity; an empty
// vector when every value is finite. The tiles flagged take the careful GEMM (gemm_acc).
template <class A>
std::vector<uint8_t> nonfinite_tiles(const A* rows, int64_t heads, int64_t L, int64_t ld,
                                     int64_t tile) {
  const int64_t ntiles = ceil_div(L, tile);
  std::vector<uint8_t> flags(heads * ntiles, 0);
  std::atomic<bool> any{false};
  at::parallel_for(0, heads * ntiles, 1, [&](int64_t t0, int64_t t1) {
    for (int64_t ht = t0; ht < t1; ++ht) {
      const int64_t h = ht / ntiles, t = ht % ntiles;
      if (any_nonfinite(rows + (h * L + t * tile) * ld, std::min(tile, L - t * tile) * ld)) {
        flags[ht] = 1;
        any.store(true, std::memory_order_relaxed);
      }
    }
  });
  if (!any.load()) flags.clear();
  return flags;
}

// Rows of a transposed tile (dim x tile, rows ld apart) are written kColumnGroup at a time: row
// c0 + c of the group is packed into buf + c * dim, then put_columns stores out[d * ld + c0 + c]
// for the whole group, one 64-byte run per line of the tile. Written one column (key) at a time,
// each value went to another line of a tile too big for L1 (64 KB for 256 keys at D = 64): the
// packing was ~14% of a 4x4x256x64 forward, as much as its exps.
constexpr int64_t kColumnGroup = 16;

template <class A>
inline void put_columns(const A* buf, A* out, int64_t dim, int64_t ld, int64_t c0, int64_t n) {
  for (int64_t d = 0; d < dim; ++d) {
    A* o = out + d * ld + c0;
    for (int64_t c = 0; c < n; ++c) o[c] = buf[c * dim + d];
  }
}

// Columns [n, round_up(n, kColumnGroup)) of a transposed tile (dim x tile, rows ld apart) set to
// zero: the GEMMs read a tile's columns up to its keys rounded to a whole vector (at most
// kColumnGroup values), never further, so a short last tile (or a tile wider than the sequence)
// leaves the rest unwritten (a 128-key head in a 256-key tile: half the packing's stores were
// zeros).
template <class A>
inline void zero_columns(A* out, int64_t dim, int64_t tile, int64_t ld, int64_t n) {
  const int64_t end = std::min(tile, round_up(n, kColumnGroup));
  for (int64_t d = 0; d < dim; ++d) std::fill(out + d * ld + n, out + d * ld + end, A(0));
}

// Transposed tiles: dst[((bh * ntiles + t) * dim + d) * tile + c] = scale * src[b, head, t * tile + c, d],
// zero for rows >= L.
template <class T, class A>
void pack_transposed(const T* src, Strided4 s, int64_t B, int64_t heads, int64_t L, int64_t dim,
                     int64_t tile, A* dst, A scale = A(1)) {
  const int64_t ntiles = ceil_div(L, tile);
  at::parallel_for(0, B * heads * ntiles, 1, [&](int64_t t0, int64_t t1) {
    std::vector<A> buf(kColumnGroup * dim);
    for (int64_t bt = t0; bt < t1; ++bt) {
      const int64_t bh = bt / ntiles, t = bt % ntiles, b = bh / heads, hd = bh % heads;
      A* out = dst + bt * dim * tile;
      const int64_t n = std::min(tile, L - t * tile);
      for (int64_t c0 = 0; c0 < n; c0 += kColumnGroup) {
        const int64_t m = std::min(kColumnGroup, n - c0);
        for (int64_t c = 0; c < m; ++c) {
          pack_row(src + b * s.s0 + hd * s.s1 + (t * tile + c0 + c) * s.s2, buf.data() + c * dim,
                   dim, dim, scale);
        }
        put_columns(buf.data(), out, dim, tile, c0, m);
      }
      zero_columns(out, dim, tile, tile, n);
    }
  });
}

// The forward's three packings in one pass: q as pack_rows (times scale, row length D), k as
// pack_transposed (tiles of `tile` keys, but rows ldk apart: D x ldk values a tile), v as
// pack_rows (row length Dvp). A task (b, h, tile t) packs q's rows of tile t and, for the first
// query head of each kv head, k's and v's rows of the same tile, token by token: where q, k and v
// are views of one qkv tensor (self-attention after one projection) that is one sequential
// stream, where three passes each read a third of every token at the token's stride.
template <class T, class A>
void pack_qkv(const T* q, Strided4 qs, const T* k, Strided4 ks, const T* v, Strided4 vs,
              const Shape& sh, int64_t tile, int64_t ldk, A scale, A* qp, A* kt, A* vp,
              int64_t Dvp) {
  const int64_t nkb = ceil_div(sh.Lk, tile), ntiles = std::max(ceil_div(sh.Lq, tile), nkb);
  at::parallel_for(0, sh.B * sh.H * ntiles, 1, [&](int64_t t0, int64_t t1) {
    std::vector<A> kbuf(kColumnGroup * sh.D);
    for (int64_t task = t0; task < t1; ++task) {
      const int64_t bh = task / ntiles, t = task % ntiles, b = bh / sh.H, h = bh % sh.H;
      const int64_t g = h / sh.G, bg = b * sh.Hkv + g;
      const int64_t nq = std::clamp<int64_t>(sh.Lq - t * tile, 0, tile);
      const bool owns_kv = h % sh.G == 0 && t < nkb;  // the group's first head packs k and v
      const int64_t nk = owns_kv ? std::min(tile, sh.Lk - t * tile) : 0;
      const T* qh = q + b * qs.s0 + h * qs.s1;
      const T* kh = k + b * ks.s0 + g * ks.s1;
      const T* vh = v + b * vs.s0 + g * vs.s1;
      A* kout = kt + (bg * nkb + t) * sh.D * ldk;
      const int64_t n = std::max(nq, nk);
      for (int64_t c0 = 0; c0 < n; c0 += kColumnGroup) {
        for (int64_t c = c0; c < std::min(c0 + kColumnGroup, n); ++c) {
          const int64_t r = t * tile + c;
          if (c < nq) pack_row(qh + r * qs.s2, qp + (bh * sh.Lq + r) * sh.D, sh.D, sh.D, scale);
          if (c < nk) {
            pack_row(kh + r * ks.s2, kbuf.data() + (c - c0) * sh.D, sh.D, sh.D, A(1));
            pack_row(vh + r * vs.s2, vp + (bg * sh.Lk + r) * Dvp, sh.Dv, Dvp, A(1));
          }
        }
        if (c0 < nk) put_columns(kbuf.data(), kout, sh.D, ldk, c0, std::min(kColumnGroup, nk - c0));
      }
      if (owns_kv) zero_columns(kout, sh.D, tile, ldk, nk);
    }
  });
  const int64_t qrows = sh.B * sh.H * sh.Lq, vrows = sh.B * sh.Hkv * sh.Lk;
  std::fill(qp + qrows * sh.D, qp + (qrows + cpu::kGemmRowPad) * sh.D, A(0));
  std::fill(vp + vrows * Dvp, vp + (vrows + cpu::kGemmRowPad) * Dvp, A(0));
}

// One forward key tile, laid out as pack_qkv lays out that tile, for a task that packs the
// tiles it uses (FwdArgs::pack_tile): keys [kb * tile, kb * tile + n), n = min(tile, Lk - kb *
// tile), of kv head bg; k transposed into kt (D x tile, rows ldk apart, columns n.. zero), v as
// n rows of Dvp into vp; buf holds kColumnGroup * D values.
template <class T, class A>
void pack_kv_tile(const T* k, Strided4 ks, const T* v, Strided4 vs, const Shape& sh, int64_t tile,
                  int64_t ldk, int64_t bg, int64_t kb, A* kt, A* vp, int64_t Dvp, A* buf) {
  const int64_t b = bg / sh.Hkv, g = bg % sh.Hkv, j0 = kb * tile, n = std::min(tile, sh.Lk - j0);
  const T* kh = k + b * ks.s0 + g * ks.s1 + j0 * ks.s2;
  const T* vh = v + b * vs.s0 + g * vs.s1 + j0 * vs.s2;
  for (int64_t c0 = 0; c0 < n; c0 += kColumnGroup) {
    const int64_t m = std::min(kColumnGroup, n - c0);
    for (int64_t c = c0; c < c0 + m; ++c) {
      pack_row(kh + c * ks.s2, buf + (c - c0) * sh.D, sh.D, sh.D, A(1));
      pack_row(vh + c * vs.s2, vp + c * Dvp, sh.Dv, Dvp, A(1));
    }
    put_columns(buf, kt, sh.D, ldk, c0, m);
  }
  zero_columns(kt, sh.D, tile, ldk, n);
}

// ---------------------------------------------------------------------------------------------
// Row helpers (FASTATTN_INLINE: compiled for the ISA of the calling worker). n is a multiple of
// V::size unless said otherwise.

template <class V>
FASTATTN_INLINE void scale_row(typename V::value_type* s, int64_t n, typename V::value_type scale) {
  const V sv(scale);
  for (int64_t c = 0; c < n; c += V::size) (V::load(s + c) * sv).store(s + c);
}

template <class V>
FASTATTN_INLINE typename V::value_type max_row(const typename V::value_type* s, int64_t n) {
  using A = typename V::value_type;
  V m0(-std::numeric_limits<A>::infinity()), m1 = m0;
  int64_t c = 0;
  for (; c + 2 * V::size <= n; c += 2 * V::size) {
    m0 = max(m0, V::load(s + c));
    m1 = max(m1, V::load(s + c + V::size));
  }
  if (c < n) m0 = max(m0, V::load(s + c));
  return max(m0, m1).max_lane();
}

// exp(x - m) for a score x, or the masked marker -0.0 where x = -inf (masked out), whatever m is
// (m may be NaN: a row that attends a NaN score; its masked entries still stay out).
template <class V>
FASTATTN_INLINE V exp_live(V x, V m) {
  using A = typename V::value_type;
  return V::select_neg_inf(x, V(-A(0)), cpu::vexp_shifted(x - m));
}

// s = exp(s - m) in place (-0.0 where s = -inf); returns the sum.
template <class V>
FASTATTN_INLINE typename V::value_type exp_sum_row(typename V::value_type* s, int64_t n,
                                                   typename V::value_type m) {
  using A = typename V::value_type;
  const V mv(m);
  V a0(A(0)), a1(A(0));
  int64_t c = 0;
  for (; c + 2 * V::size <= n; c += 2 * V::size) {
    const V e0 = exp_live(V::load(s + c), mv), e1 = exp_live(V::load(s + c + V::size), mv);
    e0.store(s + c);
    e1.store(s + c + V::size);
    a0 = a0 + e0;
    a1 = a1 + e1;
  }
  if (c < n) {
    const V e0 = exp_live(V::load(s + c), mv);
    e0.store(s + c);
    a0 = a0 + e0;
  }
  return (a0 + a1).sum();
}

// s = exp(s - m) in place (m a scalar; -0.0 where s = -inf).
template <class V>
FASTATTN_INLINE void exp_row(typename V::value_type* s, int64_t n, typename V::value_type m) {
  const V mv(m);
  for (int64_t c = 0; c < n; c += V::size) exp_live(V::load(s + c), mv).store(s + c);
}

// s = exp(s - m[c]) in place (a per-column m; -0.0 where s = -inf).
template <class V>
FASTATTN_INLINE void exp_row_cols(typename V::value_type* s, int64_t n,
                                  const typename V::value_type* m) {
  for (int64_t c = 0; c < n; c += V::size) exp_live(V::load(s + c), V::load(m + c)).store(s + c);
}

// dst = s * z
template <class V>
FASTATTN_INLINE void mul_row_to(typename V::value_type* dst, const typename V::value_type* s,
                                int64_t n, const typename V::value_type* z) {
  for (int64_t c = 0; c < n; c += V::size) (V::load(s + c) * V::load(z + c)).store(dst + c);
}

// dp = p * (dp * z - delta) with a scalar delta (z = null: no dropout); -0.0 (masked) where p is
// -0.0, even when dp or delta is NaN.
template <class V>
FASTATTN_INLINE void ds_row(typename V::value_type* dp, const typename V::value_type* p,
                            const typename V::value_type* z, int64_t n,
                            typename V::value_type delta) {
  const V dv(delta);
  for (int64_t c = 0; c < n; c += V::size) {
    V d = V::load(dp + c);
    if (z != nullptr) d = d * V::load(z + c);
    const V pv = V::load(p + c);
    V::select_neg_zero(pv, pv, pv * (d - dv)).store(dp + c);
  }
}

// dp = p * (dp * z - delta[c]) with a per-column delta (-0.0 where p is -0.0).
template <class V>
FASTATTN_INLINE void ds_row_cols(typename V::value_type* dp, const typename V::value_type* p,
                                 const typename V::value_type* z, int64_t n,
                                 const typename V::value_type* delta) {
  for (int64_t c = 0; c < n; c += V::size) {
    V d = V::load(dp + c);
    if (z != nullptr) d = d * V::load(z + c);
    const V pv = V::load(p + c);
    V::select_neg_zero(pv, pv, pv * (d - V::load(delta + c))).store(dp + c);
  }
}

// C += op(A) B on a tile, by the careful path when B holds a non-finite value (`careful`): then
// the -0.0 (masked-out) entries of op(A) contribute nothing, as docs/numerics.md's NaN rule asks.
template <class V, bool kTransA = false>
FASTATTN_INLINE void gemm_acc(bool careful, int64_t m, int64_t n, int64_t k,
                              const typename V::value_type* a, int64_t lda,
                              const typename V::value_type* b, int64_t ldb,
                              typename V::value_type* c, int64_t ldc) {
  if (careful) {
    cpu::gemm_skip_neg_zero<V, kTransA>(m, n, k, a, lda, b, ldb, c, ldc);
  } else {
    cpu::gemm<V, kTransA>(m, n, k, a, lda, b, ldb, c, ldc, true);
  }
}

// For a mask that does not vary along the query axis (stride 0 there: a key-padding mask), a
// flag per (b * H + h, key tile of bk keys): 1 when the mask removes every key of the tile, which
// the forward then skips (exact: such a tile adds nothing to any row, and its keys' values are
// never read). An empty vector for other masks or when no tile is wholly masked. Reads B * H * Lk
// mask values, against the B * H * Lq * Lk scores they save.
inline std::vector<uint8_t> masked_key_tiles(const cpu::MaskView& mask, int64_t B, int64_t H,
                                             int64_t lk, int64_t bk) {
  if (!mask.defined() || mask.stride[2] != 0) return {};
  const int64_t ntiles = ceil_div(lk, bk);
  std::vector<uint8_t> dead(B * H * ntiles, 0);
  std::vector<float> row(bk);  // the mask applied to zeros: -inf exactly where it removes a key
  bool any = false;
  for (int64_t bh = 0; bh < B * H; ++bh) {
    for (int64_t t = 0; t < ntiles; ++t) {
      const int64_t j0 = t * bk, nk = std::min(bk, lk - j0);
      std::fill(row.begin(), row.begin() + nk, 0.f);
      cpu::apply_mask_row(row.data(), nk, mask, mask.offset(bh / H, bh % H, 0, j0), mask.stride[3]);
      const bool kept = std::any_of(row.begin(), row.begin() + nk,
                                    [](float x) { return x != -std::numeric_limits<float>::infinity(); });
      dead[bh * ntiles + t] = !kept;
      any = any || !kept;
    }
  }
  return any ? dead : std::vector<uint8_t>{};
}

// Whether tile `i` of a nonfinite_tiles() list is flagged (null: all finite).
inline bool flagged(const uint8_t* flags, int64_t i) { return flags != nullptr && flags[i] != 0; }

// z[c] = keep(counter = base + c * stride) ? inv_keep : 0 for c < n (any n).
template <class A>
FASTATTN_INLINE void dropout_row(A* z, int64_t n, uint32_t base, uint32_t stride, uint32_t stream,
                                 uint32_t threshold, A inv_keep) {
  for (int64_t c = 0; c < n; ++c) {
    const uint32_t bits = dropout_bits(stream, base, static_cast<uint32_t>(c) * stride);
    z[c] = bits >= threshold ? inv_keep : A(0);
  }
}

// Sets s[c] = -inf for c outside [c_lo, c_hi) and for the padding [n, npad).
template <class A>
FASTATTN_INLINE void band_row(A* s, int64_t n, int64_t npad, int64_t c_lo, int64_t c_hi) {
  const A neg_inf = -std::numeric_limits<A>::infinity();
  c_lo = std::clamp<int64_t>(c_lo, 0, n);
  c_hi = std::clamp<int64_t>(c_hi, c_lo, n);
  std::fill(s, s + c_lo, neg_inf);
  std::fill(s + c_hi, s + npad, neg_inf);
}

// Row sr of a score tile, query i of (b, h) against key tile t: the mask added, then -inf outside
// the band (tiles inside it skip that test) and on the padding [t.nk, t.nkp).
template <class A>
FASTATTN_INLINE void mask_band_row(A* sr, const cpu::MaskView& mask, const Band& band, int64_t b,
                                   int64_t h, int64_t i, const KeyTile& t) {
  if (mask.defined()) {
    cpu::apply_mask_row(sr, t.nk, mask, mask.offset(b, h, i, t.j0), mask.stride[3]);
  }
  if (!t.full || t.nk < t.nkp) {
    band_row(sr, t.nk, t.nkp, t.full ? 0 : i + band.lo - t.j0,
             t.full ? t.nk : i + band.hi - t.j0 + 1);
  }
}

// mask_band_row, returning the row's maximum over its t.nkp scores (max_row's): on a tile inside
// the band with a mask, the mask and the maximum in one pass (cpu::apply_mask_row_max).
template <class V>
FASTATTN_INLINE typename V::value_type mask_band_max_row(typename V::value_type* sr,
                                                         const cpu::MaskView& mask,
                                                         const Band& band, int64_t b, int64_t h,
                                                         int64_t i, const KeyTile& t) {
  if (t.full && mask.defined()) {
    return cpu::apply_mask_row_max<V>(sr, t.nk, t.nkp, mask, mask.offset(b, h, i, t.j0),
                                      mask.stride[3]);
  }
  mask_band_row(sr, mask, band, b, h, i, t);
  return max_row<V>(sr, t.nkp);
}

// One online-softmax step (the forward's and the JVP's) on row s of a score tile: nk scores,
// padded with -inf to n (a multiple of V::size), their maximum mx (mask_band_max_row's), and the
// row's running max m and sum l. Sets
// s = exp(s - m_new) (P unnormalized, -0.0 where masked), l = l * alpha + rowsum(s), m = m_new,
// and alpha = exp(m_old - m_new), the factor the row's accumulators take. A NaN score makes the
// row NaN (std::max(m, NaN) would drop it). Returns false, changing nothing, while the row has
// seen no visible key (every score -inf, no NaN hiding from max_row): its P is -0.0 (masked) there.
template <class V>
FASTATTN_INLINE bool online_softmax_row(typename V::value_type* s, int64_t nk, int64_t n,
                                        typename V::value_type mx, typename V::value_type& m,
                                        typename V::value_type& l, typename V::value_type& alpha) {
  using A = typename V::value_type;
  A m_new = mx != mx ? mx : std::max(m, mx);
  if (m_new == -std::numeric_limits<A>::infinity()) {
    if (std::none_of(s, s + nk, [](A x) { return x != x; })) return false;
    m_new = std::numeric_limits<A>::quiet_NaN();
  }
  alpha = cpu::sexp(m - m_new);
  const A sum = exp_sum_row<V>(s, n, m_new);
  l = l * alpha + sum;
  m = m_new;
  return true;
}

// ---------------------------------------------------------------------------------------------
// Argument checks.

inline void check_qkv(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v) {
  for (const auto& [t, name] : {std::pair{&q, "q"}, std::pair{&k, "k"}, std::pair{&v, "v"}}) {
    TORCH_CHECK(t->dim() == 4, name, " must be 4-D (batch, heads, length, head_dim), got shape ",
                t->sizes());
    check_float_dtype(*t, name, /*allow_double=*/true);
    check_device(*t, q, name, "q");
    TORCH_CHECK(t->scalar_type() == q.scalar_type(), name, " must have q's dtype (",
                q.scalar_type(), "), got ", t->scalar_type());
  }
  TORCH_CHECK(k.size(0) == q.size(0) && v.size(0) == q.size(0), "batch sizes differ: q ",
              q.sizes(), ", k ", k.sizes(), ", v ", v.sizes());
  TORCH_CHECK(k.size(1) == v.size(1) && k.size(2) == v.size(2), "k ", k.sizes(), " and v ",
              v.sizes(), " must have the same heads and length");
  TORCH_CHECK(k.size(3) == q.size(3), "q's head dim (", q.size(3), ") differs from k's (",
              k.size(3), "): q ", q.sizes(), ", k ", k.sizes());
  const int64_t H = q.size(1), Hkv = k.size(1);
  TORCH_CHECK((Hkv > 0 && H % Hkv == 0) || (Hkv == 0 && H == 0), "the query heads (", H,
              ") must be a multiple of the key/value heads (", Hkv, "): q ", q.sizes(), ", k ",
              k.sizes());
}

inline Dropout make_dropout(double p, int64_t seed) {
  TORCH_CHECK(p >= 0.0 && p < 1.0, "dropout_p must be in [0, 1), got ", p);
  Dropout d;
  d.on = p > 0.0;
  d.seed = seed;
  d.threshold = dropout_threshold(p);
  d.inv_keep = 1.0 / (1.0 - p);
  return d;
}

// t with a unit stride on its last dimension (a copy only when it has another).
inline at::Tensor unit_last(const at::Tensor& t) {
  return t.size(-1) <= 1 || t.stride(-1) == 1 ? t : t.contiguous();
}

inline Strided4 strides_of(const at::Tensor& t) { return {t.stride(0), t.stride(1), t.stride(2)}; }

// `t` itself when T is A (outputs written in place), else a contiguous A tensor of its shape to be
// copied into it afterwards.
template <class T, class A>
at::Tensor acc_output(const at::Tensor& t) {
  if constexpr (std::is_same_v<T, A>) {
    return t;
  } else {
    return empty_tensor(t.sizes(), t.options().dtype(c10::CppTypeToScalarType<A>::value));
  }
}

}  // namespace cpu_attention
}  // namespace

namespace cpu {
// Attention shaped like decoding (few query rows against many keys; no mask, no dropout) through
// the paged forward's split-KV worker (csrc/cpu/varlen.cpp), which reads each key and value row
// in place: the dense forward packs all of k and v first, O(Lk * D) work that a few rows never
// earn back (at Lq = 1 it was 2-5x torch's time). q (B, H, Lq, D), k and v (B, Hkv, Lk, D / Dv)
// with unit last strides; the band of rows i: i + offset - left <= j <= i + offset + right with
// offset Lk - Lq (bottom_right) or 0; writes out (B, H, Lq, Dv) and lse (B, H, Lq).
void dense_decode_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                      bool bottom_right, int64_t left, int64_t right, at::Tensor& out,
                      at::Tensor& lse);
}  // namespace cpu
}  // namespace fastattn
