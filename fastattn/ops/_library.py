"""Registering fastattn's ops with torch.library: one helper for each way an op is defined.

Every compiled op has a schema (C++ ops: csrc/fastattn.cpp; Triton ops: the annotated Python
function), a fake implementation (output shapes for torch.compile / meta tensors) and an autograd
formula. The C++ op ``fastattn::<op>`` and its Triton twin ``fastattn::triton_<op>`` share the
same schema, so one fake function and one autograd formula serve both.
"""

from __future__ import annotations

from typing import Callable

import torch
import torch.autograd.forward_ad as fwAD

from fastattn import _extension
from fastattn.backends import interpreting


def triton_op(name: str, fake: Callable) -> Callable[[Callable], Callable]:
    """Register the decorated launcher wrapper as the op ``fastattn::<name>``.

    On a GPU this is ``torch.library.triton_op``: torch.compile traces into the Triton kernels
    (launched through ``wrap_triton``) without a graph break. Under the Triton interpreter
    (TRITON_INTERPRET=1, CPU tensors) kernels cannot run on fake tensors, so the op is an opaque
    ``custom_op`` with ``fake`` as its fake implementation; behaviour in eager mode is the same.
    """

    def register(fn: Callable) -> Callable:
        qualname = f"fastattn::{name}"
        if interpreting():
            op = torch.library.custom_op(qualname, fn, mutates_args=())
            op.register_fake(fake)
            return op
        return torch.library.triton_op(qualname, fn, mutates_args=())

    return register


def cpp_op(name: str, fake: Callable) -> Callable | None:
    """The C++ op ``fastattn::<name>`` with ``fake`` registered, or None without the extension."""
    if not _extension.loaded():
        return None
    torch.library.register_fake(f"fastattn::{name}", fake)
    return getattr(torch.ops.fastattn, name).default


def cpp_backends(name: str) -> list[str]:
    """The backends (``cpu``, ``cuda``) for which the extension has a kernel of ``fastattn::<name>``
    (none when the extension, e.g. one built from older sources, does not define the op)."""
    if not _extension.loaded() or not hasattr(torch.ops.fastattn, name):
        return []
    keys = (("cpu", "CPU"), ("cuda", "CUDA"))
    return [b for b, key in keys if torch._C._dispatch_has_kernel_for_dispatch_key(f"fastattn::{name}", key)]


def last_dim_contiguous(t: torch.Tensor | None) -> torch.Tensor | None:
    """``t`` with stride 1 in its last dim, as kernels require. Autograd may hand backward a
    broadcast gradient (e.g. of ``y.sum()``, strides all 0); that one is materialized here."""
    return t if t is None or t.stride(-1) == 1 else t.contiguous()


def empty_or_none(t: torch.Tensor) -> torch.Tensor | None:
    """Ops return empty tensors for outputs that were not asked for; autograd wants None."""
    return None if t.numel() == 0 else t


def forward_ad_needs(*tensors: torch.Tensor | None) -> tuple[str, ...]:
    """``("jvp",)`` when forward-mode AD is on for any of ``tensors`` (a dual tensor of
    torch.autograd.forward_ad, an input of torch.func.jvp / jacfwd), else ``()``: what
    ``backends.select(..., needs=...)`` is asked for, so that a backend without forward mode for
    the op is refused (named) or passed over (automatic choice). Never under torch.compile."""
    if torch.compiler.is_compiling():
        return ()
    if any(t is not None and fwAD.unpack_dual(t).tangent is not None for t in tensors):
        return ("jvp",)
    return ()
