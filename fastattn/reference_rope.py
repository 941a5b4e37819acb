"""``fastattn.reference_rope`` is :mod:`fastattn.reference.rope` (the same module object, kept for old imports)."""

import importlib
import sys

sys.modules[__name__] = importlib.import_module("fastattn.reference.rope")
