"""``python -m fastattn.aot``: the Hopper compile gate (see :mod:`fastattn.aot`).

    python -m fastattn.aot --quick              # CI: the configs the tests run, + WS variants
    python -m fastattn.aot                      # every config the pruners keep (make aot-full)
    python -m fastattn.aot --op attention --kernel fwd --json rows.json
    python -m fastattn.aot --cuda               # the CUDA extension's kernels (setup.py's flags)

Exit status 1 when any variant failed to compile, spills over its budget or lacks a required
instruction; 0 otherwise. Triton variants need no GPU, only Triton's bundled ptxas and
cuobjdump; the GPU image's Triton version is the one that matters (CI installs it).
"""

from __future__ import annotations

import argparse
import dataclasses
import json
import os
import sys
import time


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(prog="python -m fastattn.aot",
                                     description=__doc__.split("\n\n")[0])
    parser.add_argument("--quick", action="store_true", help="the CI subset")
    parser.add_argument("--triton", action="store_true", help="only the Triton kernels")
    parser.add_argument("--cuda", action="store_true", help="only the CUDA kernels")
    parser.add_argument("--op", help="comma-separated: attention, layer_norm, softmax, ffn, rope")
    parser.add_argument("--kernel", help="comma-separated substrings of kernel names")
    parser.add_argument("--case", help="comma-separated substrings of case names (e.g. D256,fp32)")
    parser.add_argument("--first-config", action="store_true",
                        help="only the first kept config (and WS ones), as the tests run")
    parser.add_argument("--jobs", type=int, default=os.cpu_count() or 1)
    parser.add_argument("--json", help="write every row here")
    parser.add_argument("--failures-only", action="store_true", help="print only failing rows")
    args = parser.parse_args(argv)
    both = not (args.triton or args.cuda)
    ops = args.op.split(",") if args.op else None
    kernels = args.kernel.split(",") if args.kernel else None

    from fastattn.aot import report

    rows, sections = [], []
    start = time.time()
    if args.triton or both:
        import triton

        from fastattn.aot.triton import triton_rows

        def progress(done, total, row):
            if row.status != "ok" or done % 25 == 0 or done == total:
                why = f" ({'; '.join(row.problems)})" if row.problems else ""
                print(f"  [{done}/{total}] {row.kernel} {row.case} {row.config}: {row.status}{why}",
                      file=sys.stderr, flush=True)

        found = triton_rows(quick=args.quick, ops=ops, kernels=kernels,
                            names=args.case.split(",") if args.case else None,
                            all_configs=False if args.first_config else None, jobs=args.jobs,
                            progress=progress)
        sections.append((f"Triton {triton.__version__} for sm_90 "
                         f"({'quick' if args.quick else 'full'})", found))
        rows += found
    if args.cuda or both:
        from fastattn.aot.cuda import CudaToolsMissing, cuda_rows
        try:
            found = cuda_rows(quick=args.quick, ops=ops)
        except CudaToolsMissing as exc:
            print(f"fastattn.aot: CUDA kernels not checked ({exc})")
        except ValueError as exc:  # (an --op with no .cu file)
            parser.error(str(exc))
        else:
            sections.append(("CUDA extension for sm_90a (setup.py's nvcc flags)", found))
            rows += found
    for title, found in sections:
        shown = [r for r in found if r.status != "ok"] if args.failures_only else found
        report.print_table(shown, title)
        print()
    print(f"fastattn.aot: {report.summary(rows)} in {time.time() - start:.0f} s")
    if args.json:
        with open(args.json, "w") as f:
            json.dump([dict(dataclasses.asdict(r), status=r.status, problems=r.problems)
                       for r in rows], f, indent=1)
    return 1 if any(r.status != "ok" for r in rows) else 0


if __name__ == "__main__":
    sys.exit(main())
