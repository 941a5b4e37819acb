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

Hugging Face transformers (:mod:`fastattn.integrations.hf`): :func:`register_hf` registers ``"fastattn"`` in
``transformers.AttentionInterface`` (and a matching mask builder), so that
``AutoModel.from_config(config, attn_implementation="fastattn")`` runs fastattn's attention;
:func:`swap` on a transformers model also swaps its RMSNorms, MLPs and rotary embedding (found
by structure, for the families of ``fastattn.hf.FAMILIES``), its ``nn.LayerNorm`` modules, and
switches it to that attention implementation.
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
from fastattn.integrations import hf
from fastattn.integrations.hf import hf_attention_forward, register_hf

__all__ = ["SwapEntry", "SwapReport", "hf_attention_forward", "register_hf", "swap", "unswap"]

_ORIGINAL = "_fastattn_original_class"
_LAYER_METHODS = ("forward", "_sa_block", "_mha_block", "_ff_block")


def _label(cls: type) -> str:
    mod = cls.__module__
    if mod.startswith("torch.nn."):
        return f"torch.nn.{cls.__name__}"
    if mod.startswith("fastattn.nn."):
        return f"fastattn.nn.{cls.__name__}"
    if mod.startswith("transformers."):
        return f"transformers.{cls.__name__}"
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

    @property
    def left(self) -> dict[tuple[str, str], int]:
        """Number of modules left as they were, per (class name, reason)."""
        return dict(Counter((e.before, e.note) for e in self.skipped))

    def __str__(self) -> str:
        lines = [f"fastattn {self.action} {len(self.replaced)} module(s) (backend={self.backend!r})"]
        after = {}
        for e in self.replaced:
            after.setdefault(e.before, e.after)
        for cls, n in sorted(self.counts.items()):
            lines.append(f"  {n:4d} x {cls}" + (f" -> {after[cls]}" if self.action == "swapped" else ""))
        for (cls, why), n in sorted(self.left.items()):
            lines.append(f"  {n:4d} x {cls} left: {why}")
        if self.hf_attention:
            lines.append(f"  transformers attn_implementation = {self.hf_attention!r}")
        if len(self.replaced) + len(self.skipped) > self.DETAIL_LIMIT:
            lines.append(f"  (per module: report.replaced and report.skipped, {len(self.replaced) + len(self.skipped)} entries)")
            return "\n".join(lines)
        width = max((len(e.name or "<root>") for e in self.replaced + self.skipped), default=0)
        for e in self.replaced:
            note = f"  ({e.note})" if e.note else ""
            lines.append(f"  {e.name or '<root>':{width}s}  {e.before} -> {e.after}{note}")
        for e in self.skipped:
            lines.append(f"  {e.name or '<root>':{width}s}  {e.before} kept: {e.note}")
        return "\n".join(lines)

    DETAIL_LIMIT = 40  # modules listed one by one up to this many


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
    rope: bool = True,
) -> SwapReport:
    """Replace, in place, torch's MultiheadAttention (``attention``), LayerNorm and RMSNorm
    (``layer_norm``) and TransformerEncoderLayer / TransformerDecoderLayer (whose feed-forward
    becomes one fused :func:`fastattn.ffn` when ``ffn``) by fastattn's subclasses, all running on
    ``backend`` (None: automatic). ``torch.nn.Transformer`` / ``TransformerEncoder`` /
    ``TransformerDecoder`` stacks are covered through their layers (the encoder's nested-tensor
    fast path, which would bypass fastattn, is turned off). Returns a :class:`SwapReport`;
    :func:`unswap` undoes it.

    In a Hugging Face transformers model (see :mod:`fastattn.integrations.hf`) also: its RMSNorms
    (``layer_norm``), gated and plain MLPs (``ffn``: one fused :func:`fastattn.ffn` on the same
    Parameters), rotary embedding (``rope``: :func:`fastattn.rope` on the model's own tables), and
    its ``attn_implementation`` set to fastattn's (``attention``).

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
                activation_name(module.activation)
                fused, note = ffn, "" if ffn else "ffn kept in PyTorch (ffn=False)"
            except ValueError:
                fused = False
                note = f"ffn kept in PyTorch: activation {module.activation!r} is not one of fastattn's"
        module.__class__ = fast if cls is base else _combined_class(cls, fast)
        module.__dict__[_ORIGINAL] = cls
        module.backend = backend
        if flag == "layer":
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

    hf.swap_modules(
        model, backend=backend, flags={"norm": layer_norm, "mlp": ffn, "rotary": rope},
        replaced=report.replaced, skipped=report.skipped, entry=SwapEntry, label=_label, original_attr=_ORIGINAL,
    )
    if attention:
        blocker = hf.attention_blocker(model)
        if blocker is None:
            report.hf_attention = hf.swap_attention(model, backend)
        elif getattr(model, "set_attn_implementation", None) is not None:
            current = getattr(getattr(model, "config", None), "_attn_implementation", None)
            report.skipped.append(SwapEntry("", _label(type(model)), "", f"attention stays {current!r}: {blocker}"))
    return report


def unswap(model: torch.nn.Module) -> SwapReport:
    """Undo :func:`swap`: every module it swapped gets its original class back (parameters kept)."""
    report = SwapReport(action="restored")
    for name, module in model.named_modules():
        cls = module.__dict__.pop(_ORIGINAL, None)
        if cls is not None:
            before = _label(type(module))
            for attr in ("backend", "fused_ffn"):
                module.__dict__.pop(attr, None)
            module.__class__ = cls
            report.replaced.append(SwapEntry(name, before, _label(cls)))
        if module.__dict__.pop("_fastattn_use_nested_tensor", False):
            module.use_nested_tensor = True
    hf.release_rotary()
    previous = model.__dict__.pop("_fastattn_hf_previous", None)
    if previous is not None:
        model.set_attn_implementation(previous)
        report.hf_attention = previous
    return report
