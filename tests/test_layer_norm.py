"""LayerNorm / RMSNorm / fused residual add on every backend, against the float64 NumPy reference."""

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fastattn
from fastattn import reference
from fastattn.testing import assert_close_to_reference, to_numpy

from conftest import DEVICE, backend_params, registered_ops

BACKENDS = backend_params("layer_norm")
DTYPES = [torch.float32, torch.bfloat16, torch.float16]

# (input shape, number of normalized trailing dims); odd sizes on purpose.
SHAPES = [((1, 1), 1), ((17, 100), 1), ((2, 3, 130), 1), ((5, 4, 10), 2), ((3, 1000), 1)]


def _inputs(shape, nd, dtype, device, affine=True, offset=0.0, seed=0):
    g = torch.Generator().manual_seed(seed)
    ns = shape[-nd:]
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * 2 + offset).to(dtype)
    w = (torch.randn(ns, generator=g, dtype=torch.float64) * 0.5 + 1).to(dtype) if affine else None
    b = (torch.randn(ns, generator=g, dtype=torch.float64) * 0.5).to(dtype) if affine else None
    dy = torch.randn(shape, generator=g, dtype=torch.float64).to(dtype)
    to = lambda t: None if t is None else t.to(device).requires_grad_()  # noqa: E731
    return to(x), to(w), to(b), dy.to(device), ns


def _grads(out, dy, *inputs):
    grads = torch.autograd.grad(out, [t for t in inputs if t is not None], dy)
    it = iter(grads)
    return [None if t is None else next(it) for t in inputs]


