"""Hugging Face transformers: fastattn's attention as an ``attn_implementation``, and the swaps
that :func:`fastattn.swap` makes inside a transformers model.

>>> fastattn.register_hf()                         # attn_implementation="fastattn" now exists
>>> report = fastattn.swap(model)                  # norms, MLPs, rotary and attention, in place
>>> print(report)                                  # what was replaced per class, what was left and why
>>> fastattn.unswap(model)                         # back to the model's own classes

What is swapped, found by structure so that families whose classes differ only in name share
one code path:

* RMSNorm: a module of a class named ``*RMSNorm`` with one 1-D ``weight`` and an ``eps`` or
  ``variance_epsilon`` → :func:`fastattn.rms_norm`; Gemma's ``(1 + weight)`` scale comes from
  its family row (structure cannot tell it).
* MLP: a module whose children are exactly one of :data:`MLP_LAYOUTS` (gate/up/down
  projections, Phi-3's fused ``gate_up_proj``, GPT-2's Conv1D pair, GPT-NeoX's dense pair) →
  one :func:`fastattn.ffn` call on the same Parameters. Its activation is identified by value
  (SiLU, exact GELU or tanh GELU), not by class name. Separate gate and up projections are
  concatenated per call (a copy of both weights; the parameters and state_dict keys stay).
* Rotary: an attention module whose ``forward`` calls its modeling module's
  ``apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1)`` → :func:`fastattn.rope` on the
  model's own cos/sin tables (so every rope scaling variant is kept), partial rotary included.
  The modeling module's function is replaced by a dispatcher that runs fastattn only inside a
  swapped module's forward (other models of the family are untouched) and is put back when no
  swapped module of that modeling module is left.
* Attention: the model's ``attn_implementation`` is set to the registered fastattn function.

Each swapped module keeps its identity: only its ``__class__`` changes (to a subclass of its own
class with fastattn's ``forward``), so Parameters, buffers, hooks and state_dict keys are
untouched. A family is swapped when its ``config.model_type`` has a row in :data:`FAMILIES`; a new
family whose modules have one of these structures needs a row, not code.
"""

from __future__ import annotations

import contextvars
import functools
import inspect
import sys
import weakref
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from torch import Tensor

from fastattn.ops.attention import attention
from fastattn.ops.ffn import ffn
from fastattn.ops.layer_norm import rms_norm
from fastattn.ops.rope import rope

__all__ = [
    "FAMILIES", "MLP_LAYOUTS", "Family", "MLPLayout", "activation_of", "hf_attention_forward", "register_hf", "rope_hf",
]


# ---------------------------------------------------------------------------------------------
# The attention function (transformers' AttentionInterface) and its registration.


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
    top-left causal band for more than one query. Returns ``(out (B, L, H, Dv), None)``. When
    transformers passes ``cu_seq_lens_q/k`` (a padding-free, packed batch), the sequences go to
    :func:`fastattn.ops.varlen.hf_varlen_attention_forward` instead.
    """
    if kwargs.get("softcap") is not None:
        raise ValueError("fastattn attention does not support `softcap`; use attn_implementation='eager'")
    if kwargs.get("cu_seq_lens_q") is not None and kwargs.get("cu_seq_lens_k") is not None:
        # A padding-free (packed) batch: the sequence bounds are the mask.
        if position_bias is not None:
            raise ValueError("fastattn's packed (cu_seq_lens) path takes no position_bias; use "
                             "attn_implementation='eager'")
        from fastattn.ops import varlen

        return varlen.hf_varlen_attention_forward(module, query, key, value, attention_mask,
                                                  scaling, dropout, is_causal=is_causal,
                                                  backend=backend, **kwargs)
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


# ---------------------------------------------------------------------------------------------
# The tables: one row per family, one row per MLP structure.


@dataclass(frozen=True)
class Family:
    """What structure cannot tell about a family's modules."""

    norm_offset: float = 0.0  # RMSNorm scales by (norm_offset + weight): 1 for Gemma
    left: str = ""  # what stays in PyTorch by design, said in the report


_SPLIT_FFN = ("the FFN (*Intermediate + *Output) is split across two modules with the residual "
              "LayerNorm between them: it stays in PyTorch")

FAMILIES: dict[str, Family] = {
    # decoders (config.model_type -> row)
    "llama": Family(),
    "mistral": Family(),
    "qwen2": Family(),
    "qwen3": Family(),
    "gemma": Family(norm_offset=1.0),
    "gemma2": Family(norm_offset=1.0),
    "gemma3": Family(norm_offset=1.0),
    "gemma3_text": Family(norm_offset=1.0),
    "phi3": Family(),
    "gpt2": Family(),
    "gpt_neox": Family(),
    # BERT-style encoders: torch LayerNorms and attention are swapped
    "bert": Family(left=_SPLIT_FFN),
    "roberta": Family(left=_SPLIT_FFN),
}


