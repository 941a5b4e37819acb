// The counter-based dropout RNG of docs/numerics.md, shared by the CPU (.cpp) and CUDA (.cu)
// kernels: every backend and the NumPy reference draw the same keep-mask from the same seed.
//
// All arithmetic is on uint32 and wraps mod 2^32:
//
//   fmix32(x)     = MurmurHash3's 32-bit finalizer
//   stream(b, h)  = fmix32(seed + 0x9E3779B9 * (b * H + h))        (H: number of query heads)
//   r(b, h, i, j) = fmix32(fmix32(i * Lk + j) ^ stream(b, h))
//   keep          = r >= threshold,  threshold = floor(p * 2^32)
//
// Callers reduce the 64-bit seed and indices mod 2^32 by converting them to uint32_t (two's
// complement, so a negative seed wraps exactly like Python's `seed % 2**32`). The functions are
// header-only and `inline`; under nvcc they are also __device__ functions.
#pragma once

#include <cmath>
#include <cstdint>

#if defined(__CUDACC__) || defined(__HIPCC__)
#define FASTATTN_HOST_DEVICE __host__ __device__ __forceinline__
#else
#define FASTATTN_HOST_DEVICE inline
#endif

namespace fastattn {

// MurmurHash3's 32-bit finalizer.
FASTATTN_HOST_DEVICE uint32_t fmix32(uint32_t x) {
  x ^= x >> 16;
  x *= 0x85EBCA6Bu;
  x ^= x >> 13;
  x *= 0xC2B2AE35u;
  x ^= x >> 16;
  return x;
}

// The per-(batch, query head) stream: fmix32(seed + 0x9E3779B9 * (b * H + h)) mod 2^32.
FASTATTN_HOST_DEVICE uint32_t dropout_stream(int64_t seed, int64_t b, int64_t h, int64_t num_heads) {
  const uint32_t bh = static_cast<uint32_t>(b) * static_cast<uint32_t>(num_heads) + static_cast<uint32_t>(h);
  return fmix32(static_cast<uint32_t>(seed) + 0x9E3779B9u * bh);
}

// The random word of element (i, j) of a stream: fmix32(fmix32(i * Lk + j) ^ stream) mod 2^32.
// `row_base` is i * Lk mod 2^32 (see dropout_row_base), so a row's columns cost one add each.
FASTATTN_HOST_DEVICE uint32_t dropout_bits(uint32_t stream, uint32_t row_base, uint32_t j) {
  return fmix32(fmix32(row_base + j) ^ stream);
}

// i * Lk mod 2^32.
FASTATTN_HOST_DEVICE uint32_t dropout_row_base(int64_t i, int64_t lk) {
  return static_cast<uint32_t>(i) * static_cast<uint32_t>(lk);
}

// floor(p * 2^32) for 0 <= p < 1 (fits in uint32; p * 2^32 is exact in double). Keep an element
// iff its bits are >= this threshold, so p = 0 keeps everything.
FASTATTN_HOST_DEVICE uint32_t dropout_threshold(double p) {
  return static_cast<uint32_t>(floor(p * 4294967296.0));
}

// Whether element (b, h, i, j) is kept.
FASTATTN_HOST_DEVICE bool dropout_keep(int64_t seed, int64_t b, int64_t h, int64_t num_heads,
                                       int64_t i, int64_t j, int64_t lk, uint32_t threshold) {
  return dropout_bits(dropout_stream(seed, b, h, num_heads), dropout_row_base(i, lk),
                      static_cast<uint32_t>(j)) >= threshold;
}

}  // namespace fastattn
