"""A small, fixed workload of every CUDA C++ op (csrc/cuda), to run under NVIDIA compute-sanitizer.

Run on a GPU machine (the extension built with its CUDA kernels):

    compute-sanitizer --tool memcheck  --error-exitcode 1 python bench/sanitize_cuda.py
    compute-sanitizer --tool racecheck --error-exitcode 1 python bench/sanitize_cuda.py
    compute-sanitizer --tool initcheck --error-exitcode 1 python bench/sanitize_cuda.py
    compute-sanitizer --tool synccheck --error-exitcode 1 python bench/sanitize_cuda.py

or let the script launch those itself: ``python bench/sanitize_cuda.py --all-tools``.

The calls are forward + backward of softmax (warp path, cached and uncached block paths, masks,
causal), ffn (plain and gated activations, odd sizes) and attention (the three head-dim buckets,
odd lengths, GQA, masks, band, dropout, fully masked rows, empty keys, and several
query blocks x key tiles so the cp.async pipeline turns over; then again with the forward on
32 rows a warp), varlen attention (packed sequences, empty ones included) and paged decoding,
kept small so the sanitizer (10-100x slower) finishes in a minute or two. Each output is checked to be finite
(a cheap guard that also forces the kernels to have run).
"""

from __future__ import annotations

import argparse
import shutil
import subprocess
import sys

import torch

TOOLS = ("memcheck", "racecheck", "initcheck", "synccheck")


def _finite(name, *tensors):
    for t in tensors:
        if t is not None and t.is_floating_point() and t.numel():
            bad = ~torch.isfinite(t) & ~torch.isneginf(t) if name.startswith("lse") else ~torch.isfinite(t)
            if bad.any():
                raise AssertionError(f"{name}: non-finite values")


def softmax_calls(gen, dev):
    import fastattn

    for shape, causal, masked in (
        ((2, 2, 5, 37), True, True),       # warp path, scalar loads (37 not a multiple of 8)
        ((1, 2, 3, 64), False, False),     # warp path, 16-byte vectors
        ((1, 1, 2, 1500), False, True),    # block path, scores cached in shared memory
        ((1, 1, 1, 13000), True, False),   # block path, uncached (re-reads x)
    ):
        x = torch.randn(shape, generator=gen).half().to(dev).requires_grad_()
        m = (torch.rand(1, 1, shape[2], shape[3], generator=gen) > 0.3).to(dev) if masked else None
        y = fastattn.scaled_masked_softmax(x, m, 0.5, causal, backend="cuda")
        (dx,) = torch.autograd.grad(y, x, torch.randn_like(y))
        _finite("softmax", y, dx)


def ffn_calls(gen, dev):
    import fastattn

    for act, M, D, F, D2, dtype in (("gelu", 33, 24, 40, 17, torch.bfloat16),
                                    ("swiglu", 7, 16, 32, 8, torch.float16),
                                    ("gelu_tanh", 5, 13, 11, 3, torch.float32)):
        f1 = 2 * F if act in ("swiglu", "geglu") else F
        ts = [torch.randn(*s, generator=gen).to(dtype).to(dev).requires_grad_()
              for s in ((M, D), (f1, D), (f1,), (D2, F), (D2,))]
        out = fastattn.ffn(*ts, act, backend="cuda")
        grads = torch.autograd.grad(out, ts, torch.randn_like(out))
        _finite("ffn", out, *grads)


def attention_calls(gen, dev):
    import fastattn

    cases = (
        # B, H, Hkv, Lq, Lk, D, Dv, causal, window, mask, dropout
        (1, 4, 2, 37, 29, 40, 40, True, None, None, 0.0),
        (1, 2, 1, 20, 45, 80, 96, "bottom_right", None, "bool", 0.0),
        (1, 2, 2, 33, 17, 256, 200, False, (5, 3), "float", 0.0),
        (1, 2, 1, 30, 30, 64, 64, False, None, "dead_rows", 0.2),
        (1, 1, 1, 9, 0, 64, 64, False, None, None, 0.0),
        # several query blocks and key tiles: the cp.async double buffer turns over, interior
        # tiles take the unmasked path (D 128: Q in registers; D 256: Q read from shared memory)
        (1, 2, 1, 200, 260, 128, 128, True, None, None, 0.0),
        (1, 1, 1, 70, 100, 256, 256, False, None, None, 0.1),
        (1, 2, 1, 150, 150, 64, 64, False, (40, 20), None, 0.0),  # banded GQA: dK/dV sequence
    )
    for B, H, Hkv, Lq, Lk, D, Dv, causal, window, kind, p in cases:
        q = torch.randn(B, H, Lq, D, generator=gen).half().to(dev).requires_grad_()
        k = torch.randn(B, Hkv, Lk, D, generator=gen).half().to(dev).requires_grad_()
        v = torch.randn(B, Hkv, Lk, Dv, generator=gen).half().to(dev).requires_grad_()
        leaves = [q, k, v]
        mask = None
        if kind == "bool":
            mask = (torch.rand(B, 1, Lq, Lk, generator=gen) > 0.3).to(dev)
        elif kind == "dead_rows":
            mask = torch.rand(B, H, Lq, Lk, generator=gen) > 0.5
            mask[:, :, :3] = False
            mask = mask.to(dev)
        elif kind == "float":
            mask = torch.randn(1, H, Lq, Lk, generator=gen).to(dev).requires_grad_()
            leaves.append(mask)
        out, lse = fastattn.attention(q, k, v, mask, causal=causal, window=window, dropout_p=p,
                                      seed=3, enable_gqa=True, return_lse=True, backend="cuda")
        grads = torch.autograd.grad(out, leaves, torch.randn_like(out))
        _finite("attention", out, *grads)
        _finite("lse", lse)


