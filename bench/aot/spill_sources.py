"""Where do a kernel variant's spills sit? Each local store/load (STL/LDL) of its SASS, with the
source line ptxas attributes it to and where it runs: ``LOOP`` (inside a loop of the fast path),
``ONCE`` (outside every loop: a value kept across the tile loop, stored once before it and
loaded once after), ``COLD`` (inside the NaN rule's careful branch: the address range of the
code attributed to ``_fwd_careful``, ``_dkdv_careful``, ``_dq_careful``, ``_masked_dot``,
``_attended``).

    python bench/aot/spill_sources.py --case "bf16 D128 L4k causal" --kernel dq --config "16x32 w4s2"
    python bench/aot/spill_sources.py --log bench/aot/sm90-triton3.6-2026-11-23-full-partial.log

``--log``: every FAIL row of a ``fastattn.aot`` log, case by case. Needs the gate's Triton
(3.6, ``.venv-aot``): it compiles like ``fastattn.aot`` and disassembles the cubin with the
wheel's ``nvdisasm -g`` (Triton emits line info; there is no inlining info, so a line is the
innermost one). Loops are the spans of conditional backward branches (mbarrier wait loops,
``.U.ANY``, and the out-of-line tails that jump back are not loops).
"""

from __future__ import annotations

import argparse
import ast
import collections
import contextlib
import io
import os
import re
import subprocess
import tempfile

import triton
from triton.backends.compiler import GPUTarget
from triton.compiler import ASTSource

import fastattn.kernels
from fastattn.aot import triton as aot
from fastattn.aot.report import parse_ptxas

BIN = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin")
SRC = os.path.join(os.path.dirname(fastattn.kernels.__file__), "attention.py")
COLD = ("_fwd_careful", "_dkdv_careful", "_dq_careful", "_masked_dot", "_attended")


def function_of_line():
    tree = ast.parse(open(SRC).read())
    spans = [(n.lineno, n.end_lineno, n.name) for n in tree.body if isinstance(n, ast.FunctionDef)]
    return lambda line: next((name for a, b, name in spans if a <= line <= b), "?")


def compile_variant(launch, config):
    fn, kwargs, backend, bound_args, specialization, options = aot._bind(launch, config, aot.H100)
    options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound_args,
                                                          specialization, options)
    src = ASTSource(fn, signature, constexprs, attrs)
    with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
        return triton.compile(src, target=GPUTarget("cuda", 90, 32), options=options.__dict__)


def spill_sites(cubin, where):
    """Counter of (STL/LDL, LOOP/ONCE/COLD, function:line)."""
    with tempfile.TemporaryDirectory() as tmp:
        path = os.path.join(tmp, "k.cubin")
        with open(path, "wb") as f:
            f.write(cubin)
        text = subprocess.run([os.path.join(BIN, "nvdisasm"), "-g", "-c", path],
                              capture_output=True, text=True, check=True).stdout
    line_of, insts, labels, pending = ("?", 0), [], {}, []
    for line in text.splitlines():
        m = re.match(r'\s*//## File "([^"]*)", line (\d+)', line)
        if m:
            line_of = (os.path.basename(m.group(1)), int(m.group(2)))
            continue
        m = re.match(r"^\s*(\.L\w+):", line)
        if m:
            pending.append(m.group(1))
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*)", line)
        if m:
            addr = int(m.group(1), 16)
            labels.update((p, addr) for p in pending)
            pending = []
            file, n = line_of
            insts.append((addr, f"{where(n)}:{n}" if file == "attention.py" else f"{file}:{n}",
                          m.group(2)))
    loops = []
    for addr, _, ins in insts:
        m = re.search(r"BRA[^`]*`\((\.L\w+)\)", ins)
        if (m and ins.startswith("@") and ".U.ANY" not in ins
                and labels.get(m.group(1), 1 << 40) + 0x60 < addr):
            loops.append((labels[m.group(1)], addr))
    cold = [addr for addr, src, _ in insts if src.split(":")[0] in COLD]
    lo, hi = (min(cold), max(cold)) if cold else (-1, -1)
    sites = collections.Counter()
    for addr, src, ins in insts:
        m = re.search(r"\b(STL|LDL)\b", ins)
        if m:
            kind = ("COLD" if lo <= addr <= hi else
                    "LOOP" if any(a <= addr <= b for a, b in loops) else "ONCE")
            sites[(m.group(1), kind, src)] += 1
    return sites


def probe(case, wanted, kernel, config_text, where):
    selected = [c for c in aot.cases() if c.name == case]
    for launch, config in aot.capture(selected, all_configs=True):
        name = aot._kernel_name(launch.fn)
        path = "tma" if launch.path == "1" else "ptr"
        text = aot._config_text(config, aot._launch_kwargs(launch, config))
        bare = re.sub(r" r\d+$", "", text)
        if wanted is not None and (name, path, bare) not in wanted:
            continue
        if (kernel and kernel not in name) or (config_text and bare not in config_text):
            continue
        compiled = compile_variant(launch, config)
        stats = parse_ptxas(aot._ptxas_log(compiled, 90))
        mine = stats.get(compiled.metadata.name) or next(iter(stats.values()), {})
        sites = spill_sites(compiled.asm["cubin"], where)
        kinds = collections.Counter()
        for (_, kind, _), n in sites.items():
            kinds[kind] += n
        print(f"{name} [{path}] {text}: {mine.get('regs')} registers, spills "
              f"{mine.get('spill_stores', 0)}/{mine.get('spill_loads', 0)} B; spill "
              f"instructions: loop {kinds['LOOP']}, once {kinds['ONCE']}, cold {kinds['COLD']}",
              flush=True)
        for (op, kind, src), n in sorted(sites.items()):
            print(f"    {op} {kind} x{n} {src}")


def main():
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--case", help="a case name of fastattn.aot, exactly")
    parser.add_argument("--kernel", default="", help="a substring of the kernel name")
    parser.add_argument("--config", default="", help='comma-separated, e.g. "16x32 w4s2"')
    parser.add_argument("--log", help="a fastattn.aot log: every FAIL row in it")
    args = parser.parse_args()
    where = function_of_line()
    configs = [c.strip() for c in args.config.split(",") if c.strip()]
    if args.log:
        wanted = collections.defaultdict(set)
        for line in open(args.log):
            m = re.search(r"\] (_attn_\w+) attention: (.*) \[(tma|ptr)\] (\S+ \S+)(?: r\d+)?: FAIL",
                          line)
            if m:
                wanted[m.group(2)].add((m.group(1), m.group(3), m.group(4)))
        for case, triples in wanted.items():
            print(f"== {case}", flush=True)
            probe(case, triples, args.kernel, configs, where)
    elif args.case:
        probe(args.case, None, args.kernel, configs, where)
    else:
        parser.error("--case or --log")


if __name__ == "__main__":
    main()
