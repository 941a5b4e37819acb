"""Hardware counters of the attention kernels (cuda and triton backends) under Nsight Compute.

The first GPU run (bench/results/gpu-notes.md) timed the CUDA C++ attention at 0.11-0.27 of
cuDNN and the Triton backward at 0.33-0.66; times alone do not say why. This script, run on a GPU
machine whose runtime lets ncu read the counters (Firecracker here, not gVisor), profiles one
forward + backward of each backend (and of the cuda forward's 32-row config) at B1 H16 L4096,
D64 and D128, causal or not, bf16, and prints
per kernel: time, SM and memory throughput, achieved occupancy, the tensor pipe's activity,
shared-memory bank conflicts and the leading warp stall reasons::

    python bench/profile_attention.py --out DIR          # runs ncu on itself (about 2 minutes)
    python bench/profile_attention.py --workload         # what ncu runs: warm-up, then one
                                                         # profiled fwd+bwd per case

Clocks are left alone (``--clock-control none``). Only the launches between
``torch.cuda.profiler.start()`` and ``stop()`` are profiled: autotuning and compiles happen in
the warm-up before. Metrics this ncu does not know are dropped (``ncu --query-metrics``) and
named in the output, so a missing one costs a column, not the run.
"""

from __future__ import annotations

import argparse
import csv
import io
import os
import shutil
import subprocess
import sys
from pathlib import Path

CASES = [(d, causal) for d in (64, 128) for causal in (False, True)]
# "cuda-rows32": the cuda backend with its forward on 32 rows a warp (FASTATTN_CUDA_FWD_ROWS=32,
# Configs<DP>::FwdWide): whether it moves the bound the 16-row forward is predicted to hit
# (shared-memory reads, gpu-notes).
BACKENDS = ("cuda", "cuda-rows32", "triton")
SHAPE = (1, 16, 4096)  # B, H, L

# (column, metric): what each column shows, in the order printed.
METRICS = [
    ("ms", "gpu__time_duration.sum"),
    ("SM %", "sm__throughput.avg.pct_of_peak_sustained_elapsed"),
    ("mem %", "gpu__compute_memory_throughput.avg.pct_of_peak_sustained_elapsed"),
    ("occup %", "sm__warps_active.avg.pct_of_peak_sustained_active"),
    ("mma.sync %", "sm__pipe_tensor_op_hmma_cycles_active.avg.pct_of_peak_sustained_active"),
    ("wgmma %", "sm__pipe_tensor_op_gmma_cycles_active.avg.pct_of_peak_sustained_active"),
    ("smem confl ld", "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_ld.sum"),
    ("smem confl st", "l1tex__data_bank_conflicts_pipe_lsu_mem_shared_op_st.sum"),
    ("regs", "launch__registers_per_thread"),
]
STALLS = ["barrier", "long_scoreboard", "short_scoreboard", "mio_throttle", "math_pipe_throttle",
          "wait", "not_selected", "lg_throttle", "dispatch_stall", "no_instruction"]
STALL_METRIC = "smsp__average_warps_issue_stalled_{}_per_issue_active.ratio"


def workload() -> int:
    """Warm each case up (compiles, autotuning), then profile one forward + backward of it."""
    import torch

    import fastattn

    b, h, L = SHAPE
    torch.manual_seed(0)
    for backend in BACKENDS:
        for d, causal in CASES:
            q, k, v = (torch.randn(b, h, L, d, device="cuda", dtype=torch.bfloat16,
                                   requires_grad=True) for _ in range(3))
            dout = torch.randn(b, h, L, d, device="cuda", dtype=torch.bfloat16)

            if backend == "cuda-rows32":
                os.environ["FASTATTN_CUDA_FWD_ROWS"] = "32"
            else:
                os.environ.pop("FASTATTN_CUDA_FWD_ROWS", None)

            def step():
                out = fastattn.scaled_dot_product_attention(q, k, v, is_causal=causal,
                                                            backend=backend.split("-")[0])
                torch.autograd.grad(out, (q, k, v), dout)

            for _ in range(2):
                step()
            torch.cuda.synchronize()
            torch.cuda.profiler.start()
            step()
            torch.cuda.synchronize()
            torch.cuda.profiler.stop()
            print(f"profiled {_label(backend, d, causal)}", flush=True)
    return 0


