"""Turn recorded ``fastattn bench --json`` files into a markdown summary.

    python bench/summarize.py                       # bench/results/*.json -> bench/results/SUMMARY.md
    python bench/summarize.py a.json b.json -o out.md

Per file: where it ran (CPU or GPU numbers, device, versions, commit, load), headline speedups
(geometric means over the cases), then one table per op: each provider's median time, the
throughput of the best one, the best fastattn backend's speedup over naive and over the fastest
PyTorch peer, and the largest error against the float64 reference. Providers that could not run
a case show ``n/a`` with the reasons listed under the table.
"""

from __future__ import annotations

import argparse
import glob
import math
import os
import sys
from collections import defaultdict

from fastattn.bench import NAIVE, TORCH_PREFIX, WRONG_ERROR, WRONG_FACTOR, Result, load_json, wrong_results

HERE = os.path.dirname(os.path.abspath(__file__))
RESULTS = os.path.join(HERE, "results")


def _geomean(values):
    values = [v for v in values if v and v > 0]
    return math.exp(sum(math.log(v) for v in values) / len(values)) if values else None


def _fmt(v, spec, none="-"):
    return none if v is None else format(v, spec)


def _case_key(r: Result):
    return (r.shape, r.dtype, r.mode)


def _ours(name: str) -> bool:
    return name.startswith("fastattn")


def _label(env: dict, results: list[Result]) -> str:
    kind = env.get("device_type") or ("cpu" if "cuda" not in env else "cuda")
    if kind == "cpu":
        threads = env.get("threads", "?")
        dtypes = ", ".join(dict.fromkeys(r.dtype for r in results)) or "?"
        return (f"**CPU numbers** ({env.get('device', '?')}, {threads} thread{'' if threads == 1 else 's'}) — "
                f"small shapes, {dtypes}; they say nothing about GPU performance")
    return f"**GPU numbers** ({env.get('device', '?')}, CUDA {env.get('cuda', '?')}, driver {env.get('driver', '?')})"


def headline(results: list[Result], wrong: set[int] | None = None) -> list[str]:
    """Geometric-mean speedups per (op, provider) over the cases where both ran and the result
    was right (``wrong``: their :func:`wrong_results`, when the caller has it; counted, not
    averaged)."""
    wrong = wrong_results(results) if wrong is None else wrong
    lines = ["| op | provider | cases | x naive (geomean) | x best torch (geomean) |",
             "| --- | --- | ---: | ---: | ---: |"]
    by_op: dict[str, dict[str, list[Result]]] = defaultdict(lambda: defaultdict(list))
    for r in results:
        by_op[r.op][r.provider].append(r)
    for op, providers in by_op.items():
        for name, rs in providers.items():
            if name == NAIVE:
                continue
            ok = [r for r in rs if r.ms and id(r) not in wrong]
            bad = sum(1 for r in rs if r.ms and id(r) in wrong)
            if not ok and not bad:
                continue
            vs_naive = _geomean(r.speedup_vs_naive for r in ok)
            vs_torch = _geomean(r.speedup_vs_torch for r in ok) if not name.startswith(TORCH_PREFIX) else None
            count = f"{len(ok)}" + (f" (+{bad} wrong, left out)" if bad else "")
            lines.append(f"| {op} | {'**' + name + '**' if _ours(name) else name} | {count} | "
                         f"{_fmt(vs_naive, '.2f')} | {_fmt(vs_torch, '.2f')} |")
    return lines


def op_table(op: str, results: list[Result], wrong: set[int] | None = None) -> list[str]:
    providers = list(dict.fromkeys(r.provider for r in results))
    flops = any(r.tflops is not None for r in results)
    unit = "TFLOP/s" if flops else "GB/s"
    cases: dict[tuple, dict[str, Result]] = {}
    for r in results:
        cases.setdefault(_case_key(r), {})[r.provider] = r
    notes: dict[str, int] = {}
    wrong = wrong_results(results) if wrong is None else wrong
    head = ["case", "mode", *[f"{p} ms" for p in providers], f"best {unit}", "best fastattn x naive",
            "x torch", "max err fastattn / others"]
    lines = [f"### {op}", "", f"Median milliseconds per provider (fastest in bold); throughput in {unit}.", "",
             "| " + " | ".join(head) + " |", "| " + " | ".join(["---", "---"] + ["---:"] * (len(head) - 2)) + " |"]
    for (shape, dtype, mode), rows in cases.items():
        timed = [r for r in rows.values() if r.ms and id(r) not in wrong]
        best = min(timed, key=lambda r: r.ms) if timed else None
        cells = [f"{shape} {dtype}", mode]
        for p in providers:
            r = rows.get(p)
            if r is None:
                cells.append("")
            elif r.error:
                n = notes.setdefault(f"{p}: {r.error}", len(notes) + 1)
                cells.append(f"n/a [{n}]")
            elif id(r) in wrong:
                cells.append(f"{r.ms:.3g} WRONG")
            else:
                text = f"{r.ms:.3g}"
                cells.append(f"**{text}**" if r is best else text)
        tput = None if best is None else (best.tflops if flops else best.gbps)
        cells.append(_fmt(tput, ".3g"))
        ours = [r for r in timed if _ours(r.provider)]
        top = min(ours, key=lambda r: r.ms) if ours else None
        cells.append("-" if top is None else f"{_fmt(top.speedup_vs_naive, '.2f')} ({top.provider.removeprefix('fastattn-')})")
        cells.append("-" if top is None else _fmt(top.speedup_vs_torch, ".2f"))
        mine = [r.worst_error for r in rows.values() if r.worst_error is not None and _ours(r.provider)]
        rest = [r.worst_error for r in rows.values() if r.worst_error is not None and not _ours(r.provider)]
        cells.append(f"{_fmt(max(mine) if mine else None, '.1e')} / {_fmt(max(rest) if rest else None, '.1e')}")
        lines.append("| " + " | ".join(cells) + " |")
    if notes:
        lines += ["", "Could not run:", ""]
        lines += [f"{n}. {text}" for text, n in notes.items()]
    return lines + [""]


