"""The ``fastattn`` command: ``info`` (versions, device, extension, backends) and ``bench``."""

from __future__ import annotations

import argparse
import sys

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
    print("  backends")
    for name, reason in fastattn.backend_status().items():
        print(f"    {name:8s} {'available' if reason is None else 'unavailable: ' + reason}")
    return 0


def _bench(args) -> int:
    from fastattn import bench
    from fastattn.bench_suites import SUITES

    device = torch.device(args.device or ("cuda" if torch.cuda.is_available() else "cpu"))
    dtype = getattr(torch, args.dtype or ("bfloat16" if device.type == "cuda" else "float32"))
    modes = args.mode.split(",") if args.mode else ["fwd", "fwd_bwd"]
    ops = list(SUITES) if args.op == "all" else [args.op]
    results = []
    for op in ops:
        providers, cases = SUITES[op](device, dtype, modes, args.quick)
        results += bench.compare(providers, cases, device=device)
    env = bench.environment(device)
    peaks = env["peaks"]
    bench.print_table(
        results,
        title=f"fastattn bench on {env['device']} (copy {peaks['copy_gbps']:.0f} GB/s, "
        f"matmul {peaks['matmul_tflops']:.2f} TFLOP/s measured)",
    )
    if args.json:
        bench.write_json(args.json, results, env)
        print(f"wrote {args.json}")
    return 0


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="fastattn", description=__doc__)
    sub = parser.add_subparsers(dest="command", required=True)
    sub.add_parser("info", help="versions, device, extension and backends")
    from fastattn.bench_suites import SUITES

    b = sub.add_parser("bench", help="time fastattn against naive and PyTorch, side by side")
    b.add_argument("--op", default="all", choices=[*SUITES, "all"])
    b.add_argument("--dtype", choices=["float32", "float16", "bfloat16"])
    b.add_argument("--mode", help="comma-separated: fwd, bwd, fwd_bwd (default fwd,fwd_bwd)")
    b.add_argument("--device", help="cpu or cuda (default: cuda when present)")
    b.add_argument("--quick", action="store_true", help="fewer sizes, no torch.compile peer on CPU")
    b.add_argument("--json", help="write the results and the environment to this file")
    args = parser.parse_args(argv)
    if args.command == "info":
        return _info()
    return _bench(args)


if __name__ == "__main__":
    sys.exit(main())