def _label(backend, d, causal):
    return f"{backend} D{d}{' causal' if causal else ''}"


def _labels():
    """The workload's cases in the order it profiles them."""
    return [_label(backend, d, causal) for backend in BACKENDS for d, causal in CASES]


def _known(ncu: str, wanted: list[str]) -> tuple[list[str], list[str]]:
    """The wanted metrics whose base name this ncu lists, and the others."""
    listed = subprocess.run([ncu, "--query-metrics", "--csv"], capture_output=True, text=True,
                            timeout=60).stdout
    bases = {row[0].strip('"') for row in csv.reader(io.StringIO(listed)) if row}
    keep = [m for m in wanted if m.split(".")[0] in bases or m.startswith("launch__")]
    if all(m.startswith("launch__") for m in keep):  # a listing this reader does not understand:
        return wanted, []                             # ask for all, and let ncu say
    return keep, [m for m in wanted if m not in keep]


def profile(out: Path) -> int:
    ncu = shutil.which("ncu") or "/usr/local/cuda/bin/ncu"
    if not Path(ncu).exists() and not shutil.which(ncu):
        print("profile_attention: ncu not found")
        return 1
    out.mkdir(parents=True, exist_ok=True)
    wanted = [m for _, m in METRICS] + [STALL_METRIC.format(s) for s in STALLS]
    metrics, unknown = _known(ncu, wanted)
    cmd = [ncu, "--profile-from-start", "off", "--clock-control", "none", "--target-processes",
           "all", "-k", "regex:attn", "--metrics", ",".join(metrics), "--csv", "--page", "raw",
           "--print-units", "base", sys.executable, __file__, "--workload"]
    print("$ " + " ".join(cmd), flush=True)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    (out / "ncu-raw.csv").write_text(proc.stdout)
    (out / "ncu-stderr.log").write_text(proc.stderr)
    if proc.returncode != 0:
        print(proc.stderr[-3000:])
        return proc.returncode
    print(table(proc.stdout, unknown))
    return 0


def table(raw: str, unknown: list[str]) -> str:
    """One line per profiled kernel from ncu's raw CSV page. A case's kernels follow its forward
    kernel, and the cases come in the workload's order (_labels)."""
    text = raw[raw.find('"ID"'):] if '"ID"' in raw else raw
    rows = [r for r in csv.DictReader(io.StringIO(text)) if r.get("ID", "").strip().isdigit()]
    labels, case = _labels(), -1
    lines = [" | ".join(["case", "kernel", *[c for c, _ in METRICS],
                         "top stalls (warps per issued instruction)"])]
    for r in rows:
        name = r.get("Kernel Name", "")
        case += "fwd" in name
        cells = [labels[case] if 0 <= case < len(labels) else "?", name[:40]]
        for _, metric in METRICS:
            value = r.get(metric, "")
            if metric == "gpu__time_duration.sum" and value:
                value = f"{_number(value) / 1e6:.3f}"  # ns -> ms
            cells.append(value)
        stalls = [(_number(r[m]), s) for s in STALLS
                  if (m := STALL_METRIC.format(s)) in r and _number(r[m]) is not None]
        cells.append(", ".join(f"{s} {v:.1f}" for v, s in sorted(stalls, reverse=True)[:3]))
        lines.append(" | ".join(cells))
    if unknown:
        lines.append("metrics this ncu does not know: " + ", ".join(unknown))
    return "\n".join(lines)


def _number(text):
    try:
        return float(str(text).replace(",", ""))
    except ValueError:
        return None


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--workload", action="store_true", help="the profiled program itself")
    parser.add_argument("--out", default=os.environ.get("OUT", "."), help="where ncu's CSV goes")
    args = parser.parse_args(argv)
    return workload() if args.workload else profile(Path(args.out))


if __name__ == "__main__":
    sys.exit(main())
