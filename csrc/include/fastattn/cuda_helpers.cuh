// Device and launch helpers of every CUDA kernel (csrc/cuda/*.cu: softmax, ffn, attention,
// layer_norm, rope; the mma wrappers are in cuda_mma.cuh), and of extensions built against
// fastattn's headers. Included only from .cu files, and FIRST: it prepares the c10/cuda includes.
//
// Everything lives in namespace fastattn::cuda_helpers (the kernels say `using namespace` on it).
//
// - element conversion: to_float / from_float for float, c10::Half, c10::BFloat16 (fp32 math);
// - Vec<T, N>: an N-element, N*sizeof(T)-byte aligned bundle for 16-byte (or smaller) vector
//   loads and stores (32 bytes for float32 parameters beside 16-bit rows), kVec16<T> elements in
//   16 bytes; is_aligned() / strides_multiple_of() decide on the host whether a pointer and its
//   strides allow it;
// - warp, quad (the 4 lanes of an mma fragment row) and block reductions, and the (max,
//   sum-of-exp2) pair of an online softmax;
// - MaskKind and mask_additive(): how every kernel reads a user mask (bool True = keep, or any
//   floating dtype added) through its strides, as an additive value (0 / -inf for bool);
// - host: argument checks, ceil_div and grid sizes, the opt-in shared-memory limit;
// - host: everything a launcher asks of the CUDA runtime -- launch_kernel, opt_in_smem,
//   DeviceGuard, current_stream, current_device, sm_count, blocks_per_sm, static_smem_bytes --
//   and FASTATTN_DYNAMIC_SMEM for a kernel's dynamic shared memory: in one place, so that the
//   emulated build (FASTATTN_CUDA_EMULATE, cuda_emulator.h) runs the same sources on the host;
// - FASTATTN_CUDA_IMPL_FWD_BWD / FASTATTN_CUDA_IMPL_FWD: the CUDA registration of an op's _fwd /
//   _bwd schemas (or of its _fwd alone).
//
// Conventions: every global offset is int64_t; kernels that loop over rows or elements use
// grid-stride loops, so a grid capped by grid_1d() still covers any size.
#pragma once

// A CPU-only torch wheel ships the c10/cuda headers but not the CMake-generated
// c10/cuda/impl/cuda_cmake_macros.h (on Linux it only matters for Windows DLL exports). Skip it
// where it is missing so the sources compile-check (.ci/compile_cuda.py) without a CUDA torch;
// a CUDA build of torch has the file and is unaffected.
#if defined(__has_include)
#if !__has_include(<c10/cuda/impl/cuda_cmake_macros.h>) && !defined(C10_CUDA_NO_CMAKE_CONFIGURE_FILE)
#define C10_CUDA_NO_CMAKE_CONFIGURE_FILE
#endif
#endif

// The few torch headers the sources need (ATen/ATen.h would add ~5 s of nvcc's front end a
// pass, and so would ATen/ops/empty.h: fastattn/common.h makes new tensors without it; see
// below for torch/library.h).
#include <ATen/core/Tensor.h>
// Only the host pass registers the ops (FASTATTN_CUDA_IMPL_*): nvcc's device passes, one an
// architecture, skip torch/library.h and its dispatcher headers (~5 s of cicc each).
#if !defined(__CUDA_ARCH__) && !defined(FASTATTN_CUDA_EMULATE)
#include <torch/library.h>
#endif
#ifndef FASTATTN_CUDA_EMULATE
#include <c10/cuda/CUDAException.h>
#include <c10/cuda/CUDAGuard.h>
#include <c10/cuda/CUDAStream.h>
#endif
#include <c10/util/BFloat16.h>
#include <c10/util/Exception.h>
#include <c10/util/Half.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>
#include <cuda_runtime.h>

#include <cmath>
#include <cstdint>
#include <initializer_list>
#include <optional>

#ifdef FASTATTN_CUDA_EMULATE
// pybind11 and its at::Tensor casters, for the emulated module's bindings: not
// <torch/extension.h>, which adds the whole C++ frontend (~30 s more a translation unit)
#include <torch/csrc/utils/pybind.h>

