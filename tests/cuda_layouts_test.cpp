// Host-side proof of the CUDA attention kernels' index math (csrc/include/fastattn/cuda_layout.cuh),
// compiled by g++ (or nvcc for the host) from tests/test_cuda_layouts.py; no GPU needed.
//
// It models shared memory as 32 banks of 4-byte words and ldmatrix / mma.sync by their PTX
// definitions, then checks, for every tile shape and operand corner the kernels use:
//   - every swizzled layout is a bijection of the tile onto [0, ROWS * COLS);
//   - ldmatrix.x4 (and .trans) fed with the ldsm_* row addresses, computed as the kernels do
//     (lane part and corner part, Swizzled::fragment_offset), delivers to every lane exactly
//     the elements the mma.m16n8k16 fragment definition asks for;
//   - the split address functions (fragment_offset, copy_offset) equal chunk_offset wherever
//     their preconditions hold;
//   - the accumulators of two adjacent n-tiles are the A fragment of the next product (P reuse);
//   - every warp access pattern (ldmatrix phases, 16-byte cp.async stores, the epilogue's 32-bit
//     fragment stores and 16-byte reads, the float2 accumulator read-modify-writes) is
//     bank-conflict free -- and, as a control that the checker can fail, that an unswizzled dense
//     layout is not.
// Prints one line per failure and "cuda_layouts: N checks passed" at the end; exit status 1 on any
// failure.
#include <cstdint>
#include <cstdio>
#include <map>
#include <set>
#include <vector>

#include "fastattn/cuda_layout.cuh"

using namespace fastattn::cuda_layout;

