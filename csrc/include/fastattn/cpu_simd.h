// SIMD building blocks of the CPU kernels (attention, softmax, ffn), with runtime ISA dispatch.
//
// Why not at::vec: the extension is compiled once with the compiler's baseline flags (no -mavx2),
// and at::vec picks its implementation at compile time (CPU_CAPABILITY macros), so in this
// extension at::vec::Vectorized is the scalar DEFAULT fallback: no AVX2 / AVX-512 instructions and
// a per-lane std::exp. Instead the hot loops here are written once, as templates over a small
// vector type `Vec<A, W>` built on the GCC / Clang vector extension, and instantiated three times:
// for AVX-512 (W = 16 floats), AVX2 + FMA (W = 8) and the baseline ISA (W = 4, SSE2 / NEON). The
// AVX-512 and AVX2 instantiations live in functions marked FASTATTN_TARGET_AVX512 / _AVX2 (GCC's
// target attribute); everything they call is FASTATTN_INLINE (always_inline), so it is compiled
// for that target inside them. cpu_isa() picks the best one the machine supports once per process
// (override: FASTATTN_CPU_ISA=default|avx2|avx512, never above what the CPU has). No translation
// unit is compiled with -mavx*, so the ATen / c10 inline functions emitted by our objects stay
// baseline code and the library loads and runs on any x86-64 machine.
//
// Host code only (C++17, GCC >= 9 or Clang >= 10 on x86-64 for the ISA-specific paths; other
// compilers and architectures get the baseline path).
#pragma once

#include <c10/util/BFloat16.h>
#include <c10/util/Half.h>

#include <algorithm>
#include <cctype>
#include <cmath>
#include <cstdint>
#include <cstdlib>
#include <cstring>
#include <limits>
#include <string>
#include <type_traits>
#include <utility>

#if defined(__GNUC__) || defined(__clang__)
#define FASTATTN_INLINE inline __attribute__((always_inline))
#define FASTATTN_VECTOR_EXTENSIONS 1
#else
#define FASTATTN_INLINE inline
#define FASTATTN_VECTOR_EXTENSIONS 0
#endif

#if FASTATTN_VECTOR_EXTENSIONS && (defined(__x86_64__) || defined(__i386__))
#define FASTATTN_X86_DISPATCH 1
#define FASTATTN_TARGET_AVX2 __attribute__((target("avx2,fma,f16c,popcnt")))
#define FASTATTN_TARGET_AVX512 \
  __attribute__((target("avx512f,avx512vl,avx512bw,avx512dq,avx2,fma,f16c,popcnt")))
#else
#define FASTATTN_X86_DISPATCH 0
#define FASTATTN_TARGET_AVX2
#define FASTATTN_TARGET_AVX512
#endif

