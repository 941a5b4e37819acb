"""Helpers to test an op against a float64 reference, with the package's tolerance policy.

Policy: an output in dtype ``d`` passes when its largest error against the float64 reference is at
most ``factor`` times the error of PyTorch's own implementation in dtype ``d`` (the *baseline*,
computed from the same inputs) plus a small absolute slack ``ATOL[d]``. Without a baseline the
allowed error is ``RTOL[d] * max|reference| + ATOL[d]``.
"""

from __future__ import annotations

import contextlib
from typing import Iterator

import numpy as np
import torch

ATOL = {
    torch.float64: 1e-10,
    torch.float32: 2e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 2e-2,
}
RTOL = {
    torch.float64: 1e-10,
    torch.float32: 1e-5,
    torch.float16: 2e-3,
    torch.bfloat16: 1.6e-2,
}


def to_numpy(t) -> np.ndarray:
    """A tensor (any dtype, any device, with or without grad) or array as a float64 NumPy array."""
    if isinstance(t, torch.Tensor):
        return t.detach().to("cpu", torch.float64).numpy()
    return np.asarray(t, dtype=np.float64)


def max_error(actual, reference) -> float:
    a, r = to_numpy(actual), to_numpy(reference)
    if a.shape != r.shape:
        raise AssertionError(f"shape {a.shape} differs from the reference's {r.shape}")
    if a.size == 0:
        return 0.0
    same_inf = np.isinf(a) & np.isinf(r) & (np.sign(a) == np.sign(r))
    with np.errstate(invalid="ignore"):
        return float(np.max(np.where(same_inf, 0.0, np.abs(a - r))))


def assert_close_to_reference(
    actual: torch.Tensor,
    reference,
    baseline: torch.Tensor | None = None,
    *,
    factor: float = 2.0,
    atol: float | None = None,
    name: str = "output",
) -> None:
    """Assert ``actual`` is as close to the float64 ``reference`` as the policy above allows."""
    dtype = actual.dtype
    slack = ATOL.get(dtype, 1e-5) if atol is None else atol
    a = to_numpy(actual)
    if np.isnan(a).any():
        raise AssertionError(f"{name} holds NaN at {np.argwhere(np.isnan(a))[:5].tolist()}")
    err = max_error(actual, reference)
    if baseline is not None:
        allowed = factor * max_error(baseline, reference) + slack
        rule = f"{factor} x torch's error + {slack:g}"
    else:
        ref = to_numpy(reference)
        finite = np.abs(ref[np.isfinite(ref)])
        scale = float(finite.max()) if finite.size else 0.0
        allowed = RTOL.get(dtype, 1e-5) * scale + slack
        rule = f"rtol {RTOL.get(dtype, 1e-5):g} x {scale:.3g} + {slack:g}"
    if not err <= allowed:
        raise AssertionError(f"{name} ({dtype}): max error {err:.3g} > allowed {allowed:.3g} ({rule})")


@contextlib.contextmanager
def poisoned_outputs() -> Iterator[None]:
    """Fill every newly allocated uninitialized tensor with NaN (torch.empty and C++ at::empty
    alike), so a kernel that leaves part of its output unwritten fails the NaN check."""
    det, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    fill = torch.utils.deterministic.fill_uninitialized_memory
    torch.use_deterministic_algorithms(True, warn_only=True)
    torch.utils.deterministic.fill_uninitialized_memory = True
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(det, warn_only=warn)
        torch.utils.deterministic.fill_uninitialized_memory = fill
