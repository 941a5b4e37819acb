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
#include <vector>

#include "fastattn/cpu_simd.h"

namespace fastattn {
namespace cpu {

enum class MaskKind { kNone, kBool, kFloat, kDouble, kHalf, kBFloat16 };

struct MaskView {
  MaskKind kind = MaskKind::kNone;
  const void* ptr = nullptr;
  int64_t stride[4] = {0, 0, 0, 0};
  int64_t origin = 0;  // subtracted from every offset (a staged copy: stage_rows)

  bool defined() const { return kind != MaskKind::kNone; }
  // Element offset of (a, b, i, j).
  int64_t offset(int64_t a, int64_t b, int64_t i, int64_t j) const {
    return a * stride[0] + b * stride[1] + i * stride[2] + j * stride[3] - origin;
  }
};

inline int64_t mask_element_bytes(MaskKind kind) {
  switch (kind) {
    case MaskKind::kBool: return 1;
    case MaskKind::kHalf:
    case MaskKind::kBFloat16: return 2;
    case MaskKind::kFloat: return 4;
    case MaskKind::kDouble: return 8;
    default: return 0;
  }
}

// The rows [i0, i0 + nq) x keys [j0, j0 + nk) of `mask` at (a, b), copied into `buf` row after row,
// and a view that reads them there by their own (a, b, i, j) -- or `mask` itself where a copy gains
// nothing (no mask, 4- or 8-byte elements, keys not contiguous, or one row for every query). Why: a
// kernel that walks a query block's keys a short tile at a time (the attention backward: 64 keys)
// reads each of its rows in 128-byte pieces, one 4 KB page apart per row, too many streams for the
// hardware prefetchers. Measured (B1 H4 L2048 D64 bfloat16 backward, 2 threads, min of 10-12 runs
// interleaved with the unmasked one): a (1, 1, L, L) bfloat16 bias cost +17-23 ms (AVX2) and +18
// (AVX-512) read in place, +2-3 staged; a float32 one +2 either way (not staged: the copy is its
// whole cost there); a bool one +11-13 either way (a cost elsewhere).
inline MaskView stage_rows(const MaskView& mask, int64_t a, int64_t b, int64_t i0, int64_t nq,
                           int64_t j0, int64_t nk, std::vector<unsigned char>& buf) {
  const int64_t bytes = mask_element_bytes(mask.kind);
  if (!mask.defined() || bytes > 2 || mask.stride[3] != 1 || mask.stride[2] == 0 || nq <= 1) {
    return mask;
  }
  // rows 64 bytes apart plus one line, so that they do not all map to the same cache sets
  const int64_t ld = (nk * bytes + 63) / 64 * 64 / bytes + 64 / bytes;
  buf.resize(static_cast<size_t>(nq * ld * bytes));
  const auto* src = static_cast<const unsigned char*>(mask.ptr);
  for (int64_t r = 0; r < nq; ++r) {
    std::memcpy(buf.data() + r * ld * bytes, src + mask.offset(a, b, i0 + r, j0) * bytes,
                static_cast<size_t>(nk * bytes));
  }
  MaskView view;
  view.kind = mask.kind;
  view.ptr = buf.data();
  view.stride[2] = ld;
  view.stride[3] = 1;
  view.origin = i0 * ld + j0;
  return view;
}

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

#if FASTATTN_VECTOR_EXTENSIONS
// The mask dtypes the vector paths below take for accumulation type A: bool (a byte), A itself,
// and bfloat16 for float.
template <class A, class M>
constexpr bool kVectorMask = std::is_same_v<M, uint8_t> || std::is_same_v<M, A> ||
                             (std::is_same_v<M, c10::BFloat16> && std::is_same_v<A, float>);

// W mask values at m as a vector of A (a bool mask as 0 / 1).
template <class V, class M>
FASTATTN_INLINE V load_mask(const M* m) {
  constexpr int W = V::size;
  if constexpr (std::is_same_v<M, uint8_t>) {
    typedef uint8_t Bytes __attribute__((vector_size(W)));
    Bytes b;
    std::memcpy(&b, m, sizeof(b));
    return V(__builtin_convertvector(b, typename V::Raw));
  } else if constexpr (std::is_same_v<M, typename V::value_type>) {
    return V::load(m);
  } else {
    return load_bf16<W>(m);
  }
}

// Scores s under mask values mv (load_mask's): apply_mask_row_typed's rule, a vector at a time.
template <class M, class V>
FASTATTN_INLINE V masked(V s, V mv) {
  using A = typename V::value_type;
  const V neg_inf(-std::numeric_limits<A>::infinity());
  if constexpr (std::is_same_v<M, uint8_t>) return V::select_gt(mv, V(A(0)), s, neg_inf);
  else return V::select_neg_inf(mv, neg_inf, s + mv);
}
#endif

// The contiguous row's whole vectors (32 bytes of A; compiled for the caller's ISA, which the
// kernels inline this into): as the loops below, c < returned count done. Measured on a 2 x 4 x
// 512 x 512 float mask, 1 thread AVX2: the element loops cost ~4 cycles a score, more than
// torch's whole mask handling.
template <class A, class M>
FASTATTN_INLINE int64_t apply_mask_row_vectors(A* s, int64_t n, const M* m) {
#if FASTATTN_VECTOR_EXTENSIONS
  using V = Vec<A, 32 / sizeof(A)>;
  constexpr int64_t W = V::size;
  int64_t c = 0;
  if constexpr (kVectorMask<A, M>) {
    for (; c + W <= n; c += W) masked<M>(V::load(s + c), load_mask<V>(m + c)).store(s + c);
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

// The whole W x W blocks of a transposed tile (apply_mask_tile_t below) of a mask whose key
// stride is 1: W query rows of the mask, W keys each, loaded as vectors, transposed in registers
// (cpu::transpose) into W key rows over W queries, applied to those rows of st. Returns how many
// key rows it did (a multiple of W; their query tail too). Compiled for the caller's ISA, with
// 32-byte vectors as apply_mask_row_vectors.
template <class A, class M>
FASTATTN_INLINE int64_t apply_mask_tile_t_vectors(A* st, int64_t ld, int64_t nk, int64_t nq,
                                                  const M* m, int64_t stride_q) {
#if FASTATTN_VECTOR_EXTENSIONS
  using V = Vec<A, 32 / sizeof(A)>;
  constexpr int64_t W = V::size;
  if constexpr (kVectorMask<A, M>) {
    const int64_t nk_w = nk / W * W, nq_w = nq / W * W;
    for (int64_t r = 0; r < nk_w; r += W) {
      for (int64_t c = 0; c < nq_w; c += W) {
        V t[W];
        for (int64_t u = 0; u < W; ++u) {  // mask row of query c + u, keys r .. r + W
          t[u] = load_mask<V>(m + (c + u) * stride_q + r);
        }
        transpose(t);  // t[k]: key r + k, queries c .. c + W
        for (int64_t k = 0; k < W; ++k) {
          A* s = st + (r + k) * ld + c;
          masked<M>(V::load(s), t[k]).store(s);
        }
      }
      for (int64_t k = 0; k < W && nq_w < nq; ++k) {  // the query tail of these key rows
        apply_mask_row_typed<A>(st + (r + k) * ld + nq_w, nq - nq_w, m + nq_w * stride_q + r + k,
                                stride_q);
      }
    }
    return nk_w;
  }
#endif
  return 0;
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

// apply_mask_row (offset into the mask, its key stride) on the n scores of s, then -inf on the
// padding [n, npad) (npad a multiple of V::size), returning the row's maximum (V::max_lane's
// rule: a NaN may or may not win; callers test for it). A contiguous mask of a vector dtype is
// applied in vectors of the caller's V in the same pass as the maximum: done apart, the two
// read every score twice, the mask in 32-byte vectors (9% of a 2x4x512x64 float32 forward with a
// float bias on AVX-512, one thread, where torch's kernel spends ~5% on its mask).
template <class V, class M>
FASTATTN_INLINE typename V::value_type mask_max_row_typed(typename V::value_type* s, int64_t n,
                                                          int64_t npad, const M* m,
                                                          int64_t stride) {
  using A = typename V::value_type;
  constexpr int64_t W = V::size;
  const A neg_inf = -std::numeric_limits<A>::infinity();
  V m0(neg_inf), m1(neg_inf);
  int64_t c = 0;
#if FASTATTN_VECTOR_EXTENSIONS
  if constexpr (kVectorMask<A, M>) {
    if (stride == 1) {
      for (; c + 2 * W <= n; c += 2 * W) {
        const V x0 = masked<M>(V::load(s + c), load_mask<V>(m + c));
        const V x1 = masked<M>(V::load(s + c + W), load_mask<V>(m + c + W));
        x0.store(s + c);
        x1.store(s + c + W);
        m0 = max(m0, x0);
        m1 = max(m1, x1);
      }
    }
  }
#endif
  apply_mask_row_typed<A>(s + c, n - c, m + c * stride, stride);
  std::fill(s + n, s + npad, neg_inf);
  for (; c + 2 * W <= npad; c += 2 * W) {
    m0 = max(m0, V::load(s + c));
    m1 = max(m1, V::load(s + c + W));
  }
  if (c < npad) m0 = max(m0, V::load(s + c));
  return max(m0, m1).max_lane();
}

// (mask defined. The switch over the mask's dtype is apply_mask_row's again: a generic lambda
// visitor, written once, would be compiled apart for the baseline ISA, not inlined into the
// caller's AVX2 / AVX-512 kernel.)
template <class V>
FASTATTN_INLINE typename V::value_type apply_mask_row_max(typename V::value_type* s, int64_t n,
                                                          int64_t npad, const MaskView& mask,
                                                          int64_t offset, int64_t stride) {
  const void* p = mask.ptr;
  switch (mask.kind) {
    case MaskKind::kBool:
      return mask_max_row_typed<V>(s, n, npad, static_cast<const uint8_t*>(p) + offset, stride);
    case MaskKind::kFloat:
      return mask_max_row_typed<V>(s, n, npad, static_cast<const float*>(p) + offset, stride);
    case MaskKind::kDouble:
      return mask_max_row_typed<V>(s, n, npad, static_cast<const double*>(p) + offset, stride);
    case MaskKind::kHalf:
      return mask_max_row_typed<V>(s, n, npad, static_cast<const c10::Half*>(p) + offset, stride);
    case MaskKind::kBFloat16:
      return mask_max_row_typed<V>(s, n, npad, static_cast<const c10::BFloat16*>(p) + offset, stride);
    case MaskKind::kNone:
      break;
  }
  TORCH_INTERNAL_ASSERT(false, "apply_mask_row_max needs a mask");
  return typename V::value_type(0);
}

// st[r * ld + c] for key r < nk and query c < nq: a tile of transposed scores (keys as rows)
// gets the mask of (query c, key r) at offset + c * stride_q + r * stride_k, with
// apply_mask_row's rule. Row by row that reads the mask down its columns, element by element
// (~4 cycles a score); where the key stride is 1, whole W x W blocks are read along the rows
// and transposed in registers (measured: the two-pass backward of B1 H4/Hkv1 L2048 with a
// (1, 1, L, L) bias, 134-170 -> 116-138 ms). Other mask dtypes and the tails go row by row.
template <class A>
FASTATTN_INLINE void apply_mask_tile_t(A* st, int64_t ld, int64_t nk, int64_t nq,
                                       const MaskView& mask, int64_t offset, int64_t stride_q,
                                       int64_t stride_k) {
  int64_t done = 0;
  if (stride_k == 1) {
    // (no lambda here: its body would be compiled outside the caller's ISA target)
    switch (mask.kind) {
      case MaskKind::kBool:
        done = apply_mask_tile_t_vectors<A>(
            st, ld, nk, nq, static_cast<const uint8_t*>(mask.ptr) + offset, stride_q);
        break;
      case MaskKind::kFloat:
        done = apply_mask_tile_t_vectors<A>(
            st, ld, nk, nq, static_cast<const float*>(mask.ptr) + offset, stride_q);
        break;
      case MaskKind::kBFloat16:
        done = apply_mask_tile_t_vectors<A>(
            st, ld, nk, nq, static_cast<const c10::BFloat16*>(mask.ptr) + offset, stride_q);
        break;
      default:
        break;
    }
  }
  for (int64_t r = done; r < nk; ++r) {
    apply_mask_row(st + r * ld, nq, mask, offset + r * stride_k, stride_q);
  }
}

}  // namespace cpu
}  // namespace fastattn
