"""Forward-mode AD (JVP) and double backward through fastattn.attention (issue 18).

float64 gradcheck (with check_forward_ad) and gradgradcheck on the cpu and naive backends for
every mask kind, the band, GQA and fully masked rows; the fused JVP kernels (cpu, and triton
under the interpreter) against the NumPy float64 reference; torch.func.jvp under vmap, jacfwd,
and the refusal of a backend without a JVP kernel. Shapes are tiny.
"""

import pytest
import torch
import torch.autograd.forward_ad as fwAD

import fastattn
from fastattn import backends, reference
from fastattn.testing import to_numpy

from conftest import backend_params

JVP_BACKENDS = [p for p in backend_params("attention") if p.values[0] in ("cpu", "naive", "triton")]
F64_BACKENDS = [p for p in JVP_BACKENDS if p.values[0] in ("cpu", "naive")]


def _gen(seed=0):
    return torch.Generator().manual_seed(seed)


def _mask(kind, B, H, Lq, Lk, dtype, g):
    """(mask, causal, window) for a mask kind; float masks want gradients and tangents."""
    if kind == "none":
        return None, False, None
    if kind == "bool":
        m = torch.rand(B, H, Lq, Lk, generator=g) > 0.3
        m[..., 0] = True
        return m, False, None
    if kind == "float":
        m = torch.randn(1, H, Lq, Lk, generator=g, dtype=torch.float64).to(dtype)
        m[..., 1, 2] = float("-inf")
        return m.requires_grad_(), False, None
    if kind == "causal":
        return None, True, None
    if kind == "bottom_right":
        return None, "bottom_right", None
    if kind == "window":
        return None, False, (2, 1)
    if kind == "padding":  # key padding (B, 1, 1, Lk)
        keep = torch.arange(Lk)[None, :] < torch.tensor([Lk, 3][:B])[:, None]
        return keep.view(B, 1, 1, Lk), False, None
    if kind == "dead-rows":  # rows 0 and 3 attend nothing
        m = torch.ones(B, 1, Lq, Lk, dtype=torch.bool)
        m[:, :, 0] = False
        m[:, :, 3] = False
        return m, False, None
    raise ValueError(kind)


def _qkv(B, H, Hkv, Lq, Lk, D, Dv, dtype, g):
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(dtype).requires_grad_()  # noqa: E731
    return mk(B, H, Lq, D), mk(B, Hkv, Lk, D), mk(B, Hkv, Lk, Dv)


MASKS = ["none", "bool", "float", "causal", "bottom_right", "window", "padding", "dead-rows"]
# every mask kind with one head per kv head; GQA with the kinds whose gradients it reshapes
GRADCHECK_CASES = [(kind, False) for kind in MASKS] + [("float", True), ("causal", True), ("padding", True)]


@pytest.mark.parametrize("backend,device", F64_BACKENDS)
@pytest.mark.parametrize("kind,gqa", GRADCHECK_CASES, ids=lambda x: x if isinstance(x, str) else ("gqa" if x else "mha"))
def test_gradcheck_forward_ad_and_double_backward(backend, device, kind, gqa, one_thread):
    B, H, Hkv, Lq, Lk, D, Dv = 2, 2, 1 if gqa else 2, 5, 6, 3, 2
    g = _gen(hash((kind, gqa)) % 1000)
    q, k, v = _qkv(B, H, Hkv, Lq, Lk, D, Dv, torch.float64, g)
    mask, causal, window = _mask(kind, B, H, Lq, Lk, torch.float64, g)

    def f(q, k, v, *m):
        return fastattn.attention(q, k, v, m[0] if m else mask, causal=causal, window=window,
                                  enable_gqa=gqa, backend=backend)

    inputs = (q, k, v) + ((mask,) if kind == "float" else ())
    # fast_mode: the Jacobians projected on random vectors (every entry takes part), not built
    assert torch.autograd.gradcheck(f, inputs, check_forward_ad=True, check_batched_grad=False, fast_mode=True)
    assert torch.autograd.gradgradcheck(f, inputs, fast_mode=True)
    if kind == "dead-rows":  # tangent 0 (not NaN) on the rows that attend nothing
        tangents = tuple(torch.randn_like(t) for t in inputs)
        _, tout = torch.func.jvp(f, tuple(t.detach() for t in inputs), tangents)
        assert torch.isfinite(tout).all() and (tout[:, :, [0, 3]] == 0).all()


