"""fastattn.paged_attention / paged_cache_append on every backend against the float64 reference,
the split-KV merge, bad input, and the reference GPT generating from a paged cache."""

import pytest
import torch

import fastattn
from fastattn import reference
from fastattn.testing import assert_close_to_reference, opcheck, to_numpy

from conftest import backend_params, dtype_for

BACKENDS = backend_params("paged_attention")


def _paged(lens, Lq, H, Hkv, D, Dv, block_size, device, dtype=torch.float32, spare=2, seed=0):
    """Caches with each sequence's blocks scattered in a shuffled pool (plus spare blocks), a
    block_table padded with -1, and queries."""
    g = torch.Generator().manual_seed(seed)
    need = [max(1, -(-n // block_size)) for n in lens]
    num_blocks = sum(need) + spare
    perm = torch.randperm(num_blocks, generator=g).tolist()
    table = torch.full((len(lens), max(need) + 1), -1, dtype=torch.int32)
    for b, n in enumerate(need):
        table[b, :n] = torch.tensor(perm[:n], dtype=torch.int32)
        perm = perm[n:]
    mk = lambda *s: torch.randn(*s, generator=g, dtype=torch.float64).to(device, dtype)  # noqa: E731
    q = mk(len(lens), H, Lq, D)
    kc = mk(num_blocks, block_size, Hkv, D)
    vc = mk(num_blocks, block_size, Hkv, Dv)
    return q, kc, vc, table.to(device), torch.tensor(lens, dtype=torch.int32, device=device)


# (lens, Lq, H, Hkv, D, Dv, block_size, causal, window)
CASES = [
    ([1, 17, 130], 1, 4, 2, 40, 40, 16, "bottom_right", None),     # decode, GQA
    ([17, 33], 3, 2, 2, 80, 80, 5, "bottom_right", None),          # odd block size, 3 new tokens
    ([0, 20], 1, 2, 1, 100, 100, 8, "bottom_right", None),         # an empty cache row
    ([9, 30], 2, 2, 1, 16, 24, 4, False, (None, None)),            # no band, Dv != D
    ([25], 4, 2, 2, 16, 16, 16, "bottom_right", (6, None)),        # sliding window
    ([2, 12], 5, 1, 1, 16, 16, 4, "top_left", None),
    ([3, 12], 5, 2, 1, 16, 16, 4, "bottom_right", None),           # fewer keys than queries: dead rows
    ([700], 1, 2, 1, 32, 32, 24, "bottom_right", None),            # key splits starting mid-block
    ([300, 45], 1, 2, 2, 256, 256, 16, "bottom_right", None),      # MHA decode, widest heads
    ([40, 9], 2, 8, 2, 256, 192, 8, "bottom_right", None),         # 8 rows a kv head, Dv < D
]


# Split-KV merges: GQA 4 x 5 rows (several row tiles / warps' rows), a row shorter than some
# splits (their partials empty). Run at forced split counts by the compiled backends' tests.
SPLIT_CASE = ([3, 70], 5, 8, 2, 16, 16, 8, "bottom_right", None)


def _ids(case):
    lens, Lq, H, Hkv, D, Dv, bs, causal, window = case
    return f"{lens}-lq{Lq}-h{H}/{Hkv}-d{D}/{Dv}-bs{bs}-{causal}-{window}"


def check_paged(backend, device, case, dtype):
    """paged_attention on one case of CASES against the float64 reference: out and lse (also run
    by test_cuda_kernels.py and test_cuda_emulated.py)."""
    lens, Lq, H, Hkv, D, Dv, bs, causal, window = case
    q, kc, vc, table, seqlens = _paged(lens, Lq, H, Hkv, D, Dv, bs, device, dtype)
    out, lse = fastattn.paged_attention(q, kc, vc, table, seqlens, causal=causal, window=window,
                                        return_lse=True, backend=backend)
    ref_out, ref_lse = reference.paged_attention(to_numpy(q), to_numpy(kc), to_numpy(vc), table.cpu().numpy(),
                                                 seqlens.cpu().numpy(), causal=causal, window=window)
    assert out.shape == (len(lens), H, Lq, Dv) and out.dtype == dtype and lse.dtype == torch.float32
    assert_close_to_reference(out, ref_out, name="out")
    assert_close_to_reference(lse, ref_lse, atol=None if dtype == torch.float32 else 1e-2, name="lse")


@pytest.mark.parametrize("backend,device", BACKENDS)
@pytest.mark.parametrize("case", CASES, ids=_ids)
def test_matches_reference(backend, device, case):
    check_paged(backend, device, case, dtype_for("paged_attention", backend, device))


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_half_precision(backend, device):
    q, kc, vc, table, seqlens = _paged([40, 7], 1, 4, 1, 40, 40, 16, device, dtype=torch.float16)
    out = fastattn.paged_attention(q, kc, vc, table, seqlens, backend=backend)
    ref_out, _ = reference.paged_attention(to_numpy(q), to_numpy(kc), to_numpy(vc), table.cpu().numpy(),
                                           seqlens.cpu().numpy())
    assert out.dtype == torch.float16
    assert_close_to_reference(out, ref_out, atol=5e-3, name="out")


@pytest.mark.parametrize("backend,device", [p for p in BACKENDS if p.id in ("cpu", "naive")])
@pytest.mark.parametrize("dtype", [torch.float64, torch.bfloat16])
def test_float64_and_bfloat16_on_cpu(backend, device, dtype):
    q, kc, vc, table, seqlens = _paged([70, 5], 2, 4, 2, 40, 24, 16, device, dtype=dtype)
    out, lse = fastattn.paged_attention(q, kc, vc, table, seqlens, return_lse=True, backend=backend)
    ref_out, ref_lse = reference.paged_attention(to_numpy(q), to_numpy(kc), to_numpy(vc), table.cpu().numpy(),
                                                 seqlens.cpu().numpy())
    assert out.dtype == dtype
    assert_close_to_reference(out, ref_out, atol=None if dtype == torch.float64 else 3e-2, name="out")
    assert_close_to_reference(lse, ref_lse, atol=1e-4 if dtype == torch.float64 else 3e-2, name="lse")


@pytest.mark.skipif("triton" not in fastattn.available_backends(), reason="triton unavailable")
@pytest.mark.parametrize("splits", [1, 3, 8])
def test_triton_key_splits_merge(splits):
    """The split-KV partials merge to the same result whatever the number of splits (more splits
    than some rows have keys included: their partials are empty)."""
    from conftest import DEVICE
    from fastattn.kernels.varlen import paged_forward

    # 4 query heads per kv head x 5 rows: two row tiles of 16 under the interpreter.
    q, kc, vc, table, seqlens = _paged(*SPLIT_CASE[:7], DEVICE)
    out, lse = paged_forward(q, kc, vc, table, seqlens, 0.25, True, 200, 0, num_splits=splits)
    ref_out, ref_lse = reference.paged_attention(to_numpy(q), to_numpy(kc), to_numpy(vc), table.cpu().numpy(),
                                                 seqlens.cpu().numpy(), scale=0.25)
    assert_close_to_reference(out, ref_out, name="out")
    assert_close_to_reference(lse, ref_lse, name="lse")


def test_equals_dense_attention_on_gathered_cache():
    q, kc, vc, table, seqlens = _paged([11, 30], 2, 2, 2, 16, 16, 4, "cpu")
    out = fastattn.paged_attention(q, kc, vc, table, seqlens)
    for b, n in enumerate(seqlens.tolist()):
        t = torch.arange(n)
        k = kc[table[b, t // 4].long(), t % 4].permute(1, 0, 2)[None]
        v = vc[table[b, t // 4].long(), t % 4].permute(1, 0, 2)[None]
        dense = fastattn.attention(q[b:b + 1], k, v, causal="bottom_right")
        torch.testing.assert_close(out[b:b + 1], dense, atol=1e-5, rtol=1e-5)


def test_cuda_backend_refuses_cpu_float32_inputs():
    """Backend selection refuses what the cuda kernel cannot take (CPU tensors, float32) with a
    ValueError naming the backend, on any machine, before a kernel is called."""
    q, kc, vc, table, seqlens = _paged([3], 1, 1, 1, 16, 16, 4, "cpu")
    with pytest.raises(ValueError, match="cuda"):
        fastattn.paged_attention(q, kc, vc, table, seqlens, backend="cuda")


# ---------------------------------------------------------------------------------------------
# paged_cache_append


def test_append_writes_only_the_new_positions():
    q, kc, vc, table, seqlens = _paged([5, 0, 14], 1, 2, 2, 16, 24, 4, "cpu", spare=3)
    g = torch.Generator().manual_seed(3)
    k_new = torch.randn(3, 2, 2, 16, generator=g)
    v_new = torch.randn(3, 2, 2, 24, generator=g)
    want_k, want_v = reference.paged_cache_append(to_numpy(kc), to_numpy(vc), table.numpy(), seqlens.numpy(),
                                                  to_numpy(k_new), to_numpy(v_new))
    k_before = kc.clone()
    fastattn.paged_cache_append(kc, vc, table, seqlens, k_new, v_new)
    assert torch.equal(kc, torch.from_numpy(want_k).float())
    assert torch.equal(vc, torch.from_numpy(want_v).float())
    assert (kc != k_before).any(-1).any(-1).sum() == 3 * 2  # exactly B * Lnew (block, slot) rows changed


@pytest.mark.parametrize("backend,device", BACKENDS)
def test_append_then_attend_equals_contiguous(backend, device):
    """Prefill + three decode steps through the paged cache equal attention over the contiguous
    keys."""
    g = torch.Generator().manual_seed(0)
    B, Hkv, H, D, bs = 2, 1, 2, 16, 4
    lens = [5, 9]
    k_all = torch.randn(B, Hkv, 12, D, generator=g)
    v_all = torch.randn(B, Hkv, 12, D, generator=g)
    kc = torch.zeros(8, bs, Hkv, D)
    vc = torch.zeros(8, bs, Hkv, D)
    table = torch.tensor([[3, 0, 5, -1], [1, 6, 2, 4]], dtype=torch.int32)
    seqlens = torch.zeros(B, dtype=torch.int32)
    for b, n in enumerate(lens):  # prefill row by row (different lengths)
        one = torch.tensor([0], dtype=torch.int32)
        fastattn.paged_cache_append(kc, vc, table[b:b + 1], one, k_all[b:b + 1, :, :n], v_all[b:b + 1, :, :n])
    seqlens += torch.tensor(lens, dtype=torch.int32)
    for step in range(3):
        pos = seqlens.long()
        k_new = torch.stack([k_all[b, :, pos[b]] for b in range(B)])[:, :, None]
        v_new = torch.stack([v_all[b, :, pos[b]] for b in range(B)])[:, :, None]
        fastattn.paged_cache_append(kc, vc, table, seqlens, k_new, v_new)
        seqlens += 1
        q = torch.randn(B, H, 1, D, generator=g)
        out = fastattn.paged_attention(q.to(device), kc.to(device), vc.to(device), table.to(device),
                                       seqlens.to(device), backend=backend).cpu()
        for b in range(B):
            n = int(seqlens[b])
            dense = fastattn.attention(q[b:b + 1], k_all[b:b + 1, :, :n], v_all[b:b + 1, :, :n],
                                       enable_gqa=True, backend="naive")
            torch.testing.assert_close(out[b:b + 1], dense, atol=2e-5, rtol=2e-5)


def test_opcheck_append():
    q, kc, vc, table, seqlens = _paged([5, 3], 1, 2, 2, 16, 16, 4, "cpu")
    k_new = torch.randn(2, 2, 2, 16)
    opcheck(torch.ops.fastattn.paged_cache_append.default, (kc, vc, table, seqlens, k_new, k_new.clone()),
            requires_grad=False)


# ---------------------------------------------------------------------------------------------
# Bad input


def _bad_cases():
    def setup():
        return _paged([5, 9], 1, 2, 2, 16, 16, 4, "cpu", spare=0)

    def attend(backend, **over):  # (the cpu op checks the values itself, naive through Python)
        q, kc, vc, table, seqlens = setup()
        args = dict(q=q, k_cache=kc, v_cache=vc, block_table=table, cache_seqlens=seqlens)
        args.update(over)
        fastattn.paged_attention(**args, backend=backend)

    def append(backend, **over):  # (one registered op for every backend)
        q, kc, vc, table, seqlens = setup()
        args = dict(k_cache=kc, v_cache=vc, block_table=table, cache_seqlens=seqlens,
                    k_new=torch.zeros(2, 2, 1, 16), v_new=torch.zeros(2, 2, 1, 16))
        args.update(over)
        fastattn.paged_cache_append(**args)

    i32 = lambda *x: torch.tensor(x, dtype=torch.int32)  # noqa: E731
    return [
        ("table int64", TypeError, "block_table", lambda b: attend(b, block_table=torch.zeros(2, 3, dtype=torch.long))),
        ("table out of range", ValueError, "block_table", lambda b: attend(b, block_table=i32([0, 1, -1], [2, 9, 3]))),
        ("table negative", ValueError, "block_table", lambda b: attend(b, block_table=i32([0, -2, -1], [2, 3, 4]))),
        ("seqlens above blocks", ValueError, "cache_seqlens", lambda b: attend(b, cache_seqlens=i32(9, 9))),
        # an entry past the keys is checked too (the rule is the table's, not the keys')
        ("unused entry out of range", ValueError, "block_table", lambda b: attend(
            b, block_table=i32([0, 1, -1], [2, 3, 9]), cache_seqlens=i32(5, 5))),
        # tables with no unused (-1) entry (Python's fast check): out of range, over the row
        ("full table out of range", ValueError, "block_table", lambda b: attend(b, block_table=i32([0, 1, 2], [2, 9, 3]))),
        ("full table seqlens above", ValueError, "cache_seqlens", lambda b: attend(
            b, block_table=i32([0, 1, 2], [2, 3, 4]), cache_seqlens=i32(5, 13))),
        ("seqlens int64", TypeError, "cache_seqlens", lambda b: attend(b, cache_seqlens=torch.tensor([5, 9]))),
        ("seqlens negative", ValueError, "cache_seqlens", lambda b: attend(b, cache_seqlens=i32(-1, 9))),
        ("cache dtype", TypeError, "v_cache", lambda b: attend(b, v_cache=torch.zeros(5, 4, 2, 16, dtype=torch.float64))),
        ("cache shapes", ValueError, "k_cache", lambda b: attend(b, v_cache=torch.zeros(5, 3, 2, 16))),
        ("cache head dim", ValueError, "head dim", lambda b: attend(b, k_cache=torch.zeros(5, 4, 2, 8))),
        ("cache 3-D", ValueError, "k_cache", lambda b: attend(b, k_cache=torch.zeros(5, 4, 2))),
        ("table batch", ValueError, "block_table", lambda b: attend(b, block_table=i32([0, 1, 2]))),
        ("append past blocks", ValueError, "cache_seqlens", lambda b: append(b, cache_seqlens=i32(8, 9))),
        ("append heads", ValueError, "k_new", lambda b: append(b, k_new=torch.zeros(2, 1, 1, 16), v_new=torch.zeros(2, 1, 1, 16))),
        ("append dtype", TypeError, "k_new", lambda b: append(b, k_new=torch.zeros(2, 2, 1, 16, dtype=torch.float16))),
        ("append shared slot", ValueError, "same cache slot", lambda b: append(
            b, block_table=i32([0, 1, -1], [0, 1, 2]), cache_seqlens=i32(5, 5))),
    ]


@pytest.mark.parametrize("backend", [b for b in ("cpu", "naive") if b in fastattn.backends.implementations("paged_attention")])
@pytest.mark.parametrize("name,exc,match,fn", _bad_cases(), ids=[c[0] for c in _bad_cases()])
def test_bad_input(name, exc, match, fn, backend):
    with pytest.raises(exc, match=match):
        fn(backend)


def test_failed_append_leaves_cache_unchanged():
    q, kc, vc, table, seqlens = _paged([5, 9], 1, 2, 2, 16, 16, 4, "cpu", spare=0)
    before = kc.clone(), vc.clone()
    with pytest.raises(ValueError):
        fastattn.paged_cache_append(kc, vc, table, torch.tensor([8, 9], dtype=torch.int32),
                                    torch.ones(2, 2, 1, 16), torch.ones(2, 2, 1, 16))
    assert torch.equal(kc, before[0]) and torch.equal(vc, before[1])


@pytest.mark.skipif(not hasattr(torch.ops.fastattn, "paged_attention_fwd"), reason="no extension")
def test_cpp_op_rejects_out_of_range_blocks():
    q, kc, vc, table, seqlens = _paged([5, 9], 1, 2, 2, 16, 16, 4, "cpu", spare=0)
    table[1, 1] = 99
    with pytest.raises(ValueError, match="block_table"):
        torch.ops.fastattn.paged_attention_fwd(q, kc, vc, table, seqlens, 0.25, True, 99, 0)


# ---------------------------------------------------------------------------------------------
# The reference GPT on a paged cache


@pytest.mark.parametrize("pos", ["learned", "rotary"])
def test_gpt_generate_paged_equals_contiguous_cache(pos):
    """Batched prompts of different lengths: one packed prefill, then batched decoding through the
    paged cache; greedy tokens equal generate() with the contiguous cache, row by row."""
    from fastattn.models import GPT, GPTConfig

    torch.manual_seed(0)
    cfg = GPTConfig(vocab_size=61, block_size=40, n_layer=2, n_head=2, n_embd=32, dropout=0.0, pos=pos)
    model = GPT(cfg).eval()
    prompts = [torch.randint(0, 61, (n,)) for n in (5, 17, 1)]
    paged = model.generate_paged(prompts, 8, block_size=4)
    for prompt, got in zip(prompts, paged):
        want = model.generate(prompt[None], 8, greedy=True)[0]
        assert torch.equal(got, want)
