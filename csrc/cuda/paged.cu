// Attention over a paged KV cache, forward (CUDA backend): fastattn::paged_attention_fwd
// (decoding: a few new queries against a long cache; vLLM / flash_attn_with_kvcache layout).
//
// Math, per batch row b, query head h (kv head hk = h / (H / Hkv)) and query i < Lq, over the
// keys t < Lk_b = cache_seqlens[b], key t at block block_table[b, t / bs], slot t % bs:
//
//     S_it  = scale * q_i . k_t       for t visible to i: i + offset - left <= t <= i + offset + right,
//                                     offset = Lk_b - Lq when bottom-right, else 0
//     lse_i = log sum_t exp(S_it)     (-inf when nothing is visible)
//     out_i = sum_t exp(S_it - lse_i) v_t    (0 when nothing is visible)
//
// Forward only; no mask, no dropout (the schema has neither).
//
// Work split (flash-decoding): one CTA of kWarps warps per (key split, b, kv head, row group).
// The rows of a kv head are its GQA group's query rows r = (h - hk * group) * Lq + i; a row group
// is up to RB of them (RB = 4 or 8, a template parameter: 4 when the group's rows fit, else 8 and
// as many row groups as needed; an MHA decode's one row runs at RB 4 with three rows dead: their
// FMAs leave the kernel read-bound, and an RB 1 instance set cost 12 s of nvcc a build). Every
// warp of the CTA serves all RB rows, and the warps split the keys: warp w takes the 32-key
// chunks w, w + kWarps, ... of the CTA's range, so each K and V row is read from memory once for
// all the rows that attend it (session 33's kernel gave a warp a row: the warps of a CTA read the
// same rows, and an MHA decode ran one warp a CTA). Per chunk, in a warp:
//   - lane l copies key t0 + l's K row, then its V row, to the warp's shared memory with
//     cp.async (two groups; up to 32 whole rows of each in flight a warp, where a lane of the
//     old kernel held 12 K loads and 64 B of V); its table entry was read a chunk ahead;
//   - as soon as its K row lands, lane l scores its key against the RB rows (q in shared
//     memory: broadcasts), while the V rows keep coming;
//   - the rows' running maxima are warp-wide (a NaN kept); each lane keeps its own partial sums
//     l (rescaled by the same factor as the row's), added over the warp once at the end;
//   - P V: lane l owns the DP / 32 consecutive columns from l * DP / 32, one 4-16 byte shared
//     read of each key's V row. A key some rows attend and others not (the last Lq keys of a
//     causal multi-token step, a window's edge) is added to the rows whose bit it has, never as
//     0 * v: a NaN in its V row must not reach a row that does not attend it.
// The warps' states (m, l, acc) are merged through shared memory at the end.
// Splits: enough CTAs for about two per SM when B * Hkv is small and the cache long (at least
// 512 keys a split, 128 a warp); FASTATTN_CUDA_PAGED_SPLITS=n forces n (tests). One split
// writes out and lse directly; several write their normalized out and lse to a float32
// workspace, which paged_merge_kernel merges by lse (a split that saw nothing has lse -inf and
// weight 0).
//
// Precision: q . k, the softmax and P V in float32; out rounded to the input dtype, lse float32.
// NaN rule (docs/numerics.md): a key no row of the CTA attends is never read, and one that some
// rows attend reaches only those (a select for the score, the row bits for P V), so a NaN or inf
// held at a key a row does not attend never reaches it; an attended one propagates as IEEE
// arithmetic says.
// Scalar arithmetic on the CUDA cores, no tensor cores: decoding is bound by reading the cache.
//
// Limits: float16 / bfloat16; head dims up to 256 (D and Dv independently); any block size;
// q with a unit last stride, caches with unit last strides and any others. The public function
// checks block_table and cache_seqlens (one device-to-host copy); here an entry out of range
// leaves its key unattended, and a length beyond the row's blocks leaves the row empty: never an
// out-of-bounds access.
#include "fastattn/cuda_helpers.cuh"  // first: it prepares the c10/cuda includes

#include <algorithm>
#include <cstdlib>
#include <tuple>
#include <type_traits>

#include "fastattn/common.h"
#include "fastattn/cuda_layout.cuh"
#include "fastattn/cuda_mma.cuh"