def _skip_unsupported(backend, dtype):
    if dtype == torch.float64 and backend in ("triton", "cuda"):
        pytest.skip("float64 runs on the cpu and naive backends only")


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("shape,nd", SHAPES)
@pytest.mark.parametrize("affine", [True, False])
def test_layer_norm_matches_reference(backend, device, dtype, shape, nd, affine):
    x, w, b, dy, ns = _inputs(shape, nd, dtype, device, affine)
    y = fastattn.layer_norm(x, ns, w, b, eps=1e-5, backend=backend)
    assert y.dtype == dtype and y.shape == x.shape
    ref_y, _, _ = reference.layer_norm(to_numpy(x), ns, to_numpy(w) if affine else None, to_numpy(b) if affine else None, 1e-5)
    base = F.layer_norm(x, ns, w, b, 1e-5)
    assert_close_to_reference(y, ref_y, base, name="y")

    dx, dw, db = _grads(y, dy, x, w, b)
    rdx, rdw, rdb = reference.layer_norm_backward(to_numpy(dy), to_numpy(x), ns, to_numpy(w) if affine else None, 1e-5)
    bdx, bdw, bdb = _grads(base, dy, x, w, b)
    assert_close_to_reference(dx, rdx, bdx, name="dx")
    if affine:
        assert_close_to_reference(dw, rdw, bdw, name="dweight")
        assert_close_to_reference(db, rdb, bdb, name="dbias")


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
def test_layer_norm_takes_strided_float32_weights(backend, device, dtype):
    """As F.layer_norm: weight and bias of any strides (every other element of a longer vector),
    in the input's dtype or float32; the gradients reach them in their own dtype and shape.
    Another dtype is a TypeError naming the argument."""
    x, _, _, dy, ns = _inputs((5, 3, 40), 1, dtype, device)
    g = torch.Generator().manual_seed(1)
    w = (torch.randn(80, generator=g) * 0.5 + 1).to(device)[::2].requires_grad_()
    b = (torch.randn(40, 2, generator=g) * 0.5).to(device)[:, 1].requires_grad_()
    for bad, match in (((w.double(), None), "weight has dtype torch.float64"),
                       ((w, b.double()), "bias has dtype torch.float64")):
        with pytest.raises(TypeError, match=match):
            fastattn.layer_norm(x, ns, *bad, backend=backend)
    y = fastattn.layer_norm(x, ns, w, b, backend=backend)
    ref_y, _, _ = reference.layer_norm(to_numpy(x), ns, to_numpy(w), to_numpy(b), 1e-5)
    base = F.layer_norm(x, ns, w.to(dtype), b.to(dtype))
    assert_close_to_reference(y, ref_y, base, name="y")
    dx, dw, db = _grads(y, dy, x, w, b)
    assert (dw.dtype, db.dtype, dw.shape, db.shape) == (w.dtype, b.dtype, w.shape, b.shape)
    rdx, rdw, rdb = reference.layer_norm_backward(to_numpy(dy), to_numpy(x), ns, to_numpy(w), 1e-5)
    bdx, bdw, bdb = _grads(base, dy, x, w, b)
    assert_close_to_reference(dx, rdx, bdx, name="dx")
    assert_close_to_reference(dw, rdw, bdw, name="dweight")
    assert_close_to_reference(db, rdb, bdb, name="dbias")


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16])
@pytest.mark.parametrize("shape", [(17, 100), (1, 1), (2, 1000)])
def test_rms_norm_matches_reference(backend, device, dtype, shape):
    x, w, _, dy, ns = _inputs(shape, 1, dtype, device)
    y = fastattn.rms_norm(x, ns, w, eps=1e-6, backend=backend)
    ref_y, _ = reference.rms_norm(to_numpy(x), ns, to_numpy(w), 1e-6)
    base = F.rms_norm(x, ns, w, 1e-6)
    assert_close_to_reference(y, ref_y, base, name="y")
    dx, dw = _grads(y, dy, x, w)
    rdx, rdw = reference.rms_norm_backward(to_numpy(dy), to_numpy(x), ns, to_numpy(w), 1e-6)
    bdx, bdw = _grads(base, dy, x, w)
    assert_close_to_reference(dx, rdx, bdx, name="dx")
    assert_close_to_reference(dw, rdw, bdw, name="dweight")


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("dtype", DTYPES + [torch.float64])
def test_rms_norm_default_eps_is_torchs(backend, device, dtype):
    # eps=None (nn.RMSNorm's default) is the epsilon of the compute type, as in torch's kernels:
    # float32's for 16-bit inputs, not the 16-bit type's own (bfloat16: 7.8e-3), which on rows of
    # RMS 0.01 would shrink every output about 9x (float16: 9.8e-4, 3.3x).
    _skip_unsupported(backend, dtype)
    g = torch.Generator().manual_seed(3)
    x = (torch.randn(6, 64, generator=g, dtype=torch.float64) * 0.01).to(device=device, dtype=dtype)
    eps = torch.finfo(torch.float64 if dtype == torch.float64 else torch.float32).eps
    ref_y, _ = reference.rms_norm(to_numpy(x), (64,), None, eps)
    assert_close_to_reference(fastattn.rms_norm(x, 64, backend=backend), ref_y, F.rms_norm(x, (64,)), name="y")
    module = fastattn.nn.RMSNorm(64, device=device, dtype=dtype, backend=backend)
    base = torch.nn.RMSNorm(64, device=device, dtype=dtype)(x)
    assert_close_to_reference(module(x), ref_y, base, name="nn.RMSNorm y")


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("rms", [False, True])
def test_add_layer_norm_returns_sum_and_routes_its_gradient(backend, device, rms):
    dtype = torch.float32
    x, w, b, dy, ns = _inputs((17, 130), 1, dtype, device)
    r = torch.randn(x.shape, dtype=dtype, device=device, requires_grad=True)
    dh = torch.randn(x.shape, dtype=dtype, device=device)
    bias = None if rms else b
    y, h = fastattn.add_layer_norm(x, r, ns, w, bias, eps=1e-5, rms=rms, backend=backend)
    h_ref = x.detach().double() + r.detach().double()
    assert_close_to_reference(h, h_ref, name="h")
    if rms:
        ref_y, _ = reference.rms_norm(to_numpy(h_ref), ns, to_numpy(w), 1e-5)
        rdx, rdw = reference.rms_norm_backward(to_numpy(dy), to_numpy(h_ref), ns, to_numpy(w), 1e-5)
    else:
        ref_y, _, _ = reference.layer_norm(to_numpy(h_ref), ns, to_numpy(w), to_numpy(b), 1e-5)
        rdx, rdw, _ = reference.layer_norm_backward(to_numpy(dy), to_numpy(h_ref), ns, to_numpy(w), 1e-5)
    assert_close_to_reference(y, ref_y, name="y")
    dx, dr, dw = torch.autograd.grad((y, h), (x, r, w), (dy, dh))
    # The residual stream's gradient dh flows to both summands, on top of the norm's.
    assert_close_to_reference(dx, rdx + to_numpy(dh), name="dx")
    assert_close_to_reference(dr, rdx + to_numpy(dh), name="dresidual")
    assert_close_to_reference(dw, rdw, name="dweight")


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_long_rows_and_large_mean(backend, device):
    # One row longer than any register tile (the looped path), offset by a large mean.
    x, w, b, dy, ns = _inputs((2, 70_003), 1, torch.float32, device, offset=1e4, seed=3)
    y = fastattn.layer_norm(x, ns, w, b, backend=backend)
    ref_y, _, _ = reference.layer_norm(to_numpy(x), ns, to_numpy(w), to_numpy(b), 1e-5)
    base = F.layer_norm(x, ns, w, b)
    assert_close_to_reference(y, ref_y, base, name="y")
    dx, dw, db = _grads(y, dy, x, w, b)
    rdx, rdw, rdb = reference.layer_norm_backward(to_numpy(dy), to_numpy(x), ns, to_numpy(w), 1e-5)
    bdx, bdw, bdb = _grads(base, dy, x, w, b)
    assert_close_to_reference(dx, rdx, bdx, name="dx")
    assert_close_to_reference(dw, rdw, bdw, name="dweight")


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_non_contiguous_input(backend, device):
    base = torch.randn(40, 66, device=device, dtype=torch.float32)
    for x in (base[:, 3:63], base.t()[:, :33], base[::2, 1:-1:1]):  # row-strided, transposed
        x = x.detach().requires_grad_()
        ns = x.shape[-1:]
        y = fastattn.layer_norm(x, ns, backend=backend)
        assert y.is_contiguous()  # (as torch's, whatever the input's strides)
        ref_y, _, _ = reference.layer_norm(to_numpy(x), ns, None, None, 1e-5)
        assert_close_to_reference(y, ref_y, name="y")
        (dx,) = torch.autograd.grad(y, x, torch.ones_like(y))
        rdx, _, _ = reference.layer_norm_backward(np.ones(x.shape), to_numpy(x), ns, None, 1e-5)
        assert_close_to_reference(dx, rdx, name="dx")


