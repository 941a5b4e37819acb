// Scaled, masked softmax over the last dimension (CUDA backend): fastattn::softmax_fwd / _bwd.
//
// Math (per row of length Lk; float32 arithmetic whatever the storage dtype):
//
//   forward   s_j = scale * x_j + m_j      (float mask: m_j added; bool mask: m_j = 0 / -inf)
//             s_j = -inf  where j > iq      (is_causal: top-left, query iq sees keys j <= iq)
//             y_j = exp(s_j - max s) / sum_k exp(s_k - max s),  all 0 when every s_j = -inf
//   backward  dx_j = scale * y_j * (dy_j - sum_k dy_k y_k)
//
// Scores are kept in log2 units (log2(e) folded into the scale) and exponentiated with exp2f.
// A fully masked row has max = -inf: its y is 0 (never NaN), and so is its backward.
//
// Layout: x (L0, L1, Lq, Lk) with a unit last stride and any leading strides; rows are the
// flattened (L0, L1, Lq) index, decomposed in int64. The mask is a (L0, L1, Lq, Lk) view read
// through all four strides (stride 0 on broadcast dims; its last stride may be 0 or > 1), as bool
// or any floating dtype (MaskKind, cuda_helpers.cuh). y and dx are allocated contiguous. dy and y
// in backward are read through their leading strides too.
//
// Work split:
// - rows of Lk <= 1024: one warp per row, 4 rows per 128-thread block. The row lives in
//   registers: each lane holds E = next_pow2(ceil(Lk / 32)) elements (1 .. 32), loaded as VEC-wide
//   vectors (16 bytes) when the row length, base pointer and leading strides allow it, else one
//   element at a time (lane-contiguous, still coalesced). One read of x (and mask), one write of
//   y; warp shuffles for max and sum.
// - longer rows (any length; tested up to 262144): one block per row (128 .. 1024 threads), each
//   thread walking VEC-wide chunks strided by the block. Pass 1 keeps an online (max, sum of
//   exp2) per thread, merged by a block reduction (fixed order, deterministic); pass 2 writes y.
//   Scores are cached in shared memory between the passes when the row fits in 44 KB
//   (Lk <= 11264; with the reduction scratch this stays under the 48 KB a block may use without
//   opting in), otherwise pass 2 re-reads x and the mask (from L2 for moderate rows). Backward
//   likewise: sum(dy * y) in pass 1, dx in pass 2.
// Both kernels use grid-stride loops over rows, so any row count fits in the capped grid.
#include "fastattn/cuda_helpers.cuh"  // first: it prepares the c10/cuda includes

#include <type_traits>

#include "fastattn/common.h"
#include "fastattn/softmax.h"

