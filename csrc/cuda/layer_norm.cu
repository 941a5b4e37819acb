// LayerNorm / RMSNorm forward and backward on CUDA (fastattn::layer_norm_fwd / layer_norm_bwd).
//
// Forward, per row of h (h = x, or h = x + residual rounded to x's dtype and returned):
//   LayerNorm: mean = E[h], rstd = 1 / sqrt(E[(h - mean)^2] + eps), y = (h - mean) * rstd * w + b
//   RMSNorm:   rstd = 1 / sqrt(E[h^2] + eps),                      y = h * rstd * w
// The LayerNorm statistics are taken relative to the row's first value c (delta = E[h - c],
// var = E[((h - c) - delta)^2], mean = c + delta), two passes, so rows with a large offset
// (1e4 + noise) keep their precision.
// Backward, with xhat = (h - mean) * rstd (RMSNorm: h * rstd) and g = dy * w:
//   LayerNorm: dx = rstd * (g - E[g] - xhat * E[g * xhat])   (+ dh, the gradient of the returned h)
//   RMSNorm:   dx = rstd * (g - xhat * E[g * xhat])           (+ dh)
//   dweight = sum over rows of dy * xhat, dbias = sum over rows of dy
//
// Work split: a row group (one warp when the row has at most kWarpRowBytes bytes, 4 rows per
// 128-thread block; otherwise one block of 64 .. 512 threads) handles one row at a time, in a
// grid-stride loop over the rows with as many blocks as fit on the device. Thread t of a group
// owns the vectors t, t + G, t + 2G, ... of the row (G = group size; a vector is 16 bytes when
// N, the pointers and the row strides allow it, else one element), so any N works. The row is
// read from global memory once: pass 1 keeps it in shared memory (as T) and the later passes
// read it back from there (each thread only reads what it wrote: no barrier); when the row does
// not fit in shared memory, the later passes re-read it from global memory (L2).
// dweight / dbias: each group adds dy * xhat and dy of its rows to its own float32 accumulators
// (in shared memory, or for rows too long for it, directly in the block's partial row in global
// memory); at the end each block writes one partial row of a (blocks, N) buffer, and a second
// kernel adds the partial rows in block order: deterministic, no atomics. Accumulators and
// partial rows are stored in "slot" order (element k of vector i at k * N / kVec + i) so that
// the threads of a warp touch consecutive words; the second kernel maps slots back to columns.
//
// Precision: float32 math for float32 / float16 / bfloat16; mean and rstd are float32. Row
// offsets are int64; N must be below 2^31. An empty row (N = 0) has mean 0, rstd 1 / sqrt(eps).
// Accepted dtypes and shapes: fastattn/layer_norm.h.
#include "fastattn/cuda_helpers.cuh"  // first: it prepares the c10/cuda includes

#include <c10/cuda/CUDAFunctions.h>

#include <algorithm>
#include <array>
#include <cmath>
#include <initializer_list>
#include <limits>
#include <tuple>
#include <utility>

#include "fastattn/layer_norm.h"

