// Scaled masked softmax on CPU (fastattn::softmax_fwd / softmax_bwd).
//
//   forward   s_j = scale * x_j + m_j      (float mask: m_j added; bool mask: 0 / -inf)
//             s_j = -inf where j > i        (is_causal, top-left over (Lq, Lk))
//             y_j = exp(s_j - max s) / sum_k exp(s_k - max s);  a row with max s = -inf is 0
//   backward  dx_j = scale * y_j * (dy_j - sum_k dy_k y_k)      (0 for such a row, by formula)
//
// Work split: at::parallel_for over the rows of the flattened (L0, L1, Lq) index; x, dy and y are
// read through their three leading strides (the last dimension is contiguous), the mask through
// all four of its strides (broadcast dimensions have stride 0 and are never expanded). Rows are
// processed with cpu_simd.h vectors (AVX-512 / AVX2 / baseline chosen at run time), 16-bit
// values converted on the fly (cpu::load_as / store_as). Forward (softmax_row): a max pass, an
// exp-and-sum pass and a normalize-and-store pass; a row with a mask first goes into a
// per-thread float buffer (scale * x + mask), one without goes straight from x to y (16-bit:
// through the buffer, rounded once at the end). Backward: a
// dot pass and an output pass, no buffer. Under is_causal only the first i + 1 entries of row i
// are computed; the rest are written as 0. Outputs are contiguous.
//
// Precision: float32 arithmetic for float32 / float16 / bfloat16 (the result is rounded once),
// float64 for float64. The mask may have any floating dtype (read in the accumulation type) or be
// bool. Any row length, including 0.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <limits>
#include <vector>

#include "fastattn/common.h"
#include "fastattn/cpu_mask.h"
#include "fastattn/cpu_simd.h"
#include "fastattn/softmax.h"

