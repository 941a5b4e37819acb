// The Python module fastattn._C, and the cpu backend's eager fast path in it.
//
// Why: a public function (fastattn.layer_norm, attention, ffn, softmax, paged_attention) called
// in eager mode on small CPU inputs spends most of its time in Python before the kernel:
// argument checks, the backend choice, reshapes, the autograd guard. bench/call_cost.py measured
// 35 us for fastattn.layer_norm against 8 for F.layer_norm (the op itself, below autograd: 10),
// and a model pays that on every call (bench/results/cpu-notes.md, session 24).
//
// What: each function here takes the common case of one public function in a single C++ call.
// When every tensor argument is a plain dense CPU tensor (no subclass dispatch, no functorch
// wrapper, no conjugate or negative view), nothing carries a forward-mode tangent, no
// TorchDispatchMode is active and the JIT tracer is off, and the arguments are valid, it runs the
// cpu kernel through the op's CPU entry in the dispatcher (the schema in fastattn.cpp, the kernel
// the registered op runs) and returns the output. A call that records a graph (grad mode on and
// an input that requires a gradient) is taken by layer_norm, attention and ffn only, through a
// C++ autograd node (the training path, below); the others hand it back. Otherwise it returns
// None and the caller takes the Python path, which checks the arguments and raises the errors:
// they are written once, there. The Python side (fastattn/ops/_library.py: eager_fast_path) calls
// these only outside torch.compile (calls that record a graph: only in plain eager mode) and
// only when the backend choice for the call is the cpu backend's own implementation.
#include <ATen/ATen.h>
#include <ATen/core/dispatch/Dispatcher.h>
#include <c10/core/impl/TorchDispatchModeTLS.h>
#include <torch/csrc/autograd/custom_function.h>
#include <torch/csrc/autograd/forward_grad.h>
#include <torch/csrc/autograd/python_variable.h>
#include <torch/csrc/autograd/variable.h>
#include <torch/csrc/jit/frontend/tracer.h>
#include <torch/csrc/utils/pybind.h>

#include <algorithm>
#include <cmath>
#include <optional>
#include <string>
#include <typeinfo>
#include <vector>

#include "fastattn/activation.h"
#include "fastattn/cpu_choices.h"
#include "fastattn/cpu_simd.h"

namespace py = pybind11;

