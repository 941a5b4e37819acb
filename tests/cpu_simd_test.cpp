// Host check of cpu_simd.h's vector float16 / bfloat16 conversions against c10's per-element ones
// (tests/test_cpu_simd.py compiles and runs it): load_half for every float16 bit pattern, store_half
// for every float32 high half with low halves that cover each rounding boundary (ties, both sides
// of them, all dropped bits set), at widths 4, 8 and 16; load_bf16 / store_bf16 and their even /
// odd pair forms likewise. A NaN only has to stay a NaN of its sign (c10's payload depends on
// whether it was compiled for F16C). And the softmax's exp (vexp_shifted) against vexp: the same
// bits for float32 inputs at most 88 (every one in [-88, -86] around the low cut and next to
// zero, every 61st other negative pattern, every 97th positive one), NaN for NaN.
// Exits non-zero and prints the first mismatches on failure.
#include <cmath>
#include <cstdint>
#include <cstdio>
#include <cstring>
#include <vector>

#include "fastattn/cpu_simd.h"

using fastattn::cpu::Vec;

static int failures = 0;

static uint32_t bits(float f) {
  uint32_t u;
  std::memcpy(&u, &f, 4);
  return u;
}
static float from_bits(uint32_t u) {
  float f;
  std::memcpy(&f, &u, 4);
  return f;
}
static void fail(const char* what, uint32_t in, uint32_t got, uint32_t want) {
  if (++failures <= 10) std::printf("%s: input 0x%08x gives 0x%08x, want 0x%08x\n", what, in, got, want);
}

template <int W>
void check_widening() {
  std::vector<uint16_t> in(65536);
  for (uint32_t i = 0; i < 65536; ++i) in[i] = static_cast<uint16_t>(i);
  for (uint32_t i = 0; i < 65536; i += W) {
    float out[W];
    fastattn::cpu::load_half<W>(reinterpret_cast<const c10::Half*>(in.data() + i)).store(out);
    float outb[W];
    fastattn::cpu::load_bf16<W>(reinterpret_cast<const c10::BFloat16*>(in.data() + i)).store(outb);
    for (int k = 0; k < W; ++k) {
      c10::Half h;
      h.x = in[i + k];
      const float want = static_cast<float>(h);
      const bool same = std::isnan(want) ? (std::isnan(out[k]) && bits(out[k]) == bits(want))
                                         : bits(out[k]) == bits(want);
      if (!same) fail("load_half", in[i + k], bits(out[k]), bits(want));
      c10::BFloat16 b;
      b.x = in[i + k];
      if (bits(outb[k]) != bits(static_cast<float>(b))) fail("load_bf16", in[i + k], bits(outb[k]), bits(static_cast<float>(b)));
    }
  }
  // load_bf16_pairs: 2W values, even positions in one vector and odd ones in the other.
  for (uint32_t i = 0; i + 2 * W <= 65536; i += 2 * W) {
    Vec<float, W> even, odd;
    fastattn::cpu::load_bf16_pairs<W>(reinterpret_cast<const c10::BFloat16*>(in.data() + i), even, odd);
    for (int k = 0; k < W; ++k) {
      c10::BFloat16 be, bo;
      be.x = in[i + 2 * k];
      bo.x = in[i + 2 * k + 1];
      if (bits(even[k]) != bits(static_cast<float>(be))) fail("load_bf16_pairs even", be.x, bits(even[k]), bits(static_cast<float>(be)));
      if (bits(odd[k]) != bits(static_cast<float>(bo))) fail("load_bf16_pairs odd", bo.x, bits(odd[k]), bits(static_cast<float>(bo)));
    }
  }
}

