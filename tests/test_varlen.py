"""fastattn.varlen_attention (packed sequences) on every backend against the float64 reference:
forward, lse and gradients; empty sequences, fully masked rows, GQA, bands, dropout, bad input.

Shapes stay tiny: the triton backend runs under the Triton interpreter on CPU machines.
"""

import pytest
import torch

import fastattn
from fastattn import reference
from fastattn.testing import assert_close_to_reference, opcheck, to_numpy

from conftest import backend_params, dtype_for, torch_threads

BACKENDS = backend_params("varlen_attention")


def _cu(lengths, device):
    return torch.tensor([0, *torch.tensor(lengths).cumsum(0).tolist()], dtype=torch.int32, device=device)


def _packed(lens_q, lens_k, H, Hkv, D, Dv, device, dtype=torch.float32, seed=0):
    g = torch.Generator().manual_seed(seed)
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(device, dtype).requires_grad_()  # noqa: E731
    q = mk(sum(lens_q), H, D)
    k = mk(sum(lens_k), Hkv, D)
    v = mk(sum(lens_k), Hkv, Dv)
    return q, k, v, _cu(lens_q, device), _cu(lens_k, device)


# (lens_q, lens_k, H, Hkv, D, Dv, causal, window)
CASES = [
    ([1, 17, 130], [1, 17, 130], 2, 2, 40, 40, True, None),
    ([17, 0, 5, 3], [33, 4, 0, 9], 4, 2, 80, 80, "bottom_right", None),   # empty q / k sequences, GQA
    ([17, 9], [17, 9], 2, 1, 100, 100, False, (4, 3)),                     # MQA, sliding window
    ([17, 5], [9, 3], 2, 2, 16, 24, "bottom_right", (2, None)),            # rows with no key, Dv != D
    ([6, 17], [17, 6], 1, 1, 16, 16, "top_left", None),
]


# Longer sequences for the compiled kernels' tests (test_cuda_kernels.py, test_cuda_emulated.py;
# too slow for the Triton interpreter): several query blocks and key tiles a sequence, the
# head-dim buckets 128 and 256, an empty key sequence, a window with MQA.
KERNEL_CASES = [
    ([70, 200, 5], [90, 200, 0], 4, 2, 128, 128, True, None),
    ([33, 150], [150, 40], 2, 1, 256, 200, "bottom_right", (40, 20)),
]


def _ids(case):
    lq, lk, H, Hkv, D, Dv, causal, window = case
    return f"{lq}x{lk}-h{H}/{Hkv}-d{D}/{Dv}-{causal}-{window}"


# Gradients' absolute slack per dtype (the 16-bit ones: the cuda backend, emulated or not).
GRAD_ATOL = {torch.float32: 1e-4, torch.float16: 5e-3, torch.bfloat16: 3e-2}


def check_varlen(backend, device, case, dtype, max_seqlens=(None, None)):
    """varlen_attention on one case of CASES against the float64 reference: out, lse, and the
    gradients through the backend's autograd (also run by test_cuda_emulated.py)."""
    lens_q, lens_k, H, Hkv, D, Dv, causal, window = case
    q, k, v, cu_q, cu_k = _packed(lens_q, lens_k, H, Hkv, D, Dv, device, dtype)
    out, lse = fastattn.varlen_attention(q, k, v, cu_q, cu_k, *max_seqlens, causal=causal,
                                         window=window, return_lse=True, backend=backend)
    ref_out, ref_lse = reference.varlen_attention(to_numpy(q), to_numpy(k), to_numpy(v), cu_q.cpu(),
                                                  cu_k.cpu(), causal=causal, window=window)
    assert out.shape == q.shape[:2] + (Dv,) and lse.shape == (H, q.shape[0]) and lse.dtype == torch.float32
    assert out.dtype == dtype
    assert_close_to_reference(out, ref_out, name="out")
    assert_close_to_reference(lse, ref_lse, name="lse")
    dout = torch.randn(out.shape, generator=torch.Generator().manual_seed(1)).to(device, dtype)
    dq, dk, dv = torch.autograd.grad(out, (q, k, v), dout)
    ref = reference.varlen_attention_backward(to_numpy(dout), to_numpy(q), to_numpy(k), to_numpy(v),
                                              cu_q.cpu(), cu_k.cpu(), causal=causal, window=window)
    for name, got, want in zip(("dq", "dk", "dv"), (dq, dk, dv), ref):
        assert_close_to_reference(got, want, atol=GRAD_ATOL[dtype], name=name)


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_matches_reference(backend, device, case):
    lens_q, lens_k, H, Hkv, D, Dv, causal, window = case
    if backend == "triton" and max(lens_q) * max(lens_k) > 17 * 33 and D != 40:
        pytest.skip("interpreter: keep the big case to one head dim")
    check_varlen(backend, device, case, dtype_for("varlen_attention", backend, device))