namespace {

using Tensor = at::Tensor;
using OptTensor = std::optional<Tensor>;

// The global state the fast path needs: no dispatch mode (FakeTensorMode, make_fx, ...) that
// must see the op, no JIT trace that must record it.
bool eager_state() {
  return c10::impl::TorchDispatchModeTLS::stack_len() == 0 && !torch::jit::tracer::isTracing();
}

// Whether t is a dense CPU tensor of the plain TensorImpl (functorch's batched and grad wrappers,
// functionalization, nested, sparse, quantized and MKL-DNN tensors have their own impl types)
// that no Python subclass dispatches on, with no zero-tensor, conjugate or negative bit, and that
// carries no tangent and, unless `trains` (a function with a training path, below), asks for no
// gradient here.
bool plain(const Tensor& t, bool trains) {
  const c10::TensorImpl* impl = t.unsafeGetTensorImpl();
  if (typeid(*impl) != typeid(c10::TensorImpl)) return false;
  const c10::DispatchKeySet ks = impl->key_set();
  if (!ks.has(c10::DispatchKey::CPU) || ks.has(c10::DispatchKey::Python) ||
      ks.has(c10::DispatchKey::PythonTLSSnapshot) || ks.has(c10::DispatchKey::ZeroTensor) ||
      impl->is_conj() || impl->is_neg()) {
    return false;
  }
  if (!trains && at::GradMode::is_enabled() && t.requires_grad()) return false;
  const auto* meta = torch::autograd::impl::get_autograd_meta(t);
  return meta == nullptr || meta->fw_grad_ == nullptr || meta->fw_grad_->empty();
}

// The tensor an argument holds when it is a plain one (above); nullopt otherwise.
std::optional<Tensor> tensor(py::handle obj, bool trains = false) {
  if (!THPVariable_Check(obj.ptr())) return std::nullopt;
  Tensor t = THPVariable_Unpack(obj.ptr());
  if (!plain(t, trains)) return std::nullopt;
  return t;
}

// An optional tensor argument: None gives an empty optional; ok is false for anything but None
// or a plain tensor.
OptTensor optional_tensor(py::handle obj, bool& ok, bool trains = false) {
  if (obj.is_none()) return std::nullopt;
  auto t = tensor(obj, trains);
  ok = ok && t.has_value();
  return t;
}

bool floating(const Tensor& t) {
  const auto s = t.scalar_type();
  return s == at::kFloat || s == at::kBFloat16 || s == at::kHalf || s == at::kDouble;
}

// An int that is not a bool.
bool is_int(py::handle obj) { return PyLong_Check(obj.ptr()) && !PyBool_Check(obj.ptr()); }

// The op's CPU kernel, by its schema name: below every other dispatch key (the callers have
// checked that none of them has work to do).
template <typename Sig>
c10::TypedOperatorHandle<Sig> op(const char* name) {
  return c10::Dispatcher::singleton().findSchemaOrThrow(name, "").typed<Sig>();
}

const c10::DispatchKeySet kCpu(c10::DispatchKey::CPU);

// A `causal` argument: 0 False, 1 True or "top_left", 2 "bottom_right"; -1 anything else.
int causal_kind(py::handle obj) {
  if (obj.ptr() == Py_False) return 0;
  if (obj.ptr() == Py_True) return 1;
  if (!PyUnicode_Check(obj.ptr())) return -1;
  const std::string s = obj.cast<std::string>();
  return s == "top_left" ? 1 : s == "bottom_right" ? 2 : -1;
}

// The attention functions' `causal` and `scale` arguments: false (hand the call back) unless the
// state is eager (above), causal is one of causal_kind's and scale None or a float; scale then
// holds its value, 1 / sqrt(D) for None.
bool attention_args(py::handle causal_obj, py::handle scale_obj, int64_t D, int& causal,
                    double& scale) {
  causal = causal_kind(causal_obj);
  if (!eager_state() || causal < 0) return false;
  if (scale_obj.is_none()) {
    scale = 1.0 / std::sqrt(static_cast<double>(D));
    return true;
  }
  if (!PyFloat_CheckExact(scale_obj.ptr())) return false;
  scale = PyFloat_AS_DOUBLE(scale_obj.ptr());
  return true;
}

// The tensor, or a copy of it, whose last dimension has stride 1 (ops/_library.py:
// last_dim_contiguous).
Tensor unit_last(const Tensor& t) { return t.stride(-1) == 1 ? t : t.contiguous(); }

// ---------------------------------------------------------------------------------------------
// The training path: a call that records a graph (grad mode on, some input requires a gradient)
// gets a C++ autograd node (torch::autograd::Function) instead of the Python path's
// _library._EagerAutograd / attention._Attention. The node saves what the op's registered
// formula saves and its backward calls the registered backward op through the dispatcher, as
// the formula does: the formula's few lines of glue (ops/layer_norm.py, ffn.py, attention.py:
// `_backward`) restated for this case, which tests/test_eager_fast_path.py holds to the same bits
// as the Python path, gradients included. The Python path spent ~55 us a call before the kernel
// and ~70 us in backward around it (bench/results/cpu-notes.md, session 25).

using torch::autograd::AutogradContext;
using torch::autograd::variable_list;

// Whether a call with these tensors records a graph.
bool records(std::initializer_list<const OptTensor*> ts) {
  if (!at::GradMode::is_enabled()) return false;
  return std::any_of(ts.begin(), ts.end(),
                     [](const OptTensor* t) { return *t && (*t)->requires_grad(); });
}

// A saved-data entry of the node's context.
at::IValue& saved(AutogradContext* ctx, const char* key) { return ctx->saved_data[key]; }

// t, or an undefined tensor where it is empty (ops/_library.py: empty_or_none).
Tensor defined_or_none(const Tensor& t) { return t.defined() && t.numel() > 0 ? t : Tensor(); }

// ---- layer_norm / rms_norm

using LayerNormFwd = std::tuple<Tensor, Tensor, Tensor, Tensor>(
    const Tensor&, const OptTensor&, const OptTensor&, const OptTensor&, double, bool);
using LayerNormBwd = std::tuple<Tensor, Tensor, Tensor>(
    const Tensor&, const OptTensor&, const Tensor&, const OptTensor&, const Tensor&,
    const Tensor&, bool, std::array<bool, 2>);

// x as (rows, n) with a unit last stride (ops/layer_norm.py: _rows).
Tensor norm_rows(const Tensor& x, int64_t n) {
  Tensor rows = x.reshape({-1, n});
  return rows.stride(-1) != 1 && n != 1 ? rows.contiguous() : rows;
}

// The kernel on rows (M, n) and weights (n,): (y, h, mean, rstd).
std::tuple<Tensor, Tensor, Tensor, Tensor> norm_kernel(const Tensor& rows, const OptTensor& w,
                                                       const OptTensor& b, double eps, bool rms) {
  static const auto fwd = op<LayerNormFwd>("fastattn::layer_norm_fwd");
  py::gil_scoped_release no_gil;
  return fwd.redispatch(kCpu, rows, std::nullopt, w, b, eps, rms);
}

// A weight or bias as the contiguous (n,) vector the kernel takes (ops/layer_norm.py: _flat).
OptTensor flat(const OptTensor& t, int64_t n) {
  return t && (t->dim() != 1 || !t->is_contiguous()) ? OptTensor(t->reshape({n}).contiguous()) : t;
}

struct LayerNormFn : torch::autograd::Function<LayerNormFn> {
  // y as (rows, n); the caller views it as x.
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const OptTensor& w,
                               const OptTensor& b, double eps, bool rms, int64_t n) {
    const Tensor rows = norm_rows(x, n);
    const OptTensor wf = flat(w, n);
    auto [y, h, mean, rstd] = norm_kernel(rows, wf, flat(b, n), eps, rms);
    ctx->save_for_backward({rows, wf.value_or(Tensor()), mean, rstd});
    saved(ctx, "rms") = rms;
    saved(ctx, "x") = x.sizes().vec();
    if (w || b) saved(ctx, "w") = (w ? *w : *b).sizes().vec();  // (normalized_shape: both's)
    if (b) saved(ctx, "b_dtype") = b->scalar_type();
    return {y};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto bwd = op<LayerNormBwd>("fastattn::layer_norm_bwd");
    const variable_list s = ctx->get_saved_variables();
    const Tensor &rows = s[0], &w = s[1], &mean = s[2], &rstd = s[3];
    const bool has_bias = ctx->saved_data.count("b_dtype") > 0;
    // (needs_input_grad counts the tensor inputs given: x, then w and b where given)
    const std::array<bool, 2> want{w.defined() && ctx->needs_input_grad(1),
                                   has_bias && ctx->needs_input_grad(w.defined() ? 2 : 1)};
    const Tensor dy = unit_last(grads[0]);
    auto [dx, dw, db] = bwd.call(dy, std::nullopt, rows, w.defined() ? OptTensor(w) : std::nullopt,
                                 mean, rstd, saved(ctx, "rms").toBool(), want);
    variable_list out(6);
    out[0] = dx.view(saved(ctx, "x").toIntVector());
    const auto w_shape = [&] { return saved(ctx, "w").toIntVector(); };
    if ((dw = defined_or_none(dw)).defined()) out[1] = dw.view(w_shape());
    db = defined_or_none(db);
    if (!db.defined() && has_bias && !w.defined() && want[1]) {  // a bias without a weight
      db = dy.sum(0, false, at::kFloat).to(saved(ctx, "b_dtype").toScalarType());
    }
    if (db.defined()) out[2] = db.view(w_shape());
    return out;
  }
};