namespace fastattn {
namespace cuda {
namespace {

using namespace ::fastattn::cuda_helpers;

constexpr int kWarpRowBytes = 2048;  // rows up to this size: one warp per row
constexpr int kWarpsPerBlock = 4;    // warp per row: rows per block
constexpr int kMinBlockThreads = 64;
constexpr int kMaxBlockThreads = 512;
constexpr int kColSumRows = 16;  // column-sum kernel: block of (kWarpSize, kColSumRows) threads

template <typename T, typename W>
struct FwdParams {
  const T* x;
  const T* residual;  // or nullptr
  const W* weight;    // or nullptr
  const W* bias;      // or nullptr
  T* y;               // (rows, n) contiguous
  T* h;               // (rows, n) contiguous when residual, else nullptr
  float* mean;        // (rows,), nullptr for RMSNorm
  float* rstd;        // (rows,)
  int64_t rows, x_stride, r_stride;
  int n;
  float inv_n, eps;
  bool rms;
  bool cache;  // keep the row in shared memory between the passes
};

template <typename T, typename W>
struct BwdParams {
  const T* dy;
  const T* dh;  // or nullptr
  const T* h;
  const W* weight;     // or nullptr
  const float* mean;   // nullptr for RMSNorm
  const float* rstd;
  T* dx;               // (rows, n) contiguous
  float* part_w;       // (gridDim.x, n) partial dweight in slot order, or nullptr
  float* part_b;       // (gridDim.x, n) partial dbias in slot order, or nullptr
  int64_t rows, dy_stride, dh_stride, h_stride;
  int n;
  float inv_n;
  bool rms;
  bool cache;       // keep the h and dy rows in shared memory between the passes
  bool acc_shared;  // dweight / dbias accumulators in shared memory (else in part_w / part_b)
};

// A thread's row group (a warp, or the whole block; every group of a block works on one row at a
// time): the group's size, the number of groups in the block, the thread's group and its index t
// in it.
struct RowGroup {
  int size, count, index, t;
};
template <bool kWarp>
__device__ __forceinline__ RowGroup row_group() {
  const int size = kWarp ? kWarpSize : static_cast<int>(blockDim.x);
  return {size, static_cast<int>(blockDim.x) / size, static_cast<int>(threadIdx.x) / size,
          static_cast<int>(threadIdx.x) % size};
}

// Sum over a row group: a warp, or the whole block.
template <bool kWarp>
__device__ __forceinline__ float group_sum(float v, float* red) {
  if constexpr (kWarp) {
    return warp_sum(v);
  } else {
    return block_sum(v, red);
  }
}

// Shared memory, forward: per group, the row as n / kVec vectors of T (when p.cache).
template <typename T, typename W, int kVec, bool kWarp>
__global__ void __launch_bounds__(kMaxBlockThreads) layer_norm_fwd_kernel(const FwdParams<T, W> p) {
  using VT = Vec<T, kVec>;
  using VW = Vec<W, kVec>;
  FASTATTN_DYNAMIC_SMEM(float4, smem);
  __shared__ float red[kWarpSize];
  const auto [group_size, groups, group, t] = row_group<kWarp>();
  const int nvec = p.n / kVec;
  VT* cache = reinterpret_cast<VT*>(smem) + static_cast<int64_t>(group) * nvec;
  const VW* w = reinterpret_cast<const VW*>(p.weight);
  const VW* b = reinterpret_cast<const VW*>(p.bias);

  for (int64_t row = static_cast<int64_t>(blockIdx.x) * groups + group; row < p.rows;
       row += static_cast<int64_t>(gridDim.x) * groups) {
    const T* x_row = p.x + row * p.x_stride;
    const T* r_row = p.residual != nullptr ? p.residual + row * p.r_stride : nullptr;
    const VT* x = reinterpret_cast<const VT*>(x_row);
    const VT* r = reinterpret_cast<const VT*>(r_row);
    VT* h = p.h != nullptr ? reinterpret_cast<VT*>(p.h + row * p.n) : nullptr;

    // The shift c: the row's first value of h (0 for RMSNorm).
    float c = 0.f;
    if (!p.rms) {
      c = r_row != nullptr ? to_float(from_float<T>(to_float(x_row[0]) + to_float(r_row[0])))
                           : to_float(x_row[0]);
    }
    // Pass 1: h (stored and cached), and sum(h - c) or sum(h^2).
    float s = 0.f;
    for (int i = t; i < nvec; i += group_size) {
      VT v = x[i];
      if (r != nullptr) {
        const VT rv = r[i];
#pragma unroll
        for (int k = 0; k < kVec; ++k) v.v[k] = from_float<T>(to_float(v.v[k]) + to_float(rv.v[k]));
        h[i] = v;
      }
      if (p.cache) cache[i] = v;
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const float d = to_float(v.v[k]) - c;
        s += p.rms ? d * d : d;
      }
    }
    s = group_sum<kWarp>(s, red);
    // Later passes read the row from the cache, or again from global memory.
    const VT* src = p.cache ? cache : (h != nullptr ? h : x);
    float delta = 0.f;
    float var;
    if (p.rms) {
      var = s * p.inv_n;
    } else {
      delta = s * p.inv_n;
      float q = 0.f;
      for (int i = t; i < nvec; i += group_size) {
        const VT v = src[i];
#pragma unroll
        for (int k = 0; k < kVec; ++k) {
          const float d = (to_float(v.v[k]) - c) - delta;
          q += d * d;
        }
      }
      var = group_sum<kWarp>(q, red) * p.inv_n;
    }
    const float rs = rsqrtf(var + p.eps);
    if (t == 0) {
      if (!p.rms) p.mean[row] = c + delta;
      p.rstd[row] = rs;
    }
    // Pass 3: y.
    VT* y = reinterpret_cast<VT*>(p.y + row * p.n);
    for (int i = t; i < nvec; i += group_size) {
      const VT v = src[i];
      VW wv{}, bv{};
      if (w != nullptr) wv = w[i];
      if (b != nullptr) bv = b[i];
      VT out;
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        float o = ((to_float(v.v[k]) - c) - delta) * rs;
        if (w != nullptr) o *= to_float(wv.v[k]);
        if (b != nullptr) o += to_float(bv.v[k]);
        out.v[k] = from_float<T>(o);
      }
      y[i] = out;
    }
  }
}

// Shared memory, backward, in this order: when p.acc_shared, per group n floats of dweight
// accumulators (if part_w) and n floats of dbias accumulators (if part_b); then when p.cache, per
// group the h row and the dy row as n / kVec vectors of T.
// The warp-per-row variant is always launched with kWarpsPerBlock warps (row_groups): bounding it
// by that (and asking for just one resident block) instead of kMaxBlockThreads lets ptxas give it
// the registers it needs; before, it kept it at 64-72 registers and spilled 24-32 bytes.
template <typename T, typename W, int kVec, bool kWarp>
__global__ void __launch_bounds__(kWarp ? kWarpsPerBlock * kWarpSize : kMaxBlockThreads, 1)
    layer_norm_bwd_kernel(const BwdParams<T, W> p) {
  using VT = Vec<T, kVec>;
  using VW = Vec<W, kVec>;
  FASTATTN_DYNAMIC_SMEM(float4, smem);
  __shared__ float red[kWarpSize];
  const auto [group_size, groups, group, t] = row_group<kWarp>();
  const int n = p.n;
  const int nvec = n / kVec;
  const int64_t acc_len = static_cast<int64_t>(groups) * n;  // one kind of accumulator, all groups

  float* next = reinterpret_cast<float*>(smem);
  float* acc_w_all = nullptr;  // group 0's accumulators; group g's start g * n later
  float* acc_b_all = nullptr;
  if (p.acc_shared) {
    if (p.part_w != nullptr) {
      acc_w_all = next;
      next += acc_len;
    }
    if (p.part_b != nullptr) {
      acc_b_all = next;
      next += acc_len;
    }
  } else {  // block per row only (one group): accumulate in this block's partial rows
    if (p.part_w != nullptr) acc_w_all = p.part_w + static_cast<int64_t>(blockIdx.x) * n;
    if (p.part_b != nullptr) acc_b_all = p.part_b + static_cast<int64_t>(blockIdx.x) * n;
  }
  float* acc_w = acc_w_all != nullptr ? acc_w_all + static_cast<int64_t>(group) * n : nullptr;
  float* acc_b = acc_b_all != nullptr ? acc_b_all + static_cast<int64_t>(group) * n : nullptr;
  VT* cache_h = reinterpret_cast<VT*>(next) + static_cast<int64_t>(group) * nvec;
  VT* cache_dy = reinterpret_cast<VT*>(next) + static_cast<int64_t>(groups + group) * nvec;
  const VW* w = reinterpret_cast<const VW*>(p.weight);

  // Each thread zeroes the accumulator slots it will add to (slot k * nvec + i for its vectors i).
  for (int i = t; i < nvec; i += group_size) {
#pragma unroll
    for (int k = 0; k < kVec; ++k) {
      if (acc_w != nullptr) acc_w[k * nvec + i] = 0.f;
      if (acc_b != nullptr) acc_b[k * nvec + i] = 0.f;
    }
  }

  for (int64_t row = static_cast<int64_t>(blockIdx.x) * groups + group; row < p.rows;
       row += static_cast<int64_t>(gridDim.x) * groups) {
    const VT* h = reinterpret_cast<const VT*>(p.h + row * p.h_stride);
    const VT* dy = reinterpret_cast<const VT*>(p.dy + row * p.dy_stride);
    const VT* dh =
        p.dh != nullptr ? reinterpret_cast<const VT*>(p.dh + row * p.dh_stride) : nullptr;
    const float mu = p.rms ? 0.f : p.mean[row];
    const float rs = p.rstd[row];
    // Pass 1: sum(g), sum(g * xhat), and the dweight / dbias accumulators.
    float sg = 0.f, sgx = 0.f;
    for (int i = t; i < nvec; i += group_size) {
      const VT hv = h[i];
      const VT dv = dy[i];
      if (p.cache) {
        cache_h[i] = hv;
        cache_dy[i] = dv;
      }
      VW wv{};
      if (w != nullptr) wv = w[i];
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const float xh = (to_float(hv.v[k]) - mu) * rs;
        const float d = to_float(dv.v[k]);
        const float g = w != nullptr ? d * to_float(wv.v[k]) : d;
        sg += g;
        sgx += g * xh;
        if (acc_w != nullptr) acc_w[k * nvec + i] += d * xh;
        if (acc_b != nullptr) acc_b[k * nvec + i] += d;
      }
    }
    sg = group_sum<kWarp>(sg, red);
    sgx = group_sum<kWarp>(sgx, red);
    const float cg = p.rms ? 0.f : sg * p.inv_n;
    const float cx = sgx * p.inv_n;
    // Pass 2: dx.
    const VT* hs = p.cache ? cache_h : h;
    const VT* ds = p.cache ? cache_dy : dy;
    VT* dx = reinterpret_cast<VT*>(p.dx + row * n);
    for (int i = t; i < nvec; i += group_size) {
      const VT hv = hs[i];
      const VT dv = ds[i];
      VT dhv{};
      if (dh != nullptr) dhv = dh[i];
      VW wv{};
      if (w != nullptr) wv = w[i];
      VT out;
#pragma unroll
      for (int k = 0; k < kVec; ++k) {
        const float xh = (to_float(hv.v[k]) - mu) * rs;
        const float d = to_float(dv.v[k]);
        const float g = w != nullptr ? d * to_float(wv.v[k]) : d;
        float o = (g - cg - xh * cx) * rs;
        if (dh != nullptr) o += to_float(dhv.v[k]);
        out.v[k] = from_float<T>(o);
      }
      dx[i] = out;
    }
  }

