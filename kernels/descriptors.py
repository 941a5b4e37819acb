"""When the Triton kernels read their tiles through tensor descriptors (TMA) and warp-specialize
their loops: one policy for every launcher.

* ``TMA`` (FASTATTN_TRITON_TMA: auto, 1, 0) and :func:`use_tma`: the descriptor path is taken on
  compute capability >= 9 when the installed Triton has ``tl.make_tensor_descriptor``, the
  tensors are 16-bit (float32 only when forced), 16-byte aligned (base and walked strides) and
  torch.compile is not tracing;
* ``WARP_SPECIALIZE`` (FASTATTN_TRITON_WS: 0, 1) and :func:`warp_specialize_ok`: warp-specialized
  configs are autotuned only when asked for (``1``), on Hopper and newer, with a Triton whose
  ``tl.range`` takes ``warp_specialize``. Off by default, and a warning when turned on: every
  warp-specialized config gives wrong outputs on Hopper with Triton 3.6 (errors 0.4-0.6 at D64
  and D128 on an H100, 2026-11-26, where every plain config was right; first seen as the H200's
  wrong autotuned D128 forward; bench/results/gpu-notes.md). The switch stays for work on that
  loop;
* :func:`launch`: should the installed Triton fail to build or run either feature on this GPU,
  the feature is switched off for the process (``disabled``, :func:`tma_status`) and the launch
  repeated on the pointer path, which computes the same result;
* device-side descriptors need global scratch memory: a torch allocator is installed for Triton
  before each such launch.
"""

import inspect
import logging
import os
import warnings

import torch
import triton
import triton.language as tl
from triton.runtime.errors import OutOfResources
from torch._subclasses.fake_tensor import is_fake

from . import tuning

#: Whether the installed Triton builds tensor descriptors in kernels / warp-specializes loops.
HAS_DESCRIPTORS = hasattr(tl, "make_tensor_descriptor")
HAS_WARP_SPECIALIZE = "warp_specialize" in inspect.signature(tl.range.__init__).parameters

_log = logging.getLogger(__name__)

#: When the kernels read q/k/v/dO tiles through tensor descriptors (USE_TMA): ``"auto"`` on
#: Hopper and newer GPUs; ``"1"`` wherever the installed Triton has ``tl.make_tensor_descriptor``
#: (older GPUs get it lowered to plain loads; the interpreter runs it, which is how the tests
#: check this path on CPU); ``"0"`` never. Set from FASTATTN_TRITON_TMA at import; assignable.
TMA = os.environ.get("FASTATTN_TRITON_TMA", "auto")

#: Whether warp-specialized forward configs are autotuned ("1") or not ("0", the default until
#: a GPU run shows them right: see the module docstring). Set from FASTATTN_TRITON_WS at
#: import; assignable.
WARP_SPECIALIZE = os.environ.get("FASTATTN_TRITON_WS", "0")

# Features the installed Triton failed to build on this machine ("warp_specialize", "tma"),
# with the error; each is tried once per process.
disabled = {}


def tma_mode():
    """TMA, checked: "auto", "0" or "1"."""
    mode = str(TMA).strip().lower()
    if mode not in ("auto", "0", "1"):
        raise ValueError(f"FASTATTN_TRITON_TMA (kernels.descriptors.TMA) must be auto, 0 or 1, "
                         f"got {TMA!r}")
    return mode


def hopper_or_newer():
    return tuning.capability()[0] >= 9


def tma_aligned(x):
    """TMA reads need a 16-byte aligned base, 16-byte multiples as strides of the dimensions
    that are walked, a positive row stride (it goes into the descriptor; a broadcast gradient
    has 0) and a unit stride on the last dimension."""
    size = x.element_size()
    if x.stride(-1) != 1 or x.stride(-2) <= 0 or x.data_ptr() % 16:
        return False
    return all(stride * size % 16 == 0 for d, stride in enumerate(x.stride()[:-1])
               if d == x.dim() - 2 or x.shape[d] > 1)


def tma_for(device_type):
    """Whether aligned tensors on this kind of device take the descriptor path (see TMA)."""
    mode = tma_mode()
    if mode == "0" or not HAS_DESCRIPTORS or "tma" in disabled:
        return False
    return mode == "1" or (device_type == "cuda" and not tuning.INTERPRET and hopper_or_newer())


