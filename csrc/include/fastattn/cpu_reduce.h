// Deterministic column sums of the CPU backward kernels (layer_norm's dweight / dbias, ffn's db1).
// The rows are cut into at most kMaxRowBlocks blocks fixed by the row count alone; each block sums
// its rows in order into a partial row of its own (for_row_blocks), and sum_partials adds the
// partial rows in block order: no atomics, the same bits for any number of threads. The partial
// rows are in the accumulation type (float, double for float64). Host code (ATen), CPU only.
#pragma once

#include <ATen/Parallel.h>
#include <ATen/TensorIterator.h>  // at::internal::GRAIN_SIZE
#include <ATen/core/Tensor.h>

#include <algorithm>
#include <cstdint>

#include "fastattn/common.h"

namespace fastattn {
namespace cpu {

constexpr int64_t kMaxRowBlocks = 64;
constexpr int64_t kMinBlockRows = 16;

// The number of row blocks for m rows: at least kMinBlockRows rows a block (from 4 blocks up),
// at most kMaxRowBlocks blocks. A partial row is zeroed, accumulated and summed again: at 256 x
// 8192 in 64 blocks of 4 rows the partial rows moved half as many bytes again as the rows
// themselves, and layer_norm's backward ran at 0.79x torch's (AVX-512, 2 threads); 16 rows a
// block keeps that under an eighth.
inline int64_t row_blocks(int64_t m) {
  return std::min(std::max(m / kMinBlockRows, std::min<int64_t>(m, 4)), kMaxRowBlocks);
}

// fn(k, r0, r1) for each block k of `blocks`, parallel over blocks: block k owns rows
// [k * m / blocks, (k + 1) * m / blocks) (and partial row k).
template <class Fn>
void for_row_blocks(int64_t m, int64_t blocks, const Fn& fn) {
  at::parallel_for(0, blocks, 1, [&](int64_t k0, int64_t k1) {
    for (int64_t k = k0; k < k1; ++k) fn(k, k * m / blocks, (k + 1) * m / blocks);
  });
}

// The partial rows part (blocks, N) of A summed in block order: column j is
// part[0, j] + part[1, j] + ... + part[blocks - 1, j], parallel over columns.
template <class A>
at::Tensor sum_partials(const at::Tensor& part) {
  const int64_t blocks = part.size(0), n = part.size(1);
  at::Tensor out = empty_tensor({n}, part.options());
  const A* p = part.const_data_ptr<A>();
  A* o = out.data_ptr<A>();
  at::parallel_for(0, n, std::max<int64_t>(1, at::internal::GRAIN_SIZE / std::max<int64_t>(blocks, 1)),
                   [&](int64_t c0, int64_t c1) {
                     std::copy(p + c0, p + c1, o + c0);
                     for (int64_t k = 1; k < blocks; ++k) {
                       const A* pk = p + k * n;
                       for (int64_t c = c0; c < c1; ++c) o[c] += pk[c];
                     }
                   });
  return out;
}

}  // namespace cpu
}  // namespace fastattn
