"""The ``fastattn`` command as users run it: ``python -m fastattn`` and ``fastattn demo``'s output folder."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from fastattn import cli

pytestmark = pytest.mark.usefixtures("one_thread")


def test_python_m_fastattn_is_the_cli():
    done = subprocess.run([sys.executable, "-m", "fastattn", "--help"], capture_output=True, text=True, timeout=300,
                          cwd=Path(__file__).resolve().parents[1])
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.startswith("usage: fastattn ") and "{info,bench,demo}" in done.stdout


def test_demo_writes_to_a_temporary_folder_by_default(tmp_path, monkeypatch, capsys):
    monkeypatch.chdir(tmp_path)
    assert cli.main(["demo", "--task", "reverse", "--max-steps", "2", "--no-progress", "--backend", "naive"]) == 0
    assert os.listdir(tmp_path) == []  # nothing in the current directory
    out = capsys.readouterr().out
    folder = Path(re.search(r"output folder: (\S+)", out).group(1))
    assert folder.is_absolute() and (folder / "summary.json").is_file() and (folder / "losses.json").is_file()
    shutil.rmtree(folder)
    target = tmp_path / "chosen"
    assert cli.main(["demo", "--task", "reverse", "--max-steps", "1", "--no-progress", "--backend", "naive",
                     "--out", str(target)]) == 0
    assert (target / "summary.json").is_file()


def test_cpu_bench_table_has_no_error_rows_and_fits_120_columns(capsys):
    threads = torch.get_num_threads()
    try:
        assert cli.main(["bench", "--tiny", "--op", "attention", "--mode", "fwd", "--budget", "0.001",
                         "--device", "cpu", "--threads", "1"]) == 0
    finally:
        torch.set_num_threads(threads)
    out = capsys.readouterr().out
    lines = out.splitlines()
    assert max(len(line.rstrip()) for line in lines) <= 120
    table, _, notes = out.partition("not run here:")
    assert "torch.sdpa[flash]" in table and "fastattn-cpu" in table
    assert "Error" not in table and "CUDA-only" not in table  # no error rows
    # the providers PyTorch has only on CUDA are named once, with the reason
    assert notes.count("torch.sdpa[efficient]") == 1 and notes.count("CUDA-only") == 1


def test_footnote_counts_partial_failures():
    from fastattn import bench

    rows = [bench.Result("op", f"s{i}", "float32", "fwd", "p", error="E: no" if i < 2 else None, ms=1.0) for i in range(3)]
    rows.append(bench.Result("op", "s0", "float32", "fwd", "q", error="E: no"))
    assert bench.footnotes(rows) == ["p (2 of 3 cases), q: E: no"]
