"""One contract per op: define_op registered every op's C++ and Triton twins with one schema, and
the registry checks each backend's declared capability before any kernel runs."""

import re

import pytest
import torch

import fastattn
from fastattn import _extension, backends
from fastattn.ops import _library

from conftest import graph_nodes


def _normalized(op) -> str:
    """An op's schema without its name, in one spelling: torch infers a Triton launcher's ``int``
    as ``SymInt`` and ``list[bool]`` as ``bool[]``, and leaves its returns unnamed."""
    text = str(op.default._schema)
    text = text[text.index("("):]
    text = text.replace("SymInt", "int")
    text = re.sub(r"bool\[\d+\]", "bool[]", text)
    args, returns = text.split(" -> ")
    returns = re.sub(r"(Tensor\??)\s+\w+", r"\1", returns)
    return f"{args} -> {returns}"


PAIRS = [
    (op, part)
    for op, d in sorted(_library.DEFINED.items())
    for part in ("fwd", "bwd", "jvp")
    if d.cpp is not None and d.triton is not None and getattr(d.cpp, part) is not None
]


def test_every_op_is_defined_once_for_every_backend():
    assert {"attention", "softmax", "layer_norm", "ffn", "rope", "varlen_attention", "paged_attention"} <= set(
        _library.DEFINED
    )
    for op, d in _library.DEFINED.items():
        assert "naive" in backends.implementations(op), op


@pytest.mark.skipif(not _extension.loaded(), reason=str(_extension.error()))
@pytest.mark.parametrize("op,part", PAIRS)
def test_cpp_and_triton_ops_share_one_schema(op, part):
    d = _library.DEFINED[op]
    cpp = getattr(torch.ops.fastattn, f"{d.kernel}_{part}")
    triton = getattr(torch.ops.fastattn, f"triton_{d.kernel}_{part}")
    assert _normalized(cpp) == _normalized(triton)


def test_schema_normalization_can_tell_schemas_apart():
    if len(PAIRS) < 2:
        pytest.skip("needs the extension and triton")
    (a, pa), (b, pb) = PAIRS[0], PAIRS[1]
    da, db = _library.DEFINED[a], _library.DEFINED[b]
    assert _normalized(getattr(torch.ops.fastattn, f"{da.kernel}_{pa}")) != _normalized(
        getattr(torch.ops.fastattn, f"triton_{db.kernel}_{pb}")
    )


def test_a_stale_extension_refuses_the_op_with_a_rebuild_hint():
    if not _extension.loaded():
        pytest.skip(str(_extension.error()))
    fake = lambda x: torch.empty_like(x)  # noqa: E731
    _library.define_op("stale_probe", kernel="stale_probe_not_in_extension", fake_fwd=fake, naive=lambda x: x * 2)
    try:
        with pytest.raises(ValueError, match="built before fastattn::stale_probe_not_in_extension_fwd.*rebuild"):
            backends.select("stale_probe", torch.device("cpu"), "cpu")
        # the automatic choice passes over it to naive
        name, impl = backends.select("stale_probe", torch.device("cpu"))
        assert name == "naive" and impl(torch.ones(2)).tolist() == [2.0, 2.0]
    finally:
        for b in backends._REGISTRY.values():
            b.impls.pop("stale_probe", None)
            b.missing.pop("stale_probe", None)
            b.caps.pop("stale_probe", None)
        _library.DEFINED.pop("stale_probe", None)


@pytest.fixture
def probe_backend():
    calls = []

    def impl(x, mask, scale, is_causal):
        calls.append(x.shape)
        return torch.softmax(x * scale, -1)

    backends.register_backend("softmax", "probe", impl, devices=("cpu",), dtypes=(torch.float64,))
    yield calls
    del backends._REGISTRY["probe"]


def test_select_refuses_outside_the_declared_capability_before_the_kernel(probe_backend):
    x = torch.randn(2, 3, dtype=torch.float64)
    torch.testing.assert_close(fastattn.scaled_masked_softmax(x, backend="probe"), torch.softmax(x, -1))
    assert len(probe_backend) == 1
    with pytest.raises(ValueError, match="backend 'probe'.*cannot run softmax: it does not take torch.float32"):
        fastattn.scaled_masked_softmax(x.float(), backend="probe")
    assert len(probe_backend) == 1  # never called
    assert backends.capability("softmax", "probe").dtypes == (torch.float64,)


