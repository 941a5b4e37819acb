"""fastattn.scaled_masked_softmax on every backend, against the float64 reference."""

import pytest
import torch

import fastattn
from fastattn import reference
from fastattn.testing import assert_close_to_reference, mask_to_numpy, to_numpy

from conftest import DEVICE, backend_params, registered_ops

BACKENDS = backend_params("softmax")


def _mask(kind, shape, dtype, device, g):
    if kind is None:
        return None
    if kind == "padding":  # bool key padding broadcast over heads and queries
        keep = torch.rand(shape[0], 1, 1, shape[-1], generator=g) > 0.3
        keep[..., 0] = True
        return keep.to(device)
    if kind == "bias":  # float, per (head, query, key), gradient wanted
        return torch.randn(shape[1:], generator=g, dtype=torch.float64).to(device, dtype).requires_grad_()
    if kind == "inf":  # float with -inf, one fully masked row
        m = torch.zeros(shape[-2:], dtype=torch.float64)
        m[torch.rand(shape[-2:], generator=g) < 0.3] = float("-inf")
        m[0] = float("-inf")
        return m.to(device, dtype)
    raise ValueError(kind)


# (shape, mask kind, scale, is_causal)
CASES = [
    ((2, 3, 5, 17), None, 1.0, False),
    ((2, 3, 5, 17), "padding", 0.5, False),
    ((2, 3, 5, 17), "bias", 0.125, False),
    ((1, 2, 7, 130), "inf", 1.0, False),
    ((2, 2, 9, 5), None, 1.0, True),        # causal with Lq > Lk
    ((1, 1, 3, 1), None, 2.0, False),        # rows of length 1
    ((17,), None, 1.0, False),               # 1-D
    ((2, 2, 2, 3, 33), None, 0.7, True),     # 5-D
    ((1, 1, 2, 20_000), "padding", 1.0, False),  # long rows: the multi-block path
]


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("dtype", [torch.float32, torch.bfloat16, torch.float16])
@pytest.mark.parametrize("shape,kind,scale,causal", CASES, ids=[f"{c[0]}-{c[1]}-{c[3]}" for c in CASES])
def test_softmax_matches_reference(backend, device, dtype, shape, kind, scale, causal):
    g = torch.Generator().manual_seed(len(shape) * 100 + shape[-1])
    x = (torch.randn(shape, generator=g, dtype=torch.float64) * 3).to(device, dtype).requires_grad_()
    mask = _mask(kind, shape, dtype, device, g)
    y = fastattn.scaled_masked_softmax(x, mask, scale, causal, backend=backend)
    assert y.shape == x.shape and y.dtype == dtype
    np_mask = mask_to_numpy(mask)
    ref = reference.softmax(to_numpy(x), np_mask, scale, causal)
    assert_close_to_reference(y, ref, name="y")
    dy = torch.randn(shape, generator=g, dtype=torch.float64).to(device, dtype)
    inputs = [x] + ([mask] if kind == "bias" else [])
    grads = torch.autograd.grad(y, inputs, dy)
    rdx = reference.softmax_backward(to_numpy(dy), ref, scale)
    assert_close_to_reference(grads[0], rdx, name="dx")
    if kind == "bias":  # the mask enters unscaled; its gradient is summed over the broadcast dim
        rdmask = reference.softmax_backward(to_numpy(dy), ref, 1.0).sum(0)
        assert_close_to_reference(grads[1], rdmask, name="dmask")


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_fully_masked_rows_and_huge_logits(backend, device):
    x = torch.randn(2, 4, 9, device=device) * 1e4
    x.requires_grad_()
    mask = torch.ones(2, 4, 9, dtype=torch.bool, device=device)
    mask[1, 2] = False
    y = fastattn.scaled_masked_softmax(x, mask, backend=backend)
    (dx,) = torch.autograd.grad(y, x, torch.randn_like(y))
    assert not torch.isnan(y).any() and not torch.isnan(dx).any()
    assert torch.all(y[1, 2] == 0) and torch.all(dx[1, 2] == 0)
    ref = reference.softmax(to_numpy(x), mask.cpu().numpy())
    assert_close_to_reference(y, ref, name="y")


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_bad_input_errors(backend, device):
    x = torch.randn(2, 3, 4, device=device)
    with pytest.raises(ValueError, match="not broadcastable"):
        fastattn.scaled_masked_softmax(x, torch.ones(5, dtype=torch.bool, device=device), backend=backend)
    with pytest.raises(TypeError, match="mask must be bool or floating"):
        fastattn.scaled_masked_softmax(x, torch.ones(4, dtype=torch.int32, device=device), backend=backend)
    with pytest.raises(TypeError, match="dtype"):
        fastattn.scaled_masked_softmax(x.int(), backend=backend)
    with pytest.raises(ValueError, match="is_causal"):
        fastattn.scaled_masked_softmax(x[0, 0], is_causal=True, backend=backend)


