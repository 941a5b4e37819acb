// Tensor-core helpers for the CUDA attention kernels: the PTX mma.sync m16n8k16 instruction
// (float16 or bfloat16 inputs, float32 accumulators; sm_80 and newer), the bit-level
// conversions its packed operands need, ldmatrix and cp.async. The index math that goes with them
// (swizzled tiles, ldmatrix row addresses) is in cuda_layout.cuh. Included only from .cu files, after cuda_helpers.cuh
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

// Storage type T (c10::Half / c10::BFloat16) <-> raw 16-bit patterns and packed pairs, and the
// mma of that operand type. One template for both: the two types differ only in the intrinsics
// picked by `kHalf` at compile time.
template <typename T>
struct Mma16 {
  static constexpr bool kHalf = std::is_same_v<T, c10::Half>;
  static_assert(kHalf || std::is_same_v<T, c10::BFloat16>, "mma operands are float16 or bfloat16");

  __device__ __forceinline__ static float to_float(uint16_t bits) {
    if constexpr (kHalf) {
      return __half2float(__ushort_as_half(bits));
    } else {
      return __bfloat162float(__ushort_as_bfloat16(bits));
    }
  }
  __device__ __forceinline__ static uint16_t from_float(float x) {
    if constexpr (kHalf) {
      return __half_as_ushort(__float2half_rn(x));
    } else {
      return __bfloat16_as_ushort(__float2bfloat16_rn(x));
    }
  }
  // Two floats as one .b32 operand: `lo` in bits 0..15 (the smaller k / column index).
  __device__ __forceinline__ static uint32_t pack(float lo, float hi) {
    return static_cast<uint32_t>(from_float(lo)) | (static_cast<uint32_t>(from_float(hi)) << 16);
  }
  // d += a * b (the asm text must be a literal: one statement per operand type).
  __device__ __forceinline__ static void mma(float (&d)[4], const uint32_t (&a)[4], uint32_t b0,
                                             uint32_t b1) {
#ifdef FASTATTN_CUDA_EMULATE
    ::fastattn::emulator::mma_m16n8k16(d, a, b0, b1, [](uint16_t bits) { return to_float(bits); });
#else
#define FASTATTN_MMA_M16N8K16(TYPE)                                                           \
  asm volatile("mma.sync.aligned.m16n8k16.row.col.f32." TYPE "." TYPE ".f32 "                 \
               "{%0, %1, %2, %3}, {%4, %5, %6, %7}, {%8, %9}, {%0, %1, %2, %3};\n"             \
               : "+f"(d[0]), "+f"(d[1]), "+f"(d[2]), "+f"(d[3])                                 \
               : "r"(a[0]), "r"(a[1]), "r"(a[2]), "r"(a[3]), "r"(b0), "r"(b1))
    if constexpr (kHalf) {
      FASTATTN_MMA_M16N8K16("f16");
    } else {
      FASTATTN_MMA_M16N8K16("bf16");
    }
#undef FASTATTN_MMA_M16N8K16
#endif
  }
};

// ---------------------------------------------------------------------------------------------
// ldmatrix and cp.async (sm_80+). Row addresses for ldmatrix come from cuda_layout.cuh
// (ldsm_a_row / ldsm_b_row ...): each lane passes the start of one 16-byte row of one of the four
// 8x8 matrices; the destination registers follow the mma fragment order documented there.

#ifndef FASTATTN_CUDA_EMULATE
__device__ __forceinline__ uint32_t smem_u32(const void* p) {
  return static_cast<uint32_t>(__cvta_generic_to_shared(p));
}

// Four 8x8 matrices of 16-bit elements; r[m] holds lane 4g + t's word of matrix m.
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const uint16_t* row_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(row_addr)));
}
// The same, each matrix transposed.
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], const uint16_t* row_addr) {
  asm volatile("ldmatrix.sync.aligned.m8n8.x4.trans.shared.b16 {%0, %1, %2, %3}, [%4];\n"
               : "=r"(r[0]), "=r"(r[1]), "=r"(r[2]), "=r"(r[3])
               : "r"(smem_u32(row_addr)));
}

// 16 bytes global -> shared without passing through registers (both 16-byte aligned); completes
// asynchronously: visible to this thread after cp_async_wait, to the block after a barrier too.
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem) {
  asm volatile("cp.async.cg.shared.global [%0], [%1], 16;\n" ::"r"(smem_u32(smem)), "l"(gmem)
               : "memory");
}
// Closes the group of this thread's cp.async issued since the last commit (possibly empty).
__device__ __forceinline__ void cp_async_commit() {
  asm volatile("cp.async.commit_group;\n" ::: "memory");
}
// Waits until at most N of this thread's committed groups are still in flight.
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  asm volatile("cp.async.wait_group %0;\n" ::"n"(N) : "memory");
}
#else  // the host emulator (cuda_emulator.h) stands in for the four instructions
__device__ __forceinline__ void ldsm_x4(uint32_t (&r)[4], const uint16_t* row_addr) {
  ::fastattn::emulator::ldmatrix_x4(r, row_addr, /*trans=*/false);
}
__device__ __forceinline__ void ldsm_x4_trans(uint32_t (&r)[4], const uint16_t* row_addr) {
  ::fastattn::emulator::ldmatrix_x4(r, row_addr, /*trans=*/true);
}
__device__ __forceinline__ void cp_async_16(void* smem, const void* gmem) {
  ::fastattn::emulator::cp_async_16(smem, gmem);
}
__device__ __forceinline__ void cp_async_commit() { ::fastattn::emulator::cp_async_commit(); }
template <int N>
__device__ __forceinline__ void cp_async_wait() {
  ::fastattn::emulator::cp_async_wait(N);
}
#endif


// Plain shared-memory stores and loads of a V (at most 16 bytes, V-aligned), written so that the
// host emulator's race check sees them (cuda_emulator.h); on a GPU, plain accesses.
template <typename V>
__device__ __forceinline__ void st_shared(void* p, const V& v) {
#ifdef FASTATTN_CUDA_EMULATE
  ::fastattn::emulator::shared_access(p, sizeof(V), /*write=*/true, "st_shared");
#endif
  *reinterpret_cast<V*>(p) = v;
}
template <typename V>
__device__ __forceinline__ V ld_shared(const void* p) {
#ifdef FASTATTN_CUDA_EMULATE
  ::fastattn::emulator::shared_access(p, sizeof(V), /*write=*/false, "ld_shared");
#endif
  return *reinterpret_cast<const V*>(p);
}

}  // namespace cuda_helpers
}  // namespace fastattn