@pytest.mark.parametrize("backend,device", F64_BACKENDS)
def test_gradcheck_with_dropout_and_lse(backend, device, one_thread):
    """Dropout as in the forward (same keep-mask), and the lse output: its tangent and its
    reverse-mode gradient (the fused backends take the differentiable backward for it)."""
    B, H, Lq, Lk, D = 1, 2, 5, 7, 3
    g = _gen(3)
    q, k, v = _qkv(B, H, H, Lq, Lk, D, D, torch.float64, g)
    m = torch.randn(B, H, Lq, Lk, generator=g, dtype=torch.float64).requires_grad_()

    def f(q, k, v, m):
        return fastattn.attention(q, k, v, m, causal=True, dropout_p=0.3, seed=11, backend=backend)

    assert torch.autograd.gradcheck(f, (q, k, v, m), check_forward_ad=True, check_batched_grad=False,
                                    fast_mode=True)
    assert torch.autograd.gradgradcheck(f, (q, k, v, m), fast_mode=True)

    def lse_of(q, k, v, m):  # float32 statistics: compared to naive's, not gradchecked
        return fastattn.attention(q, k, v, m, causal=True, return_lse=True, backend=backend)[1]

    tq, tk, tv, tm = (torch.randn_like(t) for t in (q, k, v, m))
    _, tlse = torch.func.jvp(lse_of, (q, k, v, m), (tq, tk, tv, tm))
    _, ref = reference.attention_jvp(to_numpy(q), to_numpy(k), to_numpy(v), to_numpy(m), to_numpy(tq),
                                     to_numpy(tk), to_numpy(tv), to_numpy(tm), causal=True)
    torch.testing.assert_close(tlse.double(), torch.from_numpy(ref), rtol=1e-5, atol=1e-5)
    w = torch.randn(B, H, Lq, generator=g, dtype=torch.float64)
    grads = torch.autograd.grad((lse_of(q, k, v, m).double() * w).sum(), (q, k, m))
    lse_n = fastattn.attention(q, k, v, m, causal=True, return_lse=True, backend="naive")[1]
    expect = torch.autograd.grad((lse_n.double() * w).sum(), (q, k, m))
    for a, b in zip(grads, expect):
        torch.testing.assert_close(a, b, rtol=1e-5, atol=1e-6)


# (B, H, Hkv, Lq, Lk, D, Dv, mask kind, dropout_p)
KERNEL_CASES = [
    (1, 2, 2, 17, 17, 16, 16, "float", 0.0),
    (2, 2, 1, 9, 17, 40, 24, "padding", 0.0),    # MQA, D != Dv
    (1, 4, 2, 33, 17, 16, 16, "causal", 0.25),   # GQA, dropout
    (1, 2, 2, 20, 20, 16, 16, "window", 0.0),
    (1, 1, 1, 9, 9, 16, 16, "dead-rows", 0.0),
]


