// layer_norm.cu compiled for the host on the emulator (see attention.cpp).
#define FASTATTN_CUDA_EMULATE 1
#include "../cuda/layer_norm.cu"