  // Shared accumulators: add the groups' slots (in group order) into this block's partial rows.
  if (p.acc_shared && (acc_w_all != nullptr || acc_b_all != nullptr)) {
    __syncthreads();
    for (int s = threadIdx.x; s < n; s += blockDim.x) {
      float sw = 0.f, sb = 0.f;
      for (int g = 0; g < groups; ++g) {
        if (acc_w_all != nullptr) sw += acc_w_all[static_cast<int64_t>(g) * n + s];
        if (acc_b_all != nullptr) sb += acc_b_all[static_cast<int64_t>(g) * n + s];
      }
      if (acc_w_all != nullptr) p.part_w[static_cast<int64_t>(blockIdx.x) * n + s] = sw;
      if (acc_b_all != nullptr) p.part_b[static_cast<int64_t>(blockIdx.x) * n + s] = sb;
    }
  }
}

// out[column of slot s] = sum over p < parts of part[p][s], added in order p = 0, 1, ...: each
// (threadIdx.x, threadIdx.y) thread sums parts y, y + kColSumRows, ... of one slot, then thread
// y = 0 adds the kColSumRows sums in order. Slot s = k * (n / vec) + i is column i * vec + k.
template <typename W>
__global__ void __launch_bounds__(kWarpSize * kColSumRows)
    column_sum_kernel(const float* part, int64_t parts, int n, int vec, W* out) {
  __shared__ float sums[kColSumRows][kWarpSize + 1];
  const int s = static_cast<int>(blockIdx.x) * kWarpSize + static_cast<int>(threadIdx.x);
  float acc = 0.f;
  if (s < n) {
    for (int64_t q = threadIdx.y; q < parts; q += kColSumRows) acc += part[q * n + s];
  }
  sums[threadIdx.y][threadIdx.x] = acc;
  __syncthreads();
  if (threadIdx.y == 0 && s < n) {
    float total = 0.f;
    for (int y = 0; y < kColSumRows; ++y) total += sums[y][threadIdx.x];
    const int nvec = n / vec;
    out[(s % nvec) * vec + s / nvec] = from_float<W>(total);
  }
}