def test_limits_are_checked_with_the_call_facts():
    seen = []

    def limits(n=None, **_):
        seen.append(n)
        return f"rows of {n} > 4" if n is not None and n > 4 else None

    backends.register_backend("limit_probe", "probe2", lambda x: x, devices=("cpu",), limits=limits)
    try:
        backends.select("limit_probe", torch.device("cpu"), "probe2", n=3)
        with pytest.raises(ValueError, match="cannot run limit_probe: rows of 5 > 4"):
            backends.select("limit_probe", torch.device("cpu"), "probe2", n=5)
        # a choice select remembers is held to the limits of every later call
        backends.select("limit_probe", torch.device("cpu"), "probe2", n=4)
        with pytest.raises(ValueError, match="rows of 6 > 4"):
            backends.select("limit_probe", torch.device("cpu"), "probe2", n=6)
        assert seen[0] == 3 and set(seen[1:]) == {4, 5, 6}  # (a refused call may ask twice)
    finally:
        del backends._REGISTRY["probe2"]


def test_register_backend_wants_a_callable():
    with pytest.raises(TypeError, match="must be callable"):
        backends.register_backend("softmax", "probe3", None)


def test_attention_limits_refuse_before_the_kernel():
    if "triton" not in backends.available_backends():
        pytest.skip("triton is not available")
    q = torch.randn(1, 1, 2, 300)
    with pytest.raises(ValueError, match="backend 'triton'.*cannot run attention: head dim 300 > 256"):
        fastattn.attention(q, q, q, backend="triton")
    # the automatic choice is never triton on a CPU tensor; the registry names who can
    with pytest.raises(ValueError, match="backends that can: .*naive"):
        backends.select("attention", torch.device("cpu"), "triton", torch.float32, head_dim=300)


def test_cuda_attention_declares_16_bit_inputs_only():
    if "attention" not in backends._REGISTRY["cuda"].impls:
        pytest.skip("the extension has no CUDA kernels")
    cap = backends.capability("attention", "cuda")
    assert cap.dtypes == (torch.float16, torch.bfloat16)
    assert cap.limits(head_dim=512) and cap.limits(head_dim=128, lq=1 << 30)


def _eager_fast_path_calls():
    """One call per op with a backward, on the cpu backend: (function of the inputs, inputs)."""
    g = torch.Generator().manual_seed(0)

    def rand(*shape):
        return torch.randn(*shape, generator=g, dtype=torch.float64)

    x, res, w, b = rand(3, 5, 16), rand(3, 5, 16), rand(16), rand(16)
    w1, b1, w2, b2 = rand(24, 16), rand(24), rand(16, 24), rand(16)
    s, mask = rand(2, 3, 7, 9), rand(7, 9)
    q = rand(1, 2, 6, 8)
    cpu = dict(backend="cpu")
    return [
        (lambda x, res, w, b: fastattn.add_layer_norm(x, res, 16, w, b, **cpu), (x, res, w, b)),
        (lambda x, w: fastattn.rms_norm(x, 16, w, **cpu), (x, w)),
        (lambda x, w1, b1, w2, b2: fastattn.ffn(x, w1, b1, w2, b2, "gelu", **cpu), (x, w1, b1, w2, b2)),
        (lambda s, mask: fastattn.scaled_masked_softmax(s, mask, 0.5, True, **cpu), (s, mask)),
        (lambda q: fastattn.rope(q, **cpu), (q,)),
    ]


@pytest.mark.skipif(not _extension.loaded(), reason=str(_extension.error()))
@pytest.mark.parametrize("case", range(5))
def test_the_eager_fast_path_applies_the_registered_formula(case, monkeypatch):
    """In plain eager mode a registered op with a gradient to compute runs through
    _library._EagerAutograd (torch.library's autograd layer costs ~25 us a call); elsewhere
    (torch.compile, functorch transforms) torch.library's own autograd runs. Same formula, same
    kernels: same bits. (The one-call path, which takes some of these calls in C++, is held to
    the same bits by tests/test_eager_fast_path.py; here it is not offered.)"""
    fn, inputs = _eager_fast_path_calls()[case]
    monkeypatch.setattr(_library, "EAGER_FAST_PATH", False)

    def grads(fast):
        leaves = [t.clone().requires_grad_() for t in inputs]
        out = fn(*leaves)
        outs = out if isinstance(out, tuple) else (out,)
        nodes = graph_nodes(outs[0])
        assert any("_EagerAutograd" in n for n in nodes) == fast, nodes
        cots = [torch.full_like(o, 0.5) + torch.arange(o.numel(), dtype=o.dtype).view(o.shape) / 7
                for o in outs]
        return outs, torch.autograd.grad(outs, leaves, cots)

    fast = grads(True)
    with monkeypatch.context() as m:
        m.setattr(_library, "plain_eager", lambda: False)
        library = grads(False)
    for a, b in zip([*fast[0], *fast[1]], [*library[0], *library[1]]):
        assert torch.equal(a, b)
    with torch.no_grad():  # nothing to differentiate: no graph at all
        out = fn(*inputs)
    assert all(o.grad_fn is None for o in (out if isinstance(out, tuple) else (out,)))


