// The CUDA kernels of csrc/cuda/<op>.cu compiled for the HOST, on the emulator of
// csrc/include/fastattn/cuda_emulator.h: one translation unit per op (their anonymous
// namespaces hold helpers of the same names), each defining fastattn::emulated_<op>(module)
// through FASTATTN_CUDA_IMPL_FWD_BWD; module.cpp binds them all. A test instrument for CI without
// a GPU (tests/test_cuda_emulated.py), not a backend: slow by design.
#define FASTATTN_CUDA_EMULATE 1
#include "../cuda/paged.cu"
