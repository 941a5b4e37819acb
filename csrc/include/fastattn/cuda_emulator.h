// A host emulator of the CUDA execution model, so that CI (no GPU) can RUN the device code of
// csrc/cuda/attention.cu, not only compile it, and check its results against the float64
// reference (tests/test_cuda_emulated.py; built by fastattn/aot/emulate.py). Compiled only when
// FASTATTN_CUDA_EMULATE is defined: then cuda_helpers.cuh includes this header after the CUDA
// runtime headers, and the kernel sources compile with a host C++ compiler, unchanged apart from
// the few primitives below.
//
// Model. A launch runs its blocks one after another (on up to FASTATTN_EMULATE_THREADS OS threads,
// one block each at a time). A block's threads are fibers of one OS thread (a six-register stack
// switch on x86-64, ucontext elsewhere): a thread runs until it reaches a synchronization point
// (__syncthreads, __syncthreads_or, __syncwarp, a shuffle or vote, ldmatrix, mma.sync), then
// the next thread runs. A point completes when every
// live thread of its scope (block or warp) has arrived; threads that have returned no longer
// count (as on the hardware). Between points the threads' code runs in thread order, so a race
// cannot show in the results; it is found by the shared-memory race check instead (below).
// What the emulator checks:
// - warp collectives with all 32 lanes present and the full mask (the kernels' contract);
// - every ldmatrix row address and cp.async destination inside the block's dynamic shared
//   memory and 16-byte aligned; every cp.async source 16-byte aligned;
// - cp.async completion as PTX defines it: a copy lands only when its thread's
//   cp.async.wait_group retires its group (never at commit or at a barrier), so a read before
//   the wait sees the old bytes; a thread that returns with copies in flight is an error;
// - shared-memory races, by happens-before, as compute-sanitizer's racecheck does: every 4-byte
//   granule remembers its last write and reads (thread, warp, the block's barrier count, the
//   warp's __syncwarp count). A read (ldmatrix, ld_shared) of a granule another thread wrote, or
//   a write (cp.async, st_shared) to one another thread read or wrote, with no __syncthreads
//   between (nor a __syncwarp, within a warp) is an error; so is any access to a granule with a cp.async to it
//   still in flight (issued, its group not yet waited for), and a read of a granule nobody wrote.
//   It sees the accesses made through the emulator: ldmatrix, cp.async, and the plain ones the
//   kernels make through st_shared / ld_shared (cuda_mma.cuh); other plain accesses go unchecked;
// - deadlock (a barrier some threads never reach) is an error, not a hang;
// - shared memory starts as 0xFF bytes (NaN in float16, bfloat16 and float32), so a read of a
//   byte nobody wrote shows up as NaN in the results.
// Tensor cores: mma.sync m16n8k16 takes the fragments of all 32 lanes (the layout documented in
// cuda_mma.cuh) and computes exact products summed in float64, rounded to float32 once per
// accumulator (the hardware rounds its partial sums; the difference is far inside the tests'
// tolerances). ldmatrix (.x4, .trans) follows the PTX fragment maps. Errors are reported as a
// c10::Error (a RuntimeError in Python) naming the kernel's block and thread.
#pragma once

#ifndef FASTATTN_CUDA_EMULATE
#error "cuda_emulator.h is only for FASTATTN_CUDA_EMULATE builds"
#endif

#include <c10/util/Exception.h>
#include <cuda_runtime.h>
#include <ucontext.h>

#include <algorithm>
#include <atomic>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <exception>
#include <functional>
#include <memory>
#include <mutex>
#include <string>
#include <thread>
#include <type_traits>
#include <vector>

