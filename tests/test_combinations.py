"""Seeded random combinations of the options of the ops that have many, every backend against the
float64 reference: attention and varlen forward and backward, paged attention forward (its only
mode), and the norms (LayerNorm / RMSNorm, with and without the fused residual add).

The other tests pick their cases by hand, one option at a time. Here each case draws every option
at once (dtype, GQA, Dv != D, lengths 1 to 130, odd head dims, six mask kinds with fully masked
rows, causal top-left / bottom-right, windows, dropout, scale, inputs laid out (B, L, H, D) as a
model's projections give them; for the norms: residual, RMS, 1-D or 2-D normalized shapes,
weight and bias or not, eps, strided rows), so that options meet in pairs no hand-picked case has. A case's
id is its seed: ``random.Random(seed)`` draws it again. As in every test (conftest's poisoned
outputs), a value a kernel leaves unwritten is NaN and fails.

Huge logits are left to test_attention's own test: there the backward's rowsum(dO * O) cancels
down to rounding noise, the same on torch's kernels, and no tolerance tells that from a bug.
"""

import math
import random

import numpy as np
import pytest
import torch
import torch.nn.functional as F

import fastattn
from fastattn import reference
from fastattn.testing import assert_close_to_reference, mask_to_numpy, to_numpy

from conftest import backend_params, skip_refused

#: Cases per backend. Triton runs the first few only: each case is a new shape, interpreted on a
#: CPU-only machine and compiled (every autotune config) on a GPU.
CASES = 48
TRITON_CASES = 12


def _seeds(op):
    params = []
    for p in backend_params(op):
        backend, device = p.values
        for seed in range(TRITON_CASES if backend == "triton" else CASES):
            params.append(pytest.param(backend, device, seed, id=f"{p.id}-{seed}", marks=p.marks))
    return params


def _drawn(op, draw, backend, device, seed):
    """Case ``seed`` of ``draw`` and the generator of its values; skipped where ``backend``
    refuses its dtype or (attention) head dims."""
    c = draw(seed)
    facts = {"head_dim": max(c["D"], c["Dv"])} if "D" in c else {}
    skip_refused(op, backend, device, c["dtype"], **facts)
    return c, torch.Generator().manual_seed(seed)


def _tensor(g, shape, device, dtype, blhd=False):
    """Standard normal values; with ``blhd`` a (B, H, L, D) view of (B, L, H, D) memory."""
    if blhd:
        b, h, l, d = shape
        t = torch.randn(b, l, h, d, generator=g, dtype=torch.float64).transpose(1, 2)
    else:
        t = torch.randn(*shape, generator=g, dtype=torch.float64)
    return t.to(device, dtype)


def _mask(kind, shape, g, device, dtype):
    B, H, Lq, Lk = shape
    if kind == "bool":  # full, with a fully masked row
        m = torch.rand(B, H, Lq, Lk, generator=g) > 0.3
        m[..., 0, :] = False
        return m.to(device)
    if kind == "bool-shared":
        return (torch.rand(1, 1, Lq, Lk, generator=g) > 0.5).to(device)
    if kind == "bias":
        return _tensor(g, (B, H, Lq, Lk), device, dtype)
    if kind == "key-bias":  # (B, 1, 1, Lk)
        return _tensor(g, (B, 1, 1, Lk), device, dtype)
    if kind == "bias-inf":  # per head, some keys at -inf
        m = torch.randn(1, H, Lq, Lk, generator=g, dtype=torch.float64)
        m[torch.rand(1, H, Lq, Lk, generator=g) > 0.6] = -math.inf
        return m.to(device, dtype)
    return None


