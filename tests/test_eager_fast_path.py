"""The cpu backend's eager fast path (csrc/eager.cpp, fastattn._C.layer_norm / attention / ffn;
fastattn.ops._library.eager_fast_path): it runs the same kernel as the registered op, so its
results are bitwise those of the Python path; it is taken only where that path would run the cpu
backend's kernel below autograd or, for layer_norm, attention and ffn, through the op's formula
in plain eager mode (its training path: a C++ autograd node, whose gradients are bitwise the
formula's too), and it hands every other call back (None)."""

import contextlib

import pytest
import torch
import torch.autograd.forward_ad as fwAD
import torch.nn.functional as F
from torch.utils._python_dispatch import TorchDispatchMode

import fastattn
from fastattn import _extension
from fastattn.ops import _library

from conftest import graph_nodes

pytestmark = pytest.mark.skipif(
    _extension.eager_function("attention") is None, reason="the extension has no eager fast path")

C = _extension.eager_function


@pytest.fixture
def calls(monkeypatch):
    """The fast path's calls and what each returned (True: a tensor, False: None)."""
    seen = []

    def spy(name):
        fn = C(name)

        def call(*args):
            out = fn(*args)
            seen.append((name, out is not None))
            return out
        return call
    monkeypatch.setattr(_extension, "eager_function", spy)
    return seen


def _qkv(B=2, H=4, Hkv=4, Lq=17, Lk=17, D=40, Dv=40, dtype=torch.float32):
    g = torch.Generator().manual_seed(0)
    return (torch.randn(B, H, Lq, D, generator=g, dtype=dtype),
            torch.randn(B, Hkv, Lk, D, generator=g, dtype=dtype),
            torch.randn(B, Hkv, Lk, Dv, generator=g, dtype=dtype))


@contextlib.contextmanager
def _python_path():
    """The public functions' Python path only (the one-call path not offered)."""
    saved, _library.EAGER_FAST_PATH = _library.EAGER_FAST_PATH, False
    try:
        yield
    finally:
        _library.EAGER_FAST_PATH = saved


def _slow(fn, *tensors):
    """fn's output on the Python path (an input that requires grad), detached."""
    leaves = [t.detach().requires_grad_() if isinstance(t, torch.Tensor) and t.is_floating_point()
              else t for t in tensors]
    with _python_path():
        return fn(*leaves).detach()


@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float64])
@pytest.mark.parametrize("causal", [False, True, "top_left", "bottom_right"])
@pytest.mark.parametrize("shape", [dict(), dict(Hkv=2, Lq=5, Lk=130), dict(Lq=130, Lk=1, D=80, Dv=100)])
def test_attention_takes_it_and_matches_the_python_path(calls, dtype, causal, shape):
    q, k, v = _qkv(dtype=dtype, **shape)
    gqa = k.shape[1] != q.shape[1]

    def fn(q, k, v):
        return fastattn.attention(q, k, v, causal=causal, enable_gqa=gqa)
    out = fn(q, k, v)
    assert calls == [("attention", True)]
    torch.testing.assert_close(out, _slow(fn, q, k, v), rtol=0, atol=0)
    assert len(calls) == 1  # (a gradient to track: not asked)
    ref = fastattn.attention(q, k, v, causal=causal, enable_gqa=gqa, backend="naive")
    torch.testing.assert_close(out, ref, **({} if dtype != torch.bfloat16 else dict(atol=2e-2, rtol=2e-2)))


