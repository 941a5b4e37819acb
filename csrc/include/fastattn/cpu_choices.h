// The cpu backend's kernel choices that depend on the CPU (and on FASTATTN_CPU_* variables). Each
// is defined beside the kernels it chooses between; csrc/eager.cpp reports them to Python
// (fastattn._extension.cpu_choices: `fastattn info` and the bench's environment block), so a
// recorded run says which kernels it timed.
#pragma once

#include <c10/core/ScalarType.h>

namespace fastattn {
namespace cpu {

// csrc/cpu/attention.cpp: whether the plain non-causal forward (no mask, no dropout) runs torch's
// own CPU flash attention rather than ours (Intel CPUs; FASTATTN_CPU_TORCH_ATTENTION).
bool torch_plain_forward();

// csrc/cpu/ffn.cpp: whether the FFN's matmuls of a 16-bit dtype run in float32 (CPUs without dot
// instructions for it; FASTATTN_CPU_FFN_GEMM).
bool ffn_gemm_in_float(c10::ScalarType st);

}  // namespace cpu
}  // namespace fastattn