namespace fastattn {
namespace {

using cpu::acc_t;
using cpu::Vec;

struct Rows4 {
  int64_t L1, Lq, N;
  int64_t s0, s1, s2;  // strides of the three leading dims (the last has stride 1)
};

// The index (a, b, i) of a row of the flattened (L0, L1, Lq) index, stepped from row to row: the
// divisions that find it took longer than a short row's arithmetic (three 64-bit divisions per
// tensor per row were about a quarter of the bfloat16 backward at 4x8x256x128).
struct RowIndex {
  int64_t a, b, i;
  RowIndex(const Rows4& r, int64_t row)
      : a(row / r.Lq / r.L1), b(row / r.Lq % r.L1), i(row % r.Lq) {}
  int64_t offset(const Rows4& r) const { return a * r.s0 + b * r.s1 + i * r.s2; }
  void next(const Rows4& r) {
    if (++i == r.Lq) {
      i = 0;
      if (++b == r.L1) {
        b = 0;
        ++a;
      }
    }
  }
};

template <class T>
struct FwdArgs {
  const T* x;
  Rows4 xr;
  cpu::MaskView mask;
  acc_t<T> scale;
  bool causal;
  T* y;  // contiguous
};

// One row: y[0, n) = softmax(scale * x[0, n)) and y[n, N) = 0, in three passes (the max of
// scale * x; exp, summed; scaled by 1 / sum). x of type X: the input row (T), or the float
// buffer s itself (a row with a mask: scale * x + mask already there, scale 1). float32 / float64
// go x -> y with no buffer; otherwise scale * x and then exp are kept in s and y is rounded once,
// on the last pass. (Measured at 4x8x256x128 float32, 2 threads: without the copy into a padded
// buffer the op 15% faster, from 0.82-0.87x torch's softmax.)
template <class V, class X, class T>
FASTATTN_INLINE void softmax_row(const X* x, T* y, typename V::value_type* s, int64_t n, int64_t N,
                                 typename V::value_type scale) {
  using A = typename V::value_type;
  constexpr int64_t W = V::size;
  constexpr bool kDirect = std::is_same_v<X, A> && std::is_same_v<T, A>;
  A* e = kDirect ? reinterpret_cast<A*>(y) : s;  // where exp(scale * x - max) goes
  const A neg_inf = -std::numeric_limits<A>::infinity();
  const V sv(scale);
  V m0(neg_inf), m1(neg_inf);
  int64_t c = 0;
  for (; c + 2 * W <= n; c += 2 * W) {
    const V v0 = cpu::load_as<V>(x + c) * sv, v1 = cpu::load_as<V>(x + c + W) * sv;
    if constexpr (!kDirect) {
      v0.store(s + c);
      v1.store(s + c + W);
    }
    m0 = max(m0, v0);
    m1 = max(m1, v1);
  }
  for (; c + W <= n; c += W) {
    const V v0 = cpu::load_as<V>(x + c) * sv;
    if constexpr (!kDirect) v0.store(s + c);
    m0 = max(m0, v0);
  }
  A mx = max(m0, m1).max_lane();
  for (; c < n; ++c) {
    const A v = cpu::to_acc<A>(x[c]) * scale;
    if constexpr (!kDirect) s[c] = v;
    mx = mx > v ? mx : v;
  }
  if (mx == neg_inf || n == 0) {
    std::fill(y, y + N, cpu::from_acc<T>(A(0)));
    return;
  }
  // scale * x again: from x (direct) or from s
  auto scaled = [&](int64_t i) {
    if constexpr (kDirect) return V::load(x + i) * sv;
    else return V::load(s + i);
  };
  const V mv(mx);
  V a0(A(0)), a1(A(0));
  c = 0;
  for (; c + 2 * W <= n; c += 2 * W) {
    const V e0 = cpu::vexp_shifted(scaled(c) - mv), e1 = cpu::vexp_shifted(scaled(c + W) - mv);
    e0.store(e + c);
    e1.store(e + c + W);
    a0 = a0 + e0;
    a1 = a1 + e1;
  }
  for (; c + W <= n; c += W) {
    const V e0 = cpu::vexp_shifted(scaled(c) - mv);
    e0.store(e + c);
    a0 = a0 + e0;
  }
  A sum = (a0 + a1).sum();
  for (; c < n; ++c) {
    e[c] = cpu::sexp((kDirect ? cpu::to_acc<A>(x[c]) * scale : s[c]) - mx);
    sum += e[c];
  }
  const A inv = A(1) / sum;
  const V iv(inv);
  c = 0;
  for (; c + W <= n; c += W) cpu::store_as(V::load(e + c) * iv, y + c);
  for (; c < n; ++c) y[c] = cpu::from_acc<T>(e[c] * inv);
  std::fill(y + n, y + N, cpu::from_acc<T>(A(0)));
}

template <class T, class V>
FASTATTN_INLINE void softmax_fwd_rows(const FwdArgs<T>& p, int64_t r0, int64_t r1) {
  using A = acc_t<T>;
  constexpr int64_t W = V::size;
  const int64_t N = p.xr.N;
  std::vector<A> buf(std::max<int64_t>(N, 1));
  A* s = buf.data();
  const V sv(p.scale);
  RowIndex at(p.xr, r0);
  for (int64_t row = r0; row < r1; ++row, at.next(p.xr)) {
    const int64_t i = at.i;
    const int64_t n = p.causal ? std::min<int64_t>(N, i + 1) : N;
    const T* x = p.x + at.offset(p.xr);
    T* y = p.y + row * N;
    if (!p.mask.defined()) {
      softmax_row<V>(x, y, s, n, N, static_cast<A>(p.scale));
      continue;
    }
    // s = scale * x + mask, then the row's softmax from s
    int64_t c = 0;
    for (; c + W <= n; c += W) (cpu::load_as<V>(x + c) * sv).store(s + c);
    for (; c < n; ++c) s[c] = cpu::to_acc<A>(x[c]) * static_cast<A>(p.scale);
    cpu::apply_mask_row(s, n, p.mask, p.mask.offset(at.a, at.b, i, 0), p.mask.stride[3]);
    softmax_row<V>(static_cast<const A*>(s), y, s, n, N, A(1));
  }
}

template <class T>
struct BwdArgs {
  const T* dy;
  Rows4 dyr;
  const T* y;
  Rows4 yr;
  acc_t<T> scale;
  T* dx;  // contiguous
};

template <class T, class V>
FASTATTN_INLINE void softmax_bwd_rows(const BwdArgs<T>& p, int64_t r0, int64_t r1) {
  using A = acc_t<T>;
  constexpr int64_t W = V::size;
  const int64_t N = p.yr.N;
  // Two passes over y and dy, read through their dtype (16-bit rows converted on the fly, no
  // buffer), dx rounded once. Both passes are order-free (a sum, then elementwise), so whole
  // 2W-value blocks go as cpu::load_pair_as / store_pair_as: bfloat16 without a shuffle (the
  // widening loads bounded the bfloat16 backward at 4x8x256x128, 1.6x torch's time).
  RowIndex at(p.yr, r0);
  for (int64_t row = r0; row < r1; ++row, at.next(p.yr)) {
    const T* y = p.y + at.offset(p.yr);
    const T* dy = p.dy + at.offset(p.dyr);
    V a0(A(0)), a1(A(0));
    int64_t c = 0;
    for (; c + 2 * W <= N; c += 2 * W) {
      V y0, y1, d0, d1;
      cpu::load_pair_as(y + c, y0, y1);
      cpu::load_pair_as(dy + c, d0, d1);
      a0 = fma(y0, d0, a0);
      a1 = fma(y1, d1, a1);
    }
    for (; c + W <= N; c += W) a0 = fma(cpu::load_as<V>(y + c), cpu::load_as<V>(dy + c), a0);
    A dot = (a0 + a1).sum();
    for (; c < N; ++c) dot += cpu::to_acc<A>(y[c]) * cpu::to_acc<A>(dy[c]);
    const V dv(dot), sv(p.scale);
    T* dx = p.dx + row * N;
    c = 0;
    for (; c + 2 * W <= N; c += 2 * W) {
      V y0, y1, d0, d1;
      cpu::load_pair_as(y + c, y0, y1);
      cpu::load_pair_as(dy + c, d0, d1);
      cpu::store_pair_as(sv * y0 * (d0 - dv), sv * y1 * (d1 - dv), dx + c);
    }
    for (; c + W <= N; c += W) {
      cpu::store_as(sv * cpu::load_as<V>(y + c) * (cpu::load_as<V>(dy + c) - dv), dx + c);
    }
    for (; c < N; ++c) {
      dx[c] = cpu::from_acc<T>(p.scale * cpu::to_acc<A>(y[c]) * (cpu::to_acc<A>(dy[c]) - dot));
    }
  }
}

// The row kernels for the ISA trampoline (cpu::isa_dispatch).
template <class T>
struct FwdKernel {
  template <int kBytes>
  FASTATTN_INLINE static void run(const FwdArgs<T>& p, int64_t r0, int64_t r1) {
    softmax_fwd_rows<T, Vec<acc_t<T>, kBytes / sizeof(acc_t<T>)>>(p, r0, r1);
  }
};
template <class T>
struct BwdKernel {
  template <int kBytes>
  FASTATTN_INLINE static void run(const BwdArgs<T>& p, int64_t r0, int64_t r1) {
    softmax_bwd_rows<T, Vec<acc_t<T>, kBytes / sizeof(acc_t<T>)>>(p, r0, r1);
  }
};

int64_t grain_rows(int64_t n) { return std::max<int64_t>(1, 32768 / std::max<int64_t>(n, 1)); }

Rows4 rows_of(const at::Tensor& t) {
  return {t.size(1), t.size(2), t.size(3), t.stride(0), t.stride(1), t.stride(2)};
}

at::Tensor softmax_fwd_cpu(const at::Tensor& x, const std::optional<at::Tensor>& mask, double scale,
                           bool is_causal) {
  check_softmax_input(x, "x", /*allow_double=*/true);
  const cpu::MaskView mview = cpu::make_mask_view(mask, x.sizes(), x, "x");
  at::Tensor y = empty_tensor(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t rows = x.size(0) * x.size(1) * x.size(2), n = x.size(3);
  if (rows == 0 || n == 0) return y;
  FASTATTN_DISPATCH_FLOATING_HALF_BF16(x.scalar_type(), "softmax_fwd_cpu", [&] {
    const FwdArgs<scalar_t> p{x.const_data_ptr<scalar_t>(), rows_of(x), mview,
                              static_cast<acc_t<scalar_t>>(scale), is_causal,
                              y.data_ptr<scalar_t>()};
    at::parallel_for(0, rows, grain_rows(n), [&](int64_t r0, int64_t r1) {
      cpu::isa_dispatch<FwdKernel<scalar_t>>(p, r0, r1);
    });
  });
  return y;
}

at::Tensor softmax_bwd_cpu(const at::Tensor& dy, const at::Tensor& y, double scale) {
  check_softmax_bwd(dy, y, /*allow_double=*/true);
  at::Tensor dx = empty_tensor(y.sizes(), y.options().memory_format(at::MemoryFormat::Contiguous));
  const int64_t rows = y.size(0) * y.size(1) * y.size(2), n = y.size(3);
  if (rows == 0 || n == 0) return dx;
  FASTATTN_DISPATCH_FLOATING_HALF_BF16(y.scalar_type(), "softmax_bwd_cpu", [&] {
    const BwdArgs<scalar_t> p{dy.const_data_ptr<scalar_t>(), rows_of(dy),
                              y.const_data_ptr<scalar_t>(), rows_of(y),
                              static_cast<acc_t<scalar_t>>(scale), dx.data_ptr<scalar_t>()};
    at::parallel_for(0, rows, grain_rows(n), [&](int64_t r0, int64_t r1) {
      cpu::isa_dispatch<BwdKernel<scalar_t>>(p, r0, r1);
    });
  });
  return dx;
}

}  // namespace

TORCH_LIBRARY_IMPL(fastattn, CPU, m) {
  m.impl("softmax_fwd", &softmax_fwd_cpu);
  m.impl("softmax_bwd", &softmax_bwd_cpu);
}

}  // namespace fastattn
