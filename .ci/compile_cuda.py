"""make check-cuda: the CUDA half of the Hopper compile gate (fastattn/aot/cuda.py).

Compiles the device code of every csrc/cuda/*.cu once with the extension's real nvcc flags
(sm_80 + sm_90a, as setup.py builds it; the host code through nvcc's front end only: see
fastattn.aot.cuda.nvcc_command), prints one row per __global__ kernel of the sm_90a build (registers, spills,
shared memory, the SASS instructions that matter), and exits non-zero on a compile error, spills
over a kernel's budget, or an attention kernel whose SASS lacks ldmatrix, cp.async or mma.
Skipped, with a message, when nvcc is not installed. ``--quick``: sm_90a only.
"""

import os
import sys
import time


from fastattn.aot.cuda import CudaToolsMissing, cuda_rows
from fastattn.aot.report import print_table


def main() -> int:
    start = time.time()
    try:
        rows = cuda_rows(quick="--quick" in sys.argv[1:])
    except CudaToolsMissing as e:
        print(f"compile_cuda: {e}; CUDA sources not checked")
        return 0
    print_table(rows, title="CUDA kernels, sm_90a build (fastattn/aot/cuda.py)")
    bad = [r for r in rows if r.problems]
    for r in bad:
        print(f"compile_cuda: {r.kernel} {r.case}: {'; '.join(r.problems)}")
    print(f"compile_cuda: {len(rows)} kernels in {time.time() - start:.0f} s, "
          f"{'FAILED: ' + str(len(bad)) if bad else 'all within budget'}")
    return 1 if bad else 0


if __name__ == "__main__":
    sys.exit(main())
