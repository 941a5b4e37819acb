"""Loads the compiled extension fastattn._C, which registers the C++/CUDA ops with torch.

Importing fastattn works without it: the ``cpu`` and ``cuda`` backends then report themselves
unavailable with the reason recorded here.
"""

import importlib

import torch  # noqa: F401  (loads libtorch, which the extension links against)

try:
    _MODULE = importlib.import_module("fastattn._C")  # importing registers the ops
    _ERROR = None
except ImportError as exc:
    _MODULE = None
    _ERROR = (
        f"the extension fastattn._C is not built ({exc}); "
        "build it with: pip install --no-build-isolation -e ."
    )


def loaded() -> bool:
    return _ERROR is None


def eager_function(name: str):
    """The extension's eager fast path of the public function ``name`` (csrc/eager.cpp), or None
    (no extension, or one built before it had that function)."""
    return getattr(_MODULE, name, None)


def eager_trains(name: str) -> bool:
    """Whether the extension's eager fast path of ``name`` also takes calls that record a graph
    (csrc/eager.cpp: its training path, a C++ autograd node)."""
    return name in getattr(_MODULE, "TRAINING", ())


def cpu_choices() -> dict[str, str] | None:
    """The cpu backend's kernel choices that depend on this CPU and on the FASTATTN_CPU_*
    variables (csrc/include/fastattn/cpu_choices.h), as they stand now: ``isa`` (avx512 / avx2 /
    default), ``attention_plain_forward`` (torch / fastattn), ``ffn_bfloat16_matmuls`` and
    ``ffn_float16_matmuls`` (float32, or the dtype itself). None without the extension."""
    fn = getattr(_MODULE, "cpu_choices", None)
    return None if fn is None else dict(fn())


def error() -> str | None:
    """None when the extension is loaded, else why it is not."""
    return _ERROR
