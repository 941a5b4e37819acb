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
// Work split (flash-decoding): one CTA of kWarps warps per (key split, b, kv head). Warp w takes
// the GQA group's rows r = w, w + kWarps, ... (query head hk * group + r / Lq, query r % Lq),
// so the warps of a CTA read the same K and V rows (the second read hits L1). A warp runs its
// row's online softmax over the split's visible keys, 32 at a time:
//   - lane l scores key t0 + l, reading its K row whole (16-byte loads when aligned) against q in
//     shared memory (a broadcast);
//   - the warp's max (a NaN kept) and sum update the row's state;
//   - P V with the lanes splitting Dv, each key's p and block read back from shared memory.
// Splits: enough CTAs for about two per SM when B * Hkv is small and the cache long (at least
// 256 keys a split); FASTATTN_CUDA_PAGED_SPLITS=n forces n (tests). One split writes out and lse
// directly; several write their normalized out and lse to a float32 workspace, which
// paged_merge_kernel merges by lse (a split that saw nothing has lse -inf and weight 0).
//
// Precision: q . k, the softmax and P V in float32; out rounded to the input dtype, lse float32.
// NaN rule (docs/numerics.md): only keys a row attends are read, so a NaN or inf held at a key it
// does not attend never reaches it; an attended one propagates as IEEE arithmetic says.
// Scalar arithmetic on the CUDA cores, no tensor cores: decoding is bound by reading the cache.
//
// Limits: float16 / bfloat16; head dims up to 256 (D and Dv independently); any block size;
// q with a unit last stride, caches with unit last strides and any others. The public function
// checks block_table and cache_seqlens (one device-to-host copy); here an entry out of range
// leaves its key unattended, and a length beyond the row's blocks leaves the row empty: never an
// out-of-bounds access.
#include "fastattn/cuda_helpers.cuh"  // first: it prepares the c10/cuda includes

#include <ATen/ATen.h>
#include <torch/library.h>

#include <algorithm>
#include <cstdlib>
#include <tuple>

#include "fastattn/common.h"
#include "fastattn/cuda_mma.cuh"

