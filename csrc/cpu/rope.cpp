// Rotary position embedding (RoPE) on CPU (fastattn::rope_fwd; its backward is the same op with
// inverse = true).
//
// Math, per token at table row p and pair i (D = 2 * half; c = cos[p, i], s = sin[p, i]):
//   pairs      rotate_half (GPT-NeoX / HF LLaMA): (a, b) = (x[i], x[i + half])
//              interleaved (GPT-J):               (a, b) = (x[2i], x[2i + 1])
//   forward    y_a = a * c - b * s,  y_b = b * c + a * s
//   inverse    the rotation by -theta (s negated): the gradient of the forward
// Token (b, l) uses table row l, or positions[b, l] when positions are given; every position is
// checked against [0, P) before any work starts.
//
// Work split: at::parallel_for over the B * L tokens; a task takes the token's cos / sin rows
// (sin negated once into a small buffer for the inverse) and applies them to the token's H
// heads, so the table is read once per token. The inner loops are plain, branch-free loops over
// the pairs that the compiler vectorizes (float32 / float64 in place; float16 / bfloat16
// converted element by element). Memory bound: one read of x, one write of y.
//
// Precision: float32 / float16 / bfloat16 compute in float32 with float32 tables, float64 in
// float64 with float64 tables (so gradcheck runs); y is rounded to x's dtype once.
#include <ATen/Parallel.h>
#include <ATen/TensorIterator.h>  // at::internal::GRAIN_SIZE
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <type_traits>
#include <vector>

#include "fastattn/common.h"

namespace fastattn {
namespace {

template <typename T>
using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

// One head row of one token: y = R(theta) x over `half` pairs. c / s: the token's table rows
// (s already negated for the inverse rotation).
template <typename T, typename A, bool kInterleaved>
inline void rotate_row(const T* __restrict x, T* __restrict y, const A* __restrict c,
                       const A* __restrict s, int64_t half) {
  if constexpr (kInterleaved) {
    for (int64_t i = 0; i < half; ++i) {
      const A a = static_cast<A>(x[2 * i]), b = static_cast<A>(x[2 * i + 1]);
      y[2 * i] = static_cast<T>(a * c[i] - b * s[i]);
      y[2 * i + 1] = static_cast<T>(b * c[i] + a * s[i]);
    }
  } else {
    const T* __restrict x2 = x + half;
    T* __restrict y2 = y + half;
    for (int64_t i = 0; i < half; ++i) {
      const A a = static_cast<A>(x[i]), b = static_cast<A>(x2[i]);
      y[i] = static_cast<T>(a * c[i] - b * s[i]);
      y2[i] = static_cast<T>(b * c[i] + a * s[i]);
    }
  }
}

template <typename T, bool kInterleaved>
void rope_impl(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
               const std::optional<at::Tensor>& positions, bool inverse, at::Tensor& y) {
  using A = acc_t<T>;
  const int64_t B = x.size(0), H = x.size(1), L = x.size(2), D = x.size(3), half = D / 2;
  const int64_t sxb = x.stride(0), sxh = x.stride(1), sxl = x.stride(2);
  const T* x_ptr = x.const_data_ptr<T>();
  T* y_ptr = y.data_ptr<T>();
  const A* cos_ptr = cos.const_data_ptr<A>();
  const A* sin_ptr = sin.const_data_ptr<A>();
  const int64_t* pos_ptr = positions ? positions->const_data_ptr<int64_t>() : nullptr;
  const int64_t spb = positions ? positions->stride(0) : 0;
  const int64_t spl = positions ? positions->stride(1) : 0;

  const int64_t per_token = std::max<int64_t>(1, H * D);
  const int64_t grain = std::max<int64_t>(1, at::internal::GRAIN_SIZE / per_token);
  at::parallel_for(0, B * L, grain, [&](int64_t t0, int64_t t1) {
    std::vector<A> neg_sin(inverse ? half : 0);
    for (int64_t t = t0; t < t1; ++t) {
      const int64_t b = t / L, l = t % L;
      const int64_t row = pos_ptr ? pos_ptr[b * spb + l * spl] : l;
      const A* c = cos_ptr + row * half;
      const A* s = sin_ptr + row * half;
      if (inverse) {
        for (int64_t i = 0; i < half; ++i) neg_sin[i] = -s[i];
        s = neg_sin.data();
      }
      for (int64_t h = 0; h < H; ++h) {
        rotate_row<T, A, kInterleaved>(x_ptr + b * sxb + h * sxh + l * sxl,
                                       y_ptr + ((b * H + h) * L + l) * D, c, s, half);
      }
    }
  });
}

at::Tensor rope_fwd_cpu(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                        const std::optional<at::Tensor>& positions, bool interleaved,
                        bool inverse) {
  TORCH_CHECK(x.dim() == 4, "x must be 4-D (B, H, L, D), got shape ", x.sizes());
  check_float_dtype(x, "x", /*allow_double=*/true);
  const int64_t B = x.size(0), L = x.size(2), D = x.size(3);
  TORCH_CHECK(D > 0 && D % 2 == 0, "x's last dim (head dim) must be even and positive, got ", D);
  TORCH_CHECK(x.numel() == 0 || x.stride(3) == 1,
              "x must have a contiguous last dimension, got shape ", x.sizes(), " and strides ",
              x.strides());
  const auto acc = acc_dtype(x.scalar_type());
  for (const auto& [t, name] : {std::pair{&cos, "cos"}, std::pair{&sin, "sin"}}) {
    check_device(*t, x, name, "x");
    check_dtype(*t, acc, name);
    TORCH_CHECK(t->dim() == 2 && t->size(1) == D / 2, name, " must be (P, D/2) = (P, ", D / 2,
                "), got shape ", t->sizes());
    check_contiguous(*t, name);
  }
  TORCH_CHECK(cos.sizes() == sin.sizes(), "cos and sin must have the same shape, got ",
              cos.sizes(), " and ", sin.sizes());
  const int64_t P = cos.size(0);
  if (positions.has_value()) {
    check_device(*positions, x, "positions", "x");
    check_dtype(*positions, at::kLong, "positions");
    check_shape(*positions, {B, L}, "positions");
  } else {
    TORCH_CHECK(P == L, "without positions the tables must have L = ", L, " rows, got ", P);
  }
  at::Tensor y = empty_tensor(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  if (y.numel() == 0) return y;
  if (positions.has_value()) {
    const int64_t* p = positions->const_data_ptr<int64_t>();
    const int64_t spb = positions->stride(0), spl = positions->stride(1);
    for (int64_t b = 0; b < B; ++b) {
      for (int64_t l = 0; l < L; ++l) {
        const int64_t v = p[b * spb + l * spl];
        TORCH_CHECK(v >= 0 && v < P, "positions[", b, ", ", l, "] = ", v,
                    " is outside the table's rows [0, ", P, ")");
      }
    }
  }
  FASTATTN_DISPATCH_FLOATING_HALF_BF16(x.scalar_type(), "rope_fwd_cpu", [&] {
    if (interleaved) {
      rope_impl<scalar_t, true>(x, cos, sin, positions, inverse, y);
    } else {
      rope_impl<scalar_t, false>(x, cos, sin, positions, inverse, y);
    }
  });
  return y;
}

}  // namespace

TORCH_LIBRARY_IMPL(fastattn, CPU, m) { m.impl("rope_fwd", &rope_fwd_cpu); }

}  // namespace fastattn
