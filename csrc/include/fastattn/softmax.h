// Argument checks of softmax_fwd / softmax_bwd's inputs, shared by csrc/cpu/softmax.cpp and
// csrc/cuda/softmax.cu so both backends accept exactly the same tensors. Host code only.
//
// Accepted: x / y / dy are 4-D (L0, L1, Lq, Lk) with a contiguous last dimension and any other
// strides, float32, float16 or bfloat16 (and float64 on CPU); dy has y's device, shape and dtype.
// The mask is checked by each backend (cpu_mask.h's make_mask_view; softmax.cu).
#pragma once

#include "fastattn/common.h"

namespace fastattn {

inline void check_softmax_input(const at::Tensor& t, const char* name, bool allow_double) {
  TORCH_CHECK(t.dim() == 4, name, " must be 4-D (L0, L1, Lq, Lk), got shape ", t.sizes());
  check_float_dtype(t, name, allow_double);
  check_last_dim_contiguous(t, name);
}

inline void check_softmax_bwd(const at::Tensor& dy, const at::Tensor& y, bool allow_double) {
  check_softmax_input(y, "y", allow_double);
  check_softmax_input(dy, "dy", allow_double);
  check_like(dy, y, y.sizes(), y.scalar_type(), "dy", "y");
}

}  // namespace fastattn
