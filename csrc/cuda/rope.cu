// Rotary position embedding (RoPE), CUDA backend: fastattn::rope_fwd (its backward is the same op
// with inverse = true).
//
// Math, per token at table row p and pair i (D = 2 * half; c = cos[p, i], s = sin[p, i]; float32
// arithmetic whatever the storage dtype):
//   pairs      rotate_half (GPT-NeoX / HF LLaMA): (a, b) = (x[i], x[i + half])
//              interleaved (GPT-J):               (a, b) = (x[2i], x[2i + 1])
//   forward    y_a = a * c - b * s,  y_b = b * c + a * s
//   inverse    the rotation by -theta (s negated): the gradient of the forward
// Token (b, l) uses table row l, or positions[b, l] when positions are given. A position outside
// [0, P) is not checked on the host (that would synchronize): the token's output is NaN and no
// memory outside the table is read.
//
// Work split: one thread per chunk of NP consecutive pairs of one (b, h, l) row, in a grid-stride
// loop over the flattened (b, h, l, chunk) index, chunks fastest, so for a contiguous x
// consecutive threads touch consecutive memory. Vector path (NP = 16 bytes of x; half a vector's
// pairs for interleaved) when half is a multiple of the chunk and x, y and the strides are
// 16-byte aligned; otherwise one pair per thread with scalar loads. The table (float32, small) is
// read through the read-only cache. Memory bound: one read of x, one write of y.
#include "fastattn/cuda_helpers.cuh"  // first: it prepares the c10/cuda includes

#include "fastattn/common.h"

