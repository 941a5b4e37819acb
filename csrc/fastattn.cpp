// The schemas of every fastattn op. csrc/cpu/<op>.cpp and csrc/cuda/<op>.cu register their
// implementations with TORCH_LIBRARY_IMPL(fastattn, CPU / CUDA, m); Python adds the fake (meta)
// implementations and autograd (fastattn/ops). The Triton backend registers ops of the same
// schemas under the names triton_<op> from Python, so one fake impl and one autograd formula
// serve every compiled backend.
//
// Conventions shared by all schemas:
// - statistics (mean, rstd, lse) are float32; "not needed" outputs are empty tensors (numel 0);
// - 2-D row inputs are (rows, N) with a contiguous last dimension and any row stride;
// - attention bands follow docs/numerics.md: key j is visible to query i iff
//   i + offset - left <= j <= i + offset + right.
#include <torch/library.h>

TORCH_LIBRARY(fastattn, m) {
  // x: (M, N). With residual, h = x + residual is normalized and returned; otherwise h is empty.
  // rms=true is RMSNorm (no centering): mean is returned empty.
  m.def(
      "layer_norm_fwd(Tensor x, Tensor? residual, Tensor? weight, Tensor? bias, float eps, "
      "bool rms) -> (Tensor y, Tensor h, Tensor mean, Tensor rstd)");
  // h: the normalized input (x, or x + residual); dh: gradient flowing into the returned h
  // (added to dx). output_mask = [want dweight, want dbias]; unwanted gradients come back empty.
  m.def(
      "layer_norm_bwd(Tensor dy, Tensor? dh, Tensor h, Tensor? weight, Tensor mean, Tensor rstd, "
      "bool rms, bool[2] output_mask) -> (Tensor dx, Tensor dweight, Tensor dbias)");
  // x: (L0, L1, Lq, Lk); mask: None or a (L0, L1, Lq, Lk) broadcast view (bool True = keep, or
  // float added); y = softmax(scale * x + mask) over the last dim, causal top-left over (Lq, Lk).
  m.def("softmax_fwd(Tensor x, Tensor? mask, float scale, bool is_causal) -> Tensor");
  m.def("softmax_bwd(Tensor dy, Tensor y, float scale) -> Tensor");
  // q (B, H, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv); mask None or a (B, H, Lq, Lk) view.
  m.def(
      "attention_fwd(Tensor q, Tensor k, Tensor v, Tensor? mask, float scale, int offset, "
      "int left, int right, float dropout_p, int seed) -> (Tensor out, Tensor lse)");
  // dmask ((B, H, Lq, Lk), float32; float64 for float64 q) is returned when need_dmask, empty
  // otherwise.
  m.def(
      "attention_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "Tensor? mask, float scale, int offset, int left, int right, float dropout_p, int seed, "
      "bool need_dmask) -> (Tensor dq, Tensor dk, Tensor dv, Tensor dmask)");
  // Forward-mode AD: the tangents tout (B, H, Lq, Dv) in q's dtype and tlse (B, H, Lq) float32
  // of (out, lse) along the tangents tq, tk, tv (shaped like q, k, v) and tmask (a view like
  // mask, of its floating dtype); an absent tangent is zero.
  m.def(
      "attention_jvp(Tensor q, Tensor k, Tensor v, Tensor? mask, Tensor? tq, Tensor? tk, "
      "Tensor? tv, Tensor? tmask, float scale, int offset, int left, int right, float dropout_p, "
      "int seed) -> (Tensor tout, Tensor tlse)");
  // Packed variable-length sequences: q (total_q, H, D), k (total_k, Hkv, D), v (total_k, Hkv,
  // Dv); sequence b is rows cu_seqlens_q[b]..cu_seqlens_q[b+1] (int32, (batch + 1,)). The band of
  // each sequence uses its own lengths: offset Lk_b - Lq_b when bottom_right, else 0; left / right
  // as for attention (unbounded: >= max_seqlen_q + max_seqlen_k). lse is (H, total_q) float32.
  // Dropout: batch row b's stream, counter i * Lk_b + j.
  m.def(
      "varlen_attention_fwd(Tensor q, Tensor k, Tensor v, Tensor cu_seqlens_q, "
      "Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, float scale, bool bottom_right, "
      "int left, int right, float dropout_p, int seed) -> (Tensor out, Tensor lse)");
  m.def(
      "varlen_attention_bwd(Tensor dout, Tensor q, Tensor k, Tensor v, Tensor out, Tensor lse, "
      "Tensor cu_seqlens_q, Tensor cu_seqlens_k, int max_seqlen_q, int max_seqlen_k, float scale, "
      "bool bottom_right, int left, int right, float dropout_p, int seed) "
      "-> (Tensor dq, Tensor dk, Tensor dv)");
  // Paged KV cache: q (B, H, Lq, D); caches (num_blocks, block_size, Hkv, D / Dv); block_table
  // int32 (B, max_blocks); cache_seqlens int32 (B,) keys per sequence. Band as above with
  // Lk = cache_seqlens[b] (unbounded: >= Lq + max_blocks * block_size). lse (B, H, Lq) float32.
  m.def(
      "paged_attention_fwd(Tensor q, Tensor k_cache, Tensor v_cache, Tensor block_table, "
      "Tensor cache_seqlens, float scale, bool bottom_right, int left, int right) "
      "-> (Tensor out, Tensor lse)");
  // x: (M, D); w1: (F, D) or (2F, D) for gated activations; w2: (D2, F). Returns the output and
  // the pre-activation x @ w1^T + b1 (kept for backward, which recomputes the activation).
  m.def(
      "ffn_fwd(Tensor x, Tensor w1, Tensor? b1, Tensor w2, Tensor? b2, str activation) "
      "-> (Tensor out, Tensor pre)");
  // output_mask = [want db1, want db2].
  m.def(
      "ffn_bwd(Tensor dout, Tensor x, Tensor w1, Tensor w2, Tensor pre, str activation, "
      "bool[2] output_mask) -> (Tensor dx, Tensor dw1, Tensor db1, Tensor dw2, Tensor db2)");
  // Rotary position embedding. x (B, H, L, D), D even; cos, sin (P, D/2) float32 (float64 for
  // float64 x); positions: None (token l uses table row l, P == L) or int64 (B, L) table rows.
  // Pairs (i, i + D/2), or (2i, 2i + 1) when interleaved. inverse rotates by -theta: the
  // backward is this op applied to dy with inverse flipped. y is contiguous (B, H, L, D).
  m.def(
      "rope_fwd(Tensor x, Tensor cos, Tensor sin, Tensor? positions, bool interleaved, "
      "bool inverse) -> Tensor");
}

// The Python module fastattn._C itself (importing it loads this library, and so registers the
// ops above) is defined in csrc/eager.cpp.
