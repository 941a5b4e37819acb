"""``fastattn.bench_suites`` is :mod:`fastattn.bench.suites` (the same module object, kept for old imports)."""

import importlib
import sys

sys.modules[__name__] = importlib.import_module("fastattn.bench.suites")
