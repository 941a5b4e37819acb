// Tensor-core helpers for the CUDA attention kernels: the PTX mma.sync m16n8k16 instruction
// (float16 or bfloat16 inputs, float32 accumulators; sm_80 and newer) and the bit-level
// conversions its packed operands need. Included only from .cu files, after cuda_helpers.cuh
// (same namespace, fastattn::cuda_helpers).
//
// Fragment layout of mma.sync.aligned.m16n8k16.row.col (PTX ISA, "Matrix Fragments for
// mma.m16n8k16"), per lane with g = lane / 4 (the "group") and t = lane % 4:
//
//   A (16 x 16, row-major), 4 x .b32, each holding two consecutive-k elements (low half first):
//     a0 = A[g][2t .. 2t+1]      a1 = A[g+8][2t .. 2t+1]
//     a2 = A[g][2t+8 .. 2t+9]    a3 = A[g+8][2t+8 .. 2t+9]
//   B (16 x 8, "col": element (k, n)), 2 x .b32:
//     b0 = B[2t .. 2t+1][g]      b1 = B[2t+8 .. 2t+9][g]
//   C / D (16 x 8, float32), 4 floats:
//     c0, c1 = C[g][2t], C[g][2t+1]      c2, c3 = C[g+8][2t], C[g+8][2t+1]
//
// So the accumulators of two adjacent n-tiles (columns 16s .. 16s+15) hold exactly the A
// fragment of k-step s of the next product (FlashAttention-2's register reuse of P):
//   a0 = pack(c[2s][0], c[2s][1]), a1 = pack(c[2s][2], c[2s][3]),
//   a2 = pack(c[2s+1][0], c[2s+1][1]), a3 = pack(c[2s+1][2], c[2s+1][3]).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>
#include <cuda_bf16.h>
#include <cuda_fp16.h>

#include <cstdint>
#include <type_traits>

namespace fastattn {
namespace cuda_helpers {

// Storage type T (c10::Half / c10::BFloat16) <-> raw 16-bit patterns and packed pairs.
template <typename T>
struct Mma16;

template <>
struct Mma16<c10::Half> {
  __device__ __forceinline__ static float to_float(uint16_t bits) {
    return __half2float(__ushort_as_half(bits));
  }
  __device__ __forceinline__ static uint16_t from_float(float x) {
    return __half_as_ushort(__float2half_rn(x));
  }
  // Two floats as one .b32 operand: `lo` in bits 0..15 (the smaller k / column index).
  __device__ __forceinline__ static uint32_t pack(float lo, float hi) {
    return static_cast<uint32_t>(from_float(lo)) | (static_cast<uint32_t>(from_float(hi)) << 16);
  }
  // d += a * b
  __device__ __forceinline__ static void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.f16.f16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

template <>
struct Mma16<c10::BFloat16> {
  __device__ __forceinline__ static float to_float(uint16_t bits) {
    return __bfloat162float(__ushort_as_bfloat16(bits));
  }
  __device__ __forceinline__ static uint16_t from_float(float x) {
    return __bfloat16_as_ushort(__float2bfloat16_rn(x));
  }
  __device__ __forceinline__ static uint32_t pack(float lo, float hi) {
    return static_cast<uint32_t>(from_float(lo)) | (static_cast<uint32_t>(from_float(hi)) << 16);
  }
  __device__ __forceinline__ static void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
    asm volatile(
        "mma.sync.aligned.m16n8k16.row.col.f32.bf16.bf16.f32 "
        "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"
        : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])
        : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1));
  }
};

// Shared-memory operand loads (tiles of 16-bit elements, row stride `ld` elements).
// Two consecutive elements p[0], p[1] as one .b32 (p must be 4-byte aligned).
__device__ __forceinline__ uint32_t ld_pair(const uint16_t* p) {
  return *reinterpret_cast<const uint32_t*>(p);
}
// Two elements one row apart, p[0] and p[ld], packed (p[0] low).
__device__ __forceinline__ uint32_t ld_pair_strided(const uint16_t* p, int ld) {
  return static_cast<uint32_t>(p[0]) | (static_cast<uint32_t>(p[ld]) << 16);
}

// The A fragment of rows [r0, r0 + 16), k-columns [k0, k0 + 16) of a row-major tile.
__device__ __forceinline__ void load_a_frag(uint32_t (&a)[4], const uint16_t* tile, int ld, int r0,
                                            int k0, int lane) {
  const int g = lane >> 2, t = lane & 3;
  const uint16_t* p = tile + (r0 + g) * ld + k0 + 2 * t;
  a[0] = ld_pair(p);
  a[1] = ld_pair(p + 8 * ld);
  a[2] = ld_pair(p + 8);
  a[3] = ld_pair(p + 8 * ld + 8);
}

// The B fragment (k-steps [k0, k0 + 16), n-columns [n0, n0 + 8)) of B = X^T for a row-major tile X
// whose rows are B's columns: B[k][n] = X[n0 + n][k0 + k]. Used for K^T, Q^T, V^T, dO^T operands.
__device__ __forceinline__ void load_b_frag_rows(uint32_t& b0, uint32_t& b1, const uint16_t* tile,
                                                 int ld, int n0, int k0, int lane) {
  const int g = lane >> 2, t = lane & 3;
  const uint16_t* p = tile + (n0 + g) * ld + k0 + 2 * t;
  b0 = ld_pair(p);
  b1 = ld_pair(p + 8);
}

// The B fragment of B = X for a row-major tile X (k along X's rows): B[k][n] = X[k0 + k][n0 + n].
__device__ __forceinline__ void load_b_frag_cols(uint32_t& b0, uint32_t& b1, const uint16_t* tile,
                                                 int ld, int n0, int k0, int lane) {
  const int g = lane >> 2, t = lane & 3;
  const uint16_t* p = tile + (k0 + 2 * t) * ld + n0 + g;
  b0 = ld_pair_strided(p, ld);
  b1 = ld_pair_strided(p + 8 * ld, ld);
}

}  // namespace cuda_helpers
}  // namespace fastattn