@pytest.mark.parametrize("backend,device", JVP_BACKENDS)
@pytest.mark.parametrize("case", KERNEL_CASES, ids=lambda c: f"{c[1]}/{c[2]}x{c[3]}x{c[4]}-{c[7]}-p{c[8]}")
def test_fused_jvp_matches_the_float64_reference(backend, device, case, one_thread):
    B, H, Hkv, Lq, Lk, D, Dv, kind, p = case
    g = _gen(7)
    q, k, v = (t.detach().to(device) for t in _qkv(B, H, Hkv, Lq, Lk, D, Dv, torch.float32, g))
    mask, causal, window = _mask(kind, B, H, Lq, Lk, torch.float32, g)
    mask = None if mask is None else mask.detach().to(device)
    primals = [q, k, v] + ([mask] if kind == "float" else [])
    tangents = [torch.randn(t.shape, generator=g).to(device) for t in primals]

    def f(q, k, v, *m):
        return fastattn.attention(q, k, v, m[0] if m else mask, causal=causal, window=window,
                                  dropout_p=p, seed=5, enable_gqa=H != Hkv, return_lse=True,
                                  backend=backend)

    (out, lse), (tout, tlse) = torch.func.jvp(f, tuple(primals), tuple(tangents))
    tm = to_numpy(tangents[3]) if kind == "float" else None
    ref_out, ref_lse = reference.attention_jvp(
        *(to_numpy(t) for t in (q, k, v)), None if mask is None else mask.cpu().numpy(),  # bool stays bool
        *(to_numpy(t) for t in tangents[:3]), tm, causal=causal, window=window, dropout_p=p,
        seed=5, enable_gqa=H != Hkv)
    torch.testing.assert_close(tout.cpu().double(), torch.from_numpy(ref_out), rtol=2e-4, atol=2e-4)
    torch.testing.assert_close(tlse.cpu().double(), torch.from_numpy(ref_lse), rtol=2e-4, atol=2e-4)
    # the primal is the forward's, and forward_ad (dual tensors) gives the same tangent
    torch.testing.assert_close(out, f(*primals)[0])
    if kind != "float":
        return
    with fwAD.dual_level():
        dual = [fwAD.make_dual(x, t) for x, t in zip(primals, tangents)]
        tout2 = fwAD.unpack_dual(f(*dual)[0]).tangent
    torch.testing.assert_close(tout2, tout)


@pytest.mark.parametrize("backend,device", JVP_BACKENDS)
def test_jvp_under_vmap_and_jacfwd(backend, device, one_thread):
    B, H, Lq, Lk, D = 1, 1, 4, 6, 4
    g = _gen(9)
    q, k, v = (t.detach().to(device) for t in _qkv(B, H, H, Lq, Lk, D, D, torch.float32, g))

    def f(q, k, v):
        return fastattn.attention(q, k, v, causal="bottom_right", backend=backend)

    tq = torch.randn(3, *q.shape, generator=g).to(device)
    tv = torch.randn(3, *v.shape, generator=g).to(device)
    batched = torch.func.vmap(lambda a, b: torch.func.jvp(f, (q, k, v), (a, torch.zeros_like(k), b))[1])(tq, tv)
    for i in range(3):
        one = torch.func.jvp(f, (q, k, v), (tq[i], torch.zeros_like(k), tv[i]))[1]
        torch.testing.assert_close(batched[i], one, rtol=1e-5, atol=1e-5)
    # jacfwd (vmap of jvp over the basis) equals jacrev
    small = lambda q: f(q, k, v)[:, :, :2]  # noqa: E731
    torch.testing.assert_close(torch.func.jacfwd(small)(q), torch.func.jacrev(small)(q),
                               rtol=1e-4, atol=1e-5)


@pytest.mark.parametrize("backend,device", [p for p in JVP_BACKENDS if p.values[0] != "naive"])
def test_double_backward_matches_naive(backend, device, one_thread):
    """create_graph=True through the fused backward (the differentiable pieces), float32."""
    B, H, Lq, Lk, D = 1, 2, 7, 9, 8
    g = _gen(4)
    q, k, v = (t.detach().to(device).requires_grad_() for t in _qkv(B, H, 1, Lq, Lk, D, D, torch.float32, g))
    w = torch.randn(B, H, Lq, D, generator=g).to(device)

    def hvp(bk):
        out = fastattn.attention(q, k, v, causal=True, window=(3, None), enable_gqa=True, backend=bk)
        gq, gk, gv = torch.autograd.grad((out * w).sum(), (q, k, v), create_graph=True)
        return torch.autograd.grad((gq.square().sum() + (gk * gv[..., :D]).sum()), (q, k, v))

    for a, b in zip(hvp(backend), hvp("naive")):
        torch.testing.assert_close(a, b, rtol=1e-4, atol=1e-5)