def _draw_attention(seed):
    r = random.Random(seed)
    hkv = r.choice([1, 2])
    d = r.choice([1, 8, 16, 40, 64, 80, 100])
    return dict(
        dtype=r.choice([torch.float32, torch.bfloat16, torch.float64]),
        B=r.choice([1, 2]), H=hkv * r.choice([1, 1, 3]), Hkv=hkv,
        Lq=r.choice([1, 2, 5, 17, 33, 64, 70]), Lk=r.choice([1, 3, 17, 40, 65, 130]),
        D=d, Dv=r.choice([d, d, 24, 1]),
        causal=r.choice([False, False, True, "bottom_right"]),
        window=r.choice([None, None, (r.randint(0, 20), r.choice([None, 0, 5]))]),
        mask=r.choice([None, "bool", "bool-shared", "bias", "key-bias", "bias-inf"]),
        dropout_p=r.choice([0.0, 0.0, 0.0, 0.3]),
        scale=r.choice([None, None, 0.05, 1.5]),
        blhd=r.random() < 0.5,
    )


@pytest.mark.parametrize("backend,device,seed", _seeds("attention"))
def test_attention_combinations(backend, device, seed):
    c, g = _drawn("attention", _draw_attention, backend, device, seed)
    dtype = c["dtype"]
    B, H, Hkv, Lq, Lk = c["B"], c["H"], c["Hkv"], c["Lq"], c["Lk"]
    q = _tensor(g, (B, H, Lq, c["D"]), device, dtype, c["blhd"]).requires_grad_()
    k = _tensor(g, (B, Hkv, Lk, c["D"]), device, dtype, c["blhd"]).requires_grad_()
    v = _tensor(g, (B, Hkv, Lk, c["Dv"]), device, dtype, c["blhd"]).requires_grad_()
    mask = _mask(c["mask"], (B, H, Lq, Lk), g, device, dtype)
    inputs = [q, k, v]
    if mask is not None and mask.is_floating_point():
        mask.requires_grad_()
        inputs.append(mask)
    options = dict(causal=c["causal"], window=c["window"], scale=c["scale"], dropout_p=c["dropout_p"],
                   seed=seed, enable_gqa=H != Hkv)
    out, lse = fastattn.attention(q, k, v, mask, return_lse=True, backend=backend, **options)
    dout = _tensor(g, out.shape, device, dtype)
    grads = torch.autograd.grad(out, inputs, dout)

    np_mask = mask_to_numpy(mask)
    arrays = [to_numpy(t) for t in (q, k, v)]
    ref_out, ref_lse = reference.attention(*arrays, np_mask, **options)
    assert_close_to_reference(out, ref_out, name="out")
    # (lse is float32 whatever the input; a -inf row of one and not the other is an infinite error)
    assert_close_to_reference(lse, ref_lse, atol=5e-2 if dtype == torch.bfloat16 else 1e-4, name="lse")
    wanted = reference.attention_backward(to_numpy(dout), *arrays, np_mask, **options)
    for name, got, want in zip(("dq", "dk", "dv", "dmask"), grads, wanted):
        assert_close_to_reference(got, want, name=name)


def _draw_varlen(seed):
    r = random.Random(seed)
    hkv = r.choice([1, 2])
    d = r.choice([1, 8, 40, 64, 80])
    n = r.randint(1, 4)
    lq = [r.choice([0, 1, 3, 17, 40]) for _ in range(n)]
    return dict(
        dtype=r.choice([torch.float32, torch.bfloat16, torch.float64]),
        H=hkv * r.choice([1, 2, 3]), Hkv=hkv, D=d, Dv=r.choice([d, 16]),
        lq=lq, lk=[r.choice([0, 1, 5, 17, 70]) if r.random() < 0.5 else n_q for n_q in lq],
        causal=r.choice([False, True, "bottom_right"]),
        window=r.choice([None, None, (r.randint(0, 9), r.choice([None, 0, 3]))]),
        scale=r.choice([None, 0.3]),
        dropout_p=r.choice([0.0, 0.0, 0.25]),
    )


