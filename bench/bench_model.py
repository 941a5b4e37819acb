"""Model: a small GPT-style block stack (fastattn.models.GPT) on fastattn's backends, naive, and
the same model in plain PyTorch (F.layer_norm, SDPA, F.linear) and its torch.compile (GPU).

Cases from fastattn.bench.suites (the same as `fastattn bench --op model`); see bench/conftest.py.
"""

import pytest

pytest.importorskip("pytest_benchmark", reason="needs pytest-benchmark (pip install pytest-benchmark)")

from fastattn.bench.suites import SUITES  # noqa: E402

if "model" not in SUITES:
    pytest.skip("fastattn.models is not available", allow_module_level=True)

OP = "model"


def test_model(bench_case, run_bench):
    run_bench(bench_case)
