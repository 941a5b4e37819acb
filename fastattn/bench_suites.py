"""The benchmark cases and providers of each op, shared by ``fastattn bench`` and ``bench/``.

A suite is ``suite(device, dtype, modes, quick) -> (providers, cases)``. Providers are named
``fastattn-<backend>`` for our backends, ``naive`` for the eager baseline, and ``torch...`` for
PyTorch's own implementations (the peers whose best time gives the ``x torch`` column).
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.nn.functional as F

import fastattn
from fastattn import backends, reference
from fastattn.bench import Case
from fastattn.testing import to_numpy


def fastattn_backends(op: str, device: torch.device) -> list[str]:
    """Our compiled backends that run ``op`` at full speed on ``device`` (not the interpreter)."""
    names = []
    for name in fastattn.available_backends():
        if name == "naive" or name not in backends.implementations(op):
            continue
        if device.type not in backends._REGISTRY[name].devices:
            continue
        if name == "triton" and device.type != "cuda":
            continue  # the Triton interpreter is a test tool, far too slow to time
        names.append(name)
    return names


def layer_norm_suite(device: torch.device, dtype: torch.dtype, modes, quick: bool):
    if device.type == "cuda":
        shapes = [(4096, 1024), (4096, 4096), (4096, 8192), (2048, 16384), (512, 65536)]
    else:
        shapes = [(4096, 256), (2048, 1024), (256, 8192)]
    if quick:
        shapes = shapes[:2]

    def naive(x, w, b):
        return fastattn.layer_norm(x, x.shape[-1:], w, b, backend="naive")

    providers: dict[str, Callable] = {
        f"fastattn-{name}": (lambda name: lambda x, w, b: fastattn.layer_norm(x, x.shape[-1:], w, b, backend=name))(name)
        for name in fastattn_backends("layer_norm", device)
    }
    providers["naive"] = naive
    providers["torch"] = lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b)
    if not quick or device.type == "cuda":
        providers["torch.compile(naive)"] = torch.compile(naive, dynamic=False)

    cases = []
    elt = torch.empty(0, dtype=dtype).element_size()
    for m, n in shapes:
        for mode in modes:
            traffic = {"fwd": 2, "bwd": 3, "fwd_bwd": 5}[mode] * m * n * elt

            def make(m=m, n=n, mode=mode):
                grad = mode != "fwd"
                x = torch.randn(m, n, device=device, dtype=dtype, requires_grad=grad)
                w = torch.randn(n, device=device, dtype=dtype, requires_grad=grad)
                b = torch.randn(n, device=device, dtype=dtype, requires_grad=grad)
                return x, w, b

            def ref(x, w, b):
                return reference.layer_norm(to_numpy(x), x.shape[-1:], to_numpy(w), to_numpy(b))[0]

            cases.append(Case("layer_norm", f"{m}x{n}", dtype, mode, make, bytes=traffic, reference=ref))
    return providers, cases


SUITES = {"layer_norm": layer_norm_suite}