@pytest.mark.parametrize("backend,device", [p for p in BACKENDS if p.id in ("cpu", "naive")])
def test_float64_gradcheck(backend, device):
    x, w, b, _, ns = _inputs((3, 7), 1, torch.float64, device, seed=5)
    torch.autograd.gradcheck(lambda x, w, b: fastattn.layer_norm(x, ns, w, b, backend=backend), (x, w, b))
    r = torch.randn(3, 7, dtype=torch.float64, device=device, requires_grad=True)
    torch.autograd.gradcheck(
        lambda x, r, w: fastattn.add_layer_norm(x, r, ns, w, rms=True, backend=backend), (x, r, w)
    )


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_bias_without_weight(backend, device):
    x, _, b, dy, ns = _inputs((5, 33), 1, torch.float32, device, seed=7)
    y = fastattn.layer_norm(x, ns, None, b, backend=backend)
    base = F.layer_norm(x, ns, None, b)
    assert_close_to_reference(y, base.detach().double(), name="y")
    db, dx = torch.autograd.grad(y, (b, x), dy)
    bdb, bdx = torch.autograd.grad(base, (b, x), dy)
    assert_close_to_reference(db, bdb.double(), name="dbias")
    assert_close_to_reference(dx, bdx.double(), name="dx")


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_empty_batch(backend, device):
    x = torch.randn(0, 16, device=device, requires_grad=True)
    y = fastattn.layer_norm(x, (16,), backend=backend)
    assert y.shape == (0, 16)
    y.sum().backward()
    assert x.grad.shape == (0, 16)


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_bad_input_errors(backend, device):
    x = torch.randn(4, 8, device=device)
    with pytest.raises(ValueError, match="normalized_shape"):
        fastattn.layer_norm(x, (7,), backend=backend)
    with pytest.raises(ValueError, match="weight has shape"):
        fastattn.layer_norm(x, (8,), torch.ones(7, device=device), backend=backend)
    with pytest.raises(ValueError, match="bias has shape"):
        fastattn.layer_norm(x, (8,), None, torch.ones(4, device=device), backend=backend)
    with pytest.raises(TypeError, match="dtype"):
        fastattn.layer_norm(x.to(torch.int32), (8,), backend=backend)
    with pytest.raises(ValueError, match="residual has shape"):
        fastattn.add_layer_norm(x, x[:2], (8,), backend=backend)
    with pytest.raises(ValueError, match="bias must be None"):
        fastattn.add_layer_norm(x, x, (8,), None, torch.ones(8, device=device), rms=True, backend=backend)
    for shape in (8.0, (8.0,), True, (True,), torch.tensor(8)):  # (torch refuses these too)
        with pytest.raises(TypeError, match="normalized_shape"):
            fastattn.layer_norm(x, shape, backend=backend)
    y = fastattn.layer_norm(x, (torch.tensor(8),), backend=backend)  # 0-d integer tensors index, as in torch
    torch.testing.assert_close(y, F.layer_norm(x, (8,)))


needs_triton = pytest.mark.skipif(not hasattr(torch.ops.fastattn, "triton_layer_norm_fwd"),
                                  reason="triton is not installed")


