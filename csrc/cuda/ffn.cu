// Feed-forward block out = act(x w1^T + b1) w2^T + b2 and its backward (CUDA backend):
// fastattn::ffn_fwd / ffn_bwd.
//
// Math (nn.Linear layout; gated activations split the first layer's output as [gate, up]):
//
//   forward   pre = x w1^T + b1                 (M, F), or (M, 2F) for swiglu / geglu
//             a   = act(pre)                    elementwise; gated: f(gate) * up
//             out = a w2^T + b2                 (M, D2)
//   backward  da   = dout w2                    (M, F)
//             dpre = da * act'(pre)             gated: [da * up * f'(gate), da * f(gate)]
//             dx = dpre w1,  dw1 = dpre^T x,  db1 = colsum(dpre)
//             dw2 = dout^T a,                   db2 = colsum(dout)
//
// Activations: gelu (exact, erf), gelu_tanh, relu, silu; gated swiglu (f = silu) and geglu
// (f = gelu).
//
// What runs where:
// - every matmul goes through ATen (at::mm / at::addmm -> cuBLAS / cuBLASLt) with float32
//   accumulation. The biases are fused into the GEMMs with at::addmm (cuBLASLt's bias epilogue
//   where torch uses it; otherwise beta = 1 on a broadcast copy: one rounding either way).
//   cuBLASLt's fused bias + GELU epilogue (at::_addmm_activation) is NOT used: backward needs the
//   pre-activation, and that epilogue only returns the activated output (a second GEMM output
//   would be needed), so the activation is our own kernel;
// - our kernels (all float32 math, one rounding to the storage dtype at the store):
//   * act_fwd: pre -> a (gated: reads the gate and up halves of each row, writes half the width);
//     forward applies act to pre as stored (rounded), so backward's recomputation matches;
//   * act_bwd: (da, pre) -> (dpre, a): the activation derivative and the recomputed activation
//     (the operand of dw2 = dout^T a) in one pass, so `a` is never kept between fwd and bwd;
//   * colsum: the bias gradients, a deterministic two-stage column reduction without atomics:
//     stage 1 sums fixed 256-row chunks of every column into a float32 (chunks, N) buffer, one
//     block per (32 columns, chunk), rows split over 8 thread rows and combined in a fixed order;
//     stage 2 sums each column's chunks in order. Same bits on every run.
// Elementwise kernels move 16-byte vectors when the widths, base pointers and row strides allow
// it, else one element per thread; both grid-stride over int64 indices.
//
// Limits: x, w1, w2, biases, dout and pre share one dtype: float32, float16 or bfloat16.
// float32 GEMMs follow torch's TF32 setting (torch.backends.cuda.matmul.allow_tf32, off by
// default). Any M (including 0), D, F, D2.
#include "fastattn/cuda_helpers.cuh"  // first: it prepares the c10/cuda includes
#include "fastattn/activation.h"

#include <array>
#include <string>
#include <tuple>
#include <type_traits>

#include "fastattn/common.h"

