"""The fixed cost of one call, warm and cold: fastattn's public functions against torch's own on
tiny inputs (the kernels take a few microseconds, so what is timed is the path from Python to
them). In a model every call runs cold: the previous kernel has taken the caches, and each
Python step then costs several times its warm cost. "Cold" here is the call right after an
FFN-sized block of GEMMs; rounds are shuffled and the median is reported, minus an empty call's.
Run: python bench/call_cost.py [rounds]. Notes: bench/results/cpu-notes.md (2026-11-26).

``python bench/call_cost.py --ab [rounds]``: what the cpu backend's one-call path (csrc/eager.cpp)
saves, in one process, rounds interleaved: each call above, each forward+backward of TRAINING
(its training path), then the GPT forward and forward+backward of ``fastattn bench --op model``
(2 layers, width 128, B4 T128 and B2 T256), the plain attention
forward at 4x4x256x64 and a paged decoding step (B1 L1024), with the path on and off, against
torch's.
"""
import random
import statistics
import sys
import time

import torch
import torch.nn.functional as F

import fastattn
from fastattn.bench import steady_cpu_allocator

steady_cpu_allocator()
torch.set_num_threads(2)
torch.manual_seed(0)
E = 128
x = torch.randn(2, 8, E)
g, b = torch.randn(E), torch.randn(E)
gw, bw = g.clone().requires_grad_(), b.clone().requires_grad_()
q, k, v = (torch.randn(1, 2, 8, 16) for _ in range(3))
s = torch.randn(2, 8, 8)
w1, b1, w2, b2 = torch.randn(32, E) * 0.05, torch.randn(32), torch.randn(E, 32) * 0.05, torch.randn(E)
PAIRS = {  # name: (fastattn, torch)
    "layer_norm": (lambda: fastattn.layer_norm(x, (E,), g, b), lambda: F.layer_norm(x, (E,), g, b)),
    "layer_norm, weights with grad": (lambda: fastattn.layer_norm(x, (E,), gw, bw),
                                      lambda: F.layer_norm(x, (E,), gw, bw)),
    "attention causal": (lambda: fastattn.attention(q, k, v, causal=True),
                         lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
    "scaled_dot_product_attention": (lambda: fastattn.scaled_dot_product_attention(q, k, v, is_causal=True),
                                     lambda: F.scaled_dot_product_attention(q, k, v, is_causal=True)),
    "softmax": (lambda: fastattn.scaled_masked_softmax(s), lambda: torch.softmax(s, -1)),
    "ffn gelu": (lambda: fastattn.ffn(x, w1, b1, w2, b2, "gelu"),
                 lambda: F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)),
}
# forward+backward (the training path of the one-call path): gradients of every input
xg, qg = x.clone().requires_grad_(), torch.randn(1, 2, 8, 48).requires_grad_()
w1g, b1g, w2g, b2g = (t.clone().requires_grad_() for t in (w1, b1, w2, b2))


def _split(t):
    return t.view(1, 2, 8, 3, 16).unbind(3)


TRAINING = {
    "layer_norm fwd+bwd": (lambda: fastattn.layer_norm(xg, (E,), gw, bw).sum().backward(),
                           lambda: F.layer_norm(xg, (E,), gw, bw).sum().backward()),
    "attention causal fwd+bwd": (
        lambda: fastattn.attention(*_split(qg), causal=True).sum().backward(),
        lambda: F.scaled_dot_product_attention(*_split(qg), is_causal=True).sum().backward()),
    "ffn gelu fwd+bwd": (lambda: fastattn.ffn(xg, w1g, b1g, w2g, b2g, "gelu").sum().backward(),
                         lambda: F.linear(F.gelu(F.linear(xg, w1g, b1g)), w2g, b2g).sum().backward()),
}
xe = torch.randn(4, 128, E)
W1, B1, W2, B2 = torch.randn(4 * E, E) * 0.05, torch.randn(4 * E), torch.randn(E, 4 * E) * 0.05, torch.randn(E)


def evict():
    F.linear(F.gelu(F.linear(xe, W1, B1)), W2, B2)


def cold_us(calls, rounds):
    times = {name: [] for name in calls}
    names = list(calls)
    for _ in range(rounds):
        random.shuffle(names)
        for name in names:
            evict()
            start = time.perf_counter()
            calls[name]()
            times[name].append(time.perf_counter() - start)
    return {name: statistics.median(t) * 1e6 for name, t in times.items()}


def warm_us(fn, n=5000):
    for _ in range(200):
        fn()
    start = time.perf_counter()
    for _ in range(n):
        fn()
    return (time.perf_counter() - start) / n * 1e6


