"""Building your own kernels on fastattn: where its C++ headers are, and a JIT build helper.

fastattn's C++ headers (``csrc/include/fastattn/*.h``, ``*.cuh``) hold the argument checks,
dtype dispatch macros and CUDA helpers its own kernels use (``common.h``: ``check_rows``,
``check_float_dtype``, ``FASTATTN_DISPATCH_FLOATING_HALF_BF16`` ...; ``cuda_helpers.cuh``: vector
loads, warp and block reductions, mask reading; ``rng.h``: the dropout RNG). An extension of
your own can include them::

    from torch.utils.cpp_extension import load
    import fastattn.extending

    load("myext", ["myext.cpp"], extra_include_paths=fastattn.extending.include_paths(),
         is_python_module=False)     # registers the ops of its TORCH_LIBRARY(myext, m) block

or, with the same flags fastattn is built with, ``fastattn.extending.load("myext", ["myext.cpp"])``.
Then register the op as a backend of a fastattn op with :func:`fastattn.register_backend`
(``docs/extending.md`` walks through a whole op).

The headers are found in an installed package (``fastattn/include``, shipped as package data)
and in a source checkout or editable install (``csrc/include`` next to the package); the
environment variable ``FASTATTN_INCLUDE_DIR`` overrides both.
"""

from __future__ import annotations

import importlib.util
import os
import sys
from pathlib import Path
from typing import Any, Sequence

__all__ = ["DEFAULT_CFLAGS", "DEFAULT_CUDA_CFLAGS", "DEFAULT_LDFLAGS", "extension_include_dir",
           "include_paths", "load"]

_MARKER = os.path.join("fastattn", "common.h")

#: Host compiler flags fastattn's own extension is built with (setup.py). ``-g0`` undoes the
#: ``-g`` that Python's own CFLAGS put in every setuptools build: with debug information
#: csrc/cpu/attention.cpp took 160 s to compile instead of 122 and its object was 23 MB instead
#: of 1.6 (2026-11-28, 2 cores); FASTATTN_DEBUG_INFO=1 keeps it. ``-O3``, not ``-O2``: -O2 built
#: in 248 s instead of 369 on 2 cores, but paged decode ran at 0.55x, layer norm's forward at
#: 0.80x and the JVP at 0.84x against torch what -O3 reaches (GCC 12, 2026-11-29).
DEFAULT_CFLAGS = (("-O3", "-std=c++17")
                  + (("-fopenmp",) if sys.platform.startswith("linux") else ())
                  + (() if os.environ.get("FASTATTN_DEBUG_INFO") == "1" else ("-g0",)))
#: nvcc flags fastattn's own extension is built with (setup.py).
DEFAULT_CUDA_CFLAGS = ("-O3", "-std=c++17", "--use_fast_math", "-lineinfo", "--expt-relaxed-constexpr")
#: Linker flags fastattn's own extension is built with (setup.py). On Linux, besides OpenMP,
#: the shared C++ runtime by its file name, the one torch uses, even where the compiler would
#: link a copy of its own in. The GPU image of 2026-11-26 has such a compiler as CXX: a GCC
#: relocated under /opt/gcc whose library path holds libstdc++.a and no libstdc++.so, so its
#: ``-lstdc++`` links the runtime statically (``-lstdc++`` again, or ``-Bdynamic`` around it,
#: does the same). With a copy inside the library, each C++ exception thrown from it (every
#: TORCH_CHECK: a user's bad input) crashed the process (signal 11); ``-l:libstdc++.so.6``
#: resolves the runtime's symbols first, so the static copy is never linked in.
DEFAULT_LDFLAGS = ("-fopenmp", "-l:libstdc++.so.6") if sys.platform.startswith("linux") else ()


def _candidates() -> list[Path]:
    package = Path(__file__).resolve().parent
    found = []
    env = os.environ.get("FASTATTN_INCLUDE_DIR")
    if env:
        found.append(Path(env))
    found.append(package / "include")  # installed: package data
    spec = importlib.util.find_spec("fastattn.include")  # an editable install may map it elsewhere
    if spec is not None and spec.submodule_search_locations:
        found.extend(Path(p) for p in spec.submodule_search_locations)
    found.append(package.parent / "csrc" / "include")  # source checkout / editable install
    return found


def extension_include_dir() -> str:
    """The directory holding fastattn's C++ headers: ``#include "fastattn/common.h"`` resolves
    against it. Raises FileNotFoundError (listing where it looked) when the headers are missing."""
    tried = _candidates()
    for path in tried:
        if (path / _MARKER).is_file():
            return str(path)
    raise FileNotFoundError(
        "fastattn's C++ headers (fastattn/common.h) were not found; looked in: "
        + ", ".join(str(p) for p in tried)
        + ". Install fastattn from a source checkout (pip install -e .) or a build that ships "
        "fastattn/include, or set FASTATTN_INCLUDE_DIR."
    )


def include_paths() -> list[str]:
    """fastattn's header directories, for ``extra_include_paths=`` of
    :func:`torch.utils.cpp_extension.load` (torch's own are added by torch)."""
    return [extension_include_dir()]


def load(
    name: str,
    sources: Sequence[str | os.PathLike],
    *,
    extra_include_paths: Sequence[str] = (),
    extra_cflags: Sequence[str] | None = None,
    extra_cuda_cflags: Sequence[str] | None = None,
    extra_ldflags: Sequence[str] | None = None,
    is_python_module: bool = False,
    **kwargs: Any,
) -> Any:
    """JIT-compile and load a C++/CUDA extension against fastattn's headers.

    :func:`torch.utils.cpp_extension.load` with fastattn's include path and compiler flags
    (:data:`DEFAULT_CFLAGS`, :data:`DEFAULT_CUDA_CFLAGS`, :data:`DEFAULT_LDFLAGS`) unless given. With
    ``is_python_module=False`` (the default here) the library is loaded as a plain shared
    library, so an extension that only registers ops with ``TORCH_LIBRARY`` needs no Python
    module init; its ops appear under ``torch.ops.<namespace>``. Other keyword arguments
    (``build_directory``, ``verbose`` ...) go to torch unchanged.
    """
    from torch.utils.cpp_extension import load as torch_load

    return torch_load(
        name,
        [str(s) for s in sources],
        extra_include_paths=[*include_paths(), *extra_include_paths],
        extra_cflags=list(DEFAULT_CFLAGS if extra_cflags is None else extra_cflags),
        extra_cuda_cflags=list(DEFAULT_CUDA_CFLAGS if extra_cuda_cflags is None else extra_cuda_cflags),
        extra_ldflags=list(DEFAULT_LDFLAGS if extra_ldflags is None else extra_ldflags),
        is_python_module=is_python_module,
        **kwargs,
    )