// ------------------------------------------------------------------------------------------------
// Host side.

// Threads per block: one warp per row for short rows (kWarpsPerBlock rows per block), else one
// block per row with about 4 vectors per thread.
struct RowGroups {
  bool warp;
  int threads;
  int groups;
};

RowGroups row_groups(int n, int elem_bytes, int vec) {
  if (static_cast<int64_t>(n) * elem_bytes <= kWarpRowBytes) {
    return {true, kWarpsPerBlock * kWarpSize, kWarpsPerBlock};
  }
  const int64_t nvec = n / vec;
  int threads = kMinBlockThreads;
  while (threads < kMaxBlockThreads && int64_t{threads} * 4 < nvec) threads *= 2;
  return {false, threads, 1};
}

// As many blocks as fit on the device at once (at least 1), and no more than `work`. Raises the
// kernel's dynamic shared memory limit first when smem_bytes needs it: the 48 KB a block gets
// without opting in counts the kernel's static shared memory too (red[], sums[]), so 48 KB of
// dynamic memory alone needs it (bf16 backward at n = 4096: "invalid argument" on the H100).
template <typename Kernel>
int resident_grid(Kernel kernel, int threads, int64_t smem_bytes, int64_t work) {
  constexpr int64_t kDefaultSmemBytes = 48 * 1024;
  if (smem_bytes + static_smem_bytes(kernel) > kDefaultSmemBytes) opt_in_smem(kernel, smem_bytes);
  const int per_sm = blocks_per_sm(kernel, threads, smem_bytes);
  const int64_t resident = int64_t{std::max(per_sm, 1)} * sm_count(current_device());
  return static_cast<int>(std::max<int64_t>(1, std::min(work, resident)));
}

