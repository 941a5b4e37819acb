// Forward-mode AD (the Jacobian-vector product) of fused attention on CPU (fastattn::attention_jvp).
//
// Math (per batch b and query head h, as csrc/cpu/attention.cpp and docs/numerics.md), with
// tangents Q', K', V' and M' (the float mask's; any of them may be absent = zero):
//
//   S  = scale Q K^T + M,   P = softmax(S) (-inf outside the band / mask),   O = (P * Z) V
//   S' = scale (Q' K^T + Q K'^T) + M'
//   lse' = rowsum(P * S')                                     (the tangent of lse)
//   O'   = ((P * S') * Z) V + (P * Z) V' - lse' * O            = (P * (S' - lse') * Z) V + (P * Z) V'
//
// Algorithm: one streaming pass over the key tiles inside the band per (query block, b, h), as
// the forward: the online softmax (running max m and sum l) carries three accumulators that are
// all rescaled by exp(m_old - m_new) together -- acc_o = sum (p Z) v, acc_t = sum (p s' Z) v +
// (p Z) v' and ls = sum p s' -- and the row ends with O = acc_o / l, lse' = ls / l,
// O' = acc_t / l - lse' O. Per tile: the S GEMM, one S' GEMM per tangent of q and k, the P V,
// (P S') V and P V' GEMMs (absent tangents skip theirs). The forward's O and lse are not read: the
// pass recomputes them, so float64 tangents are exact to float64 rounding and nothing depends on
// the saved float32 lse. Memory: the packed inputs and tangents, O((Lq + Lk) * D), and per
// worker tiles; no Lq x Lk matrix.
//
// Masked-out entries (P = -0.0) contribute nothing to lse' or O', whatever S' holds there (the
// mask's tangent at a -inf entry, a NaN); a row with nothing to attend has O' = 0 and lse' = 0.
// Dropout uses the forward's keep-mask (fastattn/rng.h); lse' is that of the undropped softmax.
//
// Precision: as the forward (float32 accumulation for float32 / float16 / bfloat16, float64 for
// float64); O' is rounded once to the input dtype, lse' is float32.
#include <ATen/Parallel.h>
#include <ATen/core/Tensor.h>
#include <torch/library.h>

#include <algorithm>
#include <atomic>
#include <limits>
#include <vector>

#include "attention_common.h"

