"""Host time per call against kernel time, for the small memory-bound ops and the attention at
L1k (GPU only).

Why: on the H100 (2026-11-26) ``fastattn bench`` timed the Triton layer norm at 4096x1024 bf16 at
0.30 ms, 20 times torch's, and slower than at 4096x4096; its softmax backward at 6-8 times its
forward. The compiled kernels (``fastattn.aot``) predict 6-12 us for that layer norm. A kernel of
a few microseconds is timed by ``triton.testing.do_bench`` as its host path whenever the Python
that launches it takes longer than the GPU's work between calls (do_bench's 256 MiB cache flush,
~90 us), and that run's host was busy (load average 14-23). This script separates the two, for
each op, mode and provider, on a quiet host (run it before anything compiles):

* ``host us``: wall time per call of back-to-back calls, no synchronization (the enqueue cost);
* ``do_bench us``: the median the benchmark reports (what the tables hold);
* ``kernel us``: the op's CUDA kernels per call from torch.profiler, the L2 flushed before each
  call (the flush's own fill kernels left out);
* ``host us 1t``: ``host us`` with the backward run on the calling thread, not autograd's
  per-device worker thread (the cost of that handoff);

then a cProfile of the layer norm's forward+backward per provider: where the host time goes.

If ``kernel us`` is far under ``do_bench us`` and ``host us`` is over ~90, the table timed the
host. ``python bench/host_overhead.py --json FILE`` records the rows. The H100 run of 2026-11-26
(before the profile): the Triton layer norm forward 87 us of host for 9 us of kernel, its
forward+backward 542 us for 44 (the cuda backend's 30 and 234, torch's 21 and 143); the cuda
backward at 4096x4096 failed (shared memory, fixed since).
"""

from __future__ import annotations

import argparse
import json
import os
import time

import torch
import torch.nn.functional as F

import fastattn


def _cases(dtype):
    """(name, make inputs, {provider: call}) of each op: layer norm and softmax at the sizes of
    ``fastattn bench --quick`` on a GPU."""
    out = []
    for M, N in ((4096, 1024), (4096, 4096)):
        def make(M=M, N=N):
            x = torch.randn(M, N, device="cuda", dtype=dtype, requires_grad=True)
            w = torch.randn(N, device="cuda", dtype=dtype, requires_grad=True)
            b = torch.randn(N, device="cuda", dtype=dtype, requires_grad=True)
            return x, w, b

        def ln(backend, N=N):
            return lambda x, w, b: fastattn.layer_norm(x, (N,), w, b, backend=backend)
        out.append((f"layer_norm {M}x{N}", make, {
            "fastattn-triton": ln("triton"), "fastattn-cuda": ln("cuda"),
            "torch": lambda x, w, b, N=N: F.layer_norm(x, (N,), w, b)}))
    # (the bias case: a masked forward measured 4.6x the unmasked one at 128x8192)
    for shape, bias in (((4, 8, 2048, 512), False), ((4, 8, 8, 131072), False),
                        ((4, 8, 128, 8192), True)):
        mask = torch.randn(1, *shape[1:], device="cuda", dtype=dtype) if bias else None

        def make(shape=shape):
            return (torch.randn(*shape, device="cuda", dtype=dtype, requires_grad=True),)

        def sm(backend, mask=mask):
            return lambda x: fastattn.scaled_masked_softmax(x, mask, 0.125, backend=backend)

        def eager(x, mask=mask):
            return torch.softmax(x * 0.125 + (0 if mask is None else mask), dim=-1)
        out.append((f"softmax {'x'.join(map(str, shape))}{' bias' if bias else ''}", make, {
            "fastattn-triton": sm("triton"), "fastattn-cuda": sm("cuda"), "torch": eager}))
    # Attention at L1k, last (its first calls autotune and compile): the Triton D128 causal
    # forward took 0.434 ms with a wide spread on 2026-11-27, 0.25 on 2026-11-26 with the same
    # config, the D64 causal one 0.57-0.65; is its host path longer than its kernel?
    for (B, H, D), causal in (((16, 16, 128), False), ((16, 16, 128), True), ((16, 32, 64), True)):
        def make(B=B, H=H, D=D):
            return tuple(torch.randn(B, H, 1024, D, device="cuda", dtype=dtype, requires_grad=True)
                         for _ in range(3))

        def at(backend, causal=causal):
            return lambda q, k, v: fastattn.attention(q, k, v, causal=causal, backend=backend)
        out.append((f"attention {B}x{H}x1024x{D}{' causal' if causal else ''}", make, {
            "fastattn-triton": at("triton"), "fastattn-cuda": at("cuda"),
            "torch": lambda q, k, v, causal=causal: F.scaled_dot_product_attention(
                q, k, v, is_causal=causal)}))
    return out


# The cases and modes whose host time cProfile breaks down, per provider: the Triton layer
# norm's fwd+bwd (542 us of host time for 44 us of kernels on the H100, 2026-11-26; torch's took
# 143), and the causal attention forward above.
_PROFILED = {"layer_norm 4096x1024": "fwd_bwd", "attention 16x16x1024x128 causal": "fwd"}


