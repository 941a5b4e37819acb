"""CI (the Hopper gate's venv: Triton as on the GPU image, not interpreted): in plain eager mode
fastattn's Triton ops launch their kernels directly, never through ``torch.library.wrap_triton``'s
traced path. With wrapping on, each launch runs torch's higher-order-op machinery: 86-100 us a
launch on the CPU of this project's VM against 1-3 us for a direct one (Triton 3.6, torch 2.13,
2026-11-26), i.e. several times a small kernel's GPU time. ``triton_op`` turns wrapping off
around its own function, which the eager fast path calls (fastattn/ops/_library.py,
``op_callable``); this holds that path to it, forward and backward, with the kernel launches
stubbed (no GPU here): launches must happen, and none through the wrapper.
"""

import os
import sys

os.environ["FASTATTN_NO_EXTENSION"] = "1"  # (the registered Triton ops alone)
os.environ["FASTATTN_AUTOTUNE"] = "0"

import torch  # noqa: E402
import torch._higher_order_ops.triton_kernel_wrap as wrap  # noqa: E402
from torch._library.triton import triton_ops_to_kernels  # noqa: E402
from triton.runtime.jit import JITFunction  # noqa: E402

# The Triton ops register as on a GPU machine, through torch.library.triton_op (where no GPU is
# seen they are plain custom ops: fastattn/ops/_library.py, triton_op). Nothing here runs on one.
_device_count, torch.cuda.device_count = torch.cuda.device_count, lambda: 1
from fastattn.backends import interpreting  # noqa: E402
from fastattn.ops._library import DEFINED, plain_eager  # noqa: E402
torch.cuda.device_count = _device_count

launches, traced = [], []
JITFunction.run = lambda self, *args, **kwargs: launches.append(self.fn.__name__)
_traced_call = wrap.TracingTritonHOPifier.call_triton_kernel


def _count_traced(self, variable, *args, **kwargs):
    traced.append(getattr(variable.kernel, "__name__", repr(variable.kernel)))
    return _traced_call(self, variable, *args, **kwargs)


wrap.TracingTritonHOPifier.call_triton_kernel = _count_traced


def main() -> int:
    if interpreting():
        print("eager_launch: TRITON_INTERPRET is set; this check needs compiled Triton")
        return 1
    if not plain_eager():
        print("eager_launch: not plain eager here")
        return 1
    missing = [f"fastattn::triton_{op}_fwd" for op in ("layer_norm", "softmax")
               if f"fastattn::triton_{op}_fwd" not in triton_ops_to_kernels]
    if missing:
        print(f"eager_launch: not registered through torch.library.triton_op: {', '.join(missing)}")
        return 1
    g = torch.Generator().manual_seed(0)

    def t(*shape):
        return torch.randn(*shape, generator=g).requires_grad_()

    x, w, b = t(64, 1024), t(1024), t(1024)
    s = t(2, 4, 16, 64)
    runs = {
        "layer_norm": lambda: DEFINED["layer_norm"].registered["triton"](x, None, (1024,), w, b, 1e-5, False)[0],
        "softmax": lambda: DEFINED["softmax"].registered["triton"](s, None, 0.125, True),
    }
    failed = 0
    for name, run in runs.items():
        launches.clear()
        traced.clear()
        y = run()
        inputs = [a for a in (x, w, b, s) if a.requires_grad]
        torch.autograd.grad(y, inputs, torch.ones_like(y), allow_unused=True)
        ok = bool(launches) and not traced
        failed += not ok
        print(f"eager_launch: {name} forward+backward: {len(launches)} direct launches "
              f"({', '.join(sorted(set(launches)))}), {len(traced)} through wrap_triton's traced "
              f"path: {'ok' if ok else 'FAILED'}")
    return 1 if failed else 0


if __name__ == "__main__":
    sys.exit(main())
