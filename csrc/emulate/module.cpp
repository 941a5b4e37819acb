// The emulated module (fastattn/aot/emulate.py builds it): every CUDA op's functions, as the
// torch ops of the cuda backend take them, but on CPU tensors, run on the host emulator
// (cuda_emulator.h); and the emulator's own controls (selftest.cpp).
#include <torch/csrc/utils/pybind.h>

namespace fastattn {
void emulated_attention(pybind11::module& m);
void emulated_varlen_attention(pybind11::module& m);
void emulated_paged_attention(pybind11::module& m);
void emulated_softmax(pybind11::module& m);
void emulated_layer_norm(pybind11::module& m);
void emulated_ffn(pybind11::module& m);
void emulated_rope(pybind11::module& m);
}  // namespace fastattn
void register_emulator_selftest(pybind11::module& m);

PYBIND11_MODULE(TORCH_EXTENSION_NAME, m) {
  fastattn::emulated_attention(m);
  fastattn::emulated_varlen_attention(m);
  fastattn::emulated_paged_attention(m);
  fastattn::emulated_softmax(m);
  fastattn::emulated_layer_norm(m);
  fastattn::emulated_ffn(m);
  fastattn::emulated_rope(m);
  register_emulator_selftest(m);
}
