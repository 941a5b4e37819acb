"""The benchmark cases and providers of each op, shared by ``fastattn bench`` and ``bench/``.

A suite is ``suite(device, dtype, modes, quick, options=None) -> (providers, cases)``. Providers
are named ``fastattn-<backend>`` for our compiled backends (whatever :func:`fastattn_backends`
finds at run time), ``naive`` for the eager baseline (fastattn's ``naive`` backend), ``torch...``
for PyTorch's own implementations (the peers whose best time gives the ``x torch`` column), and
anything else for reference points that are not the op (the bare matmuls of an FFN: its floor).

Sizes depend on the device: on a GPU the full grid (attention D in {64, 128, 256},
L in {512 ... 16384}, B = 16k tokens / L, H = 2048 / D, causal or not, padding mask and float bias;
bfloat16), on a CPU small shapes that finish in about a minute, and a hidden ``tiny`` preset for
the tests. ``Options`` narrows the grid (``--seq``, ``--d``, ``--causal``, ``--mask`` ...).
"""

from __future__ import annotations

import dataclasses
import importlib.util
import itertools
import operator
from typing import Callable

import torch
import torch.nn.functional as F

import fastattn
from fastattn import backends, reference
from fastattn.bench import Case, unchecked
from fastattn.testing import to_numpy

# Float64 NumPy references above this many elements (attention: score elements B*H*Lq*Lk) are
# computed on a leading corner only (batch 0, head 0), and skipped when even that is larger.
REFERENCE_FULL_ELEMENTS = 2**24
REFERENCE_MAX_ELEMENTS = 2**26

MASKS = ("none", "padding", "bias")
MODES = ("fwd", "bwd", "fwd_bwd")


@dataclasses.dataclass
class Options:
    """What narrows or widens a suite's default grid (None = the device's default)."""

    seqs: list[int] | None = None  # attention sequence lengths; softmax row lengths
    dims: list[int] | None = None  # attention head dims
    causal: list[bool] | None = None  # attention / softmax: causal, not, or both
    masks: list[str] | None = None  # attention / softmax: none, padding (bool), bias (float)
    compile: bool | None = None  # include torch.compile / FlexAttention peers (default: on a GPU)
    tiny: bool = False  # minimal shapes (tests)


def fastattn_backends(op: str, device: torch.device) -> list[str]:
    """Our compiled backends that run ``op`` at full speed on ``device`` (not the interpreter)."""
    names = []
    for name in fastattn.available_backends():
        if name == "naive" or name not in backends.implementations(op):
            continue
        if device.type not in backends._REGISTRY[name].devices:
            continue
        if name == "triton" and device.type != "cuda":
            continue  # the Triton interpreter is a test tool, far too slow to time
        names.append(name)
    return names


def _options(options: Options | None, device: torch.device) -> Options:
    o = dataclasses.replace(options) if options is not None else Options()
    if o.compile is None:
        o.compile = device.type == "cuda" and not o.tiny
    return o


def _preset(device: torch.device, o: Options) -> str:
    return "tiny" if o.tiny else ("gpu" if device.type == "cuda" else "cpu")


def _elt(dtype: torch.dtype) -> int:
    return torch.empty(0, dtype=dtype).element_size()


_DYNAMO_CONFIGURED = False


def compiled(fn: Callable, **kwargs) -> Callable:
    """``torch.compile(fn)``, compiled on first call; each new shape compiles anew (the
    recompile limits are raised so that a long grid never falls back to eager silently)."""
    global _DYNAMO_CONFIGURED
    if not _DYNAMO_CONFIGURED:
        from torch import _dynamo

        for name in ("recompile_limit", "cache_size_limit", "accumulated_recompile_limit", "accumulated_cache_size_limit"):
            if hasattr(_dynamo.config, name):
                setattr(_dynamo.config, name, max(getattr(_dynamo.config, name), 4096))
        _DYNAMO_CONFIGURED = True
    return torch.compile(fn, dynamic=False, **kwargs)


def _np(t):
    """A tensor as a float64 NumPy array — a bool mask stays bool (True = keep) for the reference."""
    if t is None:
        return None
    if t.dtype == torch.bool:
        return t.detach().cpu().numpy()
    return to_numpy(t)


def _random(shape, device, dtype, grad, gen, scale=1.0):
    """Normal values, drawn where they will live: on a GPU, by a generator there seeded from
    ``gen`` (drawing 2**25 values on the CPU took seconds a case, 2026-11-26's H200 run)."""
    if torch.device(device).type == "cpu":
        t = torch.randn(shape, generator=gen) * scale
    else:
        local = torch.Generator(device=device)
        local.manual_seed(int(torch.randint(2**62, (1,), generator=gen)))
        t = torch.randn(shape, generator=local, device=device).mul_(scale)
    return t.to(device=device, dtype=dtype).requires_grad_(grad)


# ---------------------------------------------------------------------------------------------
# Layer norm: GB/s.