// fastattn.layer_norm / rms_norm (no residual): y of x's shape, or None.
py::object layer_norm(py::handle x_obj, py::handle shape_obj, py::handle w_obj, py::handle b_obj,
                      py::handle eps_obj, bool rms) {
  if (!eager_state() || !PyFloat_CheckExact(eps_obj.ptr())) return py::none();
  const double eps = PyFloat_AS_DOUBLE(eps_obj.ptr());
  OptTensor x = tensor(x_obj, true);
  if (!x || !floating(*x) || !(eps >= 0)) return py::none();
  std::vector<int64_t> shape;
  if (is_int(shape_obj)) {
    shape.push_back(PyLong_AsLongLong(shape_obj.ptr()));
  } else if (PyTuple_Check(shape_obj.ptr()) || PyList_Check(shape_obj.ptr())) {
    for (py::handle item : py::reinterpret_borrow<py::sequence>(shape_obj)) {
      if (!is_int(item)) return py::none();
      shape.push_back(PyLong_AsLongLong(item.ptr()));
    }
  } else {
    return py::none();
  }
  const int64_t nd = static_cast<int64_t>(shape.size());
  if (nd == 0 || x->dim() < nd) return py::none();
  int64_t n = 1;
  for (int64_t i = 0; i < nd; ++i) {
    if (x->size(x->dim() - nd + i) != shape[i]) return py::none();
    n *= shape[i];
  }
  if (n == 0) return py::none();  // (empty rows: the Python path's rules)
  bool ok = true;
  OptTensor w = optional_tensor(w_obj, ok, true), b = optional_tensor(b_obj, ok, true);
  if (!ok || (rms && b)) return py::none();
  for (const OptTensor* t : {&w, &b}) {  // (x's dtype or float32, one dtype for both)
    if (*t && (((*t)->scalar_type() != x->scalar_type() && (*t)->scalar_type() != at::kFloat) ||
               !(*t)->sizes().equals(shape))) {
      return py::none();
    }
  }
  if (w && b && w->scalar_type() != b->scalar_type()) return py::none();
  Tensor y = records({&x, &w, &b})
                 ? LayerNormFn::apply(*x, w, b, eps, rms, n)[0]
                 : std::get<0>(norm_kernel(norm_rows(*x, n), flat(w, n), flat(b, n), eps, rms));
  if (!y.sizes().equals(x->sizes())) y = y.view(x->sizes());
  return py::cast(y);
}