@needs_triton
def test_triton_ops_check_their_arguments():
    """The registered Triton ops (callable directly through torch.ops) run the public functions'
    checks, written once in fastattn.ops: bad arguments get their errors before any kernel."""
    fwd, bwd = torch.ops.fastattn.triton_layer_norm_fwd, torch.ops.fastattn.triton_layer_norm_bwd
    x = torch.randn(4, 8, device=DEVICE)
    w = torch.ones(8, device=DEVICE)
    with pytest.raises(ValueError, match="x must be 2-D"):
        fwd(x[0], None, None, None, 1e-5, False)
    with pytest.raises(ValueError, match="weight has shape"):
        fwd(x, None, w[:7], None, 1e-5, False)
    with pytest.raises(ValueError, match="residual has shape"):
        fwd(x, x[:2], None, None, 1e-5, False)
    with pytest.raises(TypeError, match="residual has dtype"):
        fwd(x, x.half(), None, None, 1e-5, False)
    with pytest.raises(ValueError, match="bias must be None"):
        fwd(x, None, w, w, 1e-5, True)
    with pytest.raises(ValueError, match="eps must be a non-negative"):
        fwd(x, None, None, None, -1.0, False)
    mean, rstd = torch.zeros(4, device=DEVICE), torch.ones(4, device=DEVICE)
    with pytest.raises(ValueError, match="dy must have shape"):
        bwd(x[:2], None, x, w, mean, rstd, False, [True, True])
    with pytest.raises(ValueError, match="mean must have shape"):
        bwd(x, None, x, w, mean[:2], rstd, False, [True, True])
    with pytest.raises(TypeError, match="rstd must be torch.float32"):
        bwd(x, None, x, w, mean, rstd.double(), False, [True, True])
    with pytest.raises(ValueError, match="output_mask"):
        bwd(x, None, x, w, mean, rstd, False, [True])


@needs_triton
def test_kernel_limits():
    """What only the kernels know, checked by their launchers: the dtypes they are built for,
    unit last strides, rows of at least one element, int32 row indices (meta tensors: no memory)."""
    from fastattn.kernels.layer_norm import layer_norm_bwd, layer_norm_fwd

    x = torch.randn(4, 8)
    with pytest.raises(TypeError, match="take x in"):
        layer_norm_fwd(x.double(), None, None, None, 1e-5, False)
    with pytest.raises(ValueError, match="weight with a unit last stride"):
        layer_norm_fwd(x, None, torch.ones(16)[::2], None, 1e-5, False)
    with pytest.raises(ValueError, match="at least one element"):
        layer_norm_fwd(x[:, :0], None, None, None, 1e-5, False)
    with pytest.raises(ValueError, match="int32"):
        layer_norm_fwd(torch.empty(2**31, 1, device="meta"), None, None, None, 1e-5, True)
    with pytest.raises(TypeError, match="take rstd in torch.float32"):
        layer_norm_bwd(x, None, x, None, torch.zeros(4), torch.ones(4).double(), False, [False, False])


@pytest.mark.parametrize("op,device", registered_ops("layer_norm"))
@pytest.mark.parametrize("residual", [False, True])
@pytest.mark.parametrize("rms", [False, True])
def test_opcheck(op, device, residual, rms):
    x = torch.randn(5, 33, device=device, requires_grad=True)
    r = torch.randn(5, 33, device=device, requires_grad=True) if residual else None
    w = torch.randn(33, device=device, requires_grad=True)
    b = None if rms else torch.randn(33, device=device, requires_grad=True)
    torch.library.opcheck(op, (x, r, w, b, 1e-5, rms))


@pytest.mark.parametrize("backend,device", [p for p in BACKENDS if p.id in ("cpu", "naive", "triton")])
def test_compiles_without_graph_breaks(backend, device):
    if backend == "triton" and device.type == "cpu":
        pytest.skip("torch.compile of Triton ops needs a GPU")
    x = torch.randn(6, 48, device=device, requires_grad=True)
    w = torch.randn(48, device=device, requires_grad=True)
    compiler = "inductor" if device.type == "cuda" else "aot_eager"

    def f(x, w):
        return fastattn.layer_norm(x * 2, (48,), w, backend=backend).sum()

    out = torch.compile(f, fullgraph=True, backend=compiler)(x, w)
    out.backward()
    assert torch.allclose(out, f(x, w), atol=1e-4)
    assert x.grad is not None and w.grad is not None


def test_module_is_a_drop_in_for_torch_layer_norm():
    torch.manual_seed(0)
    ref = torch.nn.LayerNorm(32, eps=1e-6)
    ref.weight.data.normal_()
    ref.bias.data.normal_()
    mod = fastattn.nn.LayerNorm(32, eps=1e-6, backend="naive")
    mod.load_state_dict(ref.state_dict())
    assert isinstance(mod, torch.nn.LayerNorm)
    assert list(mod.state_dict()) == list(ref.state_dict())
    x = torch.randn(3, 5, 32)
    assert torch.allclose(mod(x), ref(x), atol=1e-5)
    rms_ref = torch.nn.RMSNorm([5, 32])
    rms = fastattn.nn.RMSNorm([5, 32], backend="naive")
    rms.load_state_dict(rms_ref.state_dict())
    assert torch.allclose(rms(x), rms_ref(x), atol=1e-5)
