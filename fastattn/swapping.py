"""Swap fastattn's drop-in modules into an existing model, in place, and back.

>>> report = fastattn.swap(model, backend=None)         # torch MHA / LayerNorm / RMSNorm /
>>> print(report)                                       # Transformer*Layer -> fastattn's
>>> fastattn.unswap(model)                              # and back to torch's classes

Each module keeps its identity: only its ``__class__`` changes, to the fastattn subclass of its
torch class, so the parameters (the same Parameter objects), buffers, device, dtype, train/eval
mode, hooks and state_dict keys are untouched. A module of a *subclass* of a torch class is
swapped only when the subclass does not override ``forward`` (e.g. a library's ``class
MyLayerNorm(nn.LayerNorm): pass``); it then gets a class deriving from both, so
``isinstance`` checks against the subclass still hold (such a model pickles only as a
state_dict; models of torch's own classes pickle whole).

Hugging Face transformers: :func:`register_hf` registers ``"fastattn"`` in
``transformers.AttentionInterface`` (and a matching mask builder), so that
``AutoModel.from_config(config, attn_implementation="fastattn")`` runs fastattn's attention;
:func:`swap` on a transformers model also switches it to that implementation (and swaps its
``nn.LayerNorm`` modules).
"""

from __future__ import annotations

import functools
from collections import Counter
from dataclasses import dataclass, field

import torch
from torch import Tensor

from fastattn.nn.attention import MultiheadAttention
from fastattn.nn.norm import LayerNorm, RMSNorm
from fastattn.nn.transformer import TransformerDecoderLayer, TransformerEncoderLayer, activation_name
from fastattn.ops.attention import attention

__all__ = ["SwapEntry", "SwapReport", "hf_attention_forward", "register_hf", "swap", "unswap"]

_ORIGINAL = "_fastattn_original_class"
_LAYER_METHODS = ("forward", "_sa_block", "_mha_block", "_ff_block")


def _label(cls: type) -> str:
    mod = cls.__module__
    if mod.startswith("torch.nn."):
        return f"torch.nn.{cls.__name__}"
    if mod.startswith("fastattn.nn."):
        return f"fastattn.nn.{cls.__name__}"
    return f"{mod}.{cls.__qualname__}"


@dataclass
class SwapEntry:
    name: str  # qualified module name ("" for the root)
    before: str  # class names
    after: str
    note: str = ""


@dataclass
class SwapReport:
    """What :func:`swap` (or :func:`unswap`) changed; ``print(report)`` shows a table."""

    backend: str | None = None
    replaced: list[SwapEntry] = field(default_factory=list)
    skipped: list[SwapEntry] = field(default_factory=list)
    hf_attention: str | None = None  # the transformers attn_implementation set, if any
    action: str = "swapped"

    @property
    def counts(self) -> dict[str, int]:
        """Number of replaced modules per original class name."""
        return dict(Counter(e.before for e in self.replaced))

    def __len__(self) -> int:
        return len(self.replaced)

    def __str__(self) -> str:
        lines = [f"fastattn {self.action} {len(self.replaced)} module(s) (backend={self.backend!r})"]
        for cls, n in sorted(self.counts.items()):
            lines.append(f"  {n:4d} x {cls}")
        if self.hf_attention:
            lines.append(f"  transformers attn_implementation = {self.hf_attention!r}")
        width = max((len(e.name or "<root>") for e in self.replaced + self.skipped), default=0)
        for e in self.replaced:
            note = f"  ({e.note})" if e.note else ""
            lines.append(f"  {e.name or '<root>':{width}s}  {e.before} -> {e.after}{note}")
        for e in self.skipped:
            lines.append(f"  {e.name or '<root>':{width}s}  {e.before} kept: {e.note}")
        return "\n".join(lines)


_BASES = (
    # (torch class, fastattn class, which swap() flag enables it)
    (torch.nn.MultiheadAttention, MultiheadAttention, "attention"),
    (torch.nn.LayerNorm, LayerNorm, "layer_norm"),
    (torch.nn.RMSNorm, RMSNorm, "layer_norm"),
    (torch.nn.TransformerEncoderLayer, TransformerEncoderLayer, "layer"),
    (torch.nn.TransformerDecoderLayer, TransformerDecoderLayer, "layer"),
)
_FAST = tuple(fast for _, fast, _ in _BASES)