@pytest.mark.parametrize("backend,device,seed", _seeds("varlen_attention"))
def test_varlen_combinations(backend, device, seed):
    c, g = _drawn("varlen_attention", _draw_varlen, backend, device, seed)
    dtype = c["dtype"]
    cu_q, cu_k = (torch.tensor(np.cumsum([0, *lens]), dtype=torch.int32, device=device) for lens in (c["lq"], c["lk"]))
    q = _tensor(g, (sum(c["lq"]), c["H"], c["D"]), device, dtype).requires_grad_()
    k = _tensor(g, (sum(c["lk"]), c["Hkv"], c["D"]), device, dtype).requires_grad_()
    v = _tensor(g, (sum(c["lk"]), c["Hkv"], c["Dv"]), device, dtype).requires_grad_()
    options = dict(causal=c["causal"], window=c["window"], scale=c["scale"], dropout_p=c["dropout_p"], seed=seed)
    out = fastattn.varlen_attention(q, k, v, cu_q, cu_k, max(c["lq"]), max(c["lk"]), backend=backend, **options)
    dout = _tensor(g, out.shape, device, dtype)
    grads = torch.autograd.grad(out, (q, k, v), dout, allow_unused=True)

    arrays = [to_numpy(t) for t in (q, k, v)] + [cu_q.cpu().numpy(), cu_k.cpu().numpy()]
    ref_out, _ = reference.varlen_attention(*arrays, **options)
    assert_close_to_reference(out, ref_out, name="out")
    wanted = reference.varlen_attention_backward(to_numpy(dout), *arrays, **options)
    for name, t, got, want in zip(("dq", "dk", "dv"), (q, k, v), grads, wanted):
        assert_close_to_reference(torch.zeros_like(t) if got is None else got, want, name=name)


def _draw_paged(seed):
    r = random.Random(seed)
    hkv = r.choice([1, 2])
    d = r.choice([1, 8, 40, 64, 80])
    B, Lq = r.randint(1, 3), r.choice([1, 1, 2, 5])
    return dict(
        dtype=r.choice([torch.float32, torch.bfloat16, torch.float64]),
        H=hkv * r.choice([1, 2, 3]), Hkv=hkv, D=d, Dv=r.choice([d, 16]), Lq=Lq,
        block_size=r.choice([1, 4, 16]), spare_blocks=r.randint(0, 2),
        lens=[r.choice([Lq, Lq + 1, 17, 40, 100]) for _ in range(B)],
        causal=r.choice(["bottom_right", False]),
        window=r.choice([None, None, (r.randint(0, 9), r.choice([None, 0, 3]))]),
        scale=r.choice([None, 0.3]),
    )


@pytest.mark.parametrize("backend,device,seed", _seeds("paged_attention"))
def test_paged_combinations(backend, device, seed):
    c, g = _drawn("paged_attention", _draw_paged, backend, device, seed)
    dtype = c["dtype"]
    B, bs = len(c["lens"]), c["block_size"]
    per_row = max(math.ceil(n / bs) for n in c["lens"]) + c["spare_blocks"]
    blocks = B * per_row + 3  # blocks no row owns, in a shuffled table
    table = torch.randperm(blocks, generator=g)[: B * per_row].reshape(B, per_row).to(device, torch.int32)
    k_cache = _tensor(g, (blocks, bs, c["Hkv"], c["D"]), device, dtype)
    v_cache = _tensor(g, (blocks, bs, c["Hkv"], c["Dv"]), device, dtype)
    q = _tensor(g, (B, c["H"], c["Lq"], c["D"]), device, dtype)
    seqlens = torch.tensor(c["lens"], dtype=torch.int32, device=device)
    options = dict(causal=c["causal"], window=c["window"], scale=c["scale"])
    out = fastattn.paged_attention(q, k_cache, v_cache, table, seqlens, backend=backend, **options)
    arrays = [to_numpy(t) for t in (q, k_cache, v_cache)] + [table.cpu().numpy(), seqlens.cpu().numpy()]
    ref_out, _ = reference.paged_attention(*arrays, **options)
    assert_close_to_reference(out, ref_out, name="out")