def traced(*tensors):
    """Whether this launch is being traced rather than run: under torch.compile, or on fake
    tensors (opcheck, make_fx), where sizes, strides and pointers are symbolic or absent."""
    return torch.compiler.is_compiling() or any(is_fake(t) for t in tensors)


def use_tma(*tensors):
    """Whether a launch on these (B, H, L, D) tensors takes the descriptor path. Never while
    torch.compile traces (the compiled graph launches the pointer kernels), nor for float32 unless
    TMA is "1": its IEEE dots are FMA loops, and on sm_90 every small float32 tile tried on the
    descriptor path spilled 0.3-58 KB at head dims >= 80 (dQ at 64 too), where the
    pointer path has configs that do not spill at all (bench/aot/README.md)."""
    if not tma_for(tensors[0].device.type):
        return False
    if tensors[0].dtype == torch.float32 and tma_mode() == "auto":
        return False
    if traced(*tensors):
        return False
    return all(tma_aligned(t) for t in tensors)


def warp_specialize_ok():
    """Warp-specialized forward configs are autotuned only when WARP_SPECIALIZE is "1", on
    Hopper and newer, with a Triton whose ``tl.range`` takes ``warp_specialize`` and that has
    not failed to build them here."""
    return (ws_asked() and HAS_WARP_SPECIALIZE and "warp_specialize" not in disabled
            and hopper_or_newer())


def ws_asked():
    """WARP_SPECIALIZE, checked: whether warp-specialized configs are asked for (with a
    warning, once per process: they are known to compute wrong results, module docstring)."""
    mode = str(WARP_SPECIALIZE).strip()
    if mode not in ("0", "1"):
        raise ValueError(f"FASTATTN_TRITON_WS (kernels.descriptors.WARP_SPECIALIZE) must be 0 or "
                         f"1, got {WARP_SPECIALIZE!r}")
    if mode == "1":
        warnings.warn("FASTATTN_TRITON_WS=1: the warp-specialized attention forward gives wrong "
                      "results on Hopper with Triton 3.6 (H100 and H200 runs, 2026-11-26); use it "
                      "only to work on that loop", RuntimeWarning, stacklevel=2)
    return mode == "1"


def tma_status():
    """What the descriptor path does on this machine: the mode, whether the installed Triton
    has descriptors and warp specialization, the path that aligned GPU inputs take
    (``"tma"`` or ``"pointer"``), and the features switched off after a failure (with why)."""
    return {
        "mode": tma_mode(),
        "descriptors": HAS_DESCRIPTORS,
        "warp_specialize": HAS_WARP_SPECIALIZE,
        "warp_specialize_on": ws_asked(),
        "default_path": "tma" if tma_for("cuda") else "pointer",
        "disabled": dict(disabled),
    }


def _scratch(size, alignment, stream):
    return torch.empty(size, dtype=torch.int8, device="cuda")


def _ensure_allocator():
    """Device-side descriptors live in global scratch memory that Triton asks its allocator
    for. Install a torch one unless one is set; the setting is per thread context, and
    autograd runs backward on a thread of its own, so this runs before every such launch."""
    from triton.runtime import _allocation
    current = getattr(_allocation, "_allocator", None)
    null = getattr(_allocation, "NullAllocator", None)
    if current is None or null is None or isinstance(current.get(), null):
        triton.set_allocator(_scratch)


def launch(run, tma, ws_candidate=False):
    """``run(use_tma)``, on the descriptor path when ``tma``. Should the installed Triton
    fail to build or run that on this GPU, the feature at fault (warp specialization when it
    was a candidate, else descriptors) is switched off for the process, logged once at debug
    level (and shown by :func:`tma_status`), and the launch repeated; the pointer path computes
    the same result. A config over the GPU's resources (``OutOfResources``: shared memory,
    registers) is the pruner's fault, not the feature's: it is raised as it is. (Autotuning
    skips such configs itself; with autotuning off one used to switch descriptors off for the
    whole process, silently.)"""
    while tma and "tma" not in disabled:
        if torch.cuda.is_available() and not tuning.INTERPRET:
            _ensure_allocator()
        try:
            run(True)
            return
        except OutOfResources:
            raise
        except Exception as exc:  # noqa: BLE001 - any build/launch failure of this path
            ws_tried = ws_candidate and warp_specialize_ok()
            feature = "warp_specialize" if ws_tried else "tma"
            disabled[feature] = f"{type(exc).__name__}: {exc}"[:500]
            _log.debug("triton: %s switched off after %s", feature, disabled[feature])
    run(False)