namespace fastattn {
namespace cuda {
namespace {

using namespace ::fastattn::cuda_helpers;

constexpr int kWarpRowsPerBlock = 4;  // warp kernel: 4 warps, one row each
constexpr int kWarpThreads = kWarpRowsPerBlock * kWarpSize;
constexpr int kMaxWarpElems = 32;  // elements per lane on the warp path: Lk <= 32 * 32 = 1024
constexpr int kMaxWarpRow = kMaxWarpElems * kWarpSize;
constexpr int kMaxBlockThreads = 1024;
// fp32 scores cached in dynamic shared memory: 44 KB, + 256 B of static reduction scratch, under
// the 48 KB per block available without cudaFuncAttributeMaxDynamicSharedMemorySize.
constexpr int64_t kMaxCachedRow = 11264;
static_assert(kMaxCachedRow * 4 + 2 * 32 * 4 <= 48 * 1024, "cached row exceeds 48 KB of shared memory");

struct FwdParams {
  const void* x;
  void* y;
  const void* mask;
  int64_t rows, L1, Lq, Lk;
  int64_t sx0, sx1, sx2;       // x's leading strides (the last one is 1)
  int64_t sm0, sm1, sm2, sm3;  // the mask's four strides
  float scale_log2;            // scale * log2(e)
  MaskKind mask_kind;
  bool causal;
};

struct BwdParams {
  const void* dy;
  const void* y;
  void* dx;
  int64_t rows, L1, Lq, Lk;
  int64_t sd0, sd1, sd2;  // dy's leading strides
  int64_t sy0, sy1, sy2;  // y's leading strides
  float scale;
};

struct RowIndex {
  int64_t i0, i1, iq;
};

__device__ __forceinline__ RowIndex split_row(int64_t row, int64_t L1, int64_t Lq) {
  const int64_t iq = row % Lq;
  const int64_t t = row / Lq;
  return {t / L1, t % L1, iq};
}

// Where one forward row lives, and how many of its keys causal masking leaves.
struct FwdRow {
  int64_t x_off, m_off, y_off, n_valid;
};

__device__ __forceinline__ FwdRow fwd_row(const FwdParams& p, int64_t row) {
  const RowIndex r = split_row(row, p.L1, p.Lq);
  FwdRow f;
  f.x_off = r.i0 * p.sx0 + r.i1 * p.sx1 + r.iq * p.sx2;
  f.m_off = r.i0 * p.sm0 + r.i1 * p.sm1 + r.iq * p.sm2;
  f.y_off = row * p.Lk;
  f.n_valid = p.causal ? (r.iq + 1 < p.Lk ? r.iq + 1 : p.Lk) : p.Lk;
  return f;
}

// The log2-unit score of column j (0 <= j < Lk) whose x value is xv; -inf where masked.
__device__ __forceinline__ float score(const FwdParams& p, const FwdRow& f, float xv, int64_t j) {
  if (j >= f.n_valid) return -INFINITY;
  float s = xv * p.scale_log2;
  if (p.mask_kind != MaskKind::kNone) s += mask_additive(p.mask, p.mask_kind, f.m_off + j * p.sm3) * kLog2e;
  return s;
}

// Loads the VEC scores of columns [c0, c0 + VEC) (those >= Lk are -inf and never read).
template <typename T, int VEC>
__device__ __forceinline__ void load_scores(const FwdParams& p, const FwdRow& f, int64_t c0,
                                            float (&s)[VEC]) {
  const T* x = static_cast<const T*>(p.x) + f.x_off;
  if (VEC > 1 && c0 + VEC <= p.Lk) {
    const Vec<T, VEC> v = load_vec<T, VEC>(x + c0);
#pragma unroll
    for (int e = 0; e < VEC; ++e) s[e] = score(p, f, to_float(v.v[e]), c0 + e);
  } else {
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      const int64_t j = c0 + e;
      s[e] = j < p.Lk ? score(p, f, to_float(x[j]), j) : -INFINITY;
    }
  }
}

template <typename T, int VEC>
__device__ __forceinline__ void store_row_chunk(T* out, int64_t c0, int64_t n, const float (&v)[VEC]) {
  if (VEC > 1 && c0 + VEC <= n) {
    Vec<T, VEC> w;
#pragma unroll
    for (int e = 0; e < VEC; ++e) w.v[e] = from_float<T>(v[e]);
    store_vec<T, VEC>(out + c0, w);
  } else {
#pragma unroll
    for (int e = 0; e < VEC; ++e) {
      if (c0 + e < n) out[c0 + e] = from_float<T>(v[e]);
    }
  }
}

template <typename T, int VEC>
__device__ __forceinline__ void load_row_chunk(const T* in, int64_t c0, int64_t n, float (&v)[VEC]) {
  if (VEC > 1 && c0 + VEC <= n) {
    const Vec<T, VEC> w = load_vec<T, VEC>(in + c0);
#pragma unroll
    for (int e = 0; e < VEC; ++e) v[e] = to_float(w.v[e]);
  } else {
#pragma unroll
    for (int e = 0; e < VEC; ++e) v[e] = c0 + e < n ? to_float(in[c0 + e]) : 0.f;
  }
}

// ---------------------------------------------------------------------------------------------
// Warp per row (Lk <= 1024). Lane `lane` owns columns (it * 32 + lane) * VEC + e.

// (kWarpThreads, 1): without a minimum of one block per SM ptxas kept the 32-element variants
// under ~96 registers and spilled 8-16 bytes; with it they use 110-114, no spills.
template <typename T, int VEC, int ITERS>
__global__ void __launch_bounds__(kWarpThreads, 1) softmax_fwd_warp_kernel(FwdParams p) {
  static_assert(VEC * ITERS <= kMaxWarpElems, "row chunk exceeds the warp path's registers");
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  for (int64_t row = int64_t{blockIdx.x} * kWarpRowsPerBlock + warp; row < p.rows;
       row += int64_t{gridDim.x} * kWarpRowsPerBlock) {
    const FwdRow f = fwd_row(p, row);
    float s[ITERS][VEC];
    float mx = -INFINITY;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      load_scores<T, VEC>(p, f, int64_t{it * kWarpSize + lane} * VEC, s[it]);
#pragma unroll
      for (int e = 0; e < VEC; ++e) mx = fmaxf(mx, s[it][e]);
    }
    mx = warp_max(mx);
    const float m_safe = mx == -INFINITY ? 0.f : mx;
    float sum = 0.f;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        s[it][e] = exp2f(s[it][e] - m_safe);  // exp2(-inf) = 0 for masked columns
        sum += s[it][e];
      }
    }
    sum = warp_sum(sum);
    const float inv = sum > 0.f ? 1.f / sum : 0.f;  // fully masked row: y = 0
    T* y = static_cast<T*>(p.y) + f.y_off;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) s[it][e] *= inv;
      store_row_chunk<T, VEC>(y, int64_t{it * kWarpSize + lane} * VEC, p.Lk, s[it]);
    }
  }
}

