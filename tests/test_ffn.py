"""fastattn.ffn on every backend, against the float64 reference."""

import pytest
import torch
import torch.nn.functional as F

import fastattn
from fastattn import reference
from fastattn.ops.ffn import ACTIVATIONS, GATED, activate
from fastattn.testing import assert_close_to_reference, to_numpy

from conftest import DEVICE, backend_params, cpu_built, registered_ops

BACKENDS = backend_params("ffn")


def _params(lead, d, hidden, d_out, activation, bias, dtype, device, g):
    rows = 2 * hidden if activation in GATED else hidden
    mk = lambda *s: (torch.randn(*s, generator=g, dtype=torch.float64) / max(1, s[-1]) ** 0.5).to(device, dtype).requires_grad_()  # noqa: E731
    x = (torch.randn(*lead, d, generator=g, dtype=torch.float64)).to(device, dtype).requires_grad_()
    w1, w2 = mk(rows, d), mk(d_out, hidden)
    b1 = mk(rows) if bias else None
    b2 = mk(d_out) if bias else None
    return x, w1, b1, w2, b2


# (leading shape, d, hidden, d_out)
SHAPES = [((1,), 16, 100, 16), ((17,), 40, 100, 24), ((2, 3), 16, 33, 16)]


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("activation", ACTIVATIONS)
@pytest.mark.parametrize("shape", SHAPES, ids=str)
@pytest.mark.parametrize("bias", [True, False])
def test_ffn_matches_reference_fp32(backend, device, activation, shape, bias):
    _check(backend, device, activation, shape, bias, torch.float32)


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_ffn_matches_reference_bf16(backend, device, activation):
    _check(backend, device, activation, ((17,), 40, 1000, 24), True, torch.bfloat16)


CPU = cpu_built("ffn")


@pytest.mark.skipif(not CPU, reason="the cpu backend is not built")
@pytest.mark.parametrize("gemm", ["float32", "native"])
@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_cpu_16bit_matmuls_on_either_path(monkeypatch, gemm, dtype, activation):
    """The cpu backend runs 16-bit FFN matmuls in float32 on CPUs without bf16 / fp16 dot
    instructions and as ATen's 16-bit GEMMs on the others (FASTATTN_CPU_FFN_GEMM=float32 / native
    forces one): either way output and gradients match the reference as closely as eager torch."""
    monkeypatch.setenv("FASTATTN_CPU_FFN_GEMM", gemm)
    _check("cpu", "cpu", activation, ((2, 9), 40, 100, 24), True, dtype)
    _check("cpu", "cpu", activation, ((17,), 40, 33, 24), False, dtype)


def _check(backend, device, activation, shape, bias, dtype):
    lead, d, hidden, d_out = shape
    g = torch.Generator().manual_seed(hidden + d)
    x, w1, b1, w2, b2 = _params(lead, d, hidden, d_out, activation, bias, dtype, device, g)
    y = fastattn.ffn(x, w1, b1, w2, b2, activation, backend=backend)
    assert y.shape == (*lead, d_out) and y.dtype == dtype
    np_ = lambda t: None if t is None else to_numpy(t)  # noqa: E731
    ref = reference.ffn(np_(x), np_(w1), np_(b1), np_(w2), np_(b2), activation)
    # Baseline: the same FFN in eager PyTorch in this dtype.
    base = F.linear(activate(activation, F.linear(x, w1, b1)), w2, b2)
    assert_close_to_reference(y, ref, base, name="y")
    dy = torch.randn(y.shape, generator=g, dtype=torch.float64).to(device, dtype)
    inputs = [t for t in (x, w1, b1, w2, b2) if t is not None]
    grads = torch.autograd.grad(y, inputs, dy)
    bgrads = torch.autograd.grad(base, inputs, dy)
    refs = [r for r in reference.ffn_backward(np_(dy), np_(x), np_(w1), np_(b1), np_(w2), np_(b2), activation) if r is not None]
    names = [n for n, t in zip(("dx", "dw1", "db1", "dw2", "db2"), (x, w1, b1, w2, b2)) if t is not None]
    for name, got, b, want in zip(names, grads, bgrads, refs):
        assert_close_to_reference(got, want, b, name=name)


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_bad_input_errors(backend, device):
    x = torch.randn(3, 8, device=device)
    w1, w2 = torch.randn(16, 8, device=device), torch.randn(8, 16, device=device)
    with pytest.raises(ValueError, match="unknown activation"):
        fastattn.ffn(x, w1, None, w2, None, "tanh", backend=backend)
    with pytest.raises(ValueError, match="w1 has shape"):
        fastattn.ffn(x, w1[:, :7], None, w2, None, backend=backend)
    with pytest.raises(ValueError, match="w2 has shape"):
        fastattn.ffn(x, w1, None, w2[:, :15], None, backend=backend)
    with pytest.raises(ValueError, match="b1 has shape"):
        fastattn.ffn(x, w1, torch.randn(15, device=device), w2, None, backend=backend)
    with pytest.raises(ValueError, match="b2 has shape"):
        fastattn.ffn(x, w1, None, w2, torch.randn(9, device=device), backend=backend)
    with pytest.raises(ValueError, match="even number of rows"):
        fastattn.ffn(x, torch.randn(15, 8, device=device), None, w2, None, "swiglu", backend=backend)
    with pytest.raises(TypeError, match="dtype"):
        fastattn.ffn(x.double(), w1, None, w2, None, backend=backend)