namespace {

int g_checks = 0, g_failures = 0;

void check(bool ok, const char* what, int a = -1, int b = -1, int c = -1) {
  ++g_checks;
  if (!ok) {
    ++g_failures;
    if (g_failures <= 30) std::printf("FAIL: %s (%d, %d, %d)\n", what, a, b, c);
  }
}

// Wavefronts a set of simultaneous accesses (byte address, width) needs: per bank, the number of
// distinct 4-byte words it must deliver (equal words are broadcast); the max over banks.
int wavefronts(const std::vector<std::pair<int64_t, int>>& accesses) {
  std::map<int, std::set<int64_t>> words;
  for (const auto& [addr, bytes] : accesses) {
    for (int w = 0; w < bytes / 4; ++w) {
      const int64_t word = addr / 4 + w;
      words[static_cast<int>(word % 32)].insert(word);
    }
  }
  int worst = 0;
  for (const auto& [bank, ws] : words) worst = std::max<int>(worst, static_cast<int>(ws.size()));
  return worst;
}

// Hardware phases: 16-byte accesses are served 8 lanes at a time, 8-byte 16 lanes, 4-byte 32.
bool conflict_free(const std::vector<int64_t>& lane_addr, int bytes) {
  const int per_phase = 128 / bytes;
  for (int p0 = 0; p0 < static_cast<int>(lane_addr.size()); p0 += per_phase) {
    std::vector<std::pair<int64_t, int>> phase;
    for (int l = p0; l < p0 + per_phase && l < static_cast<int>(lane_addr.size()); ++l) {
      if (lane_addr[l] >= 0) phase.push_back({lane_addr[l], bytes});
    }
    if (wavefronts(phase) > 1) return false;
  }
  return true;
}

// A tile whose element at (r, c) holds the id r * COLS + c, laid out by Layout::offset.
template <int ROWS, int COLS, typename Layout>
std::vector<int> make_tile() {
  std::vector<int> mem(ROWS * COLS, -1);
  for (int r = 0; r < ROWS; ++r)
    for (int c = 0; c < COLS; ++c) mem[Layout::offset(r, c)] = r * COLS + c;
  return mem;
}

// ldmatrix.x4 on `mem`: lane l gives row address addr[l] (element offsets). Returns, per lane
// and matrix m, the two elements it receives (without or with .trans).
struct Ldsm {
  int v[32][4][2];
};
Ldsm ldmatrix_x4(const std::vector<int>& mem, const int (&addr)[32], bool trans) {
  Ldsm out{};
  for (int lane = 0; lane < 32; ++lane) {
    const int g = lane / 4, t = lane % 4;
    for (int m = 0; m < 4; ++m) {
      for (int h = 0; h < 2; ++h) {
        // non-trans: row g of matrix m, elements 2t, 2t+1; trans: rows 2t, 2t+1, element g.
        out.v[lane][m][h] = trans ? mem[addr[8 * m + 2 * t + h] + g] : mem[addr[8 * m + g] + 2 * t + h];
      }
    }
  }
  return out;
}

template <int COLS>
void check_layout(int rows) {
  using L = Swizzled<COLS>;
  std::vector<int> hits(rows * COLS, 0);
  bool in_range = true;
  for (int r = 0; r < rows; ++r)
    for (int c = 0; c < COLS; ++c) {
      const int o = L::offset(r, c);
      if (o < 0 || o >= rows * COLS) in_range = false;
      else ++hits[o];
    }
  bool bijective = in_range;
  for (int h : hits) bijective = bijective && h == 1;
  check(bijective, "swizzled layout is a bijection", rows, COLS);
  // Chunk alignment: a chunk stays whole and 16-byte aligned.
  bool whole = true;
  for (int r = 0; r < rows; ++r)
    for (int ch = 0; ch < L::CHUNKS; ++ch)
      for (int e = 0; e < 8; ++e)
        whole = whole && L::offset(r, ch * 8 + e) == L::chunk_offset(r, ch) + e &&
                L::chunk_offset(r, ch) % 8 == 0;
  check(whole, "chunks stay contiguous and 16-byte aligned", rows, COLS);
}

// ldmatrix operand loads at corner (r0 rows, k0 / n0 columns) of a ROWS x COLS tile.
template <int ROWS, int COLS>
void check_ldmatrix() {
  using L = Swizzled<COLS>;
  const std::vector<int> mem = make_tile<ROWS, COLS, L>();
  auto id_row = [](int id) { return id / COLS; };
  auto id_col = [](int id) { return id % COLS; };
  for (int r0 = 0; r0 + 16 <= ROWS; r0 += 16) {
    for (int c0 = 0; c0 + 16 <= COLS; c0 += 16) {
      int addr[32];
      std::vector<int64_t> bytes(32);
      // ldsm_a: A[i][k] = X[r0 + i][c0 + k].
      for (int l = 0; l < 32; ++l) {
        addr[l] = L::fragment_offset(L::lane_offset(ldsm_a_row(l), ldsm_a_chunk(l)), r0, c0 / 8);
        bytes[l] = 2 * int64_t{addr[l]};
      }
      check(conflict_free(bytes, 16), "ldsm_a conflict free", ROWS, COLS, r0 * 1000 + c0);
      Ldsm a = ldmatrix_x4(mem, addr, false);
      bool ok = true;
      for (int l = 0; l < 32; ++l)
        for (int j = 0; j < 4; ++j)
          for (int h = 0; h < 2; ++h) {
            const Coord want = mma_a_coord(l, j, h);
            const int id = a.v[l][j][h];
            ok = ok && id_row(id) == r0 + want.row && id_col(id) == c0 + want.col;
          }
      check(ok, "ldsm_a gives the mma A fragment", ROWS, COLS, r0 * 1000 + c0);

      // ldsm_bt (.trans): B[k][n] = X[r0 + k][c0 + n], n-tiles c0 and c0 + 8. Same addresses.
      Ldsm bt = ldmatrix_x4(mem, addr, true);
      ok = true;
      for (int l = 0; l < 32; ++l)
        for (int nt = 0; nt < 2; ++nt)
          for (int j = 0; j < 2; ++j)
            for (int h = 0; h < 2; ++h) {
              const Coord kn = mma_b_coord(l, j, h);
              const int id = bt.v[l][2 * nt + j][h];
              ok = ok && id_row(id) == r0 + kn.row && id_col(id) == c0 + 8 * nt + kn.col;
            }
      check(ok, "ldsm_bt gives the mma B fragments of X", ROWS, COLS, r0 * 1000 + c0);

      // ldsm_b: B[k][n] = X[r0 + n][c0 + k] (X's rows are B's columns), n-tiles r0, r0 + 8.
      for (int l = 0; l < 32; ++l) {
        addr[l] = L::fragment_offset(L::lane_offset(ldsm_b_row(l), ldsm_b_chunk(l)), r0, c0 / 8);
        bytes[l] = 2 * int64_t{addr[l]};
      }
      check(conflict_free(bytes, 16), "ldsm_b conflict free", ROWS, COLS, r0 * 1000 + c0);
      Ldsm b = ldmatrix_x4(mem, addr, false);
      ok = true;
      for (int l = 0; l < 32; ++l)
        for (int nt = 0; nt < 2; ++nt)
          for (int j = 0; j < 2; ++j)
            for (int h = 0; h < 2; ++h) {
              const Coord kn = mma_b_coord(l, j, h);
              const int id = b.v[l][2 * nt + j][h];
              ok = ok && id_row(id) == r0 + 8 * nt + kn.col && id_col(id) == c0 + kn.row;
            }
      check(ok, "ldsm_b gives the mma B fragments of X^T", ROWS, COLS, r0 * 1000 + c0);
    }
  }
}

// The kernels' split address functions against chunk_offset: fragment_offset for every lane row
// and chunk (lr < 16, lc < 2), corner rows r0 % 8 == 0 and even chunks c0; copy_offset for every
// thread row, chunk, pass and row step the copies use.
template <int COLS>
void check_split() {
  using L = Swizzled<COLS>;
  bool ok = true;
  for (int r0 = 0; r0 < 256; r0 += 8)
    for (int c0 = 0; c0 < L::CHUNKS; c0 += 2)
      for (int lr = 0; lr < 16; ++lr)
        for (int lc = 0; lc < 2; ++lc)
          ok = ok && L::fragment_offset(L::lane_offset(lr, lc), r0, c0) == L::chunk_offset(r0 + lr, c0 + lc);
  check(ok, "fragment_offset == chunk_offset", COLS);
  ok = true;
  for (int r_t = 0; r_t < 64; ++r_t)
    for (int ch = 0; ch < L::CHUNKS; ++ch)
      for (int it = 0; it < 16; ++it) {
        ok = ok && L::template copy_offset<1>(r_t, ch, it) == L::chunk_offset(r_t + it, ch);
        ok = ok && L::template copy_offset<2>(r_t, ch, it) == L::chunk_offset(r_t + 2 * it, ch);
        ok = ok && L::template copy_offset<4>(r_t, ch, it) == L::chunk_offset(r_t + 4 * it, ch);
        ok = ok && L::template copy_offset<8>(r_t, ch, it) == L::chunk_offset(r_t + 8 * it, ch);
        ok = ok && L::template copy_offset<16>(r_t, ch, it) == L::chunk_offset(r_t + 16 * it, ch);
        ok = ok && L::template copy_offset<32>(r_t, ch, it) == L::chunk_offset(r_t + 32 * it, ch);
      }
  check(ok, "copy_offset == chunk_offset", COLS);
  // control: the split does need its precondition (an odd corner chunk breaks it)
  check(L::fragment_offset(L::lane_offset(1, 1), 0, 1) != L::chunk_offset(1, 2),
        "control: fragment_offset needs an even corner chunk", COLS);
}

// The cp.async tile copy (consecutive threads, consecutive 16-byte chunks) for NTHREADS threads.
template <int ROWS, int COLS, int NTHREADS>
void check_copy() {
  using L = Swizzled<COLS>;
  constexpr int TOTAL = ROWS * L::CHUNKS;
  bool ok = true;
  for (int it = 0; it * NTHREADS < TOTAL; ++it) {
    for (int w = 0; w < NTHREADS / 32; ++w) {
      std::vector<int64_t> bytes(32, -1);
      for (int l = 0; l < 32; ++l) {
        const int idx = copy_chunk_index(32 * w + l, it, NTHREADS);
        if (idx < TOTAL) bytes[l] = 2 * int64_t{L::chunk_offset(idx / L::CHUNKS, idx % L::CHUNKS)};
      }
      ok = ok && conflict_free(bytes, 16);
    }
  }
  check(ok, "16-byte tile copy conflict free", ROWS, COLS, NTHREADS);
}

// The forward epilogue: a warp stores its 16 x COLS output fragments as 32-bit pairs (rows g,
// g + 8; columns dt * 8 + 2t), then reads them back as 16-byte chunks, row by row.
template <int COLS>
void check_epilogue() {
  using L = Swizzled<COLS>;
  bool ok = true;
  for (int dt = 0; dt < COLS / 8; ++dt) {
    for (int r = 0; r < 2; ++r) {
      std::vector<int64_t> bytes(32);
      for (int l = 0; l < 32; ++l) {
        const Coord c = mma_c_coord(l, 2 * r);
        bytes[l] = 2 * int64_t{L::offset(c.row, dt * 8 + c.col)};
      }
      ok = ok && conflict_free(bytes, 4);
    }
  }
  check(ok, "epilogue fragment stores conflict free", COLS);
  ok = true;
  for (int it = 0; it * 32 < 16 * L::CHUNKS; ++it) {
    std::vector<int64_t> bytes(32, -1);
    for (int l = 0; l < 32; ++l) {
      const int idx = l + 32 * it;
      if (idx < 16 * L::CHUNKS) bytes[l] = 2 * int64_t{L::chunk_offset(idx / L::CHUNKS, idx % L::CHUNKS)};
    }
    ok = ok && conflict_free(bytes, 16);
  }
  check(ok, "epilogue chunk reads conflict free", COLS);
}

// Backward float32 accumulators: float2 read-modify-write of (c[2r], c[2r+1]).
template <int COLS>
void check_acc() {
  using A = AccTile<COLS>;
  bool ok = true;
  for (int warp_row = 0; warp_row < 64; warp_row += 16)
    for (int dt = 0; dt < COLS / 8; ++dt)
      for (int r = 0; r < 2; ++r) {
        std::vector<int64_t> bytes(32);
        for (int l = 0; l < 32; ++l) {
          const Coord c = mma_c_coord(l, 2 * r);
          bytes[l] = 4 * int64_t{A::offset(warp_row + c.row, dt * 8 + c.col)};
        }
        ok = ok && conflict_free(bytes, 8);
      }
  check(ok, "float2 accumulator access conflict free", COLS);
  // The epilogue reads them row by row, consecutive threads consecutive floats.
  ok = true;
  for (int base = 0; base < 64 * COLS; base += 32) {
    std::vector<int64_t> bytes(32);
    for (int l = 0; l < 32; ++l) bytes[l] = 4 * int64_t{A::offset((base + l) / COLS, (base + l) % COLS)};
    ok = ok && conflict_free(bytes, 4);
  }
  check(ok, "accumulator epilogue reads conflict free", COLS);
}

// FlashAttention-2's P reuse: c[2s], c[2s+1] of a 16 x 16k accumulator are the A fragment of
// k-step s (a0 = c[2s][0..1], a1 = c[2s][2..3], a2 = c[2s+1][0..1], a3 = c[2s+1][2..3]).
void check_p_reuse() {
  bool ok = true;
  for (int l = 0; l < 32; ++l)
    for (int j = 0; j < 4; ++j)
      for (int h = 0; h < 2; ++h) {
        const int ntile = j >> 1;             // which of the two n-tiles
        const int e = 2 * (j & 1) + h;        // which accumulator element
        const Coord c = mma_c_coord(l, e);
        const Coord a = mma_a_coord(l, j, h);
        ok = ok && a.row == c.row && a.col == 8 * ntile + c.col;
      }
  check(ok, "accumulators of two n-tiles are the next A fragment");
}

// Paged decoding (csrc/cuda/paged.cu): a warp's 32 K and 32 V rows of DP elements, Swizzled<DP>.
// Lane l copies (cp.async, 16 bytes) and reads back piece c of row l, all lanes the same c; in
// P V the warp reads one row j, lane l its DP / 32 columns from l * DP / 32 (4, 8 or 16 bytes).
template <int DP>
void check_paged_rows() {
  using L = Swizzled<DP>;
  bool ok = true;
  for (int c = 0; c < DP / kChunkElems; ++c) {
    std::vector<int64_t> bytes(32);
    for (int l = 0; l < 32; ++l) bytes[l] = 2 * int64_t{L::chunk_offset(l, c)};
    ok = ok && conflict_free(bytes, 16);
  }
  check(ok, "paged: a lane's own row, piece by piece, conflict free", DP);
  constexpr int VEC = DP / 32;
  ok = true;
  for (int j = 0; j < 32; ++j) {
    std::vector<int64_t> bytes(32);
    for (int l = 0; l < 32; ++l) bytes[l] = 2 * int64_t{L::offset(j, l * VEC)};
    // (a lane's VEC columns are contiguous: they stay within one 16-byte chunk)
    for (int l = 0; l < 32; ++l) ok = ok && L::offset(j, l * VEC + VEC - 1) == L::offset(j, l * VEC) + VEC - 1;
    ok = ok && conflict_free(bytes, 2 * VEC);
  }
  check(ok, "paged: one row's columns across the warp, conflict free", DP);
}

// Control: the checker must see the 8-way conflict of an unswizzled dense 128-byte-row tile.
struct Dense64 {
  static constexpr int offset(int row, int col) { return row * 64 + col; }
};
void check_control() {
  std::vector<int64_t> bytes(32);
  for (int l = 0; l < 32; ++l) bytes[l] = 2 * int64_t{Dense64::offset(ldsm_a_row(l), 8 * ldsm_a_chunk(l))};
  check(!conflict_free(bytes, 16), "control: a dense unswizzled tile has ldmatrix conflicts");
  std::vector<std::pair<int64_t, int>> phase;
  for (int l = 0; l < 8; ++l) phase.push_back({bytes[l], 16});
  check(wavefronts(phase) == 8, "control: 8 rows of 128 bytes, same chunk, need 8 wavefronts");
}

}  // namespace