#include "fastattn/cuda_emulator.h"  // the host build that runs the kernels in CI (no GPU)
#endif

namespace fastattn {
namespace cuda_helpers {

constexpr float kLog2e = 1.4426950408889634f;
constexpr float kLn2 = 0.6931471805599453f;
constexpr int kWarpSize = 32;
// Grid sizes are capped here; kernels cover the rest with grid-stride loops.
constexpr int64_t kMaxGridX = int64_t{1} << 30;

__host__ __device__ constexpr int64_t ceil_div(int64_t a, int64_t b) { return (a + b - 1) / b; }

// -------------------------------------------------------------------------------------------
// Element conversion (all arithmetic is float32).

__device__ __forceinline__ float to_float(float x) { return x; }
__device__ __forceinline__ float to_float(c10::Half x) { return static_cast<float>(x); }
__device__ __forceinline__ float to_float(c10::BFloat16 x) { return static_cast<float>(x); }

template <typename T>
__device__ __forceinline__ T from_float(float x);
template <>
__device__ __forceinline__ float from_float<float>(float x) { return x; }
template <>
__device__ __forceinline__ c10::Half from_float<c10::Half>(float x) { return c10::Half(x); }
template <>
__device__ __forceinline__ c10::BFloat16 from_float<c10::BFloat16>(float x) {
  return c10::BFloat16(x);
}

// -------------------------------------------------------------------------------------------
// Vector bundles. Vec<T, N> is N elements aligned to N * sizeof(T) bytes, so one load/store
// instruction moves it (two for 32 bytes) when the address is aligned to that size. At most 32
// bytes: layer_norm.cu reads float32 weight / bias vectors of as many elements (kVec16<T>) as a
// 16-byte vector of its 16-bit rows.

template <typename T, int N>
struct alignas(sizeof(T) * N) Vec {
  static_assert(N >= 1 && (N & (N - 1)) == 0, "Vec length must be a power of two");
  static_assert(sizeof(T) * N <= 32, "Vec must fit in 32 bytes");
  T v[N];
};

// Elements of T in one 16-byte vector.
template <typename T>
constexpr int kVec16 = static_cast<int>(16 / sizeof(T));

template <typename T, int N>
__device__ __forceinline__ Vec<T, N> load_vec(const T* p) {
  return *reinterpret_cast<const Vec<T, N>*>(p);
}
template <typename T, int N>
__device__ __forceinline__ void store_vec(T* p, const Vec<T, N>& v) {
  *reinterpret_cast<Vec<T, N>*>(p) = v;
}

// Whether `ptr` is `bytes`-aligned (host or device).
__host__ __device__ inline bool is_aligned(const void* ptr, int64_t bytes) {
  return reinterpret_cast<uintptr_t>(ptr) % static_cast<uintptr_t>(bytes) == 0;
}
// Host: whether every stride (in elements) is a multiple of n, so n-element vectors stay aligned
// from row to row.
inline bool strides_multiple_of(std::initializer_list<int64_t> strides, int64_t n) {
  for (int64_t s : strides) {
    if (s % n != 0) return false;
  }
  return true;
}

// Whether x is NaN, from its bits (independent of any fast-math assumption).
__device__ __forceinline__ bool is_nan(float x) {
  return (__float_as_uint(x) & 0x7fffffffu) > 0x7f800000u;
}

// max that propagates a NaN (fmaxf drops it).
__device__ __forceinline__ float max_nan(float a, float b) {
  return is_nan(a) || is_nan(b) ? NAN : fmaxf(a, b);
}

// -------------------------------------------------------------------------------------------
// Reductions. Warp and quad reductions need all 32 lanes to take part (full mask); every lane
// gets the same, bitwise identical result.

__device__ __forceinline__ float warp_sum(float v) {
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o >>= 1) v += __shfl_xor_sync(0xffffffffu, v, o);
  return v;
}
__device__ __forceinline__ float warp_max(float v) {
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o >>= 1) v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// The warp's max, a NaN in any lane included.
__device__ __forceinline__ float warp_max_nan(float v) {
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o >>= 1) v = max_nan(v, __shfl_xor_sync(0xffffffffu, v, o));
  return v;
}
// Over the 4 lanes of a quad (lanes 4g .. 4g+3): the lanes holding one row of an mma fragment.
__device__ __forceinline__ float quad_sum(float v) {
  v += __shfl_xor_sync(0xffffffffu, v, 1);
  v += __shfl_xor_sync(0xffffffffu, v, 2);
  return v;
}
__device__ __forceinline__ float quad_max(float v) {
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 1));
  v = fmaxf(v, __shfl_xor_sync(0xffffffffu, v, 2));
  return v;
}

