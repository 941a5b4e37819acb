// The CUDA attention kernels of csrc/cuda/attention.cu compiled for the HOST, on the emulator of
// csrc/include/fastattn/cuda_emulator.h, as a Python module (built by fastattn/aot/emulate.py):
// attention_fwd / attention_bwd take CPU tensors and run the very device code, block by block, that
// a GPU runs. It is a test instrument for CI without a GPU (tests/test_cuda_emulated.py), not a
// backend: it is slow by design.
#define FASTATTN_CUDA_EMULATE 1
#include "../cuda/attention.cu"

#include <torch/extension.h>

void register_emulator_selftest(pybind11::module& m);  // selftest.cpp: the emulator's controls

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  register_emulator_selftest(m);
  m.def("attention_fwd", &fastattn::cuda::attention_fwd_cuda,
        "attention_fwd of the cuda backend, emulated on the host");
  m.def("attention_bwd", &fastattn::cuda::attention_bwd_cuda,
        "attention_bwd of the cuda backend, emulated on the host");
}