int main() {
  for (int rows : {8, 16, 32, 64, 128}) {
    check_layout<64>(rows);
    check_layout<128>(rows);
    check_layout<256>(rows);
  }
  // Operand tiles of the kernels: Q / dO (BM x DP), K / V (BN x DP) for DP = 64, 128, 256.
  check_split<64>();
  check_split<128>();
  check_split<256>();
  check_ldmatrix<128, 64>();
  check_ldmatrix<128, 128>();
  check_ldmatrix<64, 256>();
  check_ldmatrix<32, 256>();
  check_copy<128, 64, 256>();
  check_copy<64, 64, 256>();
  check_copy<128, 128, 256>();
  check_copy<64, 128, 256>();
  check_copy<64, 128, 128>();
  check_copy<64, 256, 128>();
  check_copy<32, 256, 128>();
  check_copy<16, 64, 32>();
  check_epilogue<64>();
  check_epilogue<128>();
  check_epilogue<256>();
  check_acc<64>();
  check_acc<128>();
  check_acc<256>();
  check_p_reuse();
  check_paged_rows<64>();
  check_paged_rows<128>();
  check_paged_rows<256>();
  check_control();
  // The layout functions are constexpr: the compiler evaluates them too.
  static_assert(Swizzled<64>::offset(1, 0) == 64 + 8, "row 1 chunk 0 sits in physical chunk 1");
  static_assert(Swizzled<128>::offset(9, 17) == 9 * 128 + (2 ^ 1) * 8 + 1, "swizzle of row 9");
  static_assert(ldsm_b_row(31) == 15 && ldsm_b_chunk(15) == 1, "ldsm_b map");
  if (g_failures) {
    std::printf("cuda_layouts: %d of %d checks FAILED\n", g_failures, g_checks);
    return 1;
  }
  std::printf("cuda_layouts: %d checks passed\n", g_checks);
  return 0;
}