def check_fully_masked_rows(backend, device, dtype):
    """A key sequence of length 0, and bottom-right rows before the first key: out 0, lse -inf,
    gradients 0, never NaN."""
    q, k, v, cu_q, cu_k = _packed([3, 4], [0, 2], 2, 2, 16, 16, device, dtype)
    out, lse = fastattn.varlen_attention(q, k, v, cu_q, cu_k, causal="bottom_right", return_lse=True,
                                         backend=backend)
    assert torch.all(out[:5] == 0) and torch.all(torch.isneginf(lse[:, :5]))
    assert torch.all(out[5:] != 0)
    (dq,) = torch.autograd.grad(out.sum(), (q,))
    assert not dq.isnan().any() and torch.all(dq[:5] == 0)


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_fully_masked_rows_are_zero(backend, device):
    check_fully_masked_rows(backend, device, dtype_for("varlen_attention", backend, device))


def check_dropout(backend, device, dtype):
    """Dropout draws sequence b's mask from batch row b's stream (counter i Lk_b + j)."""
    q, k, v, cu_q, cu_k = _packed([5, 17], [9, 17], 2, 1, 16, 16, device, dtype)
    out = fastattn.varlen_attention(q, k, v, cu_q, cu_k, causal=True, dropout_p=0.3, seed=1234,
                                    backend=backend)
    ref_out, _ = reference.varlen_attention(to_numpy(q), to_numpy(k), to_numpy(v), cu_q.cpu(), cu_k.cpu(),
                                            causal=True, dropout_p=0.3, seed=1234)
    assert_close_to_reference(out, ref_out, name="out")
    dout = torch.ones_like(out)
    grads = torch.autograd.grad(out, (q, k, v), dout)
    ref = reference.varlen_attention_backward(to_numpy(dout), to_numpy(q), to_numpy(k), to_numpy(v),
                                              cu_q.cpu(), cu_k.cpu(), causal=True, dropout_p=0.3, seed=1234)
    for name, got, want in zip(("dq", "dk", "dv"), grads, ref):
        assert_close_to_reference(got, want, atol=GRAD_ATOL[dtype], name=name)


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_dropout_matches_reference(backend, device):
    check_dropout(backend, device, dtype_for("varlen_attention", backend, device))


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_half_precision(backend, device):
    q, k, v, cu_q, cu_k = _packed([17, 3], [17, 30], 2, 2, 40, 40, device, dtype=torch.bfloat16)
    out = fastattn.varlen_attention(q, k, v, cu_q, cu_k, causal="bottom_right", backend=backend)
    assert out.dtype == torch.bfloat16
    ref_out, _ = reference.varlen_attention(to_numpy(q), to_numpy(k), to_numpy(v), cu_q.cpu(), cu_k.cpu(),
                                            causal="bottom_right")
    assert_close_to_reference(out, ref_out, atol=3e-2, name="out")


