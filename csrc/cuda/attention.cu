// fastattn::attention_fwd / attention_bwd (CUDA backend) on dense batches: q (B, H, Lq, D), k
// (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv), an optional (B, H, Lq, Lk) mask view, the band, dropout.
// The kernels -- math, work split, limits, precision -- are attention_kernels.cuh's; this file
// checks the arguments and instantiates their dense (PACKED = false) launches.
#include "attention_kernels.cuh"

namespace fastattn {
namespace cuda {
namespace {

// Validates q, k, v, mask and the scalars; fills the shared fields of AttnParams.
AttnParams make_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                       const std::optional<at::Tensor>& mask, double scale, int64_t offset,
                       int64_t left, int64_t right, double dropout_p, int64_t seed) {
  check_qkv(q, "q", q);
  check_qkv(k, "k", q);
  check_qkv(v, "v", q);
  const int64_t B = q.size(0), H = q.size(1), Lq = q.size(2), D = q.size(3);
  const int64_t Hkv = k.size(1), Lk = k.size(2), Dv = v.size(3);
  TORCH_CHECK(k.size(0) == B && k.size(3) == D, "k must have shape (", B, ", Hkv, Lk, ", D,
              ") for q of shape ", q.sizes(), ", got ", k.sizes());
  TORCH_CHECK(v.size(0) == B && v.size(1) == Hkv && v.size(2) == Lk, "v must have shape (", B,
              ", ", Hkv, ", ", Lk, ", Dv) for k of shape ", k.sizes(), ", got ", v.sizes());
  TORCH_CHECK(Lq <= kMaxSeqLen && Lk <= kMaxSeqLen, "sequence lengths up to ", kMaxSeqLen,
              " are supported, got Lq = ", Lq, ", Lk = ", Lk);
  TORCH_CHECK(B <= 0x7fffffff && H <= 0x7fffffff, "batch and heads must fit in int32, got ",
              q.sizes());

  AttnParams p{};
  set_heads(p, H, Hkv, D, Dv);
  set_scalars(p, scale, dropout_p, seed);
  p.q = reinterpret_cast<const uint16_t*>(q.const_data_ptr());
  p.k = reinterpret_cast<const uint16_t*>(k.const_data_ptr());
  p.v = reinterpret_cast<const uint16_t*>(v.const_data_ptr());
  p.q_sb = q.stride(0), p.q_sh = q.stride(1), p.q_sl = q.stride(2);
  p.k_sb = k.stride(0), p.k_sh = k.stride(1), p.k_sl = k.stride(2);
  p.v_sb = v.stride(0), p.v_sh = v.stride(1), p.v_sl = v.stride(2);
  p.vec_q = is_aligned(p.q, 16) && strides_multiple_of({p.q_sb, p.q_sh, p.q_sl}, 8);
  p.vec_k = is_aligned(p.k, 16) && strides_multiple_of({p.k_sb, p.k_sh, p.k_sl}, 8);
  p.vec_v = is_aligned(p.v, 16) && strides_multiple_of({p.v_sb, p.v_sh, p.v_sl}, 8);

  p.mask_kind = mask_kind_of(mask);
  if (mask.has_value()) {
    check_cuda_tensor(*mask, "mask");
    check_device(*mask, q, "mask", "q");
    TORCH_CHECK(mask->dim() == 4, "mask must be a 4-D (B, H, Lq, Lk) view, got shape ",
                mask->sizes());
    check_shape(*mask, {B, H, Lq, Lk}, "mask");
    p.mask = mask->const_data_ptr();
    p.m_sb = mask->stride(0), p.m_sh = mask->stride(1);
    p.m_sl = mask->stride(2), p.m_sk = mask->stride(3);
  }

  p.B = static_cast<int>(B);
  p.Lq = static_cast<int>(Lq), p.Lk = static_cast<int>(Lk);
  // The band; a bound past +-(Lq + Lk) is equivalent to +-(Lq + Lk + 1), which fits in int32.
  const int64_t lim = Lq + Lk + 1;
  p.band_lo = static_cast<int>(std::clamp<int64_t>(offset - left, -lim, lim));
  p.band_hi = static_cast<int>(std::clamp<int64_t>(offset + right, -lim, lim));
  return p;
}

std::tuple<at::Tensor, at::Tensor> attention_fwd_cuda(const at::Tensor& q, const at::Tensor& k,
                                                      const at::Tensor& v,
                                                      const std::optional<at::Tensor>& mask,
                                                      double scale, int64_t offset, int64_t left,
                                                      int64_t right, double dropout_p,
                                                      int64_t seed) {
  AttnParams p = make_params(q, k, v, mask, scale, offset, left, right, dropout_p, seed);
  const DeviceGuard guard(q.device());
  return forward</*PACKED=*/false>(p, q, empty_tensor({p.B, p.H, p.Lq, p.Dv}, q.options()),
                 empty_tensor({p.B, p.H, p.Lq}, q.options().dtype(at::kFloat)));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor, at::Tensor> attention_bwd_cuda(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const std::optional<at::Tensor>& mask,
    double scale, int64_t offset, int64_t left, int64_t right, double dropout_p, int64_t seed,
    bool need_dmask) {
  AttnParams p = make_params(q, k, v, mask, scale, offset, left, right, dropout_p, seed);
  const DeviceGuard guard(q.device());
  // Not asked for: an empty tensor of q's dtype, as the op's fake implementation returns.
  at::Tensor dmask =
      need_dmask ? empty_tensor({p.B, p.H, p.Lq, p.Lk}, q.options().dtype(at::kFloat)).zero_()
                 : empty_tensor({0}, q.options());
  p.dmask = need_dmask && dmask.numel() > 0 ? dmask.data_ptr<float>() : nullptr;
  auto [dq, dk, dv] = backward</*PACKED=*/false>(p, dout, q, k, v, out, lse);
  return {dq, dk, dv, dmask};
}

}  // namespace
}  // namespace cuda

FASTATTN_CUDA_IMPL_FWD_BWD(attention)

}  // namespace fastattn