@functools.cache
def _combined_class(cls: type, fast: type) -> type:
    """A class deriving from ``fast`` and the torch subclass ``cls``: fastattn's forward, ``cls``'s identity."""
    namespace = {"__module__": cls.__module__, "__qualname__": f"fastattn[{cls.__qualname__}]"}
    return type(cls.__name__, (fast, cls), namespace)


def _overrides(cls: type, base: type) -> list[str]:
    layer = issubclass(base, (torch.nn.TransformerEncoderLayer, torch.nn.TransformerDecoderLayer))
    methods = _LAYER_METHODS if layer else ("forward",)
    return [m for m in methods if getattr(cls, m, None) is not getattr(base, m, None)]


def _match(module: torch.nn.Module):
    """``(torch base, fastattn class, flag)`` for a swappable module, None otherwise."""
    if isinstance(module, _FAST) or getattr(module, _ORIGINAL, None) is not None:
        return None
    for base, fast, flag in _BASES:
        if isinstance(module, base):
            return base, fast, flag
    return None


def swap(
    model: torch.nn.Module,
    *,
    backend: str | None = None,
    attention: bool = True,
    layer_norm: bool = True,
    ffn: bool = True,
) -> SwapReport:
    """Replace, in place, torch's MultiheadAttention (``attention``), LayerNorm and RMSNorm
    (``layer_norm``) and TransformerEncoderLayer / TransformerDecoderLayer (whose feed-forward
    becomes one fused :func:`fastattn.ffn` when ``ffn``) by fastattn's subclasses, all running on
    ``backend`` (None: automatic). ``torch.nn.Transformer`` / ``TransformerEncoder`` /
    ``TransformerDecoder`` stacks are covered through their layers (the encoder's nested-tensor
    fast path, which would bypass fastattn, is turned off). A transformers model is also switched
    to ``attn_implementation="fastattn"`` when ``attention``. Returns a :class:`SwapReport`;
    :func:`unswap` undoes it.

    Layers are swapped whenever any flag is set, because PyTorch's layer fast path would
    otherwise bypass the swapped attention and norms; their feed-forward stays in PyTorch when
    ``ffn=False`` or the activation is not one of fastattn's.
    """
    report = SwapReport(backend=backend)
    flags = {"attention": attention, "layer_norm": layer_norm, "layer": attention or layer_norm or ffn}
    for name, module in list(model.named_modules()):
        found = _match(module)
        if found is None:
            continue
        base, fast, flag = found
        cls = type(module)
        if not flags[flag]:
            continue
        overridden = _overrides(cls, base)
        if overridden:
            report.skipped.append(SwapEntry(name, _label(cls), "", f"{cls.__name__} overrides {', '.join(overridden)}"))
            continue
        note = ""
        if flag == "layer":
            try:
                act = activation_name(module.activation)
                fused, note = ffn, "" if ffn else "ffn kept in PyTorch (ffn=False)"
            except ValueError:
                act, fused = "relu", False
                note = f"ffn kept in PyTorch: activation {module.activation!r} is not one of fastattn's"
        module.__class__ = fast if cls is base else _combined_class(cls, fast)
        module.__dict__[_ORIGINAL] = cls
        module.backend = backend
        if flag == "layer":
            module.activation_name = act
            module.fused_ffn = fused
        report.replaced.append(SwapEntry(name, _label(cls), _label(type(module)), note))

    # torch.nn.TransformerEncoder would turn the input into a nested tensor in eval mode and feed
    # it to torch's fused kernel; keep it off where layers were swapped.
    for name, module in model.named_modules():
        if isinstance(module, torch.nn.TransformerEncoder) and any(
            isinstance(layer, _FAST) for layer in module.layers
        ):
            if getattr(module, "use_nested_tensor", False):
                module.__dict__["_fastattn_use_nested_tensor"] = True
                module.use_nested_tensor = False

    if attention:
        report.hf_attention = _swap_hf(model, backend)
    return report