@dataclass(frozen=True)
class MLPLayout:
    """An MLP's children by name: ``act(first(x)) -> second``, the first layer being one
    projection or, for gated MLPs, ``gate`` and ``up`` (separate, or one fused ``[gate; up]``)."""

    first: tuple[str, ...]
    second: str
    act: str
    gated: bool
    dropout: str | None = None  # applied to the output (GPT-2)


MLP_LAYOUTS: tuple[MLPLayout, ...] = (
    MLPLayout(("gate_proj", "up_proj"), "down_proj", "act_fn", gated=True),  # Llama, Mistral, Qwen, Gemma
    MLPLayout(("gate_up_proj",), "down_proj", "activation_fn", gated=True),  # Phi-3
    MLPLayout(("c_fc",), "c_proj", "act", gated=False, dropout="dropout"),  # GPT-2 (Conv1D)
    MLPLayout(("dense_h_to_4h",), "dense_4h_to_h", "act", gated=False),  # GPT-NeoX
)


# ---------------------------------------------------------------------------------------------
# Matching. Each returns (spec, None) for a module fastattn can take over, (None, reason) for a
# candidate it leaves (reported), or (None, None) for a module that is not a candidate.


def _eps_attr(module) -> str | None:
    for attr in ("variance_epsilon", "eps"):
        if isinstance(getattr(module, attr, None), (int, float)):
            return attr
    return None


def _match_norm(module, family: Family):
    if not type(module).__name__.endswith("RMSNorm"):
        return None, None
    params = dict(module.named_parameters(recurse=False))
    attr = _eps_attr(module)
    if list(params) != ["weight"] or params["weight"].dim() != 1 or attr is None or list(module.children()):
        return None, "not one 1-D weight with an eps: an unknown RMSNorm structure"
    return ("norm", attr, float(family.norm_offset)), None


def activation_of(act) -> str | None:
    """``"silu"``, ``"gelu"`` or ``"gelu_tanh"`` when the callable ``act`` computes that function
    (checked on values), else None."""
    x = torch.linspace(-6.0, 6.0, 49, dtype=torch.float64)
    try:
        with torch.no_grad():
            y = act(x)
    except Exception:  # noqa: BLE001 - anything that cannot run on a float64 CPU vector is unknown
        return None
    if not isinstance(y, Tensor) or y.shape != x.shape:
        return None
    for name, fn in (("silu", F.silu), ("gelu", F.gelu), ("gelu_tanh", functools.partial(F.gelu, approximate="tanh"))):
        if torch.allclose(y.double(), fn(x), rtol=0.0, atol=1e-9):
            return name
    return None


def _is_projection(module) -> bool:
    """nn.Linear, or transformers' Conv1D (weight stored (in, out))."""
    return isinstance(module, torch.nn.Linear) or (type(module).__name__ == "Conv1D" and hasattr(module, "nf"))


def _match_mlp(module):
    children = dict(module.named_children())
    for layout in MLP_LAYOUTS:
        names = {*layout.first, layout.second, layout.act} | ({layout.dropout} if layout.dropout else set())
        if set(children) != names:
            continue
        if not all(_is_projection(children[n]) for n in (*layout.first, layout.second)):
            return None, "its projections are not nn.Linear / Conv1D"
        if len(layout.first) == 2 and (children[layout.first[0]].bias is None) != (children[layout.first[1]].bias is None):
            return None, "only one of the gate and up projections has a bias"
        act = activation_of(children[layout.act])
        name = {"silu": "swiglu", "gelu": "geglu"}.get(act) if layout.gated else act
        if name is None:
            what = f"{type(children[layout.act]).__name__}"
            if layout.gated and act == "gelu_tanh":
                return None, f"gated tanh-GELU ({what}) is not one of the fused FFN's activations (its geglu is exact GELU)"
            return None, f"activation {what} is not one of the fused FFN's"
        return ("mlp", layout, name), None
    return None, None


def _match_rotary(module):
    cls = type(module)
    forward = getattr(cls, "forward", None)
    # (through decorators: transformers 5.24 wraps attention forwards in deprecate_kwarg)
    code = getattr(inspect.unwrap(forward) if callable(forward) else None, "__code__", None)
    if code is None or "apply_rotary_pos_emb" not in code.co_names:
        return None, None
    fn = getattr(sys.modules.get(cls.__module__), "apply_rotary_pos_emb", None)
    try:
        params = list(inspect.signature(fn).parameters.values())
    except (TypeError, ValueError):
        params = []
    if [p.name for p in params] != ["q", "k", "cos", "sin", "unsqueeze_dim"] or params[4].default != 1:
        return None, "its apply_rotary_pos_emb does not have the signature (q, k, cos, sin, unsqueeze_dim=1)"
    return ("rotary",), None