// Dynamic shared memory one block may use: the opt-in maximum, less room for static memory.
int64_t smem_budget() { return int64_t{max_smem_optin(current_device())} - 1024; }

// Whether 16-byte vectors of T fit every row: n a multiple of kVec16<T>, 16-byte aligned bases and
// row strides that are multiples of kVec16<T>; parameters of W aligned to kVec16<T> elements.
template <typename T, typename W>
bool vectorizable(int n, std::initializer_list<std::pair<const void*, int64_t>> rows,
                  std::initializer_list<const void*> params) {
  constexpr int kVec = kVec16<T>;
  if (n % kVec != 0) return false;
  for (const auto& [ptr, stride] : rows) {
    if (ptr != nullptr && (!is_aligned(ptr, 16) || stride % kVec != 0)) return false;
  }
  for (const void* ptr : params) {
    if (ptr != nullptr && !is_aligned(ptr, static_cast<int64_t>(sizeof(W)) * kVec)) return false;
  }
  return true;
}

template <typename T, typename W, int kVec, bool kWarp>
void launch_fwd(FwdParams<T, W> p, int threads, int groups, cudaStream_t stream) {
  const int64_t cache_bytes = int64_t{groups} * p.n * static_cast<int64_t>(sizeof(T));
  p.cache = cache_bytes <= smem_budget();
  const int64_t smem = p.cache ? cache_bytes : 0;
  const auto kernel = layer_norm_fwd_kernel<T, W, kVec, kWarp>;
  const int grid = resident_grid(kernel, threads, smem, ceil_div(p.rows, groups));
  launch_kernel(kernel, grid, threads, smem, stream, p);
}

