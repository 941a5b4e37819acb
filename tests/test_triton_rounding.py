"""Triton under the CPU interpreter behaves as compiled Triton where the suite relies on it.

Its float32 -> bfloat16 / float16 conversions round as torch's do, bit for bit. On a GPU this
checks the compiled conversion; under the interpreter it checks the suite's fix of the
interpreter's (fastattn.testing.round_bf16_in_interpreter, installed by conftest.py), without
which every bfloat16 output of a Triton kernel is truncated. And a launch keyword the kernel
does not take is refused, as compiled Triton refuses it (strict_launches_in_interpreter).
"""

import numpy as np
import pytest
import torch

from conftest import DEVICE

triton = pytest.importorskip("triton")
tl = triton.language


@triton.jit
def _cast_kernel(X, Y, n, BLOCK: tl.constexpr):
    offs = tl.program_id(0) * BLOCK + tl.arange(0, BLOCK)
    ok = offs < n
    tl.store(Y + offs, tl.load(X + offs, mask=ok).to(Y.dtype.element_ty), mask=ok)


def _boundaries():
    """Every bfloat16 value as float32, with the float32 values at, just under and just over the
    midpoints between neighbours (the ties and the last values before them), NaN payloads,
    infinities, subnormals and values that round over to infinity."""
    bits = np.arange(1 << 16, dtype=np.uint32) << 16
    half_ulp = np.uint32(1 << 15)
    cases = [bits, bits + half_ulp, bits + half_ulp - 1, bits + half_ulp + 1, bits + 1, bits - 1]
    x = np.concatenate(cases).view(np.float32)
    return torch.from_numpy(x.copy())


@pytest.mark.parametrize("dtype", [torch.bfloat16, torch.float16])
def test_float32_casts_round_like_torch(dtype):
    x = _boundaries().to(DEVICE)
    y = torch.empty(x.shape, dtype=dtype, device=DEVICE)
    _cast_kernel[(triton.cdiv(x.numel(), 4096),)](x, y, x.numel(), BLOCK=4096)
    want = x.to(dtype)
    nan = torch.isnan(want)
    assert torch.equal(torch.isnan(y), nan)
    same = (y.view(torch.int16) == want.view(torch.int16)) | nan
    bad = (~same).nonzero().flatten()[:5].tolist()
    assert not bad, [(x[i].item(), y[i].item(), want[i].item()) for i in bad]



def test_a_launch_keyword_the_kernel_lacks_is_refused():
    """Compiled Triton refuses a keyword that is neither a kernel parameter nor a compile option
    (a KeyError at launch); under the interpreter the suite holds it to the same rule
    (fastattn.testing.strict_launches_in_interpreter), so a config made for another kernel
    fails on the CPU too. Parameters and options (num_warps, maxnreg, ...) still pass."""
    x = torch.zeros(8, device=DEVICE)
    y = torch.empty(8, dtype=torch.bfloat16, device=DEVICE)
    _cast_kernel[(1,)](x, y, 8, BLOCK=8, num_warps=4, num_stages=1)
    with pytest.raises(KeyError, match="WARP_SPECIALIZE"):
        _cast_kernel[(1,)](x, y, 8, BLOCK=8, WARP_SPECIALIZE=False)