namespace fastattn {
namespace cuda {
namespace {

using namespace ::fastattn::cuda_helpers;

constexpr int kWarps = 4;
constexpr int kMaxHeadDim = 256;
constexpr int kMinSplitKeys = 256;
// At least 4 CTAs (16 warps) an SM, so up to 128 registers a thread: without a minimum, ptxas
// kept the D128 / D256 kernels at 56-72 registers and spilled 16-32 B.
constexpr int kMinCtas = 4;

struct PagedParams {
  const uint16_t* q;  // (B, H, Lq, D)
  int64_t q_sb, q_sh, q_sl;
  const uint16_t* k;  // (num_blocks, bs, Hkv, D)
  const uint16_t* v;  // (num_blocks, bs, Hkv, Dv)
  int64_t k_sblk, k_sslot, k_sh;
  int64_t v_sblk, v_sslot, v_sh;
  bool vec_k;  // K rows 16-byte aligned and D % 8 == 0: 16-byte loads
  const int* table;  // (B, max_blocks)
  int64_t table_sb;
  const int* seqlens;  // (B,)
  int B, H, Hkv, group, Lq, D, Dv, bs, max_blocks, num_blocks;
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

// Shared memory a warp uses: its row's q (DP floats), then each chunk's 32 probabilities, the
// 32 keys' blocks (-1: not attended) and slots.
template <int DP>
struct WarpSmem {
  static constexpr int FLOATS = DP + 3 * 32;
  static constexpr int BYTES = kWarps * FLOATS * 4;
};

// q . k for the K row `k` (D elements) and q in shared memory (DP floats, zero past D). The loop
// runs to DP, unrolled, so that a lane's 16-byte loads of its row are in flight together (it
// waited a memory latency a load when it stopped at D); four partial sums break the chain of
// FMAs.
template <typename M16, int DP>
__device__ __forceinline__ float dot_q_k(const PagedParams& p, const float* q, const uint16_t* k) {
  float acc[4] = {};
  if (p.vec_k) {
#pragma unroll
    for (int d = 0; d < DP; d += 8) {
      // (a load under a condition, not a loop that breaks: ptxas predicates it and issues the
      // row's loads together; past D, q is 0 in shared memory)
      uint4 w = make_uint4(0, 0, 0, 0);
      if (d < p.D) w = *reinterpret_cast<const uint4*>(k + d);
      const float4 qa = ld_shared<float4>(q + d), qb = ld_shared<float4>(q + d + 4);
      const uint32_t words[4] = {w.x, w.y, w.z, w.w};
      const float qs[8] = {qa.x, qa.y, qa.z, qa.w, qb.x, qb.y, qb.z, qb.w};
#pragma unroll
      for (int e = 0; e < 8; ++e) {
        acc[e % 4] += qs[e] * M16::to_float(static_cast<uint16_t>(words[e / 2] >> (16 * (e % 2))));
      }
    }
  } else {
    for (int d = 0; d < p.D; ++d) acc[d % 4] += ld_shared<float>(q + d) * M16::to_float(k[d]);
  }
  return (acc[0] + acc[1]) + (acc[2] + acc[3]);
}

template <typename T, int DP>
__global__ void __launch_bounds__(kWarps * 32, kMinCtas) paged_fwd_kernel(const PagedParams p) {
  using M16 = Mma16<T>;
  constexpr int U = DP / 32;  // V columns d = lane + 32 u
  constexpr int KJ = DP > 128 ? 4 : 8;  // keys whose V rows a lane loads at once
  FASTATTN_DYNAMIC_SMEM(float, smem);
  const int lane = threadIdx.x % 32, warp = threadIdx.x / 32;
  float* sq = smem + warp * WarpSmem<DP>::FLOATS;
  float* sp = sq + DP;
  int* sblk = reinterpret_cast<int*>(sp + 32);
  int* sslot = sblk + 32;

  // (32-bit divisions: a 64-bit one is a subroutine call, and ptxas spilled around it)
  const int split = static_cast<int>(blockIdx.x) % p.splits;
  const int bhk = static_cast<int>(blockIdx.x) / p.splits;
  const int b = bhk / p.Hkv, hk = bhk % p.Hkv;
  int Lk = p.seqlens[b];
  if (Lk < 0 || Lk > p.max_blocks * p.bs) Lk = 0;  // refused by the public function
  const int offset = p.bottom_right ? Lk - p.Lq : 0;
  const int t_split = split * p.split_len;
  const int t_split_end = min(Lk, t_split + p.split_len);
  const int* table = p.table + b * p.table_sb;
  const uint16_t* k_head = p.k + hk * p.k_sh;
  const uint16_t* v_head = p.v + hk * p.v_sh;

  for (int r = warp; r < p.group * p.Lq; r += kWarps) {
    const int h = hk * p.group + r / p.Lq, i = r % p.Lq;
    const uint16_t* q = p.q + b * p.q_sb + h * p.q_sh + i * p.q_sl;
    for (int d = lane; d < DP; d += 32) st_shared(sq + d, d < p.D ? M16::to_float(q[d]) : 0.f);
    __syncwarp();
    const int t_begin = max(t_split, i + offset - p.left);
    const int t_end = min(t_split_end, i + offset + p.right + 1);
    float m = -INFINITY, l = 0.f, acc[U] = {};
    for (int t0 = t_begin; t0 < t_end; t0 += 32) {
      // Lane l: key t0 + l's block (or -1: past the range, or an entry out of range) and score.
      const int t = t0 + lane;
      int blk = -1, slot = 0;
      if (t < t_end) {
        const int idx = t / p.bs;  // (the one division a key: the P V loop reads it back)
        slot = t - idx * p.bs;
        blk = table[idx];
        if (blk < 0 || blk >= p.num_blocks) blk = -1;
      }
      float s = -INFINITY;
      if (blk >= 0) {
        s = dot_q_k<M16, DP>(p, sq, k_head + blk * p.k_sblk + slot * p.k_sslot) * p.scale;
      }
      const float m_new = max_nan(m, warp_max_nan(s));
      const float m_safe = m_new == -INFINITY ? 0.f : m_new;
      const float alpha = expf(m - m_safe);  // 0 while the row was empty
      const float pr = blk >= 0 ? expf(s - m_safe) : 0.f;
      l = l * alpha + warp_sum(pr);
      m = m_new;
#pragma unroll
      for (int u = 0; u < U; ++u) acc[u] *= alpha;
      st_shared(sp + lane, pr);
      st_shared(sblk + lane, blk);
      st_shared(sslot + lane, slot);
      __syncwarp();
      // P V, KJ keys at a time: their V loads are in flight together (one key at a time, a
      // warp waited a memory latency a key). Keys past the chunk's end, or not attended, have
      // block -1 and p 0: their V rows are never read.
      const int n = min(32, t_end - t0);
      for (int j0 = 0; j0 < n; j0 += KJ) {
        float vals[KJ][U];
#pragma unroll
        for (int jj = 0; jj < KJ; ++jj) {
          const int bj = ld_shared<int>(sblk + j0 + jj);  // (j0 + jj < 32: KJ divides 32)
          const uint16_t* vr = v_head + bj * p.v_sblk + ld_shared<int>(sslot + j0 + jj) * p.v_sslot;
#pragma unroll
          for (int u = 0; u < U; ++u) {
            const int d = lane + 32 * u;
            vals[jj][u] = bj >= 0 && d < p.Dv ? M16::to_float(vr[d]) : 0.f;
          }
        }
#pragma unroll
        for (int jj = 0; jj < KJ; ++jj) {
          const float pj = ld_shared<float>(sp + j0 + jj);
#pragma unroll
          for (int u = 0; u < U; ++u) acc[u] += pj * vals[jj][u];
        }
      }
      // Every lane has read this chunk's p, blocks and slots (and q) before the next chunk, or
      // the next row, overwrites them.
      __syncwarp();
    }
    // Normalized out and lse (an empty row: 0 and -inf), to out or to this split's workspace.
    const bool empty = l == 0.f;
    // (__fdividef: an IEEE division has a slow path called as a subroutine, and ptxas spilled
    // around the call; l is a sum of at most 2^30 terms <= 1, far from its 2^126 limit)
    const float inv = empty ? 0.f : __fdividef(1.f, l);
    const float lse = empty ? -INFINITY : m + logf(l);
    const int64_t row = ((int64_t{b} * p.H + h) * p.Lq + i);
#pragma unroll
    for (int u = 0; u < U; ++u) {
      const int d = lane + 32 * u;
      if (d >= p.Dv) continue;
      if (p.splits == 1) {
        p.out[row * p.Dv + d] = M16::from_float(acc[u] * inv);
      } else {
        p.ws_out[(split * int64_t{p.B} * p.H * p.Lq + row) * p.Dv + d] = acc[u] * inv;
      }
    }
    if (lane == 0) {
      if (p.splits == 1) {
        p.lse[row] = lse;
      } else {
        p.ws_lse[split * int64_t{p.B} * p.H * p.Lq + row] = lse;
      }
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

template <typename T, int DP>
void launch_paged(const PagedParams& p, int64_t blocks, cudaStream_t stream) {
  launch_kernel(paged_fwd_kernel<T, DP>, static_cast<unsigned>(blocks), kWarps * 32,
                WarpSmem<DP>::BYTES, stream, p);
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
  at::Tensor out = at::empty({B, H, Lq, Dv}, q.options());
  at::Tensor lse = at::empty({B, H, Lq}, q.options().dtype(at::kFloat));
  if (lse.numel() == 0) return {out, lse};

  PagedParams p{};
  p.q = reinterpret_cast<const uint16_t*>(q.const_data_ptr());
  p.q_sb = q.stride(0), p.q_sh = q.stride(1), p.q_sl = q.stride(2);
  p.k = reinterpret_cast<const uint16_t*>(k_cache.const_data_ptr());
  p.v = reinterpret_cast<const uint16_t*>(v_cache.const_data_ptr());
  p.k_sblk = k_cache.stride(0), p.k_sslot = k_cache.stride(1), p.k_sh = k_cache.stride(2);
  p.v_sblk = v_cache.stride(0), p.v_sslot = v_cache.stride(1), p.v_sh = v_cache.stride(2);
  p.vec_k = D % 8 == 0 && is_aligned(p.k, 16) &&
            strides_multiple_of({p.k_sblk, p.k_sslot, p.k_sh}, 8);
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
  p.splits = num_splits(B * Hkv, max_len, device);
  p.split_len = static_cast<int>(ceil_div(std::max<int64_t>(max_len, 1), int64_t{p.splits}));
  at::Tensor ws_out, ws_lse;
  if (p.splits == 1) {
    p.out = reinterpret_cast<uint16_t*>(out.data_ptr());
    p.lse = lse.data_ptr<float>();
  } else {
    ws_out = at::empty({p.splits, B, H, Lq, Dv}, q.options().dtype(at::kFloat));
    ws_lse = at::empty({p.splits, B, H, Lq}, q.options().dtype(at::kFloat));
    p.ws_out = ws_out.data_ptr<float>();
    p.ws_lse = ws_lse.data_ptr<float>();
    p.out = reinterpret_cast<uint16_t*>(out.data_ptr());  // (the merge's)
    p.lse = lse.data_ptr<float>();
  }
  const int64_t blocks = B * Hkv * p.splits;
  TORCH_CHECK(blocks <= 0x7fffffff, "paged_attention: too many blocks (", blocks, ")");
  const cudaStream_t stream = current_stream(device);
  auto go = [&](auto tag) {
    using T = decltype(tag);
    const int64_t d_max = std::max(D, Dv);
    if (d_max <= 64) {
      launch_paged<T, 64>(p, blocks, stream);
    } else if (d_max <= 128) {
      launch_paged<T, 128>(p, blocks, stream);
    } else {
      launch_paged<T, 256>(p, blocks, stream);
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