// ---- attention

using AttentionBwd = std::tuple<Tensor, Tensor, Tensor, Tensor>(
    const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&,
    const OptTensor&, double, int64_t, int64_t, int64_t, double, int64_t, bool);

// The kernel without mask or dropout: (out, lse).
std::tuple<Tensor, Tensor> attention_kernel(const Tensor& q, const Tensor& k, const Tensor& v,
                                            double scale, int64_t offset, int64_t left,
                                            int64_t right) {
  static const auto fwd = op<std::tuple<Tensor, Tensor>(
      const Tensor&, const Tensor&, const Tensor&, const OptTensor&, double, int64_t, int64_t,
      int64_t, double, int64_t)>("fastattn::attention_fwd");
  py::gil_scoped_release no_gil;
  return fwd.redispatch(kCpu, q, k, v, std::nullopt, scale, offset, left, right, 0.0, 0);
}

struct AttentionFn : torch::autograd::Function<AttentionFn> {
  static variable_list forward(AutogradContext* ctx, const Tensor& q, const Tensor& k,
                               const Tensor& v, double scale, int64_t offset, int64_t left,
                               int64_t right) {
    auto [out, lse] = attention_kernel(q, k, v, scale, offset, left, right);
    ctx->save_for_backward({q, k, v, out, lse});
    saved(ctx, "scale") = scale;
    saved(ctx, "band") = std::vector<int64_t>{offset, left, right};
    return {out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    const variable_list s = ctx->get_saved_variables();
    const Tensor &q = s[0], &k = s[1], &v = s[2], &out = s[3], &lse = s[4];
    const bool needs[3] = {ctx->needs_input_grad(0), ctx->needs_input_grad(1),
                           ctx->needs_input_grad(2)};
    variable_list res(7);
    if (!(needs[0] || needs[1] || needs[2])) return res;
    const double scale = saved(ctx, "scale").toDouble();
    const std::vector<int64_t> band = saved(ctx, "band").toIntVector();
    const int64_t offset = band[0], left = band[1], right = band[2];
    if (at::GradMode::is_enabled() &&
        (q.requires_grad() || k.requires_grad() || v.requires_grad())) {
      // create_graph=True: the Python formula's differentiable backward (attention._Attention)
      py::gil_scoped_acquire gil;
      static py::object* differentiable = new py::object(
          py::module_::import("fastattn.ops.attention").attr("_differentiable_backward"));
      const py::tuple r = (*differentiable)(
          q, k, v, py::none(), py::make_tuple(scale, offset, left, right, 0.0, 0), grads[0],
          py::none(), py::make_tuple(needs[0], needs[1], needs[2], false), true);
      for (int i = 0; i < 3; ++i) res[i] = r[i].is_none() ? Tensor() : r[i].cast<Tensor>();
      return res;
    }
    static const auto bwd = op<AttentionBwd>("fastattn::attention_bwd");
    auto [dq, dk, dv, dmask] = bwd.call(unit_last(grads[0]), q, k, v, out, lse, std::nullopt,
                                        scale, offset, left, right, 0.0, 0, false);
    res[0] = dq;
    res[1] = dk;
    res[2] = dv;
    return res;
  }
};

// fastattn.attention with no mask, window or dropout: q (B, H, Lq, D), k (B, Hkv, Lk, D),
// v (B, Hkv, Lk, Dv); causal False, True, "top_left" or "bottom_right"; scale None or a float.
// A call that records a graph takes the training path only with q, k, v of unit last stride (a
// copy made here would leave the saved tensors off the graph that create_graph differentiates).
py::object attention(py::handle q_obj, py::handle k_obj, py::handle v_obj, py::handle causal_obj,
                     py::handle scale_obj, bool enable_gqa) {
  OptTensor q = tensor(q_obj, true), k = tensor(k_obj, true), v = tensor(v_obj, true);
  if (!q || !k || !v || q->dim() != 4 || k->dim() != 4 || v->dim() != 4) return py::none();
  if (!floating(*q) || k->scalar_type() != q->scalar_type() || v->scalar_type() != q->scalar_type()) {
    return py::none();
  }
  const int64_t B = q->size(0), H = q->size(1), Lq = q->size(2), D = q->size(3);
  const int64_t Hkv = k->size(1), Lk = k->size(2);
  if (k->size(0) != B || v->size(0) != B || v->size(1) != Hkv || v->size(2) != Lk ||
      k->size(3) != D || Hkv == 0 || H % Hkv != 0 || (Hkv != H && !enable_gqa)) {
    return py::none();
  }
  // (empty inputs and head dim 0 have their own rules on the Python path)
  int causal;
  double scale;
  if (B * H * Lq * Lk * D * v->size(3) == 0 ||
      !attention_args(causal_obj, scale_obj, D, causal, scale)) {
    return py::none();
  }
  // The band of fastattn.ops.attention.band: unbounded is Lq + Lk.
  const int64_t unbounded = Lq + Lk;
  const int64_t offset = causal == 2 ? Lk - Lq : 0;
  const int64_t right = causal ? 0 : unbounded;
  if (!records({&q, &k, &v})) {
    return py::cast(std::get<0>(attention_kernel(*q, *k, *v, scale, offset, unbounded, right)));
  }
  if (q->stride(-1) != 1 || k->stride(-1) != 1 || v->stride(-1) != 1) return py::none();
  return py::cast(AttentionFn::apply(*q, *k, *v, scale, offset, unbounded, right)[0]);
}

// fastattn.paged_attention with no window: q (B, H, Lq, D); caches (num_blocks, block_size, Hkv,
// D / Dv) of q's dtype; block_table (B, max_blocks) and cache_seqlens (B,) int32, whose values
// the kernel checks itself (ops/varlen.py: _CHECKS_PAGED_VALUES); the output, or None.
py::object paged_attention(py::handle q_obj, py::handle kc_obj, py::handle vc_obj,
                           py::handle table_obj, py::handle lens_obj, py::handle causal_obj,
                           py::handle scale_obj) {
  auto q = tensor(q_obj), kc = tensor(kc_obj), vc = tensor(vc_obj);
  auto table = tensor(table_obj), lens = tensor(lens_obj);
  if (!q || !kc || !vc || !table || !lens || q->dim() != 4 || kc->dim() != 4 || vc->dim() != 4 ||
      table->dim() != 2 || lens->dim() != 1 || !floating(*q) ||
      kc->scalar_type() != q->scalar_type() || vc->scalar_type() != q->scalar_type() ||
      table->scalar_type() != at::kInt || lens->scalar_type() != at::kInt) {
    return py::none();
  }
  const int64_t B = q->size(0), H = q->size(1), Lq = q->size(2), D = q->size(3);
  const int64_t block_size = kc->size(1), Hkv = kc->size(2);
  if (kc->sizes().slice(0, 3) != vc->sizes().slice(0, 3) || block_size == 0 || Hkv == 0 ||
      kc->size(3) != D || H % Hkv != 0 || table->size(0) != B || lens->size(0) != B ||
      B * H * Lq * D * vc->size(3) == 0) {
    return py::none();
  }
  int causal;
  double scale;
  if (!attention_args(causal_obj, scale_obj, D, causal, scale)) return py::none();
  // (ops/varlen.py: _band_args, unbounded = Lq + max_blocks * block_size)
  const int64_t unbounded = Lq + table->size(1) * block_size;
  static const auto fwd = op<std::tuple<Tensor, Tensor>(
      const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, double, bool,
      int64_t, int64_t)>("fastattn::paged_attention_fwd");
  Tensor out;
  {
    py::gil_scoped_release no_gil;
    out = std::get<0>(fwd.redispatch(kCpu, unit_last(*q), unit_last(*kc), unit_last(*vc), *table,
                                     *lens, scale, causal == 2, unbounded, causal ? 0 : unbounded));
  }
  return py::cast(out);
}

// ---- ffn

using FfnFwd = std::tuple<Tensor, Tensor>(const Tensor&, const Tensor&, const OptTensor&,
                                          const Tensor&, const OptTensor&, c10::string_view);
using FfnBwd = std::tuple<Tensor, Tensor, Tensor, Tensor, Tensor>(
    const Tensor&, const Tensor&, const Tensor&, const Tensor&, const Tensor&, c10::string_view,
    std::array<bool, 2>);

// The kernel on x as (M, D) rows and contiguous weights: (out (M, D2), pre).
std::tuple<Tensor, Tensor> ffn_kernel(const Tensor& x, const Tensor& w1, const OptTensor& b1,
                                      const Tensor& w2, const OptTensor& b2,
                                      const std::string& activation) {
  static const auto fwd = op<FfnFwd>("fastattn::ffn_fwd");
  py::gil_scoped_release no_gil;
  return fwd.redispatch(kCpu, x, w1, b1, w2, b2, activation);
}

struct FfnFn : torch::autograd::Function<FfnFn> {
  // out as (M, D2); the caller views it as x's leading dims.
  static variable_list forward(AutogradContext* ctx, const Tensor& x, const Tensor& w1,
                               const OptTensor& b1, const Tensor& w2, const OptTensor& b2,
                               const std::string& activation) {
    const Tensor rows = x.reshape({-1, x.size(-1)}).contiguous();
    const Tensor w1c = w1.contiguous(), w2c = w2.contiguous();
    auto [out, pre] = ffn_kernel(rows, w1c, b1, w2c, b2, activation);
    ctx->save_for_backward({rows, w1c, w2c, pre});
    saved(ctx, "activation") = activation;
    saved(ctx, "x") = x.sizes().vec();
    saved(ctx, "bias") = std::vector<bool>{b1.has_value(), b2.has_value()};
    return {out};
  }

