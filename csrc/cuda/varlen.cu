// fastattn::varlen_attention_fwd / _bwd (CUDA backend): attention over packed sequences of
// different lengths, q (total_q, H, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv), sequence b
// being rows cu_seqlens_q[b] .. cu_seqlens_q[b + 1] (and cu_seqlens_k's for k, v). No kernel of
// its own: attention_kernels.cuh's PACKED instances, each CTA narrowed to its sequence by
// seq_view<true>, on a grid sized by the longest lengths (docs/cuda_attention.md). This file
// checks the arguments and instantiates those launches, compiled beside attention.cu's.
#include "attention_kernels.cuh"

namespace fastattn {
namespace cuda {
namespace {

// cu_seqlens: int32, 1-D, contiguous, on q's device. Its values are the public function's to
// check (reading them here would cost a device-to-host copy); seq_view() keeps bad ones in bounds.
void check_cu_seqlens(const at::Tensor& cu, const char* name, const at::Tensor& q) {
  check_cuda_tensor(cu, name);
  check_device(cu, q, name, "q");
  TORCH_CHECK(cu.scalar_type() == at::kInt, name, " must be int32, got ", cu.scalar_type(),
              " (shape ", cu.sizes(), ")");
  TORCH_CHECK(cu.dim() == 1 && cu.size(0) >= 1, name, " must be 1-D (batch + 1,), got shape ",
              cu.sizes());
  check_contiguous(cu, name);
}

AttnParams make_varlen_params(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                              const at::Tensor& cu_q, const at::Tensor& cu_k, int64_t max_q,
                              int64_t max_k, double scale, bool bottom_right, int64_t left,
                              int64_t right, double dropout_p, int64_t seed) {
  check_qkv(q, "q", q, /*packed=*/true);
  check_qkv(k, "k", q, /*packed=*/true);
  check_qkv(v, "v", q, /*packed=*/true);
  const int64_t total_q = q.size(0), total_k = k.size(0);
  TORCH_CHECK(k.size(2) == q.size(2), "q and k head dims differ: q ", q.sizes(), ", k ",
              k.sizes());
  TORCH_CHECK(v.size(0) == total_k && v.size(1) == k.size(1), "v must have shape (", total_k,
              ", ", k.size(1), ", Dv) for k of shape ", k.sizes(), ", got ", v.sizes());
  check_cu_seqlens(cu_q, "cu_seqlens_q", q);
  check_cu_seqlens(cu_k, "cu_seqlens_k", q);
  TORCH_CHECK(cu_k.size(0) == cu_q.size(0), "cu_seqlens_q ", cu_q.sizes(), " and cu_seqlens_k ",
              cu_k.sizes(), " must both be (batch + 1,)");
  TORCH_CHECK(max_q >= 0 && max_k >= 0 && max_q <= kMaxSeqLen && max_k <= kMaxSeqLen,
              "max_seqlen_q and max_seqlen_k must be in [0, ", kMaxSeqLen, "], got ", max_q,
              " and ", max_k);
  TORCH_CHECK(total_q <= 0x7fffffff && total_k <= 0x7fffffff,
              "total lengths must fit in int32 (cu_seqlens is int32), got q ", q.sizes(), ", k ",
              k.sizes());
  TORCH_CHECK(left >= 0 && right >= 0, "left and right must be >= 0, got ", left, ", ", right);

  AttnParams p{};
  set_heads(p, q.size(1), k.size(1), q.size(2), v.size(2));
  set_scalars(p, scale, dropout_p, seed);
  const Rows qs = rows_of(q), ks = rows_of(k), vs = rows_of(v);
  p.q = reinterpret_cast<const uint16_t*>(q.const_data_ptr());
  p.k = reinterpret_cast<const uint16_t*>(k.const_data_ptr());
  p.v = reinterpret_cast<const uint16_t*>(v.const_data_ptr());
  p.q_sb = qs.sb, p.q_sh = qs.sh, p.q_sl = qs.sl;
  p.k_sb = ks.sb, p.k_sh = ks.sh, p.k_sl = ks.sl;
  p.v_sb = vs.sb, p.v_sh = vs.sh, p.v_sl = vs.sl;
  p.vec_q = is_aligned(p.q, 16) && strides_multiple_of({p.q_sh, p.q_sl}, 8);
  p.vec_k = is_aligned(p.k, 16) && strides_multiple_of({p.k_sh, p.k_sl}, 8);
  p.vec_v = is_aligned(p.v, 16) && strides_multiple_of({p.v_sh, p.v_sl}, 8);
  p.mask_kind = MaskKind::kNone;
  p.B = static_cast<int>(cu_q.size(0) - 1);
  p.Lq = static_cast<int>(max_q), p.Lk = static_cast<int>(max_k);
  p.cu_q = cu_q.const_data_ptr<int>();
  p.cu_k = cu_k.const_data_ptr<int>();
  p.total_q = static_cast<int>(total_q), p.total_k = static_cast<int>(total_k);
  p.bottom_right = bottom_right;
  const int64_t lim = max_q + max_k + 1;
  p.left = static_cast<int>(std::min(left, lim));
  p.right = static_cast<int>(std::min(right, lim));
  return p;
}

std::tuple<at::Tensor, at::Tensor> varlen_attention_fwd_cuda(
    const at::Tensor& q, const at::Tensor& k, const at::Tensor& v, const at::Tensor& cu_q,
    const at::Tensor& cu_k, int64_t max_q, int64_t max_k, double scale, bool bottom_right,
    int64_t left, int64_t right, double dropout_p, int64_t seed) {
  AttnParams p = make_varlen_params(q, k, v, cu_q, cu_k, max_q, max_k, scale, bottom_right, left,
                                    right, dropout_p, seed);
  const DeviceGuard guard(q.device());
  return forward</*PACKED=*/true>(p, q, empty_tensor({q.size(0), p.H, p.Dv}, q.options()),
                 empty_tensor({p.H, q.size(0)}, q.options().dtype(at::kFloat)));
}

std::tuple<at::Tensor, at::Tensor, at::Tensor> varlen_attention_bwd_cuda(
    const at::Tensor& dout, const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
    const at::Tensor& out, const at::Tensor& lse, const at::Tensor& cu_q, const at::Tensor& cu_k,
    int64_t max_q, int64_t max_k, double scale, bool bottom_right, int64_t left, int64_t right,
    double dropout_p, int64_t seed) {
  AttnParams p = make_varlen_params(q, k, v, cu_q, cu_k, max_q, max_k, scale, bottom_right, left,
                                    right, dropout_p, seed);
  const DeviceGuard guard(q.device());
  return backward</*PACKED=*/true>(p, dout, q, k, v, out, lse);
}

}  // namespace
}  // namespace cuda

FASTATTN_CUDA_IMPL_FWD_BWD(varlen_attention)

}  // namespace fastattn
