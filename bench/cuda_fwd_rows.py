"""The cuda attention forward on 16 against 32 query rows a warp, side by side (GPU only).

``Configs<DP>::Fwd`` (8 warps of 16 rows, Q in registers) is the default; ``FwdWide`` (4 warps of
32 rows, two m16 tiles a warp, Q re-read from shared memory; head dims up to 128) is the FA2
split, taken when ``FASTATTN_CUDA_FWD_ROWS=32`` (the extension reads it at each call). Every K
and V fragment a warp reads from shared memory then feeds two tiles' mma: the reads per mma fall
from 61 to 38 KB/MFLOP at D64 and to 46 at D128 (32-key tiles there: 64 spilled). Prediction
(csrc/cuda/attention_kernels.cuh, docs/cuda_attention.md): the same 8 warps per SM (registers),
twice the independent mma per warp: 32 rows 1.15-1.5x faster at D64 and 1.0-1.3x at D128, bf16, L >= 4k.

For each case both variants run alternately in one process (``fastattn.bench.time_fn``, the
benchmark's own timing: do_bench's median), their outputs compared (they must agree to bf16 rounding:
the same arithmetic in the same order per row), and torch's cuDNN / flash SDPA timed beside
them as the yardstick. ``--json FILE`` records the rows.
"""

from __future__ import annotations

import argparse
import json
import os
import torch
import torch.nn.functional as F

import fastattn
from fastattn.bench import time_fn


def _with_rows(rows, fn):
    def call():
        if rows == 32:
            os.environ["FASTATTN_CUDA_FWD_ROWS"] = "32"
        else:
            os.environ.pop("FASTATTN_CUDA_FWD_ROWS", None)
        try:
            return fn()
        finally:
            os.environ.pop("FASTATTN_CUDA_FWD_ROWS", None)
    return call


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seq", default="1024,4096,16384")
    parser.add_argument("--d", default="64,128")
    parser.add_argument("--budget", type=float, default=0.05, help="seconds a measurement")
    parser.add_argument("--json")
    args = parser.parse_args(argv)
    if not torch.cuda.is_available() or fastattn.backend_status().get("cuda"):
        raise SystemExit("cuda_fwd_rows: needs a GPU and the cuda backend")
    dtype, tokens, rows_out = torch.bfloat16, 16384, []
    print(f"{'case':28} {'16 rows ms':>10} {'32 rows ms':>10} {'32 vs 16':>8} {'sdpa ms':>8} "
          f"{'max diff':>9}")
    for d in map(int, args.d.split(",")):
        heads = 2048 // d
        for L in map(int, args.seq.split(",")):
            for causal in (False, True):
                B = max(1, tokens // L)
                q, k, v = (torch.randn(B, heads, L, d, device="cuda", dtype=dtype) for _ in range(3))
                attend = lambda: fastattn.attention(q, k, v, causal=causal, backend="cuda")  # noqa: E731
                narrow, wide = _with_rows(16, attend), _with_rows(32, attend)
                diff = (narrow().float() - wide().float()).abs().max().item()
                sdpa = lambda: F.scaled_dot_product_attention(q, k, v, is_causal=causal)  # noqa: E731
                t16, t32, ts = [], [], []
                for _ in range(3):  # alternate, so drift hits both
                    for fn, times in ((narrow, t16), (wide, t32), (sdpa, ts)):
                        times.append(time_fn(fn, q.device, args.budget)[0])
                row = dict(D=d, L=L, B=B, H=heads, causal=causal, ms_16=min(t16), ms_32=min(t32),
                           ms_sdpa=min(ts), max_diff=diff)
                rows_out.append(row)
                name = f"D{d} L{L} B{B} H{heads}{' causal' if causal else ''}"
                print(f"{name:28} {row['ms_16']:10.3f} {row['ms_32']:10.3f} "
                      f"{row['ms_16'] / row['ms_32']:7.2f}x {row['ms_sdpa']:8.3f} {diff:9.2e}",
                      flush=True)
                if args.json:  # after each case: a step cut at its limit keeps what it measured
                    with open(args.json, "w") as f:
                        json.dump({"device": torch.cuda.get_device_name(), "dtype": str(dtype),
                                   "torch": torch.__version__, "rows": rows_out}, f, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