  static variable_list backward(AutogradContext* ctx, variable_list grads) {
    static const auto bwd = op<FfnBwd>("fastattn::ffn_bwd");
    const variable_list s = ctx->get_saved_variables();
    const auto bias = saved(ctx, "bias").toBoolList();
    // (needs_input_grad counts the tensor inputs given: x, w1, b1 where given, w2, b2)
    const std::array<bool, 2> want{bias[0] && ctx->needs_input_grad(2),
                                   bias[1] && ctx->needs_input_grad(bias[0] ? 4 : 3)};
    auto [dx, dw1, db1, dw2, db2] = bwd.call(grads[0].contiguous(), s[0], s[1], s[2], s[3],
                                             saved(ctx, "activation").toStringRef(), want);
    return {dx.view(saved(ctx, "x").toIntVector()), dw1, defined_or_none(db1), dw2,
            defined_or_none(db2), Tensor()};
  }
};

// fastattn.ffn: x (..., D), w1 (F1, D), w2 (D2, F), biases None or (F1,) / (D2,), all of x's
// dtype; the output (..., D2), or None.
py::object ffn(py::handle x_obj, py::handle w1_obj, py::handle b1_obj, py::handle w2_obj,
               py::handle b2_obj, py::handle act_obj) {
  if (!eager_state() || !PyUnicode_Check(act_obj.ptr())) return py::none();
  const std::string activation = act_obj.cast<std::string>();
  bool gated;
  try {
    gated = fastattn::parse_activation(activation).gated;  // (the one table, activation.h)
  } catch (const c10::Error&) {
    return py::none();  // (an unknown name: the Python path's error)
  }
  OptTensor x = tensor(x_obj, true), w1 = tensor(w1_obj, true), w2 = tensor(w2_obj, true);
  bool ok = true;
  OptTensor b1 = optional_tensor(b1_obj, ok, true), b2 = optional_tensor(b2_obj, ok, true);
  if (!ok || !x || !w1 || !w2 || !floating(*x) || x->dim() < 1 || w1->dim() != 2 ||
      w2->dim() != 2) {
    return py::none();
  }
  const auto dtype = x->scalar_type();
  for (const OptTensor* t : {&w1, &w2, &b1, &b2}) {
    if (*t && (*t)->scalar_type() != dtype) return py::none();
  }
  const int64_t d = x->size(-1), f1 = w1->size(0), d2 = w2->size(0);
  if (d == 0 || f1 == 0 || d2 == 0 || w1->size(1) != d || (gated && f1 % 2) ||
      w2->size(1) != (gated ? f1 / 2 : f1) ||
      (b1 && !b1->sizes().equals({f1})) || (b2 && !b2->sizes().equals({d2}))) {
    return py::none();
  }
  std::vector<int64_t> shape(x->sizes().begin(), x->sizes().end());
  shape.back() = d2;
  const Tensor out = records({&x, &w1, &b1, &w2, &b2})
      ? FfnFn::apply(*x, *w1, b1, *w2, b2, activation)[0]
      : std::get<0>(ffn_kernel(x->reshape({-1, d}).contiguous(), w1->contiguous(), b1,
                               w2->contiguous(), b2, activation));
  return py::cast(out.view(shape));
}

// fastattn.scaled_masked_softmax with no mask: x (..., Lk) (at least (Lq, Lk) when causal),
// scale a float or an int, is_causal a bool; y of x's shape, or None.
py::object softmax(py::handle x_obj, py::handle scale_obj, py::handle causal_obj) {
  if (!eager_state() || !(PyFloat_CheckExact(scale_obj.ptr()) || is_int(scale_obj)) ||
      !PyBool_Check(causal_obj.ptr())) {
    return py::none();
  }
  const double scale = PyFloat_AsDouble(scale_obj.ptr());
  const bool causal = causal_obj.ptr() == Py_True;
  auto x = tensor(x_obj);
  if (!x || !floating(*x) || x->dim() == 0 || (causal && x->dim() < 2)) return py::none();
  // (L0, L1, Lq, Lk): the leading dims folded into L0, missing ones 1 (ops/softmax.py: _as_4d)
  const auto sizes = x->sizes();
  const int64_t nd = x->dim(), tail = std::min<int64_t>(3, nd);
  std::vector<int64_t> full{1};
  for (int64_t i = 0; i < nd - tail; ++i) full[0] *= sizes[i];
  for (int64_t i = tail; i < 3; ++i) full.push_back(1);
  for (int64_t i = nd - tail; i < nd; ++i) full.push_back(sizes[i]);
  static const auto fwd = op<Tensor(const Tensor&, const OptTensor&, double, bool)>(
      "fastattn::softmax_fwd");
  Tensor y;
  {
    py::gil_scoped_release no_gil;
    Tensor x4 = x->reshape(full);
    if (x4.stride(-1) != 1) x4 = x4.contiguous();
    y = fwd.redispatch(kCpu, x4, std::nullopt, scale, causal).view(sizes);
  }
  return py::cast(y);
}

// The cpu backend's CPU-dependent choices (fastattn/cpu_choices.h), read now (the variables that
// force them are read on every call).
py::dict cpu_choices() {
  namespace cpu = fastattn::cpu;
  py::dict d;
  d["isa"] = cpu::isa_name(cpu::cpu_isa());
  d["attention_plain_forward"] = cpu::torch_plain_forward() ? "torch" : "fastattn";
  d["ffn_bfloat16_matmuls"] = cpu::ffn_gemm_in_float(at::kBFloat16) ? "float32" : "bfloat16";
  d["ffn_float16_matmuls"] = cpu::ffn_gemm_in_float(at::kHalf) ? "float32" : "float16";
  return d;
}

}  // namespace

PYBIND11_MODULE(_C, m) {
  m.doc() = "fastattn's compiled ops (registered with torch on import) and the cpu backend's "
            "eager inference fast path (csrc/eager.cpp)";
  m.def("layer_norm", &layer_norm, "fastattn.layer_norm / rms_norm's eager fast path, or None");
  m.def("attention", &attention, "fastattn.attention's eager fast path, or None");
  m.def("ffn", &ffn, "fastattn.ffn's eager fast path, or None");
  m.def("softmax", &softmax, "fastattn.scaled_masked_softmax's eager fast path, or None");
  m.def("paged_attention", &paged_attention, "fastattn.paged_attention's eager fast path, or None");
  m.def("cpu_choices", &cpu_choices,
        "the cpu backend's CPU-dependent kernel choices (fastattn/cpu_choices.h)");
  // The functions above whose path also takes calls that record a graph (the training path).
  m.attr("TRAINING") = py::make_tuple("layer_norm", "attention", "ffn");
}
