// Host check of cpu_gemm.h (tests/test_cpu_simd.py compiles and runs it at each ISA):
// - gemm walks k in chunks of kGemmDepth; its result must equal, bit for bit, that of one pass
//   over the whole depth (gemm_panel: each C element's FMAs in the same order), for depths below,
//   at and above the chunk, row counts that leave a partial register block, widths that leave a
//   partial column block, A plain and transposed, C overwritten and accumulated;
// - and both must be a GEMM: within 1e-4 of a double-precision product;
// - gemm_ld(n) is a whole number of 64-byte lines, at least n, never a multiple of 512 bytes.
// Exits non-zero and prints the first mismatches on failure.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <random>
#include <vector>

#include "fastattn/cpu_gemm.h"

namespace cpu = fastattn::cpu;

static int failures = 0;

template <class A>
void check_ld() {
  for (int64_t n = 1; n <= 1024; ++n) {
    const int64_t line = 64 / static_cast<int64_t>(sizeof(A));
    const int64_t ld = cpu::gemm_ld<A>(n), bytes = ld * static_cast<int64_t>(sizeof(A));
    if (ld < n || bytes % 64 != 0 || bytes % 512 == 0 || ld > n + 2 * line) {
      if (++failures <= 10) std::printf("gemm_ld<%zu-byte>(%ld) = %ld\n", sizeof(A), n, ld);
    }
  }
}

template <int W, bool kTransA>
void check_gemm(int64_t m, int64_t n, int64_t k, bool accumulate) {
  using V = cpu::Vec<float, W>;
  const int64_t lda = kTransA ? m + 3 : k + 5, ldb = cpu::gemm_ld<float>(n), ldc = n + W;
  const int64_t arows = kTransA ? k : m + cpu::kGemmRowPad;  // gemm reads whole row blocks of A
  std::vector<float> a(arows * lda + cpu::kGemmRowPad), b(k * ldb + W), c0((m + 1) * ldc);
  std::mt19937 gen(static_cast<uint32_t>(m * 1000003 + n * 1009 + k * 7 + accumulate));
  std::uniform_real_distribution<float> u(-1.0f, 1.0f);
  for (auto& x : a) x = u(gen);
  for (auto& x : b) x = u(gen);
  for (auto& x : c0) x = u(gen);
  std::vector<float> chunked = c0, whole = c0;
  cpu::gemm<V, kTransA>(m, n, k, a.data(), lda, b.data(), ldb, chunked.data(), ldc, accumulate);
  cpu::gemm_panel<V, kTransA>(m, n, k, a.data(), lda, b.data(), ldb, whole.data(), ldc, accumulate);
  for (int64_t i = 0; i < m; ++i) {
    for (int64_t j = 0; j < n; ++j) {
      double want = accumulate ? c0[i * ldc + j] : 0.0;
      for (int64_t p = 0; p < k; ++p) {
        want += static_cast<double>(kTransA ? a[p * lda + i] : a[i * lda + p]) * b[p * ldb + j];
      }
      const float got = chunked[i * ldc + j];
      const bool same = std::memcmp(&got, &whole[i * ldc + j], sizeof(float)) == 0;
      if ((!same || std::fabs(got - want) > 1e-4 * (1.0 + std::sqrt(static_cast<double>(k)))) &&
          ++failures <= 10) {
        std::printf("W%d trans%d m%ld n%ld k%ld acc%d (%ld, %ld): chunked %.9g, one pass %.9g, "
                    "double %.9g\n", W, kTransA, m, n, k, accumulate, i, j, got,
                    whole[i * ldc + j], want);
      }
    }
    for (int64_t j = n; j < ldc; ++j) {  // columns past n are never written
      if (chunked[i * ldc + j] != c0[i * ldc + j] && ++failures <= 10) {
        std::printf("W%d m%ld n%ld k%ld: column %ld of row %ld was written\n", W, m, n, k, j, i);
      }
    }
  }
  for (int64_t j = 0; j < ldc; ++j) {  // nor are rows past m
    if (chunked[m * ldc + j] != c0[m * ldc + j] && ++failures <= 10) {
      std::printf("W%d m%ld n%ld k%ld: row m was written\n", W, m, n, k);
    }
  }
}

template <int W>
void check_width() {
  for (int64_t k : {0, 1, 63, 64, 65, 130, 256}) {
    for (int64_t m : {1, 5, 13, 64}) {  // (13: 8 + 4 rows and a last one, on one-vector blocks)
      for (int64_t n : {int64_t{W}, int64_t{3 * W}, int64_t{5 * W}, int64_t{16 * W}}) {
        for (bool acc : {false, true}) {
          check_gemm<W, false>(m, n, k, acc);
          check_gemm<W, true>(m, n, k, acc);
        }
      }
    }
  }
}

int main() {
  check_ld<float>();
  check_ld<double>();
  check_width<4>();
  check_width<8>();
  check_width<16>();
  if (failures) {
    std::printf("%d mismatches\n", failures);
    return 1;
  }
  std::printf("ok\n");
  return 0;
}