def layer_norm_suite(device: torch.device, dtype: torch.dtype, modes, quick: bool, options: Options | None = None):
    o = _options(options, device)
    preset = _preset(device, o)
    shapes = {
        "gpu": [(4096, 1024), (4096, 4096), (4096, 8192), (2048, 16384), (512, 65536)],
        "cpu": [(4096, 256), (2048, 1024), (256, 8192)],
        "tiny": [(64, 32), (16, 128)],
    }[preset]
    if quick and preset != "tiny":
        shapes = shapes[:2]

    def naive(x, w, b):
        return fastattn.layer_norm(x, x.shape[-1:], w, b, backend="naive")

    providers: dict[str, Callable] = {
        f"fastattn-{name}": (lambda name: lambda x, w, b: fastattn.layer_norm(x, x.shape[-1:], w, b, backend=name))(name)
        for name in fastattn_backends("layer_norm", device)
    }
    providers["naive"] = naive
    providers["torch"] = lambda x, w, b: F.layer_norm(x, x.shape[-1:], w, b)
    if o.compile:
        providers["torch.compile(naive)"] = compiled(naive)

    def ref(x, w, b):
        return reference.layer_norm(to_numpy(x), x.shape[-1:], to_numpy(w), to_numpy(b))[0]

    def grad_ref(inputs, dout):
        x, w, _b = inputs
        return list(reference.layer_norm_backward(dout, to_numpy(x), x.shape[-1:], to_numpy(w)))

    cases = []
    elt = _elt(dtype)
    for m, n in shapes:
        for mode in modes:
            traffic = {"fwd": 2, "bwd": 3, "fwd_bwd": 5}[mode] * m * n * elt

            def make(m=m, n=n, mode=mode):
                grad = mode != "fwd"
                gen = torch.Generator().manual_seed(m * 7 + n)
                x = _random((m, n), device, dtype, grad, gen)
                w = _random((n,), device, dtype, grad, gen)
                b = _random((n,), device, dtype, grad, gen)
                return x, w, b

            big = m * n > REFERENCE_MAX_ELEMENTS
            cases.append(Case(
                "layer_norm", f"{m}x{n}", dtype, mode, make, bytes=traffic,
                reference=None if big else ref, grad_reference=None if big else grad_ref,
                params={"N": n}, sweep="N",
            ))
    return providers, cases


# ---------------------------------------------------------------------------------------------
# Attention: TFLOP/s = 4 * B * H * Lq * Lk * D (halved when causal), x2.5 backward, x3.5 both.


def attention_flops(b: int, h: int, lq: int, lk: int, d: int, causal: bool, mode: str) -> int:
    flops = 4 * b * h * lq * lk * d
    if causal:
        flops //= 2
    return int(flops * {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}[mode])


@dataclasses.dataclass
class AttentionAux:
    """Per-case extras every attention provider receives after (q, k, v, mask): the flags, the
    mask merged with the causal band for SDPA (which takes one or the other), and what
    FlexAttention needs (built on a provider's first, untimed call)."""

    causal: bool
    kind: str  # none, padding, bias
    sdpa_mask: torch.Tensor | None
    sdpa_causal: bool
    lengths: torch.Tensor | None = None
    bias: torch.Tensor | None = None
    flex: dict = dataclasses.field(default_factory=dict)