# ---------------------------------------------------------------------------------------------
# The forwards of the swapped classes.


def _norm_forward(self, x: Tensor) -> Tensor:
    _, attr, offset = self._fastattn_spec
    weight = self.weight
    if offset:  # Gemma: x normalized times (1 + w), both in float32, rounded once to x's dtype
        weight = weight.float() + offset
    elif weight.dtype != x.dtype:  # Llama-style: w * normed(x), promoted as PyTorch does
        x = x.to(torch.promote_types(x.dtype, weight.dtype))
        weight = weight.to(x.dtype)
    return rms_norm(x, weight.shape, weight, getattr(self, attr), backend=self.backend)


def _weights(proj) -> tuple[Tensor, Tensor | None]:
    """A projection's (weight (out, in), bias) in nn.Linear layout."""
    if isinstance(proj, torch.nn.Linear):
        return proj.weight, proj.bias
    return proj.weight.t(), proj.bias  # Conv1D


def _mlp_forward(self, x: Tensor) -> Tensor:
    _, layout, activation = self._fastattn_spec
    firsts = [_weights(getattr(self, n)) for n in layout.first]
    if len(firsts) == 1:
        w1, b1 = firsts[0]
    else:  # gate and up: fastattn's gated w1 is [gate; up]
        w1 = torch.cat([w for w, _ in firsts])
        b1 = None if firsts[0][1] is None else torch.cat([b for _, b in firsts])
    w2, b2 = _weights(getattr(self, layout.second))
    out = ffn(x, w1, b1, w2, b2, activation, backend=self.backend)
    return getattr(self, layout.dropout)(out) if layout.dropout else out


# The backend for rope inside a swapped attention module's forward (unset elsewhere).
_ROTARY_BACKEND: contextvars.ContextVar = contextvars.ContextVar("fastattn_hf_rotary")
_PATCHED: dict[str, tuple] = {}  # modeling module name -> (original function, WeakSet of swapped modules)


def _rotary_forward(self, *args, **kwargs):
    _patch_rotary(self)  # a copy of a swapped model (deepcopy, pickle) registers on its first call
    token = _ROTARY_BACKEND.set(self.backend)
    try:
        return super(type(self), self).forward(*args, **kwargs)
    finally:
        _ROTARY_BACKEND.reset(token)


def rope_hf(x: Tensor, cos: Tensor, sin: Tensor, unsqueeze_dim: int = 1, *, backend: str | None = None) -> Tensor:
    """Hugging Face's ``rotate_half`` RoPE of ``x`` with HF's tables on fastattn: ``cos``/``sin``
    (B, L, R) or (L, R) hold each token's angles twice (``cat(freqs, freqs)``); the first R of
    x's D dims are rotated (partial rotary), the rest pass through. ``x`` is (B, H, L, D) with
    ``unsqueeze_dim=1`` or (B, L, H, D) with 2."""
    if unsqueeze_dim == 2:
        return rope_hf(x.transpose(1, 2), cos, sin, 1, backend=backend).transpose(1, 2)
    B, _, L, D = x.shape
    R = cos.shape[-1]
    half = R // 2
    if cos.dim() == 2 or cos.shape[0] == 1:  # one table for the whole batch
        table_cos, table_sin = cos.reshape(L, R)[:, :half], sin.reshape(L, R)[:, :half]
        positions = None
    else:
        table_cos, table_sin = cos.reshape(B * L, R)[:, :half], sin.reshape(B * L, R)[:, :half]
        positions = torch.arange(B * L, device=x.device).view(B, L)
    rotated = rope(x[..., :R], table_cos, table_sin, positions=positions, backend=backend)
    return rotated if R == D else torch.cat([rotated, x[..., R:]], dim=-1)


def _rotary_dispatcher(original):
    @functools.wraps(original)
    def apply_rotary_pos_emb(q, k, cos, sin, unsqueeze_dim=1):
        backend = _ROTARY_BACKEND.get(_ROTARY_BACKEND)
        if backend is _ROTARY_BACKEND or unsqueeze_dim not in (1, 2):  # not inside a swapped module
            return original(q, k, cos, sin, unsqueeze_dim)
        return rope_hf(q, cos, sin, unsqueeze_dim, backend=backend), rope_hf(k, cos, sin, unsqueeze_dim, backend=backend)

    apply_rotary_pos_emb._fastattn_original = original
    return apply_rotary_pos_emb


