// Controls for the host emulator (cuda_emulator.h): small kernels, each with one defect the
// emulator must report (or, with `ok`, the same kernel without it, which must run), and an
// mma.sync / ldmatrix product checked against a plain matrix product. tests/test_cuda_emulated.py
// runs them: a check that never fires would let the attention tests pass for the wrong reason.
#define FASTATTN_CUDA_EMULATE 1
#include "fastattn/cuda_helpers.cuh"
#include "fastattn/cuda_mma.cuh"

#include <torch/csrc/utils/pybind.h>

#include <string>

#include "fastattn/common.h"

namespace fastattn {
namespace emulator_selftest {

using namespace ::fastattn::cuda_helpers;

struct Args {
  const uint16_t* a;  // 16 x 16 row-major (mma test) or 64 x 8 (copy tests)
  const uint16_t* b;  // 8 x 16 row-major: B^T (mma test)
  float* out;
  bool ok;  // run the kernel without its defect
};

// A thread reads a word another thread wrote, with (ok) or without a barrier between.
__global__ void raw_race(const Args p) {
  FASTATTN_DYNAMIC_SMEM(unsigned char, smem);
  float* s = reinterpret_cast<float*>(smem);
  const int t = threadIdx.x;
  st_shared(s + t, static_cast<float>(t));
  if (p.ok) __syncthreads();
  p.out[t] = ld_shared<float>(s + (63 - t));
}

// Two threads of different warps write one word, with (ok) or without a barrier between.
__global__ void waw_race(const Args p) {
  FASTATTN_DYNAMIC_SMEM(unsigned char, smem);
  float* s = reinterpret_cast<float*>(smem);
  const int t = threadIdx.x;
  if (t == 0) st_shared(s, 1.f);
  if (p.ok) __syncthreads();
  if (t == 32) st_shared(s, 2.f);
  p.out[t] = 0.f;
}

// A warp reads a tile with ldmatrix while another warp's cp.async refills it; ok: a barrier
// between, as the kernels' second barrier per key tile.
__global__ void war_race(const Args p) {
  FASTATTN_DYNAMIC_SMEM(unsigned char, smem);
  uint16_t* s = reinterpret_cast<uint16_t*>(smem);
  const int t = threadIdx.x, lane = t % 32;
  st_shared(s + 8 * t, make_uint4(t, t, t, t));  // 64 chunks of 16 bytes
  __syncthreads();
  uint32_t r[4] = {0, 0, 0, 0};
  if (t < 32) ldsm_x4(r, s + 8 * lane);  // warp 0 reads chunks 0..31
  if (p.ok) __syncthreads();
  if (t >= 32) cp_async_16(s + 8 * (t - 32), p.a + 8 * (t - 32));  // warp 1 refills them
  cp_async_commit();
  cp_async_wait<0>();
  p.out[t] = static_cast<float>(r[0] & 0xffffu);
}

// Thread t's cp.async of 16-byte chunk t of `a` into shared memory, committed, and (ok) waited
// for; returns the shared tile.
__device__ uint16_t* copy_own_chunk(const Args& p) {
  FASTATTN_DYNAMIC_SMEM(unsigned char, smem);
  uint16_t* s = reinterpret_cast<uint16_t*>(smem);
  const int t = threadIdx.x;
  cp_async_16(s + 8 * t, p.a + 8 * t);
  cp_async_commit();
  if (p.ok) cp_async_wait<0>();
  return s;
}

// A thread reads its own cp.async destination before (or, ok, after) waiting for it.
__global__ void read_in_flight(const Args p) {
  const uint16_t* s = copy_own_chunk(p);
  const uint4 v = ld_shared<uint4>(s + 8 * threadIdx.x);
  cp_async_wait<0>();
  p.out[threadIdx.x] = static_cast<float>(v.x & 0xffffu);
}

// A thread returns with its cp.async group never waited for (ok: waited for).
__global__ void exit_in_flight(const Args p) {
  copy_own_chunk(p);
  p.out[threadIdx.x] = 1.f;
}

// Reads shared memory that no thread wrote (ok: after writing it).
__global__ void read_unwritten(const Args p) {
  FASTATTN_DYNAMIC_SMEM(unsigned char, smem);
  float* s = reinterpret_cast<float*>(smem);
  const int t = threadIdx.x;
  if (p.ok) st_shared(s + t, 1.f);
  p.out[t] = ld_shared<float>(s + t);
}

// Threads 0-47 wait at a barrier while lanes 16-31 of warp 1 wait in a shuffle for lanes 0-15,
// which are at the barrier (ok: every thread passes the barrier first).
__global__ void divergent_barrier(const Args p) {
  const int t = threadIdx.x;
  if (p.ok || t < 48) __syncthreads();
  if (t >= 32) p.out[t] = __shfl_xor_sync(0xffffffffu, 1.f * t, 1);
}

// ldmatrix past the end of the dynamic shared memory (ok: inside it).
__global__ void ldmatrix_out_of_bounds(const Args p) {
  FASTATTN_DYNAMIC_SMEM(unsigned char, smem);
  uint16_t* s = reinterpret_cast<uint16_t*>(smem);
  const int lane = threadIdx.x % 32;
  st_shared(s + 8 * lane, make_uint4(0, 0, 0, 0));
  __syncwarp();
  uint32_t r[4];
  ldsm_x4(r, s + 8 * lane + (p.ok ? 0 : 2048));  // 4096 bytes on: the end
  p.out[lane] = static_cast<float>(r[0]);
}

// D = A B for A (16 x 16, row-major) and B given as B^T (8 x 16, row-major), through ldmatrix of
// row-major tiles in shared memory and one mma.sync, as the attention kernels compute Q K^T.
template <typename T>
__global__ void mma_product(const Args p) {
  FASTATTN_DYNAMIC_SMEM(unsigned char, smem);
  uint16_t* sa = reinterpret_cast<uint16_t*>(smem);
  uint16_t* sb = sa + 256;
  const int lane = threadIdx.x;
  // 16 rows of A (2 chunks each) and 8 rows of B^T (2 chunks each): 48 chunks.
  for (int c = lane; c < 48; c += 32) {
    uint16_t* dst = c < 32 ? sa + 8 * c : sb + 8 * (c - 32);
    const uint16_t* src = c < 32 ? p.a + 8 * c : p.b + 8 * (c - 32);
    cp_async_16(dst, src);
  }
  cp_async_commit();
  cp_async_wait<0>();
  __syncwarp();
  // A: matrices (rows 0-7, k 0-7), (rows 8-15, k 0-7), (rows 0-7, k 8-15), (rows 8-15, k 8-15).
  const int m = lane / 8, r = lane % 8;
  uint32_t a[4];
  ldsm_x4(a, sa + 16 * (r + 8 * (m % 2)) + 8 * (m / 2));
  // B^T rows n = r, k halves: matrices (k 0-7), (k 8-15) -- x4 reads each twice.
  uint32_t b[4];
  ldsm_x4(b, sb + 16 * r + 8 * (m % 2));
  float d[4] = {0.f, 0.f, 0.f, 0.f};
  Mma16<T>::mma(d, a, b[0], b[1]);
  const int g = lane / 4, t = lane % 4;
  p.out[g * 8 + 2 * t] = d[0];
  p.out[g * 8 + 2 * t + 1] = d[1];
  p.out[(g + 8) * 8 + 2 * t] = d[2];
  p.out[(g + 8) * 8 + 2 * t + 1] = d[3];
}

// Runs control `name` on 64 threads (the mma: 32) with 4 KiB of shared memory; returns out.
at::Tensor run(const std::string& name, bool ok, const at::Tensor& a, const at::Tensor& b) {
  TORCH_CHECK(a.is_contiguous() && a.numel() >= 512 && a.element_size() == 2,
              "a: a contiguous 16-bit tensor of at least 512 elements");
  TORCH_CHECK(b.is_contiguous() && b.numel() >= 128 && b.element_size() == 2,
              "b: a contiguous 16-bit tensor of at least 128 elements");
  at::Tensor out = fastattn::empty_tensor({256}, a.options().dtype(at::kFloat)).zero_();
  const Args p{reinterpret_cast<const uint16_t*>(a.const_data_ptr()),
               reinterpret_cast<const uint16_t*>(b.const_data_ptr()), out.data_ptr<float>(), ok};
  auto go = [&](void (*kernel)(Args), unsigned threads) {
    launch_kernel(kernel, 1, threads, 4096, nullptr, p);
  };
  if (name == "raw_race") go(raw_race, 64);
  else if (name == "waw_race") go(waw_race, 64);
  else if (name == "war_race") go(war_race, 64);
  else if (name == "read_in_flight") go(read_in_flight, 64);
  else if (name == "exit_in_flight") go(exit_in_flight, 64);
  else if (name == "read_unwritten") go(read_unwritten, 64);
  else if (name == "divergent_barrier") go(divergent_barrier, 64);
  else if (name == "ldmatrix_out_of_bounds") go(ldmatrix_out_of_bounds, 32);
  else if (name == "mma_f16") go(mma_product<c10::Half>, 32);
  else if (name == "mma_bf16") go(mma_product<c10::BFloat16>, 32);
  else TORCH_CHECK(false, "no emulator control named ", name);
  return out;
}

}  // namespace emulator_selftest
}  // namespace fastattn

void register_emulator_selftest(pybind11::module& m) {
  m.def("selftest", &fastattn::emulator_selftest::run,
        "run one of the emulator's controls (csrc/emulate/selftest.cpp)");
}
