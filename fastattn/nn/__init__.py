"""Drop-in modules that run fastattn's kernels."""

from fastattn.nn.norm import LayerNorm, RMSNorm

__all__ = ["LayerNorm", "RMSNorm"]