namespace fastattn {
namespace cuda {
namespace {

using namespace ::fastattn::cuda_helpers;

constexpr float kSqrt1_2 = 0.70710678118654752f;      // 1 / sqrt(2)
constexpr float kInvSqrt2Pi = 0.39894228040143268f;   // 1 / sqrt(2 pi)
constexpr float kSqrt2OverPi = 0.79788456080286536f;  // sqrt(2 / pi)
constexpr float kGeluTanhC = 0.044715f;

// exp and tanh to a few ulp. setup.py's --use_fast_math (for the attention kernels) makes
// tanhf the tanh.approx instruction (relative error about 2^-11) and expf __expf (error growing
// with |x|): on the first GPU run (H200, 2026-11-26) float32 FFN gradients through gelu_tanh,
// silu and swiglu came out 2-8 times less accurate than torch's. These cost nothing in a
// memory-bound kernel.
__device__ __forceinline__ float exp_accurate(float x) {
  constexpr float kLog2e = 1.44269502162933349609375f;  // log2(e) rounded to float
  constexpr float kLog2eLo = 1.9259629911266175e-08f;   // log2(e) - kLog2e
  x = fminf(fmaxf(x, -104.f), 88.f);                    // 2^t stays finite, err too
  const float t = x * kLog2e;
  const float err = fmaf(x, kLog2e, -t) + x * kLog2eLo;  // x log2(e) - t, |err| < 2^-17
  const float e = exp2f(t);                              // ex2.approx: 2 ulp
  return fmaf(e, err * 0.693147180559945309f, e);        // 2^(t + err) = 2^t (1 + err ln 2)
}

// tanh(u) = 1 - 2 / (e^2u + 1): absolute error of a few 1e-8, which is what gelu and silu need
// (they add it to 1); |u| > 15 rounds to +-1 in float32 anyway.
__device__ __forceinline__ float tanh_accurate(float u) {
  const float e = exp_accurate(2.f * fminf(fmaxf(u, -15.f), 15.f));
  return 1.f - 2.f * __frcp_rn(e + 1.f);
}

// f(h) and f'(h) of the elementwise activation ACT (float32).
template <int ACT>
__device__ __forceinline__ float act_f(float h) {
  if constexpr (ACT == kGelu) {
    return 0.5f * h * (1.f + erff(h * kSqrt1_2));
  } else if constexpr (ACT == kGeluTanh) {
    return 0.5f * h * (1.f + tanh_accurate(kSqrt2OverPi * (h + kGeluTanhC * h * h * h)));
  } else if constexpr (ACT == kRelu) {
    return h > 0.f ? h : 0.f;
  } else {
    return h * (0.5f + 0.5f * tanh_accurate(0.5f * h));  // h * sigmoid(h), no exp overflow
  }
}

template <int ACT>
__device__ __forceinline__ void act_f_df(float h, float& f, float& df) {
  if constexpr (ACT == kGelu) {
    const float cdf = 0.5f * (1.f + erff(h * kSqrt1_2));
    f = h * cdf;
    df = cdf + h * kInvSqrt2Pi * exp_accurate(-0.5f * h * h);
  } else if constexpr (ACT == kGeluTanh) {
    const float t = tanh_accurate(kSqrt2OverPi * (h + kGeluTanhC * h * h * h));
    f = 0.5f * h * (1.f + t);
    df = 0.5f * (1.f + t) +
         0.5f * h * (1.f - t * t) * kSqrt2OverPi * (1.f + 3.f * kGeluTanhC * h * h);
  } else if constexpr (ACT == kRelu) {
    f = h > 0.f ? h : 0.f;
    df = h > 0.f ? 1.f : 0.f;
  } else {
    const float s = 0.5f + 0.5f * tanh_accurate(0.5f * h);
    f = h * s;
    df = s * (1.f + h * (1.f - s));
  }
}

// ---------------------------------------------------------------------------------------------
// Elementwise kernels over (M, F) in VEC-wide pieces: piece idx covers row idx / (F / VEC),
// columns [c, c + VEC) with c = (idx % (F / VEC)) * VEC. The host guarantees F % VEC == 0 and
// VEC * sizeof(T)-byte alignment of every row start used.

struct ActParams {
  const void* pre;  // (M, F1), row stride pre_stride; F1 = 2F when gated
  const void* da;   // backward: (M, F) contiguous
  void* a;          // (M, F) contiguous
  void* dpre;       // backward: (M, F1) contiguous
  int64_t M, F, pre_stride;
};

// Calls piece(row, c) for every piece of this thread (a grid-stride loop over all M * F / VEC).
template <int VEC, typename Piece>
__device__ __forceinline__ void for_each_piece(const ActParams& p, Piece&& piece) {
  const int64_t pieces_per_row = p.F / VEC;
  const int64_t total = p.M * pieces_per_row;
  for (int64_t idx = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; idx < total;
       idx += int64_t{gridDim.x} * blockDim.x) {
    piece(idx / pieces_per_row, (idx % pieces_per_row) * VEC);
  }
}

template <typename T, int ACT, bool GATED, int VEC>
__global__ void __launch_bounds__(256) act_fwd_kernel(ActParams p) {
  const T* pre = static_cast<const T*>(p.pre);
  T* a = static_cast<T*>(p.a);
  for_each_piece<VEC>(p, [&](int64_t row, int64_t c) {
    const T* src = pre + row * p.pre_stride + c;
    const Vec<T, VEC> h = load_vec<T, VEC>(src);
    Vec<T, VEC> out;
    if constexpr (GATED) {
      const Vec<T, VEC> up = load_vec<T, VEC>(src + p.F);
#pragma unroll
      for (int e = 0; e < VEC; ++e) out.v[e] = from_float<T>(act_f<ACT>(to_float(h.v[e])) * to_float(up.v[e]));
    } else {
#pragma unroll
      for (int e = 0; e < VEC; ++e) out.v[e] = from_float<T>(act_f<ACT>(to_float(h.v[e])));
    }
    store_vec<T, VEC>(a + row * p.F + c, out);
  });
}

template <typename T, int ACT, bool GATED, int VEC>
__global__ void __launch_bounds__(256) act_bwd_kernel(ActParams p) {
  const int64_t F1 = GATED ? 2 * p.F : p.F;
  const T* pre = static_cast<const T*>(p.pre);
  const T* da = static_cast<const T*>(p.da);
  T* a = static_cast<T*>(p.a);
  T* dpre = static_cast<T*>(p.dpre);
  for_each_piece<VEC>(p, [&](int64_t row, int64_t c) {
    const T* src = pre + row * p.pre_stride + c;
    const Vec<T, VEC> h = load_vec<T, VEC>(src);
    const Vec<T, VEC> g = load_vec<T, VEC>(da + row * p.F + c);
    Vec<T, VEC> out_a, out_d;
    if constexpr (GATED) {
      const Vec<T, VEC> up = load_vec<T, VEC>(src + p.F);
      Vec<T, VEC> out_du;
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        float f, df;
        act_f_df<ACT>(to_float(h.v[e]), f, df);
        const float u = to_float(up.v[e]), gv = to_float(g.v[e]);
        out_a.v[e] = from_float<T>(f * u);
        out_d.v[e] = from_float<T>(gv * u * df);
        out_du.v[e] = from_float<T>(gv * f);
      }
      store_vec<T, VEC>(dpre + row * F1 + p.F + c, out_du);
    } else {
#pragma unroll
      for (int e = 0; e < VEC; ++e) {
        float f, df;
        act_f_df<ACT>(to_float(h.v[e]), f, df);
        out_a.v[e] = from_float<T>(f);
        out_d.v[e] = from_float<T>(to_float(g.v[e]) * df);
      }
    }
    store_vec<T, VEC>(dpre + row * F1 + c, out_d);
    store_vec<T, VEC>(a + row * p.F + c, out_a);
  });
}

// ---------------------------------------------------------------------------------------------
// Deterministic column sums: out[n] = sum_m in[m, n] (float32 accumulation, fixed order).

constexpr int kColTile = 32;     // columns per stage-1 block (threadIdx.x)
constexpr int kColRowThreads = 8;  // thread rows per stage-1 block (threadIdx.y)
constexpr int64_t kChunkRows = 256;  // rows per partial sum
constexpr int kMaxGridY = 65535;

template <typename T>
__global__ void __launch_bounds__(kColTile * kColRowThreads)
    colsum_partial_kernel(const T* __restrict__ in, int64_t M, int64_t N, int64_t row_stride,
                          float* __restrict__ partial, int64_t num_chunks) {
  __shared__ float red[kColRowThreads][kColTile + 1];
  const int tx = threadIdx.x, ty = threadIdx.y;
  for (int64_t tile = blockIdx.x; tile * kColTile < N; tile += gridDim.x) {
    const int64_t col = tile * kColTile + tx;
    for (int64_t chunk = blockIdx.y; chunk < num_chunks; chunk += gridDim.y) {
      const int64_t r0 = chunk * kChunkRows;
      const int64_t r1 = r0 + kChunkRows < M ? r0 + kChunkRows : M;
      float acc = 0.f;
      if (col < N) {
        for (int64_t r = r0 + ty; r < r1; r += kColRowThreads) acc += to_float(in[r * row_stride + col]);
      }
      red[ty][tx] = acc;
      __syncthreads();
      if (ty == 0 && col < N) {
        float s = 0.f;
#pragma unroll
        for (int k = 0; k < kColRowThreads; ++k) s += red[k][tx];
        partial[chunk * N + col] = s;
      }
      __syncthreads();  // red is rewritten by the next chunk
    }
  }
}

template <typename T>
__global__ void __launch_bounds__(256)
    colsum_final_kernel(const float* __restrict__ partial, int64_t num_chunks, int64_t N, T* __restrict__ out) {
  for (int64_t col = int64_t{blockIdx.x} * blockDim.x + threadIdx.x; col < N;
       col += int64_t{gridDim.x} * blockDim.x) {
    float s = 0.f;
    for (int64_t c = 0; c < num_chunks; ++c) s += partial[c * N + col];
    out[col] = from_float<T>(s);
  }
}

// Column sums of the (M, N) row matrix `in` (unit column stride) in `in`'s dtype.
at::Tensor column_sum(const at::Tensor& in, cudaStream_t stream) {
  const int64_t M = in.size(0), N = in.size(1);
  at::Tensor out = empty_tensor({N}, in.options());
  if (N == 0) return out;
  if (M == 0) return out.zero_();
  const int64_t num_chunks = ceil_div(M, kChunkRows);
  at::Tensor partial = empty_tensor({num_chunks, N}, in.options().dtype(at::kFloat));
  const dim3 block(kColTile, kColRowThreads);
  const dim3 grid(grid_1d(ceil_div(N, kColTile)),
                  static_cast<unsigned>(num_chunks < kMaxGridY ? num_chunks : kMaxGridY));
  FASTATTN_DISPATCH_FLOAT_HALF_BF16(in.scalar_type(), "ffn_column_sum_cuda", [&] {
    launch_kernel(colsum_partial_kernel<scalar_t>, grid, block, 0, stream,
                  in.const_data_ptr<scalar_t>(), M, N, in.stride(0), partial.data_ptr<float>(),
                  num_chunks);
    launch_kernel(colsum_final_kernel<scalar_t>, grid_1d(ceil_div(N, 256)), 256, 0, stream,
                  partial.const_data_ptr<float>(), num_chunks, N, out.data_ptr<scalar_t>());
  });
  return out;
}

// ---------------------------------------------------------------------------------------------
// Launchers of the elementwise kernels: dispatch on dtype, activation, gating and vector width.

template <typename Fn>
void with_activation(ActSpec spec, Fn&& fn) {
  switch (spec.act) {
    case kGelu: fn(std::integral_constant<int, kGelu>{}); break;
    case kGeluTanh: fn(std::integral_constant<int, kGeluTanh>{}); break;
    case kRelu: fn(std::integral_constant<int, kRelu>{}); break;
    case kSilu: fn(std::integral_constant<int, kSilu>{}); break;
  }
}

// 16-byte vectors when every row start of every operand is 16-byte aligned.
bool act_vec_ok(const ActParams& p, int64_t elem_size) {
  const int64_t V = 16 / elem_size;
  const bool ptrs = is_aligned(p.pre, 16) && is_aligned(p.a, 16) &&
                    (p.da == nullptr || is_aligned(p.da, 16)) &&
                    (p.dpre == nullptr || is_aligned(p.dpre, 16));
  return ptrs && p.F % V == 0 && p.pre_stride % V == 0;
}

void launch_act(const ActParams& p, ActSpec spec, bool backward, at::ScalarType dtype,
                int64_t elem_size, cudaStream_t stream) {
  if (p.M == 0 || p.F == 0) return;
  const bool vec = act_vec_ok(p, elem_size);
  FASTATTN_DISPATCH_FLOAT_HALF_BF16(dtype, "ffn_activation_cuda", [&] {
    constexpr int V = kVec16<scalar_t>;
    with_activation(spec, [&](auto act_const) {
      constexpr int ACT = decltype(act_const)::value;
      auto go = [&](auto gated_const, auto vec_const) {
        constexpr bool GATED = decltype(gated_const)::value;
        constexpr int VEC = decltype(vec_const)::value;
        const unsigned grid = grid_1d(ceil_div(p.M * (p.F / VEC), 256));
        if (backward) {
          launch_kernel(act_bwd_kernel<scalar_t, ACT, GATED, VEC>, grid, 256, 0, stream, p);
        } else {
          launch_kernel(act_fwd_kernel<scalar_t, ACT, GATED, VEC>, grid, 256, 0, stream, p);
        }
      };
      using True = std::true_type;
      using False = std::false_type;
      using VecN = std::integral_constant<int, V>;
      using Vec1 = std::integral_constant<int, 1>;
      if (spec.gated) {
        vec ? go(True{}, VecN{}) : go(True{}, Vec1{});
      } else {
        vec ? go(False{}, VecN{}) : go(False{}, Vec1{});
      }
    });
  });
}

// ---------------------------------------------------------------------------------------------
// The ops.

void check_matrix(const at::Tensor& t, const char* name, const at::Tensor& x) {
  check_cuda_tensor(t, name);
  check_device(t, x, name, "x");
  TORCH_CHECK(t.dim() == 2, name, " must be 2-D, got shape ", t.sizes());
  check_dtype(t, x.scalar_type(), name);
}

int64_t hidden_width(const at::Tensor& w1, ActSpec spec, const std::string& activation) {
  if (spec.gated) {
    TORCH_CHECK(w1.size(0) % 2 == 0, activation,
                " needs w1 with an even number of rows ([gate; up]), got shape ", w1.sizes());
    return w1.size(0) / 2;
  }
  return w1.size(0);
}

// The checks ffn_fwd and ffn_bwd share: x a CUDA (M, D) matrix of a float dtype (not float64),
// w1 and w2 matrices beside it. Returns the activation's spec.
ActSpec check_ffn_inputs(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2,
                         const std::string& activation) {
  const ActSpec spec = parse_activation(activation);
  check_cuda_tensor(x, "x");
  check_rows(x, "x");
  check_float_dtype(x, "x", /*allow_double=*/false);
  check_matrix(w1, "w1", x);
  check_matrix(w2, "w2", x);
  return spec;
}

std::tuple<at::Tensor, at::Tensor> ffn_fwd_cuda(const at::Tensor& x, const at::Tensor& w1,
                                                const std::optional<at::Tensor>& b1,
                                                const at::Tensor& w2,
                                                const std::optional<at::Tensor>& b2,
                                                c10::string_view activation_sv) {
  const std::string activation(activation_sv);
  const ActSpec spec = check_ffn_inputs(x, w1, w2, activation);
  const int64_t M = x.size(0), D = x.size(1), F1 = w1.size(0), D2 = w2.size(0);
  const int64_t F = hidden_width(w1, spec, activation);
  TORCH_CHECK(w1.size(1) == D, "w1 must have shape (", spec.gated ? "2F" : "F", ", ", D,
              ") for x of shape ", x.sizes(), ", got ", w1.sizes());
  TORCH_CHECK(w2.size(1) == F, "w2 must have shape (D2, ", F, ") for w1 of shape ", w1.sizes(),
              " and activation ", activation, ", got ", w2.sizes());
  for (const auto& [b, name, n] : {std::tuple{&b1, "b1", F1}, std::tuple{&b2, "b2", D2}}) {
    if (!b->has_value()) continue;
    check_cuda_tensor(**b, name);
    check_device(**b, x, name, "x");
    check_shape(**b, {n}, name);
    check_dtype(**b, x.scalar_type(), name);
  }
  const DeviceGuard guard(x.device());
  const cudaStream_t stream = current_stream(x.device().index());

  at::Tensor pre = b1.has_value() ? addmm_call(*b1, x, w1.t()) : mm_call(x, w1.t());
  at::Tensor a = empty_tensor({M, F}, x.options());
  ActParams p{};
  p.pre = pre.data_ptr();
  p.a = a.data_ptr();
  p.M = M;
  p.F = F;
  p.pre_stride = pre.stride(0);
  TORCH_CHECK(pre.dim() == 2 && (F1 <= 1 || pre.stride(1) == 1),
              "ffn_fwd: internal error, pre-activation is not row-major");
  launch_act(p, spec, /*backward=*/false, x.scalar_type(), x.element_size(), stream);
  at::Tensor out = b2.has_value() ? addmm_call(*b2, a, w2.t()) : mm_call(a, w2.t());
  return {out, pre};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> ffn_bwd_cuda(
    const at::Tensor& dout, const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2,
    const at::Tensor& pre, c10::string_view activation_sv, std::array<bool, 2> output_mask) {
  const std::string activation(activation_sv);
  const ActSpec spec = check_ffn_inputs(x, w1, w2, activation);
  check_matrix(dout, "dout", x);
  check_matrix(pre, "pre", x);
  check_rows(pre, "pre");
  check_rows(dout, "dout");
  const int64_t M = x.size(0), D = x.size(1), F1 = w1.size(0), D2 = w2.size(0);
  const int64_t F = hidden_width(w1, spec, activation);
  TORCH_CHECK(w1.size(1) == D, "w1 must have shape (", F1, ", ", D, ") for x of shape ",
              x.sizes(), ", got ", w1.sizes());
  TORCH_CHECK(w2.size(1) == F, "w2 must have shape (", D2, ", ", F, "), got ", w2.sizes());
  check_shape(dout, {M, D2}, "dout");
  check_shape(pre, {M, F1}, "pre");
  const DeviceGuard guard(x.device());
  const cudaStream_t stream = current_stream(x.device().index());

  at::Tensor da = mm_call(dout, w2);  // (M, F), row-major
  at::Tensor da_c = da.is_contiguous() ? da : da.contiguous();
  at::Tensor dpre = empty_tensor({M, F1}, x.options());
  at::Tensor a = empty_tensor({M, F}, x.options());
  ActParams p{};
  p.pre = pre.data_ptr();
  p.da = da_c.data_ptr();
  p.a = a.data_ptr();
  p.dpre = dpre.data_ptr();
  p.M = M;
  p.F = F;
  p.pre_stride = pre.stride(0);
  launch_act(p, spec, /*backward=*/true, x.scalar_type(), x.element_size(), stream);

  at::Tensor dx = mm_call(dpre, w1);
  at::Tensor dw1 = mm_call(dpre.t(), x);
  at::Tensor dw2 = mm_call(dout.t(), a);
  at::Tensor db1 = output_mask[0] ? column_sum(dpre, stream) : empty_tensor({0}, w1.options());
  at::Tensor db2 = output_mask[1] ? column_sum(dout, stream) : empty_tensor({0}, w2.options());
  return {dx, dw1, db1, dw2, db2};
}

}  // namespace
}  // namespace cuda

FASTATTN_CUDA_IMPL_FWD_BWD(ffn)

}  // namespace fastattn