namespace fastattn {
namespace cpu {

enum class Isa { kDefault = 0, kAvx2 = 1, kAvx512 = 2 };

inline Isa detect_isa() {
  Isa best = Isa::kDefault;
#if FASTATTN_X86_DISPATCH
  __builtin_cpu_init();
  if (__builtin_cpu_supports("avx2") && __builtin_cpu_supports("fma")) best = Isa::kAvx2;
  if (best == Isa::kAvx2 && __builtin_cpu_supports("avx512f") &&
      __builtin_cpu_supports("avx512vl") && __builtin_cpu_supports("avx512bw") &&
      __builtin_cpu_supports("avx512dq")) {
    best = Isa::kAvx512;
  }
#endif
  if (const char* env = std::getenv("FASTATTN_CPU_ISA")) {
    std::string s(env);
    for (auto& c : s) c = static_cast<char>(std::tolower(static_cast<unsigned char>(c)));
    Isa want = best;
    if (s == "default" || s == "scalar" || s == "baseline") want = Isa::kDefault;
    if (s == "avx2") want = Isa::kAvx2;
    if (s == "avx512") want = Isa::kAvx512;
    best = std::min(best, want);
  }
  return best;
}

// Whether this is an Intel CPU (the cpu attention forward's choice of kernel depends on it).
inline bool intel_cpu() {
#if FASTATTN_X86_DISPATCH
  static const bool intel = (__builtin_cpu_init(), __builtin_cpu_is("intel"));
  return intel;
#else
  return false;
#endif
}

// The ISA the kernels use in this process (detected once).
inline Isa cpu_isa() {
  static const Isa isa = detect_isa();
  return isa;
}

inline const char* isa_name(Isa isa) {
  return isa == Isa::kAvx512 ? "avx512" : isa == Isa::kAvx2 ? "avx2" : "default";
}

// The one ISA trampoline every CPU kernel goes through. A kernel is a struct with
//
//   template <int kBytes> FASTATTN_INLINE static void run(args...);
//
// written once over the vector width kBytes (64: AVX-512, 32: AVX2, 16: the baseline; a kernel
// takes Vec<A, kBytes / sizeof(A)>). isa_dispatch<Kernel>(args...) calls the instantiation
// compiled for the ISA cpu_isa() chose, inside a function carrying that target attribute.
template <class Kernel, class... Args>
FASTATTN_TARGET_AVX512 void isa_avx512(Args&&... args) {
  Kernel::template run<64>(std::forward<Args>(args)...);
}
template <class Kernel, class... Args>
FASTATTN_TARGET_AVX2 void isa_avx2(Args&&... args) {
  Kernel::template run<32>(std::forward<Args>(args)...);
}
template <class Kernel, class... Args>
void isa_default(Args&&... args) {
  Kernel::template run<16>(std::forward<Args>(args)...);
}
template <class Kernel, class... Args>
void isa_dispatch(Args&&... args) {
  switch (cpu_isa()) {
    case Isa::kAvx512: return isa_avx512<Kernel>(std::forward<Args>(args)...);
    case Isa::kAvx2: return isa_avx2<Kernel>(std::forward<Args>(args)...);
    default: return isa_default<Kernel>(std::forward<Args>(args)...);
  }
}

// Vector widths (in floats) of the three instantiations.
constexpr int kWidthAvx512 = 16;
constexpr int kWidthAvx2 = 8;
constexpr int kWidthDefault = 4;

// ---------------------------------------------------------------------------------------------
// Vec<A, W>: W lanes of A (float or double).

#if FASTATTN_VECTOR_EXTENSIONS
template <class A, int W>
struct RawVec;
#define FASTATTN_RAW_VEC(A, W) \
  template <>                  \
  struct RawVec<A, W> {        \
    typedef A type __attribute__((vector_size(sizeof(A) * W))); \
  };
FASTATTN_RAW_VEC(float, 16)
FASTATTN_RAW_VEC(float, 8)
FASTATTN_RAW_VEC(float, 4)
FASTATTN_RAW_VEC(double, 8)
FASTATTN_RAW_VEC(double, 4)
FASTATTN_RAW_VEC(double, 2)
FASTATTN_RAW_VEC(uint16_t, 16)
FASTATTN_RAW_VEC(uint16_t, 8)
FASTATTN_RAW_VEC(uint16_t, 4)
FASTATTN_RAW_VEC(uint32_t, 16)
FASTATTN_RAW_VEC(uint32_t, 8)
FASTATTN_RAW_VEC(uint32_t, 4)
FASTATTN_RAW_VEC(int32_t, 16)
FASTATTN_RAW_VEC(int32_t, 8)
FASTATTN_RAW_VEC(int32_t, 4)
FASTATTN_RAW_VEC(int64_t, 8)
FASTATTN_RAW_VEC(int64_t, 4)
FASTATTN_RAW_VEC(int64_t, 2)
#undef FASTATTN_RAW_VEC

template <class A, int W>
struct Vec {
  static_assert(std::is_same_v<A, float> || std::is_same_v<A, double>);
  using Raw = typename RawVec<A, W>::type;
  using value_type = A;
  static constexpr int size = W;
  Raw v;

