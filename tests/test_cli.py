"""The ``fastattn`` command as users run it: ``python -m fastattn`` and ``fastattn demo``'s output folder."""

import os
import re
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

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