needs_triton = pytest.mark.skipif(not hasattr(torch.ops.fastattn, "triton_softmax_fwd"),
                                  reason="triton is not installed")


@needs_triton
def test_triton_ops_check_their_arguments():
    """The registered Triton ops (callable directly through torch.ops) run the public function's
    checks, written once in fastattn.ops, and the contract's (x 4-D, the mask expanded to it)."""
    fwd, bwd = torch.ops.fastattn.triton_softmax_fwd, torch.ops.fastattn.triton_softmax_bwd
    x = torch.randn(2, 3, 4, 5, device=DEVICE)
    with pytest.raises(ValueError, match="4-D"):
        fwd(x[0], None, 1.0, False)
    with pytest.raises(TypeError, match="dtype"):
        fwd(x.int(), None, 1.0, False)
    with pytest.raises(TypeError, match="mask must be bool or floating"):
        fwd(x, torch.ones_like(x, dtype=torch.int32), 1.0, False)
    with pytest.raises(ValueError, match="expand it"):
        fwd(x, torch.ones(1, 1, 1, 5, dtype=torch.bool, device=DEVICE), 1.0, False)
    with pytest.raises(ValueError, match="dy must have shape"):
        bwd(x[:1], x, 1.0)
    with pytest.raises(TypeError, match="dy must be torch.float32"):
        bwd(x.half(), x, 1.0)


@needs_triton
def test_kernel_limits():
    """What only the kernels know, checked by their launchers: the dtypes they are built for,
    unit last strides, int32 row indices and mask offsets along a row (meta tensors: no memory)."""
    from fastattn.kernels.softmax import softmax_bwd, softmax_fwd

    x = torch.randn(2, 3, 4, 5)
    with pytest.raises(TypeError, match="take x in"):
        softmax_fwd(x.double(), None, 1.0, False)
    with pytest.raises(ValueError, match="dy with a unit last stride"):
        softmax_bwd(x.transpose(2, 3).contiguous().transpose(2, 3), x, 1.0)
    with pytest.raises(ValueError, match="int32"):
        softmax_fwd(torch.empty(2**31, 1, 1, 1, device="meta"), None, 1.0, False)
    x = torch.empty(1, 1, 1, 2**16 + 1, device="meta")
    mask = torch.empty_strided(x.shape, (0, 0, 0, 2**15), dtype=torch.bool, device="meta")
    with pytest.raises(ValueError, match="mask .* int32"):
        softmax_fwd(x, mask, 1.0, False)


@pytest.mark.parametrize("op,device", registered_ops("softmax"))
def test_opcheck(op, device):
    x = torch.randn(2, 3, 4, 9, device=device, requires_grad=True)
    bias = torch.randn(3, 4, 9, device=device, requires_grad=True).expand(2, 3, 4, 9)
    torch.library.opcheck(op, (x, None, 0.5, True))
    torch.library.opcheck(op, (x, bias, 0.5, False))


def test_module_and_megatron_compat():
    x = torch.randn(2, 2, 4, 6)
    mod = fastattn.nn.ScaledMaskedSoftmax(scale=0.5, is_causal=True, backend="naive")
    assert torch.allclose(mod(x), fastattn.scaled_masked_softmax(x, None, 0.5, True, backend="naive"))
    from fastattn.compat import megatron

    masked_out = torch.rand(2, 1, 4, 6) > 0.7  # Megatron: True = masked out
    got = megatron.scaled_masked_softmax(x, masked_out, 0.5)
    want = fastattn.scaled_masked_softmax(x, ~masked_out, 0.5)
    assert torch.equal(got, want)
    got = megatron.scaled_upper_triang_masked_softmax(x[0], 0.5)
    assert torch.equal(got, fastattn.scaled_masked_softmax(x[0], None, 0.5, True))
