"""Attention: every fastattn backend available here, naive, torch SDPA (default and each kernel forced), FlexAttention and torch.compile(naive) (GPU).

Cases from fastattn.bench.suites (the same as `fastattn bench --op attention`); see bench/conftest.py.
"""

import pytest

pytest.importorskip("pytest_benchmark", reason="needs pytest-benchmark (pip install pytest-benchmark)")

OP = "attention"


def test_attention(bench_case, run_bench):
    run_bench(bench_case)