template <typename T, int VEC, int ITERS>
__global__ void __launch_bounds__(kWarpThreads) softmax_bwd_warp_kernel(BwdParams p) {
  static_assert(VEC * ITERS <= kMaxWarpElems, "row chunk exceeds the warp path's registers");
  const int lane = threadIdx.x % kWarpSize;
  const int warp = threadIdx.x / kWarpSize;
  for (int64_t row = int64_t{blockIdx.x} * kWarpRowsPerBlock + warp; row < p.rows;
       row += int64_t{gridDim.x} * kWarpRowsPerBlock) {
    const RowIndex r = split_row(row, p.L1, p.Lq);
    const T* dy = static_cast<const T*>(p.dy) + r.i0 * p.sd0 + r.i1 * p.sd1 + r.iq * p.sd2;
    const T* y = static_cast<const T*>(p.y) + r.i0 * p.sy0 + r.i1 * p.sy1 + r.iq * p.sy2;
    float g[ITERS][VEC], v[ITERS][VEC];
    float dot = 0.f;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
      const int64_t c0 = int64_t{it * kWarpSize + lane} * VEC;
      load_row_chunk<T, VEC>(dy, c0, p.Lk, g[it]);
      load_row_chunk<T, VEC>(y, c0, p.Lk, v[it]);
#pragma unroll
      for (int e = 0; e < VEC; ++e) dot += g[it][e] * v[it][e];
    }
    dot = warp_sum(dot);
    T* dx = static_cast<T*>(p.dx) + row * p.Lk;
#pragma unroll
    for (int it = 0; it < ITERS; ++it) {
#pragma unroll
      for (int e = 0; e < VEC; ++e) g[it][e] = p.scale * v[it][e] * (g[it][e] - dot);
      store_row_chunk<T, VEC>(dx, int64_t{it * kWarpSize + lane} * VEC, p.Lk, g[it]);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Block per row (Lk > 1024, no upper limit). Thread t owns the chunks c0 = (t + k * blockDim) * VEC;
// with CACHE, pass 1 stores its scores in shared memory at the same columns, which pass 2 (the
// same thread) reads back: no other thread touches them, so no barrier is needed for the cache.

template <typename T, int VEC, bool CACHE>
__global__ void __launch_bounds__(kMaxBlockThreads) softmax_fwd_block_kernel(FwdParams p) {
  FASTATTN_DYNAMIC_SMEM(float, cache);  // CACHE: Lk floats (launch passes Lk * 4 bytes)
  __shared__ float red_m[kWarpSize], red_l[kWarpSize];
  const int64_t step = int64_t{blockDim.x} * VEC;
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const FwdRow f = fwd_row(p, row);
    MaxSum st{-INFINITY, 0.f};
    for (int64_t c0 = int64_t{threadIdx.x} * VEC; c0 < p.Lk; c0 += step) {
      float s[VEC];
      load_scores<T, VEC>(p, f, c0, s);
      float cm = -INFINITY;
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        cm = fmaxf(cm, s[e]);
        if (CACHE && c0 + e < p.Lk) cache[c0 + e] = s[e];
      }
      if (cm != -INFINITY) {
        float l = 0.f;
#pragma unroll
        for (int e = 0; e < VEC; ++e) l += exp2f(s[e] - cm);
        st = max_sum_combine(st, MaxSum{cm, l});
      }
    }
    st = block_max_sum(st, red_m, red_l);
    const float m_safe = st.m == -INFINITY ? 0.f : st.m;
    const float inv = st.l > 0.f ? 1.f / st.l : 0.f;
    T* y = static_cast<T*>(p.y) + f.y_off;
    for (int64_t c0 = int64_t{threadIdx.x} * VEC; c0 < p.Lk; c0 += step) {
      float s[VEC];
      if (CACHE) {
#pragma unroll
        for (int e = 0; e < VEC; ++e) s[e] = c0 + e < p.Lk ? cache[c0 + e] : -INFINITY;
      } else {
        load_scores<T, VEC>(p, f, c0, s);
      }
#pragma unroll
      for (int e = 0; e < VEC; ++e) s[e] = exp2f(s[e] - m_safe) * inv;
      store_row_chunk<T, VEC>(y, c0, p.Lk, s);
    }
  }
}

