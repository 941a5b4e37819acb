"""``fastattn.reference_models`` is :mod:`fastattn.reference.models` (the same module object, kept for old imports)."""

import importlib
import sys

sys.modules[__name__] = importlib.import_module("fastattn.reference.models")