namespace fastattn {
namespace cuda {
namespace {

using namespace ::fastattn::cuda_helpers;

constexpr int kWarps = 4;
constexpr int kMaxHeadDim = 256;
constexpr int kMaxRows = 8;  // rows a CTA serves at once (RB)
// At least 128 keys a warp in a split: the warps of a CTA split its keys.
constexpr int kMinSplitKeys = 512;
// CTAs an SM must hold, the register bound given to ptxas: 3 (168 registers) up to head dim 128,
// as many as shared memory holds at 128 (PagedSmem: ~70 KiB; ~36 at 64, where 4 CTAs' 128
// registers spilled); 1 at 256 (~140 KiB). Without a bound, ptxas kept 96 registers and spilled
// a few bytes at some instances; with room for 2 CTAs it took 200-254.
template <int DP>
constexpr int kMinCtas = DP <= 128 ? 3 : 1;

struct PagedParams {
  const uint16_t* q;  // (B, H, Lq, D)
  int64_t q_sb, q_sh, q_sl;
  const uint16_t* k;  // (num_blocks, bs, Hkv, D)
  const uint16_t* v;  // (num_blocks, bs, Hkv, Dv)
  int64_t k_sblk, k_sslot, k_sh;
  int64_t v_sblk, v_sslot, v_sh;
  // K and V rows 16-byte aligned, D and Dv multiples of 8: rows are copied by cp.async
  bool async;
  const int* table;  // (B, max_blocks)
  int64_t table_sb;
  const int* seqlens;  // (B,)
  int B, H, Hkv, group, Lq, D, Dv, bs, max_blocks, num_blocks;
  int row_groups;  // ceil(group * Lq / RB)
  bool bottom_right;
  int left, right;  // clamped to Lq + max_blocks * bs + 1
  float scale;
  int splits, split_len;  // keys per split
  // One split: out (B, H, Lq, Dv) and lse (B, H, Lq), contiguous. Several: ws_out (splits, B,
  // H, Lq, Dv) and ws_lse (splits, B, H, Lq), float32, contiguous.
  uint16_t* out;
  float* lse;
  float* ws_out;
  float* ws_lse;
};

// Shared memory, in 4-byte words. The key loop: the rows' q (RB x DP floats, 0 past D and for
// rows past the group), their visible key ranges [beg, end), then for each warp (16-byte
// aligned) its chunk's 32 K rows and 32 V rows (DP 16-bit elements each, 16-byte pieces
// swizzled: piece c of key j's row at c ^ (j % 8), so that the 8 lanes of a quarter warp reading
// piece c of their own rows, or one row's consecutive pieces, hit distinct banks), the p of each
// key and row (32 x RB), each key's block (-1: no row attends it) and row bits. The merge, after
// a barrier, reuses it from the start: each warp's acc (RB x DP), m and l, then the weight of
// each warp's state in each row's output.
template <int DP, int RB>
struct PagedSmem {
  static constexpr int Q = 0, BEG = RB * DP, END = BEG + RB, WARPS = (END + RB + 3) / 4 * 4;
  static constexpr int KROWS = 0, VROWS = 16 * DP, P = 32 * DP, BLK = P + 32 * RB,
                       BITS = BLK + 32, WARP = BITS + 32;
  static constexpr int ACC = 0, M = kWarps * RB * DP, L = M + kWarps * RB, W = L + kWarps * RB;
  static constexpr int LOOP_WORDS = WARPS + kWarps * WARP, MERGE_WORDS = W + kWarps * RB;
  static constexpr int BYTES = 4 * (LOOP_WORDS > MERGE_WORDS ? LOOP_WORDS : MERGE_WORDS);
};

// Element offset of column d in row j of a warp's K or V rows (the swizzle above).
template <int DP>
__device__ __forceinline__ int row_elem(int j, int d) {
  return cuda_layout::Swizzled<DP>::offset(j, d);
}

// Copies the first n (D or Dv) elements of the cache row `src` to row j of `dst`: cp.async of
// 16-byte pieces when p.async (the pieces past n are not written: readers test d < n), else
// element loads and 16-byte stores, zeros past n.
template <int DP>
__device__ __forceinline__ void copy_row(const PagedParams& p, uint16_t* dst, int j,
                                         const uint16_t* src, int n) {
  if (p.async) {
#pragma unroll
    for (int d = 0; d < DP; d += 8) {
      if (d < n) cp_async_16(dst + row_elem<DP>(j, d), src + d);
    }
  } else {
    for (int d = 0; d < DP; d += 8) {
      Vec<uint16_t, 8> x;
#pragma unroll
      for (int e = 0; e < 8; ++e) x.v[e] = d + e < n ? src[d + e] : uint16_t{0};
      st_shared(dst + row_elem<DP>(j, d), x);
    }
  }
}

// RB floats from shared memory (float4 loads when RB is a multiple of 4).
template <int RB>
__device__ __forceinline__ void ld_shared_rows(const float* src, float (&x)[RB]) {
  if constexpr (RB % 4 == 0) {
#pragma unroll
    for (int r = 0; r < RB; r += 4) {
      const float4 f = ld_shared<float4>(src + r);
      x[r] = f.x, x[r + 1] = f.y, x[r + 2] = f.z, x[r + 3] = f.w;
    }
  } else {
#pragma unroll
    for (int r = 0; r < RB; ++r) x[r] = ld_shared<float>(src + r);
  }
}

// s[r] = q_r . k for row `lane` of the warp's K rows and the RB rows of q (0 past D). Pieces
// past D are not read (a cp.async never wrote them). The RB >= 4 rows are independent chains of
// FMAs.
template <typename M16, int DP, int RB>
__device__ __forceinline__ void dot_q_k(const PagedParams& p, const float* sq, const uint16_t* sk,
                                        int lane, float (&s)[RB]) {
  static_assert(RB >= 4, "one accumulator a row: fewer rows would need partial sums");
#pragma unroll
  for (int r = 0; r < RB; ++r) s[r] = 0.f;
  // (unrolled up to 128 columns: at DP 256, ptxas unrolling all 32 pieces took 255 registers
  // and spilled)
#pragma unroll 16
  for (int d = 0; d < DP; d += 8) {
    const uint4 w = d < p.D ? ld_shared<uint4>(sk + row_elem<DP>(lane, d)) : make_uint4(0, 0, 0, 0);
    const uint32_t words[4] = {w.x, w.y, w.z, w.w};
    float kf[8];
#pragma unroll
    for (int e = 0; e < 8; ++e) {
      kf[e] = M16::to_float(static_cast<uint16_t>(words[e / 2] >> (16 * (e % 2))));
    }
#pragma unroll
    for (int r = 0; r < RB; ++r) {
      const float4 qa = ld_shared<float4>(sq + r * DP + d);
      const float4 qb = ld_shared<float4>(sq + r * DP + d + 4);
      const float qs[8] = {qa.x, qa.y, qa.z, qa.w, qb.x, qb.y, qb.z, qb.w};
#pragma unroll
      for (int e = 0; e < 8; ++e) s[r] += qs[e] * kf[e];
    }
  }
}

// Lane's key t of its chunk: its block in the cache (-1 past the rows' keys, or an entry out of
// range) and slot, and which of the RB rows attend it (bits; 0 when the block is -1).
struct KeyRef {
  int blk, slot;
  unsigned bits;
};

// (The rows' ranges are read from shared memory, not kept in 2 x RB registers.)
template <int RB>
__device__ __forceinline__ KeyRef key_ref(const PagedParams& p, const int* table, int t,
                                          const int* sbeg, const int* send) {
  KeyRef kr{-1, 0, 0u};
#pragma unroll
  for (int r = 0; r < RB; ++r) {
    kr.bits |= unsigned{t >= ld_shared<int>(sbeg + r) && t < ld_shared<int>(send + r)} << r;
  }
  if (kr.bits != 0) {
    const int idx = t / p.bs;
    kr.slot = t - idx * p.bs;
    kr.blk = table[idx];
    if (kr.blk < 0 || kr.blk >= p.num_blocks) kr.blk = -1, kr.bits = 0;
  }
  return kr;
}

template <typename T, int DP, int RB>
__global__ void __launch_bounds__(kWarps * 32, kMinCtas<DP>) paged_fwd_kernel(const PagedParams p) {
  using M16 = Mma16<T>;
  using S = PagedSmem<DP, RB>;
  constexpr int VEC = DP / 32;  // V columns a lane owns: c0 = lane * VEC, ..., c0 + VEC - 1
  FASTATTN_DYNAMIC_SMEM(float, smem);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float* sq = smem + S::Q;
  int* sbeg = reinterpret_cast<int*>(smem + S::BEG);
  int* send = reinterpret_cast<int*>(smem + S::END);
  float* sw = smem + S::WARPS + warp * S::WARP;
  uint16_t* sk = reinterpret_cast<uint16_t*>(sw + S::KROWS);
  uint16_t* sv = reinterpret_cast<uint16_t*>(sw + S::VROWS);
  float* sp = sw + S::P;
  int* sblk = reinterpret_cast<int*>(sw + S::BLK);
  int* sbits = reinterpret_cast<int*>(sw + S::BITS);

  // (32-bit divisions: a 64-bit one is a subroutine call, and ptxas spilled around it)
  const int split = static_cast<int>(blockIdx.x) % p.splits;
  const int rest = static_cast<int>(blockIdx.x) / p.splits;
  const int r0 = rest % p.row_groups * RB;
  const int bhk = rest / p.row_groups;
  const int b = bhk / p.Hkv, hk = bhk % p.Hkv;
  const int nr = min(RB, p.group * p.Lq - r0);  // rows of this group
  int Lk = p.seqlens[b];
  if (Lk < 0 || Lk > p.max_blocks * p.bs) Lk = 0;  // refused by the public function
  const int offset = p.bottom_right ? Lk - p.Lq : 0;
  const int t_split = split * p.split_len;
  const int t_split_end = min(Lk, t_split + p.split_len);
  const int* table = p.table + b * p.table_sb;
  const uint16_t* k_head = p.k + hk * p.k_sh;
  const uint16_t* v_head = p.v + hk * p.v_sh;

  // The rows' q and visible ranges (within the split; empty for rows past the group).
  for (int x = threadIdx.x; x < RB * DP; x += kWarps * 32) {
    const int r = x / DP, d = x % DP, row = r0 + r;
    const uint16_t* q =
        p.q + b * p.q_sb + (hk * p.group + row / p.Lq) * p.q_sh + row % p.Lq * p.q_sl;
    st_shared(sq + x, r < nr && d < p.D ? M16::to_float(q[d]) : 0.f);
  }
  if (threadIdx.x < RB) {
    const int r = threadIdx.x, i = (r0 + r) % p.Lq;
    const bool live = r < nr;
    st_shared(sbeg + r, live ? max(t_split, i + offset - p.left) : 0);
    st_shared(send + r, live ? min(t_split_end, i + offset + p.right + 1) : 0);
  }
  __syncthreads();
  int t_lo = t_split_end, t_hi = t_split;  // the union of the rows' ranges
#pragma unroll
  for (int r = 0; r < RB; ++r) {
    const int beg = ld_shared<int>(sbeg + r), end = ld_shared<int>(send + r);
    if (beg < end) t_lo = min(t_lo, beg), t_hi = max(t_hi, end);
  }
  const unsigned alive = (1u << nr) - 1;

  float m[RB], l[RB], acc[RB][VEC] = {};  // l: this lane's part of the row sum
#pragma unroll
  for (int r = 0; r < RB; ++r) m[r] = -INFINITY, l[r] = 0.f;
  const int c0 = lane * VEC;
  // The next chunk's key (its table entry read a chunk ahead: the copies wait on it).
  KeyRef next = key_ref<RB>(p, table, t_lo + 32 * warp + lane, sbeg, send);
  for (int t0 = t_lo + 32 * warp; t0 < t_hi; t0 += 32 * kWarps) {
    const KeyRef key = next;
    next = key_ref<RB>(p, table, t0 + 32 * kWarps + lane, sbeg, send);
    // Lane l copies key t0 + l's K row (one group) and V row (a second group): a lane scores its
    // own key as soon as its K row lands, while the V rows keep coming.
    if (key.blk >= 0) {
      copy_row<DP>(p, sk, lane, k_head + key.blk * p.k_sblk + key.slot * p.k_sslot, p.D);
    }
    cp_async_commit();
    if (key.blk >= 0) {
      copy_row<DP>(p, sv, lane, v_head + key.blk * p.v_sblk + key.slot * p.v_sslot, p.Dv);
    }
    cp_async_commit();
    cp_async_wait<1>();
    float s[RB];
    if (key.blk >= 0) dot_q_k<M16, DP, RB>(p, sq, sk, lane, s);  // (else no row attends it)
#pragma unroll
    for (int r = 0; r < RB; ++r) {
      // (a select, not a product: a NaN in a K row row r does not attend stays out of its score)
      const bool att = (key.bits >> r) & 1u;
      const float sr = att ? s[r] * p.scale : -INFINITY;
      const float m_new = max_nan(m[r], warp_max_nan(sr));
      const float m_safe = m_new == -INFINITY ? 0.f : m_new;
      const float alpha = expf(m[r] - m_safe);  // 0 while the row was empty
      const float pr = att ? expf(sr - m_safe) : 0.f;
      l[r] = l[r] * alpha + pr;
      m[r] = m_new;
#pragma unroll
      for (int e = 0; e < VEC; ++e) acc[r][e] *= alpha;
      st_shared(sp + lane * RB + r, pr);
    }
    st_shared(sblk + lane, key.blk);
    st_shared(sbits + lane, static_cast<int>(key.bits));
    // Whether every key read is attended by every row of the group: then P V needs no row bits.
    const bool whole = !__any_sync(0xffffffffu, key.blk >= 0 && key.bits != alive);
    cp_async_wait<0>();
    __syncwarp();  // (every lane's V row and p are in)
    // P V: a key some rows do not attend adds only to the rows whose bit it has (never 0 * v);
    // a key no row attends (block -1) is not read: its V row in shared memory is stale.
    const int n = min(32, t_hi - t0);
    auto pv = [&](auto all_rows) {
      // (4 keys unrolled, their shared-memory loads together; at RB 8, ptxas then spilled)
#pragma unroll(RB < 8 ? 4 : 1)
      for (int j = 0; j < n; ++j) {
        const int bj = ld_shared<int>(sblk + j);
        Vec<uint16_t, VEC> raw{};
        if (bj >= 0 && c0 < p.Dv) raw = ld_shared<Vec<uint16_t, VEC>>(sv + row_elem<DP>(j, c0));
        float pj[RB];
        ld_shared_rows<RB>(sp + j * RB, pj);
        const unsigned bits = decltype(all_rows)::value ? alive : ld_shared<int>(sbits + j);
#pragma unroll
        for (int e = 0; e < VEC; ++e) {
          const float ve = M16::to_float(raw.v[e]);
#pragma unroll
          for (int r = 0; r < RB; ++r) {
            if (decltype(all_rows)::value || ((bits >> r) & 1u)) acc[r][e] += pj[r] * ve;
          }
        }
      }
    };
    if (whole) {
      pv(std::true_type{});
    } else {
      pv(std::false_type{});
    }
    // Every lane has read this chunk's rows, p, blocks and bits before the next chunk's copies
    // and stores overwrite them.
    __syncwarp();
  }

  // Merge the warps' states: each writes m, l (summed over its lanes) and acc; thread r < RB
  // then weighs each warp's state in row r (exp(m_w - M) / L; a warp that saw nothing weighs 0,
  // an empty row gets 0 and lse -inf, a NaN propagates) and writes the lse; all threads then
  // write the rows' out.
#pragma unroll
  for (int r = 0; r < RB; ++r) l[r] = warp_sum(l[r]);
  __syncthreads();  // (the key loop's shared memory is free)
#pragma unroll
  for (int r = 0; r < RB; ++r) {
    float* dst = smem + S::ACC + (warp * RB + r) * DP + c0;
#pragma unroll
    for (int e = 0; e < VEC; ++e) st_shared(dst + e, acc[r][e]);
    if (lane == 0) {
      st_shared(smem + S::M + warp * RB + r, m[r]);
      st_shared(smem + S::L + warp * RB + r, l[r]);
    }
  }
  __syncthreads();
  const int64_t rows = int64_t{p.B} * p.H * p.Lq;
  auto out_row = [&](int r) {
    const int row = r0 + r;
    return (int64_t{b} * p.H + hk * p.group + row / p.Lq) * p.Lq + row % p.Lq;
  };
  if (threadIdx.x < nr) {
    const int r = threadIdx.x;
    float mw[kWarps], mx = -INFINITY;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      mw[w] = ld_shared<float>(smem + S::M + w * RB + r);
      mx = max_nan(mx, mw[w]);
    }
    const float m_safe = mx == -INFINITY ? 0.f : mx;
    float ew[kWarps], sum = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      ew[w] = expf(mw[w] - m_safe);
      sum += ew[w] * ld_shared<float>(smem + S::L + w * RB + r);
    }
    const bool empty = sum == 0.f;
    // (__fdividef: an IEEE division has a slow path called as a subroutine, and ptxas spilled
    // around the call; the sum is at most 2^30 terms <= 1, far from its 2^126 limit)
    const float inv = empty ? 0.f : __fdividef(1.f, sum);
#pragma unroll
    for (int w = 0; w < kWarps; ++w) st_shared(smem + S::W + w * RB + r, ew[w] * inv);
    const float lse = empty ? -INFINITY : mx + logf(sum);
    if (p.splits == 1) {
      p.lse[out_row(r)] = lse;
    } else {
      p.ws_lse[split * rows + out_row(r)] = lse;
    }
  }
  __syncthreads();
  for (int x = threadIdx.x; x < nr * p.Dv; x += kWarps * 32) {
    const int r = x / p.Dv, d = x % p.Dv;
    float o = 0.f;
#pragma unroll
    for (int w = 0; w < kWarps; ++w) {
      // (an empty warp's acc is 0 and its weight 0; a skipped product would hide a NaN)
      o += ld_shared<float>(smem + S::W + w * RB + r) *
           ld_shared<float>(smem + S::ACC + (w * RB + r) * DP + d);
    }
    if (p.splits == 1) {
      p.out[out_row(r) * p.Dv + d] = M16::from_float(o);
    } else {
      p.ws_out[(split * rows + out_row(r)) * p.Dv + d] = o;
    }
  }
}

// The splits merged, a warp a query row (row = (b * H + h) * Lq + i): lse = logsumexp_s lse_s,
// out = sum_s exp(lse_s - lse) out_s, as torch.logsumexp and a weighted sum give them: a row no
// split attended gets -inf and 0, a split that saw nothing weighs 0, a NaN propagates. (One
// launch; the seven ATen ops it replaced were seven launches, which a batch-1 step outlasted.)
template <typename T>
__global__ void __launch_bounds__(kWarps * 32) paged_merge_kernel(const PagedParams p) {
  using M16 = Mma16<T>;
  const int lane = threadIdx.x % 32;
  const int64_t rows = int64_t{p.B} * p.H * p.Lq;
  for (int64_t row = int64_t{blockIdx.x} * kWarps + threadIdx.x / 32; row < rows;
       row += int64_t{gridDim.x} * kWarps) {
    const float* lse_s = p.ws_lse + row;  // split s at lse_s[s * rows]
    float m = -INFINITY;
    for (int s = lane; s < p.splits; s += 32) m = max_nan(m, lse_s[s * rows]);
    m = warp_max_nan(m);
    if (m == INFINITY || m == -INFINITY) m = 0.f;  // (torch.logsumexp's shift)
    float sum = 0.f;
    for (int s = lane; s < p.splits; s += 32) sum += expf(lse_s[s * rows] - m);
    const float lse = logf(warp_sum(sum)) + m;
    const float shift = lse == -INFINITY ? 0.f : lse;
    for (int d = lane; d < p.Dv; d += 32) {
      float acc = 0.f;
      for (int s = 0; s < p.splits; ++s) {
        acc += expf(lse_s[s * rows] - shift) * p.ws_out[(s * rows + row) * p.Dv + d];
      }
      p.out[row * p.Dv + d] = M16::from_float(acc);
    }
    if (lane == 0) p.lse[row] = lse;
  }
}

// ---------------------------------------------------------------------------------------------
// Host side.

void check_cache(const at::Tensor& t, const char* name, const at::Tensor& q) {
  check_cuda_tensor(t, name);
  check_device(t, q, name, "q");
  TORCH_CHECK(t.dim() == 4, name, " must be 4-D (num_blocks, block_size, kv_heads, head_dim), ",
              "got shape ", t.sizes());
  TORCH_CHECK(t.size(3) <= 1 || t.stride(3) == 1, name,
              " must have a contiguous last dimension, got strides ", t.strides());
  check_dtype(t, q.scalar_type(), name);
}

void check_index(const at::Tensor& t, const char* name, const at::Tensor& q, int dim) {
  check_cuda_tensor(t, name);
  check_device(t, q, name, "q");
  TORCH_CHECK(t.scalar_type() == at::kInt, name, " must be int32, got ", t.scalar_type());
  TORCH_CHECK(t.dim() == dim && t.size(0) == q.size(0), name, " must be ",
              dim == 2 ? "(batch, max_blocks)" : "(batch,)", " with q's batch ", q.size(0),
              ", got shape ", t.sizes());
  TORCH_CHECK(t.stride(-1) == 1 || t.size(-1) <= 1, name, " must have a unit last stride");
}

// The number of key splits: about two CTAs per SM, at least kMinSplitKeys keys a split;
// FASTATTN_CUDA_PAGED_SPLITS=n forces n (tests of the merge).
int num_splits(int64_t ctas, int64_t max_len, int device) {
  if (const char* forced = std::getenv("FASTATTN_CUDA_PAGED_SPLITS")) {
    const int n = std::atoi(forced);
    if (n >= 1) return static_cast<int>(std::min<int64_t>(n, std::max<int64_t>(max_len, 1)));
  }
  const int64_t want = ceil_div(2 * int64_t{sm_count(device)}, std::max<int64_t>(ctas, 1));
  return static_cast<int>(std::clamp<int64_t>(std::min(want, max_len / kMinSplitKeys), 1, 128));
}

template <typename T, int DP, int RB>
void launch_paged(const PagedParams& p, int64_t blocks, int device, cudaStream_t stream) {
  constexpr int bytes = PagedSmem<DP, RB>::BYTES;
  if constexpr (bytes > 48 * 1024) {
    TORCH_CHECK(bytes <= max_smem_optin(device), "paged_attention at head dim ", DP, " needs ",
                bytes, " bytes of shared memory per block but this GPU allows ",
                max_smem_optin(device), "; use backend=\"triton\"");
    opt_in_smem(paged_fwd_kernel<T, DP, RB>, bytes);
  }
  launch_kernel(paged_fwd_kernel<T, DP, RB>, static_cast<unsigned>(blocks), kWarps * 32, bytes,
                stream, p);
}

// The kernel for the head dim (DP) and the rows a kv head serves (RB: 4 or 8).
template <typename T, int DP>
void launch_paged_rows(const PagedParams& p, int rb, int64_t blocks, int device,
                       cudaStream_t stream) {
  if (rb == 4) {
    launch_paged<T, DP, 4>(p, blocks, device, stream);
  } else {
    launch_paged<T, DP, kMaxRows>(p, blocks, device, stream);
  }
}

std::tuple<at::Tensor, at::Tensor> paged_attention_fwd_cuda(
    const at::Tensor& q, const at::Tensor& k_cache, const at::Tensor& v_cache,
    const at::Tensor& block_table, const at::Tensor& cache_seqlens, double scale,
    bool bottom_right, int64_t left, int64_t right) {
  check_cuda_tensor(q, "q");
  TORCH_CHECK(q.dim() == 4, "q must be 4-D (batch, heads, new_tokens, head_dim), got shape ",
              q.sizes());
  TORCH_CHECK(q.size(3) <= 1 || q.stride(3) == 1, "q must have a contiguous last dimension");
  const auto dt = q.scalar_type();
  TORCH_CHECK(dt == at::kHalf || dt == at::kBFloat16, "the cuda paged attention kernel takes ",
              "float16 or bfloat16; q is ", dt, " (shape ", q.sizes(), "). Use backend=\"triton\" ",
              "or backend=\"cpu\", or cast q and the caches to bfloat16 / float16");
  check_cache(k_cache, "k_cache", q);
  check_cache(v_cache, "v_cache", q);
  check_index(block_table, "block_table", q, 2);
  check_index(cache_seqlens, "cache_seqlens", q, 1);
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), D = q.size(3);
  const int64_t nb = k_cache.size(0), bs = k_cache.size(1), Hkv = k_cache.size(2);
  const int64_t Dv = v_cache.size(3);
  TORCH_CHECK(v_cache.size(0) == nb && v_cache.size(1) == bs && v_cache.size(2) == Hkv,
              "k_cache ", k_cache.sizes(), " and v_cache ", v_cache.sizes(),
              " must share (num_blocks, block_size, kv_heads)");
  TORCH_CHECK(k_cache.size(3) == D, "q head dim ", D, " differs from k_cache's ", k_cache.size(3));
  TORCH_CHECK(Hkv >= 1 && H % Hkv == 0, "query heads (", H, ") must be a multiple of the caches' ",
              "kv heads (", Hkv, ")");
  TORCH_CHECK(bs >= 1, "block_size (k_cache.shape[1]) must be >= 1");
  TORCH_CHECK(D <= kMaxHeadDim && Dv <= kMaxHeadDim, "head dims up to ", kMaxHeadDim,
              " are supported, got ", D, " and ", Dv);
  TORCH_CHECK(left >= 0 && right >= 0, "left and right must be >= 0, got ", left, ", ", right);
  const int64_t max_len = block_table.size(1) * bs;
  TORCH_CHECK(max_len <= 0x3fffffff && nb <= 0x7fffffff && Lq <= 0x3fffffff,
              "the cache (max_blocks * block_size = ", max_len, ") and Lq must fit in int32");