def _draw_norm(seed):
    r = random.Random(seed)
    normalized = [r.choice([1, 3, 17, 100, 769, 2049])]
    if r.random() < 0.3:
        normalized.insert(0, r.choice([2, 3]))
    rms = r.random() < 0.5
    return dict(
        dtype=r.choice([torch.float32, torch.bfloat16, torch.float16]),
        rms=rms, residual=r.random() < 0.5,
        lead=[r.choice([1, 2, 5]), *([r.choice([1, 3])] if r.random() < 0.5 else [])],
        normalized=tuple(normalized),
        weight=r.random() < 0.75, bias=not rms and r.random() < 0.5,
        eps=r.choice([1e-5, 1e-6, 0.1]), offset=r.choice([0.0, 0.0, 10.0]),
        strided=r.random() < 0.3,
    )


@pytest.mark.parametrize("backend,device,seed", _seeds("layer_norm"))
def test_norm_combinations(backend, device, seed):
    c, g = _drawn("layer_norm", _draw_norm, backend, device, seed)
    dtype, ns, eps = c["dtype"], c["normalized"], c["eps"]
    shape = (*c["lead"], *ns)

    def values(shape, scale=1.0, offset=0.0, strided=False):
        # strided: rows 3 elements apart, as a slice of a wider tensor leaves them
        t = torch.randn(*shape[:-1], shape[-1] + 3 * strided, generator=g, dtype=torch.float64)
        return (t[..., : shape[-1]] * scale + offset).to(device, dtype).requires_grad_()

    x = values(shape, 2.0, c["offset"], c["strided"])
    residual = values(shape) if c["residual"] else None
    weight = values(ns, 0.5, 1.0) if c["weight"] else None
    bias = values(ns, 0.5) if c["bias"] else None

    rms, fused = c["rms"], c["residual"]
    if fused:
        outs = fastattn.add_layer_norm(x, residual, ns, weight, bias, eps, rms=rms, backend=backend)
        h = x + residual  # (the fused op's h: the sum in the input dtype)
    else:
        outs = (fastattn.rms_norm(x, ns, weight, eps, backend=backend) if rms
                else fastattn.layer_norm(x, ns, weight, bias, eps, backend=backend),)
        h = x
    base = F.rms_norm(h, ns, weight, eps) if rms else F.layer_norm(h, ns, weight, bias, eps)
    h64, w64 = to_numpy(h), None if weight is None else to_numpy(weight)
    if rms:
        ref, _ = reference.rms_norm(h64, ns, w64, eps)
    else:
        ref, _, _ = reference.layer_norm(h64, ns, w64, None if bias is None else to_numpy(bias), eps)
    assert_close_to_reference(outs[0], ref, base, name="y")
    if fused:
        assert torch.equal(outs[1], h), "h must be input + residual in the input dtype"

    cotangents = [torch.randn(shape, generator=g, dtype=torch.float64).to(device, dtype) for _ in range(1 + fused)]
    inputs = [t for t in (x, residual, weight, bias) if t is not None]
    grads = torch.autograd.grad(outs, inputs, cotangents)
    base_grads = torch.autograd.grad([base, h][: 1 + fused], inputs, cotangents)
    backward = reference.rms_norm_backward if rms else reference.layer_norm_backward
    dh, dweight, *dbias = backward(to_numpy(cotangents[0]), h64, ns, w64, eps)
    if fused:
        dh = dh + to_numpy(cotangents[1])  # h's own gradient flows to input and residual alike
    wanted = {"dx": dh, "dresidual": dh, "dweight": dweight, "dbias": dbias[0] if dbias else None}
    names = [n for n, t in zip(wanted, (x, residual, weight, bias)) if t is not None]
    for name, got, baseline in zip(names, grads, base_grads):
        assert_close_to_reference(got, wanted[name], baseline, name=name)