def test_sdpa_and_nn_modules_take_jvp(one_thread):
    """torch.func.jvp through scaled_dot_product_attention and a fastattn.nn module equals the
    naive backend's (torch's own forward AD)."""
    g = _gen(2)
    x = torch.randn(2, 5, 16, generator=g)
    tx = torch.randn(2, 5, 16, generator=g)
    mha = fastattn.nn.MultiheadAttention(16, 2, batch_first=True)
    params = dict(mha.named_parameters())
    tangents = {n: torch.randn(p.shape, generator=g) for n, p in params.items()}

    def run(x, params):
        return torch.func.functional_call(mha, params, (x, x, x), kwargs={"need_weights": False})[0]

    got = torch.func.jvp(run, (x, params), (tx, tangents))
    with fastattn.use_backend("naive"):
        want = torch.func.jvp(run, (x, params), (tx, tangents))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)

    q, k, v = (torch.randn(3, 2, 4, 8, generator=g) for _ in range(3))
    f = lambda q: fastattn.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    t = torch.randn(q.shape, generator=g)
    sdpa = lambda q: torch.nn.functional.scaled_dot_product_attention(q, k, v, is_causal=True)  # noqa: E731
    with torch.nn.attention.sdpa_kernel(torch.nn.attention.SDPBackend.MATH):
        want = torch.func.jvp(sdpa, (q,), (t,))
    torch.testing.assert_close(torch.func.jvp(f, (q,), (t,)), want, rtol=1e-4, atol=1e-5)


def test_backend_without_jvp_is_refused():
    """Forward mode on a backend without a JVP kernel is a ValueError from backend selection
    (the cuda backend's case), and the automatic choice passes over it."""
    name = "test_jvp_less"
    backends.register_backend("attention", name, lambda *a: (_ for _ in ()).throw(AssertionError("ran")),
                              devices=("cpu",))
    backends.note_missing_feature("attention", name, "jvp", "it has no forward-mode AD (JVP) kernel")
    q = torch.randn(1, 1, 3, 4)
    with pytest.raises(ValueError, match="test_jvp_less.*no forward-mode AD"):
        torch.func.jvp(lambda q: fastattn.attention(q, q, q, backend=name), (q,), (q,))
    with pytest.raises(ValueError, match="test_jvp_less.*no forward-mode AD"):
        backends.select("attention", q.device, name, q.dtype, needs=("jvp",))
    assert backends.select("attention", q.device, None, q.dtype, needs=("jvp",))[0] != name
    # a user's backend that declares nothing is trusted with forward mode (its autograd decides)
    backends.register_backend("attention", "test_jvp_plain", backends._REGISTRY["naive"].impls["attention"],
                              devices=("cpu",))
    plain = lambda q: fastattn.attention(q, q, q, backend="test_jvp_plain")  # noqa: E731
    torch.testing.assert_close(torch.func.jvp(plain, (q,), (q,)),
                               torch.func.jvp(lambda q: fastattn.attention(q, q, q, backend="naive"), (q,), (q,)))
    for b in backends.implementations("attention"):
        if b in ("cuda",):
            assert "jvp" not in backends._REGISTRY[b].features.get("attention", ())


def test_docs_examples_run(capsys, one_thread):
    """docs/jvp.md's code (a MeanFlow training step through fastattn.nn, a Hessian-vector
    product) runs as written, and the MeanFlow loss is finite."""
    import pathlib
    import re

    text = (pathlib.Path(__file__).resolve().parents[1] / "docs" / "jvp.md").read_text()
    blocks = re.findall(r"```python\n(.*?)```", text, flags=re.S)
    assert len(blocks) == 2
    namespace: dict = {}
    for block in blocks:
        exec(compile(block, "docs/jvp.md", "exec"), namespace)  # noqa: S102 - our own docs
    losses = [float(x) for x in re.findall(r"loss (\S+)", capsys.readouterr().out)]
    assert len(losses) == 3 and all(torch.isfinite(torch.tensor(losses)))
    assert all(h.shape == t.shape and torch.isfinite(h).all() for h, t in zip(namespace["hvp"], (namespace["q"],) * 3))