template <int W>
void check_narrowing() {
  // Low halves: every combination of bits 12..15 (the float16 rounding bit 13, the tie bit 12 and
  // their neighbours) with the bits below all clear, one set, the top one set or all set.
  std::vector<uint32_t> lows;
  for (uint32_t top = 0; top < 16; ++top) {
    for (uint32_t below : {0x000u, 0x001u, 0x800u, 0xFFFu}) lows.push_back((top << 12) | below);
  }
  std::vector<float> in;
  in.reserve(65536 * lows.size());
  for (uint32_t hi = 0; hi < 65536; ++hi) {
    for (uint32_t lo : lows) in.push_back(from_bits((hi << 16) | lo));
  }
  std::vector<uint16_t> out(in.size()), outb(in.size());
  for (size_t i = 0; i + W <= in.size(); i += W) {
    const Vec<float, W> v = Vec<float, W>::load(in.data() + i);
    fastattn::cpu::store_half<W>(v, reinterpret_cast<c10::Half*>(out.data() + i));
    fastattn::cpu::store_bf16<W>(v, reinterpret_cast<c10::BFloat16*>(outb.data() + i));
  }
  // store_bf16_pairs: 2W values given as the even-position and odd-position floats.
  std::vector<uint16_t> outp(in.size());
  for (size_t i = 0; i + 2 * W <= in.size(); i += 2 * W) {
    float even[W], odd[W];
    for (int k = 0; k < W; ++k) {
      even[k] = in[i + 2 * k];
      odd[k] = in[i + 2 * k + 1];
    }
    fastattn::cpu::store_bf16_pairs<W>(Vec<float, W>::load(even), Vec<float, W>::load(odd),
                                       reinterpret_cast<c10::BFloat16*>(outp.data() + i));
  }
  for (size_t i = 0; i < in.size(); ++i) {
    const uint16_t wantp = c10::BFloat16(in[i]).x;
    if (!std::isnan(in[i]) && outp[i] != wantp) fail("store_bf16_pairs", bits(in[i]), outp[i], wantp);
    if (std::isnan(in[i]) && !((outp[i] & 0x7F80) == 0x7F80 && (outp[i] & 0x7F))) fail("store_bf16_pairs NaN", bits(in[i]), outp[i], wantp);
  }
  for (size_t i = 0; i < in.size(); ++i) {
    const uint16_t want = c10::Half(in[i]).x;
    const uint16_t wantb = c10::BFloat16(in[i]).x;
    // A NaN must stay a NaN of its sign; its payload is c10's choice (0x7E00 in software,
    // kept by F16C when the compiler targets it).
    const bool same = std::isnan(in[i])
                          ? (out[i] & 0x7C00) == 0x7C00 && (out[i] & 0x03FF) && (out[i] >> 15) == (want >> 15)
                          : out[i] == want;
    if (!same) fail("store_half", bits(in[i]), out[i], want);
    if (!std::isnan(in[i]) && outb[i] != wantb) fail("store_bf16", bits(in[i]), outb[i], wantb);
  }
}

template <int W>
void check_exp_shifted() {
  using V = Vec<float, W>;
  auto check = [](uint32_t u) {
    float in[W], got[W], want[W];
    for (int i = 0; i < W; ++i) in[i] = from_bits(u + i);
    fastattn::cpu::vexp_shifted(V::load(in)).store(got);
    fastattn::cpu::vexp(V::load(in)).store(want);
    for (int i = 0; i < W; ++i) {
      const bool same = std::isnan(in[i]) ? std::isnan(got[i]) : bits(got[i]) == bits(want[i]);
      if (!same) fail("vexp_shifted", bits(in[i]), bits(got[i]), bits(want[i]));
    }
  };
  for (uint64_t u = 0x80000000u; u + W <= 0x100000000u; u += 61 * W) check(static_cast<uint32_t>(u));
  for (uint32_t u = bits(-86.0f); u < bits(-88.0f); u += W) check(u);  // around the low cut, all
  for (uint32_t u = 0x80000000u; u < 0x80000000u + 4096 * W; u += W) check(u);  // -0 and tiny
  const uint32_t top = bits(88.0f);
  for (uint32_t u = 0; u + W <= top; u += 97 * W) check(u);
  for (uint32_t u = 0x7F800001u; u < 0x7F800001u + 64 * W; u += W) check(u);  // NaNs
}

int main() {
  check_exp_shifted<4>();
  check_exp_shifted<8>();
  check_exp_shifted<16>();
  check_widening<4>();
  check_widening<8>();
  check_widening<16>();
  check_narrowing<4>();
  check_narrowing<8>();
  check_narrowing<16>();
  if (failures) {
    std::printf("%d mismatches\n", failures);
    return 1;
  }
  std::printf("ok\n");
  return 0;
}