template <typename T, int VEC>
__global__ void __launch_bounds__(kMaxBlockThreads) softmax_bwd_block_kernel(BwdParams p) {
  __shared__ float red[kWarpSize];
  const int64_t step = int64_t{blockDim.x} * VEC;
  for (int64_t row = blockIdx.x; row < p.rows; row += gridDim.x) {
    const RowIndex r = split_row(row, p.L1, p.Lq);
    const T* dy = static_cast<const T*>(p.dy) + r.i0 * p.sd0 + r.i1 * p.sd1 + r.iq * p.sd2;
    const T* y = static_cast<const T*>(p.y) + r.i0 * p.sy0 + r.i1 * p.sy1 + r.iq * p.sy2;
    float dot = 0.f;
    for (int64_t c0 = int64_t{threadIdx.x} * VEC; c0 < p.Lk; c0 += step) {
      float g[VEC], v[VEC];
      load_row_chunk<T, VEC>(dy, c0, p.Lk, g);
      load_row_chunk<T, VEC>(y, c0, p.Lk, v);
#pragma unroll
      for (int e = 0; e < VEC; ++e) dot += g[e] * v[e];
    }
    dot = block_sum(dot, red);
    T* dx = static_cast<T*>(p.dx) + row * p.Lk;
    for (int64_t c0 = int64_t{threadIdx.x} * VEC; c0 < p.Lk; c0 += step) {
      float g[VEC], v[VEC];
      load_row_chunk<T, VEC>(dy, c0, p.Lk, g);
      load_row_chunk<T, VEC>(y, c0, p.Lk, v);
#pragma unroll
      for (int e = 0; e < VEC; ++e) g[e] = p.scale * v[e] * (g[e] - dot);
      store_row_chunk<T, VEC>(dx, c0, p.Lk, g);
    }
  }
}

// ---------------------------------------------------------------------------------------------
// Launchers.

// Elements per lane on the warp path: the next power of two >= ceil(Lk / 32), in [1, 32].
int warp_elems(int64_t Lk) {
  int e = 1;
  while (int64_t{e} * kWarpSize < Lk) e *= 2;
  return e;
}

