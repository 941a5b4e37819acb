"""``fastattn.compat.megatron`` is :mod:`fastattn.integrations.megatron` (the same module object,
kept for old imports)."""

import sys

from fastattn.integrations import megatron as _megatron

sys.modules[__name__] = _megatron