def _callable(call, inputs, mode):
    """A no-argument call of ``call``: the forward under no_grad, or forward and backward
    (``autograd.grad``, so nothing accumulates)."""
    if mode == "fwd":
        def fn():
            with torch.no_grad():
                return call(*inputs)
        return fn
    dout = torch.randn_like(call(*inputs).detach())

    def fn():
        return torch.autograd.grad(call(*inputs), inputs, dout)
    return fn


def _host_us(fn, calls=100, rounds=5):
    """Best-of-``rounds`` wall time per call of ``calls`` back-to-back calls (no synchronization)."""
    fn()
    best = float("inf")
    for _ in range(rounds):
        torch.cuda.synchronize()
        start = time.perf_counter()
        for _ in range(calls):
            fn()
        best = min(best, (time.perf_counter() - start) / calls * 1e6)
    torch.cuda.synchronize()
    return best


def _profile(title, fn, calls=200, top=22):
    """Where the host time of ``fn`` goes: cProfile over ``calls`` calls, the backward run on this
    thread (cProfile sees one thread), the ``top`` functions by their own time."""
    import cProfile
    import io
    import pstats

    with torch.autograd.set_multithreading_enabled(False):
        fn()
        torch.cuda.synchronize()
        prof = cProfile.Profile()
        prof.enable()
        for _ in range(calls):
            fn()
        prof.disable()
        torch.cuda.synchronize()
    text = io.StringIO()
    pstats.Stats(prof, stream=text).sort_stats("tottime").print_stats(top)
    body = text.getvalue().splitlines()
    print(f"\n--- cProfile: {title}, {calls} calls (times per call: divide by {calls})")
    print("\n".join(line[:160] for line in body if line.strip())[:6000], flush=True)


def _measure(fn, flush, calls=100, rounds=5):
    """(host us, do_bench us, kernel us) of ``fn``; host time: the best of ``rounds`` bursts of
    ``calls`` calls, few enough that the launch queue (~1000 entries) never fills and blocks."""
    from torch.profiler import ProfilerActivity, profile

    from fastattn.bench import time_fn

    host_us = _host_us(fn, calls, rounds)
    med = time_fn(fn, torch.device("cuda"), 0.1)[0]  # (do_bench, warm-up 10 ms, 40 ms of runs)
    runs = 50
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(runs):
            flush.zero_()
            fn()
        torch.cuda.synchronize()
    kernels = [e for e in prof.key_averages() if e.device_type == torch.autograd.DeviceType.CUDA
               and not any(word in e.key.lower() for word in ("fill", "memset"))]
    kernel_us = sum(e.device_time_total for e in kernels) / runs  # (device events only: the
    return host_us, med * 1e3, kernel_us                          # aten ops hold them again)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--dtype", default="bfloat16", choices=["bfloat16", "float16", "float32"])
    parser.add_argument("--json", help="write the rows here")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available():
        print("host_overhead: no GPU; nothing to measure")
        return 0
    dtype = getattr(torch, args.dtype)
    available = set(fastattn.available_backends())
    flush = torch.empty(256 * 2**20 // 4, dtype=torch.int, device="cuda")  # do_bench's L2 flush
    rows = []
    print(f"load average {os.getloadavg()}; {torch.cuda.get_device_name()}")
    print(f"{'case':28} {'mode':8} {'provider':16} {'host us':>8} {'do_bench us':>12} "
          f"{'kernel us':>10} {'host us 1t':>10}")
    for name, make, providers in _cases(dtype):
        inputs = make()
        runnable = {p: c for p, c in providers.items()
                    if not p.startswith("fastattn-") or p[len("fastattn-"):] in available}
        for provider, call in runnable.items():
            for mode in ("fwd", "fwd_bwd"):
                row = dict(case=name, mode=mode, provider=provider)
                rows.append(row)  # (filled in below; the JSON keeps a failure too)
                try:
                    fn = _callable(call, inputs, mode)
                    row.update(zip(("host_us", "do_bench_us", "kernel_us"), _measure(fn, flush)))
                    # the backward on this thread, not autograd's device thread: the handoff's cost
                    with torch.autograd.set_multithreading_enabled(False):
                        row["host_us_one_thread"] = _host_us(fn)
                except Exception as e:  # (one failing kernel must not hide the others' rows)
                    row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:150]}"
                    print(f"{name:28} {mode:8} {provider:16} {row['error']}", flush=True)
                    torch.cuda.synchronize()
                    continue
                print(f"{name:28} {mode:8} {provider:16} {row['host_us']:8.1f} "
                      f"{row['do_bench_us']:12.1f} {row['kernel_us']:10.1f} "
                      f"{row['host_us_one_thread']:10.1f}", flush=True)
        if name in _PROFILED:
            mode = _PROFILED[name]
            for provider, call in runnable.items():
                try:
                    _profile(f"{name} {mode} {provider}", _callable(call, inputs, mode))
                except Exception as e:  # (as above: the other providers' profiles still print)
                    print(f"--- cProfile: {name} {mode} {provider}: {type(e).__name__}: {e}")
    if args.json:
        with open(args.json, "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "torch": torch.__version__,
                       "loadavg": os.getloadavg(), "dtype": args.dtype, "rows": rows}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
