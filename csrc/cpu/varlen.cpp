// Attention over packed variable-length sequences and over a paged KV cache, on CPU
// (fastattn::varlen_attention_fwd / varlen_attention_bwd / paged_attention_fwd).
//
// Math (per sequence b, query head h, kv head g = h / (H / Hkv)), as docs/numerics.md with each
// sequence's own lengths Lq_b, Lk_b:
//
//   S_ij = scale * q_i . k_j   for keys j inside the band  i + off - left <= j <= i + off + right
//          (off = Lk_b - Lq_b when bottom_right, else 0), -inf outside
//   lse_i = log sum_j exp(S_ij),  P = exp(S - lse),  O = (P * Z) V     Z: dropout (rng.h), with the
//          stream of batch row b and the counter i * Lk_b + j
//   delta_i = sum_j P_ij dP_ij,  dP = Z * (dO V^T),  dS = P * (dP - delta)
//   dQ = scale * dS K,  dK = scale * dS^T Q,  dV = (P * Z)^T dO
//
// Layouts: varlen q (total_q, H, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv), sequence b is rows
// cu_q[b]..cu_q[b+1] (and cu_k); lse (H, total_q). Paged: q (B, H, Lq, D), caches (num_blocks,
// block_size, Hkv, D/Dv); key t of sequence b lives in block block_table[b, t / block_size], slot
// t % block_size; lse (B, H, Lq).
//
// Work split:
// * varlen forward / backward: each sequence is the dense CPU attention (fastattn::attention_fwd
//   / _bwd, csrc/cpu/attention.cpp: blocked GEMM tiles, online softmax, SIMD) on strided
//   (1, H, L, D) views of the packed tensors, with the sequence's band offset and batch row b's
//   dropout stream; only the outputs are copied into the packed layout. Longest first: a
//   sequence with more than a thread's share of the work left, and the last ones when fewer
//   than two per thread are left, run one after another, each parallel over heads and query
//   blocks inside; the others run in parallel, each dense call on one thread (for_sequences).
// * paged forward (decoding: few queries, many keys) splits the key axis as flash-decoding does:
//   one task per (sequence, kv head, key split) covers the Lq rows of every query head of the GQA
//   group (so each cached key row is read from memory once per split), keys as rows (scores by
//   W-lane dot products folded into W scores at once), keeping per-row partial (max, sum, O);
//   a second pass per (sequence, query head, row) merges the splits. The number of splits is
//   chosen so that the tasks outnumber the threads about 4 to 1.
//
// Precision: as the dense kernel for varlen; paged: accumulation in float32 (float64 for float64
// inputs), the cache read in place (float32 / float64 rows of whole vectors) or converted a key
// row at a time (never as a whole).
// Limits: none beyond memory; index arithmetic is int64. Every index is checked before use:
// cu_seqlens must be within bounds and non-decreasing (the Python layer gives friendlier
// messages; these checks keep a direct call in bounds); block_table entries must be blocks or -1
// and cache_seqlens within the blocks a row owns (ValueError naming them: the public function
// leaves these values to this op).
#include <ATen/Parallel.h>
#include <ATen/core/LegacyTypeDispatch.h>  // at::AutoDispatchBelowADInplaceOrView
#include <ATen/core/Tensor.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/LocalDispatchKeySet.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <limits>
#include <numeric>
#include <vector>

#include "fastattn/common.h"
#include "fastattn/cpu_simd.h"