namespace fastattn {
namespace cuda {
namespace {

using namespace ::fastattn::cuda_helpers;

constexpr int kThreads = 256;

struct RopeParams {
  const void* x;
  void* y;
  const float* cos;
  const float* sin;
  const int64_t* pos;     // nullptr: token l uses table row l
  int64_t H, L, half, P;
  int64_t sxb, sxh, sxl;  // x's leading strides (the last one is 1)
  int64_t spb, spl;       // positions' strides
  int64_t total;          // B * H * L * (half / NP) chunks
  float sign;             // +1: rotate by theta; -1: by -theta (inverse)
};

// NP pairs per thread. kVector: x / y moved with 16-byte (or 2 * NP-element) vector accesses.
template <typename T, int NP, bool kInterleaved, bool kVector>
__global__ void __launch_bounds__(kThreads) rope_kernel(RopeParams p) {
  const int64_t chunks = p.half / NP;
  const int64_t D = 2 * p.half;
  for (int64_t e = int64_t{blockIdx.x} * kThreads + threadIdx.x; e < p.total;
       e += int64_t{gridDim.x} * kThreads) {
    const int64_t chunk = e % chunks;
    int64_t t = e / chunks;
    const int64_t l = t % p.L;
    t /= p.L;
    const int64_t h = t % p.H;
    const int64_t b = t / p.H;
    int64_t row = l;
    bool valid = true;
    if (p.pos != nullptr) {
      row = __ldg(p.pos + b * p.spb + l * p.spl);
      valid = row >= 0 && row < p.P;
      if (!valid) row = 0;
    }
    const int64_t i0 = chunk * NP;
    const T* x = static_cast<const T*>(p.x) + b * p.sxb + h * p.sxh + l * p.sxl;
    T* y = static_cast<T*>(p.y) + ((b * p.H + h) * p.L + l) * D;

    float a[NP], bv[NP];
    if constexpr (kInterleaved) {
      if constexpr (kVector) {
        const Vec<T, 2 * NP> v = load_vec<T, 2 * NP>(x + 2 * i0);
#pragma unroll
        for (int k = 0; k < NP; ++k) {
          a[k] = to_float(v.v[2 * k]);
          bv[k] = to_float(v.v[2 * k + 1]);
        }
      } else {
#pragma unroll
        for (int k = 0; k < NP; ++k) {
          a[k] = to_float(x[2 * (i0 + k)]);
          bv[k] = to_float(x[2 * (i0 + k) + 1]);
        }
      }
    } else {
      if constexpr (kVector) {
        const Vec<T, NP> v1 = load_vec<T, NP>(x + i0);
        const Vec<T, NP> v2 = load_vec<T, NP>(x + p.half + i0);
#pragma unroll
        for (int k = 0; k < NP; ++k) {
          a[k] = to_float(v1.v[k]);
          bv[k] = to_float(v2.v[k]);
        }
      } else {
#pragma unroll
        for (int k = 0; k < NP; ++k) {
          a[k] = to_float(x[i0 + k]);
          bv[k] = to_float(x[p.half + i0 + k]);
        }
      }
    }

    const float* c_row = p.cos + row * p.half + i0;
    const float* s_row = p.sin + row * p.half + i0;
    float ya[NP], yb[NP];
#pragma unroll
    for (int k = 0; k < NP; ++k) {
      const float c = valid ? __ldg(c_row + k) : NAN;
      const float s = p.sign * __ldg(s_row + k);
      ya[k] = a[k] * c - bv[k] * s;
      yb[k] = bv[k] * c + a[k] * s;
    }

    if constexpr (kInterleaved) {
      if constexpr (kVector) {
        Vec<T, 2 * NP> w;
#pragma unroll
        for (int k = 0; k < NP; ++k) {
          w.v[2 * k] = from_float<T>(ya[k]);
          w.v[2 * k + 1] = from_float<T>(yb[k]);
        }
        store_vec<T, 2 * NP>(y + 2 * i0, w);
      } else {
#pragma unroll
        for (int k = 0; k < NP; ++k) {
          y[2 * (i0 + k)] = from_float<T>(ya[k]);
          y[2 * (i0 + k) + 1] = from_float<T>(yb[k]);
        }
      }
    } else {
      if constexpr (kVector) {
        Vec<T, NP> w1, w2;
#pragma unroll
        for (int k = 0; k < NP; ++k) {
          w1.v[k] = from_float<T>(ya[k]);
          w2.v[k] = from_float<T>(yb[k]);
        }
        store_vec<T, NP>(y + i0, w1);
        store_vec<T, NP>(y + p.half + i0, w2);
      } else {
#pragma unroll
        for (int k = 0; k < NP; ++k) {
          y[i0 + k] = from_float<T>(ya[k]);
          y[p.half + i0 + k] = from_float<T>(yb[k]);
        }
      }
    }
  }
}

template <typename T, int NP, bool kInterleaved, bool kVector>
void launch(RopeParams p, cudaStream_t stream) {
  p.total = p.total / NP;
  const unsigned blocks = grid_1d(ceil_div(p.total, kThreads));
  launch_kernel(rope_kernel<T, NP, kInterleaved, kVector>, blocks, kThreads, 0, stream, p);
}

// Picks the widest chunk the layout allows: 16 bytes of x per vector access.
template <typename T>
void dispatch(RopeParams p, bool interleaved, bool aligned, cudaStream_t stream) {
  constexpr int kV = kVec16<T>;  // elements per 16-byte vector
  if (interleaved) {
    constexpr int NP = kV / 2;  // pairs per 16-byte vector
    if (aligned && p.half % NP == 0) return launch<T, NP, true, true>(p, stream);
    return launch<T, 1, true, false>(p, stream);
  }
  if (aligned && p.half % kV == 0) return launch<T, kV, false, true>(p, stream);
  return launch<T, 1, false, false>(p, stream);
}

at::Tensor rope_fwd_cuda(const at::Tensor& x, const at::Tensor& cos, const at::Tensor& sin,
                         const std::optional<at::Tensor>& positions, bool interleaved,
                         bool inverse) {
  check_cuda_tensor(x, "x");
  TORCH_CHECK(x.dim() == 4, "x must be 4-D (B, H, L, D), got shape ", x.sizes());
  check_float_dtype(x, "x", /*allow_double=*/false);
  const int64_t B = x.size(0), H = x.size(1), L = x.size(2), D = x.size(3);
  TORCH_CHECK(D > 0 && D % 2 == 0, "x's last dim (head dim) must be even and positive, got ", D);
  TORCH_CHECK(x.numel() == 0 || x.stride(3) == 1,
              "x must have a contiguous last dimension, got shape ", x.sizes(), " and strides ",
              x.strides());
  for (const auto& [t, name] : {std::pair{&cos, "cos"}, std::pair{&sin, "sin"}}) {
    check_device(*t, x, name, "x");
    check_dtype(*t, at::kFloat, name);
    TORCH_CHECK(t->dim() == 2 && t->size(1) == D / 2, name, " must be (P, D/2) = (P, ", D / 2,
                "), got shape ", t->sizes());
    check_contiguous(*t, name);
  }
  TORCH_CHECK(cos.sizes() == sin.sizes(), "cos and sin must have the same shape, got ",
              cos.sizes(), " and ", sin.sizes());
  if (positions.has_value()) {
    check_device(*positions, x, "positions", "x");
    check_dtype(*positions, at::kLong, "positions");
    check_shape(*positions, {B, L}, "positions");
  } else {
    TORCH_CHECK(cos.size(0) == L, "without positions the tables must have L = ", L,
                " rows, got ", cos.size(0));
  }
  const DeviceGuard guard(x.device());
  at::Tensor y = empty_tensor(x.sizes(), x.options().memory_format(at::MemoryFormat::Contiguous));
  if (y.numel() == 0) return y;

  RopeParams p{};
  p.x = x.data_ptr();
  p.y = y.data_ptr();
  p.cos = cos.data_ptr<float>();
  p.sin = sin.data_ptr<float>();
  p.pos = positions.has_value() ? positions->data_ptr<int64_t>() : nullptr;
  p.H = H;
  p.L = L;
  p.half = D / 2;
  p.P = cos.size(0);
  p.sxb = x.stride(0);
  p.sxh = x.stride(1);
  p.sxl = x.stride(2);
  p.spb = positions.has_value() ? positions->stride(0) : 0;
  p.spl = positions.has_value() ? positions->stride(1) : 0;
  p.total = B * H * L * p.half;  // pairs; launch() divides by the pairs per thread
  p.sign = inverse ? -1.f : 1.f;
  const int64_t V = 16 / static_cast<int64_t>(x.element_size());
  // The vector path needs every row start (and, for rotate_half, the second half) 16-byte
  // aligned: base pointers aligned, leading strides and half multiples of a vector.
  const bool aligned = is_aligned(p.x, 16) && is_aligned(p.y, 16) &&
                       strides_multiple_of({p.sxb, p.sxh, p.sxl, D}, V) &&
                       (interleaved || p.half % V == 0);
  const cudaStream_t stream = current_stream(x.device().index());
  FASTATTN_DISPATCH_FLOAT_HALF_BF16(x.scalar_type(), "rope_fwd_cuda", [&] {
    dispatch<scalar_t>(p, interleaved, aligned, stream);
  });
  return y;
}

}  // namespace
}  // namespace cuda

FASTATTN_CUDA_IMPL_FWD(rope)

}  // namespace fastattn
