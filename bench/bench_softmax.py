"""Scaled masked softmax: fastattn backends, naive, the composite torch.softmax(x * scale + mask) and its torch.compile (GPU).

Cases from fastattn.bench.suites (the same as `fastattn bench --op softmax`); see bench/conftest.py.
"""

import pytest

pytest.importorskip("pytest_benchmark", reason="needs pytest-benchmark (pip install pytest-benchmark)")

OP = "softmax"


def test_softmax(bench_case, run_bench):
    run_bench(bench_case)