// The state of an online softmax in log2 units: m = running max of the scores, l = sum of
// exp2(s - m). m = -inf and l = 0 is the empty state (nothing attended yet).
struct MaxSum {
  float m;
  float l;
};

__device__ __forceinline__ MaxSum max_sum_combine(MaxSum a, MaxSum b) {
  const float m = fmaxf(a.m, b.m);
  if (m == -INFINITY) return {m, 0.f};  // both empty: avoid exp2(-inf - -inf) = NaN
  return {m, a.l * exp2f(a.m - m) + b.l * exp2f(b.m - m)};
}

__device__ __forceinline__ MaxSum warp_max_sum(MaxSum v) {
#pragma unroll
  for (int o = kWarpSize / 2; o > 0; o >>= 1) {
    MaxSum other{__shfl_xor_sync(0xffffffffu, v.m, o), __shfl_xor_sync(0xffffffffu, v.l, o)};
    v = max_sum_combine(v, other);
  }
  return v;
}

// Block-wide reductions: every thread of the block must call them (they synchronize), blockDim.x
// a multiple of 32, and every thread gets the result (the warps' values added in warp order:
// deterministic, bitwise identical in every thread). `scratch` needs kWarpSize floats of shared
// memory, not in use by other code at the call; the function ends with a barrier, so the same
// scratch may be reused (by the next call or anything else) right after.
__device__ __forceinline__ float block_sum(float v, float* scratch) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int nwarps = static_cast<int>(blockDim.x) / kWarpSize;
  v = warp_sum(v);
  if (lane == 0) scratch[warp] = v;
  __syncthreads();
  float total = 0.f;
  for (int w = 0; w < nwarps; ++w) total += scratch[w];  // fixed order: deterministic
  __syncthreads();
  return total;
}

__device__ __forceinline__ MaxSum block_max_sum(MaxSum v, float* scratch_m, float* scratch_l) {
  const int lane = threadIdx.x % kWarpSize, warp = threadIdx.x / kWarpSize;
  const int nwarps = static_cast<int>(blockDim.x) / kWarpSize;
  v = warp_max_sum(v);
  if (lane == 0) {
    scratch_m[warp] = v.m;
    scratch_l[warp] = v.l;
  }
  __syncthreads();
  MaxSum total{-INFINITY, 0.f};
  for (int w = 0; w < nwarps; ++w) total = max_sum_combine(total, MaxSum{scratch_m[w], scratch_l[w]});
  __syncthreads();
  return total;
}

// -------------------------------------------------------------------------------------------
// User masks, read element by element through their strides (broadcast dims have stride 0).

enum class MaskKind : int { kNone = 0, kBool, kHalf, kBFloat16, kFloat, kDouble };

inline MaskKind mask_kind_of(const std::optional<at::Tensor>& mask) {
  if (!mask.has_value()) return MaskKind::kNone;
  switch (mask->scalar_type()) {
    case at::kBool: return MaskKind::kBool;
    case at::kHalf: return MaskKind::kHalf;
    case at::kBFloat16: return MaskKind::kBFloat16;
    case at::kFloat: return MaskKind::kFloat;
    case at::kDouble: return MaskKind::kDouble;
    default:
      TORCH_CHECK(false, "mask must be bool, float16, bfloat16, float32 or float64, got ",
                  mask->scalar_type(), " (shape ", mask->sizes(), ")");
  }
  return MaskKind::kNone;
}

