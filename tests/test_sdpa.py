"""fastattn.scaled_dot_product_attention follows torch.nn.functional.scaled_dot_product_attention's
shape rules and corner cases: every case here runs both and compares outputs and gradients, or
checks that both refuse. float64 on the naive and cpu backends."""

import pytest
import torch
import torch.nn.functional as F

import fastattn

pytestmark = pytest.mark.usefixtures("one_thread")

F64 = torch.float64
BACKENDS = [b for b in ("naive", "cpu") if fastattn.backend_status()[b] is None]


def _t(*shape, dtype=F64, seed=0):
    g = torch.Generator().manual_seed(seed + sum(shape) * 7 + len(shape))
    return torch.randn(*shape, generator=g, dtype=dtype).requires_grad_()


def _both(q, k, v, backend, **kw):
    """Outputs and input gradients of torch and fastattn for the same call."""
    results = []
    for fn in (F.scaled_dot_product_attention,
               lambda *a, **k: fastattn.scaled_dot_product_attention(*a, **k, backend=backend)):
        inputs = [t.detach().clone().requires_grad_(t.requires_grad) for t in (q, k, v)]
        mask = kw.get("attn_mask")
        if mask is not None and mask.is_floating_point():
            mask = mask.detach().clone().requires_grad_()
        out = fn(*inputs, **{**kw, "attn_mask": mask})
        g = torch.Generator().manual_seed(9)
        w = torch.randn(out.shape, generator=g, dtype=out.dtype)
        grads = torch.autograd.grad((out * w).sum(), [*inputs] + ([mask] if mask is not None and mask.requires_grad else []),
                                    allow_unused=True) if out.requires_grad else []
        results.append((out, grads))
    return results


def _check(q, k, v, backend, **kw):
    (want, want_g), (got, got_g) = _both(q, k, v, backend, **kw)
    assert got.shape == want.shape and got.dtype == want.dtype
    tol = 1e-10 if got.dtype == F64 else 1e-5
    torch.testing.assert_close(got, want, rtol=tol, atol=tol)
    assert len(got_g) == len(want_g)
    for i, (a, b) in enumerate(zip(got_g, want_g)):
        if b is None:
            assert a is None or not a.any()
        else:  # the compiled backends accumulate a float mask's gradient (i == 3) in float32
            tol = 1e-10 if b.dtype == F64 and i < 3 else 1e-5
            torch.testing.assert_close(a, b, rtol=10 * tol, atol=tol)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shapes", [
    ((5, 8), (6, 8), (6, 7)),  # 2-D: no batch, no heads
    ((3, 5, 8), (3, 6, 8), (3, 6, 8)),  # 3-D
    ((2, 3, 2, 5, 8), (2, 3, 2, 6, 8), (2, 3, 2, 6, 4)),  # 5-D
    ((2, 3, 5, 8), (1, 3, 6, 8), (2, 3, 6, 8)),  # broadcast batch
    ((3, 5, 8), (2, 3, 6, 8), (2, 3, 6, 8)),  # fewer dims broadcast
    ((2, 4, 5, 8), (2, 1, 6, 8), (2, 1, 6, 8)),  # one key/value head broadcast without enable_gqa
])
def test_leading_dims_broadcast_like_torch(backend, shapes):
    q, k, v = (_t(*s, seed=i) for i, s in enumerate(shapes))
    _check(q, k, v, backend)
    _check(q, k, v, backend, is_causal=True, scale=0.7)


@pytest.mark.parametrize("backend", BACKENDS)
def test_gqa_on_dim_minus_3(backend):
    _check(_t(2, 4, 5, 8), _t(1, 2, 6, 8, seed=1), _t(1, 2, 6, 8, seed=2), backend, enable_gqa=True)
    _check(_t(4, 5, 8), _t(2, 6, 8, seed=1), _t(2, 6, 8, seed=2), backend, enable_gqa=True, is_causal=True)
    _check(_t(2, 2, 4, 5, 8), _t(2, 2, 2, 6, 8, seed=1), _t(2, 2, 2, 6, 8, seed=2), backend, enable_gqa=True)


@pytest.mark.parametrize("backend", BACKENDS)
def test_masks_like_torch(backend):
    q, k, v = _t(2, 3, 5, 8), _t(2, 3, 6, 8, seed=1), _t(2, 3, 6, 8, seed=2)
    g = torch.Generator().manual_seed(3)
    allowed = torch.rand(5, 6, generator=g) < 0.7
    allowed[:, 0] = True
    bias = torch.randn(3, 1, 6, generator=g, dtype=F64)
    _check(q, k, v, backend, attn_mask=allowed)
    _check(q, k, v, backend, attn_mask=bias)
    _check(q.float(), k.float(), v.float(), backend, attn_mask=bias.float())
    # a float32 mask is accepted for any query dtype
    _check(q, k, v, backend, attn_mask=bias.float())
    _check(_t(3, 5, 8), _t(3, 6, 8, seed=1), _t(3, 6, 8, seed=2), backend, attn_mask=allowed[None])