namespace fastattn {
namespace {

constexpr int64_t kMinSplit = 256;  // paged forward: fewest keys per split

// The band of row i clipped to the keys [0, lk): [lo, hi], empty when lo > hi.
struct RowBand {
  int64_t lo, hi;
};

inline RowBand row_band(int64_t i, int64_t lq, int64_t lk, bool bottom_right, int64_t left,
                        int64_t right) {
  const int64_t off = bottom_right ? lk - lq : 0;
  left = std::min(left, lq + lk);  // unbounded sides arrive as large values: no overflow
  right = std::min(right, lq + lk);
  return {std::max<int64_t>(0, i + off - left), std::min(lk - 1, i + off + right)};
}

template <class Worker>
void run_tasks(int64_t ntasks, const Worker& worker) {
  if (ntasks <= 0) return;
  std::atomic<int64_t> next{0};
  at::parallel_for(0, at::get_num_threads(), 1, [&](int64_t, int64_t) {
    for (int64_t t = next++; t < ntasks; t = next++) worker(t);
  });
}


// cu_seqlens as host int64 values, checked: int32, 1-D, (batch + 1), 0 first, non-decreasing,
// last == total.
std::vector<int64_t> read_cu(const at::Tensor& cu, int64_t batch1, int64_t total, const char* name) {
  TORCH_CHECK(cu.scalar_type() == at::kInt, name, " must be int32, got ", cu.scalar_type());
  TORCH_CHECK(cu.dim() == 1 && cu.size(0) == batch1, name, " must have shape (", batch1,
              ",), got ", cu.sizes());
  const auto c = cu.contiguous();
  const int32_t* p = c.data_ptr<int32_t>();
  std::vector<int64_t> out(p, p + batch1);
  TORCH_CHECK(batch1 >= 1 && out[0] == 0, name, " must start at 0");
  for (int64_t b = 0; b + 1 < batch1; ++b)
    TORCH_CHECK(out[b + 1] >= out[b], name, " must be non-decreasing, got ", out[b], " then ",
                out[b + 1], " at ", b);
  TORCH_CHECK(out[batch1 - 1] == total, name, " must end at the total length ", total, ", got ",
              out[batch1 - 1]);
  return out;
}

void check_last_dim(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.size(-1) <= 1 || t.stride(-1) == 1, name,
              " must have a contiguous last dimension, got strides ", t.strides());
}

struct VarlenShape {
  int64_t H, Hkv, D, Dv, batch, max_q, max_k;
  std::vector<int64_t> cq, ck;
};

VarlenShape check_varlen(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                         const at::Tensor& cu_q, const at::Tensor& cu_k) {
  TORCH_CHECK(q.dim() == 3 && k.dim() == 3 && v.dim() == 3,
              "q, k, v must be 3-D (total, heads, dim), got ", q.sizes(), ", ", k.sizes(), ", ",
              v.sizes());
  check_float_dtype(q, "q", true);
  TORCH_CHECK(k.scalar_type() == q.scalar_type() && v.scalar_type() == q.scalar_type(),
              "q, k, v must share a dtype");
  TORCH_CHECK(k.size(0) == v.size(0) && k.size(1) == v.size(1),
              "k and v must share total length and heads, got ", k.sizes(), " and ", v.sizes());
  TORCH_CHECK(k.size(2) == q.size(2), "q and k head dims differ: ", q.sizes(), ", ", k.sizes());
  TORCH_CHECK(k.size(1) > 0 && q.size(1) % k.size(1) == 0,
              "query heads must be a multiple of kv heads, got ", q.sizes(), ", ", k.sizes());
  check_last_dim(q, "q");
  check_last_dim(k, "k");
  check_last_dim(v, "v");
  TORCH_CHECK(cu_q.size(0) == cu_k.size(0), "cu_seqlens_q and cu_seqlens_k must have one length, got ",
              cu_q.sizes(), " and ", cu_k.sizes());
  VarlenShape s;
  s.H = q.size(1), s.Hkv = k.size(1), s.D = q.size(2), s.Dv = v.size(2);
  s.batch = cu_q.size(0) - 1;
  s.cq = read_cu(cu_q, cu_q.size(0), q.size(0), "cu_seqlens_q");
  s.ck = read_cu(cu_k, cu_k.size(0), k.size(0), "cu_seqlens_k");
  s.max_q = s.max_k = 0;
  for (int64_t b = 0; b < s.batch; ++b) {
    s.max_q = std::max(s.max_q, s.cq[b + 1] - s.cq[b]);
    s.max_k = std::max(s.max_k, s.ck[b + 1] - s.ck[b]);
  }
  return s;
}

// ---------------------------------------------------------------------------------------------
// varlen: each sequence through the dense CPU attention (csrc/cpu/attention.cpp, reached through
// the dispatcher) on strided (1, H, L, D) views of the packed tensors, so the packed layout costs
// no copy in and one copy of the outputs out.

// (L, H, D) rows [start, start + n) -> the (1, H, n, D) view the dense op takes.
at::Tensor seq_view(const at::Tensor& t, int64_t start, int64_t n) {
  return t.narrow(0, start, n).permute({1, 0, 2}).unsqueeze(0);
}

// The seed whose batch-0 dropout streams are batch row b's (rng.h: the stream hashes
// seed + 0x9E3779B9 * (b * H + h)), so sequence b runs as a batch of one.
int64_t sequence_seed(int64_t seed, int64_t b, int64_t H) {
  return static_cast<int64_t>(static_cast<uint32_t>(seed) +
                              0x9E3779B9u * static_cast<uint32_t>(b) * static_cast<uint32_t>(H));
}

// Runs fn(b) for every sequence, longest (lq * lk) first. A sequence that alone holds more than
// a thread's share of the work left (its own included) runs by itself, parallel inside (heads and
// query blocks), as do the last ones when fewer than two per thread are left; the others run in
// parallel, one sequence per thread (each dense call on its worker's thread). One thread per
// sequence alone left 4 sequences of 1024, 563, 307 and 154 tokens on 2 threads at 1024^2
// against 563^2 + 307^2 + 154^2: one thread idle 60% of the time.
template <class Fn>
void for_sequences(const VarlenShape& s, const Fn& fn) {
  const int64_t threads = at::get_num_threads();
  auto work = [&](int64_t b) { return (s.cq[b + 1] - s.cq[b]) * (s.ck[b + 1] - s.ck[b]); };
  std::vector<int64_t> order(s.batch);
  std::iota(order.begin(), order.end(), 0);
  std::stable_sort(order.begin(), order.end(), [&](int64_t x, int64_t y) { return work(x) > work(y); });
  int64_t left = 0;
  for (int64_t b = 0; b < s.batch; ++b) left += work(b);
  int64_t alone = 0;  // order[0, alone) run by themselves
  while (alone < s.batch && (threads <= 1 || s.batch - alone < 2 * threads ||
                             work(order[alone]) * threads > left)) {
    left -= work(order[alone++]);
  }
  {
    at::AutoDispatchBelowADInplaceOrView guard;
    for (int64_t t = 0; t < alone; ++t) fn(order[t]);
  }
  run_tasks(s.batch - alone, [&](int64_t t) {
    at::AutoDispatchBelowADInplaceOrView guard;
    fn(order[alone + t]);
  });
}

int64_t seq_offset(const VarlenShape& s, int64_t b, bool bottom_right) {
  return bottom_right ? (s.ck[b + 1] - s.ck[b]) - (s.cq[b + 1] - s.cq[b]) : 0;
}

std::tuple<at::Tensor, at::Tensor> varlen_attention_fwd_cpu(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_q,
    const at::Tensor& cu_k, int64_t max_seqlen_q, int64_t max_seqlen_k, double scale,
    bool bottom_right, int64_t left, int64_t right, double dropout_p, int64_t seed) {
  const VarlenShape s = check_varlen(q, k, v, cu_q, cu_k);
  TORCH_CHECK(s.max_q <= max_seqlen_q && s.max_k <= max_seqlen_k,
              "max_seqlen_q / max_seqlen_k (", max_seqlen_q, ", ", max_seqlen_k,
              ") are below the longest sequences (", s.max_q, ", ", s.max_k, ")");
  TORCH_CHECK(left >= 0 && right >= 0, "left and right must be >= 0, got ", left, ", ", right);
  TORCH_CHECK(dropout_p >= 0 && dropout_p < 1, "dropout_p must be in [0, 1), got ", dropout_p);
  auto out = empty_tensor({q.size(0), s.H, s.Dv}, q.options());
  auto lse = empty_tensor({s.H, q.size(0)}, q.options().dtype(at::kFloat));
  static auto dense = c10::Dispatcher::singleton()
                          .findSchemaOrThrow("fastattn::attention_fwd", "")
                          .typed<std::tuple<at::Tensor, at::Tensor>(
                              const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const std::optional<at::Tensor>&, double, int64_t, int64_t, int64_t,
                              double, int64_t)>();
  for_sequences(s, [&](int64_t b) {
    const int64_t q0 = s.cq[b], lq = s.cq[b + 1] - q0, k0 = s.ck[b], lk = s.ck[b + 1] - k0;
    if (lq == 0) return;
    auto [o, l] = dense.call(seq_view(q, q0, lq), seq_view(k, k0, lk), seq_view(v, k0, lk),
                             std::nullopt, scale, seq_offset(s, b, bottom_right), left, right,
                             dropout_p, sequence_seed(seed, b, s.H));
    out.narrow(0, q0, lq).copy_(o[0].permute({1, 0, 2}));
    lse.narrow(1, q0, lq).copy_(l[0]);
  });
  return {out, lse};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_attention_bwd_cpu(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& cu_q, const at::Tensor& cu_k,
    int64_t max_seqlen_q, int64_t max_seqlen_k, double scale, bool bottom_right, int64_t left,
    int64_t right, double dropout_p, int64_t seed) {
  const VarlenShape s = check_varlen(q, k, v, cu_q, cu_k);
  check_shape(dout, {q.size(0), s.H, s.Dv}, "dout");
  check_shape(out, {q.size(0), s.H, s.Dv}, "out");
  check_shape(lse, {s.H, q.size(0)}, "lse");
  check_dtype(lse, at::kFloat, "lse");
  TORCH_CHECK(left >= 0 && right >= 0, "left and right must be >= 0, got ", left, ", ", right);
  TORCH_CHECK(dropout_p >= 0 && dropout_p < 1, "dropout_p must be in [0, 1), got ", dropout_p);
  const at::Tensor dout_t = dout.to(q.scalar_type());
  auto dq = empty_tensor(q.sizes(), q.options());
  auto dk = empty_tensor(k.sizes(), k.options());
  auto dv = empty_tensor(v.sizes(), v.options());
  static auto dense = c10::Dispatcher::singleton()
                          .findSchemaOrThrow("fastattn::attention_bwd", "")
                          .typed<std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor>(
                              const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const at::Tensor&, const at::Tensor&, const at::Tensor&,
                              const std::optional<at::Tensor>&, double, int64_t, int64_t, int64_t,
                              double, int64_t, bool)>();
  for_sequences(s, [&](int64_t b) {
    const int64_t q0 = s.cq[b], lq = s.cq[b + 1] - q0, k0 = s.ck[b], lk = s.ck[b + 1] - k0;
    if (lq == 0 || lk == 0) {  // no score: every gradient of the sequence is 0
      dq.narrow(0, q0, lq).zero_();
      dk.narrow(0, k0, lk).zero_();
      dv.narrow(0, k0, lk).zero_();
      return;
    }
    auto [gq, gk, gv, unused] = dense.call(
        seq_view(dout_t, q0, lq), seq_view(q, q0, lq), seq_view(k, k0, lk), seq_view(v, k0, lk),
        seq_view(out, q0, lq), lse.narrow(1, q0, lq).unsqueeze(0), std::nullopt, scale,
        seq_offset(s, b, bottom_right), left, right, dropout_p, sequence_seed(seed, b, s.H), false);
    dq.narrow(0, q0, lq).copy_(gq[0].permute({1, 0, 2}));
    dk.narrow(0, k0, lk).copy_(gk[0].permute({1, 0, 2}));
    dv.narrow(0, k0, lk).copy_(gv[0].permute({1, 0, 2}));
  });
  return {dq, dk, dv};
}

// ---------------------------------------------------------------------------------------------
// paged forward (split-KV decoding)

constexpr int64_t kPagedTile = 64;  // keys gathered (and converted) per step

// max(a, b), NaN when either is (std::max keeps its first argument against a NaN, which would
// drop a row's attended NaN score: the NaN rule of docs/numerics.md wants it in the output).
template <class A>
inline A nan_max(A a, A b) {
  return a != a || b != b ? a + b : std::max(a, b);
}

template <class T>
struct PagedArgs {
  using A = cpu::acc_t<T>;
  const T *Q, *K, *V;
  int64_t sq_b, sq_h, sq_m, sk_blk, sk_slot, sk_h, sv_blk, sv_slot, sv_h;
  int64_t B, H, Hkv, group, Lq, D, Dv, block_size, max_blocks, splits, chunk, rows;
  const int64_t* table;
  const int64_t* lens;
  bool bottom_right;
  int64_t left, right;
  A scale;
  A *pm, *pl, *po;  // partials per (b, kv head, split, row): max, sum, unnormalized O (Dv)
};

// S[jj] = q . k_jj for one row q (zero-padded to Dp, a multiple of W) and the keys jj < nv (a
// multiple of W), each key a row of Dp values at krow[jj]. W keys at a time: W dot products as
// W-lane partial sums (W independent FMA chains), folded into one vector of W scores by
// cpu::sum_each. (Keys as rows, as the cache holds them: transposing each 64-key tile into
// D x 64 instead took about two thirds of a decode step, measured at B8 L4096 D64.)
template <class V>
FASTATTN_INLINE void paged_scores(const typename V::value_type* q, int64_t Dp,
                                  const typename V::value_type* const* krow, int64_t nv,
                                  typename V::value_type* S) {
  using A = typename V::value_type;
  constexpr int W = V::size;
  for (int64_t jj = 0; jj < nv; jj += W) {
    V acc[W];
    for (int c = 0; c < W; ++c) acc[c] = V(A(0));
    for (int64_t d = 0; d < Dp; d += W) {
      const V qd = V::load(q + d);
      for (int c = 0; c < W; ++c) acc[c] = fma(qd, V::load(krow[jj + c] + d), acc[c]);
    }
    cpu::sum_each(acc).store(S + jj);
  }
}

// o[0, U * W) = alpha * o + sum_{lo <= jj <= hi} p[jj] * vrow[jj][0, U * W): U slices of the
// output row in registers across the keys, U independent FMA chains.
template <class V, int U>
FASTATTN_INLINE void paged_pv(typename V::value_type* o, typename V::value_type alpha,
                              const typename V::value_type* p, int64_t lo, int64_t hi,
                              const typename V::value_type* const* vrow, int64_t d) {
  constexpr int64_t W = V::size;
  V acc[U];
  for (int c = 0; c < U; ++c) acc[c] = V::load(o + c * W) * V(alpha);
  for (int64_t jj = lo; jj <= hi; ++jj) {
    const V pj(p[jj]);
    for (int c = 0; c < U; ++c) acc[c] = fma(pj, V::load(vrow[jj] + d + c * W), acc[c]);
  }
  for (int c = 0; c < U; ++c) acc[c].store(o + c * W);
}

// One (b, kv head, key split) task: the group's rows (query head g * group + r / Lq, query
// r % Lq) over the split's keys, kPagedTile at a time: a row pointer per key and value. float32
// / float64 rows whose length is a multiple of the vector width W are read in the cache itself;
// others are converted (16-bit) and zero-padded to Dp / Dvp in a per-task buffer. Scores of keys
// outside a row's band or past the tile are masked after the fact; the O update keeps each
// W-wide slice of O in a register across keys.
template <class V, class T>
FASTATTN_INLINE void paged_worker(const PagedArgs<T>& p, std::atomic<int64_t>& next) {
  using A = typename V::value_type;
  constexpr int W = V::size;
  const A ninf = -std::numeric_limits<A>::infinity();
  const int64_t Dp = cpu::round_up(p.D, W), Dvp = cpu::round_up(p.Dv, W), TK = kPagedTile;
  static_assert(kPagedTile % 16 == 0, "whole vectors of keys");
  constexpr bool kAcc = std::is_same_v<T, A>;
  const bool k_in_place = kAcc && p.D == Dp, v_in_place = kAcc && p.Dv == Dvp;
  std::vector<A> qbuf(p.rows * Dp, A(0)), kbuf(k_in_place ? 0 : TK * Dp, A(0));
  std::vector<A> vbuf(v_in_place ? 0 : TK * Dvp, A(0));
  std::vector<const A*> krow(TK), vrow(TK);
  std::vector<A> acc(p.rows * Dvp), m(p.rows), l(p.rows), scores(p.rows * TK);
  const int64_t ntasks = p.B * p.Hkv * p.splits;
  for (int64_t t = next++; t < ntasks; t = next++) {
    const int64_t sp = t % p.splits, g = (t / p.splits) % p.Hkv, b = t / (p.splits * p.Hkv);
    const int64_t lk = p.lens[b], j_begin = sp * p.chunk, j_end = std::min(lk, j_begin + p.chunk);
    for (int64_t r = 0; r < p.rows; ++r) {
      const int64_t h = g * p.group + r / p.Lq, i = r % p.Lq;
      const T* qi = p.Q + b * p.sq_b + h * p.sq_h + i * p.sq_m;
      for (int64_t d = 0; d < p.D; ++d) qbuf[r * Dp + d] = cpu::to_acc<A>(qi[d]) * p.scale;
    }
    std::fill(acc.begin(), acc.end(), A(0));
    std::fill(m.begin(), m.end(), ninf);
    std::fill(l.begin(), l.end(), A(0));
    for (int64_t j0 = j_begin; j0 < j_end; j0 += TK) {
      const int64_t n = std::min(TK, j_end - j0);
      // (block and slot stepped along, not divided out per key: two 64-bit divisions a key were
      // most of a float32 decode step that the cache's bandwidth should bound)
      int64_t entry = j0 / p.block_size, slot = j0 % p.block_size;
      for (int64_t jj = 0; jj < n; ++jj, ++slot) {
        if (slot == p.block_size) {
          slot = 0;
          ++entry;
        }
        const int64_t blk = p.table[b * p.max_blocks + entry];
        const T* kj = p.K + blk * p.sk_blk + slot * p.sk_slot + g * p.sk_h;
        const T* vj = p.V + blk * p.sv_blk + slot * p.sv_slot + g * p.sv_h;
        if constexpr (kAcc) {
          if (k_in_place) krow[jj] = kj;
          if (v_in_place) vrow[jj] = vj;
        }
        if (!k_in_place) {
          cpu::convert_to_acc(kj, kbuf.data() + jj * Dp, p.D);
          krow[jj] = kbuf.data() + jj * Dp;
        }
        if (!v_in_place) {
          cpu::convert_to_acc(vj, vbuf.data() + jj * Dvp, p.Dv);
          vrow[jj] = vbuf.data() + jj * Dvp;
        }
      }
      const int64_t nv = cpu::round_up(n, W);  // whole vectors; keys past n are masked below
      for (int64_t jj = n; jj < nv; ++jj) krow[jj] = krow[0];
      for (int64_t r = 0; r < p.rows; ++r) {
        paged_scores<V>(qbuf.data() + r * Dp, Dp, krow.data(), nv, scores.data() + r * TK);
      }
      for (int64_t r = 0; r < p.rows; ++r) {
        const RowBand band = row_band(r % p.Lq, p.Lq, lk, p.bottom_right, p.left, p.right);
        const int64_t lo = std::max(band.lo, j0) - j0, hi = std::min(band.hi, j0 + n - 1) - j0;
        if (lo > hi) continue;
        A* sc = scores.data() + r * TK;
        A mt = ninf;
        for (int64_t jj = lo; jj <= hi; ++jj) mt = nan_max(mt, sc[jj]);
        const A m_new = nan_max(m[r], mt);
        const A alpha = m[r] == ninf ? A(0) : cpu::sexp(m[r] - m_new);
        A sum = 0;
        for (int64_t jj = 0; jj < nv; jj += W) {
          V e = cpu::vexp_shifted(V::load(sc + jj) - V(m_new));
          e.store(sc + jj);
        }
        for (int64_t jj = 0; jj < lo; ++jj) sc[jj] = A(0);
        for (int64_t jj = hi + 1; jj < nv; ++jj) sc[jj] = A(0);
        for (int64_t jj = lo; jj <= hi; ++jj) sum += sc[jj];
        A* o = acc.data() + r * Dvp;
        int64_t d = 0;
        for (; d + 8 * W <= Dvp; d += 8 * W) paged_pv<V, 8>(o + d, alpha, sc, lo, hi, vrow.data(), d);
        for (; d + 4 * W <= Dvp; d += 4 * W) paged_pv<V, 4>(o + d, alpha, sc, lo, hi, vrow.data(), d);
        for (; d < Dvp; d += W) paged_pv<V, 1>(o + d, alpha, sc, lo, hi, vrow.data(), d);
        l[r] = l[r] * alpha + sum;
        m[r] = m_new;
      }
    }
    for (int64_t r = 0; r < p.rows; ++r) {
      p.pm[t * p.rows + r] = m[r];
      p.pl[t * p.rows + r] = l[r];
      std::copy(acc.data() + r * Dvp, acc.data() + r * Dvp + p.Dv, p.po + (t * p.rows + r) * p.Dv);
    }
  }
}

// The paged worker for the ISA trampoline (cpu::isa_dispatch).
template <class T>
struct PagedKernel {
  template <int kBytes>
  FASTATTN_INLINE static void run(const PagedArgs<T>& p, std::atomic<int64_t>& next) {
    paged_worker<cpu::Vec<cpu::acc_t<T>, kBytes / sizeof(cpu::acc_t<T>)>, T>(p, next);
  }
};

template <class T>
void paged_fwd_impl(const at::Tensor& q, const at::Tensor& kc, const at::Tensor& vc,
                    const std::vector<int64_t>& table, int64_t max_blocks,
                    const std::vector<int64_t>& lens, at::Tensor& out, at::Tensor& lse,
                    double scale, bool bottom_right, int64_t left, int64_t right) {
  using A = cpu::acc_t<T>;
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), D = q.size(3);
  const int64_t bs = kc.size(1), Hkv = kc.size(2), Dv = vc.size(3), group = H / Hkv;
  const int64_t max_len = lens.empty() ? 0 : *std::max_element(lens.begin(), lens.end());
  const int64_t want = 4 * at::get_num_threads();
  const int64_t splits = std::max<int64_t>(
      1, std::min((want + B * Hkv - 1) / std::max<int64_t>(B * Hkv, 1),
                  (max_len + kMinSplit - 1) / kMinSplit));
  const int64_t chunk = std::max<int64_t>(1, (max_len + splits - 1) / splits);
  const int64_t rows = group * Lq;
  std::vector<A> pm(B * Hkv * splits * rows), pl(pm.size()), po(pm.size() * Dv);
  const PagedArgs<T> p{q.data_ptr<T>(), kc.data_ptr<T>(), vc.data_ptr<T>(),
                       q.stride(0), q.stride(1), q.stride(2),
                       kc.stride(0), kc.stride(1), kc.stride(2),
                       vc.stride(0), vc.stride(1), vc.stride(2),
                       B, H, Hkv, group, Lq, D, Dv, bs, max_blocks, splits, chunk, rows,
                       table.data(), lens.data(), bottom_right, left, right, static_cast<A>(scale),
                       pm.data(), pl.data(), po.data()};
  std::atomic<int64_t> next{0};
  const int64_t workers = std::max<int64_t>(1, std::min<int64_t>(at::get_num_threads(), B * Hkv * splits));
  at::parallel_for(0, workers, 1, [&](int64_t, int64_t) {
    cpu::isa_dispatch<PagedKernel<T>>(p, next);
  });

  // Merge the splits: M = max_s m_s, l = sum_s l_s exp(m_s - M), O = sum_s O_s exp(m_s - M) / l.
  T* O = out.data_ptr<T>();
  float* Lse = lse.data_ptr<float>();
  at::parallel_for(0, B * H * Lq, 16, [&](int64_t begin, int64_t end) {
    std::vector<A> acc(Dv);
    for (int64_t x = begin; x < end; ++x) {
      const int64_t i = x % Lq, h = (x / Lq) % H, b = x / (Lq * H);
      const int64_t g = h / group, r = (h % group) * Lq + i;
      A M = -std::numeric_limits<A>::infinity();
      for (int64_t sp = 0; sp < splits; ++sp)
        M = nan_max(M, pm[((b * Hkv + g) * splits + sp) * rows + r]);
      std::fill(acc.begin(), acc.end(), A(0));
      A l = 0;
      if (M != -std::numeric_limits<A>::infinity()) {
        for (int64_t sp = 0; sp < splits; ++sp) {
          const int64_t idx = ((b * Hkv + g) * splits + sp) * rows + r;
          if (pl[idx] == A(0)) continue;
          const A w = std::exp(pm[idx] - M);
          l += pl[idx] * w;
          for (int64_t d = 0; d < Dv; ++d) acc[d] += po[idx * Dv + d] * w;
        }
      }
      T* oi = O + b * out.stride(0) + h * out.stride(1) + i * out.stride(2);
      const bool live = !(l == A(0));  // a NaN l is a NaN row (an attended NaN), not an empty one
      for (int64_t d = 0; d < Dv; ++d) oi[d] = static_cast<T>(live ? acc[d] / l : A(0));
      Lse[x] = live ? static_cast<float>(M + std::log(l)) : -std::numeric_limits<float>::infinity();
    }
  });
}

std::tuple<at::Tensor, at::Tensor> paged_attention_fwd_cpu(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& block_table, const at::Tensor& cache_seqlens, double scale,
    bool bottom_right, int64_t left, int64_t right) {
  TORCH_CHECK(q.dim() == 4, "q must be 4-D (B, H, Lq, D), got ", q.sizes());
  TORCH_CHECK(k_cache.dim() == 4 && v_cache.dim() == 4,
              "k_cache and v_cache must be 4-D (num_blocks, block_size, Hkv, D), got ",
              k_cache.sizes(), " and ", v_cache.sizes());
  check_float_dtype(q, "q", true);
  TORCH_CHECK(k_cache.scalar_type() == q.scalar_type() && v_cache.scalar_type() == q.scalar_type(),
              "k_cache and v_cache must have q's dtype");
  TORCH_CHECK(k_cache.sizes().slice(0, 3) == v_cache.sizes().slice(0, 3),
              "k_cache and v_cache shapes differ: ", k_cache.sizes(), ", ", v_cache.sizes());
  TORCH_CHECK(k_cache.size(3) == q.size(3), "q and k_cache head dims differ");
  TORCH_CHECK(k_cache.size(2) > 0 && q.size(1) % k_cache.size(2) == 0,
              "query heads must be a multiple of the caches' kv heads");
  TORCH_CHECK(k_cache.size(1) > 0, "block_size must be >= 1");
  check_last_dim(q, "q");
  check_last_dim(k_cache, "k_cache");
  check_last_dim(v_cache, "v_cache");
  const int64_t B = q.size(0);
  check_dtype(block_table, at::kInt, "block_table");
  check_dtype(cache_seqlens, at::kInt, "cache_seqlens");
  TORCH_CHECK(block_table.dim() == 2 && block_table.size(0) == B, "block_table must be (B, max_blocks), got ",
              block_table.sizes());
  check_shape(cache_seqlens, {B}, "cache_seqlens");
  TORCH_CHECK(left >= 0 && right >= 0, "left and right must be >= 0");
  const int64_t max_blocks = block_table.size(1), bs = k_cache.size(1), nblocks = k_cache.size(0);
  const auto tc = block_table.contiguous();
  const auto lc = cache_seqlens.contiguous();
  std::vector<int64_t> table(tc.data_ptr<int32_t>(), tc.data_ptr<int32_t>() + tc.numel());
  std::vector<int64_t> lens(lc.data_ptr<int32_t>(), lc.data_ptr<int32_t>() + B);
  // The rule of fastattn.paged_attention (fastattn/ops/varlen.py, _check_paged), which leaves
  // the values to this op on the cpu backend: every entry a block or -1; a row owns its entries
  // up to the first -1; its length fits in them.
  for (int64_t b = 0; b < B; ++b) {
    int64_t owned = 0;
    bool prefix = true;
    for (int64_t s = 0; s < max_blocks; ++s) {
      const int64_t e = table[b * max_blocks + s];
      TORCH_CHECK_VALUE(e >= -1 && e < nblocks, "block_table[", b, ", ", s, "] = ", e,
                        " is not a block of the caches (0 <= index < num_blocks = ", nblocks,
                        ", or -1 for no block)");
      prefix = prefix && e >= 0;
      owned += prefix;
    }
    TORCH_CHECK_VALUE(lens[b] >= 0, "cache_seqlens must be >= 0, got cache_seqlens[", b, "] = ",
                      lens[b]);
    TORCH_CHECK_VALUE(lens[b] <= owned * bs, "cache_seqlens[", b, "] = ", lens[b], " exceeds the ",
                      owned * bs, " positions of the blocks row ", b, " of block_table owns (block_size ",
                      bs, ")");
  }
  auto out = empty_tensor({B, q.size(1), q.size(2), v_cache.size(3)}, q.options());
  auto lse = empty_tensor({B, q.size(1), q.size(2)}, q.options().dtype(at::kFloat));
  if (out.numel() == 0 && lse.numel() == 0) return {out, lse};
  FASTATTN_DISPATCH_FLOATING_HALF_BF16(q.scalar_type(), "paged_attention_fwd", [&] {
    paged_fwd_impl<scalar_t>(q, k_cache, v_cache, table, max_blocks, lens, out, lse, scale,
                             bottom_right, left, right);
  });
  return {out, lse};
}

}  // namespace

