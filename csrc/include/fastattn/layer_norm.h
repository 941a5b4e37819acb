// Argument checks and forward outputs of layer_norm_fwd / layer_norm_bwd, shared by
// csrc/cpu/layer_norm.cpp and csrc/cuda/layer_norm.cu so both backends accept exactly the same
// inputs and agree on empty ones. Host code only.
//
// Accepted: x / h / residual / dy / dh are (M, N) row matrices (contiguous last dim, any row
// stride) of one dtype: float32, float16, bfloat16 (and float64 on CPU). weight and bias are
// contiguous (N,), with x's dtype or float32, the same dtype for both; dweight / dbias come back
// in that dtype. mean (unused by RMSNorm) and rstd are contiguous float32 (M,).
#pragma once

#include <ATen/core/Tensor.h>

#include <cmath>
#include <tuple>

#include "fastattn/common.h"

namespace fastattn {

inline void check_layer_norm_params(const at::Tensor& x, const std::optional<at::Tensor>& weight,
                                    const std::optional<at::Tensor>& bias, const char* x_name) {
  const int64_t n = x.size(1);
  for (const auto& [p, name] : {std::pair{&weight, "weight"}, std::pair{&bias, "bias"}}) {
    if (!p->has_value()) continue;
    const at::Tensor& t = **p;
    check_device(t, x, name, x_name);
    check_shape(t, {n}, name);
    check_contiguous(t, name);
    check_param_dtype(t, x.scalar_type(), name);
  }
  if (weight.has_value() && bias.has_value()) {
    TORCH_CHECK(weight->scalar_type() == bias->scalar_type(),
                "weight and bias must have the same dtype, got ", weight->scalar_type(), " and ",
                bias->scalar_type());
  }
}

inline void check_layer_norm_fwd(const at::Tensor& x, const std::optional<at::Tensor>& residual,
                                 const std::optional<at::Tensor>& weight,
                                 const std::optional<at::Tensor>& bias, bool allow_double) {
  check_rows(x, "x");
  check_float_dtype(x, "x", allow_double);
  if (residual.has_value()) {
    check_device(*residual, x, "residual", "x");
    check_shape(*residual, x.sizes(), "residual");
    check_rows(*residual, "residual");
    check_dtype(*residual, x.scalar_type(), "residual");
  }
  check_layer_norm_params(x, weight, bias, "x");
}

inline void check_layer_norm_bwd(const at::Tensor& dy, const std::optional<at::Tensor>& dh,
                                 const at::Tensor& h, const std::optional<at::Tensor>& weight,
                                 const at::Tensor& mean, const at::Tensor& rstd, bool rms,
                                 bool allow_double) {
  check_rows(h, "h");
  check_float_dtype(h, "h", allow_double);
  const int64_t m = h.size(0);
  for (const auto& [p, name] : {std::pair{&dy, "dy"}, std::pair{dh ? &*dh : nullptr, "dh"}}) {
    if (p == nullptr) continue;
    check_device(*p, h, name, "h");
    check_shape(*p, h.sizes(), name);
    check_rows(*p, name);
    check_dtype(*p, h.scalar_type(), name);
  }
  for (const auto& [p, name] : {std::pair{&mean, "mean"}, std::pair{&rstd, "rstd"}}) {
    if (rms && p == &mean) continue;
    check_device(*p, h, name, "h");
    check_shape(*p, {m}, name);
    check_contiguous(*p, name);
    check_dtype(*p, at::kFloat, name);
  }
  check_layer_norm_params(h, weight, std::nullopt, "h");
}

// layer_norm_fwd's outputs for x (M, N): y and h (x + residual, empty without one) in x's dtype,
// mean (empty for RMSNorm) and rstd float32, allocated. When there is nothing to compute (M = 0
// or N = 0) they are final already -- an empty row has mean 0 and rstd 1 / sqrt(eps) -- and
// `empty` is set.
struct LayerNormFwdOutputs {
  at::Tensor y, h, mean, rstd;
  bool empty;
  std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> tuple() const {
    return {y, h, mean, rstd};
  }
};

inline LayerNormFwdOutputs layer_norm_fwd_outputs(const at::Tensor& x, bool residual, double eps,
                                                  bool rms) {
  const int64_t m = x.size(0), n = x.size(1);
  const auto f32 = x.options().dtype(at::kFloat);
  const auto opts = x.options();
  LayerNormFwdOutputs o{empty_tensor({m, n}, opts),
                        residual ? empty_tensor({m, n}, opts) : empty_tensor({0}, opts),
                        empty_tensor({rms ? 0 : m}, f32), empty_tensor({m}, f32),
                        m == 0 || n == 0};
  if (m > 0 && n == 0) {
    o.mean.zero_();
    o.rstd.fill_(1.0 / std::sqrt(eps));
  }
  return o;
}

}  // namespace fastattn