// Threads for the block path: up to ~4 chunks per thread, 128 .. 1024.
int block_threads(int64_t chunks) {
  int t = 128;
  while (t < kMaxBlockThreads && int64_t{t} * 4 < chunks) t *= 2;
  return t;
}

// Calls fn(std::integral_constant<int, E>) for the runtime E in {1, 2, 4, 8, 16, 32}.
template <typename Fn>
void with_elems(int e, Fn&& fn) {
  switch (e) {
    case 1: fn(std::integral_constant<int, 1>{}); break;
    case 2: fn(std::integral_constant<int, 2>{}); break;
    case 4: fn(std::integral_constant<int, 4>{}); break;
    case 8: fn(std::integral_constant<int, 8>{}); break;
    case 16: fn(std::integral_constant<int, 16>{}); break;
    case 32: fn(std::integral_constant<int, 32>{}); break;
    default: TORCH_CHECK(false, "softmax: internal error, bad elements per lane ", e);
  }
}

// Launches the forward (Params = FwdParams) or the backward (BwdParams) kernel for p: the
// warp-per-row kernel with E elements per lane for rows up to kMaxWarpRow, else the
// block-per-row one; 16-byte vectors (V elements) when vec_ok and, on the warp path, E >= V.
template <typename T, typename Params>
void launch(const Params& p, bool vec_ok, cudaStream_t stream) {
  constexpr bool kFwd = std::is_same_v<Params, FwdParams>;
  constexpr int V = kVec16<T>;
  if (p.Lk <= kMaxWarpRow) {
    const unsigned grid = grid_1d(ceil_div(p.rows, kWarpRowsPerBlock));
    with_elems(warp_elems(p.Lk), [&](auto e_const) {
      constexpr int E = decltype(e_const)::value;
      auto warp_kernel = [&](auto vec_const) {
        constexpr int VEC = decltype(vec_const)::value;
        if constexpr (kFwd) {
          launch_kernel(softmax_fwd_warp_kernel<T, VEC, E / VEC>, grid, kWarpThreads, 0, stream, p);
        } else {
          launch_kernel(softmax_bwd_warp_kernel<T, VEC, E / VEC>, grid, kWarpThreads, 0, stream, p);
        }
      };
      if constexpr (E >= V) {
        if (vec_ok) return warp_kernel(std::integral_constant<int, V>{});
      }
      warp_kernel(std::integral_constant<int, 1>{});
    });
    return;
  }
  const unsigned grid = grid_1d(p.rows);
  const int threads = block_threads(vec_ok ? ceil_div(p.Lk, V) : p.Lk);
  if constexpr (kFwd) {
    // Rows up to kMaxCachedRow keep their scores in shared memory between the passes.
    const bool cache = p.Lk <= kMaxCachedRow;
    const size_t smem = cache ? static_cast<size_t>(p.Lk) * sizeof(float) : 0;
    if (vec_ok) {
      if (cache) {
        launch_kernel(softmax_fwd_block_kernel<T, V, true>, grid, threads, smem, stream, p);
      } else {
        launch_kernel(softmax_fwd_block_kernel<T, V, false>, grid, threads, 0, stream, p);
      }
    } else if (cache) {
      launch_kernel(softmax_fwd_block_kernel<T, 1, true>, grid, threads, smem, stream, p);
    } else {
      launch_kernel(softmax_fwd_block_kernel<T, 1, false>, grid, threads, 0, stream, p);
    }
  } else if (vec_ok) {
    launch_kernel(softmax_bwd_block_kernel<T, V>, grid, threads, 0, stream, p);
  } else {
    launch_kernel(softmax_bwd_block_kernel<T, 1>, grid, threads, 0, stream, p);
  }
}