def test_equals_dense_attention_per_sequence():
    """Packing changes nothing: each sequence equals fastattn.attention on its own slice."""
    q, k, v, cu_q, cu_k = _packed([7, 12], [7, 12], 4, 2, 16, 16, "cpu")
    out = fastattn.varlen_attention(q, k, v, cu_q, cu_k, causal=True)
    for b in range(2):
        sl = slice(int(cu_q[b]), int(cu_q[b + 1]))
        dense = fastattn.attention(q[sl].permute(1, 0, 2)[None], k[sl].permute(1, 0, 2)[None],
                                   v[sl].permute(1, 0, 2)[None], causal=True, enable_gqa=True)
        torch.testing.assert_close(out[sl], dense[0].permute(1, 0, 2), atol=1e-5, rtol=1e-5)


def test_cuda_backend_refuses_cpu_float32_inputs():
    """Backend selection refuses what the cuda kernels cannot take (CPU tensors, float32) with a
    ValueError naming the backend, on any machine, before a kernel is called."""
    q, k, v, cu_q, cu_k = _packed([3], [3], 1, 1, 16, 16, "cpu")
    with pytest.raises(ValueError, match="cuda"):
        fastattn.varlen_attention(q, k, v, cu_q, cu_k, backend="cuda")


# ---------------------------------------------------------------------------------------------
# Bad input: a ValueError / TypeError that names the argument.


def _bad_cases():
    def call(**over):
        q, k, v, cu_q, cu_k = _packed([3, 4], [5, 2], 2, 2, 16, 16, "cpu")
        args = dict(q=q, k=k, v=v, cu_seqlens_q=cu_q, cu_seqlens_k=cu_k)
        args.update(over)
        fastattn.varlen_attention(**args)

    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    return [
        ("cu_seqlens_q int64", TypeError, "cu_seqlens_q", lambda: call(cu_seqlens_q=torch.tensor([0, 3, 7]))),
        ("cu_seqlens_k not from 0", ValueError, "cu_seqlens_k", lambda: call(cu_seqlens_k=i32(1, 5, 7))),
        ("cu_seqlens_q decreasing", ValueError, "cu_seqlens_q", lambda: call(cu_seqlens_q=i32(0, 5, 3))),
        ("cu_seqlens_q wrong total", ValueError, "cu_seqlens_q", lambda: call(cu_seqlens_q=i32(0, 3, 6))),
        ("batch mismatch", ValueError, "cu_seqlens", lambda: call(cu_seqlens_k=i32(0, 7))),
        ("max_seqlen_q too small", ValueError, "max_seqlen_q", lambda: call(max_seqlen_q=3)),
        ("max_seqlen_k too small", ValueError, "max_seqlen_k", lambda: call(max_seqlen_k=4)),
        ("q 4-D", ValueError, "q", lambda: call(q=torch.zeros(1, 7, 2, 16))),
        ("k dtype", TypeError, "k", lambda: call(k=torch.zeros(7, 2, 16, dtype=torch.float64))),
        ("gqa", ValueError, "heads", lambda: call(k=torch.zeros(7, 3, 16), v=torch.zeros(7, 3, 16))),
        ("head dim", ValueError, "head dim", lambda: call(k=torch.zeros(7, 2, 8))),
        ("causal", ValueError, "causal", lambda: fastattn.varlen_attention(
            torch.zeros(3, 1, 16), torch.zeros(3, 1, 16), torch.zeros(3, 1, 16), i32(0, 3), i32(0, 3),
            causal="bottom")),
    ]


@pytest.mark.parametrize("name,exc,match,fn", _bad_cases(), ids=[c[0] for c in _bad_cases()])
def test_bad_input(name, exc, match, fn):
    with pytest.raises(exc, match=match):
        fn()