namespace fastattn {
namespace emulator {

constexpr int kWarp = 32;
// The dynamic shared memory a block may opt in to: the H100's 227 KiB.
constexpr int kSmemOptin = 232448;

struct Fiber;
struct Block;

// ---- Execution contexts: a fiber's saved stack pointer (x86-64: the callee-saved registers
// are pushed on its own stack; no system call, unlike swapcontext's signal-mask save), or a
// ucontext_t on other machines.
#if defined(__x86_64__) && defined(__linux__)
extern "C" void fastattn_emulator_switch(void** save_sp, void* load_sp);
// Weak: every translation unit that includes this header defines it; the linker keeps one.
asm(R"(
  .text
  .weak fastattn_emulator_switch
  .type fastattn_emulator_switch, @function
fastattn_emulator_switch:
  pushq %rbp
  pushq %rbx
  pushq %r12
  pushq %r13
  pushq %r14
  pushq %r15
  movq %rsp, (%rdi)
  movq %rsi, %rsp
  popq %r15
  popq %r14
  popq %r13
  popq %r12
  popq %rbx
  popq %rbp
  ret
  .size fastattn_emulator_switch, .-fastattn_emulator_switch
)");
struct Context {
  void* sp = nullptr;
};
inline void switch_context(Context& from, Context& to) { fastattn_emulator_switch(&from.sp, to.sp); }
// A context that starts `entry` (which never returns) on [stack, stack + bytes).
inline void make_context(Context& c, char* stack, size_t bytes, void (*entry)()) {
  auto top = reinterpret_cast<uintptr_t>(stack + bytes) & ~uintptr_t{15};
  auto* sp = reinterpret_cast<void**>(top);
  *--sp = nullptr;                               // entry's return address: never used
  *--sp = reinterpret_cast<void*>(entry);        // popped by the switch's ret
  for (int r = 0; r < 6; ++r) *--sp = nullptr;   // rbp rbx r12 r13 r14 r15
  c.sp = sp;
}
#else
struct Context {
  ucontext_t uc;
};
inline void switch_context(Context& from, Context& to) { swapcontext(&from.uc, &to.uc); }
inline void make_context(Context& c, char* stack, size_t bytes, void (*entry)()) {
  getcontext(&c.uc);
  c.uc.uc_stack.ss_sp = stack;
  c.uc.uc_stack.ss_size = bytes;
  c.uc.uc_link = nullptr;
  makecontext(&c.uc, entry, 0);
}
#endif

// Per-warp rendezvous state: the lanes' operands of the collective in progress.
struct Warp {
  int live = 0;  // lanes not yet returned
  int arrived = 0;
  uint64_t gen = 0;
  uint32_t fences = 0;  // completed __syncwarp()s: they order the lanes' shared accesses
  uint64_t word[kWarp];          // shuffle / vote operand
  const void* addr[kWarp];       // ldmatrix row address
  uint32_t frag[kWarp][6];       // mma a0..a3, b0, b1
};

// The race check's record of one 4-byte granule of shared memory: who accessed it last, in which
// barrier interval (`epoch`, the block's completed __syncthreads) and after how many of the
// accessing warp's __syncwarp (`fence`). tid / warp kMany: several in that interval.
constexpr int32_t kNone = -1, kMany = -2;
struct Access {
  int32_t tid = kNone;
  int32_t warp = kNone;
  uint32_t epoch = 0;
  uint32_t fence = 0;
};
struct Granule {
  Access write, read;
  int32_t in_flight = 0;  // cp.async copies to it not yet landed
};

struct Block {
  uint3 idx{};
  dim3 dim{};
  dim3 grid{};
  std::vector<unsigned char> smem;  // dynamic shared memory (+ alignment slack)
  unsigned char* smem_base = nullptr;
  size_t smem_bytes = 0;
  int live = 0;
  int arrived = 0;
  uint64_t gen = 0;
  int vote[2] = {0, 0};  // __syncthreads_or, by barrier generation parity
  std::vector<Warp> warps;
  std::vector<Granule> shadow;  // one per 4 bytes of smem
  std::string unwritten;         // the first read of a granule nobody had written
};

struct CpAsync {
  void* dst;
  const void* src;
};

struct Fiber {
  Context ctx;
  std::unique_ptr<char[]> stack;
  uint3 tid{};
  int linear = 0;  // the thread's index in the block (x fastest): its warp is linear / 32
  int lane = 0;
  bool done = false;
  std::vector<CpAsync> open;                  // issued since the last commit
  std::vector<std::vector<CpAsync>> groups;   // committed, oldest first
};

// The scheduler of one OS thread (one block at a time).
struct Scheduler {
  Context main;
  Block* block = nullptr;
  std::vector<Fiber> fibers;
  Fiber* cur = nullptr;
  uint64_t progress = 0;
  bool failed = false;
  std::string error;
  std::function<void()> body;  // the kernel call every fiber makes
};

inline thread_local Scheduler* tls_sched = nullptr;

inline Scheduler& sched() { return *tls_sched; }
inline Fiber& self() { return *tls_sched->cur; }
inline Block& block() { return *tls_sched->block; }
inline Warp& warp() { return block().warps[self().linear / kWarp]; }

inline std::string where() {
  const Block& b = block();
  return "block (" + std::to_string(b.idx.x) + ", " + std::to_string(b.idx.y) + ", " +
         std::to_string(b.idx.z) + "), thread " + std::to_string(self().linear);
}

// Ends this fiber for good and hands control back to the scheduler, which reports `what`.
[[noreturn]] inline void fail(const std::string& what) {
  Scheduler& s = sched();
  if (!s.failed) {
    s.failed = true;
    s.error = what + " (" + where() + ")";
  }
  switch_context(s.cur->ctx, s.main);
  std::abort();  // never resumed
}

inline void yield() {
  Scheduler& s = sched();
  switch_context(s.cur->ctx, s.main);
}

// Arrive at the block barrier and wait for every live thread; returns the OR of `pred`.
inline int block_barrier(int pred) {
  Block& b = block();
  const uint64_t g = b.gen;
  b.vote[g & 1] |= pred != 0;
  ++sched().progress;
  if (++b.arrived == b.live) {
    b.arrived = 0;
    b.vote[(g + 1) & 1] = 0;
    ++b.gen;
  } else {
    while (b.gen == g) yield();
  }
  return b.vote[g & 1];
}

// Arrive at the warp's rendezvous and wait for its other live lanes. `fence`: a __syncwarp,
// which also orders the lanes' shared-memory accesses (the race check counts it).
inline void warp_barrier(bool fence = false) {
  Warp& w = warp();
  if (w.live != kWarp) fail("a warp collective with lanes that have returned");
  const uint64_t g = w.gen;
  ++sched().progress;
  if (++w.arrived == w.live) {
    w.arrived = 0;
    w.fences += fence;
    ++w.gen;
  } else {
    while (w.gen == g) yield();
  }
}

inline void check_mask(unsigned mask) {
  if (mask != 0xffffffffu) fail("a warp collective without the full mask");
}

template <typename V>
inline V shfl_xor(unsigned mask, V v, int lane_mask) {
  static_assert(sizeof(V) <= 8 && std::is_trivially_copyable_v<V>, "shuffle of a word");
  check_mask(mask);
  Warp& w = warp();
  const int lane = self().lane;
  uint64_t bits = 0;
  std::memcpy(&bits, &v, sizeof(V));
  w.word[lane] = bits;
  warp_barrier();
  const uint64_t other = w.word[(lane ^ lane_mask) & (kWarp - 1)];
  warp_barrier();  // every lane has read before the slots are reused
  V out;
  std::memcpy(&out, &other, sizeof(V));
  return out;
}

inline int any_sync(unsigned mask, int pred) {
  check_mask(mask);
  Warp& w = warp();
  w.word[self().lane] = pred != 0;
  warp_barrier();
  int any = 0;
  for (int l = 0; l < kWarp; ++l) any |= static_cast<int>(w.word[l]);
  warp_barrier();
  return any;
}

// Whether [p, p + bytes) lies in the block's dynamic shared memory.
inline bool in_smem(const void* p, size_t bytes) {
  const Block& b = block();
  const auto* c = static_cast<const unsigned char*>(p);
  return c >= b.smem_base && c + bytes <= b.smem_base + b.smem_bytes;
}

inline void check_smem_row(const void* p, const char* what) {
  if (!in_smem(p, 16)) fail(std::string(what) + ": address outside the dynamic shared memory");
  if (reinterpret_cast<uintptr_t>(p) % 16 != 0) fail(std::string(what) + ": unaligned address");
}

// ---- The shared-memory race check (see the top of this file).

// Whether `prev` happens before an access by thread `tid` of warp `w` now: an earlier barrier
// interval, the same thread, or the same warp with a __syncwarp since.
inline bool ordered(const Access& prev, int tid, int w) {
  if (prev.tid == kNone) return true;
  const Block& b = block();
  if (prev.epoch < static_cast<uint32_t>(b.gen)) return true;
  if (tid >= 0 && prev.tid == tid) return true;
  return prev.warp == w && prev.fence < b.warps[w].fences;
}

inline void record(Access& a, int tid, int w) {
  const Block& b = block();
  const auto epoch = static_cast<uint32_t>(b.gen);
  if (a.tid != kNone && a.epoch == epoch) {  // one more access in this interval
    if (a.tid != tid) a.tid = kMany;
    if (a.warp != w) a.warp = kMany;
  } else {
    a.tid = tid;
    a.warp = w;
    a.epoch = epoch;
  }
  a.fence = b.warps[w].fences;
}

inline std::string describe(const Access& a) {
  if (a.tid == kMany) return a.warp == kMany ? "several warps" : "several threads of warp " + std::to_string(a.warp);
  return "thread " + std::to_string(a.tid);
}

// `what` touches [p, p + bytes) of shared memory: `write` or read, by this thread (`warp_wide`:
// by the warp as a whole, as ldmatrix reads; then no thread's own earlier access orders it).
inline void shared_access(const void* p, size_t bytes, bool write, const char* what,
                          bool warp_wide = false) {
  if (!in_smem(p, bytes)) fail(std::string(what) + ": address outside the dynamic shared memory");
  Block& b = block();
  const int tid = warp_wide ? kMany : self().linear;
  const int w = self().linear / kWarp;
  const size_t off = static_cast<const unsigned char*>(p) - b.smem_base;
  for (size_t g = off / 4; g < (off + bytes + 3) / 4; ++g) {
    Granule& gr = b.shadow[g];
    const std::string at = " at shared byte " + std::to_string(4 * g);
    if (gr.in_flight > 0) fail(std::string("race: ") + what + at + " while a cp.async to it is in flight");
    if (write) {
      if (!ordered(gr.read, tid, w)) {
        fail(std::string("race: ") + what + " writes" + at + " read by " + describe(gr.read) +
             " with no barrier between");
      }
      if (!ordered(gr.write, tid, w)) {  // which write is last is up to the hardware's timing
        fail(std::string("race: ") + what + " writes" + at + " written by " +
             describe(gr.write) + " with no barrier between");
      }
      record(gr.write, tid, w);
    } else {
      // Reported when the block ends, unless a race is found first: in the emulator's thread
      // order, a read racing with a later write of another thread comes before that write.
      if (gr.write.tid == kNone && b.unwritten.empty()) {
        b.unwritten = std::string(what) + " reads" + at + ", which nobody wrote (" + where() + ")";
      }
      if (!ordered(gr.write, tid, w)) {
        fail(std::string("race: ") + what + " reads" + at + " written by " + describe(gr.write) +
             " with no barrier between");
      }
      record(gr.read, tid, w);
    }
  }
}

// ldmatrix.sync.aligned.m8n8.x4[.trans].shared.b16: lane 8m + r gives row r of matrix m.
inline void ldmatrix_x4(uint32_t (&r)[4], const uint16_t* row_addr, bool trans) {
  check_smem_row(row_addr, "ldmatrix");
  shared_access(row_addr, 16, /*write=*/false, "ldmatrix", /*warp_wide=*/true);
  Warp& w = warp();
  const int lane = self().lane, g = lane / 4, t = lane % 4;
  w.addr[lane] = row_addr;
  warp_barrier();
  for (int m = 0; m < 4; ++m) {
    uint16_t lo, hi;
    if (!trans) {  // row g of matrix m, elements 2t, 2t + 1
      const auto* row = static_cast<const uint16_t*>(w.addr[8 * m + g]);
      lo = row[2 * t];
      hi = row[2 * t + 1];
    } else {  // column g of matrix m, rows 2t, 2t + 1
      lo = static_cast<const uint16_t*>(w.addr[8 * m + 2 * t])[g];
      hi = static_cast<const uint16_t*>(w.addr[8 * m + 2 * t + 1])[g];
    }
    r[m] = static_cast<uint32_t>(lo) | (static_cast<uint32_t>(hi) << 16);
  }
  warp_barrier();
}

// mma.sync.aligned.m16n8k16.row.col.f32.{f16,bf16}: d += A B for the warp's fragments.
template <typename ToFloat>
inline void mma_m16n8k16(float (&d)[4], const uint32_t (&a)[4], uint32_t b0, uint32_t b1,
                         ToFloat to_float) {
  Warp& w = warp();
  const int lane = self().lane, g = lane / 4, t = lane % 4;
  for (int i = 0; i < 4; ++i) w.frag[lane][i] = a[i];
  w.frag[lane][4] = b0;
  w.frag[lane][5] = b1;
  warp_barrier();
  auto half_of = [](uint32_t word, int k) {
    return static_cast<uint16_t>(k % 2 == 0 ? word & 0xffffu : word >> 16);
  };
  // A[row][k]: lane 4 (row % 8) + (k % 8) / 2, register (row >= 8) + 2 (k >= 8), half k % 2.
  auto A = [&](int row, int k) {
    const uint32_t word = w.frag[4 * (row % 8) + (k % 8) / 2][(row >= 8) + 2 * (k >= 8)];
    return static_cast<double>(to_float(half_of(word, k)));
  };
  // B[k][n]: lane 4 n + (k % 8) / 2, b0 for k < 8 else b1, half k % 2.
  auto B = [&](int k, int n) {
    const uint32_t word = w.frag[4 * n + (k % 8) / 2][4 + (k >= 8)];
    return static_cast<double>(to_float(half_of(word, k)));
  };
  float out[4];
  for (int c = 0; c < 4; ++c) {
    const int row = g + 8 * (c / 2), col = 2 * t + (c % 2);
    double acc = d[c];
    for (int k = 0; k < 16; ++k) acc += A(row, k) * B(k, col);
    out[c] = static_cast<float>(acc);
  }
  warp_barrier();  // every lane has read the fragments before they are reused
  for (int c = 0; c < 4; ++c) d[c] = out[c];
}

inline void cp_async_16(void* dst, const void* src) {
  check_smem_row(dst, "cp.async destination");
  if (reinterpret_cast<uintptr_t>(src) % 16 != 0) fail("cp.async: unaligned global source");
  // The copy may land at any moment from now: earlier reads by others must be ordered before it.
  shared_access(dst, 16, /*write=*/true, "cp.async");
  Block& b = block();
  const size_t g0 = (static_cast<unsigned char*>(dst) - b.smem_base) / 4;
  for (size_t g = g0; g < g0 + 4; ++g) ++b.shadow[g].in_flight;
  self().open.push_back({dst, src});
}
inline void cp_async_commit() {
  Fiber& f = self();
  f.groups.push_back(std::move(f.open));
  f.open.clear();
}
// cp.async.wait_group n: the copies of all but the newest n committed groups land now.
inline void cp_async_wait(int n) {
  Fiber& f = self();
  while (static_cast<int>(f.groups.size()) > n) {
    Block& b = block();
    for (const CpAsync& c : f.groups.front()) {
      std::memcpy(c.dst, c.src, 16);
      const size_t g0 = (static_cast<unsigned char*>(c.dst) - b.smem_base) / 4;
      for (size_t g = g0; g < g0 + 4; ++g) {  // landed: written by this thread, now
        --b.shadow[g].in_flight;
        record(b.shadow[g].write, f.linear, f.linear / kWarp);
      }
    }
    f.groups.erase(f.groups.begin());
  }
}

inline void fiber_entry() {
  Scheduler& s = sched();
  try {
    s.body();
  } catch (const std::exception& e) {  // nothing may unwind past a fiber's first frame
    fail(std::string("the kernel threw: ") + e.what());
  }
  Fiber& f = self();
  bool in_flight = !f.open.empty();
  for (const auto& grp : f.groups) in_flight = in_flight || !grp.empty();
  if (in_flight) fail("a thread returned with cp.async copies in flight");
  // Leave the barriers: the block's and the warp's (completing them if all others wait).
  Block& b = block();
  Warp& w = warp();
  f.done = true;
  ++s.progress;
  if (--b.live > 0 && b.arrived == b.live) {
    b.arrived = 0;
    b.vote[(b.gen + 1) & 1] = 0;
    ++b.gen;
  }
  if (--w.live > 0 && w.arrived == w.live) {
    w.arrived = 0;
    ++w.gen;
  }
  switch_context(f.ctx, s.main);
}

inline size_t stack_bytes() {
  const char* env = std::getenv("FASTATTN_EMULATE_STACK_KB");
  return (env != nullptr ? std::strtoul(env, nullptr, 10) : 256) * 1024;
}

// Runs block `b` of a launch to completion on this OS thread; returns an error or "".
inline std::string run_block(unsigned b, dim3 grid, dim3 blockdim, size_t smem_bytes,
                             const std::function<void()>& body) {
  Scheduler s;
  Block blk;
  blk.idx = uint3{b % grid.x, b / grid.x % grid.y, b / (grid.x * grid.y)};
  blk.dim = blockdim;
  blk.grid = grid;
  const int nthreads = static_cast<int>(blockdim.x * blockdim.y * blockdim.z);
  blk.smem.assign(smem_bytes + 128, 0xFF);
  const auto addr = reinterpret_cast<uintptr_t>(blk.smem.data());
  blk.smem_base = blk.smem.data() + ((128 - addr % 128) % 128);
  blk.smem_bytes = smem_bytes;
  blk.shadow.assign((smem_bytes + 3) / 4, Granule{});
  blk.live = nthreads;
  blk.warps.resize((nthreads + kWarp - 1) / kWarp);
  for (int w = 0; w < static_cast<int>(blk.warps.size()); ++w) {
    blk.warps[w].live = std::min(kWarp, nthreads - w * kWarp);
  }
  s.block = &blk;
  s.body = body;
  s.fibers.resize(nthreads);
  tls_sched = &s;
  const size_t stack = stack_bytes();
  for (int t = 0; t < nthreads; ++t) {
    Fiber& f = s.fibers[t];
    const auto u = static_cast<unsigned>(t);  // x fastest, as the hardware numbers threads
    f.tid = uint3{u % blockdim.x, u / blockdim.x % blockdim.y, u / (blockdim.x * blockdim.y)};
    f.linear = t;
    f.lane = t % kWarp;
    f.stack.reset(new char[stack]);
    make_context(f.ctx, f.stack.get(), stack, fiber_entry);
  }
  int alive = nthreads;
  while (alive > 0) {
    const uint64_t before = s.progress;
    for (Fiber& f : s.fibers) {
      if (f.done) continue;
      s.cur = &f;
      switch_context(s.main, f.ctx);
      if (s.failed) {
        tls_sched = nullptr;
        return s.error;
      }
    }
    alive = 0;
    for (const Fiber& f : s.fibers) alive += !f.done;
    if (alive > 0 && s.progress == before) {
      tls_sched = nullptr;
      return "deadlock: " + std::to_string(alive) + " threads wait at a barrier others never reach" +
             " (block " + std::to_string(b) + ")";
    }
  }
  tls_sched = nullptr;
  return blk.unwritten;
}

// kernel<<<blocks, threads, smem>>>(args...), run on the host.
template <typename... KArgs, typename... Args>
void launch(void (*kernel)(KArgs...), dim3 grid, dim3 blockdim, size_t smem_bytes,
            const Args&... args) {
  TORCH_CHECK(smem_bytes <= static_cast<size_t>(kSmemOptin), "emulated launch asks for ",
              smem_bytes, " bytes of shared memory");
  const unsigned threads = blockdim.x * blockdim.y * blockdim.z;
  TORCH_CHECK(threads >= 1 && threads <= 1024, "emulated launch of ", threads, " threads a block");
  const std::function<void()> body = [&]() { kernel(args...); };
  const unsigned blocks = grid.x * grid.y * grid.z;
  const char* env = std::getenv("FASTATTN_EMULATE_THREADS");
  unsigned workers = env != nullptr ? static_cast<unsigned>(std::atoi(env))
                                    : std::max(1u, std::thread::hardware_concurrency());
  workers = std::max(1u, std::min(workers, blocks));
  if (blocks == 0) return;
  std::atomic<unsigned> next{0};
  std::mutex mu;
  std::string first_error;
  auto work = [&]() {
    for (unsigned b = next++; b < blocks; b = next++) {
      std::string err = run_block(b, grid, blockdim, smem_bytes, body);
      if (!err.empty()) {
        std::lock_guard<std::mutex> lock(mu);
        if (first_error.empty()) first_error = err;
        next = blocks;  // stop handing out blocks
      }
    }
  };
  std::vector<std::thread> pool;
  for (unsigned i = 1; i < workers; ++i) pool.emplace_back(work);
  work();
  for (auto& th : pool) th.join();
  TORCH_CHECK(first_error.empty(), "emulated CUDA kernel: ", first_error);
}

}  // namespace emulator
}  // namespace fastattn

