"""FFN Linear -> GELU -> Linear: fastattn backends, naive, eager torch, its torch.compile (GPU) and the bare matmuls (the floor).

Cases from fastattn.bench.suites (the same as `fastattn bench --op ffn`); see bench/conftest.py.
"""

import pytest

pytest.importorskip("pytest_benchmark", reason="needs pytest-benchmark (pip install pytest-benchmark)")

OP = "ffn"


def test_ffn(bench_case, run_bench):
    run_bench(bench_case)