def summarize_file(path: str) -> list[str]:
    results, env = load_json(path)
    inside = os.path.abspath(path).startswith(RESULTS + os.sep)
    name = os.path.relpath(path, RESULTS) if inside else os.path.basename(path)
    peaks = env.get("peaks") or {}
    if "copy_gbps" in peaks:  # files written before peaks were keyed by dtype
        peaks = {"": peaks}
    peak_text = "; ".join(
        f"{key.split(' ')[-1] or p.get('matmul_dtype', '')} matmul {p['matmul_tflops']:.3g} TFLOP/s, copy {p['copy_gbps']:.0f} GB/s"
        for key, p in peaks.items()
    )
    commit = env.get("commit") or "?"
    if env.get("commit_dirty"):
        commit += " (with uncommitted changes)"
    lines = [
        f"## {name}", "",
        _label(env, results), "",
        f"- recorded {env.get('date', '?')} with `{env.get('command', 'fastattn bench')}`"
        + (f" in {env['wall_s']:.0f} s" if env.get("wall_s") else ""),
        f"- fastattn {env.get('fastattn', '?')} at commit {commit}; torch {env.get('torch', '?')}, "
        f"triton {env.get('triton', '?')}, python {env.get('python', '?')}",
        f"- fastattn backends available: {', '.join(env.get('backends') or []) or '?'}",
        f"- measured peaks: {peak_text or '?'}",
    ]
    if env.get("cpu_isa"):
        caps = ", ".join(f"{k} {env[k]}" for k in ("torch_cpu_isa", "onednn_max_cpu_isa", "mkl_enable_instructions")
                         if env.get(k))
        kernels = ", ".join(f"{k} {v}" for k, v in (env.get("cpu_kernels") or {}).items())
        lines.append(f"- cpu backend SIMD {env['cpu_isa']}" + (f" ({caps})" if caps else "")
                     + (f"; kernels chosen by CPU: {kernels}" if kernels else ""))
    if env.get("partial"):
        lines.append("- **partial**: the run was cut short; these are the cases it finished")
    if env.get("loadavg"):
        lines.append(f"- load average at the end (1, 5, 15 min): {', '.join(str(v) for v in env['loadavg'])} "
                     f"on {env.get('cpus', '?')} CPUs — other work on the machine inflates CPU times")
    if not any(_ours(r.provider) and r.ms for r in results):
        lines.append("- no compiled fastattn backend ran here (only `naive`): the speedups below compare "
                     "PyTorch's kernels with the naive baseline")
    wrong = wrong_results(results)  # (per case: one pass serves every table of the file)
    lines += ["", "### Headlines", "", *headline(results, wrong), ""]
    for op in dict.fromkeys(r.op for r in results):
        lines += op_table(op, [r for r in results if r.op == op], wrong)
    return lines


def newest_first(paths: list[str]) -> list[str]:
    """Result files by the date they record (a GPU session's folder holds several), newest first."""
    return sorted(paths, key=lambda path: (load_json(path)[1].get("date") or "", path), reverse=True)


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("files", nargs="*",
                        help="result JSON files (default: bench/results/*.json and */*.json)")
    parser.add_argument("-o", "--output", default=os.path.join(RESULTS, "SUMMARY.md"))
    args = parser.parse_args(argv)
    files = args.files or newest_first(
        glob.glob(os.path.join(RESULTS, "*.json")) + glob.glob(os.path.join(RESULTS, "*", "*.json")))
    if not files:
        print("summarize: no result files", file=sys.stderr)
        return 1
    lines = [
        "# Recorded benchmark results", "",
        "Generated by `python bench/summarize.py` from the JSON files in this folder (newest first); "
        "do not edit by hand. How results are recorded: [README.md](README.md).", "",
        "Columns: `x naive` = naive time / provider time; `x torch` = the fastest PyTorch peer's time / "
        "provider time; `max err` = the largest absolute error against the float64 NumPy reference "
        "(forward output, and gradients in backward modes) of the fastattn backends / of the other providers. "
        f"WRONG: a fastattn result whose error is over {WRONG_ERROR:g} and {WRONG_FACTOR:g} times the other "
        "providers' (its time is shown, never counted as fastest or in a geomean).", "",
    ]
    for path in files:
        lines += summarize_file(path)
    with open(args.output, "w") as f:
        f.write("\n".join(lines).rstrip() + "\n")
    print(f"wrote {args.output} from {len(files)} file(s)")
    return 0


if __name__ == "__main__":
    sys.exit(main())
