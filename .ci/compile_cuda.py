"""Compile every csrc/cuda/*.cu with nvcc (object files discarded) to catch CUDA syntax and
template errors on machines without a GPU. Skipped, with a message, when nvcc is not installed."""

import concurrent.futures
import glob
import os
import shutil
import subprocess
import sys
import tempfile

from torch.utils.cpp_extension import include_paths

ARCHS = ["-gencode", "arch=compute_80,code=sm_80", "-gencode", "arch=compute_90a,code=sm_90a"]


def compile_one(path: str, out_dir: str) -> tuple[str, int, str]:
    cmd = [
        "nvcc", "-std=c++17", "-O3", "--expt-relaxed-constexpr", "-Xcompiler", "-fPIC",
        "-DTORCH_EXTENSION_NAME=_C", *ARCHS, "-I", os.path.abspath("csrc/include"),
        *(f"-I{p}" for p in include_paths()), "-c", path,
        "-o", os.path.join(out_dir, os.path.basename(path) + ".o"),
    ]
    proc = subprocess.run(cmd, capture_output=True, text=True)
    return path, proc.returncode, proc.stdout + proc.stderr


def main() -> int:
    if shutil.which("nvcc") is None:
        print("compile_cuda: nvcc not found; CUDA sources not checked")
        return 0
    sources = sorted(glob.glob("csrc/cuda/*.cu"))
    failed = 0
    with tempfile.TemporaryDirectory() as out, concurrent.futures.ThreadPoolExecutor(os.cpu_count()) as pool:
        for path, rc, log in pool.map(lambda p: compile_one(p, out), sources):
            print(f"compile_cuda: {path}: {'ok' if rc == 0 else 'FAILED'}")
            if rc != 0:
                failed += 1
                print(log)
    print(f"compile_cuda: {len(sources) - failed} of {len(sources)} CUDA sources compiled")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
