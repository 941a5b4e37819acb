"""The ``fastattn`` command: ``info`` (versions, device, extension, backends), ``bench`` (the
side-by-side benchmark) and ``demo`` (train the reference models for about a minute)."""

from __future__ import annotations

import argparse
import os
import sys
import textwrap

import torch


def _info() -> int:
    import fastattn
    from fastattn import _extension
    from fastattn.bench import environment

    env = environment()
    print(f"fastattn {fastattn.__version__}")
    for key in ("torch", "triton", "python", "device", "cuda", "driver", "threads", "commit"):
        if key in env:
            print(f"  {key:10s} {env[key]}")
    print(f"  extension  {'fastattn._C loaded' if _extension.loaded() else _extension.error()}")
    if _extension.loaded():
        cuda = torch._C._dispatch_has_kernel_for_dispatch_key("fastattn::layer_norm_fwd", "CUDA")
        print(f"             built with CUDA kernels: {cuda}")
    if choices := _extension.cpu_choices():
        plain = "torch's kernel" if choices["attention_plain_forward"] == "torch" else "fastattn's kernel"
        print(f"  cpu kernels: {choices['isa']} SIMD; plain attention forward: {plain}; FFN matmuls: "
              f"bf16 in {choices['ffn_bfloat16_matmuls']}, fp16 in {choices['ffn_float16_matmuls']}")
    if "triton_attention" in env:
        t = env["triton_attention"]
        path = "tensor descriptors (TMA)" if t["default_path"] == "tma" else "pointer loads"
        print(f"  triton attention: {path}; FASTATTN_TRITON_TMA={t['mode']}, Triton has "
              f"descriptors: {t['descriptors']}, warp specialization: {t['warp_specialize']} "
              f"(FASTATTN_TRITON_WS={int(t['warp_specialize_on'])}: "
              f"{'tuned' if t['warp_specialize_on'] else 'not tuned'})")
        for feature, why in t["disabled"].items():
            print(f"    {feature} switched off: {why}")
    print("  backends")
    for name, reason in fastattn.backend_status().items():
        print(f"    {name:8s} {'available' if reason is None else 'unavailable: ' + reason}")
    return 0


