"""The CUDA kernels RUN on the host: csrc/cuda/*.cu compiled by the host C++ compiler on the
SIMT emulator of csrc/include/fastattn/cuda_emulator.h (fibers for threads, warp-level ldmatrix /
mma.sync / shuffles, cp.async completing at its wait, a happens-before shared-memory race check).

It lets CI (no GPU) check the device code of the cuda backend against the float64 reference —
fragment maps, swizzled addresses, the online softmax, masks and bands, dropout, GQA, the
backward's three kernels, and the small ops' kernels — and the attention kernels' barriers
(tests/test_cuda_emulated.py). It is a test instrument, not a backend: a block runs its threads
one after another (hundreds of times slower than the cpu backend); timing, occupancy and the
sm_90a compiler stay for a GPU to show.

``load()`` builds (once, cached under build/emulate/) and returns the module: ``<op>_fwd`` /
``<op>_bwd`` for attention, softmax, layer_norm, ffn (and ``rope_fwd``) take CPU tensors and the
arguments of the ``fastattn::<op>_fwd`` / ``_bwd`` schemas (csrc/fastattn.cpp);
``selftest(name, ok, a, b)`` runs one of the emulator's own controls (csrc/emulate/selftest.cpp).
``register()`` makes the attention, varlen_attention and paged_attention ops the backend
``"cuda_emulated"``. It needs the CUDA headers (cuda_fp16.h, cuda_runtime.h; no GPU, no CUDA
library is linked) and raises :class:`EmulatorUnavailable` without them.
"""

from __future__ import annotations

import functools
import os
import shutil

ROOT = os.path.dirname(os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
SOURCES = [os.path.join(ROOT, "csrc", "emulate", f"{name}.cpp")
           for name in ("module", "attention", "varlen", "paged", "softmax", "layer_norm", "ffn",
                        "rope", "selftest")]


class EmulatorUnavailable(RuntimeError):
    """The sources or the CUDA headers are not on this machine."""


def cuda_include_dir() -> str:
    """The CUDA toolkit's include directory (the one holding cuda_fp16.h)."""
    from torch.utils.cpp_extension import CUDA_HOME

    homes = [CUDA_HOME, os.environ.get("CUDA_HOME")]
    nvcc = shutil.which("nvcc")
    if nvcc is not None:
        homes.append(os.path.dirname(os.path.dirname(os.path.realpath(nvcc))))
    homes.append("/usr/local/cuda")
    for home in filter(None, homes):
        inc = os.path.join(home, "include")
        if os.path.isfile(os.path.join(inc, "cuda_fp16.h")):
            return inc
    raise EmulatorUnavailable("no CUDA toolkit headers (cuda_fp16.h) found: set CUDA_HOME")


@functools.lru_cache(maxsize=None)
def load(verbose: bool = False):
    """Builds (or reuses) the emulated module and returns it."""
    missing = [s for s in SOURCES if not os.path.isfile(s)]
    if missing:
        raise EmulatorUnavailable(f"{missing[0]} is not there (an installed wheel has no csrc/)")
    from torch.utils.cpp_extension import is_ninja_available, load as load_extension

    if not is_ninja_available():
        raise EmulatorUnavailable("torch builds the emulated module with ninja: pip install ninja")

    build = os.path.join(ROOT, "build", "emulate")
    os.makedirs(build, exist_ok=True)
    return load_extension(
        name="fastattn_cuda_emulated",
        sources=SOURCES,
        extra_include_paths=[os.path.join(ROOT, "csrc", "include"), cuda_include_dir()],
        # -O1: the nine files took 161 s on 2 cores, the tests then ~55 s (2026-11-29; 390 s
        # while the sources included <torch/extension.h> instead of torch's pybind header).
        extra_cflags=["-O1", "-std=c++17", "-Wno-unknown-pragmas"],
        build_directory=build,
        verbose=verbose,
    )


BACKEND = "cuda_emulated"


def _attention_function():
    import torch

    class EmulatedAttention(torch.autograd.Function):
        """The emulated cuda attention ops under autograd: the backward is attention_bwd's three
        kernels; a float mask (a (B, H, Lq, Lk) view) gets dS, summed back by the view's own
        autograd."""

        @staticmethod
        def forward(ctx, q, k, v, mask, scale, offset, left, right, dropout_p, seed):
            out, lse = load().attention_fwd(q, k, v, mask, scale, offset, left, right, dropout_p,
                                            seed)
            ctx.save_for_backward(q, k, v, mask, out, lse)
            ctx.args = (scale, offset, left, right, dropout_p, seed)
            ctx.mark_non_differentiable(lse)
            return out, lse

        @staticmethod
        def backward(ctx, dout, _dlse):
            q, k, v, mask, out, lse = ctx.saved_tensors
            need_dmask = bool(ctx.needs_input_grad[3])
            dq, dk, dv, dmask = load().attention_bwd(dout.contiguous(), q, k, v, out, lse, mask,
                                                     *ctx.args, need_dmask)
            return dq, dk, dv, dmask if need_dmask else None, *([None] * 6)

    return EmulatedAttention


def _varlen_function():
    import torch

    from fastattn.ops import varlen
    from fastattn.ops._library import Compiled

    class EmulatedVarlen(torch.autograd.Function):
        """The emulated varlen_attention ops under the registered op's own autograd formula
        (fastattn/ops/varlen.py)."""

        @staticmethod
        def forward(ctx, *inputs):
            out, lse = load().varlen_attention_fwd(*inputs)
            varlen._setup_context(ctx, inputs, (out, lse))
            ctx.mark_non_differentiable(lse)
            return out, lse

        @staticmethod
        def backward(ctx, dout, dlse):
            return varlen._backward(Compiled(None, load().varlen_attention_bwd), ctx, dout, dlse)

    return EmulatedVarlen


@functools.lru_cache(maxsize=None)
def register() -> str:
    """Registers the emulated kernels as the backend ``"cuda_emulated"`` of attention and
    varlen_attention (CPU tensors, float16 / bfloat16), so that tests written against
    ``fastattn.attention(..., backend=...)`` run the cuda backend's device code on the host;
    returns the name. Builds the module first."""
    import torch

    from fastattn import backends

    kernels = load()
    for op, fn in (("attention", _attention_function().apply),
                   ("varlen_attention", _varlen_function().apply),
                   ("paged_attention", kernels.paged_attention_fwd)):  # (forward only)
        backends.register_backend(op, BACKEND, fn, devices=("cpu",),
                                  dtypes=(torch.float16, torch.bfloat16))
    return BACKEND
