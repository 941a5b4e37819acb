// Feed-forward block on CPU (fastattn::ffn_fwd / ffn_bwd): out = act(x w1^T + b1) w2^T + b2.
//
//   forward   pre = x w1^T + b1              (M, F), or (M, 2F) split [gate, up] when gated
//             a   = act(pre)                 gated: f(gate) * up  (swiglu: f = silu, geglu: gelu)
//             out = a w2^T + b2              (M, D2)
//   backward  da = dout w2,  dpre = da * act'(pre)   gated: [da * up * f'(gate), da * f(gate)]
//             dx = dpre w1,  dw1 = dpre^T x,  dw2 = dout^T a,  db1 = sum_rows dpre,
//             db2 = sum_rows dout
//
// The four matmuls of each direction are ATen's (at::addmm / at::mm: MKL / oneDNN), in float32
// for bfloat16 / float16 inputs on a CPU without dot-product instructions for them (gemm_in_float
// below: oneDNN's 16-bit GEMMs there run 10-130x slower than MKL's float32 ones). Ours are the
// fused elementwise passes: forward writes `a` from `pre` in one pass (pre, with the bias added by
// addmm, is what is returned and saved); backward reads `pre` and `da` once and writes `dpre`
// and the recomputed `a` (the operand of dw2), and sums dpre's columns (db1) on the way into
// per-block partial rows. Column sums are deterministic: the rows are cut into at most
// cpu::kMaxRowBlocks blocks fixed by M alone, each block sums its rows in order, and the partial
// rows are added in block order (fastattn/cpu_reduce.h); db2 is a column-parallel sum of dout in
// row order.
//
// The elementwise passes are parallel over rows and vectorized with cpu_simd.h (AVX-512 / AVX2 /
// baseline chosen at run time): exp is vectorized; erf (gelu) uses a rational approximation
// (clamped to [-4, 4], a few float32 ulp). float64 uses std::
// functions per element. gelu_tanh uses 0.5 (1 + tanh(u)) = sigmoid(2u). Activation math is float32 (float64 for float64) on `pre` as stored, so
// the `a` recomputed in backward is bit-identical to the forward's.
//
// Activations: gelu (erf), gelu_tanh, relu, silu, swiglu, geglu; anything else is an error.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <cmath>
#include <cstdlib>
#include <cstring>
#include <mutex>
#include <string>
#include <vector>

#include "fastattn/activation.h"
#include "fastattn/common.h"
#include "fastattn/cpu_choices.h"
#include "fastattn/cpu_reduce.h"
#include "fastattn/cpu_simd.h"

