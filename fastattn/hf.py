"""``fastattn.hf`` is :mod:`fastattn.integrations.hf` (the same module object, kept for old imports)."""

import sys

from fastattn.integrations import hf as _hf

sys.modules[__name__] = _hf