template <typename T, typename W>
void layer_norm_fwd_typed(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                          const std::optional<at::Tensor>& weight,
                          const std::optional<at::Tensor>& bias, double eps, bool rms,
                          at::Tensor& y, at::Tensor& h, at::Tensor& mean, at::Tensor& rstd) {
  FwdParams<T, W> p{};
  p.x = x.const_data_ptr<T>();
  p.residual = residual ? residual->const_data_ptr<T>() : nullptr;
  p.weight = weight ? weight->const_data_ptr<W>() : nullptr;
  p.bias = bias ? bias->const_data_ptr<W>() : nullptr;
  p.y = y.data_ptr<T>();
  p.h = residual ? h.data_ptr<T>() : nullptr;
  p.mean = rms ? nullptr : mean.data_ptr<float>();
  p.rstd = rstd.data_ptr<float>();
  p.rows = x.size(0);
  p.x_stride = x.stride(0);
  p.r_stride = residual ? residual->stride(0) : 0;
  p.n = static_cast<int>(x.size(1));
  p.inv_n = 1.f / static_cast<float>(p.n);
  p.eps = static_cast<float>(eps);
  p.rms = rms;
  const cudaStream_t stream = current_stream(current_device());
  constexpr int kVec = kVec16<T>;
  if (vectorizable<T, W>(p.n, {{p.x, p.x_stride}, {p.residual, p.r_stride}}, {p.weight, p.bias})) {
    const RowGroups rg = row_groups(p.n, sizeof(T), kVec);
    if (rg.warp) {
      launch_fwd<T, W, kVec, true>(p, rg.threads, rg.groups, stream);
    } else {
      launch_fwd<T, W, kVec, false>(p, rg.threads, rg.groups, stream);
    }
  } else {
    const RowGroups rg = row_groups(p.n, sizeof(T), 1);
    if (rg.warp) {
      launch_fwd<T, W, 1, true>(p, rg.threads, rg.groups, stream);
    } else {
      launch_fwd<T, W, 1, false>(p, rg.threads, rg.groups, stream);
    }
  }
}