at::Tensor softmax_fwd_cuda(const at::Tensor& x, const std::optional<at::Tensor>& mask,
                            double scale, bool is_causal) {
  check_cuda_tensor(x, "x");
  check_softmax_input(x, "x", /*allow_double=*/false);
  const MaskKind mask_kind = mask_kind_of(mask);
  if (mask.has_value()) {
    check_device(*mask, x, "mask", "x");
    TORCH_CHECK(mask->dim() == 4, "mask must be a 4-D (L0, L1, Lq, Lk) view, got shape ",
                mask->sizes());
    check_shape(*mask, x.sizes(), "mask");
  }
  const DeviceGuard guard(x.device());
  at::Tensor y = empty_tensor(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  if (y.numel() == 0) return y;

  FwdParams p{};
  p.x = x.data_ptr();
  p.y = y.data_ptr();
  p.mask = mask.has_value() ? mask->data_ptr() : nullptr;
  p.L1 = x.size(1);
  p.Lq = x.size(2);
  p.Lk = x.size(3);
  p.rows = x.size(0) * p.L1 * p.Lq;
  p.sx0 = x.stride(0);
  p.sx1 = x.stride(1);
  p.sx2 = x.stride(2);
  if (mask.has_value()) {
    p.sm0 = mask->stride(0);
    p.sm1 = mask->stride(1);
    p.sm2 = mask->stride(2);
    p.sm3 = mask->stride(3);
  }
  p.scale_log2 = static_cast<float>(scale) * kLog2e;
  p.mask_kind = mask_kind;
  p.causal = is_causal;
  const int64_t vbytes = 16;
  const int64_t V = vbytes / static_cast<int64_t>(x.element_size());
  const bool vec_ok = p.Lk % V == 0 && is_aligned(p.x, vbytes) && is_aligned(p.y, vbytes) &&
                      strides_multiple_of({p.sx0, p.sx1, p.sx2}, V);
  const cudaStream_t stream = current_stream(x.device().index());
  FASTATTN_DISPATCH_FLOAT_HALF_BF16(x.scalar_type(), "softmax_fwd_cuda",
                                    [&] { launch<scalar_t>(p, vec_ok, stream); });
  return y;
}

at::Tensor softmax_bwd_cuda(const at::Tensor& dy, const at::Tensor& y, double scale) {
  check_cuda_tensor(y, "y");
  check_cuda_tensor(dy, "dy");
  check_softmax_bwd(dy, y, /*allow_double=*/false);
  const DeviceGuard guard(y.device());
  at::Tensor dx = empty_tensor(y.sizes(), y.options().memory_format(at::MemoryFormat::Contiguous));
  if (dx.numel() == 0) return dx;

  BwdParams p{};
  p.dy = dy.data_ptr();
  p.y = y.data_ptr();
  p.dx = dx.data_ptr();
  p.L1 = y.size(1);
  p.Lq = y.size(2);
  p.Lk = y.size(3);
  p.rows = y.size(0) * p.L1 * p.Lq;
  p.sd0 = dy.stride(0);
  p.sd1 = dy.stride(1);
  p.sd2 = dy.stride(2);
  p.sy0 = y.stride(0);
  p.sy1 = y.stride(1);
  p.sy2 = y.stride(2);
  p.scale = static_cast<float>(scale);
  const int64_t vbytes = 16;
  const int64_t V = vbytes / static_cast<int64_t>(y.element_size());
  const bool vec_ok = p.Lk % V == 0 && is_aligned(p.dy, vbytes) && is_aligned(p.y, vbytes) &&
                      is_aligned(p.dx, vbytes) &&
                      strides_multiple_of({p.sd0, p.sd1, p.sd2, p.sy0, p.sy1, p.sy2}, V);
  const cudaStream_t stream = current_stream(y.device().index());
  FASTATTN_DISPATCH_FLOAT_HALF_BF16(y.scalar_type(), "softmax_bwd_cuda",
                                    [&] { launch<scalar_t>(p, vec_ok, stream); });
  return dx;
}

}  // namespace
}  // namespace cuda

FASTATTN_CUDA_IMPL_FWD_BWD(softmax)

}  // namespace fastattn