  Vec() = default;
  FASTATTN_INLINE Vec(Raw r) : v(r) {}
  FASTATTN_INLINE explicit Vec(A x) : v(x - Raw{}) {}  // x - (+0) keeps -0.0 (x + 0 would not)
  FASTATTN_INLINE static Vec load(const A* p) {
    Vec r;
    std::memcpy(&r.v, p, sizeof(Raw));
    return r;
  }
  FASTATTN_INLINE void store(A* p) const { std::memcpy(p, &v, sizeof(Raw)); }
  FASTATTN_INLINE A operator[](int i) const { return v[i]; }
  FASTATTN_INLINE friend Vec operator+(Vec a, Vec b) { return a.v + b.v; }
  FASTATTN_INLINE friend Vec operator-(Vec a, Vec b) { return a.v - b.v; }
  FASTATTN_INLINE friend Vec operator*(Vec a, Vec b) { return a.v * b.v; }
  FASTATTN_INLINE friend Vec operator/(Vec a, Vec b) { return a.v / b.v; }
  // a * b + c, contracted into one FMA where the target has it.
  FASTATTN_INLINE friend Vec fma(Vec a, Vec b, Vec c) { return a.v * b.v + c.v; }
  FASTATTN_INLINE friend Vec max(Vec a, Vec b) { return a.v > b.v ? a.v : b.v; }
  FASTATTN_INLINE friend Vec min(Vec a, Vec b) { return a.v < b.v ? a.v : b.v; }
  // Lane-wise "c ? a : b" where c is the comparison "x < y" (etc.) of two Vecs.
  FASTATTN_INLINE static Vec select_lt(Vec x, Vec y, Vec a, Vec b) { return x.v < y.v ? a.v : b.v; }
  FASTATTN_INLINE static Vec select_gt(Vec x, Vec y, Vec a, Vec b) { return x.v > y.v ? a.v : b.v; }
  FASTATTN_INLINE static Vec select_nan(Vec x, Vec a, Vec b) { return x.v != x.v ? a.v : b.v; }
  // Lane-wise "x == -inf ? a : b" (NaN never matches).
  FASTATTN_INLINE static Vec select_neg_inf(Vec x, Vec a, Vec b) {
    return x.v == Vec(-std::numeric_limits<A>::infinity()).v ? a.v : b.v;
  }
  // Lane-wise "x is -0.0 (that bit pattern exactly) ? a : b": the attention kernels mark masked-out
  // probabilities and score gradients as -0.0 (see is_neg_zero). NaN never matches.
  FASTATTN_INLINE static Vec select_neg_zero(Vec x, Vec a, Vec b) {
    using I = std::conditional_t<sizeof(A) == 4, int32_t, int64_t>;
    using RawI = typename RawVec<I, W>::type;
    RawI bits;
    std::memcpy(&bits, &x.v, sizeof(bits));
    return bits == (RawI{} + std::numeric_limits<I>::min()) ? a.v : b.v;
  }
  // Horizontal sum and max: the halves of the vector combined lane by lane, then the halves of
  // that, down to four lanes (two for double), then those two by two: log2(W) steps, where a
  // chain over the lanes took W - 1 dependent scalar steps with a lane extract each (12% of the
  // D32 causal forward at 64 x 128 keys, which reduces every row of every tile). The sum's
  // rounding follows that tree; max_lane, as max, takes a lane that compares greater (a NaN lane
  // may or may not win: callers that care test for NaN themselves).
  FASTATTN_INLINE A sum() const { return fold<W, Add>(v); }
  FASTATTN_INLINE A max_lane() const { return fold<W, Max>(v); }