def varlen_calls(gen, dev):
    """Packed sequences (the kernels' PACKED instances): empty query and key sequences, GQA,
    bottom-right causal, several query blocks in the longest, a grid past every sequence."""
    import fastattn

    lens_q, lens_k = [70, 0, 5, 130], [90, 4, 0, 130]

    def cu(lens):
        return torch.tensor([0, *torch.tensor(lens).cumsum(0).tolist()], dtype=torch.int32,
                            device=dev)

    for D, max_q, p in ((64, None, 0.0), (128, 200, 0.1), (256, None, 0.0)):
        q = torch.randn(sum(lens_q), 4, D, generator=gen).half().to(dev).requires_grad_()
        k = torch.randn(sum(lens_k), 2, D, generator=gen).half().to(dev).requires_grad_()
        v = torch.randn(sum(lens_k), 2, D, generator=gen).half().to(dev).requires_grad_()
        out, lse = fastattn.varlen_attention(q, k, v, cu(lens_q), cu(lens_k), max_q, None,
                                             causal="bottom_right", dropout_p=p, seed=3,
                                             return_lse=True, backend="cuda")
        grads = torch.autograd.grad(out, (q, k, v), torch.randn_like(out))
        _finite("varlen", out, *grads)
        _finite("lse", lse)


def paged_calls(gen, dev):
    """Paged decoding: GQA (8 rows a kv head) and MHA at D100 (element copies, not cp.async), an
    empty cache row, an odd block size, one split and several."""
    import os

    import fastattn

    lens, bs, Lq = [0, 37, 900], 7, 2
    need = [max(1, -(-n // bs)) for n in lens]
    table = torch.full((len(lens), max(need)), -1, dtype=torch.int32)
    perm = torch.randperm(sum(need), generator=gen)
    start = 0
    for b, n in enumerate(need):
        table[b, :n] = perm[start:start + n].int()
        start += n
    for H, Hkv, D, splits in ((8, 2, 64, "1"), (8, 2, 128, "3"), (8, 2, 256, ""), (2, 2, 100, "")):
        q = torch.randn(len(lens), H, Lq, D, generator=gen).half().to(dev)
        kc = torch.randn(sum(need), bs, Hkv, D, generator=gen).half().to(dev)
        vc = torch.randn(sum(need), bs, Hkv, D, generator=gen).half().to(dev)
        os.environ["FASTATTN_CUDA_PAGED_SPLITS"] = splits
        try:
            out, lse = fastattn.paged_attention(q, kc, vc, table.to(dev),
                                                torch.tensor(lens, dtype=torch.int32, device=dev),
                                                return_lse=True, backend="cuda")
        finally:
            del os.environ["FASTATTN_CUDA_PAGED_SPLITS"]
        _finite("paged", out)
        _finite("lse", lse)


def wide_forward_calls(gen, dev):
    """The attention calls again with the forward on 32 rows a warp (FASTATTN_CUDA_FWD_ROWS=32,
    read by the extension at each call; head dims up to 128 take it): Q re-read from shared
    memory per key tile, two m16 tiles staged per warp in the epilogue."""
    import os

    os.environ["FASTATTN_CUDA_FWD_ROWS"] = "32"
    try:
        attention_calls(gen, dev)
    finally:
        del os.environ["FASTATTN_CUDA_FWD_ROWS"]


def workload():
    import fastattn

    reason = fastattn.backend_status().get("cuda")
    if reason:
        sys.exit(f"sanitize_cuda: the cuda backend is unavailable: {reason}")
    dev = torch.device("cuda")
    gen = torch.Generator().manual_seed(0)
    softmax_calls(gen, dev)
    ffn_calls(gen, dev)
    attention_calls(gen, dev)
    varlen_calls(gen, dev)
    paged_calls(gen, dev)
    wide_forward_calls(gen, dev)
    torch.cuda.synchronize()
    print("sanitize_cuda: workload done")


def run_all_tools() -> int:
    exe = shutil.which("compute-sanitizer")
    if exe is None:
        print("sanitize_cuda: compute-sanitizer not found on PATH", file=sys.stderr)
        return 2
    failed = []
    for tool in TOOLS:
        cmd = [exe, "--tool", tool, "--error-exitcode", "1", sys.executable, __file__]
        print("sanitize_cuda: running", " ".join(cmd), flush=True)
        if subprocess.run(cmd).returncode != 0:
            failed.append(tool)
    print("sanitize_cuda:", "FAILED " + ", ".join(failed) if failed else "all tools clean")
    return 1 if failed else 0


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--all-tools", action="store_true",
                        help="run this workload under each compute-sanitizer tool in turn")
    args = parser.parse_args()
    if args.all_tools:
        return run_all_tools()
    workload()
    return 0


if __name__ == "__main__":
    sys.exit(main())