@pytest.mark.skipif(not hasattr(torch.ops.fastattn, "varlen_attention_fwd"), reason="no extension")
def test_cpp_op_rejects_out_of_bounds_cu_seqlens():
    """The C++ op checks cu_seqlens itself, so a direct call cannot read out of bounds."""
    q = torch.zeros(4, 1, 16)
    bad = torch.tensor([0, 9], dtype=torch.int32)
    good = torch.tensor([0, 4], dtype=torch.int32)
    with pytest.raises(RuntimeError, match="cu_seqlens_q"):
        torch.ops.fastattn.varlen_attention_fwd(q, q, q, bad, good, 9, 4, 1.0, False, 8, 8, 0.0, 0)


# ---------------------------------------------------------------------------------------------
# Registered ops.


def _op_args(device):
    q, k, v, cu_q, cu_k = _packed([3, 0, 5], [4, 2, 5], 2, 1, 16, 16, device)
    return (q.detach(), k.detach(), v.detach(), cu_q, cu_k, 5, 5, 0.25, True, 10, 0, 0.0, 0)


@pytest.mark.skipif(not hasattr(torch.ops.fastattn, "varlen_attention_fwd"), reason="no extension")
def test_opcheck_cpp():
    opcheck(torch.ops.fastattn.varlen_attention_fwd.default, _op_args("cpu"))
    opcheck(torch.ops.fastattn.paged_attention_fwd.default, _paged_op_args(), requires_grad=False)


@pytest.mark.skipif("triton" not in fastattn.available_backends(), reason="triton unavailable")
def test_opcheck_triton():
    from conftest import DEVICE

    opcheck(torch.ops.fastattn.triton_varlen_attention_fwd.default, _op_args(DEVICE))
    args = tuple(a.to(DEVICE) if isinstance(a, torch.Tensor) else a for a in _paged_op_args())
    opcheck(torch.ops.fastattn.triton_paged_attention_fwd.default, args, requires_grad=False)


def _paged_op_args():
    g = torch.Generator().manual_seed(0)
    q = torch.randn(2, 2, 1, 16, generator=g)
    kc = torch.randn(4, 4, 1, 16, generator=g)
    vc = torch.randn(4, 4, 1, 16, generator=g)
    table = torch.tensor([[2, 0], [1, 3]], dtype=torch.int32)
    lens = torch.tensor([6, 3], dtype=torch.int32)
    return (q, kc, vc, table, lens, 0.25, True, 9, 9)


# ---------------------------------------------------------------------------------------------
# Hugging Face padding-free batches (tiny models from their configs; no downloads)


@pytest.fixture(scope="module")
def transformers():
    return pytest.importorskip("transformers", minversion="4.53")


def _tiny(transformers, kind):
    if kind == "llama":
        cfg = transformers.LlamaConfig(vocab_size=64, hidden_size=32, intermediate_size=64, num_hidden_layers=2,
                                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=64)
    else:
        cfg = transformers.GPT2Config(vocab_size=64, n_embd=32, n_layer=2, n_head=2, n_positions=64,
                                      resid_pdrop=0.0, embd_pdrop=0.0, attn_pdrop=0.0)
    torch.manual_seed(0)
    return transformers.AutoModelForCausalLM.from_config(cfg, attn_implementation="eager").eval()


