// Index math of the CUDA attention kernels' shared-memory tiles and tensor-core fragments, as
// __host__ __device__ constexpr functions: the kernels (csrc/cuda/attention.cu) call them, and
// tests/test_cuda_layouts.py compiles tests/cuda_layouts_test.cpp for the host, which proves with
// them (no GPU) that every layout is a bijection, that ldmatrix fed with these addresses yields
// exactly the mma.sync fragments, and that the warps' access patterns are bank-conflict free.
// Plain C++17: no CUDA header is needed, so g++ compiles it too.
//
// 1. Swizzled 16-bit tiles (XOR swizzle, "conflict-free by construction"). A tile is ROWS rows
//    x COLS 16-bit elements, COLS a multiple of 64 (a row is a whole number of 128-byte lines),
//    stored densely row after row, each row as COLS / 8 chunks of 16 bytes. Logical chunk c of
//    row r lives at physical chunk c ^ (r % 8). The 32 banks are 8 groups of 4 (one 16-byte chunk
//    wide), and chunk p of any row falls in group p % 8, so:
//    - 8 consecutive rows, same logical chunk (one 8x8 ldmatrix matrix) -> 8 distinct groups;
//    - one row, 8 consecutive logical chunks 8a .. 8a+7 (a quarter-warp of 16-byte cp.async
//      stores) -> 8 distinct groups.
//    Both are exactly the 8 addresses one shared-memory wavefront serves: no conflicts.
//
// 2. mma.sync.m16n8k16 fragments (PTX ISA "Matrix Fragments for mma.m16n8k16"), lane = 4g + t:
//      A (16 x 16): a[j] = A[g + 8 (j & 1)][2t + 8 (j >> 1) + {0, 1}]
//      B (16 x 8):  b[j] = B[2t + 8 j + {0, 1}][g]
//      C (16 x 8):  c[e] = C[g + 8 (e >> 1)][2t + (e & 1)]
//
// 3. ldmatrix.x4 (PTX "ldmatrix"): lanes 8m .. 8m+7 give the 8 row addresses (16 bytes each) of
//    matrix m; lane 4g + t receives word m = (row g, elements 2t, 2t+1) of matrix m, or with .trans
//    (elements (2t, g) and (2t+1, g)) of it. The three operand loads the kernels use:
//    - ldsm_a:   A fragment of rows [r0, r0+16) x k [k0, k0+16) of a row-major tile (Q, dO, K, V
//                as the left operand). Matrices: (rows 0-7, k 0-7), (8-15, 0-7), (0-7, 8-15),
//                (8-15, 8-15): lane -> row lane % 16, chunk lane / 16.
//    - ldsm_b:   B = X^T for a row-major X whose rows are B's columns (K in Q K^T, Q in K Q^T,
//                ...), two n-tiles at once: b[0..1] for columns n0 .. n0+7, b[2..3] for n0+8 ..
//                n0+15. Matrices: (n 0-7, k 0-7), (n 0-7, k 8-15), (n 8-15, k 0-7), (n 8-15,
//                k 8-15): lane -> row (lane % 8) + 8 (lane / 16), chunk (lane / 8) % 2.
//    - ldsm_bt:  B = X for a row-major X whose rows are k (V in P V, dO in P^T dO, K in dS K),
//                with .trans, two n-tiles: same matrix order as ldsm_b with the roles of rows and
//                columns swapped: lane -> row lane % 16, chunk lane / 16 (the same map as ldsm_a).
//
// 4. Float32 accumulator tiles (backward dK, dV, dQ in shared memory): row stride COLS + 8 floats,
//    the C fragment's pairs (c[2r], c[2r+1]) read-modified-written as one 8-byte float2. A warp's
//    8-byte accesses are served half a warp at a time; lanes 0-15 (g 0-3) then touch words
//    (COLS + 8) g + 2t .. +1 = 8 g + 2 t (mod 32): 16 distinct pairs of banks.
#pragma once

#if defined(__CUDACC__)
#define FASTATTN_LAYOUT_FN __host__ __device__ constexpr __forceinline__
#else
#define FASTATTN_LAYOUT_FN constexpr inline
#endif

namespace fastattn {
namespace cuda_layout {

constexpr int kChunkElems = 8;    // 16-bit elements in a 16-byte chunk
constexpr int kSwizzleRows = 8;   // the XOR pattern repeats every 8 rows (one 128-byte line)

// --- 1. swizzled 16-bit tiles -----------------------------------------------------------------

template <int COLS>
struct Swizzled {
  static_assert(COLS % 64 == 0, "a swizzled row must be whole 128-byte lines (COLS % 64 == 0)");
  static constexpr int CHUNKS = COLS / kChunkElems;  // 16-byte chunks per row