// The mask element at `off` as an additive score term in natural units: a bool mask gives 0
// (True, keep) or -inf; a float mask its value. kNone gives 0. The branch is uniform over a
// launch, so it costs no divergence.
__device__ __forceinline__ float mask_additive(const void* base, MaskKind kind, int64_t off) {
  switch (kind) {
    case MaskKind::kBool:
      return reinterpret_cast<const uint8_t*>(base)[off] != 0 ? 0.f : -INFINITY;
    case MaskKind::kHalf:
      return static_cast<float>(reinterpret_cast<const c10::Half*>(base)[off]);
    case MaskKind::kBFloat16:
      return static_cast<float>(reinterpret_cast<const c10::BFloat16*>(base)[off]);
    case MaskKind::kFloat:
      return reinterpret_cast<const float*>(base)[off];
    case MaskKind::kDouble:
      return static_cast<float>(reinterpret_cast<const double*>(base)[off]);
    default:
      return 0.f;
  }
}

// -------------------------------------------------------------------------------------------
// Host: checks, device limits and launch sizes.

#ifndef FASTATTN_CUDA_EMULATE
inline void check_cuda_tensor(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cuda(), name, " must be a CUDA tensor, got device ", t.device(), " (shape ",
              t.sizes(), ")");
}

// The largest dynamic shared memory a block may opt in to on `device`.
inline int max_smem_optin(int device) {
  int n = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&n, cudaDevAttrMaxSharedMemoryPerBlockOptin, device));
  return n;
}

// Makes the tensor's device current for the op's scope.
using DeviceGuard = c10::cuda::CUDAGuard;

// The stream the op's kernels run on.
inline cudaStream_t current_stream(int device) {
  return c10::cuda::getCurrentCUDAStream(device).stream();
}

// kernel<<<grid, block, smem, stream>>>(args...), checked.
template <typename... KArgs, typename... Args>
void launch_kernel(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem,
                   cudaStream_t stream, const Args&... args) {
  kernel<<<grid, block, smem, stream>>>(args...);
  C10_CUDA_KERNEL_LAUNCH_CHECK();
}

// Lets `kernel` take `bytes` of dynamic shared memory (needed above 48 KiB with its static).
template <typename Kernel>
void opt_in_smem(Kernel kernel, int64_t bytes) {
  C10_CUDA_CHECK(cudaFuncSetAttribute(kernel, cudaFuncAttributeMaxDynamicSharedMemorySize,
                                      static_cast<int>(bytes)));
}

// The kernel's static shared memory, and how many of its blocks fit on one SM at once.
template <typename Kernel>
int64_t static_smem_bytes(Kernel kernel) {
  cudaFuncAttributes attr{};
  C10_CUDA_CHECK(cudaFuncGetAttributes(&attr, kernel));
  return static_cast<int64_t>(attr.sharedSizeBytes);
}
template <typename Kernel>
int blocks_per_sm(Kernel kernel, int threads, int64_t smem_bytes) {
  int per_sm = 0;
  C10_CUDA_CHECK(cudaOccupancyMaxActiveBlocksPerMultiprocessor(&per_sm, kernel, threads,
                                                               static_cast<size_t>(smem_bytes)));
  return per_sm;
}
inline int sm_count(int device) {
  int sms = 0;
  C10_CUDA_CHECK(cudaDeviceGetAttribute(&sms, cudaDevAttrMultiProcessorCount, device));
  return sms;
}
inline int current_device() { return c10::cuda::current_device(); }
#else
// The emulated build (cuda_emulator.h): the "device" is the CPU, H100 limits, launches run on
// the host.
inline void check_cuda_tensor(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_cpu(), name, " must be a CPU tensor for the emulated CUDA kernels, got device ",
              t.device(), " (shape ", t.sizes(), ")");
}
inline int max_smem_optin(int) { return ::fastattn::emulator::kSmemOptin; }
struct DeviceGuard {
  explicit DeviceGuard(c10::Device) {}
};
inline cudaStream_t current_stream(int) { return nullptr; }
template <typename... KArgs, typename... Args>
void launch_kernel(void (*kernel)(KArgs...), dim3 grid, dim3 block, size_t smem, cudaStream_t,
                   const Args&... args) {
  ::fastattn::emulator::launch(kernel, grid, block, smem, args...);
}
template <typename Kernel>
void opt_in_smem(Kernel, int64_t) {}
template <typename Kernel>
int64_t static_smem_bytes(Kernel) {
  return 0;  // static __shared__ arrays live outside the emulated block's dynamic memory
}
template <typename Kernel>
int blocks_per_sm(Kernel, int threads, int64_t smem_bytes) {  // the H100's limits
  const int by_threads = 2048 / std::max(threads, 1);
  const int by_smem = smem_bytes > 0 ? static_cast<int>(233472 / (smem_bytes + 1024)) : 32;
  return std::max(0, std::min({by_threads, by_smem, 32}));
}
inline int sm_count(int) { return 132; }
inline int current_device() { return 0; }
#endif

