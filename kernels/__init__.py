"""fastattn's Triton kernels, shipped as the subpackage ``fastattn.kernels``.

One module per op, each holding @triton.jit kernels and their launchers (tensors in, tensors out,
no autograd): ``layer_norm``, ``softmax``, ``attention``, ``ffn``, ``rope``; ``rng`` is the counter-based
dropout RNG they share (docs/numerics.md), ``tuning`` the autotuning switch (FASTATTN_AUTOTUNE).
"""

if __name__ != "fastattn.kernels":
    raise ImportError(
        f"this folder is fastattn's Triton kernels and must be imported as fastattn.kernels, "
        f"not as {__name__!r} (a different PyPI package is named 'kernels')"
    )
