"""Host checks of the CPU kernels' vector building blocks, compiled with the host C++ compiler against
torch's headers, once at the baseline ISA and once for each of AVX2 and AVX-512 the CPU runs (the
kernels use them inside code compiled for those targets):

- tests/cpu_simd_test.cpp: the vector float16 / bfloat16 conversions (cpu_simd.h). It compares
  load_half / store_half and load_bf16 / store_bf16 with c10's per-element conversions, bit for
  bit: every float16 pattern, and float32 inputs at every rounding boundary.
- tests/cpu_gemm_test.cpp: the attention tiles' GEMM (cpu_gemm.h): walking k in chunks gives the
  result of one pass bit for bit, and both a GEMM; row strides from gemm_ld.
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest
from torch.utils.cpp_extension import include_paths

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCES = {"simd": "cpu_simd_test.cpp", "gemm": "cpu_gemm_test.cpp"}

ISAS = {
    "baseline": ([], None),
    "avx2": (["-mavx2", "-mfma", "-mf16c"], "avx2"),
    "avx512": (["-mavx512f", "-mavx512bw", "-mavx512vl", "-mavx512dq", "-mavx2", "-mfma"], "avx512bw"),
}


def _cpu_flags() -> set[str]:
    try:
        with open("/proc/cpuinfo") as f:
            for line in f:
                if line.startswith("flags"):
                    return set(line.split(":", 1)[1].split())
    except OSError:
        pass
    return set()


@pytest.mark.parametrize("source", list(SOURCES))
@pytest.mark.parametrize("isa", list(ISAS))
def test_host_checks(isa, source, tmp_path):
    cxx = next((c for c in (os.environ.get("CXX"), "g++", "clang++", "c++") if c and shutil.which(c)), None)
    if cxx is None:
        pytest.skip("no host C++ compiler (g++, clang++ or c++) on PATH")
    flags, needs = ISAS[isa]
    if needs is not None and needs not in _cpu_flags():
        pytest.skip(f"this CPU has no {isa}")
    exe = str(tmp_path / f"cpu_{source}_test_{isa}")
    includes = [f"-I{p}" for p in include_paths()] + [f"-I{os.path.join(ROOT, 'csrc', 'include')}"]
    src = os.path.join(ROOT, "tests", SOURCES[source])
    build = subprocess.run([cxx, "-std=c++17", "-O2", *flags, *includes, src, "-o", exe],
                           capture_output=True, text=True)
    assert build.returncode == 0, f"{cxx} failed:\n{build.stdout}{build.stderr}"
    run = subprocess.run([exe], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert run.stdout.strip() == "ok"