namespace cpu {

// Declared in csrc/cpu/attention_common.h: k and v (B, Hkv, Lk, D) viewed as a cache of B blocks
// of Lk slots, (B, Lk, Hkv, D), with block_table row b = [b] and every length Lk.
void dense_decode_fwd(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, double scale,
                      bool bottom_right, int64_t left, int64_t right, at::Tensor& out,
                      at::Tensor& lse) {
  const int64_t B = q.size(0);
  std::vector<int64_t> table(B), lens(B, k.size(2));
  std::iota(table.begin(), table.end(), int64_t{0});
  FASTATTN_DISPATCH_FLOATING_HALF_BF16(q.scalar_type(), "attention_fwd_decode", [&] {
    paged_fwd_impl<scalar_t>(q, k.permute({0, 2, 1, 3}), v.permute({0, 2, 1, 3}), table, 1, lens,
                             out, lse, scale, bottom_right, left, right);
  });
}

}  // namespace cpu

TORCH_LIBRARY_IMPL(fastattn, CPU, m) {
  m.impl("varlen_attention_fwd", &varlen_attention_fwd_cpu);
  m.impl("varlen_attention_bwd", &varlen_attention_bwd_cpu);
  m.impl("paged_attention_fwd", &paged_attention_fwd_cpu);
}

}  // namespace fastattn
