"""fastattn: fused attention, softmax, layer norm and FFN kernels for PyTorch.

Each op runs on one of several interchangeable backends (``triton``, ``cuda``, ``cpu``, ``naive``);
see :mod:`fastattn.backends` for how one is chosen.
"""

from fastattn.backends import (
    available_backends,
    backend_status,
    register_backend,
    use_backend,
)
from fastattn.ops import (
    add_layer_norm,
    attention,
    ffn,
    layer_norm,
    paged_attention,
    paged_cache_append,
    rms_norm,
    rope,
    rotary_cos_sin,
    scaled_dot_product_attention,
    scaled_masked_softmax,
    varlen_attention,
)
from fastattn import extending, models, nn, reference
from fastattn.extending import extension_include_dir
from fastattn.swapping import register_hf, swap, unswap

__version__ = "0.1.0"

__all__ = [
    "__version__",
    "add_layer_norm",
    "attention",
    "available_backends",
    "backend_status",
    "extending",
    "extension_include_dir",
    "ffn",
    "layer_norm",
    "models",
    "nn",
    "paged_attention",
    "paged_cache_append",
    "register_hf",
    "reference",
    "register_backend",
    "rms_norm",
    "rope",
    "rotary_cos_sin",
    "scaled_dot_product_attention",
    "scaled_masked_softmax",
    "swap",
    "unswap",
    "use_backend",
    "varlen_attention",
]