def unswap(model: torch.nn.Module) -> SwapReport:
    """Undo :func:`swap`: every module it swapped gets its original class back (parameters kept)."""
    report = SwapReport(action="restored")
    for name, module in model.named_modules():
        cls = module.__dict__.pop(_ORIGINAL, None)
        if cls is not None:
            before = _label(type(module))
            for attr in ("backend", "activation_name", "fused_ffn"):
                module.__dict__.pop(attr, None)
            module.__class__ = cls
            report.replaced.append(SwapEntry(name, before, _label(cls)))
        if module.__dict__.pop("_fastattn_use_nested_tensor", False):
            module.use_nested_tensor = True
    previous = model.__dict__.pop("_fastattn_hf_previous", None)
    if previous is not None:
        model.set_attn_implementation(previous)
        report.hf_attention = previous
    return report


# ---------------------------------------------------------------------------------------------
# Hugging Face transformers


def hf_attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None,
    scaling: float | None = None,
    dropout: float = 0.0,
    *,
    backend: str | None = None,
    is_causal: bool | None = None,
    position_bias: Tensor | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """An attention function with transformers' ``AttentionInterface`` signature, on fastattn.

    ``query (B, H, L, D)``, ``key``/``value (B, Hkv, S, D)``, ``attention_mask`` None, bool
    (True = may attend) or float (added), broadcastable to (B, H, L, S). Follows transformers'
    ``sdpa`` integration: without a mask, ``is_causal`` (or ``module.is_causal``) applies the
    top-left causal band for more than one query. Returns ``(out (B, L, H, Dv), None)``.
    """
    if kwargs.get("softcap") is not None:
        raise ValueError("fastattn attention does not support `softcap`; use attn_implementation='eager'")
    L = query.shape[2]
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    causal = bool(L > 1 and attention_mask is None and causal)
    if causal and key.shape[2] > L:
        # As transformers' sdpa: only a prefill into an empty static cache gets here; the keys
        # past the queries are empty slots.
        key, value = key[:, :, :L], value[:, :, :L]
        if position_bias is not None:
            position_bias = position_bias[..., :L]
    mask = attention_mask
    if position_bias is not None:
        if mask is None:
            mask = position_bias
        elif mask.dtype == torch.bool:
            mask = position_bias.masked_fill(~mask, float("-inf"))
        else:
            mask = position_bias + mask
    if mask is not None and mask.is_floating_point() and mask.dtype != query.dtype:
        mask = mask.to(query.dtype)
    out = attention(
        query, key, value, mask, causal=causal, scale=scaling, dropout_p=float(dropout),
        enable_gqa=key.shape[1] != query.shape[1], backend=backend,
    )
    return out.transpose(1, 2).contiguous(), None


def register_hf(name: str = "fastattn", *, backend: str | None = None) -> str:
    """Register fastattn's attention in transformers as ``attn_implementation=name`` (and the
    sdpa-style mask builder for it). Returns ``name``. Raises ImportError without transformers."""
    from transformers import AttentionInterface

    AttentionInterface.register(name, functools.partial(hf_attention_forward, backend=backend))
    try:
        from transformers.masking_utils import AttentionMaskInterface, sdpa_mask
    except ImportError:  # older transformers build masks without an interface
        pass
    else:
        AttentionMaskInterface.register(name, sdpa_mask)
    return name


def _swap_hf(model: torch.nn.Module, backend: str | None) -> str | None:
    """Switch a transformers model to fastattn's attention; the name set, or None."""
    setter = getattr(model, "set_attn_implementation", None)
    config = getattr(model, "config", None)
    can = getattr(model, "_can_set_attn_implementation", None)
    if setter is None or config is None or not callable(can) or not can():
        return None
    previous = config._attn_implementation
    name = register_hf("fastattn" if backend is None else f"fastattn_{backend}", backend=backend)
    if previous != name:
        setter(name)
        model.__dict__.setdefault("_fastattn_hf_previous", previous)
    return name
