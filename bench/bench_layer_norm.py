"""Layer norm: fastattn backends, naive, F.layer_norm and torch.compile(naive) (GPU).

Cases from fastattn.bench.suites (the same as `fastattn bench --op layer_norm`); see bench/conftest.py.
"""

import pytest

pytest.importorskip("pytest_benchmark", reason="needs pytest-benchmark (pip install pytest-benchmark)")

OP = "layer_norm"


def test_layer_norm(bench_case, run_bench):
    run_bench(bench_case)