@pytest.mark.parametrize("kind", ["llama", "gpt2"])
def test_hf_packed_batch_equals_eager(transformers, kind, monkeypatch):
    """A packed batch through fastattn's registered HF attention (attn_implementation="fastattn"),
    which takes the varlen path when transformers passes cu_seq_lens_*, equals eager on each
    sequence alone, forward and gradients."""
    from fastattn.ops import varlen

    calls = []
    packed = varlen.hf_varlen_attention_forward

    def spy(module, query, *args, **kwargs):
        calls.append(query.shape)
        return packed(module, query, *args, **kwargs)

    monkeypatch.setattr(varlen, "hf_varlen_attention_forward", spy)
    fastattn.register_hf()
    model = _tiny(transformers, kind)
    lengths = [5, 17, 1]
    g = torch.Generator().manual_seed(1)
    seqs = [torch.randint(0, 64, (n,), generator=g) for n in lengths]

    model.zero_grad()
    eager = [model(s[None]).logits[0] for s in seqs]
    sum(e.square().mean() for e in eager).backward()
    eager_grads = {n: p.grad.clone() for n, p in model.named_parameters() if p.grad is not None}

    model.set_attn_implementation("fastattn")
    model.zero_grad()
    cu = _cu(lengths, "cpu")
    positions = torch.cat([torch.arange(n) for n in lengths])[None]
    logits = model(torch.cat(seqs)[None], position_ids=positions, cu_seq_lens_q=cu, cu_seq_lens_k=cu,
                   max_length_q=max(lengths), max_length_k=max(lengths)).logits[0]
    assert len(calls) == 2
    parts = logits.split(lengths)
    for got, want in zip(parts, eager):
        torch.testing.assert_close(got, want, atol=1e-5, rtol=1e-5)
    sum(p.square().mean() for p in parts).backward()
    for name, p in model.named_parameters():
        if name in eager_grads:
            torch.testing.assert_close(p.grad, eager_grads[name], atol=1e-5, rtol=1e-4, msg=name)


@pytest.mark.parametrize("backend,device", [p for p in BACKENDS if p.id in ("cpu", "naive")])
@pytest.mark.parametrize("lens_q,lens_k", [
    ([3, 1, 0, 7, 2, 5, 1, 4, 6], [6, 4, 1, 5, 2, 7, 0, 1, 3]),     # all in parallel
    ([3, 40, 0, 7, 2, 5, 1, 4, 6], [3, 40, 0, 7, 2, 5, 1, 4, 6]),   # the long one alone first
], ids=["short", "one-long"])
def test_many_short_sequences(backend, device, lens_q, lens_k):
    """More sequences than threads: the cpu backend runs sequences in parallel (each dense call
    on one thread), after any sequence with more than a thread's share of the work, which runs
    alone (parallel inside); the result and gradients must not change."""
    with torch_threads(2):
        q, k, v, cu_q, cu_k = _packed(lens_q, lens_k, 4, 2, 16, 16, device, dtype=torch.float64)
        out = fastattn.varlen_attention(q, k, v, cu_q, cu_k, causal="bottom_right", backend=backend)
        cu = (cu_q.cpu(), cu_k.cpu())
        ref_out, _ = reference.varlen_attention(to_numpy(q), to_numpy(k), to_numpy(v), *cu,
                                                causal="bottom_right")
        assert_close_to_reference(out, ref_out, name="out")
        grads = torch.autograd.grad(out.sum(), (q, k, v))
        ref = reference.varlen_attention_backward(to_numpy(torch.ones_like(out)), to_numpy(q),
                                                  to_numpy(k), to_numpy(v), *cu, causal="bottom_right")
        for name, got, want in zip(("dq", "dk", "dv"), grads, ref):
            assert_close_to_reference(got, want, name=name)


def test_tiles_take_symbolic_head_dims(monkeypatch):
    """Under torch.compile's dynamic shapes (opcheck's aot_dispatch_dynamic) the launchers get
    SymInt head dims: the GPU's tile table must take them as it takes ints (an H100, 2026-11-27:
    float32's table was indexed by a SymBool). The interpreter's branch never reads them."""
    pytest.importorskip("triton")
    from torch.fx.experimental.symbolic_shapes import ShapeEnv

    from fastattn.kernels import varlen
    from fastattn.testing import symbolic_int

    monkeypatch.setattr(varlen, "_INTERPRET", False)
    env = ShapeEnv()
    for i, (d, dv) in enumerate([(64, 64), (80, 16), (200, 256)]):
        sym_d, sym_dv = symbolic_int(env, d, f"d{i}"), symbolic_int(env, dv, f"dv{i}")
        for dtype in (torch.float32, torch.bfloat16):
            for kernel in ("fwd", "paged", "dkdv", "dq"):
                assert varlen._tiles(sym_d, sym_dv, dtype, kernel) == varlen._tiles(d, dv, dtype, kernel)