 private:
  struct Add {
    template <class T>
    FASTATTN_INLINE static T apply(T a, T b) { return a + b; }
  };
  struct Max {
    template <class T>
    FASTATTN_INLINE static T apply(T a, T b) { return a > b ? a : b; }
  };
  template <int N, class Op, class R>
  FASTATTN_INLINE static A fold(R r) {
    if constexpr (N > 16 / static_cast<int>(sizeof(A))) {
      using H = typename RawVec<A, N / 2>::type;
      H lo, hi;
      std::memcpy(&lo, &r, sizeof(H));
      std::memcpy(&hi, reinterpret_cast<const char*>(&r) + sizeof(H), sizeof(H));
      return fold<N / 2, Op>(Op::apply(lo, hi));
    } else if constexpr (N == 4) {
      return Op::apply(Op::apply(A(r[0]), A(r[2])), Op::apply(A(r[1]), A(r[3])));
    } else {
      return Op::apply(A(r[0]), A(r[1]));
    }
  }
};
#else
template <class A, int W>
struct Vec {
  using value_type = A;
  static constexpr int size = W;
  A v[W];
  Vec() = default;
  explicit Vec(A x) { for (int i = 0; i < W; ++i) v[i] = x; }
  static Vec load(const A* p) { Vec r; std::memcpy(r.v, p, sizeof(r.v)); return r; }
  void store(A* p) const { std::memcpy(p, v, sizeof(v)); }
  A operator[](int i) const { return v[i]; }
#define FASTATTN_LANEWISE(expr) Vec r; for (int i = 0; i < W; ++i) r.v[i] = (expr); return r;
  friend Vec operator+(Vec a, Vec b) { FASTATTN_LANEWISE(a.v[i] + b.v[i]) }
  friend Vec operator-(Vec a, Vec b) { FASTATTN_LANEWISE(a.v[i] - b.v[i]) }
  friend Vec operator*(Vec a, Vec b) { FASTATTN_LANEWISE(a.v[i] * b.v[i]) }
  friend Vec operator/(Vec a, Vec b) { FASTATTN_LANEWISE(a.v[i] / b.v[i]) }
  friend Vec fma(Vec a, Vec b, Vec c) { FASTATTN_LANEWISE(a.v[i] * b.v[i] + c.v[i]) }
  friend Vec max(Vec a, Vec b) { FASTATTN_LANEWISE(a.v[i] > b.v[i] ? a.v[i] : b.v[i]) }
  friend Vec min(Vec a, Vec b) { FASTATTN_LANEWISE(a.v[i] < b.v[i] ? a.v[i] : b.v[i]) }
  static Vec select_lt(Vec x, Vec y, Vec a, Vec b) { FASTATTN_LANEWISE(x.v[i] < y.v[i] ? a.v[i] : b.v[i]) }
  static Vec select_gt(Vec x, Vec y, Vec a, Vec b) { FASTATTN_LANEWISE(x.v[i] > y.v[i] ? a.v[i] : b.v[i]) }
  static Vec select_nan(Vec x, Vec a, Vec b) { FASTATTN_LANEWISE(x.v[i] != x.v[i] ? a.v[i] : b.v[i]) }
  static Vec select_neg_inf(Vec x, Vec a, Vec b) {
    FASTATTN_LANEWISE(x.v[i] == -std::numeric_limits<A>::infinity() ? a.v[i] : b.v[i])
  }
  static Vec select_neg_zero(Vec x, Vec a, Vec b) {
    FASTATTN_LANEWISE(x.v[i] == A(0) && std::signbit(x.v[i]) ? a.v[i] : b.v[i])
  }
#undef FASTATTN_LANEWISE
  A sum() const { A s = v[0]; for (int i = 1; i < W; ++i) s += v[i]; return s; }
  A max_lane() const { A s = v[0]; for (int i = 1; i < W; ++i) s = v[i] > s ? v[i] : s; return s; }
};
#endif

// vexp's polynomial and scaling for xc in [-86.95, 88.38] (a NaN stays NaN on the vector path).
template <int W>
FASTATTN_INLINE Vec<float, W> vexp_clamped(Vec<float, W> xc) {
  using V = Vec<float, W>;
  const V magic(12582912.0f);  // 1.5 * 2^23: adding it rounds to an integer in the low bits
  const V t = fma(xc, V(1.44269504088896341f), magic);
  const V n = t - magic;
  V r = fma(n, V(-0.693359375f), xc);
  r = fma(n, V(2.12194440e-4f), r);
  V p(1.9875691500e-4f);
  p = fma(p, r, V(1.3981999507e-3f));
  p = fma(p, r, V(8.3334519073e-3f));
  p = fma(p, r, V(4.1665795894e-2f));
  p = fma(p, r, V(1.6666665459e-1f));
  p = fma(p, r, V(5.0000001201e-1f));
  p = fma(p * r, r, r + V(1.0f));
#if FASTATTN_VECTOR_EXTENSIONS
  typedef int32_t RawI __attribute__((vector_size(sizeof(float) * W)));
  RawI bits;
  std::memcpy(&bits, &t.v, sizeof(bits));
  bits = (bits - 0x4B400000 + 127) << 23;
  V scale;
  std::memcpy(&scale.v, &bits, sizeof(bits));
  return p * scale;
#else
  V res;
  for (int i = 0; i < W; ++i) res.v[i] = std::ldexp(p.v[i], static_cast<int>(n.v[i]));
  return res;
#endif
}

// exp, lane-wise. float: Cephes' expf (range reduction by ln 2, degree-6 polynomial, about 1 ulp
// on the normal range); exp(x) = 0 exactly for x < -86.95 (so -inf gives 0), +inf above
// ln(FLT_MAX), NaN stays NaN. double: std::exp per lane (the float64 path is for gradcheck).
// The low cut is 2^-125.4, not ln(FLT_MIN): clamped there, the scale 2^n stays at 2^-125 and
// p * 2^n stays normal. At ln(FLT_MIN) it took n = -126 and made a subnormal product for every
// -inf score (a masked-out key), which x86 finishes in microcode (an "assist", ~100+ cycles a
// vector), before the select threw it away: a (1, 1, 2048, 2048) mask with a fifth of its
// entries out cost the bf16 attention backward ~6 ms more than one with none (AVX2, 2 threads).
// Values in [2^-126, 2^-125.4) become 0: 1.2e-38 .. 1.8e-38, far under any tolerance here.
template <int W>
FASTATTN_INLINE Vec<float, W> vexp(Vec<float, W> x) {
  using V = Vec<float, W>;
  const V lo(-86.95f), hi(88.37626266f);
  V res = vexp_clamped(min(max(x, lo), hi));
  res = V::select_lt(x, lo, V(0.0f), res);
  res = V::select_gt(x, hi, V(std::numeric_limits<float>::infinity()), res);
  return V::select_nan(x, x, res);
}

// vexp for the softmax's x = score - (a maximum over the scores): x <= 0 up to rounding, or NaN,
// never near overflow. Same values as vexp for x <= 88.37 (above it: about FLT_MAX, not inf), in
// two fewer compare-and-selects: the clamp is ordered so that a NaN passes through it (max(a, b)
// = a > b ? a : b keeps b when either is NaN) and on through the arithmetic, instead of being
// restored at the end. About 1/8 of the exp's instructions, which are ~1/6 of the attention
// forward's time (AVX-512, float32).
template <int W>
FASTATTN_INLINE Vec<float, W> vexp_shifted(Vec<float, W> x) {
#if FASTATTN_VECTOR_EXTENSIONS
  using V = Vec<float, W>;
  const V lo(-86.95f), hi(88.37626266f);
  const V res = vexp_clamped(min(hi, max(lo, x)));
  return V::select_lt(x, lo, V(0.0f), res);
#else
  return vexp(x);
#endif
}

template <int W>
FASTATTN_INLINE Vec<double, W> vexp(Vec<double, W> x) {
  Vec<double, W> r;
  for (int i = 0; i < W; ++i) r.v[i] = std::exp(x.v[i]);
  return r;
}

template <int W>
FASTATTN_INLINE Vec<double, W> vexp_shifted(Vec<double, W> x) {
  return vexp(x);
}

// Scalar exp matching vexp's float results (used for row tails and scalars).
FASTATTN_INLINE float sexp(float x) {
  Vec<float, 4> v(x);
  return vexp(v)[0];
}
FASTATTN_INLINE double sexp(double x) { return std::exp(x); }

// sum_each(x): lane c of the result is the sum of the lanes of x[c], for the W vectors x[0, W)
// (clobbered): W horizontal sums, transposed into one vector, in W - 1 steps of two shuffles and
// an add, where a transpose through memory takes W^2 scalar moves. A step at S: each vector holds
// W / S partial sums of S lanes; two of them become one holding 2W / S sums of S / 2 lanes (their
// first half-blocks plus their second half-blocks), in key order.
namespace detail {
constexpr int fold_lane(int W, int S, bool second, int o) {
  const int half = S / 2, m = W / S, key = o / half;
  return (key < m ? 0 : W) + (key % m) * S + o % half + (second ? half : 0);
}
#if FASTATTN_VECTOR_EXTENSIONS
template <int W, int S, bool kSecond, class Raw, size_t... O>
FASTATTN_INLINE Raw fold_half(Raw a, Raw b, std::index_sequence<O...>) {
#if defined(__clang__)
  return __builtin_shufflevector(a, b, fold_lane(W, S, kSecond, O)...);
#else
  using I = std::conditional_t<sizeof(a[0]) == 4, int32_t, int64_t>;
  typedef I Mask __attribute__((vector_size(sizeof(Raw))));
  return __builtin_shuffle(a, b, Mask{fold_lane(W, S, kSecond, O)...});
#endif
}

template <int S, class A, int W>
FASTATTN_INLINE void fold_level(Vec<A, W>* x) {
  constexpr auto lanes = std::make_index_sequence<W>{};
  for (int i = 0; i < S / 2; ++i) {
    x[i] = Vec<A, W>(fold_half<W, S, false>(x[2 * i].v, x[2 * i + 1].v, lanes) +
                     fold_half<W, S, true>(x[2 * i].v, x[2 * i + 1].v, lanes));
  }
  if constexpr (S > 2) fold_level<S / 2>(x);
}
#endif
}  // namespace detail

template <class A, int W>
FASTATTN_INLINE Vec<A, W> sum_each(Vec<A, W>* x) {
#if FASTATTN_VECTOR_EXTENSIONS
  detail::fold_level<W>(x);
  return x[0];
#else
  Vec<A, W> r;
  for (int c = 0; c < W; ++c) r.v[c] = x[c].sum();
  return r;
#endif
}

// transpose(x): the W x W matrix held as W vectors x[0, W) (row i = x[i]) replaced by its
// transpose, in log2(W) rounds of W interleaves: x'[2k] = the first halves of x[k] and
// x[k + W/2] interleaved, x'[2k+1] = their second halves (a perfect shuffle of the rows; after
// log2(W) of them, lane c of row r holds what lane r of row c held).
namespace detail {
constexpr int interleave_lane(int W, bool second, int o) {
  return (o % 2 ? W : 0) + o / 2 + (second ? W / 2 : 0);
}
#if FASTATTN_VECTOR_EXTENSIONS
template <int W, bool kSecond, class Raw, size_t... O>
FASTATTN_INLINE Raw interleave_half(Raw a, Raw b, std::index_sequence<O...>) {
#if defined(__clang__)
  return __builtin_shufflevector(a, b, interleave_lane(W, kSecond, O)...);
#else
  using I = std::conditional_t<sizeof(a[0]) == 4, int32_t, int64_t>;
  typedef I Mask __attribute__((vector_size(sizeof(Raw))));
  return __builtin_shuffle(a, b, Mask{interleave_lane(W, kSecond, O)...});
#endif
}
#endif
}  // namespace detail

template <class A, int W>
FASTATTN_INLINE void transpose(Vec<A, W>* x) {
#if FASTATTN_VECTOR_EXTENSIONS
  constexpr auto lanes = std::make_index_sequence<W>{};
  for (int round = 1; round < W; round *= 2) {
    Vec<A, W> y[W];
    for (int k = 0; k < W / 2; ++k) {
      y[2 * k] = Vec<A, W>(detail::interleave_half<W, false>(x[k].v, x[k + W / 2].v, lanes));
      y[2 * k + 1] = Vec<A, W>(detail::interleave_half<W, true>(x[k].v, x[k + W / 2].v, lanes));
    }
    for (int k = 0; k < W; ++k) x[k] = y[k];
  }
#else
  for (int r = 0; r < W; ++r)
    for (int c = r + 1; c < W; ++c) std::swap(x[r].v[c], x[c].v[r]);
#endif
}

// True iff x is -0.0 (the marker of a masked-out probability in the attention kernels; a NaN,
// whatever its sign bit, is not).
template <class A>
FASTATTN_INLINE bool is_neg_zero(A x) {
  return x == A(0) && std::signbit(x);
}

// ---------------------------------------------------------------------------------------------
// Element conversions between storage types and the accumulation type.

template <class A, class T>
FASTATTN_INLINE A to_acc(T x) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    uint32_t u = static_cast<uint32_t>(x.x) << 16;
    float f;
    std::memcpy(&f, &u, 4);
    return static_cast<A>(f);
  } else {
    return static_cast<A>(x);
  }
}

