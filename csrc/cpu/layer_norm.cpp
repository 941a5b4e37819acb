// LayerNorm / RMSNorm forward and backward on CPU (fastattn::layer_norm_fwd / layer_norm_bwd).
//
// Forward, per row of h (h = x, or h = x + residual rounded to x's dtype and returned):
//   LayerNorm: mean = E[h], rstd = 1 / sqrt(E[(h - mean)^2] + eps), y = (h - mean) * rstd * w + b
//   RMSNorm:   rstd = 1 / sqrt(E[h^2] + eps),                      y = h * rstd * w
// Backward, with xhat = (h - mean) * rstd (RMSNorm: h * rstd) and g = dy * w:
//   LayerNorm: dx = rstd * (g - E[g] - xhat * E[g * xhat])   (+ dh, the gradient of the returned h)
//   RMSNorm:   dx = rstd * (g - xhat * E[g * xhat])           (+ dh)
//   dweight = sum over rows of dy * xhat, dbias = sum over rows of dy
//
// Work split: at::parallel_for over rows. Both directions read a row through its dtype in every
// pass (16-bit values converted on the fly: a bfloat16 row of 8192 stays in L1, where float
// copies did not; the backward's copies of h, dy and dx held it at 0.7x torch's time at
// 256 x 8192, AVX2). Every pass runs on cpu::Vec of the target's width (reductions: RowSum
// below), the last n % W values in scalars. The per-task row loops are compiled three times, for
// AVX-512, AVX2 and baseline x86-64, and picked at run time (fastattn/cpu_simd.h:
// FASTATTN_TARGET_*, cpu_isa(); it also says why not at::vec::Vectorized). The statistics take
// two passes over the row (the mean, then the squared deviations from it), both relative to the
// row's first value, so rows with a large offset (1e4 + noise) keep their precision.
// dweight / dbias: the rows are cut into at most cpu::kMaxRowBlocks fixed blocks, each block sums
// its rows into its own partial row (in the accumulation type), and the partial rows are added in
// block order: deterministic, no atomics, and independent of the number of threads
// (fastattn/cpu_reduce.h).
//
// Precision: float32 / float16 / bfloat16 compute in float32, float64 in float64 (so gradcheck
// runs); mean and rstd are returned as float32 whatever the dtype (docs/numerics.md). An empty row
// (N = 0) has mean 0 and rstd 1 / sqrt(eps). Accepted dtypes: see fastattn/layer_norm.h.
#include <ATen/Parallel.h>
#include <ATen/TensorIterator.h>  // at::internal::GRAIN_SIZE
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <type_traits>
#include <vector>

#include "fastattn/cpu_reduce.h"
#include "fastattn/cpu_simd.h"
#include "fastattn/layer_norm.h"