def _jvp_ops():
    params = []
    for name, backend in (("attention_jvp", "cpu"), ("triton_attention_jvp", "triton")):
        overload = getattr(torch.ops.fastattn, name, None)
        if overload is not None and "jvp" in backends._REGISTRY[backend].features.get("attention", ()):
            params.append(pytest.param(overload.default, "cuda" if torch.cuda.is_available() and backend == "triton"
                                       else "cpu", id=name))
    return params


@pytest.mark.parametrize("op,device", _jvp_ops())
def test_opcheck_jvp_ops(op, device, one_thread):
    """The JVP ops are real custom ops: schema, fake impl and eager agree (opcheck); their vmap
    rule (the vmapped dim folded into the batch) equals a loop, absent tangents included."""
    g = _gen(1)
    q, k, v = (torch.randn(*s, generator=g).to(device) for s in ((1, 2, 5, 16), (1, 1, 7, 16), (1, 1, 7, 16)))
    mask = torch.randn(1, 1, 5, 7, generator=g).to(device).expand(1, 2, 5, 7)
    tq, tk, tv, tm = (torch.randn(t.shape, generator=g).to(device) for t in (q, k, v, mask))
    torch.library.opcheck(op, (q, k, v, mask, tq, tk, tv, tm, 0.25, 2, 3, 0, 0.0, 0))
    tvs = torch.randn(3, *v.shape, generator=g).to(device)
    batched = torch.vmap(lambda t: op(q, k, v, mask, None, None, t, None, 0.25, 2, 3, 0, 0.0, 0)[0])(tvs)
    for i in range(3):
        torch.testing.assert_close(batched[i], op(q, k, v, mask, None, None, tvs[i], None, 0.25, 2, 3, 0, 0.0, 0)[0])


@pytest.mark.parametrize("op,device", [p for p in _jvp_ops() if p.id == "triton_attention_jvp"])
def test_triton_jvp_op_checks_its_arguments(op, device):
    """Called directly through torch.ops, the Triton JVP op checks its tangents (fastattn.ops),
    a mask tangent without a float mask included, before any kernel runs."""
    q = torch.randn(1, 2, 5, 16, device=device)
    kv = torch.randn(1, 1, 7, 16, device=device)
    with pytest.raises(ValueError, match="tmask"):
        op(q, kv, kv, None, None, None, None, torch.zeros(1, 2, 5, 7, device=device), 0.25, 0, 7, 7, 0.0, 0)
    with pytest.raises(ValueError, match="tq must have shape"):
        op(q, kv, kv, None, q[:, :1], None, None, None, 0.25, 0, 7, 7, 0.0, 0)


@pytest.mark.parametrize("backend,device", [p for p in JVP_BACKENDS if p.values[0] != "naive"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16], ids=["bf16", "fp16"])
def test_fused_jvp_16bit_within_twice_naives_error(backend, device, dtype, one_thread):
    """16-bit inputs: the fused JVP's error against the float64 reference (of the same rounded
    inputs) is at most twice the naive backend's (torch's forward AD, float32 inside) + slack."""
    from fastattn.testing import assert_close_to_reference

    B, H, Hkv, Lq, Lk, D = 1, 4, 2, 19, 23, 32
    g = _gen(12)
    q, k, v = (t.detach().to(device) for t in _qkv(B, H, Hkv, Lq, Lk, D, D, dtype, g))
    m = (torch.randn(1, 1, Lq, Lk, generator=g) * 0.5).to(device, dtype)
    prim = (q, k, v, m)
    tang = tuple(torch.randn(t.shape, generator=g).to(device, dtype) for t in prim)

    def run(bk):
        f = lambda q, k, v, m: fastattn.attention(q, k, v, m, causal=True, enable_gqa=True, backend=bk)  # noqa: E731
        return torch.func.jvp(f, prim, tang)[1]

    ref, _ = reference.attention_jvp(*(to_numpy(t) for t in prim), *(to_numpy(t) for t in tang),
                                     causal=True, enable_gqa=True)
    assert_close_to_reference(run(backend), ref, baseline=run("naive"), name="tangent")