needs_triton = pytest.mark.skipif(not hasattr(torch.ops.fastattn, "triton_ffn_fwd"),
                                  reason="triton is not installed")


@needs_triton
def test_triton_ops_check_their_arguments():
    """The registered Triton ops (callable directly through torch.ops) run the public function's
    checks, written once in fastattn.ops, and the contract's (x 2-D, dout and pre shaped by it)."""
    fwd, bwd = torch.ops.fastattn.triton_ffn_fwd, torch.ops.fastattn.triton_ffn_bwd
    x, w1, w2 = (torch.randn(*s, device=DEVICE) for s in ((3, 4), (6, 4), (4, 6)))
    with pytest.raises(ValueError, match="x must be 2-D"):
        fwd(x[None], w1, None, w2, None, "gelu")
    with pytest.raises(ValueError, match="unknown activation"):
        fwd(x, w1, None, w2, None, "tanh")
    with pytest.raises(ValueError, match="w1 has shape"):
        fwd(x, w1[:, :3], None, w2, None, "gelu")
    with pytest.raises(ValueError, match="b1 has shape"):
        fwd(x, w1, torch.zeros(5, device=DEVICE), w2, None, "gelu")
    with pytest.raises(TypeError, match="dtype"):
        fwd(x, w1.half(), None, w2, None, "gelu")
    pre, dout = torch.randn(3, 6, device=DEVICE), torch.randn(3, 4, device=DEVICE)
    with pytest.raises(ValueError, match="dout must have shape"):
        bwd(dout[:2], x, w1, w2, pre, "gelu", [False, False])
    with pytest.raises(TypeError, match="pre must be torch.float32"):
        bwd(dout, x, w1, w2, pre.half(), "gelu", [False, False])
    with pytest.raises(ValueError, match="output_mask"):
        bwd(dout, x, w1, w2, pre, "gelu", [False])


@needs_triton
def test_kernel_limits():
    """What only the kernels know, checked by their launchers: the dtypes they are built for and
    int32 index arithmetic (here K offsets of a column-major x; meta tensors: no memory)."""
    from fastattn.kernels.ffn import ffn_fwd

    x, w1, w2 = torch.randn(3, 4), torch.randn(6, 4), torch.randn(4, 6)
    with pytest.raises(TypeError, match="float32, float16 or bfloat16"):
        ffn_fwd(x.double(), w1.double(), None, w2.double(), None, "gelu")
    x = torch.empty_strided((2, 4), (1, 2**28), device="meta")
    with pytest.raises(ValueError, match=r"K offsets .* x @ w1\^T in int32"):
        ffn_fwd(x, w1.to("meta"), None, w2.to("meta"), None, "gelu")


@pytest.mark.parametrize("op,device", registered_ops("ffn"))
@pytest.mark.parametrize("activation", ["gelu", "swiglu"])
def test_opcheck(op, device, activation):
    g = torch.Generator().manual_seed(0)
    x, w1, b1, w2, b2 = _params((5,), 8, 12, 8, activation, True, torch.float32, device, g)
    torch.library.opcheck(op, (x, w1, b1, w2, b2, activation))
    torch.library.opcheck(op, (x, w1, None, w2, None, activation))


def test_feed_forward_module_state_dict_matches_two_linears():
    mod = fastattn.nn.FeedForward(16, 40, activation="gelu", backend="naive")
    assert list(mod.state_dict()) == ["fc1.weight", "fc1.bias", "fc2.weight", "fc2.bias"]
    x = torch.randn(3, 16)
    want = mod.fc2(F.gelu(mod.fc1(x)))
    assert torch.allclose(mod(x), want, atol=1e-5)