  const DeviceGuard guard(q.device());
  at::Tensor out = empty_tensor({B, H, Lq, Dv}, q.options());
  at::Tensor lse = empty_tensor({B, H, Lq}, q.options().dtype(at::kFloat));
  if (lse.numel() == 0) return {out, lse};

  PagedParams p{};
  p.q = reinterpret_cast<const uint16_t*>(q.const_data_ptr());
  p.q_sb = q.stride(0), p.q_sh = q.stride(1), p.q_sl = q.stride(2);
  p.k = reinterpret_cast<const uint16_t*>(k_cache.const_data_ptr());
  p.v = reinterpret_cast<const uint16_t*>(v_cache.const_data_ptr());
  p.k_sblk = k_cache.stride(0), p.k_sslot = k_cache.stride(1), p.k_sh = k_cache.stride(2);
  p.v_sblk = v_cache.stride(0), p.v_sslot = v_cache.stride(1), p.v_sh = v_cache.stride(2);
  p.async = D % 8 == 0 && Dv % 8 == 0 && is_aligned(p.k, 16) && is_aligned(p.v, 16) &&
            strides_multiple_of({p.k_sblk, p.k_sslot, p.k_sh, p.v_sblk, p.v_sslot, p.v_sh}, 8);
  p.table = block_table.const_data_ptr<int>();
  p.table_sb = block_table.stride(0);
  p.seqlens = cache_seqlens.const_data_ptr<int>();
  p.B = static_cast<int>(B), p.H = static_cast<int>(H), p.Hkv = static_cast<int>(Hkv);
  p.group = static_cast<int>(H / Hkv), p.Lq = static_cast<int>(Lq);
  p.D = static_cast<int>(D), p.Dv = static_cast<int>(Dv), p.bs = static_cast<int>(bs);
  p.max_blocks = static_cast<int>(block_table.size(1)), p.num_blocks = static_cast<int>(nb);
  p.bottom_right = bottom_right;
  const int64_t lim = Lq + max_len + 1;
  p.left = static_cast<int>(std::min(left, lim));
  p.right = static_cast<int>(std::min(right, lim));
  p.scale = static_cast<float>(scale);
  const int device = q.device().index();
  const int64_t rows = H / Hkv * Lq;  // a kv head's query rows
  const int rb = rows <= 4 ? 4 : kMaxRows;
  TORCH_CHECK(ceil_div(rows, int64_t{rb}) <= 0x7fffffff, "paged_attention: too many query rows");
  p.row_groups = static_cast<int>(ceil_div(rows, int64_t{rb}));
  p.splits = num_splits(B * Hkv * p.row_groups, max_len, device);
  p.split_len = static_cast<int>(ceil_div(std::max<int64_t>(max_len, 1), int64_t{p.splits}));
  at::Tensor ws_out, ws_lse;
  if (p.splits == 1) {
    p.out = reinterpret_cast<uint16_t*>(out.data_ptr());
    p.lse = lse.data_ptr<float>();
  } else {
    ws_out = empty_tensor({p.splits, B, H, Lq, Dv}, q.options().dtype(at::kFloat));
    ws_lse = empty_tensor({p.splits, B, H, Lq}, q.options().dtype(at::kFloat));
    p.ws_out = ws_out.data_ptr<float>();
    p.ws_lse = ws_lse.data_ptr<float>();
    p.out = reinterpret_cast<uint16_t*>(out.data_ptr());  // (the merge's)
    p.lse = lse.data_ptr<float>();
  }
  const int64_t blocks = B * Hkv * p.row_groups * p.splits;
  TORCH_CHECK(blocks <= 0x7fffffff, "paged_attention: too many blocks (", blocks, ")");
  const cudaStream_t stream = current_stream(device);
  const int64_t d_max = std::max(D, Dv);
  auto go = [&](auto tag) {
    using T = decltype(tag);
    if (d_max <= 64) {
      launch_paged_rows<T, 64>(p, rb, blocks, device, stream);
    } else if (d_max <= 128) {
      launch_paged_rows<T, 128>(p, rb, blocks, device, stream);
    } else {
      launch_paged_rows<T, 256>(p, rb, blocks, device, stream);
    }
    if (p.splits > 1) {
      launch_kernel(paged_merge_kernel<T>, grid_1d(ceil_div(lse.numel(), int64_t{kWarps})),
                    kWarps * 32, 0, stream, p);
    }
  };
  if (dt == at::kHalf) {
    go(c10::Half{});
  } else {
    go(c10::BFloat16{});
  }
  return {out, lse};
}

}  // namespace
}  // namespace cuda

FASTATTN_CUDA_IMPL_FWD(paged_attention)

}  // namespace fastattn