@pytest.mark.parametrize("backend,device", [p for p in F64_BACKENDS if p.values[0] != "naive"])
def test_hessian_transforms_match_naive(backend, device, one_thread):
    """torch.func.hessian (jacfwd of jacrev: the JVP of the backward) and jacrev of jacrev."""
    g = _gen(8)
    q, k, v, w = (torch.randn(1, 2, 4, 3, generator=g, dtype=torch.float64) for _ in range(4))

    def hessians(bk):
        f = lambda q, k: (fastattn.attention(q, k, v, causal=True, backend=bk) * w).sum()  # noqa: E731
        return torch.func.hessian(f, argnums=(0, 1))(q, k), torch.func.jacrev(torch.func.jacrev(f))(q, k)

    for a, b in zip(torch.utils._pytree.tree_leaves(hessians(backend)), torch.utils._pytree.tree_leaves(hessians("naive"))):
        torch.testing.assert_close(a, b)


def test_other_ops_take_forward_mode_on_naive(one_thread):
    """layer_norm, ffn, softmax and rope have no JVP kernel: under forward mode the automatic
    choice takes their naive backend (torch's forward AD), a named compiled backend is refused;
    so fastattn.nn.TransformerEncoderLayer (fused attention, naive norms and FFN) takes
    torch.func.jvp and equals torch's layer on its math SDPA (its default CPU kernel has no
    forward AD)."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    g = _gen(6)
    torch.manual_seed(6)
    layer = fastattn.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
    ref = torch.nn.TransformerEncoderLayer(16, 2, dim_feedforward=32, dropout=0.0, batch_first=True)
    ref.load_state_dict(layer.state_dict())
    x, t = torch.randn(2, 5, 16, generator=g), torch.randn(2, 5, 16, generator=g)
    got = torch.func.jvp(layer, (x,), (t,))
    with sdpa_kernel(SDPBackend.MATH):
        want = torch.func.jvp(ref, (x,), (t,))
    torch.testing.assert_close(got, want, rtol=1e-4, atol=1e-5)
    for name, f in (("layer_norm", lambda x: fastattn.layer_norm(x, (16,), backend="cpu")),
                    ("softmax", lambda x: fastattn.scaled_masked_softmax(x, backend="cpu"))):
        with pytest.raises(ValueError, match=f"cannot run {name}: it has no forward-mode AD"):
            torch.func.jvp(f, (x,), (t,))


@pytest.mark.parametrize("backend,device", F64_BACKENDS)
def test_vmap_of_grad_equals_a_loop(backend, device, one_thread):
    """Per-sample gradients (vmap of torch.func.grad) and a vmapped forward."""
    g = _gen(10)
    q, k, v = (torch.randn(3, 1, 2, 8, 4, generator=g) for _ in range(3))

    def loss(q, k, v):
        return fastattn.attention(q, k, v, causal=True, backend=backend).square().sum()

    batched = torch.vmap(torch.func.grad(loss, argnums=(0, 1, 2)))(q, k, v)
    for i in range(3):
        for a, b in zip(batched, torch.func.grad(loss, argnums=(0, 1, 2))(q[i], k[i], v[i])):
            torch.testing.assert_close(a[i], b)
    out = torch.vmap(lambda q, k, v: fastattn.attention(q, k, v, backend=backend))(q, k, v)
    torch.testing.assert_close(out[1], fastattn.attention(q[1], k[1], v[1], backend=backend))
