"""The autotuning switch shared by the kernel modules.

``FASTATTN_AUTOTUNE=0`` (read at import; ``AUTOTUNE`` is assignable) makes every autotuned
kernel run the first config its pruner keeps instead of timing all of them: one compile per
shape rather than one per config. The GPU test suite sets it (tests/conftest.py) so that its
many small shapes do not each autotune; benchmarks and users keep the default, full tuning.
"""

import os

AUTOTUNE = os.environ.get("FASTATTN_AUTOTUNE", "1").strip().lower() not in (
    "0", "false", "no", "off")


def limit(configs):
    """The pruned ``configs`` themselves, or only the first one when autotuning is off."""
    return list(configs) if AUTOTUNE else list(configs)[:1]
