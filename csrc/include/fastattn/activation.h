// The FFN's activations, one table for every C++ backend (csrc/cpu/ffn.cpp, csrc/cuda/ffn.cu).
// It mirrors fastattn/activations.py (the Python table the ops, nn modules, NumPy reference and
// Triton kernels use); tests/test_activations.py reads this file and checks that the names, the
// codes and the gating agree. Codes are the Triton kernels' ids as well; 0 is the identity.
//
//   name        f             gated   (gated: the first layer's output splits as [gate, up],
//   gelu        gelu (erf)    no               a = f(gate) * up)
//   gelu_tanh   gelu (tanh)   no
//   relu        relu          no
//   silu        silu          no
//   swiglu      silu          yes
//   geglu       gelu (erf)    yes
#pragma once

#include <string>

#include <c10/util/Exception.h>

namespace fastattn {

// The elementwise function f, by its code (unscoped so that kernels can template on it).
enum Act : int { kGelu = 1, kGeluTanh = 2, kRelu = 3, kSilu = 4 };

struct ActSpec {
  Act act;
  bool gated;
};

inline ActSpec parse_activation(const std::string& name) {
  if (name == "gelu") return {kGelu, false};
  if (name == "gelu_tanh") return {kGeluTanh, false};
  if (name == "relu") return {kRelu, false};
  if (name == "silu") return {kSilu, false};
  if (name == "swiglu") return {kSilu, true};
  if (name == "geglu") return {kGelu, true};
  TORCH_CHECK(false, "unknown activation '", name,
              "'; expected one of gelu, gelu_tanh, relu, silu, swiglu, geglu");
  return {kGelu, false};  // unreachable
}

}  // namespace fastattn
