"""Host-side proof of the CUDA attention kernels' index math, no GPU needed.

tests/cuda_layouts_test.cpp includes csrc/include/fastattn/cuda_layout.cuh (the swizzle,
mma-fragment and ldmatrix address functions the kernels use) and checks, by modelling shared-memory
banks, ldmatrix and mma.sync by their PTX definitions, that every layout is a bijection, that the
ldmatrix addresses deliver exactly the mma fragments, and that each warp access pattern of the
kernels is bank-conflict free (with a control that the checker does see the conflicts of an
unswizzled tile). Compiled with the host C++ compiler (g++, clang++, or nvcc for the host).
"""

from __future__ import annotations

import os
import shutil
import subprocess

import pytest

ROOT = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
SOURCE = os.path.join(ROOT, "tests", "cuda_layouts_test.cpp")
INCLUDE = os.path.join(ROOT, "csrc", "include")


def _compiler():
    for name in (os.environ.get("CXX"), "g++", "clang++", "c++", "nvcc"):
        if name and shutil.which(name):
            return name
    return None


def test_cuda_layouts_host_proof(tmp_path):
    cxx = _compiler()
    if cxx is None:
        pytest.skip("no host C++ compiler (g++, clang++, c++ or nvcc) on PATH")
    exe = str(tmp_path / "cuda_layouts_test")
    build = subprocess.run([cxx, "-std=c++17", "-O1", "-I", INCLUDE, SOURCE, "-o", exe],
                           capture_output=True, text=True)
    assert build.returncode == 0, f"{cxx} failed:\n{build.stdout}{build.stderr}"
    run = subprocess.run([exe], capture_output=True, text=True, timeout=120)
    assert run.returncode == 0, run.stdout + run.stderr
    assert "checks passed" in run.stdout, run.stdout