def _mode_calls(backend, device):
    """(public call, its inputs, the registered op a dispatch mode must see), small inputs."""
    kernel = "" if backend in ("cpu", "cuda") else f"{backend}_"
    x, w, b = (torch.randn(*s, device=device) for s in ((8, 32), (32,), (32,)))
    return [
        (lambda x, w, b: fastattn.layer_norm(x, (32,), w, b, backend=backend), (x, w, b),
         f"{kernel}layer_norm_fwd"),
        (lambda s: fastattn.scaled_masked_softmax(s, None, 0.5, backend=backend),
         (torch.randn(2, 3, 5, 7, device=device),), f"{kernel}softmax_fwd"),
        (lambda q: fastattn.attention(q, q, q, backend=backend),
         (torch.randn(1, 2, 9, 16, device=device),), f"{kernel}attention_fwd"),
    ]


@pytest.mark.parametrize("backend", ["cpu", "triton", "cuda"])
def test_dispatch_modes_see_the_registered_op(backend):
    """The eager fast paths (below autograd; a Python op's own function without the dispatcher)
    step aside under a dispatch mode: make_fx / export tracing and FakeTensorMode must meet the
    registered op and its fake implementation, never the kernels inside it (calling a Triton op's
    function directly there once reached the launcher with fake tensors)."""
    from torch.fx.experimental.proxy_tensor import make_fx

    from conftest import backend_params
    param = next(p for p in backend_params("layer_norm") if p.values[0] == backend)
    if param.marks:
        pytest.skip(param.marks[0].kwargs["reason"])
    for call, inputs, op in _mode_calls(backend, param.values[1]):
        graph = make_fx(call, tracing_mode="fake")(*inputs).graph
        targets = [str(n.target) for n in graph.nodes if n.op == "call_function"]
        assert f"fastattn.{op}.default" in targets, (op, targets)


def test_eager_first_calls_a_python_ops_function_in_a_plain_backward(monkeypatch):
    """``_library.eager_first``: the fast path's backward ops call the op's own function where
    grad mode is off in plain eager mode, and the registered op anywhere else (create_graph,
    tracing); C++ ops keep their dispatcher callable."""
    calls = []

    class PythonOp:  # a torch.library.CustomOpDef's shape: its default kernel only
        _backend_fns = {None: object()}

        def _init_fn(self, x):
            calls.append("function")
            return x

        def __call__(self, x):
            calls.append("op")
            return x

    bwd = _library.eager_first(PythonOp())
    with torch.no_grad():
        bwd(1)
    bwd(2)  # grad mode on (a double backward)
    monkeypatch.setattr(_library, "plain_eager", lambda: False)
    with torch.no_grad():
        bwd(3)
    assert calls == ["function", "op", "op"]
    assert _library.eager_first(None) is None
    if _extension.loaded():
        op = torch.ops.fastattn.layer_norm_bwd.default
        assert _library.eager_first(op) is not op and _library.op_callable(op) is op._op


@pytest.mark.parametrize("backend", ["cpu", "triton"])
def test_the_backward_fast_path_gives_the_registered_ops_bits(backend, monkeypatch):
    """Forward and backward through the eager fast paths (the op's own function, eager_first's
    backward) equal torch.library's path, bit for bit."""
    from conftest import backend_params
    param = next(p for p in backend_params("layer_norm") if p.values[0] == backend)
    if param.marks:
        pytest.skip(param.marks[0].kwargs["reason"])
    g = torch.Generator().manual_seed(3)
    x, w, b = (torch.randn(*s, generator=g) for s in ((5, 40), (40,), (40,)))

    def grads():
        leaves = [t.clone().requires_grad_() for t in (x, w, b)]
        y = fastattn.layer_norm(leaves[0], (40,), leaves[1], leaves[2], backend=backend)
        return (y, *torch.autograd.grad(y, leaves, torch.linspace(-1, 1, y.numel()).view(y.shape)))

    fast = grads()
    monkeypatch.setattr(_library, "plain_eager", lambda: False)
    for a, b_ in zip(fast, grads()):
        assert torch.equal(a, b_)