  // Physical chunk of logical chunk `chunk` in row `row`.
  static FASTATTN_LAYOUT_FN int phys_chunk(int row, int chunk) {
    return chunk ^ (row % kSwizzleRows);
  }
  // Element offset of the start of logical chunk `chunk` of row `row`.
  static FASTATTN_LAYOUT_FN int chunk_offset(int row, int chunk) {
    return row * COLS + phys_chunk(row, chunk) * kChunkElems;
  }
  // Element offset of element (row, col).
  static FASTATTN_LAYOUT_FN int offset(int row, int col) {
    return chunk_offset(row, col / kChunkElems) + col % kChunkElems;
  }

  // An ldmatrix operand read at corner (r0, chunk c0) -- r0 % 8 == 0 and c0 even, as every
  // 16 x 16 operand block is -- by a lane that addresses row r0 + lr, chunk c0 + lc (lc 0 or 1)
  // splits into the lane's part, lane_offset(lr, lc), computed once per kernel, and the corner's:
  //     chunk_offset(r0 + lr, c0 + lc) == fragment_offset(lane_offset(lr, lc), r0, c0).
  // (r0 leaves the row's swizzle alone, and c0 + lc == c0 ^ lc, so the XOR splits.) The corner
  // contributes one XOR with one of 4 constants (c0 % 8) and an addition the compiler folds into
  // the ldmatrix's immediate: chunk_offset at (r0 + lr, c0 + lc) costs ~3 integer instructions
  // per ldmatrix in the kernels' SASS (an OR, an XOR, a shift-add), this ~0 -- the key tile of a
  // D128 forward reads 64 of them per warp.
  static FASTATTN_LAYOUT_FN int lane_offset(int lr, int lc) { return chunk_offset(lr, lc); }

  // The tile copies: pass `it` of a thread whose chunks are (r_t + it * RSTEP, ch) writes
  // chunk_offset(r_t + it * RSTEP, ch). With RSTEP a multiple of 8 the swizzle is the same in
  // every pass and the pass adds a constant; otherwise it is chunk_offset itself.
  template <int RSTEP>
  static FASTATTN_LAYOUT_FN int copy_offset(int r_t, int ch, int it) {
    if (RSTEP % kSwizzleRows == 0) return chunk_offset(r_t, ch) + it * RSTEP * COLS;
    return chunk_offset(r_t + it * RSTEP, ch);
  }
  static FASTATTN_LAYOUT_FN int fragment_offset(int lane_off, int r0, int c0) {
    return (lane_off ^ (c0 % kSwizzleRows) * kChunkElems) + r0 * COLS +
           (c0 / kSwizzleRows) * kSwizzleRows * kChunkElems;
  }
};

// The 16-byte chunk a thread copies in a tile load (ROWS x COLS tile, NTHREADS threads, pass
// `it`): consecutive threads take consecutive chunks of a row. Returns the chunk index `idx`;
// row idx / CHUNKS, chunk idx % CHUNKS; idx >= ROWS * CHUNKS means nothing to copy.
FASTATTN_LAYOUT_FN int copy_chunk_index(int tid, int it, int nthreads) { return tid + it * nthreads; }

// --- 2. mma.m16n8k16 fragment coordinates (for the tests and the docs; the kernels rely on them
// implicitly through the ldmatrix maps below) ----------------------------------------------------

struct Coord {
  int row, col;
};

// Element `half` (0: low 16 bits, 1: high) of register a[j] of lane `lane`.
FASTATTN_LAYOUT_FN Coord mma_a_coord(int lane, int j, int half) {
  return {lane / 4 + 8 * (j & 1), 2 * (lane % 4) + 8 * (j >> 1) + half};
}
// Register b[j] (j = 0, 1) as (k, n).
FASTATTN_LAYOUT_FN Coord mma_b_coord(int lane, int j, int half) {
  return {2 * (lane % 4) + 8 * j + half, lane / 4};
}
// Accumulator c[e] (e = 0 .. 3) as (row, col).
FASTATTN_LAYOUT_FN Coord mma_c_coord(int lane, int e) {
  return {lane / 4 + 8 * (e >> 1), 2 * (lane % 4) + (e & 1)};
}

// --- 3. ldmatrix.x4 row addresses: (row, chunk) relative to the operand's corner ---------------

// ldsm_a and ldsm_bt (row-major tile, rows = A's rows, or rows = B's k).
FASTATTN_LAYOUT_FN int ldsm_a_row(int lane) { return lane % 16; }
FASTATTN_LAYOUT_FN int ldsm_a_chunk(int lane) { return lane / 16; }
// ldsm_b (rows of the tile = B's columns n).
FASTATTN_LAYOUT_FN int ldsm_b_row(int lane) { return lane % 8 + 8 * (lane / 16); }
FASTATTN_LAYOUT_FN int ldsm_b_chunk(int lane) { return (lane / 8) % 2; }

// --- 4. float32 accumulator tiles -------------------------------------------------------------

template <int COLS>
struct AccTile {
  static_assert(COLS % 32 == 0, "accumulator rows must be a multiple of 32 floats");
  static constexpr int LD = COLS + 8;  // floats per row (see 4. above)
  static FASTATTN_LAYOUT_FN int offset(int row, int col) { return row * LD + col; }
};

}  // namespace cuda_layout
}  // namespace fastattn
