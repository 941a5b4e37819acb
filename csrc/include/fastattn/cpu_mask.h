// Reading an attention / softmax mask through its strides (CPU kernels). A mask is bool (true =
// keep) or any floating dtype (added to the scaled scores, read in the accumulation type); it is a
// broadcast view of (L0, L1, Lq, Lk) whose broadcast dimensions have stride 0, and is never
// materialized. Host code only.
#pragma once

#include <ATen/core/Tensor.h>
#include <c10/util/Exception.h>

#include <cstring>
#include <limits>
#include <optional>

#include "fastattn/cpu_simd.h"

namespace fastattn {
namespace cpu {

enum class MaskKind { kNone, kBool, kFloat, kDouble, kHalf, kBFloat16 };

struct MaskView {
  MaskKind kind = MaskKind::kNone;
  const void* ptr = nullptr;
  int64_t stride[4] = {0, 0, 0, 0};

  bool defined() const { return kind != MaskKind::kNone; }
  // Element offset of (a, b, i, j).
  int64_t offset(int64_t a, int64_t b, int64_t i, int64_t j) const {
    return a * stride[0] + b * stride[1] + i * stride[2] + j * stride[3];
  }
};

// Checks `mask` (None, or bool / floating of exactly `shape`, any strides) and describes it.
inline MaskView make_mask_view(const std::optional<at::Tensor>& mask, at::IntArrayRef shape,
                               const at::Tensor& x, const char* x_name) {
  MaskView view;
  if (!mask.has_value() || !mask->defined()) return view;
  const at::Tensor& m = *mask;
  TORCH_CHECK(m.device() == x.device(), "mask must be on the device of ", x_name, " (", x.device(),
              "), got ", m.device());
  TORCH_CHECK(m.sizes() == shape, "mask must be a view of shape ", shape,
              " (expand a broadcastable mask to it), got shape ", m.sizes());
  switch (m.scalar_type()) {
    case at::kBool: view.kind = MaskKind::kBool; break;
    case at::kFloat: view.kind = MaskKind::kFloat; break;
    case at::kDouble: view.kind = MaskKind::kDouble; break;
    case at::kHalf: view.kind = MaskKind::kHalf; break;
    case at::kBFloat16: view.kind = MaskKind::kBFloat16; break;
    default:
      TORCH_CHECK(false, "mask must be bool or floating (float64, float32, float16, bfloat16), got ",
                  m.scalar_type());
  }
  view.ptr = m.data_ptr();
  for (int d = 0; d < 4; ++d) view.stride[d] = m.stride(d);
  return view;
}

// The contiguous row's whole vectors (32 bytes of A; compiled for the caller's ISA, which the
// kernels inline this into): as the loops below, c < returned count done. Measured on a 2 x 4 x
// 512 x 512 float mask, 1 thread AVX2: the element loops cost ~4 cycles a score, more than
// torch's whole mask handling.
template <class A, class M>
FASTATTN_INLINE int64_t apply_mask_row_vectors(A* s, int64_t n, const M* m) {
#if FASTATTN_VECTOR_EXTENSIONS
  using V = Vec<A, 32 / sizeof(A)>;
  constexpr int64_t W = V::size;
  const V neg_inf(-std::numeric_limits<A>::infinity());
  int64_t c = 0;
  if constexpr (std::is_same_v<M, uint8_t>) {  // keep where the byte is non-zero
    typedef uint8_t Bytes __attribute__((vector_size(W)));
    for (; c + W <= n; c += W) {
      Bytes b;
      std::memcpy(&b, m + c, sizeof(b));
      const V keep(__builtin_convertvector(b, typename V::Raw));
      V::select_gt(keep, V(A(0)), V::load(s + c), neg_inf).store(s + c);
    }
  } else if constexpr (std::is_same_v<M, A> ||
                       (std::is_same_v<M, c10::BFloat16> && std::is_same_v<A, float>)) {
    for (; c + W <= n; c += W) {
      V mv;
      if constexpr (std::is_same_v<M, A>) mv = V::load(m + c);
      else mv = load_bf16<W>(m + c);
      V::select_neg_inf(mv, neg_inf, V::load(s + c) + mv).store(s + c);
    }
  }
  return c;
#else
  return 0;
#endif
}

template <class A, class M>
FASTATTN_INLINE void apply_mask_row_typed(A* s, int64_t n, const M* m, int64_t stride) {
  if constexpr (std::is_same_v<M, uint8_t>) {
    const A neg_inf = -std::numeric_limits<A>::infinity();
    if (stride == 1) {
      for (int64_t c = apply_mask_row_vectors<A>(s, n, m); c < n; ++c) s[c] = m[c] != 0 ? s[c] : neg_inf;
    } else {
      for (int64_t c = 0; c < n; ++c) s[c] = m[c * stride] != 0 ? s[c] : neg_inf;
    }
  } else {
    // -inf masks the entry out (s = -inf even when s is NaN: a NaN at a masked-out key must not
    // leak, docs/numerics.md); any other value is added.
    const A neg_inf = -std::numeric_limits<A>::infinity();
    auto add = [neg_inf](A x, A mv) { return mv == neg_inf ? neg_inf : x + mv; };
    if (stride == 1) {
      for (int64_t c = apply_mask_row_vectors<A>(s, n, m); c < n; ++c) s[c] = add(s[c], to_acc<A>(m[c]));
    } else {
      for (int64_t c = 0; c < n; ++c) s[c] = add(s[c], to_acc<A>(m[c * stride]));
    }
  }
}

// s[c] += mask[offset + c * stride] for c < n (float masks; s[c] = -inf where the mask is -inf),
// or s[c] = -inf where a bool mask is false.
template <class A>
FASTATTN_INLINE void apply_mask_row(A* s, int64_t n, const MaskView& mask, int64_t offset,
                                    int64_t stride) {
  switch (mask.kind) {
    case MaskKind::kBool:
      apply_mask_row_typed<A>(s, n, static_cast<const uint8_t*>(mask.ptr) + offset, stride);
      break;
    case MaskKind::kFloat:
      apply_mask_row_typed<A>(s, n, static_cast<const float*>(mask.ptr) + offset, stride);
      break;
    case MaskKind::kDouble:
      apply_mask_row_typed<A>(s, n, static_cast<const double*>(mask.ptr) + offset, stride);
      break;
    case MaskKind::kHalf:
      apply_mask_row_typed<A>(s, n, static_cast<const c10::Half*>(mask.ptr) + offset, stride);
      break;
    case MaskKind::kBFloat16:
      apply_mask_row_typed<A>(s, n, static_cast<const c10::BFloat16*>(mask.ptr) + offset, stride);
      break;
    case MaskKind::kNone:
      break;
  }
}

}  // namespace cpu
}  // namespace fastattn