@pytest.mark.parametrize("is_causal", [False, True])
def test_sdpa_takes_it(calls, is_causal):
    q, k, v = _qkv(Hkv=2)
    out = fastattn.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=0.3, enable_gqa=True)
    assert calls == [("attention", True)]
    ref = F.scaled_dot_product_attention(q, k, v, is_causal=is_causal, scale=0.3, enable_gqa=True)
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("rms", [False, True])
@pytest.mark.parametrize("shape,normalized", [((3, 5, 40), (40,)), ((7, 6, 10), [6, 10]), ((1, 130), 130)])
def test_layer_norm_takes_it_and_matches_the_python_path(calls, rms, shape, normalized):
    x = torch.randn(*shape)
    dims = (normalized,) if isinstance(normalized, int) else tuple(normalized)
    w, b = torch.randn(dims), torch.randn(dims)
    if rms:
        def fn(x, w):
            return fastattn.rms_norm(x, normalized, w, eps=1e-6)
        args = (x, w)
    else:
        def fn(x, w, b):
            return fastattn.layer_norm(x, normalized, w, b)
        args = (x, w, b)
    out = fn(*args)
    assert calls == [("layer_norm", True)]
    torch.testing.assert_close(out, _slow(fn, *args), rtol=0, atol=0)
    ref = (F.rms_norm(x, dims, w, eps=1e-6) if rms else F.layer_norm(x, dims, w, b))
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("activation", ["gelu", "gelu_tanh", "relu", "silu", "swiglu", "geglu"])
def test_ffn_takes_it_and_matches_the_python_path(calls, activation):
    gated = activation in ("swiglu", "geglu")
    x = torch.randn(2, 17, 40)
    w1, b1 = torch.randn((2 if gated else 1) * 24, 40) * 0.1, torch.randn((2 if gated else 1) * 24)
    w2, b2 = torch.randn(40, 24) * 0.1, None

    def fn(x, w1, b1, w2):
        return fastattn.ffn(x, w1, b1, w2, b2, activation)
    out = fn(x, w1, b1, w2)
    assert calls == [("ffn", True)] and out.shape == (2, 17, 40)
    torch.testing.assert_close(out, _slow(fn, x, w1, b1, w2), rtol=0, atol=0)
    torch.testing.assert_close(out, fastattn.ffn(x, w1, b1, w2, b2, activation, backend="naive"),
                               atol=1e-5, rtol=1e-5)


@pytest.mark.parametrize("is_causal", [False, True])
@pytest.mark.parametrize("shape", [(130,), (5, 17), (2, 3, 17, 40), (2, 2, 3, 5, 7)])
def test_softmax_takes_it_and_matches_the_python_path(calls, is_causal, shape):
    if is_causal and len(shape) < 2:
        pytest.skip("is_causal needs (..., Lq, Lk)")
    x = torch.randn(*shape).transpose(-1, 0) if len(shape) == 2 else torch.randn(*shape)

    def fn(x):
        return fastattn.scaled_masked_softmax(x, None, 0.5, is_causal)
    out = fn(x)
    assert calls == [("softmax", True)] and out.shape == x.shape
    torch.testing.assert_close(out, _slow(fn, x), rtol=0, atol=0)
    torch.testing.assert_close(out, fastattn.scaled_masked_softmax(x, None, 0.5, is_causal, backend="naive"),
                               atol=1e-6, rtol=1e-5)


def _paged(B=2, H=4, Hkv=2, Lq=3, D=40, Dv=24, block=16, blocks=4, lens=(40, 7)):
    """A paged cache (num_blocks, block, Hkv, D) of B rows with ``blocks`` blocks each, in a
    shuffled order, and the rows' lengths."""
    g = torch.Generator().manual_seed(0)
    kc = torch.randn(B * blocks, block, Hkv, D, generator=g)
    vc = torch.randn(B * blocks, block, Hkv, Dv, generator=g)
    table = torch.randperm(B * blocks, generator=g).to(torch.int32).view(B, blocks)
    return torch.randn(B, H, Lq, D, generator=g), kc, vc, table, torch.tensor(lens, dtype=torch.int32)


@pytest.mark.parametrize("causal", [False, True, "bottom_right"])
def test_paged_attention_takes_it_and_matches_the_naive_backend(calls, causal):
    q, kc, vc, table, lens = _paged()
    out = fastattn.paged_attention(q, kc, vc, table, lens, causal=causal, scale=0.2)
    assert calls == [("paged_attention", True)]
    ref = fastattn.paged_attention(q, kc, vc, table, lens, causal=causal, scale=0.2, backend="naive")
    torch.testing.assert_close(out, ref, atol=1e-5, rtol=1e-5)
    with pytest.raises(ValueError, match="cache_seqlens"):  # (values: the kernel's own check)
        fastattn.paged_attention(q, kc, vc, table, torch.tensor([40, 65], dtype=torch.int32))