def _padding_lengths(b: int, lk: int) -> list[int]:
    """Valid key lengths per batch element: from nearly all keys down to half of them."""
    return [lk - ((i + 1) * lk) // (2 * b) for i in range(b)]


def _attention_grid(device, o: Options, quick: bool):
    """(B, H, L, D, causal, mask) tuples of the attention grid."""
    preset = _preset(device, o)
    if preset == "gpu":
        dims, seqs, tokens, width = [64, 128, 256], [512, 1024, 2048, 4096, 8192, 16384], 16384, 2048
        if quick:
            dims, seqs = [64, 128], [1024, 4096, 16384]
    elif preset == "cpu":
        dims, seqs, tokens, width = [64], [256, 512, 1024], 1024, 256
        if quick:
            seqs = [256, 1024]
    else:
        dims, seqs, tokens, width = [16], [32, 64], 64, 32
    dims, seqs = o.dims or dims, o.seqs or seqs
    if o.causal is not None or o.masks is not None:
        variants = list(itertools.product(o.causal or [False, True], o.masks or ["none"]))
        masked_at = None
    else:
        variants = [(False, "none"), (True, "none")]
        # Masks (non-causal; the band is covered above) at one head dim / length, not the product.
        masked_at = {"gpu": ("D", 128 if 128 in dims else dims[0]),
                     "cpu": ("L", seqs[len(seqs) // 2]),
                     "tiny": ("L", seqs[-1])}[preset]
    # The tiny preset (tests) covers both masks with the causal band too.
    masked_variants = [(True, "padding"), (True, "bias")] if preset == "tiny" else [(False, "padding"), (False, "bias")]
    grid = []
    for d in dims:
        h = max(1, width // d)
        for L in seqs:
            b = max(1, tokens // L)
            extra = []
            if masked_at is not None and {"D": d, "L": L}[masked_at[0]] == masked_at[1]:
                extra = masked_variants
            for causal, mask in variants + extra:
                grid.append((b, h, L, d, causal, mask))
    return grid


def _sdpa(backend=None):
    if backend is None:
        def fn(q, k, v, mask, aux):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=aux.sdpa_mask, is_causal=aux.sdpa_causal)

        return fn
    from torch.nn.attention import SDPBackend, sdpa_kernel

    kind = getattr(SDPBackend, backend)
    cuda_only = backend in ("EFFICIENT_ATTENTION", "CUDNN_ATTENTION")

    def forced(q, k, v, mask, aux):
        if cuda_only and q.device.type == "cpu":
            raise NotImplementedError("a CUDA-only SDPA kernel (CPU has flash, math)")
        with sdpa_kernel(kind):
            return F.scaled_dot_product_attention(q, k, v, attn_mask=aux.sdpa_mask, is_causal=aux.sdpa_causal)

    return forced


def _flex_provider() -> Callable:
    """FlexAttention (compiled), with the case's mask as a BlockMask (causal, padding) and a
    score_mod (float bias)."""
    state: dict = {}

    def flex(q, k, v, mask, aux):
        from torch.nn.attention.flex_attention import create_block_mask, flex_attention

        if "fn" not in state:
            state["fn"] = compiled(flex_attention)
        if "args" not in aux.flex:
            B, _, Lq, _ = q.shape
            Lk = k.shape[2]
            causal, lengths, bias = aux.causal, aux.lengths, aux.bias

            def padded(b, h, qi, kv):
                ok = kv < lengths[b]
                return ok & (qi >= kv) if causal else ok

            def lower(b, h, qi, kv):
                return qi >= kv

            def add_bias(score, b, h, qi, kv):
                return score + bias[0, 0, qi, kv]

            mask_mod = padded if lengths is not None else (lower if causal else None)
            block_mask = None
            if mask_mod is not None:
                block_mask = create_block_mask(mask_mod, B if lengths is not None else None, None, Lq, Lk, device=q.device)
            score_mod = add_bias if bias is not None else None
            aux.flex["args"] = {"block_mask": block_mask, "score_mod": score_mod}
        return state["fn"](q, k, v, **aux.flex["args"])

    return flex


def attention_suite(device: torch.device, dtype: torch.dtype, modes, quick: bool, options: Options | None = None):
    o = _options(options, device)

    def ours(name):
        return lambda q, k, v, mask, aux: fastattn.attention(q, k, v, mask, causal=aux.causal, backend=name)

    def naive(q, k, v, mask, aux):
        return fastattn.attention(q, k, v, mask, causal=aux.causal, backend="naive")

    providers: dict[str, Callable] = {f"fastattn-{n}": ours(n) for n in fastattn_backends("attention", device)}
    providers["naive"] = naive
    providers["torch.sdpa"] = _sdpa()
    for name, kind in (("flash", "FLASH_ATTENTION"), ("efficient", "EFFICIENT_ATTENTION"),
                       ("cudnn", "CUDNN_ATTENTION"), ("math", "MATH")):
        providers[f"torch.sdpa[{name}]"] = _sdpa(kind)
    if o.compile:
        providers["torch.flex_attention"] = _flex_provider()
        providers["torch.compile(naive)"] = compiled(naive)

    cases = []
    for b, h, L, d, causal, kind in _attention_grid(device, o, quick):
        score_elements = b * h * L * L
        corner = score_elements > REFERENCE_FULL_ELEMENTS
        has_ref = (L * L if corner else score_elements) <= REFERENCE_MAX_ELEMENTS
        for mode in modes:
            def make(b=b, h=h, L=L, d=d, causal=causal, kind=kind, mode=mode):
                grad = mode != "fwd"
                gen = torch.Generator().manual_seed(L * 1000 + d)
                q, k, v = (_random((b, h, L, d), device, dtype, grad, gen) for _ in range(3))
                mask = lengths = bias = None
                if kind == "padding":
                    lengths = torch.tensor(_padding_lengths(b, L), device=device)
                    mask = (torch.arange(L, device=device) < lengths[:, None]).view(b, 1, 1, L)
                elif kind == "bias":
                    bias = mask = _random((1, 1, L, L), device, dtype, False, gen, scale=0.5)
                sdpa_mask, sdpa_causal = mask, causal
                if mask is not None and causal:  # SDPA takes a mask or is_causal, not both
                    allowed = torch.ones(L, L, dtype=torch.bool, device=device).tril()
                    if mask.dtype == torch.bool:
                        sdpa_mask = mask & allowed
                    else:
                        sdpa_mask = mask.masked_fill(~allowed, float("-inf"))
                    sdpa_causal = False
                aux = AttentionAux(causal, kind, sdpa_mask, sdpa_causal, lengths, bias)
                return q, k, v, mask, aux

            def cut(t, n):
                return None if t is None else _np(t[:n, :n] if corner else t)

            def ref(q, k, v, mask, aux):
                n = 1 if corner else None
                return reference.attention(cut(q, n), cut(k, n), cut(v, n), cut(mask, n), causal=aux.causal)[0]

            def grad_ref(inputs, dout):
                q, k, v, mask, aux = inputs
                n = 1 if corner else None
                dout = dout[:1, :1] if corner else dout
                dq, dk, dv, _ = reference.attention_backward(
                    dout, cut(q, n), cut(k, n), cut(v, n), cut(mask, n), causal=aux.causal
                )
                return [dq, dk, dv]

            name = f"{b}x{h}x{L}x{d}" + (" causal" if causal else "") + ("" if kind == "none" else f" {kind}")
            cases.append(Case(
                "attention", name, dtype, mode, make,
                flops=attention_flops(b, h, L, L, d, causal, mode),
                reference=ref if has_ref else None, grad_reference=grad_ref if has_ref else None,
                params={"L": L, "D": d, "causal": causal, "mask": kind}, sweep="L",
            ))
    return providers, cases


# ---------------------------------------------------------------------------------------------
# Scaled masked softmax: GB/s, against the composite torch.softmax(x * scale + mask).

SOFTMAX_SCALE = 0.125


def _softmax_grid(device, o: Options, quick: bool):
    preset = _preset(device, o)
    total, lengths = {
        "gpu": (2**25, [128, 512, 2048, 8192, 32768, 131072, 262144]),
        "cpu": (2**20, [128, 2048, 32768]),
        "tiny": (2**10, [32, 256]),
    }[preset]
    if quick and preset == "gpu":
        lengths = [512, 8192, 131072]
    elif quick and preset == "cpu":
        lengths = [128, 32768]
    lengths = o.seqs or lengths
    default_masks = {"gpu": ["none", "padding", "bias"], "cpu": ["none", "padding"], "tiny": ["padding", "bias"]}[preset]
    variants = list(itertools.product(o.causal or [False], o.masks or default_masks))
    grid = []
    for lk in lengths:
        rows = max(1, total // lk)
        b = min(4, rows)
        h = max(1, min(8, rows // b))
        lq = max(1, rows // (b * h))
        for causal, kind in variants:
            grid.append((b, h, lq, lk, causal, kind))
    return grid


def softmax_suite(device: torch.device, dtype: torch.dtype, modes, quick: bool, options: Options | None = None):
    o = _options(options, device)
    scale = SOFTMAX_SCALE

    def ours(name):
        return lambda x, mask, causal_mask: fastattn.scaled_masked_softmax(
            x, mask, scale, causal_mask is not None, backend=name
        )

    def naive(x, mask, causal_mask):
        return fastattn.scaled_masked_softmax(x, mask, scale, causal_mask is not None, backend="naive")

    def composite(x, mask, causal_mask):
        s = x * scale
        if mask is not None and mask.dtype == torch.bool:
            s = s.masked_fill(~mask, float("-inf"))
        elif mask is not None:
            s = s + mask
        if causal_mask is not None:
            s = s.masked_fill(causal_mask, float("-inf"))
        return torch.softmax(s, dim=-1)

    providers: dict[str, Callable] = {f"fastattn-{n}": ours(n) for n in fastattn_backends("softmax", device)}
    providers["naive"] = naive
    providers["torch"] = composite
    if o.compile:
        providers["torch.compile(torch)"] = compiled(composite)

    cases = []
    elt = _elt(dtype)
    for b, h, lq, lk, causal, kind in _softmax_grid(device, o, quick):
        n = b * h * lq * lk
        mask_bytes = {"none": 0, "padding": b * lk, "bias": h * lq * lk * elt}[kind]
        fwd_bytes, bwd_bytes = 2 * n * elt + mask_bytes, 3 * n * elt
        # The float64 reference of a big case: its first (batch, head), rows being independent
        # (the whole of a 2**25-element case took seconds a mode in NumPy).
        full = n <= REFERENCE_MAX_ELEMENTS // 16
        for mode in modes:
            traffic = {"fwd": fwd_bytes, "bwd": bwd_bytes, "fwd_bwd": fwd_bytes + bwd_bytes}[mode]

            def make(b=b, h=h, lq=lq, lk=lk, causal=causal, kind=kind, mode=mode):
                gen = torch.Generator().manual_seed(lk + lq)
                x = _random((b, h, lq, lk), device, dtype, mode != "fwd", gen, scale=4.0)
                mask = None
                if kind == "padding":
                    lengths = torch.tensor(_padding_lengths(b, lk), device=device)
                    mask = (torch.arange(lk, device=device) < lengths[:, None]).view(b, 1, 1, lk)
                elif kind == "bias":
                    mask = _random((1, h, lq, lk), device, dtype, False, gen)
                causal_mask = torch.ones(lq, lk, dtype=torch.bool, device=device).triu(1) if causal else None
                return x, mask, causal_mask

            def cut(t):
                return None if t is None else _np(t if full else t[:1, :1])

            def ref(x, mask, causal_mask):
                return reference.softmax(cut(x), cut(mask), scale, causal_mask is not None)

            def grad_ref(inputs, dout):
                x, mask, causal_mask = inputs
                y = reference.softmax(cut(x), cut(mask), scale, causal_mask is not None)
                return [reference.softmax_backward(dout if full else dout[:1, :1], y, scale)]

            name = f"{b}x{h}x{lq}x{lk}" + (" causal" if causal else "") + ("" if kind == "none" else f" {kind}")
            cases.append(Case(
                "softmax", name, dtype, mode, make, bytes=traffic, reference=ref, grad_reference=grad_ref,
                params={"Lk": lk, "causal": causal, "mask": kind}, sweep="Lk",
            ))
    return providers, cases


# ---------------------------------------------------------------------------------------------
# FFN Linear -> GELU -> Linear: TFLOP/s = 4 * M * D * F forward, x2 backward, x3 both.

FFN_REFERENCE_ROWS = 256


def ffn_suite(device: torch.device, dtype: torch.dtype, modes, quick: bool, options: Options | None = None):
    o = _options(options, device)
    preset = _preset(device, o)
    m, dims = {"gpu": (8192, [1024, 2048, 4096, 8192]), "cpu": (256, [256, 512]), "tiny": (16, [32])}[preset]
    if quick and preset == "gpu":
        dims = [1024, 4096]
    elif quick and preset == "cpu":
        dims = [256]
    activation = "gelu"

    def ours(name):
        return lambda x, w1, b1, w2, b2: fastattn.ffn(x, w1, b1, w2, b2, activation, backend=name)

    def naive(x, w1, b1, w2, b2):
        return fastattn.ffn(x, w1, b1, w2, b2, activation, backend="naive")

    def eager(x, w1, b1, w2, b2):
        return F.linear(F.gelu(F.linear(x, w1, b1)), w2, b2)

    @unchecked
    def matmuls(x, w1, b1, w2, b2):
        return (x @ w1.t()) @ w2.t()

    providers: dict[str, Callable] = {f"fastattn-{n}": ours(n) for n in fastattn_backends("ffn", device)}
    providers["naive"] = naive
    providers["torch"] = eager
    if o.compile:
        providers["torch.compile(torch)"] = compiled(eager)
    providers["matmuls (floor)"] = matmuls

    def ref(x, w1, b1, w2, b2):
        rows = slice(0, FFN_REFERENCE_ROWS)
        return reference.ffn(to_numpy(x[rows]), to_numpy(w1), to_numpy(b1), to_numpy(w2), to_numpy(b2), activation)

    def grad_ref(inputs, dout):
        x, w1, b1, w2, b2 = (to_numpy(t) for t in inputs)
        return list(reference.ffn_backward(dout, x, w1, b1, w2, b2, activation))

    cases = []
    for d in dims:
        f = 4 * d
        for mode in modes:
            def make(d=d, f=f, mode=mode):
                grad = mode != "fwd"
                gen = torch.Generator().manual_seed(d)
                x = _random((m, d), device, dtype, grad, gen)
                w1 = _random((f, d), device, dtype, grad, gen, scale=d**-0.5)
                b1 = _random((f,), device, dtype, grad, gen, scale=0.1)
                w2 = _random((d, f), device, dtype, grad, gen, scale=f**-0.5)
                b2 = _random((d,), device, dtype, grad, gen, scale=0.1)
                return x, w1, b1, w2, b2

            # float64 NumPy on the first rows only; gradients (which need every row) for small cases.
            small = m * f <= 2**22 and m * d * f <= 2**32
            cases.append(Case(
                "ffn", f"{m}x{d}x{f}", dtype, mode, make,
                flops=int(4 * m * d * f * {"fwd": 1, "bwd": 2, "fwd_bwd": 3}[mode]),
                reference=ref if d * f <= REFERENCE_MAX_ELEMENTS else None,
                grad_reference=grad_ref if small else None,
                params={"D": d}, sweep="D",
            ))
    return providers, cases


# ---------------------------------------------------------------------------------------------
# Model: a small GPT-style block stack (fastattn.models.GPT): TFLOP/s of the whole forward
# (2 * tokens * (12 * L * E^2 + E * vocab) + causal attention), x2 backward, x3 both.


def gpt_flops(config, b: int, t: int, mode: str) -> int:
    e, n = config.n_embd, config.n_layer
    dense = 2 * b * t * (n * (4 * e * e + 2 * config.mlp_ratio * e * e) + e * config.vocab_size)
    attn = n * attention_flops(b, config.n_head, t, t, e // config.n_head, True, "fwd")
    return int((dense + attn) * {"fwd": 1, "bwd": 2, "fwd_bwd": 3}[mode])


def torch_gpt(params: dict, idx: torch.Tensor, config) -> torch.Tensor:
    """The logits of :class:`fastattn.models.GPT` from its parameters, in plain PyTorch
    (F.layer_norm, F.linear, F.scaled_dot_product_attention, F.gelu): the peer."""
    p = params
    B, T = idx.shape
    E, H, eps = config.n_embd, config.n_head, config.layer_norm_eps
    approximate = "tanh" if config.activation == "gelu_tanh" else "none"

    def ln(x, name):
        return F.layer_norm(x, (E,), p[f"{name}.weight"], p.get(f"{name}.bias"), eps)

    x = F.embedding(idx, p["transformer.wte.weight"]) + p["transformer.wpe.weight"][:T]
    for i in range(config.n_layer):
        pre = f"transformer.h.{i}."
        qkv = F.linear(ln(x, pre + "ln_1"), p[pre + "attn.c_attn.weight"], p.get(pre + "attn.c_attn.bias"))
        q, k, v = (t.unflatten(-1, (H, -1)).transpose(1, 2) for t in qkv.chunk(3, dim=-1))
        y = F.scaled_dot_product_attention(q, k, v, is_causal=True).transpose(1, 2).reshape(B, T, E)
        x = x + F.linear(y, p[pre + "attn.c_proj.weight"], p.get(pre + "attn.c_proj.bias"))
        h = F.gelu(F.linear(ln(x, pre + "ln_2"), p[pre + "mlp.fc1.weight"], p.get(pre + "mlp.fc1.bias")), approximate=approximate)
        x = x + F.linear(h, p[pre + "mlp.fc2.weight"], p.get(pre + "mlp.fc2.bias"))
    return F.linear(ln(x, "transformer.ln_f"), p["transformer.wte.weight"])


@dataclasses.dataclass
class ModelAux:
    """The model's config and parameter names; providers build their module on first call."""

    config: object
    names: list[str]
    modules: dict = dataclasses.field(default_factory=dict)


def model_suite(device: torch.device, dtype: torch.dtype, modes, quick: bool, options: Options | None = None):
    from fastattn.reference import models as reference_models
    from fastattn.models import GPT, GPTConfig

    o = _options(options, device)
    preset = _preset(device, o)
    tokens, seqs, config = {
        "gpu": (8192, [1024, 2048, 4096], dict(n_layer=4, n_head=16, n_embd=1024, vocab_size=8192)),
        "cpu": (512, [128, 256], dict(n_layer=2, n_head=4, n_embd=128, vocab_size=512)),
        "tiny": (32, [16], dict(n_layer=1, n_head=2, n_embd=32, vocab_size=64)),
    }[preset]
    if quick and preset != "tiny":
        seqs = seqs[::2] if len(seqs) > 2 else seqs[-1:]
    seqs = o.seqs or seqs
    config = GPTConfig(block_size=max(seqs), dropout=0.0, activation="gelu", **config)

    def gpt(backend, name):
        def fn(idx, aux, *params):
            # The module holds the case's tensors themselves as its parameters (bound on the first
            # call, so gradients reach them): the peer is plain functional code, and
            # torch.func.functional_call would add its per-call swapping (~1 ms of 19 measured).
            module, bound = aux.modules.get(name, (None, ()))
            if module is None:
                module = GPT(aux.config, backend=backend, device="meta").eval()
            if len(bound) != len(params) or not all(map(operator.is_, bound, params)):
                held = dict(module.named_parameters())  # one name per tensor (tied weights once)
                new = {id(held[n]): t for n, t in zip(aux.names, params)}
                for full, old in list(module.named_parameters(remove_duplicate=False)):
                    owner, _, leaf = full.rpartition(".")
                    module.get_submodule(owner)._parameters[leaf] = new[id(old)]
                aux.modules[name] = (module, params)
            return module(idx)[0]

        return fn

    every = None
    for op in ("attention", "layer_norm", "ffn"):
        names = set(fastattn_backends(op, device))
        every = names if every is None else every & names
    providers: dict[str, Callable] = {f"fastattn-{n}": gpt(n, n) for n in sorted(every)}
    if not every and any(fastattn_backends(op, device) for op in ("attention", "layer_norm", "ffn")):
        providers["fastattn-auto"] = gpt(None, "auto")  # per op, the best backend that has it
    providers["naive"] = gpt("naive", "naive")

    def peer(idx, aux, *params):
        return torch_gpt(dict(zip(aux.names, params)), idx, aux.config)

    providers["torch"] = peer
    if o.compile:
        providers["torch.compile(torch)"] = compiled(peer)

    cases = []
    for t in seqs:
        b = max(1, tokens // t)
        has_ref = t * config.mlp_ratio * config.n_embd * config.n_layer <= 2**23
        for mode in modes:
            def make(b=b, t=t, mode=mode):
                gen = torch.Generator().manual_seed(t)
                with torch.random.fork_rng(devices=[]):
                    torch.manual_seed(0)
                    model = GPT(config, backend="naive")
                names, params = [], []
                for name, param in model.named_parameters():
                    names.append(name)
                    params.append(param.detach().to(device=device, dtype=dtype).requires_grad_(mode != "fwd"))
                idx = torch.randint(0, config.vocab_size, (b, t), generator=gen).to(device)
                return (idx, ModelAux(config, names), *params)

            def ref(idx, aux, *params):  # batch 0 only (causal: independent of the others)
                state = {n: to_numpy(p) for n, p in zip(aux.names, params)}
                return reference_models.gpt_forward(state, aux.config, idx[:1].cpu().numpy())

            cases.append(Case(
                "model", f"GPT {config.n_layer}x{config.n_embd} B{b} T{t}", dtype, mode, make,
                flops=gpt_flops(config, b, t, mode), reference=ref if has_ref else None,
                params={"T": t, "layers": config.n_layer, "E": config.n_embd}, sweep="T",
            ))
    return providers, cases


# ---------------------------------------------------------------------------------------------
# Packed variable-length attention: packed (fastattn.varlen_attention) vs padded SDPA at mixed
# lengths. TFLOP/s of the useful work (sum over sequences of 4 * H * L^2 * D, halved when
# causal); tokens/s = params["tokens"] / time.


def _mixed_lengths(tokens: int, longest: int) -> list[int]:
    """Sequence lengths from ``longest`` down to an eighth of it, cycling, summing to ``tokens``."""
    fractions = (1.0, 0.55, 0.3, 0.8, 0.15, 0.45, 0.125, 0.7)
    lengths: list[int] = []
    while sum(lengths) < tokens:
        lengths.append(max(1, int(fractions[len(lengths) % len(fractions)] * longest)))
    lengths[-1] -= sum(lengths) - tokens
    return [n for n in lengths if n > 0]


@dataclasses.dataclass
class VarlenAux:
    """What the padded peers need: the lengths, each token's row in the padded (B * Lmax) layout,
    and SDPA's mask (key padding, and the causal band)."""

    causal: bool
    lengths: list[int]
    index: torch.Tensor
    sdpa_mask: torch.Tensor


def varlen_suite(device: torch.device, dtype: torch.dtype, modes, quick: bool, options: Options | None = None):
    o = _options(options, device)
    preset = _preset(device, o)
    tokens, longest, dims, width = {
        "gpu": (16384, [1024, 4096, 16384], [64, 128], 2048),
        "cpu": (2048, [256, 1024], [64], 256),
        "tiny": (48, [32], [16], 32),
    }[preset]
    if quick and preset != "tiny":
        longest = longest[-1:]
    longest, dims = o.seqs or longest, o.dims or dims
    causals = o.causal or [False, True]

    def ours(name):
        return lambda q, k, v, cu, aux: fastattn.varlen_attention(q, k, v, cu, cu, max(aux.lengths), max(aux.lengths),
                                                                  causal=aux.causal, backend=name)

    def naive(q, k, v, cu, aux):
        return fastattn.varlen_attention(q, k, v, cu, cu, causal=aux.causal, backend="naive")

    def padded(q, k, v, cu, aux):
        """Pad to (B, H, Lmax, D), SDPA with the key-padding (+ causal) mask, unpad: what packed
        data costs without a varlen kernel (the copies are part of it)."""
        B, L = len(aux.lengths), max(aux.lengths)

        def pad(t):
            return t.new_zeros(B * L, *t.shape[1:]).index_copy(0, aux.index, t).view(B, L, *t.shape[1:]).transpose(1, 2)

        out = F.scaled_dot_product_attention(pad(q), pad(k), pad(v), attn_mask=aux.sdpa_mask,
                                             enable_gqa=q.shape[1] != k.shape[1])
        return out.transpose(1, 2).reshape(B * L, *q.shape[1:2], v.shape[-1]).index_select(0, aux.index)

    def per_sequence(q, k, v, cu, aux):
        """SDPA once per sequence (no padding, one launch each)."""
        outs, start = [], 0
        for n in aux.lengths:
            sl = slice(start, start + n)
            outs.append(F.scaled_dot_product_attention(q[sl].transpose(0, 1), k[sl].transpose(0, 1), v[sl].transpose(0, 1),
                                                       is_causal=aux.causal).transpose(0, 1))
            start += n
        return torch.cat(outs)

    providers: dict[str, Callable] = {f"fastattn-{n}": ours(n) for n in fastattn_backends("varlen_attention", device)}
    providers["naive"] = naive
    providers["torch.sdpa (padded)"] = padded
    providers["torch.sdpa (per sequence)"] = per_sequence

    cases = []
    for d in dims:
        h = max(1, width // d)
        for top in longest:
            lengths = _mixed_lengths(tokens, top)
            first = lengths[0]
            has_ref = h * first * first <= REFERENCE_MAX_ELEMENTS
            for causal in causals:
                work = sum(attention_flops(1, h, n, n, d, causal, "fwd") for n in lengths)
                for mode in modes:
                    def make(lengths=lengths, h=h, d=d, causal=causal, mode=mode):
                        grad = mode != "fwd"
                        gen = torch.Generator().manual_seed(len(lengths) * 100 + d)
                        total, B, L = sum(lengths), len(lengths), max(lengths)
                        q, k, v = (_random((total, h, d), device, dtype, grad, gen) for _ in range(3))
                        cu = torch.tensor([0, *itertools.accumulate(lengths)], dtype=torch.int32, device=device)
                        index = torch.cat([b * L + torch.arange(n) for b, n in enumerate(lengths)]).to(device)
                        keep = torch.arange(L)[None, :] < torch.tensor(lengths)[:, None]
                        mask = keep.view(B, 1, 1, L)
                        if causal:
                            mask = mask & torch.ones(L, L, dtype=torch.bool).tril()
                        return q, k, v, cu, VarlenAux(causal, lengths, index, mask.to(device))

                    def ref(q, k, v, cu, aux):  # the first sequence
                        n = aux.lengths[0]
                        return reference.varlen_attention(_np(q[:n]), _np(k[:n]), _np(v[:n]), [0, n], [0, n],
                                                          causal=aux.causal)[0]

                    def grad_ref(inputs, dout):
                        q, k, v, cu, aux = inputs
                        n = aux.lengths[0]
                        return list(reference.varlen_attention_backward(
                            dout[:n], _np(q[:n]), _np(k[:n]), _np(v[:n]), [0, n], [0, n], causal=aux.causal))

                    name = f"{len(lengths)} seqs {min(lengths)}-{max(lengths)} H{h} D{d}" + (" causal" if causal else "")
                    cases.append(Case(
                        "varlen", name, dtype, mode, make,
                        flops=int(work * {"fwd": 1.0, "bwd": 2.5, "fwd_bwd": 3.5}[mode]),
                        reference=ref if has_ref else None, grad_reference=grad_ref if has_ref else None,
                        params={"tokens": tokens, "Lmax": top, "D": d, "causal": causal,
                                "padded_tokens": len(lengths) * max(lengths)},
                        sweep="Lmax",
                    ))
    return providers, cases


# ---------------------------------------------------------------------------------------------
# Paged decoding: one new token per sequence over a paged cache of mixed lengths (L/2 .. L),
# against SDPA on a padded contiguous cache. GB/s counts the K/V bytes the sequences own (the
# floor of a decode step); tokens/s = params["tokens"] (= B) / time.


@dataclasses.dataclass
class DecodeAux:
    lengths: list[int]
    k: torch.Tensor  # the same keys in a padded contiguous (B, Hkv, L, D) cache, for SDPA
    v: torch.Tensor
    mask: torch.Tensor  # (B, 1, 1, L) key padding


def decode_suite(device: torch.device, dtype: torch.dtype, modes, quick: bool, options: Options | None = None):
    o = _options(options, device)
    preset = _preset(device, o)
    seqs, batches, h, hkv, d, block = {
        "gpu": ([1024, 4096, 8192, 16384, 32768], [1, 8, 64], 32, 8, 128, 16),
        "cpu": ([1024, 4096], [1, 8], 8, 2, 64, 16),
        "tiny": ([32], [2], 2, 1, 16, 4),
    }[preset]
    if quick and preset == "gpu":
        seqs, batches = [4096, 32768], [1, 64]
    elif quick and preset == "cpu":
        seqs, batches = [4096], [8]
    seqs, d = o.seqs or seqs, (o.dims or [d])[0]

    def ours(name):
        return lambda q, kc, vc, table, lens, aux: fastattn.paged_attention(q, kc, vc, table, lens, backend=name)

    def naive(q, kc, vc, table, lens, aux):
        return fastattn.paged_attention(q, kc, vc, table, lens, backend="naive")

    def sdpa(q, kc, vc, table, lens, aux):
        return F.scaled_dot_product_attention(q, aux.k, aux.v, attn_mask=aux.mask, enable_gqa=True)

    providers: dict[str, Callable] = {f"fastattn-{n}": ours(n) for n in fastattn_backends("paged_attention", device)}
    providers["naive"] = naive
    providers["torch.sdpa (padded cache)"] = sdpa

    cases = []
    elt = _elt(dtype)
    for L in seqs:
        for B in batches:
            lengths = [L - (b * L) // (2 * B) for b in range(B)]
            traffic = sum(lengths) * hkv * 2 * d * elt + 2 * B * h * d * elt

            def make(L=L, B=B, lengths=lengths):
                gen = torch.Generator().manual_seed(L + B)
                per_row = -(-L // block)
                q = _random((B, h, 1, d), device, dtype, False, gen)
                k = _random((B, hkv, L, d), device, dtype, False, gen)
                v = _random((B, hkv, L, d), device, dtype, False, gen)
                # Row b owns blocks b, b + B, ...: the pool holds them interleaved.
                table = torch.arange(B * per_row, dtype=torch.int32).view(per_row, B).T.contiguous()
                kc = torch.zeros(B * per_row, block, hkv, d, dtype=dtype, device=device)
                vc = torch.zeros_like(kc)
                lens = torch.zeros(B, dtype=torch.int32, device=device)
                table = table.to(device)
                fastattn.paged_cache_append(kc, vc, table, lens, k, v)
                lens = torch.tensor(lengths, dtype=torch.int32, device=device)
                mask = (torch.arange(L)[None, :] < torch.tensor(lengths)[:, None]).view(B, 1, 1, L).to(device)
                return q, kc, vc, table, lens, DecodeAux(lengths, k, v, mask)

            def ref(q, kc, vc, table, lens, aux):  # sequence 0
                n = aux.lengths[0]
                return reference.attention(_np(q[:1]), _np(aux.k[:1, :, :n]), _np(aux.v[:1, :, :n]),
                                           causal="bottom_right", enable_gqa=True)[0]

            cases.append(Case(
                "decode", f"B{B} L{L} H{h}/{hkv} D{d}", dtype, "fwd", make, bytes=traffic,
                reference=ref if L * h <= REFERENCE_MAX_ELEMENTS else None,
                params={"tokens": B, "L": L, "B": B, "D": d}, sweep="L",
            ))
    return providers, cases


# ---------------------------------------------------------------------------------------------
# Attention's JVP (forward-mode AD): time and peak memory against torch's math-path JVP.


@dataclasses.dataclass
class JvpAux:
    causal: bool
    tangents: tuple  # of q, k, v


def jvp_suite(device: torch.device, dtype: torch.dtype, modes, quick: bool, options: Options | None = None):
    """``torch.func.jvp`` of attention with tangents of q, k and v (the output's tangent is timed,
    the primal comes with it). Peers: torch's JVP of ``F.scaled_dot_product_attention`` on its
    math path (the only SDPA kernel with forward AD; O(L^2) memory) and the naive backend's; the
    plain forward of our fastest backend is a reference point (the JVP's cost in forwards). Only
    the ``fwd`` mode exists (one JVP call); peak memory is measured on CPUs too."""
    from torch.nn.attention import SDPBackend, sdpa_kernel

    o = _options(options, device)
    preset = _preset(device, o)
    seqs, d, h, tokens = {
        "gpu": ([512, 1024, 2048, 4096, 8192], 64, 16, 16384),
        "cpu": ([512, 1024, 2048], 64, 4, 2048),
        "tiny": ([32], 16, 2, 32),
    }[preset]
    if quick:
        seqs = seqs[:: 2]
    seqs, d = o.seqs or seqs, (o.dims or [d])[0]
    causal_variants = o.causal or [False, True]

    def ours(name):
        def fn(q, k, v, mask, aux):
            f = lambda q, k, v: fastattn.attention(q, k, v, mask, causal=aux.causal, backend=name)  # noqa: E731
            return torch.func.jvp(f, (q, k, v), aux.tangents)[1]

        return fn

    def naive(q, k, v, mask, aux):
        f = lambda q, k, v: fastattn.attention(q, k, v, mask, causal=aux.causal, backend="naive")  # noqa: E731
        return torch.func.jvp(f, (q, k, v), aux.tangents)[1]

    def math_jvp(q, k, v, mask, aux):
        f = lambda q, k, v: F.scaled_dot_product_attention(q, k, v, is_causal=aux.causal)  # noqa: E731
        with sdpa_kernel(SDPBackend.MATH):
            return torch.func.jvp(f, (q, k, v), aux.tangents)[1]

    jvp_backends = [n for n in fastattn_backends("attention", device)
                    if "jvp" in backends._REGISTRY[n].features.get("attention", ())]
    providers: dict[str, Callable] = {f"fastattn-{n}": ours(n) for n in jvp_backends}
    providers["naive"] = naive
    providers["torch.sdpa[math] jvp"] = math_jvp
    if jvp_backends:
        best = jvp_backends[0]
        fwd = lambda q, k, v, mask, aux: fastattn.attention(q, k, v, mask, causal=aux.causal, backend=best)  # noqa: E731
        fwd.bench_check = False  # not the op: its output is O, not O's tangent
        providers[f"forward only (fastattn-{best})"] = fwd

    cases = []
    for L in seqs:
        b = max(1, tokens // L)
        for causal in causal_variants:
            def make(b=b, L=L, causal=causal):
                gen = torch.Generator().manual_seed(L + causal)
                q, k, v, tq, tk, tv = (_random((b, h, L, d), device, dtype, False, gen) for _ in range(6))
                return q, k, v, None, JvpAux(causal, (tq, tk, tv))

            def ref(q, k, v, mask, aux):  # batch 0, head 0
                tq, tk, tv = aux.tangents
                c = lambda t: _np(t[:1, :1])  # noqa: E731
                return reference.attention_jvp(c(q), c(k), c(v), None, c(tq), c(tk), c(tv), causal=aux.causal)[0]

            # forward (2 matmuls) + one per tangent of q, k + (P S') V + P V' + O recomputed
            flops = attention_flops(b, h, L, L, d, causal, "fwd") * 3
            cases.append(Case(
                "jvp", f"{b}x{h}x{L}x{d}" + (" causal" if causal else ""), dtype, "fwd", make,
                flops=flops, reference=ref if L * L <= REFERENCE_MAX_ELEMENTS else None,
                params={"L": L, "D": d, "causal": causal}, sweep="L", cpu_memory=True,
            ))
    return providers, cases


SUITES = {
    "attention": attention_suite,
    "jvp": jvp_suite,
    "softmax": softmax_suite,
    "layer_norm": layer_norm_suite,
    "ffn": ffn_suite,
    "varlen": varlen_suite,
    "decode": decode_suite,
}
if importlib.util.find_spec("fastattn.models") is not None:
    SUITES["model"] = model_suite