// A 1-D grid of `blocks` blocks, at least 1 and at most kMaxGridX: kernels launched with it either
// loop over their work with a grid-stride loop or never need more than kMaxGridX blocks.
inline unsigned grid_1d(int64_t blocks) {
  if (blocks < 1) blocks = 1;
  return static_cast<unsigned>(blocks < kMaxGridX ? blocks : kMaxGridX);
}

}  // namespace cuda_helpers
}  // namespace fastattn

// The block's dynamic shared memory as `TYPE NAME[]`, 16-byte aligned.
#ifndef FASTATTN_CUDA_EMULATE
#define FASTATTN_DYNAMIC_SMEM(TYPE, NAME) extern __shared__ __align__(16) TYPE NAME[]
#else
#define FASTATTN_DYNAMIC_SMEM(TYPE, NAME) \
  TYPE* const NAME = reinterpret_cast<TYPE*>(::fastattn::emulator::block().smem_base)
#endif

// Registers cuda::NAME_fwd_cuda and cuda::NAME_bwd_cuda (defined in the including file, inside
// namespace fastattn) as the CUDA kernels of the schemas NAME_fwd and NAME_bwd of
// csrc/fastattn.cpp. Used at namespace fastattn scope, once per op. The emulated build defines
// fastattn::emulated_NAME(module) instead, which binds them as NAME_fwd / NAME_bwd of the
// emulated module (csrc/emulate/module.cpp). FASTATTN_CUDA_IMPL_FWD: the same for an op with a
// forward only (rope, paged_attention).
#if defined(__CUDA_ARCH__) && !defined(FASTATTN_CUDA_EMULATE)
// (a device pass: no registration, only a mention, so that cicc does not warn that the host
// functions are never referenced)
#define FASTATTN_CUDA_IMPL_FWD_BWD(NAME) \
  inline void device_pass_##NAME() {      \
    (void)&cuda::NAME##_fwd_cuda;         \
    (void)&cuda::NAME##_bwd_cuda;         \
  }
#define FASTATTN_CUDA_IMPL_FWD(NAME) \
  inline void device_pass_##NAME() { (void)&cuda::NAME##_fwd_cuda; }
#elif !defined(FASTATTN_CUDA_EMULATE)
#define FASTATTN_CUDA_IMPL_FWD_BWD(NAME)             \
  TORCH_LIBRARY_IMPL(fastattn, CUDA, m) {             \
    m.impl(#NAME "_fwd", &cuda::NAME##_fwd_cuda);     \
    m.impl(#NAME "_bwd", &cuda::NAME##_bwd_cuda);     \
  }
#define FASTATTN_CUDA_IMPL_FWD(NAME) \
  TORCH_LIBRARY_IMPL(fastattn, CUDA, m) { m.impl(#NAME "_fwd", &cuda::NAME##_fwd_cuda); }
#else
#define FASTATTN_CUDA_IMPL_FWD_BWD(NAME)                  \
  void emulated_##NAME(pybind11::module& m) {              \
    m.def(#NAME "_fwd", &cuda::NAME##_fwd_cuda);           \
    m.def(#NAME "_bwd", &cuda::NAME##_bwd_cuda);           \
  }
#define FASTATTN_CUDA_IMPL_FWD(NAME) \
  void emulated_##NAME(pybind11::module& m) { m.def(#NAME "_fwd", &cuda::NAME##_fwd_cuda); }
#endif