def test_no_grad_takes_it_with_inputs_that_require_grad(calls):
    q, k, v = (t.requires_grad_() for t in _qkv())
    with torch.no_grad():
        fastattn.attention(q, k, v)
    with torch.inference_mode():
        fastattn.attention(*_qkv())
    assert calls == [("attention", True)] * 2


def test_handed_back_where_the_python_path_must_run(calls):
    q, k, v = _qkv()
    x, w = torch.randn(4, 40), torch.randn(40)
    s = torch.randn(2, 5, 7, requires_grad=True)  # a gradient to track, no training path:
    fastattn.scaled_masked_softmax(s, None, 0.5)  # not even asked
    assert calls == []
    with fwAD.dual_level():  # a tangent
        fastattn.attention(fwAD.make_dual(q, torch.randn_like(q)), k, v.detach())

    class Mode(TorchDispatchMode):
        def __torch_dispatch__(self, func, types, args=(), kwargs=None):
            return func(*args, **(kwargs or {}))
    with Mode():
        fastattn.layer_norm(x, (40,), w)
    torch.jit.trace(lambda x: fastattn.layer_norm(x, (40,), w), (x,), check_trace=False)
    torch.vmap(lambda x: fastattn.layer_norm(x, (40,), w))(x[None])
    fastattn.layer_norm(torch._neg_view(x), (40,), w)  # (a negative view)
    with pytest.raises(ValueError, match="eps"):  # (not a float: the Python path decides)
        fastattn.layer_norm(x, (40,), w, eps=True)
    fastattn.attention(q, k, v.detach(), causal=1)  # (nor is this a bool)
    assert calls == [("attention", False)] + [("layer_norm", False)] * 5 + [("attention", False)]


def test_not_asked_where_another_backend_is_chosen(calls, monkeypatch):
    q, k, v = _qkv()
    fastattn.attention(q, k, v, backend="naive")
    with fastattn.use_backend("naive"):
        fastattn.attention(q, k, v)
    monkeypatch.setenv("FASTATTN_BACKEND", "naive")
    fastattn.attention(q, k, v)
    monkeypatch.delenv("FASTATTN_BACKEND")
    fastattn.attention(q, k, v, mask=torch.ones(17, 17, dtype=torch.bool))  # (masks: Python path)
    assert calls == []
    fastattn.attention(q, k, v, backend="cpu")
    assert calls == [("attention", True)]


@pytest.mark.parametrize("call,error", [
    (lambda q, k, v: fastattn.attention(q, k[:, :3], v), ValueError),
    (lambda q, k, v: fastattn.attention(q, k, v[..., :3, :]), ValueError),
    (lambda q, k, v: fastattn.attention(q, k.double(), v), TypeError),
    (lambda q, k, v: fastattn.attention(q, k, v, causal="left"), ValueError),
    (lambda q, k, v: fastattn.attention(q, k, "v"), TypeError),
    (lambda q, k, v: fastattn.layer_norm(q, (41,)), ValueError),
    (lambda q, k, v: fastattn.layer_norm(q, (40,), torch.randn(39)), ValueError),
    (lambda q, k, v: fastattn.layer_norm(q, (40,), eps=-1.0), ValueError),
    (lambda q, k, v: fastattn.ffn(q, torch.randn(8, 39), None, torch.randn(40, 8), None), ValueError),
    (lambda q, k, v: fastattn.ffn(q, torch.randn(8, 40), None, torch.randn(40, 8), None, "tanh"), ValueError),
    (lambda q, k, v: fastattn.scaled_masked_softmax(q[0, 0, 0], None, 1.0, True), ValueError),
    (lambda q, k, v: fastattn.scaled_masked_softmax(q.int()), TypeError),
    (lambda q, k, v: fastattn.paged_attention(q, *_paged()[1:3], _paged()[3].long(), _paged()[4]), TypeError),
    (lambda q, k, v: fastattn.paged_attention(q, *_paged(D=16)[1:]), ValueError),
])
def test_bad_input_still_raises_the_python_paths_error(calls, call, error):
    with pytest.raises(error):
        call(*_qkv())
    assert all(not taken for _, taken in calls)


# ---------------------------------------------------------------------------------------------
# The training path: calls that record a graph.