def main(rounds: int) -> None:
    calls = {"": lambda: None}
    for name, (ours, theirs) in PAIRS.items():
        calls[name + " fastattn"], calls[name + " torch"] = ours, theirs
    cold = cold_us(calls, rounds)
    base = cold.pop("")
    print(f"{'call':32s} {'warm us (fastattn / torch)':>28s} {'cold us (fastattn / torch)':>28s} {'cold ratio':>10s}")
    for name, (ours, theirs) in PAIRS.items():
        a, t = cold[name + " fastattn"] - base, cold[name + " torch"] - base
        print(f"{name:32s} {warm_us(ours):13.1f} / {warm_us(theirs):<12.1f} {a:13.1f} / {t:<12.1f} {t / a:10.2f}")


def _gpt_cases():
    """The GPT forward of fastattn bench's cpu preset (eval, no grad): fastattn's module and the
    functional torch peer, on the same parameters."""
    from fastattn.bench.suites import torch_gpt
    from fastattn.models import GPT, GPTConfig

    config = GPTConfig(block_size=256, dropout=0.0, activation="gelu", n_layer=2, n_head=4,
                       n_embd=128, vocab_size=512)
    model = GPT(config).eval().requires_grad_(False)
    params = dict(model.named_parameters())
    cases = {}
    for B, T in ((4, 128), (2, 256)):
        idx = torch.randint(0, config.vocab_size, (B, T))
        cases[f"GPT fwd B{B} T{T}"] = (lambda idx=idx: model(idx)[0],
                                       lambda idx=idx: torch_gpt(params, idx, config))
    train = GPT(config)
    named = dict(train.named_parameters())
    for B, T in ((4, 128), (2, 256)):
        idx = torch.randint(0, config.vocab_size, (B, T))
        cases[f"GPT fwd+bwd B{B} T{T}"] = (
            lambda idx=idx: train(idx)[0].sum().backward(),
            lambda idx=idx: torch_gpt(named, idx, config).sum().backward())
    q, k, v = (torch.randn(4, 4, 256, 64) for _ in range(3))
    cases["attention fwd 4x4x256x64"] = (lambda: fastattn.attention(q, k, v),
                                         lambda: F.scaled_dot_product_attention(q, k, v))
    # fastattn bench --op decode's B1 L1024 H8/2 D64 step (blocks of 16), against SDPA on the
    # padded cache with its key-padding mask
    L, block = 1024, 16
    qd = torch.randn(1, 8, 1, 64)
    kc, vc = torch.randn(L // block, block, 2, 64), torch.randn(L // block, block, 2, 64)
    table = torch.randperm(L // block).to(torch.int32)[None]
    lens = torch.tensor([L], dtype=torch.int32)
    kp, vp = (c[table[0].long()].reshape(1, L, 2, 64).transpose(1, 2) for c in (kc, vc))
    pad = torch.ones(1, 1, 1, L, dtype=torch.bool)
    cases["paged decode B1 L1024 H8/2"] = (
        lambda: fastattn.paged_attention(qd, kc, vc, table, lens),
        lambda: F.scaled_dot_product_attention(qd, kp, vp, attn_mask=pad, enable_gqa=True))
    return cases


def ab(rounds: int) -> None:
    """Each call and case with the one-call path on and off, rounds interleaved (min and median
    of each, us): the ratio off/on is what the path saves."""
    from fastattn.ops import _library

    cases = {**PAIRS, **TRAINING, **_gpt_cases()}
    times = {(name, arm): [] for name in cases for arm in ("on", "off", "torch")}
    for name, (ours, theirs) in cases.items():  # (warm-up)
        ours(), theirs()
    for _ in range(rounds):
        for name, (ours, theirs) in cases.items():
            arms = [("on", True, ours), ("off", False, ours), ("torch", True, theirs)]
            random.shuffle(arms)
            for arm, flag, fn in arms:
                _library.EAGER_FAST_PATH = flag
                evict()
                start = time.perf_counter()
                fn()
                times[(name, arm)].append(time.perf_counter() - start)
    _library.EAGER_FAST_PATH = True
    print(f"{'case':32s} {'on us':>10s} {'off us':>10s} {'torch us':>10s} {'off/on':>7s} "
          f"{'torch/on':>8s} {'torch/off':>9s}   (medians of {rounds} rounds)")
    for name in cases:
        on, off, th = (statistics.median(times[(name, a)]) * 1e6 for a in ("on", "off", "torch"))
        print(f"{name:32s} {on:10.1f} {off:10.1f} {th:10.1f} {off / on:7.2f} {th / on:8.2f} "
              f"{th / off:9.2f}")


if __name__ == "__main__":
    args = sys.argv[1:]
    if args[:1] == ["--ab"]:
        ab(int(args[1]) if len(args) > 1 else 200)
    else:
        main(int(args[0]) if args else 600)
