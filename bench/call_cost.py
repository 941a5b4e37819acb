"""The fixed cost of one call, warm and cold: fastattn's public functions against torch's own on
tiny inputs (the kernels take a few microseconds, so what is timed is the path from Python to
them). In a model every call runs cold: the previous kernel has taken the caches, and each
Python step then costs several times its warm cost. "Cold" here is the call right after an
FFN-sized block of GEMMs; rounds are shuffled and the median is reported, minus an empty call's.
Run: python bench/call_cost.py [rounds]. Notes: bench/results/cpu-notes.md (2026-11-26).
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


if __name__ == "__main__":
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 600)