template <class T, class A>
FASTATTN_INLINE T from_acc(A x) {
  if constexpr (std::is_same_v<T, c10::BFloat16>) {
    const float f = static_cast<float>(x);
    uint32_t u;
    std::memcpy(&u, &f, 4);
    c10::BFloat16 r;
    // round to nearest even; NaN stays a (quiet) NaN
    r.x = (f != f) ? uint16_t(0x7FC0) : static_cast<uint16_t>((u + 0x7FFFu + ((u >> 16) & 1u)) >> 16);
    return r;
  } else {
    return static_cast<T>(x);
  }
}

// W bfloat16 values <-> a float vector, with integer vector ops (bfloat16 is the high half of a
// float; stores round to nearest even, NaN -> quiet NaN), as to_acc / from_acc do per element.
#if FASTATTN_VECTOR_EXTENSIONS
template <int W>
FASTATTN_INLINE Vec<float, W> load_bf16(const c10::BFloat16* p) {
  using U16 = typename RawVec<uint16_t, W>::type;
  using U32 = typename RawVec<uint32_t, W>::type;
  U16 h;
  std::memcpy(&h, p, sizeof(h));
  Vec<float, W> r;
#if defined(__clang__) || __GNUC__ >= 12
  if constexpr (W == 8) {
    // Each value into the high half of a zeroed 32-bit lane by one interleave: 2 shuffle uops on
    // AVX2 (vpermq, vpunpcklwd), where GCC 12 splits the widening convert below into 128-bit
    // halves (4 shuffles and a shift). Shuffles bound the bfloat16 passes of layer_norm's rows
    // (AVX2, 256 x 8192, one thread: 1.5 -> 2 cycles a value with the convert).
    const U16 z = {};
    const auto wide = __builtin_shufflevector(z, h, 0, 8, 0, 9, 0, 10, 0, 11, 0, 12, 0, 13, 0, 14,
                                              0, 15);
    static_assert(sizeof(wide) == sizeof(r.v));
    std::memcpy(&r.v, &wide, sizeof(r.v));
    return r;
  }
#endif
  const U32 u = __builtin_convertvector(h, U32) << 16;
  std::memcpy(&r.v, &u, sizeof(u));
  return r;
}