def _patch_rotary(module) -> None:
    name = type(module).__module__
    if name not in _PATCHED:
        modeling = sys.modules[name]
        original = modeling.apply_rotary_pos_emb
        _PATCHED[name] = (original, weakref.WeakSet())
        modeling.apply_rotary_pos_emb = _rotary_dispatcher(original)
    _PATCHED[name][1].add(module)


def release_rotary() -> None:
    """Put back each modeling module's ``apply_rotary_pos_emb`` once none of its swapped modules is left."""
    for name, (original, modules) in list(_PATCHED.items()):
        if not any(getattr(type(m), "_fastattn_spec", None) == ("rotary",) for m in modules):
            sys.modules[name].apply_rotary_pos_emb = original
            del _PATCHED[name]


_FORWARDS = {"norm": _norm_forward, "mlp": _mlp_forward, "rotary": _rotary_forward}
_AFTER = {"norm": "fastattn rms_norm", "mlp": "fastattn ffn", "rotary": "fastattn rope (its rotary embedding)"}


@functools.cache
def _swapped_class(cls: type, spec: tuple) -> type:
    namespace = {
        "__module__": cls.__module__, "__qualname__": f"fastattn[{cls.__qualname__}]",
        "forward": _FORWARDS[spec[0]], "_fastattn_spec": spec,
    }
    return type(cls.__name__, (cls,), namespace)


def describe(spec: tuple) -> str:
    kind = spec[0]
    if kind == "norm" and spec[2]:
        return f"{_AFTER[kind]} ({spec[2]:g} + weight)"
    if kind == "mlp":
        return f"{_AFTER[kind]} ({spec[2]})"
    return _AFTER[kind]


# ---------------------------------------------------------------------------------------------
# The walk that fastattn.swap runs on a transformers model.


def families(model: torch.nn.Module) -> dict[str, str]:
    """``{module name prefix: config.model_type}`` for each module with a transformers config."""
    found = {}
    for name, module in model.named_modules():
        model_type = getattr(getattr(module, "config", None), "model_type", None)
        if isinstance(model_type, str) and model_type and hasattr(module, "set_attn_implementation"):
            found[name] = model_type
    return found


def _family_of(name: str, prefixes: dict[str, str]) -> str | None:
    best = None
    for prefix in prefixes:
        if prefix == "" or name == prefix or name.startswith(prefix + "."):
            if best is None or len(prefix) > len(best):
                best = prefix
    return None if best is None else prefixes[best]


def swap_modules(model, *, backend, flags, replaced, skipped, entry, label, original_attr) -> None:
    """Swap the RMSNorm / MLP / rotary modules of every transformers family in ``model``; adds
    ``entry(name, before, after, note)`` to ``replaced`` or ``skipped``. ``flags``: which of
    ``norm``, ``mlp``, ``rotary`` are on."""
    prefixes = families(model)
    if not prefixes:
        return
    for prefix, model_type in prefixes.items():
        if _family_of(prefix, {p: t for p, t in prefixes.items() if p != prefix}) is not None:
            continue  # said once, at the outermost transformers model
        before = label(type(model.get_submodule(prefix)))
        row = FAMILIES.get(model_type)
        if row is None:
            skipped.append(entry(prefix, before, "", f"model_type {model_type!r} has no row in fastattn.hf.FAMILIES: "
                                                     f"only its torch norms and attention are swapped"))
        elif row.left:
            skipped.append(entry(prefix, before, "", row.left))
    for name, module in list(model.named_modules()):
        model_type = _family_of(name, prefixes)
        family = FAMILIES.get(model_type)
        if family is None or getattr(type(module), "_fastattn_spec", None) is not None:
            continue
        for kind, (spec, reason) in (("norm", _match_norm(module, family)), ("mlp", _match_mlp(module)),
                                     ("rotary", _match_rotary(module))):
            if spec is None and reason is None:
                continue
            if not flags[kind]:
                break
            cls = type(module)
            if reason is not None:
                skipped.append(entry(name, label(cls), "", reason))
                break
            module.__class__ = _swapped_class(cls, spec)
            module.__dict__[original_attr] = cls
            module.backend = backend
            if kind == "rotary":
                _patch_rotary(module)
            replaced.append(entry(name, label(cls), describe(spec), ""))
            break


def attention_blocker(model) -> str | None:
    """Why the model's attention cannot run on fastattn (None: it can)."""
    config = getattr(model, "config", None)
    configs = [config, getattr(config, "text_config", None)]
    for c in configs:
        cap = getattr(c, "attn_logit_softcapping", None)
        if cap is not None:
            return f"attn_logit_softcapping={cap}: fastattn's attention has no score soft-capping"
    return None


def swap_attention(model: torch.nn.Module, backend: str | None) -> str | None:
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
