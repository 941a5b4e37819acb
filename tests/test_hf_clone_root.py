"""A clone's root is safe for transformers: its folder kernels/ (shipped as fastattn.kernels) no
longer breaks transformers' probe for the Hugging Face package ``kernels``, and steps aside for
that package when it is installed. Subprocesses, because the test session itself keeps the root
off sys.path (conftest)."""

import os
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[1]


def _run(code: str, **env) -> subprocess.CompletedProcess:
    environ = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    environ.update(env)
    return subprocess.run([sys.executable, "-c", code], cwd=ROOT, env=environ, capture_output=True, text=True, timeout=300)


def test_transformers_and_fastattn_import_from_the_repository_root():
    pytest.importorskip("transformers")
    code = (
        "import sys, os; assert os.path.realpath(sys.path[0] or os.getcwd()) == os.path.realpath('.')\n"
        "from transformers import GPT2LMHeadModel\n"
        "from transformers.utils.import_utils import is_kernels_available\n"
        "import fastattn, fastattn.kernels.attention\n"
        "import kernels\n"
        "print(is_kernels_available(), getattr(kernels, '__file__', None), fastattn.kernels.__name__)\n"
    )
    done = _run(code)
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.split() == ["False", "None", "fastattn.kernels"]


def test_root_kernels_hands_over_to_an_installed_package(tmp_path):
    other = tmp_path / "kernels"
    other.mkdir()
    (other / "__init__.py").write_text("__version__ = '9.9.9'\nWHO = 'the other kernels'\n")
    done = _run("import kernels; print(kernels.__version__, kernels.WHO)", PYTHONPATH=str(tmp_path))
    assert done.returncode == 0, done.stderr[-3000:]
    assert done.stdout.strip() == "9.9.9 the other kernels"
    done = _run("import kernels; kernels.attention_forward")
    assert done.returncode == 1 and "import it as fastattn.kernels" in done.stderr