namespace fastattn {
namespace {

using namespace cpu_attention;

constexpr int64_t kJvpBlockQ = 64;   // query rows per task
constexpr int64_t kJvpBlockK = 128;  // keys per tile

template <class A>
struct JvpArgs {
  Shape sh;
  Band band;
  Dropout drop;
  cpu::MaskView mask, tmask;  // the mask and its tangent (float, or undefined)
  const A* qp;                // (B * H * Lq + pad, Dp): scale * Q, row-major
  const A* tqp;               // scale * Q', or null
  const A* kt;                // (B * Hkv, nkb, D, BK): transposed key tiles
  const A* tkt;               // K' likewise, or null
  const A* vp;                // (B * Hkv * Lk + pad, Dvp)
  const A* tvp;               // V' likewise, or null
  int64_t Dp, Dvp, BQ, BK, nqb, nkb;
  const int64_t* qb_order;
  const uint8_t *v_bad, *tv_bad;  // nonfinite_tiles of vp / tvp (tile BK), or null
  A* tout;                        // (B, H, Lq, Dv)
  float* tlse;                    // (B, H, Lq)
};

template <class V>
FASTATTN_INLINE void jvp_worker(const JvpArgs<typename V::value_type>& p, std::atomic<int64_t>& next) {
  using A = typename V::value_type;
  constexpr int64_t W = V::size, R = cpu::kGemmRowPad;
  const Shape& sh = p.sh;
  const int64_t D = sh.D, Dv = sh.Dv, Dp = p.Dp, Dvp = p.Dvp, BQ = p.BQ, BK = p.BK;
  const A neg_inf = -std::numeric_limits<A>::infinity();
  const bool has_ts = p.tqp != nullptr || p.tkt != nullptr || p.tmask.defined();
  std::vector<A> sbuf((BQ + R) * BK), tsbuf((BQ + R) * BK);
  std::vector<A> acc_o((BQ + R) * std::max(Dvp, W)), acc_t((BQ + R) * std::max(Dvp, W));
  std::vector<A> m(BQ), l(BQ), ls(BQ), z(p.drop.on ? BK : 0);
  const int64_t ntasks = sh.B * sh.H * p.nqb;
  for (int64_t t; (t = next.fetch_add(1, std::memory_order_relaxed)) < ntasks;) {
    const auto [qb, bh, b, h, bg, i0, nq, stream] = query_task(t, sh, p.qb_order, BQ, p.drop);
    const A* qblk = p.qp + (bh * sh.Lq + i0) * Dp;
    std::fill(m.begin(), m.end(), neg_inf);
    std::fill(l.begin(), l.end(), A(0));
    std::fill(ls.begin(), ls.end(), A(0));
    std::fill(acc_o.begin(), acc_o.end(), A(0));
    std::fill(acc_t.begin(), acc_t.end(), A(0));

    const TileSpan ks = key_tile_span(p.band, i0, nq, sh.Lk, BK);
    for (int64_t kb = ks.first; kb <= ks.last; ++kb) {
      const KeyTile tile = key_tile(p.band, i0, nq, kb, BK, sh.Lk, W);
      const auto [j0, nk, nkp, full] = tile;
      const A* ktile = p.kt + (bg * p.nkb + kb) * D * BK;
      A* s = sbuf.data();
      A* ts = tsbuf.data();
      // S = (scale Q) K^T;  S' = (scale Q') K^T + (scale Q) K'^T
      cpu::gemm<V>(nq, nkp, D, qblk, Dp, ktile, BK, s, BK, false);
      if (p.tqp != nullptr) {
        cpu::gemm<V>(nq, nkp, D, p.tqp + (bh * sh.Lq + i0) * Dp, Dp, ktile, BK, ts, BK, false);
      }
      if (p.tkt != nullptr) {
        cpu::gemm<V>(nq, nkp, D, qblk, Dp, p.tkt + (bg * p.nkb + kb) * D * BK, BK, ts, BK,
                     p.tqp != nullptr);
      }
      if (p.tqp == nullptr && p.tkt == nullptr) std::fill(ts, ts + nq * BK, A(0));
      for (int64_t r = 0; r < nq; ++r) {
        A* sr = s + r * BK;
        A* tr = ts + r * BK;
        const int64_t i = i0 + r;
        if (p.tmask.defined()) {
          cpu::apply_mask_row(tr, nk, p.tmask, p.tmask.offset(b, h, i, j0), p.tmask.stride[3]);
        }
        const A mx = mask_band_max_row<V>(sr, p.mask, p.band, b, h, i, tile);
        A alpha;  // sr = P (unnormalized), -0.0 masked
        if (!online_softmax_row<V>(sr, nk, nkp, mx, m[r], l[r], alpha)) {
          std::fill(sr, sr + nkp, -A(0));  // nothing visible yet: P = -0.0
          std::fill(tr, tr + nkp, -A(0));
          continue;
        }
        if (alpha != A(1)) {
          scale_row<V>(acc_o.data() + r * Dvp, Dvp, alpha);
          scale_row<V>(acc_t.data() + r * Dvp, Dvp, alpha);
          ls[r] *= alpha;
        }
        // tr = P * S' (-0.0 where P is masked, whatever S' holds there)
        V acc(A(0));
        for (int64_t c = 0; c < nkp; c += W) {
          const V pv = V::load(sr + c);
          const V x = V::select_neg_zero(pv, pv, pv * V::load(tr + c));
          x.store(tr + c);
          acc = acc + x;
        }
        if (has_ts) ls[r] += acc.sum();
        if (p.drop.on) {
          dropout_row<A>(z.data(), nk, dropout_row_base(i, sh.Lk) + static_cast<uint32_t>(j0), 1,
                         stream, p.drop.threshold, static_cast<A>(p.drop.inv_keep));
          for (int64_t c = 0; c < nk; ++c) {
            sr[c] *= z[c];
            tr[c] *= z[c];
          }
        }
      }
      const A* vblk = p.vp + (bg * sh.Lk + j0) * Dvp;
      const bool v_careful = flagged(p.v_bad, bg * p.nkb + kb);
      // O += (P Z) V;  O' += (P S' Z) V + (P Z) V'
      gemm_acc<V>(v_careful, nq, Dvp, nk, s, BK, vblk, Dvp, acc_o.data(), Dvp);
      if (has_ts) gemm_acc<V>(v_careful, nq, Dvp, nk, ts, BK, vblk, Dvp, acc_t.data(), Dvp);
      if (p.tvp != nullptr) {
        gemm_acc<V>(flagged(p.tv_bad, bg * p.nkb + kb), nq, Dvp, nk, s, BK,
                    p.tvp + (bg * sh.Lk + j0) * Dvp, Dvp, acc_t.data(), Dvp);
      }
    }

    for (int64_t r = 0; r < nq; ++r) {
      const int64_t i = i0 + r;
      const bool dead = l[r] == A(0);  // nothing attended
      const A inv = dead ? A(0) : A(1) / l[r];
      const A dlse = ls[r] * inv;
      const A* o = acc_o.data() + r * Dvp;
      const A* to = acc_t.data() + r * Dvp;
      A* dst = p.tout + (bh * sh.Lq + i) * Dv;
      for (int64_t d = 0; d < Dv; ++d) dst[d] = dead ? A(0) : to[d] * inv - dlse * (o[d] * inv);
      p.tlse[bh * sh.Lq + i] = dead ? 0.0f : static_cast<float>(dlse);
    }
  }
}

// The worker for the ISA trampoline (cpu::isa_dispatch).
template <class A>
struct JvpKernel {
  template <int kBytes>
  FASTATTN_INLINE static void run(const JvpArgs<A>& p, std::atomic<int64_t>& next) {
    jvp_worker<Vec<A, kBytes / sizeof(A)>>(p, next);
  }
};
template <class A>
void jvp_dispatch(const JvpArgs<A>& p, std::atomic<int64_t>& next) {
  cpu::isa_dispatch<JvpKernel<A>>(p, next);
}

// A tangent: undefined (zero) or of `like`'s shape, dtype and device.
bool check_tangent(const std::optional<at::Tensor>& t, const at::Tensor& like, const char* name,
                   const char* like_name) {
  if (!t.has_value() || !t->defined()) return false;
  check_like(*t, like, like.sizes(), like.scalar_type(), name, like_name);
  return true;
}

template <class T>
void attention_jvp_impl(const at::Tensor& q, const at::Tensor& k, const at::Tensor& v,
                        const at::Tensor* tq, const at::Tensor* tk, const at::Tensor* tv,
                        const cpu::MaskView& mask, const cpu::MaskView& tmask, double scale,
                        const Band& band, const Dropout& drop, at::Tensor& tout, at::Tensor& tlse) {
  using A = acc_t<T>;
  const auto acc_opts = q.options().dtype(c10::CppTypeToScalarType<A>::value);
  const Shape sh{q.size(0), q.size(1), k.size(1), q.size(1) / k.size(1), q.size(2), k.size(2),
                 q.size(3), v.size(3)};
  const int64_t BQ = kJvpBlockQ, BK = kJvpBlockK;
  const int64_t nqb = ceil_div(sh.Lq, BQ), nkb = ceil_div(sh.Lk, BK);
  const int64_t Dp = round_up(sh.D, kPad<A>), Dvp = round_up(sh.Dv, kPad<A>);
  const int64_t BH = sh.B * sh.H, BG = sh.B * sh.Hkv;
  const A sc = static_cast<A>(scale);
  auto rows = [&](const at::Tensor& x, int64_t heads, int64_t L, int64_t dim, int64_t dpad, A s) {
    at::Tensor buf = empty_tensor({packed_rows_size(sh.B * heads * L, dpad)}, acc_opts);
    pack_rows<T, A>(x.const_data_ptr<T>(), strides_of(x), sh.B, heads, L, dim, dpad, buf.data_ptr<A>(), s);
    return buf;
  };
  auto tiles = [&](const at::Tensor& x) {
    at::Tensor buf = empty_tensor({BG * nkb * sh.D * BK}, acc_opts);
    pack_transposed<T, A>(x.const_data_ptr<T>(), strides_of(x), sh.B, sh.Hkv, sh.Lk, sh.D, BK, buf.data_ptr<A>());
    return buf;
  };
  const at::Tensor qp = rows(q, sh.H, sh.Lq, sh.D, Dp, sc), kt = tiles(k);
  const at::Tensor vp = rows(v, sh.Hkv, sh.Lk, sh.Dv, Dvp, A(1));
  const at::Tensor tqp = tq ? rows(*tq, sh.H, sh.Lq, sh.D, Dp, sc) : at::Tensor();
  const at::Tensor tkt = tk ? tiles(*tk) : at::Tensor();
  const at::Tensor tvp = tv ? rows(*tv, sh.Hkv, sh.Lk, sh.Dv, Dvp, A(1)) : at::Tensor();
  const std::vector<uint8_t> v_bad = nonfinite_tiles(vp.const_data_ptr<A>(), BG, sh.Lk, Dvp, BK);
  const std::vector<uint8_t> tv_bad =
      tv ? nonfinite_tiles(tvp.const_data_ptr<A>(), BG, sh.Lk, Dvp, BK) : std::vector<uint8_t>();
  auto ptr = [](const std::vector<uint8_t>& f) { return f.empty() ? nullptr : f.data(); };
  auto data = [](const at::Tensor& x) { return x.defined() ? x.const_data_ptr<A>() : nullptr; };
  at::Tensor tout_acc = acc_output<T, A>(tout);
  const std::vector<int64_t> order = query_order(band, sh.Lq, sh.Lk, BQ, BK);
  const JvpArgs<A> p{sh, band, drop, mask, tmask, data(qp), data(tqp), data(kt), data(tkt),
                     data(vp), data(tvp), Dp, Dvp, BQ, BK, nqb, nkb, order.data(), ptr(v_bad),
                     ptr(tv_bad), tout_acc.data_ptr<A>(), tlse.data_ptr<float>()};
  run_workers(BH * nqb, [&](std::atomic<int64_t>& next) { jvp_dispatch<A>(p, next); });
  if (!tout_acc.is_same(tout)) tout.copy_(tout_acc);
}

std::tuple<at::Tensor, at::Tensor> attention_jvp_cpu(
    const at::Tensor& q_in, const at::Tensor& k_in, const at::Tensor& v_in,
    const std::optional<at::Tensor>& mask, const std::optional<at::Tensor>& tq_in,
    const std::optional<at::Tensor>& tk_in, const std::optional<at::Tensor>& tv_in,
    const std::optional<at::Tensor>& tmask, double scale, int64_t offset, int64_t left,
    int64_t right, double dropout_p, int64_t seed) {
  check_qkv(q_in, k_in, v_in);
  const int64_t B = q_in.size(0), H = q_in.size(1), Lq = q_in.size(2), Lk = k_in.size(2);
  const int64_t Dv = v_in.size(3);
  const bool has_tq = check_tangent(tq_in, q_in, "tq", "q");
  const bool has_tk = check_tangent(tk_in, k_in, "tk", "k");
  const bool has_tv = check_tangent(tv_in, v_in, "tv", "v");
  const at::Tensor q = unit_last(q_in), k = unit_last(k_in), v = unit_last(v_in);
  const at::Tensor tq = has_tq ? unit_last(*tq_in) : at::Tensor();
  const at::Tensor tk = has_tk ? unit_last(*tk_in) : at::Tensor();
  const at::Tensor tv = has_tv ? unit_last(*tv_in) : at::Tensor();
  const cpu::MaskView mview = cpu::make_mask_view(mask, {B, H, Lq, Lk}, q, "q");
  const cpu::MaskView tmview = cpu::make_mask_view(tmask, {B, H, Lq, Lk}, q, "q");
  TORCH_CHECK(!tmview.defined() || (mview.defined() && mview.kind != cpu::MaskKind::kBool &&
                                    tmview.kind == mview.kind),
              "tmask (the mask's tangent) needs a floating mask of its dtype");
  const Dropout drop = make_dropout(dropout_p, seed);
  at::Tensor tout = empty_tensor({B, H, Lq, Dv}, q.options()).zero_();
  at::Tensor tlse = empty_tensor({B, H, Lq}, q.options().dtype(at::kFloat)).zero_();
  if (B * H * Lq == 0 || Lk == 0) return {tout, tlse};
  const Band band = make_band(offset, left, right, Lq, Lk);
  FASTATTN_DISPATCH_FLOATING_HALF_BF16(q.scalar_type(), "attention_jvp_cpu", [&] {
    attention_jvp_impl<scalar_t>(q, k, v, has_tq ? &tq : nullptr, has_tk ? &tk : nullptr,
                                 has_tv ? &tv : nullptr, mview, tmview, scale, band, drop, tout,
                                 tlse);
  });
  return {tout, tlse};
}

}  // namespace

TORCH_LIBRARY_IMPL(fastattn, CPU, m) { m.impl("attention_jvp", &attention_jvp_cpu); }

}  // namespace fastattn
