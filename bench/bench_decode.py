"""Paged KV-cache decoding: fastattn backends, naive and SDPA on a padded contiguous cache, at cache lengths 1k-32k and batch 1-64 (GPU).

Cases from fastattn.bench.suites (the same as `fastattn bench --op decode`); see bench/conftest.py.
"""

import pytest

pytest.importorskip("pytest_benchmark", reason="needs pytest-benchmark (pip install pytest-benchmark)")

OP = "decode"


def test_decode(bench_case, run_bench):
    run_bench(bench_case)
