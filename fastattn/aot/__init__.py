"""Ahead-of-time checks for the Hopper (sm_90) build, run without a GPU.

``python -m fastattn.aot`` compiles every Triton kernel launch fastattn makes (representative
shapes x every autotune config the pruners keep) and every CUDA kernel of the extension for
sm_90/sm_90a, and prints one row per variant: registers, spills, shared memory and the
instructions its SASS holds (:mod:`fastattn.aot.report`). It exits non-zero on a compile error,
on spills over a kernel's budget, or on a SASS that lacks an instruction a kernel must use.
"""