// 2W bfloat16 values as two float vectors, the values at even positions and those at odd ones:
// for order-free reductions (sums), no shuffle at all (one shift, one and), where load_bf16 needs
// two per W values on AVX2.
template <int W>
FASTATTN_INLINE void load_bf16_pairs(const c10::BFloat16* p, Vec<float, W>& even,
                                     Vec<float, W>& odd) {
  using U32 = typename RawVec<uint32_t, W>::type;
  U32 u;
  std::memcpy(&u, p, sizeof(u));
  const U32 e = u << 16, o = u & 0xFFFF0000u;
  std::memcpy(&even.v, &e, sizeof(e));
  std::memcpy(&odd.v, &o, sizeof(o));
}

// x rounded to bfloat16 (nearest even; NaN -> the quiet NaN 0x7FC0), in the high half of each
// 32-bit lane (the low half is not cleared): the one rounding of the vector stores below.
template <int W>
FASTATTN_INLINE typename RawVec<uint32_t, W>::type bf16_high(Vec<float, W> x) {
  using U32 = typename RawVec<uint32_t, W>::type;
  U32 u;
  std::memcpy(&u, &x.v, sizeof(u));
  return x.v != x.v ? U32{} + 0x7FC00000u : u + 0x7FFFu + ((u >> 16) & 1u);
}