namespace fastattn {
namespace {

using cpu::acc_t;
using cpu::Vec;

constexpr double kSqrt1_2 = 0.70710678118654752440;
constexpr double kInvSqrt2Pi = 0.39894228040143267794;
constexpr double kSqrt2OverPi = 0.79788456080286535588;
constexpr double kGeluTanhC = 0.044715;

// erf for float vectors: x * P(x^2) / Q(x^2) on x clamped to [-4, 4] (the rational approximation
// of Eigen / XLA, a few ulp; |erf| rounds to 1 beyond 4 in float32).
template <int W>
FASTATTN_INLINE Vec<float, W> verf(Vec<float, W> a) {
  using V = Vec<float, W>;
  const V x = min(max(a, V(-4.0f)), V(4.0f));
  const V x2 = x * x;
  V p = fma(x2, V(-2.72614225801306e-10f), V(2.77068142495902e-08f));
  p = fma(x2, p, V(-2.10102402082508e-06f));
  p = fma(x2, p, V(-5.69250639462346e-05f));
  p = fma(x2, p, V(-7.34990630326855e-04f));
  p = fma(x2, p, V(-2.95459980854025e-03f));
  p = fma(x2, p, V(-1.60960333262415e-02f));
  p = p * x;
  V q = fma(x2, V(-1.45660718464996e-05f), V(-2.13374055278905e-04f));
  q = fma(x2, q, V(-1.68282697438203e-03f));
  q = fma(x2, q, V(-7.37332916720468e-03f));
  q = fma(x2, q, V(-1.42647390514189e-02f));
  return V::select_nan(a, a, p / q);
}

// 1 - s for s = 1 / (1 + e): e s where s >= 1/2 (no cancellation as s -> 1; e <= 1 there),
// 1 - s elsewhere (exact enough, and safe when e overflows to inf).
template <int W>
FASTATTN_INLINE Vec<float, W> one_minus_sigmoid(Vec<float, W> s, Vec<float, W> e) {
  using V = Vec<float, W>;
  return V::select_lt(s, V(0.5f), V(1.0f) - s, e * s);
}

// f(h) and, when `df` is not null, f'(h), for one vector.
template <int W>
FASTATTN_INLINE Vec<float, W> act_vec(Act act, Vec<float, W> h, Vec<float, W>* df) {
  using V = Vec<float, W>;
  const V one(1.0f), half(0.5f), zero(0.0f);
  switch (act) {
    case kGelu: {
      // h cdf = h/2 + h/2 erf: one fma (bfloat16 pass 33 -> 30 cycles a vector at AVX-512)
      const V e = verf(h * V(float(kSqrt1_2)));
      if (df != nullptr) {
        *df = fma(h * V(float(kInvSqrt2Pi)), cpu::vexp(h * h * V(-0.5f)), fma(half, e, half));
      }
      const V hh = half * h;
      return fma(hh, e, hh);
    }
    case kGeluTanh: {
      // 0.5 (1 + tanh(u)) = sigmoid(2u): no cancellation in either tail.
      const V h2 = h * h;
      const V u = V(float(kSqrt2OverPi)) * fma(V(float(kGeluTanhC)) * h2, h, h);
      const V e = cpu::vexp(zero - (u + u));
      const V s = one / (one + e);
      if (df != nullptr) {
        // d/dh [h s] = s + h * 2 s (1 - s) * du/dh
        const V du = V(float(kSqrt2OverPi)) * fma(V(float(3 * kGeluTanhC)), h2, one);
        *df = fma(V(2.0f) * h * s * one_minus_sigmoid(s, e), du, s);
      }
      return h * s;
    }
    case kRelu:
      if (df != nullptr) *df = V::select_gt(h, zero, one, zero);
      return V::select_lt(h, zero, zero, h);
    case kSilu:
    default: {
      const V e = cpu::vexp(zero - h);
      const V s = one / (one + e);
      if (df != nullptr) *df = s * fma(h, one_minus_sigmoid(s, e), one);  // s (1 + h (1 - s))
      return h * s;
    }
  }
}

// The float64 versions, per element with the std:: functions.
template <int W>
FASTATTN_INLINE Vec<double, W> act_vec(Act act, Vec<double, W> h, Vec<double, W>* df) {
  Vec<double, W> f;
  for (int i = 0; i < W; ++i) {
    const double x = h.v[i];
    double fx, dfx;
    switch (act) {
      case kGelu: {
        const double cdf = 0.5 * (1.0 + std::erf(x * kSqrt1_2));
        fx = x * cdf;
        dfx = cdf + x * kInvSqrt2Pi * std::exp(-0.5 * x * x);
        break;
      }
      case kGeluTanh: {
        const double t = std::tanh(kSqrt2OverPi * (x + kGeluTanhC * x * x * x));
        fx = 0.5 * x * (1.0 + t);
        dfx = 0.5 * (1.0 + t) + 0.5 * x * (1.0 - t * t) * kSqrt2OverPi * (1.0 + 3 * kGeluTanhC * x * x);
        break;
      }
      case kRelu:
        fx = x < 0 ? 0.0 : x;
        dfx = x > 0 ? 1.0 : 0.0;
        break;
      case kSilu:
      default: {
        const double s = 0.5 * (1.0 + std::tanh(0.5 * x));
        fx = x * s;
        dfx = s * (1.0 + x * (1.0 - s));
        break;
      }
    }
    f.v[i] = fx;
    if (df != nullptr) df->v[i] = dfx;
  }
  return f;
}

// n <= W values of T at p as a vector of A (zero-filled past n).
template <class V, class T>
FASTATTN_INLINE V load_part(const T* p, int64_t n) {
  using A = typename V::value_type;
  if (n == V::size) return cpu::load_as<V>(p);
  A tmp[V::size];
  for (int64_t i = 0; i < V::size; ++i) tmp[i] = i < n ? cpu::to_acc<A>(p[i]) : A(0);
  return V::load(tmp);
}

template <class V, class T>
FASTATTN_INLINE void store_part(V v, T* p, int64_t n) {
  using A = typename V::value_type;
  if (n == V::size) return cpu::store_as(v, p);
  A tmp[V::size];
  v.store(tmp);
  for (int64_t i = 0; i < n; ++i) p[i] = cpu::from_acc<T>(tmp[i]);
}

struct Dims {
  int64_t M, F, F1;  // rows; activation width; pre width (F, or 2F when gated)
};

// a = act(pre) for rows [r0, r1).
template <class T, class V>
FASTATTN_INLINE void act_fwd_rows(ActSpec act, Dims d, const T* pre, T* a, int64_t r0, int64_t r1) {
  constexpr int64_t W = V::size;
  for (int64_t r = r0; r < r1; ++r) {
    const T* pr = pre + r * d.F1;
    T* ar = a + r * d.F;
    int64_t c0 = 0;
    // Elementwise: 2W values a step (cpu::load_pair_as: bfloat16 as even / odd halves, which need
    // no shuffle to widen or narrow; the shuffle port bounded this pass).
    for (; c0 + 2 * W <= d.F; c0 += 2 * W) {
      V he, ho;
      cpu::load_pair_as(pr + c0, he, ho);
      V fe = act_vec(act.act, he, static_cast<V*>(nullptr));
      V fo = act_vec(act.act, ho, static_cast<V*>(nullptr));
      if (act.gated) {
        V ue, uo;
        cpu::load_pair_as(pr + d.F + c0, ue, uo);
        fe = fe * ue;
        fo = fo * uo;
      }
      cpu::store_pair_as(fe, fo, ar + c0);
    }
    for (int64_t c = c0; c < d.F; c += W) {
      const int64_t n = std::min<int64_t>(W, d.F - c);
      V f = act_vec(act.act, load_part<V>(pr + c, n), static_cast<V*>(nullptr));
      if (act.gated) f = f * load_part<V>(pr + d.F + c, n);
      store_part(f, ar + c, n);
    }
  }
}

// dpre = da * act'(pre) and a = act(pre) for rows [r0, r1); adds dpre's rows to `colsum` (F1
// values) when it is not null.
template <class T, class V>
FASTATTN_INLINE void act_bwd_rows(ActSpec act, Dims d, const T* pre, const T* da, T* dpre, T* a,
                                  typename V::value_type* colsum, int64_t r0, int64_t r1) {
  constexpr int64_t W = V::size;
  using A = typename V::value_type;
  for (int64_t r = r0; r < r1; ++r) {
    const T* pr = pre + r * d.F1;
    const T* dar = da + r * d.F;
    T* dpr = dpre + r * d.F1;
    T* ar = a + r * d.F;
    for (int64_t c = 0; c < d.F; c += W) {
      const int64_t n = std::min<int64_t>(W, d.F - c);
      V df;
      const V f = act_vec(act.act, load_part<V>(pr + c, n), &df);
      const V g = load_part<V>(dar + c, n);
      if (act.gated) {
        const V up = load_part<V>(pr + d.F + c, n);
        const V dgate = g * up * df, dup = g * f;
        store_part(f * up, ar + c, n);
        store_part(dgate, dpr + c, n);
        store_part(dup, dpr + d.F + c, n);
        if (colsum != nullptr) {
          A tmp[2][W];
          dgate.store(tmp[0]);
          dup.store(tmp[1]);
          for (int64_t i = 0; i < n; ++i) {
            colsum[c + i] += tmp[0][i];
            colsum[d.F + c + i] += tmp[1][i];
          }
        }
      } else {
        const V dp = g * df;
        store_part(f, ar + c, n);
        store_part(dp, dpr + c, n);
        if (colsum != nullptr) {
          if (n == W) {
            (V::load(colsum + c) + dp).store(colsum + c);
          } else {
            A tmp[W];
            dp.store(tmp);
            for (int64_t i = 0; i < n; ++i) colsum[c + i] += tmp[i];
          }
        }
      }
    }
  }
}

// The activation row kernels for the ISA trampoline (cpu::isa_dispatch).
template <class T>
struct ActFwdKernel {
  template <int kBytes>
  FASTATTN_INLINE static void run(ActSpec act, Dims d, const T* pre, T* a, int64_t r0, int64_t r1) {
    act_fwd_rows<T, Vec<acc_t<T>, kBytes / sizeof(acc_t<T>)>>(act, d, pre, a, r0, r1);
  }
};
template <class T>
struct ActBwdKernel {
  template <int kBytes>
  FASTATTN_INLINE static void run(ActSpec act, Dims d, const T* pre, const T* da, T* dpre, T* a,
                                  acc_t<T>* cs, int64_t r0, int64_t r1) {
    act_bwd_rows<T, Vec<acc_t<T>, kBytes / sizeof(acc_t<T>)>>(act, d, pre, da, dpre, a, cs, r0, r1);
  }
};

template <class T>
void act_fwd(ActSpec act, Dims d, const T* pre, T* a, int64_t r0, int64_t r1) {
  cpu::isa_dispatch<ActFwdKernel<T>>(act, d, pre, a, r0, r1);
}

template <class T>
void act_bwd(ActSpec act, Dims d, const T* pre, const T* da, T* dpre, T* a, acc_t<T>* cs,
             int64_t r0, int64_t r1) {
  cpu::isa_dispatch<ActBwdKernel<T>>(act, d, pre, da, dpre, a, cs, r0, r1);
}

int64_t grain_rows(int64_t width) { return std::max<int64_t>(1, 16384 / std::max<int64_t>(width, 1)); }

// Column sums of the (M, N) matrix t (rows of stride ld, unit column stride) in A, in row order,
// parallel over column chunks: deterministic.
template <class T>
at::Tensor column_sum(const T* t, int64_t M, int64_t N, int64_t ld, const at::TensorOptions& opts) {
  using A = acc_t<T>;
  at::Tensor out = empty_tensor({N}, opts.dtype(c10::CppTypeToScalarType<A>::value));
  A* o = out.data_ptr<A>();
  at::parallel_for(0, cpu::ceil_div(N, 64), std::max<int64_t>(1, 4096 / std::max<int64_t>(M, 1)),
                   [&](int64_t k0, int64_t k1) {
    const int64_t c0 = k0 * 64, c1 = std::min(N, k1 * 64);
    std::fill(o + c0, o + c1, A(0));
    for (int64_t r = 0; r < M; ++r) {
      const T* row = t + r * ld;
      for (int64_t c = c0; c < c1; ++c) o[c] += cpu::to_acc<A>(row[c]);
    }
  });
  return out;
}

// ---------------------------------------------------------------------------------------------
// Checks.

void check_matrix(const at::Tensor& t, const at::Tensor& x, const char* name) {
  TORCH_CHECK(t.dim() == 2, name, " must be 2-D, got shape ", t.sizes());
  check_device(t, x, name, "x");
  TORCH_CHECK(t.scalar_type() == x.scalar_type(), name, " must have x's dtype (", x.scalar_type(),
              "), got ", t.scalar_type());
}

// Returns the dims after checking x (M, D), w1 (F1, D), w2 (D2, F).
Dims check_ffn(const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2, ActSpec act) {
  TORCH_CHECK(x.dim() == 2, "x must be 2-D (rows, D), got shape ", x.sizes());
  check_float_dtype(x, "x", /*allow_double=*/true);
  check_matrix(w1, x, "w1");
  check_matrix(w2, x, "w2");
  TORCH_CHECK(w1.size(1) == x.size(1), "w1 must have shape (F, D) with D = x.size(1) = ", x.size(1),
              ", got ", w1.sizes());
  const int64_t F1 = w1.size(0);
  TORCH_CHECK(!act.gated || F1 % 2 == 0,
              "a gated activation needs w1 with an even number of rows ([gate; up]), got ",
              w1.sizes());
  const int64_t F = act.gated ? F1 / 2 : F1;
  TORCH_CHECK(w2.size(1) == F, "w2 must have shape (D2, F) with F = ", F, " (w1 ", w1.sizes(),
              act.gated ? ", gated" : "", "), got ", w2.sizes());
  return {x.size(0), F, F1};
}

void check_bias(const std::optional<at::Tensor>& b, int64_t n, const at::Tensor& x, const char* name) {
  if (!b.has_value()) return;
  check_device(*b, x, name, "x");
  check_shape(*b, {n}, name);
  TORCH_CHECK(b->scalar_type() == x.scalar_type(), name, " must have x's dtype (", x.scalar_type(),
              "), got ", b->scalar_type());
}

// ---------------------------------------------------------------------------------------------
// The matmuls' dtype.
//
// ATen's bfloat16 / float16 GEMMs (oneDNN) are fast only on CPUs with dot-product instructions
// for that type: avx512_bf16 or AMX-BF16 for bfloat16, avx512_fp16 for float16. Elsewhere they
// run 10x (x w^T) to 130x (dy w) slower than MKL's float32 GEMM on the same operands (AMD EPYC,
// AVX2, 256 x 256 x 1024: 10.3 / 130 ms against 1.0 ms; bench/results/cpu-notes.md, session 27).
// There the operands are converted to float32, multiplied by the float32 GEMM and the product
// rounded once to the input dtype. That is the 16-bit GEMM's own contract (exact products,
// float32 accumulation, one rounding), so results differ from it only in summation order.
// With FASTATTN_CPU_ISA capping our kernels below AVX-512 the CPU is taken to have neither (the
// bench's "AVX2 on an AVX-512 machine" runs). FASTATTN_CPU_FFN_GEMM=native / float32 (or any
// other value) forces one path for 16-bit inputs (read on every call); the first call converting
// is logged (INFO). The decision is cpu::ffn_gemm_in_float (fastattn/cpu_choices.h, below).

bool cpu_has_dot_for(at::ScalarType st) {
#if FASTATTN_X86_DISPATCH
  if (cpu::cpu_isa() != cpu::Isa::kAvx512) return false;
  static const bool bf16 = (__builtin_cpu_init(), __builtin_cpu_supports("avx512bf16") ||
                                                      __builtin_cpu_supports("amx-bf16"));
  static const bool fp16 = (__builtin_cpu_init(), __builtin_cpu_supports("avx512fp16"));
  return st == at::kBFloat16 ? bf16 : fp16;
#else
  (void)st;
  return true;  // not measured off x86: ATen's GEMMs as they are
#endif
}

// cpu::ffn_gemm_in_float, logged the first time it says float32.
bool gemm_in_float(at::ScalarType st) {
  const bool up = cpu::ffn_gemm_in_float(st);
  if (up) {
    static std::once_flag once;
    std::call_once(once, [] {
      LOG(INFO) << "fastattn cpu ffn: 16-bit matmuls run in float32, the faster GEMM on a CPU "
                << "without bf16 / fp16 dot-product instructions "
                << "(FASTATTN_CPU_FFN_GEMM=native keeps ATen's 16-bit GEMMs)";
    });
  }
  return up;
}

// The matmuls' operands: as given, or converted to float32 (Gemm::in), and their products back
// in the input dtype (Gemm::out). Convert each tensor once even where two matmuls read it.
struct Gemm {
  at::ScalarType dtype;
  bool up;
  explicit Gemm(at::ScalarType st) : dtype(st), up(gemm_in_float(st)) {}
  at::Tensor in(const at::Tensor& t) const { return up ? t.to(at::kFloat) : t; }
  std::optional<at::Tensor> in(const std::optional<at::Tensor>& t) const {
    return t.has_value() ? std::optional<at::Tensor>(in(*t)) : std::nullopt;
  }
  at::Tensor out(const at::Tensor& t) const { return t.to(dtype); }
};

// x @ w^T (+ bias), contiguous.
at::Tensor linear_bias(const at::Tensor& x, const at::Tensor& w, const std::optional<at::Tensor>& b) {
  return b.has_value() ? addmm_call(*b, x, w.t()) : mm_call(x, w.t());
}

// ---------------------------------------------------------------------------------------------
// Ops.

std::tuple<at::Tensor, at::Tensor> ffn_fwd_cpu(const at::Tensor& x, const at::Tensor& w1,
                                               const std::optional<at::Tensor>& b1,
                                               const at::Tensor& w2,
                                               const std::optional<at::Tensor>& b2,
                                               c10::string_view activation) {
  const ActSpec act = parse_activation(std::string(activation));
  const Dims d = check_ffn(x, w1, w2, act);
  check_bias(b1, d.F1, x, "b1");
  check_bias(b2, w2.size(0), x, "b2");
  const Gemm gemm(x.scalar_type());
  at::Tensor pre = gemm.out(linear_bias(gemm.in(x), gemm.in(w1), gemm.in(b1))).contiguous();
  at::Tensor a = empty_tensor({d.M, d.F}, x.options());
  if (d.M > 0 && d.F > 0) {
    FASTATTN_DISPATCH_FLOATING_HALF_BF16(x.scalar_type(), "ffn_fwd_cpu", [&] {
      const scalar_t* pp = pre.const_data_ptr<scalar_t>();
      scalar_t* ap = a.data_ptr<scalar_t>();
      at::parallel_for(0, d.M, grain_rows(d.F1), [&](int64_t r0, int64_t r1) {
        act_fwd<scalar_t>(act, d, pp, ap, r0, r1);
      });
    });
  }
  at::Tensor out = gemm.out(linear_bias(gemm.in(a), gemm.in(w2), gemm.in(b2)));
  return {out, pre};
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor, at::Tensor> ffn_bwd_cpu(
    const at::Tensor& dout, const at::Tensor& x, const at::Tensor& w1, const at::Tensor& w2,
    const at::Tensor& pre_in, c10::string_view activation, std::array<bool, 2> output_mask) {
  const ActSpec act = parse_activation(std::string(activation));
  const Dims d = check_ffn(x, w1, w2, act);
  const int64_t D2 = w2.size(0);
  check_matrix(dout, x, "dout");
  check_shape(dout, {d.M, D2}, "dout");
  check_matrix(pre_in, x, "pre");
  check_shape(pre_in, {d.M, d.F1}, "pre");
  const at::Tensor pre = pre_in.contiguous();
  const Gemm gemm(x.scalar_type());
  const at::Tensor dout_g = gemm.in(dout);
  const at::Tensor da = gemm.out(mm_call(dout_g, gemm.in(w2))).contiguous();  // (M, F)
  at::Tensor dpre = empty_tensor({d.M, d.F1}, x.options());
  at::Tensor a = empty_tensor({d.M, d.F}, x.options());
  at::Tensor db1 = empty_tensor({0}, w1.options()), db2 = empty_tensor({0}, w2.options());
  FASTATTN_DISPATCH_FLOATING_HALF_BF16(x.scalar_type(), "ffn_bwd_cpu", [&] {
    using A = acc_t<scalar_t>;
    const auto acc_opts = x.options().dtype(c10::CppTypeToScalarType<A>::value);
    const int64_t blocks = cpu::row_blocks(d.M);
    at::Tensor part;
    if (output_mask[0] && blocks > 0) part = empty_tensor({blocks, d.F1}, acc_opts).zero_();
    if (d.M > 0 && d.F > 0) {
      const scalar_t* pp = pre.const_data_ptr<scalar_t>();
      const scalar_t* dap = da.const_data_ptr<scalar_t>();
      scalar_t* dpp = dpre.data_ptr<scalar_t>();
      scalar_t* ap = a.data_ptr<scalar_t>();
      if (part.defined()) {
        A* cs = part.data_ptr<A>();
        cpu::for_row_blocks(d.M, blocks, [&](int64_t k, int64_t r0, int64_t r1) {
          act_bwd<scalar_t>(act, d, pp, dap, dpp, ap, cs + k * d.F1, r0, r1);
        });
      } else {
        at::parallel_for(0, d.M, grain_rows(d.F1), [&](int64_t r0, int64_t r1) {
          act_bwd<scalar_t>(act, d, pp, dap, dpp, ap, nullptr, r0, r1);
        });
      }
    }
    if (output_mask[0]) {
      db1 = part.defined() ? cpu::sum_partials<A>(part).to(w1.scalar_type())
                           : empty_tensor({d.F1}, w1.options()).zero_();
    }
    if (output_mask[1]) {
      const at::Tensor dc = dout.stride(1) == 1 || D2 <= 1 ? dout : dout.contiguous();
      db2 = column_sum<scalar_t>(dc.const_data_ptr<scalar_t>(), d.M, D2, dc.stride(0), x.options())
                .to(w2.scalar_type());
    }
  });
  const at::Tensor dpre_g = gemm.in(dpre);
  at::Tensor dw2 = gemm.out(mm_call(dout_g.t(), gemm.in(a)));
  at::Tensor dx = gemm.out(mm_call(dpre_g, gemm.in(w1)));
  at::Tensor dw1 = gemm.out(mm_call(dpre_g.t(), gemm.in(x)));
  return {dx, dw1, db1, dw2, db2};
}

}  // namespace

bool cpu::ffn_gemm_in_float(c10::ScalarType st) {
  if (st != at::kBFloat16 && st != at::kHalf) return false;
  const char* env = std::getenv("FASTATTN_CPU_FFN_GEMM");
  if (env != nullptr && env[0] != '\0') return std::strcmp(env, "native") != 0;
  return !cpu_has_dot_for(st);
}

TORCH_LIBRARY_IMPL(fastattn, CPU, m) {
  m.impl("ffn_fwd", &ffn_fwd_cpu);
  m.impl("ffn_bwd", &ffn_bwd_cpu);
}

}  // namespace fastattn