@pytest.mark.parametrize("backend", BACKENDS)
def test_float32_mask_kept_in_float32_for_16_bit_queries(backend):
    """torch adds a float32 mask in float32 to bf16 scores; rounding it to bf16 first (89.89 ->
    90.0) moved this output by 0.06 against the float64 result, 7x torch's own error."""
    g = torch.Generator().manual_seed(0)
    q, k, v = (torch.randn(1, 2, 8, 16, generator=g) for _ in range(3))
    i, j = torch.arange(8)[:, None], torch.arange(8)[None, :]
    bias = -(i - j).abs().float() * 3.37 + 100.0
    want = F.scaled_dot_product_attention(q.double(), k.double(), v.double(), attn_mask=bias.double())
    q, k, v = q.bfloat16(), k.bfloat16(), v.bfloat16()
    got = fastattn.scaled_dot_product_attention(q, k, v, attn_mask=bias, backend=backend)
    torch_err = (F.scaled_dot_product_attention(q, k, v, attn_mask=bias).double() - want).abs().max()
    assert (got.double() - want).abs().max() <= 2 * torch_err + 4e-3
    torch.testing.assert_close(got, fastattn.attention(q, k, v, mask=bias.expand(1, 2, 8, 8), backend=backend),
                               rtol=0, atol=0)


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("case", ["head dim 0", "value dim 0", "no queries", "no keys", "no batch", "dropout 1"])
def test_corner_cases_like_torch(backend, case):
    qs, ks, vs, kw = (2, 3, 5, 4), (2, 3, 6, 4), (2, 3, 6, 4), {}
    if case == "head dim 0":
        qs, ks = (2, 3, 5, 0), (2, 3, 6, 0)
        kw = {"attn_mask": torch.randn(5, 6, dtype=F64)}
    elif case == "value dim 0":
        vs = (2, 3, 6, 0)
    elif case == "no queries":
        qs = (2, 3, 0, 4)
    elif case == "no keys":
        ks, vs = (2, 3, 0, 4), (2, 3, 0, 4)
    elif case == "no batch":
        qs, ks, vs = (0, 3, 5, 4), (0, 3, 6, 4), (0, 3, 6, 4)
    else:
        kw = {"dropout_p": 1.0}
    _check(_t(*qs), _t(*ks, seed=1), _t(*vs, seed=2), backend, **kw)
    if case == "head dim 0":
        _check(_t(*qs), _t(*ks, seed=1), _t(*vs, seed=2), backend)


@pytest.mark.parametrize("args,kw,error", [
    (((4, 8), (4, 8), (4,)), {}, ValueError),  # 1-D
    (((2, 4, 8), (2, 4, 8), (2, 5, 8)), {}, ValueError),  # key and value lengths differ
    (((2, 4, 8), (2, 4, 6), (2, 4, 8)), {}, ValueError),  # head dims differ
    (((2, 4, 8), (3, 4, 8), (3, 4, 8)), {}, ValueError),  # batch does not broadcast
    (((1, 4, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8)), {}, ValueError),  # fewer heads without enable_gqa
    (((1, 3, 4, 8), (1, 2, 4, 8), (1, 2, 4, 8)), {"enable_gqa": True}, ValueError),  # not a multiple
    (((2, 4, 8), (2, 4, 8), (2, 4, 8)), {"dropout_p": 1.5}, ValueError),
    (((2, 4, 8), (2, 4, 8), (2, 4, 8)), {"attn_mask": ("float64", (4, 4))}, TypeError),  # float64 mask, float32 q
    (((2, 4, 8), (2, 4, 8), (2, 4, 8)), {"attn_mask": ("float16", (4, 4))}, TypeError),
    (((2, 4, 8), (2, 4, 8), (2, 4, 8)), {"attn_mask": ("int64", (4, 4))}, TypeError),
    (((2, 4, 8), (2, 4, 8), (2, 4, 8)), {"attn_mask": ("bool", (3, 4))}, ValueError),
    (((2, 4, 8), (2, 4, 8), (2, 4, 8)), {"attn_mask": ("bool", (1, 1, 2, 4, 4))}, ValueError),  # more dims than the weights
    (((2, 4, 8), (2, 4, 8), (2, 4, 8)), {"attn_mask": ("float32", (4, 4)), "is_causal": True}, ValueError),
])
def test_bad_input_refused_like_torch(args, kw, error):
    q, k, v = (torch.randn(*s) for s in args)
    if "attn_mask" in kw:
        dtype, shape = kw["attn_mask"]
        kw = {**kw, "attn_mask": torch.ones(shape, dtype=getattr(torch, dtype))}
    with pytest.raises(error):
        fastattn.scaled_dot_product_attention(q, k, v, **kw)
    if min(map(len, args)) >= 2 and args[1][-2] != args[2][-2]:
        return  # torch's CPU kernel does not check this one (it reads value with key's length)
    if kw.get("is_causal"):  # documented as an error; torch's math kernel raises, its CPU flash kernel does not
        kw["attn_mask"].requires_grad_()  # (a mask that needs a gradient takes the math kernel)
    with pytest.raises(RuntimeError):
        F.scaled_dot_product_attention(q, k, v, **kw)


@pytest.mark.parametrize("shape", [(1, 2, 4, 8), (2, 4, 8)])  # the one-call path, and the general one
def test_argument_kinds_refused_like_torch(shape):
    q = torch.randn(*shape)
    for bad in ("bottom_right", "no", 1, None):  # a string once meant a bottom-right band on one path
        with pytest.raises(TypeError, match="is_causal"):
            fastattn.scaled_dot_product_attention(q, q, q, is_causal=bad)
        with pytest.raises(TypeError):
            F.scaled_dot_product_attention(q, q, q, is_causal=bad)
    for fn in (fastattn.scaled_dot_product_attention, F.scaled_dot_product_attention):
        with pytest.raises(TypeError):  # scale and enable_gqa are keyword-only
            fn(q, q, q, None, 0.0, False, 0.5)
    for fn in (fastattn.scaled_dot_product_attention, F.scaled_dot_product_attention):
        with pytest.raises(TypeError, match="scale"):
            fn(q, q, q, scale="a")
    torch.testing.assert_close(fastattn.scaled_dot_product_attention(q, q, q, None, 0.0, True, scale=0.5),
                               F.scaled_dot_product_attention(q, q, q, None, 0.0, True, scale=0.5))