// load_bf16_pairs inverted: 2W bfloat16 values from the even-position and odd-position floats, rounded as
// store_bf16 rounds, interleaved by an or (no shuffle). An elementwise pass that loads pairs and
// stores pairs keeps every value in its place without widening or narrowing in order.
template <int W>
FASTATTN_INLINE void store_bf16_pairs(Vec<float, W> even, Vec<float, W> odd, c10::BFloat16* p) {
  using U32 = typename RawVec<uint32_t, W>::type;
  const U32 out = (bf16_high(even) >> 16) | (bf16_high(odd) & 0xFFFF0000u);
  std::memcpy(p, &out, sizeof(out));
}

template <int W>
FASTATTN_INLINE void store_bf16(Vec<float, W> x, c10::BFloat16* p) {
  using U16 = typename RawVec<uint16_t, W>::type;
  const U16 h = __builtin_convertvector(bf16_high(x) >> 16, U16);
  std::memcpy(p, &h, sizeof(h));
}
#else
template <int W>
FASTATTN_INLINE Vec<float, W> load_bf16(const c10::BFloat16* p) {
  Vec<float, W> r;
  for (int i = 0; i < W; ++i) r.v[i] = to_acc<float>(p[i]);
  return r;
}
template <int W>
FASTATTN_INLINE void store_bf16(Vec<float, W> x, c10::BFloat16* p) {
  for (int i = 0; i < W; ++i) p[i] = from_acc<c10::BFloat16>(x.v[i]);
}
template <int W>
FASTATTN_INLINE void load_bf16_pairs(const c10::BFloat16* p, Vec<float, W>& even,
                                     Vec<float, W>& odd) {
  for (int i = 0; i < W; ++i) {
    even.v[i] = to_acc<float>(p[2 * i]);
    odd.v[i] = to_acc<float>(p[2 * i + 1]);
  }
}
template <int W>
FASTATTN_INLINE void store_bf16_pairs(Vec<float, W> even, Vec<float, W> odd, c10::BFloat16* p) {
  for (int i = 0; i < W; ++i) {
    p[2 * i] = from_acc<c10::BFloat16>(even.v[i]);
    p[2 * i + 1] = from_acc<c10::BFloat16>(odd.v[i]);
  }
}
#endif

// W float16 values <-> a float vector with integer and float vector ops (any ISA, any width),
// bit for bit what c10::Half's per-element conversions give (checked for every float16 value and
// every rounding boundary by tests/cpu_simd_test.cpp): widening is exact (a NaN keeps its payload
// and is made quiet); narrowing rounds to nearest even, overflows to inf and makes a NaN 0x7E00
// with its sign (c10's software conversion does; F16C would keep the payload). Flush-to-zero and
// denormals-are-zero do not change the results. (F16C's vcvtph2ps would be one instruction, but
// GCC inlines an intrinsic only into a function whose own target has it, and these are called
// from generic helpers.) Per element, float16 ran at 0.1x torch's layer_norm (AVX2, 2 threads).
#if FASTATTN_VECTOR_EXTENSIONS
template <int W>
FASTATTN_INLINE Vec<float, W> load_half(const c10::Half* p) {
  using U32 = typename RawVec<uint32_t, W>::type;
  using F = typename RawVec<float, W>::type;
  // h << 16 in each lane: what a bfloat16 load of the same bits gives.
  const Vec<float, W> hi = load_bf16<W>(reinterpret_cast<const c10::BFloat16*>(p));
  U32 x;
  std::memcpy(&x, &hi.v, sizeof(x));
  const U32 sign = x & 0x80000000u;
  const U32 em = (x >> 3) & 0x0FFFE000u;  // exponent and mantissa, (h & 0x7FFF) << 13
  const U32 e = em & 0x0F800000u;
  const U32 normal = em + (112u << 23);    // rebias the exponent: 15 -> 127
  // inf; NaN with its payload, made quiet (as c10 does).
  const U32 nan_quiet = (em & 0x007FE000u) != U32{} ? U32{} + 0x00400000u : U32{};
  const U32 special = em | 0x7F800000u | nan_quiet;
  // Subnormal m * 2^-24: (1 + m 2^-10) 2^-14 - 2^-14, two normal floats, exact.
  F sub;
  const U32 shifted = em + (113u << 23);
  std::memcpy(&sub, &shifted, sizeof(sub));
  sub = sub - (F{} + 0x1p-14f);
  U32 sub_bits;
  std::memcpy(&sub_bits, &sub, sizeof(sub_bits));
  const U32 r = (e == U32{} ? sub_bits : (e == (U32{} + 0x0F800000u) ? special : normal)) | sign;
  Vec<float, W> out;
  std::memcpy(&out.v, &r, sizeof(r));
  return out;
}

