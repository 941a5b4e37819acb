"""fastattn's Triton kernels, shipped as the subpackage ``fastattn.kernels``.

One module per op, each holding @triton.jit kernels and their launchers (tensors in, tensors out,
no autograd): ``layer_norm``, ``softmax``, ``attention``, ``ffn``, ``rope``; ``rng`` is the counter-based
dropout RNG they share (docs/numerics.md), ``tuning`` the autotuning switch (FASTATTN_AUTOTUNE).

Imported under any other name — the top-level ``kernels`` that Python finds in a clone's root,
which transformers probes for the Hugging Face package of that name — this folder steps aside:
it hands over to the installed PyPI package ``kernels`` when there is one, and otherwise stays an
empty module without ``__file__`` or ``__version__``, which is how transformers (and anything
else that reads versions) recognizes a folder that merely shadows a package name on sys.path.
"""

if __name__ != "fastattn.kernels":

    def _step_aside(name):
        import importlib.util
        import os
        import sys
        from importlib.machinery import PathFinder

        here = os.path.dirname(os.path.dirname(os.path.realpath(__spec__.origin)))
        elsewhere = [p for p in sys.path if os.path.realpath(p or os.getcwd()) != here]
        spec = PathFinder.find_spec(name, elsewhere)
        if spec is None or spec.loader is None:
            return False
        module = importlib.util.module_from_spec(spec)
        sys.modules[name] = module  # what the import statement returns once this file has run
        spec.loader.exec_module(module)
        return True

    if not _step_aside(__name__):
        # No package of this name elsewhere: look like a bare folder on sys.path.
        del __file__

        def __getattr__(attr):
            raise AttributeError(
                f"{__name__!r} here is fastattn's Triton kernels folder (import it as fastattn.kernels), "
                f"and no other package named {__name__!r} is installed"
            )

    del _step_aside