// Runs the backward kernel, then the column sums into dweight / dbias (when defined).
template <typename T, typename W, int kVec, bool kWarp>
void launch_bwd(BwdParams<T, W> p, int threads, int groups, at::Tensor& dweight,
                at::Tensor& dbias, cudaStream_t stream) {
  const int num_acc = int{dweight.defined()} + int{dbias.defined()};
  const int64_t acc_bytes = int64_t{groups} * p.n * static_cast<int64_t>(sizeof(float)) * num_acc;
  const int64_t cache_bytes = 2 * int64_t{groups} * p.n * static_cast<int64_t>(sizeof(T));
  const int64_t budget = smem_budget();
  p.acc_shared = num_acc > 0 && acc_bytes <= budget;
  // Warp-per-row rows are short enough for both (kWarpRowBytes); only whole blocks fall back.
  TORCH_INTERNAL_ASSERT(!kWarp || num_acc == 0 || p.acc_shared);
  const int64_t acc_smem = p.acc_shared ? acc_bytes : 0;
  p.cache = acc_smem + cache_bytes <= budget;
  const int64_t smem = acc_smem + (p.cache ? cache_bytes : 0);
  const auto kernel = layer_norm_bwd_kernel<T, W, kVec, kWarp>;
  const int grid = resident_grid(kernel, threads, smem, ceil_div(p.rows, groups));
  at::Tensor part_w, part_b;
  if (num_acc > 0) {  // (without weight and bias both are undefined: they have no options)
    const auto f32 = (dweight.defined() ? dweight : dbias).options().dtype(at::kFloat);
    if (dweight.defined()) {
      part_w = empty_tensor({grid, p.n}, f32);
      p.part_w = part_w.data_ptr<float>();
    }
    if (dbias.defined()) {
      part_b = empty_tensor({grid, p.n}, f32);
      p.part_b = part_b.data_ptr<float>();
    }
  }
  launch_kernel(kernel, grid, threads, smem, stream, p);
  const dim3 sum_block(kWarpSize, kColSumRows);
  const unsigned sum_grid = grid_1d(ceil_div(p.n, kWarpSize));
  if (dweight.defined()) {
    launch_kernel(column_sum_kernel<W>, sum_grid, sum_block, 0, stream, p.part_w, grid, p.n, kVec,
                                                              dweight.data_ptr<W>());
  }
  if (dbias.defined()) {
    launch_kernel(column_sum_kernel<W>, sum_grid, sum_block, 0, stream, p.part_b, grid, p.n, kVec,
                                                              dbias.data_ptr<W>());
  }
}

template <typename T, typename W>
void layer_norm_bwd_typed(const at::Tensor& dy, const std::optional<at::Tensor>& dh,
                          const at::Tensor& h, const std::optional<at::Tensor>& weight,
                          const at::Tensor& mean, const at::Tensor& rstd, bool rms,
                          at::Tensor& dx, at::Tensor& dweight, at::Tensor& dbias) {
  BwdParams<T, W> p{};
  p.dy = dy.const_data_ptr<T>();
  p.dh = dh ? dh->const_data_ptr<T>() : nullptr;
  p.h = h.const_data_ptr<T>();
  p.weight = weight ? weight->const_data_ptr<W>() : nullptr;
  p.mean = rms ? nullptr : mean.const_data_ptr<float>();
  p.rstd = rstd.const_data_ptr<float>();
  p.dx = dx.data_ptr<T>();
  p.rows = h.size(0);
  p.dy_stride = dy.stride(0);
  p.dh_stride = dh ? dh->stride(0) : 0;
  p.h_stride = h.stride(0);
  p.n = static_cast<int>(h.size(1));
  p.inv_n = 1.f / static_cast<float>(p.n);
  p.rms = rms;
  const cudaStream_t stream = current_stream(current_device());
  constexpr int kVec = kVec16<T>;
  if (vectorizable<T, W>(p.n, {{p.dy, p.dy_stride}, {p.dh, p.dh_stride}, {p.h, p.h_stride}},
                         {p.weight})) {
    const RowGroups rg = row_groups(p.n, sizeof(T), kVec);
    if (rg.warp) {
      launch_bwd<T, W, kVec, true>(p, rg.threads, rg.groups, dweight, dbias, stream);
    } else {
      launch_bwd<T, W, kVec, false>(p, rg.threads, rg.groups, dweight, dbias, stream);
    }
  } else {
    const RowGroups rg = row_groups(p.n, sizeof(T), 1);
    if (rg.warp) {
      launch_bwd<T, W, 1, true>(p, rg.threads, rg.groups, dweight, dbias, stream);
    } else {
      launch_bwd<T, W, 1, false>(p, rg.threads, rg.groups, dweight, dbias, stream);
    }
  }
}

// The parameters' dtype: the input's, or float32 (checked by check_layer_norm_params).
bool float_params(const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias) {
  const auto& p = weight.has_value() ? weight : bias;
  return p.has_value() && p->scalar_type() == at::kFloat;
}