template <int W>
FASTATTN_INLINE void store_half(Vec<float, W> x, c10::Half* p) {
  using U16 = typename RawVec<uint16_t, W>::type;
  using U32 = typename RawVec<uint32_t, W>::type;
  using F = typename RawVec<float, W>::type;
  U32 u;
  std::memcpy(&u, &x.v, sizeof(u));
  const U32 sign = u & 0x80000000u;
  u ^= sign;
  // |x| >= 2^16 (and inf, NaN): inf, or the quiet NaN 0x7E00.
  const U32 big = u > (U32{} + 0x7F800000u) ? U32{} + 0x7E00u : U32{} + 0x7C00u;
  // |x| < 2^-14: adding 0.5 rounds |x| to a multiple of 2^-24 (the float16 subnormal step), to
  // nearest even; the mantissa bits of the sum are then the float16 bits.
  F f;
  std::memcpy(&f, &u, sizeof(f));
  f = f + 0.5f;
  U32 small;
  std::memcpy(&small, &f, sizeof(small));
  small = small - (126u << 23);
  // Normal: rebias, then drop 13 bits rounding to nearest even (a carry may reach inf).
  const U32 odd = (u >> 13) & 1u;
  const U32 normal = (u + (0u - (112u << 23)) + 0xFFFu + odd) >> 13;
  const U32 r = (u >= (U32{} + (143u << 23)) ? big : (u < (U32{} + (113u << 23)) ? small : normal)) |
                (sign >> 16);
  const U16 h = __builtin_convertvector(r, U16);
  std::memcpy(p, &h, sizeof(h));
}
#endif

// W values of T at p as a vector of A = acc_t<T>, and back (rounded once): in place for
// float / double, vector ops for bfloat16 and float16 (above).
template <class V, class T>
FASTATTN_INLINE V load_as(const T* p) {
  using A = typename V::value_type;
  if constexpr (std::is_same_v<T, A>) {
    return V::load(p);
  } else if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<A, float>) {
    return load_bf16<V::size>(p);
#if FASTATTN_VECTOR_EXTENSIONS
  } else if constexpr (std::is_same_v<T, c10::Half> && std::is_same_v<A, float>) {
    return load_half<V::size>(p);
#endif
  } else {
    A tmp[V::size];
    for (int i = 0; i < V::size; ++i) tmp[i] = to_acc<A>(p[i]);
    return V::load(tmp);
  }
}

template <class V, class T>
FASTATTN_INLINE void store_as(V v, T* p) {
  using A = typename V::value_type;
  if constexpr (std::is_same_v<T, A>) {
    v.store(p);
  } else if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<A, float>) {
    store_bf16<V::size>(v, p);
#if FASTATTN_VECTOR_EXTENSIONS
  } else if constexpr (std::is_same_v<T, c10::Half> && std::is_same_v<A, float>) {
    store_half<V::size>(v, p);
#endif
  } else {
    A tmp[V::size];
    v.store(tmp);
    for (int i = 0; i < V::size; ++i) p[i] = from_acc<T>(tmp[i]);
  }
}

// 2W values of T at p as two vectors of A, and back: for passes where a value's lane does not
// matter as long as every vector op sees the same lanes (elementwise, or sums whose grouping is
// free). bfloat16 goes as load_bf16_pairs / store_bf16_pairs (values at even positions in one,
// odd ones in the other: no shuffles, where load_as needs a widening per W values); other types
// as two consecutive vectors. Stored back by store_pair_as, every value is in its place.
template <class V, class T>
FASTATTN_INLINE void load_pair_as(const T* p, V& first, V& second) {
  if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<typename V::value_type, float>) {
    load_bf16_pairs<V::size>(p, first, second);
  } else {
    first = load_as<V>(p);
    second = load_as<V>(p + V::size);
  }
}

template <class V, class T>
FASTATTN_INLINE void store_pair_as(V first, V second, T* p) {
  if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<typename V::value_type, float>) {
    store_bf16_pairs<V::size>(first, second, p);
  } else {
    store_as(first, p);
    store_as(second, p + V::size);
  }
}

// dst[0, n) = src[0, n) converted to A.
template <class A, class T>
FASTATTN_INLINE void convert_to_acc(const T* src, A* dst, int64_t n) {
  int64_t i = 0;
  if constexpr (std::is_same_v<T, c10::BFloat16> && std::is_same_v<A, float>) {
    for (; i + 16 <= n; i += 16) load_bf16<16>(src + i).store(dst + i);
  }
  for (; i < n; ++i) dst[i] = to_acc<A>(src[i]);
}

// The accumulation type: double for double, float otherwise.
template <class T>
using acc_t = std::conditional_t<std::is_same_v<T, double>, double, float>;

constexpr int64_t round_up(int64_t x, int64_t m) { return (x + m - 1) / m * m; }
constexpr int64_t ceil_div(int64_t x, int64_t m) { return (x + m - 1) / m; }

}  // namespace cpu
}  // namespace fastattn