namespace fastattn {
namespace {

using cpu::acc_t;

// ---------------------------------------------------------------------------------------------
// Row helpers, always inlined into the per-ISA row loops below. W: the ISA's vector width in A.
//
// Row reductions run on four W-lane accumulators (four independent add chains), the last n % W
// values in a scalar, and end in one fixed order of adds. An earlier version kept 32 scalar partial
// sums and folded them in a loop the compiler did not unroll: at N = 256 the two folds of a row
// cost more than its passes (AVX2, one thread, 256 x 256: 1.28x torch's time).

template <typename A, int W>
struct RowSum {
  using V = cpu::Vec<A, W>;
  V acc[4];
  A tail = A(0);
  FASTATTN_INLINE RowSum() {
    const V zero(A(0));
    for (auto& v : acc) v = zero;
  }
  FASTATTN_INLINE A total() const { return ((acc[0] + acc[1]) + (acc[2] + acc[3])).sum() + tail; }
};

// sum over i < n of v or v^2 (kSquares), v = (h[i] - c) - d, h read through its type T (16-bit
// values converted on the fly: the row stays half the size in L1).
template <bool kSquares, int W, typename A, typename T>
FASTATTN_INLINE A row_moment(const T* __restrict h, int64_t n, A c, A d) {
  using V = cpu::Vec<A, W>;
  const V cv(c), dv(d);
  RowSum<A, W> s;
  auto add = [&](int u, V x) {  // accumulator u += v or v^2, v = (x - c) - d
    const V v = (x - cv) - dv;
    s.acc[u] = kSquares ? fma(v, v, s.acc[u]) : s.acc[u] + v;
  };
  int64_t i = 0;
  if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<A, float>) {
    // The sum does not care about order: 2W values a load, split even / odd without a shuffle.
    for (; i + 4 * W <= n; i += 4 * W) {
      for (int u = 0; u < 2; ++u) {
        V even, odd;
        cpu::load_bf16_pairs<W>(h + i + 2 * u * W, even, odd);
        add(2 * u, even);
        add(2 * u + 1, odd);
      }
    }
  }
  for (; i + 4 * W <= n; i += 4 * W) {
    for (int u = 0; u < 4; ++u) add(u, cpu::load_as<V>(h + i + u * W));
  }
  for (; i + W <= n; i += W) add(0, cpu::load_as<V>(h + i));
  for (; i < n; ++i) {
    const A v = (cpu::to_acc<A>(h[i]) - c) - d;
    s.tail += kSquares ? v * v : v;
  }
  return s.total();
}

// ---------------------------------------------------------------------------------------------
// Forward rows.

template <typename T>
struct FwdArgs {
  using A = acc_t<T>;
  const T* x;
  const T* residual;  // or nullptr
  int64_t x_stride, r_stride;
  const A* w;  // n values (ones when there is no weight)
  const A* b;  // n values (zeros when there is no bias)
  T* y;
  T* h;         // when residual
  float* mean;  // nullptr for RMSNorm
  float* rstd;
  int64_t n;
  A eps;
  bool rms;
};

template <int W, typename T>
FASTATTN_INLINE void fwd_rows_impl(const FwdArgs<T>& a, int64_t r0, int64_t r1) {
  using A = acc_t<T>;
  using V = cpu::Vec<A, W>;
  const int64_t n = a.n;
  const A inv_n = A(1) / A(n);
  for (int64_t r = r0; r < r1; ++r) {
    const T* __restrict h;  // the row, read through T by every pass
    if (a.residual != nullptr) {
      // h = x + residual in A, rounded to T and returned; the statistics use the rounded h.
      const T* __restrict xr = a.x + r * a.x_stride;
      const T* __restrict rr = a.residual + r * a.r_stride;
      T* __restrict hr = a.h + r * n;
      int64_t i = 0;
      for (; i + W <= n; i += W) {
        cpu::store_as(cpu::load_as<V>(xr + i) + cpu::load_as<V>(rr + i), hr + i);
      }
      for (; i < n; ++i) hr[i] = cpu::from_acc<T>(cpu::to_acc<A>(xr[i]) + cpu::to_acc<A>(rr[i]));
      h = hr;
    } else {
      h = a.x + r * a.x_stride;
    }
    // LayerNorm statistics relative to c = h[0] (exact differences for nearby values):
    // delta = E[h - c], var = E[((h - c) - delta)^2], mean = c + delta.
    const A c = a.rms ? A(0) : cpu::to_acc<A>(h[0]);
    const A delta = a.rms ? A(0) : row_moment<false, W>(h, n, c, A(0)) * inv_n;
    const A var = row_moment<true, W>(h, n, c, delta) * inv_n;
    const A rs = A(1) / std::sqrt(var + a.eps);
    if (!a.rms) a.mean[r] = static_cast<float>(c + delta);
    a.rstd[r] = static_cast<float>(rs);
    T* __restrict yr = a.y + r * n;
    const A* __restrict w = a.w;
    const A* __restrict b = a.b;
    const V cv(c), dv(delta), rsv(rs);
    int64_t i = 0;
    for (; i + W <= n; i += W) {
      const V xh = ((cpu::load_as<V>(h + i) - cv) - dv) * rsv;
      cpu::store_as(fma(xh, V::load(w + i), V::load(b + i)), yr + i);
    }
    for (; i < n; ++i) {
      yr[i] = cpu::from_acc<T>(((cpu::to_acc<A>(h[i]) - c) - delta) * rs * w[i] + b[i]);
    }
  }
}

// The row kernels for the ISA trampoline (cpu::isa_dispatch): the reductions on Vec of the
// target's width, the element-wise loops auto-vectorized for it.
template <typename T>
struct FwdKernel {
  template <int kBytes>
  FASTATTN_INLINE static void run(const FwdArgs<T>& a, int64_t r0, int64_t r1) {
    fwd_rows_impl<kBytes / int(sizeof(acc_t<T>))>(a, r0, r1);
  }
};

template <typename T>
void fwd_rows(const FwdArgs<T>& a, int64_t r0, int64_t r1) {
  cpu::isa_dispatch<FwdKernel<T>>(a, r0, r1);
}

// ---------------------------------------------------------------------------------------------
// Backward rows.

template <typename T>
struct BwdArgs {
  using A = acc_t<T>;
  const T* dy;
  const T* dh;  // or nullptr
  const T* h;
  int64_t dy_stride, dh_stride, h_stride;
  const A* w;          // n values (ones when there is no weight)
  const float* mean;   // nullptr for RMSNorm
  const float* rstd;
  T* dx;
  int64_t n;
  bool rms;
};

// Row dx = rstd * (dy w - cg - xhat cx) (+ dh), xhat = (h - mu) rstd; with kParts also
// pw += dy xhat and pb += dy, in a loop of their own over the row (read again from L1/L2): one
// loop with all eight streams (dy, h, w, dx, and pw, pb read and written) ran the backward at
// 0.6x torch's on an Intel Xeon (AVX-512, 256 x 8192 float32; dx alone took 0.45 of the time),
// two loops of five at parity or better. Rows of T, converted on the fly.
template <int W, bool kDh, bool kParts, typename T, typename A>
FASTATTN_INLINE void dx_row(T* __restrict dx, const T* __restrict dy, const T* __restrict h,
                            const A* __restrict w, const T* __restrict dh, A mu, A rs, A cg, A cx,
                            A* __restrict pw, A* __restrict pb, int64_t n) {
  using V = cpu::Vec<A, W>;
  const V muv(mu), rsv(rs), cgv(cg), cxv(cx);
  int64_t j = 0;
  for (; j + W <= n; j += W) {
    const V dyv = cpu::load_as<V>(dy + j);
    const V xh = (cpu::load_as<V>(h + j) - muv) * rsv;
    V d = (dyv * V::load(w + j) - cgv - xh * cxv) * rsv;
    if constexpr (kDh) d = d + cpu::load_as<V>(dh + j);
    cpu::store_as(d, dx + j);
  }
  if constexpr (kParts) {
    for (int64_t i = 0; i + W <= n; i += W) {
      const V dyv = cpu::load_as<V>(dy + i);
      const V xh = (cpu::load_as<V>(h + i) - muv) * rsv;
      fma(dyv, xh, V::load(pw + i)).store(pw + i);
      (V::load(pb + i) + dyv).store(pb + i);
    }
  }
  for (; j < n; ++j) {
    const A dyj = cpu::to_acc<A>(dy[j]);
    const A xh = (cpu::to_acc<A>(h[j]) - mu) * rs;
    A d = (dyj * w[j] - cg - xh * cx) * rs;
    if constexpr (kDh) d += cpu::to_acc<A>(dh[j]);
    dx[j] = cpu::from_acc<T>(d);
    if constexpr (kParts) {
      pw[j] += dyj * xh;
      pb[j] += dyj;
    }
  }
}

// Rows [r0, r1); pw / pb: the partial dweight / dbias row these rows add to, or null.
template <int W, typename T>
FASTATTN_INLINE void bwd_rows_impl(const BwdArgs<T>& a, int64_t r0, int64_t r1, acc_t<T>* pw,
                                   acc_t<T>* pb) {
  using A = acc_t<T>;
  using V = cpu::Vec<A, W>;
  const int64_t n = a.n;
  const A inv_n = A(1) / A(n);
  const A* __restrict w = a.w;
  for (int64_t r = r0; r < r1; ++r) {
    const T* __restrict h = a.h + r * a.h_stride;
    const T* __restrict dy = a.dy + r * a.dy_stride;
    const A mu = a.rms ? A(0) : A(a.mean[r]);
    const A rs = A(a.rstd[r]);
    // Pass 1: E[g] and E[g * xhat], g = dy * w, xhat = (h - mu) * rs.
    RowSum<A, W> sg, sgx;
    {
      const V muv(mu), rsv(rs);
      int64_t i = 0;
      for (; i + 2 * W <= n; i += 2 * W) {
        for (int u = 0; u < 2; ++u) {
          const int64_t j = i + u * W;
          const V g = cpu::load_as<V>(dy + j) * V::load(w + j);
          sg.acc[u] = sg.acc[u] + g;
          sgx.acc[u] = fma(g, (cpu::load_as<V>(h + j) - muv) * rsv, sgx.acc[u]);
        }
      }
      for (; i < n; ++i) {
        const A g = cpu::to_acc<A>(dy[i]) * w[i];
        sg.tail += g;
        sgx.tail += g * ((cpu::to_acc<A>(h[i]) - mu) * rs);
      }
    }
    const A cg = a.rms ? A(0) : sg.total() * inv_n;
    const A cx = sgx.total() * inv_n;
    // Pass 2: dx = rstd * (g - E[g] - xhat * E[g * xhat]) + dh, and in the same loop (one more
    // read of the row, from L1) the partial dweight / dbias rows.
    T* dx = a.dx + r * n;
    const T* __restrict dh = a.dh != nullptr ? a.dh + r * a.dh_stride : nullptr;
    if (pw != nullptr && dh != nullptr) {
      dx_row<W, true, true>(dx, dy, h, w, dh, mu, rs, cg, cx, pw, pb, n);
    } else if (pw != nullptr) {
      dx_row<W, false, true>(dx, dy, h, w, dh, mu, rs, cg, cx, pw, pb, n);
    } else if (dh != nullptr) {
      dx_row<W, true, false>(dx, dy, h, w, dh, mu, rs, cg, cx, pw, pb, n);
    } else {
      dx_row<W, false, false>(dx, dy, h, w, dh, mu, rs, cg, cx, pw, pb, n);
    }
  }
}

template <typename T>
struct BwdKernel {
  template <int kBytes>
  FASTATTN_INLINE static void run(const BwdArgs<T>& a, int64_t r0, int64_t r1, acc_t<T>* pw, acc_t<T>* pb) {
    bwd_rows_impl<kBytes / int(sizeof(acc_t<T>))>(a, r0, r1, pw, pb);
  }
};

template <typename T>
void bwd_rows(const BwdArgs<T>& a, int64_t r0, int64_t r1, acc_t<T>* pw, acc_t<T>* pb) {
  cpu::isa_dispatch<BwdKernel<T>>(a, r0, r1, pw, pb);
}

// ---------------------------------------------------------------------------------------------
// Drivers.

// A weight or bias (n values) as the accumulation type A: its own data where it holds exactly that
// (contiguous A), else converted into buf (`fill` n times where absent). Converting with
// Tensor::to went through the dispatcher: ~6 us a call for bfloat16 weights, ten calls in the
// bench's small GPT forward (bench/results/cpu-notes.md, session 25).
template <typename A>
const A* acc_values(const std::optional<at::Tensor>& t, int64_t n, A fill, std::vector<A>& buf) {
  if (t && t->scalar_type() == c10::CppTypeToScalarType<A>::value && t->is_contiguous()) {
    return t->const_data_ptr<A>();
  }
  buf.assign(n, fill);
  if (t) {
    AT_DISPATCH_FLOATING_TYPES_AND2(at::kHalf, at::kBFloat16, t->scalar_type(), "acc_values", [&] {
      const scalar_t* p = t->const_data_ptr<scalar_t>();
      const int64_t stride = t->stride(0);
      for (int64_t i = 0; i < n; ++i) buf[i] = static_cast<A>(p[i * stride]);
    });
  }
  return buf.data();
}

template <typename T>
void layer_norm_fwd_impl(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                         const std::optional<at::Tensor>& weight,
                         const std::optional<at::Tensor>& bias, double eps, bool rms,
                         at::Tensor& y, at::Tensor& h, at::Tensor& mean, at::Tensor& rstd) {
  using A = acc_t<T>;
  std::vector<A> w_buf, b_buf;
  FwdArgs<T> a{};
  a.x = x.const_data_ptr<T>();
  a.residual = residual ? residual->const_data_ptr<T>() : nullptr;
  a.x_stride = x.stride(0);
  a.r_stride = residual ? residual->stride(0) : 0;
  a.w = acc_values<A>(weight, x.size(1), A(1), w_buf);
  a.b = acc_values<A>(bias, x.size(1), A(0), b_buf);
  a.y = y.data_ptr<T>();
  a.h = residual ? h.data_ptr<T>() : nullptr;
  a.mean = rms ? nullptr : mean.data_ptr<float>();
  a.rstd = rstd.data_ptr<float>();
  a.n = x.size(1);
  a.eps = static_cast<A>(eps);
  a.rms = rms;
  at::parallel_for(0, x.size(0), std::max<int64_t>(1, at::internal::GRAIN_SIZE / a.n),
                   [&](int64_t r0, int64_t r1) { fwd_rows(a, r0, r1); });
}

template <typename T>
void layer_norm_bwd_impl(const at::Tensor& dy, const std::optional<at::Tensor>& dh,
                         const at::Tensor& h, const std::optional<at::Tensor>& weight,
                         const at::Tensor& mean, const at::Tensor& rstd, bool rms, at::Tensor& dx,
                         at::Tensor& part_w, at::Tensor& part_b) {
  using A = acc_t<T>;
  std::vector<A> w_buf;
  BwdArgs<T> a{};
  a.dy = dy.const_data_ptr<T>();
  a.dh = dh ? dh->const_data_ptr<T>() : nullptr;
  a.h = h.const_data_ptr<T>();
  a.dy_stride = dy.stride(0);
  a.dh_stride = dh ? dh->stride(0) : 0;
  a.h_stride = h.stride(0);
  a.w = acc_values<A>(weight, h.size(1), A(1), w_buf);
  a.mean = rms ? nullptr : mean.const_data_ptr<float>();
  a.rstd = rstd.const_data_ptr<float>();
  a.dx = dx.data_ptr<T>();
  a.n = h.size(1);
  a.rms = rms;
  const int64_t m = h.size(0), n = a.n;
  if (!part_w.defined()) {
    at::parallel_for(0, m, std::max<int64_t>(1, at::internal::GRAIN_SIZE / n),
                     [&](int64_t r0, int64_t r1) { bwd_rows(a, r0, r1, nullptr, nullptr); });
    return;
  }
  A* pw = part_w.data_ptr<A>();
  A* pb = part_b.data_ptr<A>();
  cpu::for_row_blocks(m, part_w.size(0), [&](int64_t k, int64_t r0, int64_t r1) {
    std::fill(pw + k * n, pw + (k + 1) * n, A(0));
    std::fill(pb + k * n, pb + (k + 1) * n, A(0));
    bwd_rows(a, r0, r1, pw + k * n, pb + k * n);
  });
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> layer_norm_fwd_cpu(
    const at::Tensor& x, const std::optional<at::Tensor>& residual,
    const std::optional<at::Tensor>& weight, const std::optional<at::Tensor>& bias, double eps,
    bool rms) {
  check_layer_norm_fwd(x, residual, weight, bias, /*allow_double=*/true);
  LayerNormFwdOutputs out = layer_norm_fwd_outputs(x, residual.has_value(), eps, rms);
  if (out.empty) return out.tuple();
  FASTATTN_DISPATCH_FLOATING_HALF_BF16(x.scalar_type(), "layer_norm_fwd_cpu", [&] {
    layer_norm_fwd_impl<scalar_t>(x, residual, weight, bias, eps, rms, out.y, out.h, out.mean,
                                  out.rstd);
  });
  return out.tuple();
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> layer_norm_bwd_cpu(
    const at::Tensor& dy, const std::optional<at::Tensor>& dh, const at::Tensor& h,
    const std::optional<at::Tensor>& weight, const at::Tensor& mean, const at::Tensor& rstd,
    bool rms, std::array<bool, 2> output_mask) {
  check_layer_norm_bwd(dy, dh, h, weight, mean, rstd, rms, /*allow_double=*/true);
  const int64_t m = h.size(0), n = h.size(1);
  const bool want_dw = weight.has_value() && output_mask[0];
  const bool want_db = weight.has_value() && output_mask[1];
  const auto acc = acc_dtype(h.scalar_type());
  const auto acc_opts = h.options().dtype(acc);
  at::Tensor dx = empty_tensor({m, n}, h.options());
  at::Tensor part_w, part_b;
  const int64_t blocks = cpu::row_blocks(m);
  if ((want_dw || want_db) && m > 0 && n > 0) {
    part_w = empty_tensor({blocks, n}, acc_opts);
    part_b = empty_tensor({blocks, n}, acc_opts);
  }
  if (m > 0 && n > 0) {
    FASTATTN_DISPATCH_FLOATING_HALF_BF16(h.scalar_type(), "layer_norm_bwd_cpu", [&] {
      layer_norm_bwd_impl<scalar_t>(dy, dh, h, weight, mean, rstd, rms, dx, part_w, part_b);
    });
  }
  auto finish = [&](bool want, const at::Tensor& part) {
    if (!want) return empty_tensor({0}, h.options());
    if (!part.defined()) return empty_tensor({n}, weight->options()).zero_();
    const at::Tensor sum =
        acc == at::kDouble ? cpu::sum_partials<double>(part) : cpu::sum_partials<float>(part);
    return sum.to(weight->scalar_type());
  };
  return {dx, finish(want_dw, part_w), finish(want_db, part_b)};
}

}  // namespace

TORCH_LIBRARY_IMPL(fastattn, CPU, m) {
  m.impl("layer_norm_fwd", &layer_norm_fwd_cpu);
  m.impl("layer_norm_bwd", &layer_norm_bwd_cpu);
}

}  // namespace fastattn
