"""bench/triton_bounds.py: every load and store of an interpreted Triton kernel checked against its
tensor arguments' storages, and the attention kernels run with it at the H100's tile sizes.

The case is test_combinations' seed 0 (bf16, D 100, Dv 1, (B, L, H, D) layout, causal window,
full bool mask with a fully masked row), which met "an illegal memory access" in the forward on
an H100 (2026-11-27): every forward, dK/dV and dQ config the pruners keep there runs in bounds
under the interpreter, fast path and careful path. CPU only (the check patches the interpreter).
"""

import importlib.util
from pathlib import Path

import pytest
import torch

pytestmark = pytest.mark.skipif(torch.cuda.is_available(),
                                reason="checks the Triton interpreter (CPU only)")

ROOT = Path(__file__).resolve().parents[1]
_spec = importlib.util.spec_from_file_location("triton_bounds", ROOT / "bench" / "triton_bounds.py")
bounds = importlib.util.module_from_spec(_spec)
_spec.loader.exec_module(bounds)

import triton  # noqa: E402
import triton.language as tl  # noqa: E402



@triton.jit
def _off_by_one(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.arange(0, BLOCK)
    x = tl.load(X + offs, mask=offs <= n, other=0.0)   # one element past the end
    tl.store(Y + offs - 1, x, mask=offs < n)           # one element before the start


def test_checker_reports_accesses_outside_the_arguments():
    x, y = torch.arange(10, dtype=torch.float32), torch.zeros(10)
    with bounds.BoundsChecker(source_dir=Path(__file__).parent) as check:
        _off_by_one[(1,)](x, y, 10, BLOCK=16)
    found = {v.op: v for v in check.violations}
    assert set(found) == {"load", "store"}, check.report()
    assert found["load"].lanes == 1 and "X (float32, 40 B)" in found["load"].examples[0]
    assert "4 B past its end" in found["load"].examples[0]
    assert "4 B before its start" in found["store"].examples[0]
    assert "test_triton_bounds.py" in found["load"].where
    # the out-of-bounds lanes were dropped: nothing outside y was written, x[10] read as 0
    assert torch.equal(y[:9], x[1:10])


def test_attention_seed0_as_it_faulted_is_in_bounds(monkeypatch):
    """The forward launch that faulted on the H100 (2026-11-27), as it was: config 64x64 w4s3
    (not kept since), on the caller's mask with its unaligned rows (copied since)."""
    from fastattn.kernels import attention_launch
    monkeypatch.setattr(attention_launch, "ALIGN_MASK", False)
    c, check, record = bounds.run_attention(0, forward_only=True, pick="64x64 w4s3")
    assert [r.config for r in record] == ["64x64 w4s3 ptr"]
    assert not check.violations, check.report()
    assert not [r for r in record if r.unwritten], record


@pytest.mark.parametrize("careful", [False, True], ids=["fast", "careful"])
def test_attention_seed0_in_bounds_at_h100_configs(careful):
    """Forward and backward; the fast path at every config the H100 pruners keep (not the
    interpreter's single 16 x 16 one), every block's careful path at the first (the one the
    GPU test suite runs, FASTATTN_AUTOTUNE=0)."""
    c, check, record = bounds.run_attention(0, only_first=careful, careful=careful)
    assert c["D"] == 100 and c["Dv"] == 1 and c["mask"] == "bool"
    fwd = [r.config for r in record if r.kernel == "_attn_fwd_kernel"]
    # (64x64 w4s3, which faulted on the H100, is no longer kept at head dim 100: it spilled)
    assert fwd[0] == "64x64 w8s2 ptr" and len(fwd) == (1 if careful else 4), fwd
    kernels = {r.kernel for r in record}
    assert kernels == {"_attn_fwd_kernel", "_attn_bwd_dkdv_kernel", "_attn_bwd_dq_kernel"}
    assert not check.violations, check.report()
    assert not check.undefined_other, check.report()
    assert not [r for r in record if r.unwritten], record