def _ln_case(rms=False, shape=(3, 5, 40), normalized=(40,), weight=True, bias=True, x_grad=True):
    def make():
        x = torch.randn(*shape, requires_grad=x_grad)
        w = torch.randn(normalized, requires_grad=True) if weight else None
        b = torch.randn(normalized, requires_grad=True) if bias and not rms else None
        if rms:
            return (lambda x, w: fastattn.rms_norm(x, normalized, w, eps=1e-6)), (x, w)
        return (lambda x, w, b: fastattn.layer_norm(x, normalized, w, b)), (x, w, b)
    return "layer_norm", make


def _ffn_case(activation="gelu", b1=True, b2=True, dtype=torch.float32):
    def make():
        gated = activation in ("swiglu", "geglu")
        x = torch.randn(2, 17, 40, dtype=dtype, requires_grad=True)
        w1 = (torch.randn((2 if gated else 1) * 24, 40, dtype=dtype) * 0.1).requires_grad_()
        w2 = (torch.randn(40, 24, dtype=dtype) * 0.1).requires_grad_()
        bias1 = torch.randn(w1.shape[0], dtype=dtype, requires_grad=True) if b1 else None
        bias2 = torch.randn(40, dtype=dtype, requires_grad=True) if b2 else None
        return (lambda x, w1, b1, w2, b2: fastattn.ffn(x, w1, b1, w2, b2, activation)), (x, w1, bias1, w2, bias2)
    return "ffn", make


def _attention_case(causal=False, dtype=torch.float32, sdpa=False, **shape):
    def make():
        q, k, v = (t.requires_grad_() for t in _qkv(dtype=dtype, **shape))
        gqa = k.shape[1] != q.shape[1]
        if sdpa:
            return (lambda q, k, v: fastattn.scaled_dot_product_attention(q, k, v, is_causal=causal, enable_gqa=gqa)), (q, k, v)
        return (lambda q, k, v: fastattn.attention(q, k, v, causal=causal, enable_gqa=gqa)), (q, k, v)
    return "attention", make


_TRAINING_CASES = {
    "ln": _ln_case(), "ln-2d-shape": _ln_case(shape=(7, 6, 10), normalized=(6, 10)),
    "ln-weights-only": _ln_case(x_grad=False), "ln-bias-only": _ln_case(weight=False),
    "ln-no-affine": _ln_case(weight=False, bias=False), "rms": _ln_case(rms=True),
    "ffn-gelu": _ffn_case(), "ffn-swiglu-b2": _ffn_case("swiglu", b1=False),
    "ffn-silu-b1": _ffn_case("silu", b2=False), "ffn-relu-f64": _ffn_case("relu", dtype=torch.float64),
    "attention": _attention_case(), "attention-causal": _attention_case(causal=True),
    "attention-bottom-right-gqa": _attention_case("bottom_right", Hkv=2, Lq=5, Lk=130),
    "attention-bf16": _attention_case(True, dtype=torch.bfloat16),
    "sdpa-f64-d80": _attention_case(True, dtype=torch.float64, sdpa=True, Lq=130, Lk=1, D=80, Dv=100),
}


def _run_training(make, python_path):
    """(output, gradients of every input that requires one, the graph's node names)."""
    torch.manual_seed(0)
    fn, inputs = make()
    with _python_path() if python_path else contextlib.nullcontext():
        out = fn(*inputs)
    leaves = [t for t in inputs if t is not None and t.requires_grad]
    cot = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(out.dtype)
    return out, torch.autograd.grad(out, leaves, cot), graph_nodes(out)


@pytest.mark.parametrize("case", list(_TRAINING_CASES))
def test_training_path_takes_it_and_matches_the_python_path(calls, case):
    op, make = _TRAINING_CASES[case]
    out, grads, nodes = _run_training(make, python_path=False)
    assert calls == [(op, True)]
    assert any("CppNode" in n for n in nodes), nodes  # (the C++ node, not _EagerAutograd)
    ref_out, ref_grads, ref_nodes = _run_training(make, python_path=True)
    assert not any("CppNode" in n for n in ref_nodes), ref_nodes
    assert len(calls) == 1
    assert torch.equal(out, ref_out)
    assert len(grads) == len(ref_grads)
    for g, r in zip(grads, ref_grads):
        assert torch.equal(g, r)