def _ints(text: str) -> list[int]:
    try:
        return [int(v) for v in text.split(",") if v.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got {text!r}") from None


def _choices(allowed):
    def parse(text: str) -> list[str]:
        values = [v.strip() for v in text.split(",") if v.strip()]
        bad = [v for v in values if v not in allowed]
        if bad or not values:
            raise argparse.ArgumentTypeError(f"{text!r}: choose from {', '.join(allowed)} (comma-separated)")
        return values

    return parse


def _busy(device) -> str | None:
    """Why CPU timings would be unreliable now (other work competing for the cores), or None."""
    import os

    if device.type != "cpu" or not hasattr(os, "getloadavg"):
        return None
    load, cpus = os.getloadavg()[0], os.cpu_count() or 1
    if load > 1.5 * cpus:
        return f"the machine is busy (load average {load:.1f} on {cpus} CPUs)"
    return None


def _bench(args) -> int:
    threads = torch.get_num_threads()
    try:
        return _run_bench(args)
    finally:
        torch.set_num_threads(threads)  # main() may be called in-process (tests)


def _run_bench(args) -> int:
    import time

    from fastattn import bench
    from fastattn.bench.suites import SUITES, Options

    start = time.perf_counter()
    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    if device.type == "cuda" and not torch.cuda.is_available():
        print("fastattn bench: --device cuda but no CUDA GPU is available", file=sys.stderr)
        return 2
    dtype = getattr(torch, args.dtype) if args.dtype else bench.default_dtype(device)
    modes = args.mode or ["fwd", "fwd_bwd"]
    ops = list(SUITES) if "all" in args.op else list(dict.fromkeys(args.op))
    options = Options(
        seqs=args.seq, dims=args.d, masks=args.mask,
        causal=None if args.causal is None else [args.causal],
        compile=args.compile, tiny=args.tiny,
    )
    busy = _busy(device)
    if device.type == "cpu":
        bench.steady_cpu_allocator()
    if args.threads:
        torch.set_num_threads(args.threads)
    elif busy:
        # Threads that wait for each other at every op stall whenever one is descheduled: on a
        # busy machine one thread gives steadier (and faster) numbers. --threads overrides.
        torch.set_num_threads(1)
    if busy:
        print(f"fastattn bench: warning: {busy}: CPU timings are slow and noisy; running with "
              f"{torch.get_num_threads()} thread(s) (--threads N to choose)", file=sys.stderr)
    results = []
    env = bench.environment(device)  # (the peaks measured before the runs, on an idle device)
    env["command"] = "fastattn bench" + "".join(f" {a}" for a in (args.argv or []))

    def checkpoint(done):  # a run cut short (a GPU lease's step timeout) keeps what it measured
        bench.write_json(args.json, results + done, {**env, "partial": True})

    for op in ops:
        providers, cases = SUITES[op](device, dtype, modes, args.quick, options)
        if args.providers:
            keep = [p.strip() for p in args.providers.split(",") if p.strip()]
            providers = {n: f for n, f in providers.items() if n == bench.NAIVE or any(k in n for k in keep)}
        results += bench.compare(providers, cases, device=device, budget_s=args.budget,
                                 on_case=checkpoint if args.json else None)
    env["wall_s"] = round(time.perf_counter() - start, 1)
    if hasattr(os, "getloadavg"):  # at the end, as SUMMARY.md reports it
        env["loadavg"] = [round(v, 2) for v in os.getloadavg()]
    peaks = bench.measure_peaks(device, dtype)
    title = (
        f"fastattn bench on {env['device']} ({device.type}, {env['threads']} thread{'s' if env['threads'] != 1 else ''}): copy "
        f"{peaks['copy_gbps']:.0f} GB/s, {peaks['matmul_dtype']} matmul {peaks['matmul_tflops']:.2f} TFLOP/s measured"
    )
    bench.print_table(results, title=title)
    print(textwrap.fill(
        "x naive / x torch: speedup over the naive backend / the fastest PyTorch peer (torch...); "
        "max err: largest |error| against the float64 reference (output and gradients)", bench.WIDTH))
    status = 0
    if args.json:
        bench.write_json(args.json, results, env)
        print(f"wrote {args.json}")
    if args.plot:
        try:
            bench.plot(results, args.plot, title=title)
            print(f"wrote {args.plot}")
        except (ImportError, ValueError) as exc:
            print(f"fastattn bench: no plot: {exc}", file=sys.stderr)
            status = 1
    print(f"fastattn bench: {len(results)} measurements in {time.perf_counter() - start:.1f} s")
    return status


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="fastattn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, device, extension and backends")
    from fastattn.bench.suites import MASKS, MODES, SUITES

    b = sub.add_parser(
        "bench", help="time fastattn against naive and PyTorch, side by side",
        description="Time fastattn's backends against the naive baseline and PyTorch's own kernels. "
        "Defaults depend on the device: small shapes on a CPU (about a minute), the full grid on a GPU.",
    )
    b.add_argument("--op", type=_choices([*SUITES, "all"]), default=["all"],
                   help=f"comma-separated: {', '.join(SUITES)} or all (default all)")
    b.add_argument("--dtype", choices=["float32", "float16", "bfloat16"],
                   help="default: bfloat16 on a GPU, float32 on a CPU")
    b.add_argument("--mode", type=_choices(MODES), help="comma-separated: fwd, bwd, fwd_bwd (default fwd,fwd_bwd)")
    b.add_argument("--causal", action=argparse.BooleanOptionalAction, default=None,
                   help="attention/softmax: only causal (--causal) or only not (--no-causal); default: the grid's mix")
    b.add_argument("--mask", type=_choices(MASKS), help="attention/softmax masks, comma-separated: none, padding, bias")
    b.add_argument("--d", type=_ints, help="attention head dims, e.g. 64,128")
    b.add_argument("--seq", type=_ints, help="attention sequence lengths / softmax row lengths / model sequence lengths, e.g. 512,1024")
    b.add_argument("--device", choices=["cpu", "cuda"], help="default: cuda when present")
    b.add_argument("--quick", action="store_true", help="fewer sizes")
    b.add_argument("--compile", action=argparse.BooleanOptionalAction, default=None,
                   help="include torch.compile and FlexAttention peers (default: on a GPU only; "
                   "compiling each shape takes seconds on a CPU)")
    b.add_argument("--providers", help="keep only providers whose names contain one of these "
                   "comma-separated strings (naive is always kept), e.g. fastattn,sdpa")
    b.add_argument("--threads", type=int, help="CPU threads for torch (default: torch's choice)")
    b.add_argument("--budget", type=float, help="seconds of timing per measurement (default 0.25 GPU, 0.12 CPU)")
    b.add_argument("--json", help="write the results and the environment to this file")
    b.add_argument("--plot", help="write TFLOP/s (GB/s) against sequence length per provider to this PNG (matplotlib)")
    b.add_argument("--tiny", action="store_true", help=argparse.SUPPRESS)  # minimal shapes, for tests
    from fastattn.models import demo

    demo.add_arguments(sub.add_parser(
        "demo", help="train the reference Transformer (digit reversal) and GPT (characters), about a minute"))
    args = parser.parse_args(argv)
    if args.command == "info":
        return _info()
    if args.command == "demo":
        return demo.run(args)
    args.argv = list(sys.argv[2:] if argv is None else argv[1:])
    return _bench(args)


if __name__ == "__main__":
    sys.exit(main())