// The CUDA built-ins the kernels use, on top of the emulator.
#undef __launch_bounds__
#define __launch_bounds__(...)
// A kernel's static __shared__ arrays: per OS thread, so per block (one runs at a time on each);
// not NaN-filled and not seen by the race check (plain accesses).
#undef __shared__
#define __shared__ thread_local
#define threadIdx (::fastattn::emulator::self().tid)
#define blockIdx (::fastattn::emulator::block().idx)
#define blockDim (::fastattn::emulator::block().dim)
#define gridDim (::fastattn::emulator::block().grid)

inline void __syncthreads() { ::fastattn::emulator::block_barrier(0); }
inline int __syncthreads_or(int pred) { return ::fastattn::emulator::block_barrier(pred); }
inline void __syncwarp(unsigned mask = 0xffffffffu) {
  ::fastattn::emulator::check_mask(mask);
  ::fastattn::emulator::warp_barrier(/*fence=*/true);
}
template <typename V>
inline V __shfl_xor_sync(unsigned mask, V v, int lane_mask) {
  return ::fastattn::emulator::shfl_xor(mask, v, lane_mask);
}
inline int __any_sync(unsigned mask, int pred) { return ::fastattn::emulator::any_sync(mask, pred); }
inline unsigned __float_as_uint(float x) {
  unsigned u;
  std::memcpy(&u, &x, sizeof u);
  return u;
}
template <typename V>
inline V __ldg(const V* p) {
  return *p;
}
inline float __frcp_rn(float x) { return 1.f / x; }
inline float __fdividef(float a, float b) { return a / b; }
inline float __expf(float x) { return std::exp(x); }
inline float rsqrtf(float x) { return 1.f / std::sqrt(x); }
using std::max;
using std::min;
