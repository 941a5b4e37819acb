// A small register-blocked GEMM for the CPU attention tiles (cpu_simd.h explains the ISA scheme).
//
//   C[m x n] = (accumulate ? C : 0) + A[m x k] B[k x n]
//
// A is row-major with row stride lda (it is read one scalar at a time and broadcast), B row-major
// with row stride ldb and n a multiple of the vector width (callers pack B with zero padding),
// C row-major with row stride ldc (n columns written; A is read in whole blocks of MR rows, see
// kGemmRowPad). The micro-kernel keeps an MR x (NV * W)
// block of C in registers and streams k: per step it loads NV vectors of B and does MR * NV FMAs.
// Everything is FASTATTN_INLINE so it is compiled for the ISA of the calling kernel.
#pragma once

#include "fastattn/cpu_simd.h"

namespace fastattn {
namespace cpu {

// Register blocking (rows x vectors of C held in registers): 4 x 4 for 16-lane vectors (AVX-512,
// 32 registers), 4 x 3 for 8 lanes (AVX2, 16 registers), 4 x 2 otherwise. Measured on the
// attention tile shapes (64 x 256 x 64, 64 x 64 x 256): about 10% faster than 8 x 2 / 6 x 2.
template <class V>
struct GemmBlocking {
  static constexpr int kMR = 4;
  static constexpr int kNV = V::size >= 16 ? 4 : (V::size >= 8 ? 3 : 2);
};

template <class V, int MR, int NV, bool kTransA>
FASTATTN_INLINE void gemm_micro(int64_t k, const typename V::value_type* __restrict a, int64_t lda,
                                const typename V::value_type* __restrict b, int64_t ldb,
                                typename V::value_type* __restrict c, int64_t ldc, bool accumulate) {
  constexpr int W = V::size;
  V acc[MR][NV];
  if (accumulate) {
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = V::load(c + r * ldc + v * W);
    }
  } else {
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = V(typename V::value_type(0));
    }
  }
  for (int64_t p = 0; p < k; ++p) {
    V bv[NV];
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) bv[v] = V::load(b + p * ldb + v * W);
#pragma GCC unroll 16
    for (int r = 0; r < MR; ++r) {
      const V ar(kTransA ? a[p * lda + r] : a[r * lda + p]);
#pragma GCC unroll 4
      for (int v = 0; v < NV; ++v) acc[r][v] = fma(ar, bv[v], acc[r][v]);
    }
  }
#pragma GCC unroll 16
  for (int r = 0; r < MR; ++r) {
#pragma GCC unroll 4
    for (int v = 0; v < NV; ++v) acc[r][v].store(c + r * ldc + v * W);
  }
}

// A block of MR rows and nv <= NV vectors: picks the micro-kernel of that width.
template <class V, int MR, int NV, bool kTransA>
FASTATTN_INLINE void gemm_block(int64_t nv, int64_t k, const typename V::value_type* a,
                                int64_t lda, const typename V::value_type* b, int64_t ldb,
                                typename V::value_type* c, int64_t ldc, bool accumulate) {
  if constexpr (NV > 1) {
    if (nv < NV) {
      return gemm_block<V, MR, NV - 1, kTransA>(nv, k, a, lda, b, ldb, c, ldc, accumulate);
    }
  }
  gemm_micro<V, MR, NV, kTransA>(k, a, lda, b, ldb, c, ldc, accumulate);
}

// A is read in whole blocks of MR (<= kGemmRowPad) rows: it must have round_up(m, MR) readable
// rows (callers pad their buffers with kGemmRowPad rows); the values of the rows past m do not
// matter. C is written in rows [0, m) only.
constexpr int64_t kGemmRowPad = 8;

// The depth of one pass over B (kGemmDepth rows of it): gemm walks k in chunks of this many
// rows, so that the B panel a column block reads (kGemmDepth x NV * W values: 16 KB for 64 x 64
// floats) stays in L1 while every row block of C passes over it. Unchunked, a 256-deep B (the
// forward's P V over a 256-key tile) was read from L2 by every 4-row block: 64 x 64 x 256 ran at
// 90 GFLOP/s against 125 chunked (Xeon, AVX-512, one thread; MKL's sgemm: 125).
constexpr int64_t kGemmDepth = 64;

// A row stride (in elements of A) for a matrix of n columns that gemm reads as B: n rounded up to
// whole 64-byte lines, plus one line where that would make the stride a multiple of 512 bytes.
// Rows 512 bytes apart fall into the same few sets of a 32 KB 8-way L1 (64 sets of 64-byte
// lines): a B panel of 64 rows at a 1 KB stride (the forward's K^T tile of 256 keys) needs 16
// lines of one set and thrashed, 80 GFLOP/s; with one more line per row, 125.
template <class A>
constexpr int64_t gemm_ld(int64_t n) {
  constexpr int64_t line = 64 / static_cast<int64_t>(sizeof(A));
  const int64_t ld = round_up(n, line);
  return (ld * static_cast<int64_t>(sizeof(A))) % 512 == 0 ? ld + line : ld;
}