void check_cuda_args(std::initializer_list<std::pair<const at::Tensor*, const char*>> args) {
  for (const auto& [t, name] : args) {
    if (t != nullptr) check_cuda_tensor(*t, name);
  }
}

const at::Tensor* ptr(const std::optional<at::Tensor>& t) { return t ? &*t : nullptr; }

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> layer_norm_fwd_cuda(
    const at::Tensor& x, const std::optional<at::Tensor>& residual,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, double eps,
    bool rms) {
  check_cuda_args({{&x, "x"}, {ptr(residual), "residual"}, {ptr(weight), "weight"},
                   {ptr(bias), "bias"}});
  check_layer_norm_fwd(x, residual, weight, bias, /*allow_double=*/false);
  TORCH_CHECK(x.size(1) < std::numeric_limits<int>::max(), "x: rows of ", x.size(1),
              " elements are too long (at most 2^31 - 2)");
  const DeviceGuard device_guard(x.device());
  LayerNormFwdOutputs out = layer_norm_fwd_outputs(x, residual.has_value(), eps, rms);
  if (out.empty) return out.tuple();
  FASTATTN_DISPATCH_FLOAT_HALF_BF16(x.scalar_type(), "layer_norm_fwd_cuda", [&] {
    if (float_params(weight, bias)) {
      layer_norm_fwd_typed<scalar_t, float>(x, residual, weight, bias, eps, rms, out.y, out.h,
                                            out.mean, out.rstd);
    } else {
      layer_norm_fwd_typed<scalar_t, scalar_t>(x, residual, weight, bias, eps, rms, out.y, out.h,
                                               out.mean, out.rstd);
    }
  });
  return out.tuple();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_bwd_cuda(
    const at::Tensor& dy, const std::optional<at::Tensor>& dh, const at::Tensor& h,
    const std::optional<at::Tensor>& weight, const at::Tensor& mean, const at::Tensor& rstd,
    bool rms, std::array<bool, 2> output_mask) {
  check_cuda_args({{&dy, "dy"}, {ptr(dh), "dh"}, {&h, "h"}, {ptr(weight), "weight"},
                   {rms ? nullptr : &mean, "mean"}, {&rstd, "rstd"}});
  check_layer_norm_bwd(dy, dh, h, weight, mean, rstd, rms, /*allow_double=*/false);
  TORCH_CHECK(h.size(1) < std::numeric_limits<int>::max(), "h: rows of ", h.size(1),
              " elements are too long (at most 2^31 - 2)");
  const DeviceGuard device_guard(h.device());
  const int64_t m = h.size(0), n = h.size(1);
  at::Tensor dx = empty_tensor({m, n}, h.options());
  const bool want_dw = weight.has_value() && output_mask[0];
  const bool want_db = weight.has_value() && output_mask[1];
  at::Tensor dweight = want_dw ? empty_tensor({n}, weight->options()) : at::Tensor();
  at::Tensor dbias = want_db ? empty_tensor({n}, weight->options()) : at::Tensor();
  if (m == 0 || n == 0) {
    if (want_dw) dweight.zero_();
    if (want_db) dbias.zero_();
  } else {
    FASTATTN_DISPATCH_FLOAT_HALF_BF16(h.scalar_type(), "layer_norm_bwd_cuda", [&] {
      if (float_params(weight, std::nullopt)) {
        layer_norm_bwd_typed<scalar_t, float>(dy, dh, h, weight, mean, rstd, rms, dx, dweight,
                                              dbias);
      } else {
        layer_norm_bwd_typed<scalar_t, scalar_t>(dy, dh, h, weight, mean, rstd, rms, dx, dweight,
                                                 dbias);
      }
    });
  }
  const at::Tensor empty = empty_tensor({0}, h.options());
  return {dx, want_dw ? dweight : empty, want_db ? dbias : empty};
}

}  // namespace
}  // namespace cuda

FASTATTN_CUDA_IMPL_FWD_BWD(layer_norm)

}  // namespace fastattn
