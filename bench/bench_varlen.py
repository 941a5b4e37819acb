"""Packed variable-length attention: fastattn backends, naive, SDPA on padded tensors (pad, SDPA, unpad) and SDPA per sequence, at mixed lengths.

Cases from fastattn.bench.suites (the same as `fastattn bench --op varlen`); see bench/conftest.py.
"""

import pytest

pytest.importorskip("pytest_benchmark", reason="needs pytest-benchmark (pip install pytest-benchmark)")

OP = "varlen"


def test_varlen(bench_case, run_bench):
    run_bench(bench_case)