def test_training_path_double_backward_is_the_formulas(calls):
    """create_graph=True through attention's training path: the node hands the backward to the
    Python formula's differentiable one (attention._differentiable_backward), so the gradient of
    a gradient is the Python path's, bit for bit, and right (gradgradcheck)."""
    _, make = _attention_case(causal=True, dtype=torch.float64, B=1, H=2, Hkv=1, Lq=5, Lk=7, D=8, Dv=8)

    def second(python_path):
        torch.manual_seed(0)
        fn, inputs = make()
        with _python_path() if python_path else contextlib.nullcontext():
            out = fn(*inputs)
        g = torch.autograd.grad(out, inputs, torch.ones_like(out), create_graph=True)
        return torch.autograd.grad(sum((t * t).sum() for t in g), inputs)

    fast, ref = second(False), second(True)
    assert calls == [("attention", True)]
    for a, b in zip(fast, ref):
        assert torch.equal(a, b)
    fn, inputs = make()
    assert torch.autograd.gradgradcheck(fn, inputs)


def test_training_path_keeps_autograds_rules(calls):
    """The node saves its tensors as autograd does: an input changed in place before backward is
    an error, and a second backward without retain_graph is one too."""
    x, w = torch.randn(4, 40, requires_grad=True), torch.randn(40, requires_grad=True)
    y = fastattn.layer_norm(x, (40,), w)
    with torch.no_grad():
        w.add_(1.0)
    with pytest.raises(RuntimeError, match="modified by an inplace operation"):
        y.sum().backward()
    q, k, v = (t.requires_grad_() for t in _qkv())
    out = fastattn.attention(q, k, v)
    out.sum().backward()
    with pytest.raises(RuntimeError, match="backward through the graph a second time"):
        out.sum().backward()
    assert calls == [("layer_norm", True), ("attention", True)]


def test_training_path_hands_back_attention_without_a_unit_last_stride(calls):
    """q, k, v with a strided last dim would need copies made inside the node, off the graph that
    create_graph differentiates: that call takes the Python path."""
    q, k, v = _qkv()
    q = q.transpose(-1, -2).contiguous().transpose(-1, -2).requires_grad_()
    out = fastattn.attention(q, k, v)
    assert calls == [("attention", False)]
    out.sum().backward()
    assert q.grad is not None


def test_training_path_under_saved_tensor_hooks_and_checkpointing(calls):
    """Saved-tensor hooks see the node's tensors (offloading, non-reentrant checkpointing), and a
    checkpointed block's gradients are the plain block's."""
    torch.manual_seed(0)
    x = torch.randn(2, 17, 32, requires_grad=True)
    w, b = torch.randn(32, requires_grad=True), torch.randn(32, requires_grad=True)
    w1, w2 = (torch.randn(64, 32) * 0.1).requires_grad_(), (torch.randn(32, 64) * 0.1).requires_grad_()

    def block(x):
        h = fastattn.layer_norm(x, (32,), w, b)
        q = h.view(2, 17, 4, 8).transpose(1, 2)
        a = fastattn.attention(q, q, q, causal=True).transpose(1, 2).reshape(2, 17, 32)
        return fastattn.ffn(a, w1, None, w2, None, "gelu")

    leaves = (x, w, b, w1, w2)
    plain = torch.autograd.grad(block(x).sum(), leaves)
    packed = []

    def pack(t):
        packed.append(t.shape)
        return t
    with torch.autograd.graph.saved_tensors_hooks(pack, lambda t: t):
        hooked = torch.autograd.grad(block(x).sum(), leaves)
    assert len(packed) >= 4 + 5 + 4  # (layer_norm's, attention's and ffn's saved tensors at least)
    checkpointed = torch.autograd.grad(
        torch.utils.checkpoint.checkpoint(block, x, use_reentrant=False).sum(), leaves)
    for a, h, c in zip(plain, hooked, checkpointed):
        assert torch.equal(a, h) and torch.equal(a, c)
    assert {taken for _, taken in calls} == {True}
