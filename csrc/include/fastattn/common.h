// Argument checks and dtype dispatch shared by the CPU (.cpp) and CUDA (.cu) ops. Host code only.
// Every check names the argument and shows what it got, so a failing call says what to fix.
#pragma once

#include <ATen/Dispatch.h>
#include <ATen/core/Tensor.h>
#include <ATen/ops/addmm_ops.h>
#include <ATen/ops/empty_ops.h>
#include <ATen/ops/mm_ops.h>
#include <c10/util/Exception.h>

#include <optional>

namespace fastattn {

// A new tensor, as at::empty(size, options) makes it: the same op call, through the entry point
// that inline function calls (zeros: `.zero_()` on it). Its own header (ATen/ops/empty.h, like
// zeros.h) brings ATen/Context.h and DeviceGuard.h with it: ~5 s of every nvcc front-end pass
// over a .cu file and of every emulated (g++) translation unit (CUDA 13, torch 2.13,
// 2026-11-29); ATen/ops/empty_ops.h declares only the entry point. The CPU sources call ops the
// same way rather than include ATen/ATen.h (every op's header: ~11 s of g++ a file).
inline at::Tensor empty_tensor(at::IntArrayRef size, const at::TensorOptions& options) {
  return at::_ops::empty_memory_format::call(
      c10::fromIntArrayRefSlow(size), c10::optTypeMetaToScalarType(options.dtype_opt()),
      options.layout_opt(), options.device_opt(), options.pinned_memory_opt(),
      c10::impl::check_tensor_options_and_extract_memory_format(options, std::nullopt));
}

// at::mm(a, b) and at::addmm(bias, a, b) (beta = alpha = 1), through the same entry points, for
// the same reason.
inline at::Tensor mm_call(const at::Tensor& a, const at::Tensor& b) {
  return at::_ops::mm::call(a, b);
}
inline at::Tensor addmm_call(const at::Tensor& bias, const at::Tensor& a, const at::Tensor& b) {
  return at::_ops::addmm::call(bias, a, b, /*beta=*/1, /*alpha=*/1);
}

// A contiguous last dimension, any other strides (an empty tensor, as autograd may hand over, can
// have any strides).
inline void check_last_dim_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.size(-1) <= 1 || t.stride(-1) == 1 || t.numel() == 0, name,
              " must have a contiguous last dimension, got shape ", t.sizes(), " and strides ",
              t.strides());
}

// A matrix of rows: 2-D with a contiguous last dimension and any row stride.
inline void check_rows(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.dim() == 2, name, " must be 2-D (rows, N), got shape ", t.sizes());
  check_last_dim_contiguous(t, name);
}

inline void check_shape(const at::Tensor& t, at::IntArrayRef shape, const char* name) {
  TORCH_CHECK(t.sizes() == shape, name, " must have shape ", shape, ", got ", t.sizes());
}

inline void check_contiguous(const at::Tensor& t, const char* name) {
  TORCH_CHECK(t.is_contiguous(), name, " must be contiguous, got shape ", t.sizes(),
              " and strides ", t.strides());
}

inline void check_device(const at::Tensor& t, const at::Tensor& ref, const char* name,
                         const char* ref_name) {
  TORCH_CHECK(t.device() == ref.device(), name, " must be on the device of ", ref_name, " (",
              ref.device(), "), got ", t.device());
}

inline void check_dtype(const at::Tensor& t, at::ScalarType dtype, const char* name) {
  TORCH_CHECK(t.scalar_type() == dtype, name, " must have dtype ", dtype, ", got ",
              t.scalar_type(), " (shape ", t.sizes(), ")");
}

// t on ref's device with this shape and dtype (a gradient, a saved output, a tangent).
inline void check_like(const at::Tensor& t, const at::Tensor& ref, at::IntArrayRef shape,
                       at::ScalarType dtype, const char* name, const char* ref_name) {
  check_device(t, ref, name, ref_name);
  check_shape(t, shape, name);
  check_dtype(t, dtype, name);
}

// float32, float16 or bfloat16; float64 too when allow_double (the CPU backend, for gradcheck).
inline void check_float_dtype(const at::Tensor& t, const char* name, bool allow_double) {
  const auto dt = t.scalar_type();
  const bool ok = dt == at::kFloat || dt == at::kHalf || dt == at::kBFloat16 ||
                  (allow_double && dt == at::kDouble);
  TORCH_CHECK(ok, name,
              allow_double ? " must be float32, float16, bfloat16 or float64"
                           : " must be float32, float16 or bfloat16",
              ", got ", dt, " (shape ", t.sizes(), ")");
}

// A parameter that follows an input: the input's dtype, or float32 (fp32 master parameters).
inline void check_param_dtype(const at::Tensor& t, at::ScalarType input_dtype, const char* name) {
  TORCH_CHECK(t.scalar_type() == input_dtype || t.scalar_type() == at::kFloat, name,
              " must have the input's dtype (", input_dtype, ") or float32, got ", t.scalar_type());
}

// The dtype the CPU kernels accumulate an input of `dtype` in (cpu::acc_t): float64 for float64,
// float32 otherwise.
inline at::ScalarType acc_dtype(at::ScalarType dtype) {
  return dtype == at::kDouble ? at::kDouble : at::kFloat;
}

}  // namespace fastattn

// scalar_t = float, c10::Half or c10::BFloat16 (the CUDA kernels' dtypes).
#define FASTATTN_DISPATCH_FLOAT_HALF_BF16(TYPE, NAME, ...)      \
  AT_DISPATCH_SWITCH(TYPE, NAME,                                \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)  \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__)   \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))

// The same plus double (the CPU kernels' dtypes).
#define FASTATTN_DISPATCH_FLOATING_HALF_BF16(TYPE, NAME, ...)   \
  AT_DISPATCH_SWITCH(TYPE, NAME,                                \
                     AT_DISPATCH_CASE(at::kDouble, __VA_ARGS__) \
                     AT_DISPATCH_CASE(at::kFloat, __VA_ARGS__)  \
                     AT_DISPATCH_CASE(at::kHalf, __VA_ARGS__)   \
                     AT_DISPATCH_CASE(at::kBFloat16, __VA_ARGS__))
