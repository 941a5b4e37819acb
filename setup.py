"""Builds the torch extension fastattn._C from csrc/ and ships kernels/ as fastattn.kernels.

The extension is a CUDAExtension (CPU + CUDA kernels) when torch was built with CUDA and nvcc is
found, otherwise a CppExtension with the CPU kernels only. FASTATTN_NO_EXTENSION=1 skips it (the
package then runs its triton and naive backends only); FASTATTN_NO_CUDA=1 forces the CPU build.
"""

import glob
import importlib.util
import os

from setuptools import find_packages, setup

import torch
from torch.utils.cpp_extension import CUDA_HOME, BuildExtension, CppExtension, CUDAExtension


def _flags():
    """fastattn.extending, the one place for the flags (DEFAULT_CFLAGS, DEFAULT_CUDA_CFLAGS,
    DEFAULT_LDFLAGS) that users' JIT builds get too; loaded by path, as the package is not
    built yet (the module needs the standard library alone)."""
    path = os.path.join(os.path.dirname(os.path.abspath(__file__)), "fastattn", "extending.py")
    spec = importlib.util.spec_from_file_location("_fastattn_extending", path)
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def _cuda_wanted() -> bool:
    return (
        torch.version.cuda is not None
        and CUDA_HOME is not None
        and os.environ.get("FASTATTN_NO_CUDA") != "1"
    )


def extensions():
    if os.environ.get("FASTATTN_NO_EXTENSION") == "1":
        return []
    # A ninja job a CPU unless the user set MAX_JOBS. Ninja's default, CPUs + 2, makes the longest
    # file (csrc/cpu/attention.cpp, 4 CPU-minutes) share the CPUs with three others: on 2 cores
    # the CPU build took 334 s that way against 307 s with 2 jobs (2026-11-29).
    os.environ.setdefault("MAX_JOBS", str(os.cpu_count() or 1))
    sources = ["csrc/fastattn.cpp", "csrc/eager.cpp", *sorted(glob.glob("csrc/cpu/*.cpp"))]
    include_dirs = [os.path.abspath("csrc/include")]
    flags = _flags()
    cxx, ld = list(flags.DEFAULT_CFLAGS), list(flags.DEFAULT_LDFLAGS)
    if not _cuda_wanted():
        return [
            CppExtension(
                "fastattn._C",
                sources,
                include_dirs=include_dirs,
                extra_compile_args={"cxx": cxx},
                extra_link_args=ld,
            )
        ]
    # sm_80 (A100) and sm_90a (H100/H200, wgmma) unless the user chose architectures.
    os.environ.setdefault("TORCH_CUDA_ARCH_LIST", "8.0;9.0a")
    nvcc = list(flags.DEFAULT_CUDA_CFLAGS)
    return [
        CUDAExtension(
            "fastattn._C",
            sources + sorted(glob.glob("csrc/cuda/*.cu")),
            include_dirs=include_dirs,
            extra_compile_args={"cxx": cxx, "nvcc": nvcc},
            extra_link_args=ld,
        )
    ]


setup(
    packages=[*find_packages(include=["fastattn", "fastattn.*"]), "fastattn.kernels", "fastattn.include"],
    # kernels/ ships as fastattn.kernels; the C++ headers ship as fastattn/include so that users
    # can compile their own extensions against them (fastattn.extending.include_paths()).
    package_dir={"fastattn.kernels": "kernels", "fastattn.include": "csrc/include"},
    package_data={"fastattn": ["data/*"], "fastattn.include": ["fastattn/*.h", "fastattn/*.cuh"]},
    ext_modules=extensions(),
    cmdclass={"build_ext": BuildExtension.with_options(use_ninja=True)},
)
