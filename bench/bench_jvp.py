"""Attention's JVP (torch.func.jvp, tangents of q, k, v): fastattn backends, naive and torch's math-path SDPA JVP, time and peak memory, at L 512-8k (GPU; 512-2k on a CPU).

Cases from fastattn.bench.suites (the same as `fastattn bench --op jvp`); see bench/conftest.py.
"""

import pytest

pytest.importorskip("pytest_benchmark", reason="needs pytest-benchmark (pip install pytest-benchmark)")

OP = "jvp"


def test_jvp(bench_case, run_bench):
    run_bench(bench_case)