// gemm for k <= kGemmDepth.
template <class V, bool kTransA>
FASTATTN_INLINE void gemm_panel(int64_t m, int64_t n, int64_t k, const typename V::value_type* a,
                                int64_t lda, const typename V::value_type* b, int64_t ldb,
                                typename V::value_type* c, int64_t ldc, bool accumulate) {
  using A = typename V::value_type;
  constexpr int W = V::size;
  constexpr int MR = GemmBlocking<V>::kMR, NV = GemmBlocking<V>::kNV;
  static_assert(MR <= kGemmRowPad);
  const int64_t m_full = m / MR * MR;
  auto a_rows = [&](int64_t i) { return kTransA ? a + i : a + i * lda; };
  for (int64_t j = 0; j < n; j += NV * W) {
    const int64_t nv = std::min<int64_t>(NV, (n - j) / W);
    if (nv == NV) {
      for (int64_t i = 0; i < m_full; i += MR) {
        gemm_micro<V, MR, NV, kTransA>(k, a_rows(i), lda, b + j, ldb, c + i * ldc + j, ldc,
                                       accumulate);
      }
    } else if (nv == 1) {
      // One vector wide (Dv = 128 on AVX2: the last 8 of 128 columns). MR accumulators would be
      // MR chains of dependent FMAs, too few to cover the FMA latency on both pipes; 2 * MR rows
      // at a time keep twice as many in flight. Same sums in the same order, per element.
      int64_t i = 0;
      for (; i + 2 * MR <= m_full; i += 2 * MR) {
        gemm_micro<V, 2 * MR, 1, kTransA>(k, a_rows(i), lda, b + j, ldb, c + i * ldc + j, ldc,
                                          accumulate);
      }
      for (; i < m_full; i += MR) {
        gemm_micro<V, MR, 1, kTransA>(k, a_rows(i), lda, b + j, ldb, c + i * ldc + j, ldc,
                                      accumulate);
      }
    } else {
      for (int64_t i = 0; i < m_full; i += MR) {
        gemm_block<V, MR, NV, kTransA>(nv, k, a_rows(i), lda, b + j, ldb, c + i * ldc + j, ldc,
                                       accumulate);
      }
    }
    if (m_full < m) {  // the last rows go through a register-block-sized scratch C
      const int64_t mr = m - m_full, cols = nv * W;
      A tmp[MR * NV * W];
      for (int64_t r = 0; r < mr; ++r) {
        for (int64_t x = 0; x < cols; ++x) tmp[r * NV * W + x] = accumulate ? c[(m_full + r) * ldc + j + x] : A(0);
      }
      gemm_block<V, MR, NV, kTransA>(nv, k, a_rows(m_full), lda, b + j, ldb, tmp, NV * W, accumulate);
      for (int64_t r = 0; r < mr; ++r) {
        for (int64_t x = 0; x < cols; ++x) c[(m_full + r) * ldc + j + x] = tmp[r * NV * W + x];
      }
    }
  }
}

// C[m x n] (+)= op(A)[m x k] B[k x n] with op(A) = A (a[i * lda + p]) or, when kTransA, A^T
// (a[p * lda + i]); n must be a multiple of V::size. k is walked in chunks of kGemmDepth, C
// accumulating after the first; B is best given with a row stride from gemm_ld.
template <class V, bool kTransA = false>
FASTATTN_INLINE void gemm(int64_t m, int64_t n, int64_t k, const typename V::value_type* a,
                          int64_t lda, const typename V::value_type* b, int64_t ldb,
                          typename V::value_type* c, int64_t ldc, bool accumulate) {
  for (int64_t p0 = 0; p0 < k || p0 == 0; p0 += kGemmDepth) {
    gemm_panel<V, kTransA>(m, n, std::min(kGemmDepth, k - p0), kTransA ? a + p0 * lda : a + p0,
                           lda, b + p0 * ldb, ldb, c, ldc, accumulate || p0 > 0);
  }
}

// The careful path of gemm for a B that holds non-finite values: C[m x n] += op(A) B where the
// entries of op(A) that are exactly -0.0 (the attention kernels' marker of a masked-out
// probability or score gradient) contribute nothing -- not even the NaN of 0 * inf or 0 * NaN --
// while every other entry, +0.0 included, contributes its IEEE product. n a multiple of V::size.
// One axpy per (row, k) entry: several times slower than gemm, used only on tiles whose B is not
// all finite.
template <class V, bool kTransA = false>
FASTATTN_INLINE void gemm_skip_neg_zero(int64_t m, int64_t n, int64_t k,
                                        const typename V::value_type* a, int64_t lda,
                                        const typename V::value_type* b, int64_t ldb,
                                        typename V::value_type* c, int64_t ldc) {
  constexpr int W = V::size;
  for (int64_t i = 0; i < m; ++i) {
    typename V::value_type* ci = c + i * ldc;
    for (int64_t p = 0; p < k; ++p) {
      const auto x = kTransA ? a[p * lda + i] : a[i * lda + p];
      if (is_neg_zero(x)) continue;
      const V xv(x);
      const typename V::value_type* bp = b + p * ldb;
      for (int64_t j = 0; j < n; j += W) fma(xv, V::load(bp + j), V::load(ci + j)).store(ci + j);
    }
  }
}

}  // namespace cpu
}  // namespace fastattn
