"""Scaled dot-product attention: the public functions, their validation, and the backends.

Backend contract (what ``backends.register_backend("attention", name, fn)`` receives)::

    fn(q, k, v, mask, scale, offset, left, right, dropout_p, seed) -> (out, lse)

with inputs already validated: q (B, H, Lq, D), k (B, Hkv, Lk, D), v (B, Hkv, Lk, Dv); mask None
or a (B, H, Lq, Lk) broadcast *view* of the user's mask (bool True = allowed, or float added to
the scores); the band ``(offset, left, right)`` of docs/numerics.md; ``seed`` an int. ``out`` is
(B, H, Lq, Dv) in q's dtype, ``lse`` (B, H, Lq) float32. Gradients, the float mask's included,
flow through autograd.

Derivatives (docs/numerics.md): the compiled backends' ops run inside :class:`_Attention`, an
autograd.Function that gives them reverse mode (the fused backward kernel), forward mode (the
backend's fused JVP kernel, ``attention_jvp`` / ``triton_attention_jvp``) and double backward (a
backward built from differentiable pieces, :func:`_differentiable_backward`); ``naive`` is plain
PyTorch and differentiates itself. Under torch.compile (which cannot trace a custom ``jvp``) the
ops are called directly and their registered autograd (first order) applies.
"""

from __future__ import annotations

import math
from typing import Optional


import torch
from torch import Tensor

from fastattn import backends
from fastattn.ops._library import (
    BELOW_AUTOGRAD, IS_COMPILING, as_float, broadcast_shapes, broadcasts_to, check_like, define_op,
    eager_fast_path, eager_first, empty_or_none, forward_ad_needs, last_dim_contiguous,
    no_autograd, op_callable, triton_kernels,
)

_DTYPES = (torch.float16, torch.bfloat16, torch.float32, torch.float64)
_CAUSAL = (False, True, "top_left", "bottom_right")


# ---------------------------------------------------------------------------------------------
# The band (causal / sliding window) and the dropout RNG, as in docs/numerics.md.


def band(lq: int, lk: int, causal=False, window=None) -> tuple[int, int, int]:
    """``(offset, left, right)``: query i may attend key j iff i+offset-left <= j <= i+offset+right.

    Causal sets ``right = min(right, 0)``; a window ``(left, right)`` (None = unbounded) is aligned
    bottom-right with ``causal="bottom_right"``, top-left otherwise; unbounded is ``lq + lk``.
    """
    unbounded = lq + lk
    offset = lk - lq if causal == "bottom_right" else 0
    left = right = unbounded
    if window is not None:
        left = unbounded if window[0] is None else int(window[0])
        right = unbounded if window[1] is None else int(window[1])
    if causal is not False:
        right = min(right, 0)
    return offset, left, right


def _band_mask(lq, lk, offset, left, right, device) -> Tensor:
    i = torch.arange(lq, device=device)[:, None] + offset
    j = torch.arange(lk, device=device)[None, :]
    return (j >= i - left) & (j <= i + right)


_M32 = 0xFFFFFFFF


def _fmix32(x: Tensor) -> Tensor:
    """MurmurHash3's finalizer on uint32 values held in int64 (products wrap mod 2^64, and the low
    32 bits, all we keep, are those of the uint32 product)."""
    x = x ^ (x >> 16)
    x = (x * 0x85EBCA6B) & _M32
    x = x ^ (x >> 13)
    x = (x * 0xC2B2AE35) & _M32
    return x ^ (x >> 16)


def dropout_keep_mask(seed: int, b: int, h: int, lq: int, lk: int, p: float, device, row0: int = 0) -> Tensor:
    """Bool (b, h, lq, lk) keep-mask of the shared counter-based RNG (docs/numerics.md), for the
    query rows ``row0 .. row0 + lq - 1``."""
    bh = torch.arange(b * h, device=device, dtype=torch.int64).view(b, h, 1, 1)
    stream = _fmix32((seed + 0x9E3779B9 * bh) & _M32)
    i = torch.arange(row0, row0 + lq, device=device, dtype=torch.int64).view(lq, 1)
    j = torch.arange(lk, device=device, dtype=torch.int64).view(1, lk)
    r = _fmix32(_fmix32((i * lk + j) & _M32) ^ stream)
    return r >= math.floor(p * 2**32)


# ---------------------------------------------------------------------------------------------
# naive: eager PyTorch with the full (B, H, Lq, Lk) score matrix — the baseline.


def _pairwise(a, b, sel):
    """``sum_j where(sel_ij, a_i* b_j)``-style product that never combines a masked-out pair: ``a``
    (..., M, 1, K) or (..., M, N, 1) against ``b``, both zeroed where ``sel`` (broadcast) is False
    *before* the product, so a NaN or inf there meets no 0 (and its gradient stays 0 too)."""
    return torch.where(sel, a, 0.0) * torch.where(sel, b, 0.0)


def _all_finite(*tensors) -> bool:
    if torch.compiler.is_compiling():
        return True
    try:
        return all(bool(torch.isfinite(t).all()) for t in tensors)
    except RuntimeError:  # under torch.func.vmap no data-dependent branch: as under compile
        return True


def _naive(q, k, v, mask, scale, offset, left, right, dropout_p, seed, row0=0):
    """The naive backend; ``row0`` > 0 computes the rows ``row0 ..`` of a longer query (whose
    first row is 0) given their q and mask rows: the band's ``offset`` is then the caller's
    ``offset + row0`` and dropout draws those rows' counters (:func:`_differentiable_backward`)."""
    B, H, Lq, _ = q.shape
    Lk = k.shape[2]
    group = H // k.shape[1]
    k = k.repeat_interleave(group, dim=1)
    v = v.repeat_interleave(group, dim=1)
    dtype, acc = q.dtype, torch.promote_types(q.dtype, torch.float32)
    q, k, v = q.to(acc), k.to(acc), v.to(acc)
    allowed = _band_mask(Lq, Lk, offset, left, right, q.device)
    if mask is not None and mask.dtype == torch.bool:
        allowed = allowed & mask
    elif mask is not None:
        allowed = allowed & (mask != float("-inf"))  # -inf masks out, as a False would
    allowed = allowed.expand(B, H, Lq, Lk)
    # The NaN rule (docs/numerics.md): a masked-out pair (i, j) never meets q_i with k_j nor
    # p_ij with v_j, so a NaN / inf held only by masked-out keys or rows does not leak (as 0 * NaN
    # would), forward or backward. Matmuls do meet them: when an operand is not all finite the
    # products are formed pairwise, masked first (O(Lq * Lk * D) memory; one reduction per check,
    # a synchronization on a GPU). Under torch.compile the check (a data-dependent branch) is
    # skipped: compiled naive takes the matmuls, which hold the rule for finite inputs only; so
    # does naive under torch.func.vmap, where the check cannot run.
    sel = allowed.unsqueeze(-1)
    if _all_finite(q, k):
        s = (q @ k.transpose(-1, -2)) * scale
    else:
        s = _pairwise(q.unsqueeze(-2), k.unsqueeze(-3), sel).sum(-1) * scale
    if mask is not None and mask.dtype != torch.bool:
        s = s + mask.to(acc)
    s = s.masked_fill(~allowed, float("-inf"))
    # Rows with nothing to attend: softmax over zeros (finite), then zeroed, so the output and
    # every gradient of those rows is 0 rather than NaN. A row with a NaN score is NaN (not dead);
    # its masked-out entries are 0 all the same.
    dead = torch.isneginf(s).all(-1, keepdim=True).detach()
    p = torch.softmax(s.masked_fill(dead, 0.0), dim=-1).masked_fill(~allowed | dead, 0.0)
    if dropout_p > 0:
        keep = dropout_keep_mask(seed, B, H, Lq, Lk, dropout_p, q.device, row0)
        p = p * keep / (1.0 - dropout_p)
    if _all_finite(v):
        out = p @ v
    else:
        out = _pairwise(p.unsqueeze(-1), v.unsqueeze(-3), sel).sum(-2)
    # lse is differentiable (both modes); dead rows: -inf with tangent and gradient 0. Written
    # out (max + log sum exp(s - max), the max held constant) rather than torch.logsumexp, which
    # returns +inf for a row with a +inf score where IEEE arithmetic (the reference, the kernels)
    # gives NaN.
    live = s.masked_fill(dead, 0.0)
    top = live.amax(-1, keepdim=True).detach()
    lse = (top + torch.log(torch.exp(live - top).sum(-1, keepdim=True))).squeeze(-1)
    lse = lse.masked_fill(dead.squeeze(-1), float("-inf"))
    return out.to(dtype), lse.to(torch.float32)


# ---------------------------------------------------------------------------------------------
# Compiled backends: one fake impl and one autograd formula for the C++ and Triton ops.


def _fake_fwd(q, k, v, mask, scale, offset, left, right, dropout_p, seed):
    B, H, Lq, _ = q.shape
    out = q.new_empty(B, H, Lq, v.shape[-1])
    return out, q.new_empty(B, H, Lq, dtype=torch.float32)


def _fake_bwd(dout, q, k, v, out, lse, mask, scale, offset, left, right, dropout_p, seed, need_dmask):
    B, H, Lq, _ = q.shape
    dtype = torch.float64 if q.dtype == torch.float64 else torch.float32  # the accumulation type
    dmask = q.new_empty(B, H, Lq, k.shape[2], dtype=dtype) if need_dmask else q.new_empty(0)
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v), dmask


def _setup_context(ctx, inputs, output):
    q, k, v, mask, scale, offset, left, right, dropout_p, seed = inputs
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, mask)
    ctx.args = (scale, offset, left, right, dropout_p, seed)
    ctx.float_mask = mask is not None and mask.is_floating_point()


def _fused_grads(bwd, dout, saved, args, need_dmask):
    """dq, dk, dv, dmask (None unless ``need_dmask``) by a backend's fused backward op;
    ``saved`` = (q, k, v, out, lse, mask) of the forward."""
    q, k, v, out, lse, mask = saved
    dq, dk, dv, dmask = bwd(last_dim_contiguous(dout), q, k, v, out, lse, mask, *args, need_dmask)
    dmask = empty_or_none(dmask)
    return dq, dk, dv, None if dmask is None else dmask.to(mask.dtype)


def _backward(ops, ctx, dout, _dlse):
    if dout is None:  # only lse was used: this formula gives lse no gradient (_Attention does)
        return (None,) * 10
    need_dmask = ctx.float_mask and ctx.needs_input_grad[3]
    return (*_fused_grads(ops.bwd, dout, ctx.saved_tensors, ctx.args, need_dmask), *(None,) * 6)


def _triton_fwd(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Optional[Tensor],
    scale: float,
    offset: int,
    left: int,
    right: int,
    dropout_p: float,
    seed: int,
) -> tuple[Tensor, Tensor]:
    _check_op(q, k, v, mask, dropout_p)
    q, k, v = (last_dim_contiguous(t) for t in (q, k, v))  # the layout the kernels take
    return _kernels.attention_forward(q, k, v, mask, scale, offset, left, right, dropout_p, seed)


def _triton_bwd(
    dout: Tensor,
    q: Tensor,
    k: Tensor,
    v: Tensor,
    out: Tensor,
    lse: Tensor,
    mask: Optional[Tensor],
    scale: float,
    offset: int,
    left: int,
    right: int,
    dropout_p: float,
    seed: int,
    need_dmask: bool,
) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    B, H, Lq, _ = q.shape
    _check_op(q, k, v, mask, dropout_p, dout=(dout, (B, H, Lq, v.shape[-1]), q.dtype),
              out=(out, (B, H, Lq, v.shape[-1]), q.dtype), lse=(lse, (B, H, Lq), torch.float32))
    dout, q, k, v, out = (last_dim_contiguous(t) for t in (dout, q, k, v, out))
    dq, dk, dv, dmask = _kernels.attention_backward(
        dout, q, k, v, out, lse, mask, scale, offset, left, right, dropout_p, seed, need_dmask
    )
    return dq, dk, dv, dmask if dmask is not None else q.new_empty(0)


# ---------------------------------------------------------------------------------------------
# Forward-mode AD: one JVP op per compiled backend (same schema), its fake impl.


def _fake_jvp(q, k, v, mask, tq, tk, tv, tmask, scale, offset, left, right, dropout_p, seed):
    B, H, Lq, _ = q.shape
    return q.new_empty(B, H, Lq, v.shape[-1]), q.new_empty(B, H, Lq, dtype=torch.float32)


def _triton_jvp(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    mask: Optional[Tensor],
    tq: Optional[Tensor],
    tk: Optional[Tensor],
    tv: Optional[Tensor],
    tmask: Optional[Tensor],
    scale: float,
    offset: int,
    left: int,
    right: int,
    dropout_p: float,
    seed: int,
) -> tuple[Tensor, Tensor]:
    if tmask is not None and (mask is None or mask.dtype == torch.bool):
        raise ValueError(f"tmask (the mask's tangent) needs a float mask of its shape, got mask "
                         f"{None if mask is None else mask.dtype}")
    tangents = {name: (t, p.shape, p.dtype) for name, t, p in
                (("tq", tq, q), ("tk", tk, k), ("tv", tv, v), ("tmask", tmask, mask)) if t is not None}
    _check_op(q, k, v, mask, dropout_p, **tangents)
    q, k, v, tq, tk, tv = (last_dim_contiguous(t) for t in (q, k, v, tq, tk, tv))
    return _jvp_kernels.attention_jvp(q, k, v, mask, tq, tk, tv, tmask, scale, offset, left, right,
                                      dropout_p, seed)


# ---------------------------------------------------------------------------------------------
# vmap (torch.func.vmap, jacfwd) of the compiled ops: the vmapped dim is folded into the batch.


def _fold_vmap_rule(op):
    """A vmap rule for an attention op whose tensors all lead with the batch dim B: batched
    tensors become (N * B, ...) (unbatched ones are expanded), outputs are unfolded to
    (N, B, ...). Dropout draws per (b, h), so with dropout_p > 0 the op runs once per vmapped
    element instead (the same masks as a Python loop would draw)."""

    def rule(info, in_dims, *args):
        n = info.batch_size

        def fold(x, d):
            if not isinstance(x, Tensor):
                return x
            x = x.movedim(d, 0) if d is not None else x.unsqueeze(0).expand(n, *x.shape)
            return x.reshape(n * x.shape[1], *x.shape[2:])

        def unfold(y):
            if y.numel() == 0 and y.dim() == 1:  # an output that was not asked for
                return y, None
            return y.reshape(n, -1, *y.shape[1:]), 0

        if args[_arg_index(op, "dropout_p")] > 0:
            outs = [op(*(a.select(d, i) if isinstance(a, Tensor) and d is not None else a
                         for a, d in zip(args, in_dims))) for i in range(n)]
            return tuple(torch.stack(ys) for ys in zip(*outs)), tuple(0 for _ in outs[0])
        outs = op(*(fold(a, d) for a, d in zip(args, in_dims)))
        folded = [unfold(y) for y in outs]
        return tuple(y for y, _ in folded), tuple(d for _, d in folded)

    torch.library.register_vmap(op, rule)


def _arg_index(op, name: str) -> int:
    schema = op._opoverload._schema if hasattr(op, "_opoverload") else op._schema  # CustomOpDef / OpOverload
    return [a.name for a in schema.arguments].index(name)


# ---------------------------------------------------------------------------------------------
# Derivatives of the compiled backends.

# Score entries (B * H * rows * Lk) per query chunk of the differentiable backward.
_CHUNK_SCORES = 1 << 22


def _cotangent(t, r0, r1, q, v):
    """Rows r0:r1 of a cotangent of out (``v`` given: (B, H, Lq, Dv) in q's dtype) or of lse
    (float32 (B, H, Lq)), zeros for None."""
    if t is not None:
        return t[:, :, r0:r1].to(q.dtype if v is not None else torch.float32)
    B, H = q.shape[:2]
    shape = (B, H, r1 - r0, v.shape[-1]) if v is not None else (B, H, r1 - r0)
    return q.new_zeros(shape, dtype=q.dtype if v is not None else torch.float32)


def _graph_vjp(chunk, xs, cot_out, cot_lse):
    """``chunk``'s vjp by torch.autograd.grad with create_graph=True (differentiable again; it
    runs under checkpoint, whose saved-tensor hooks torch.func.vjp does not support)."""
    with torch.enable_grad():
        outs = chunk(*xs)
        grads = torch.autograd.grad(outs, xs, (cot_out, cot_lse), create_graph=True, allow_unused=True)
    return tuple(torch.zeros_like(x) if g is None else g for x, g in zip(xs, grads))


def _differentiable_backward(q, k, v, mask, args, dout, dlse, needs, create=False):
    """dq, dk, dv, dmask (None where not ``needs``) of ``<dout, out> + <dlse, lse>`` by the naive
    backend's differentiable operations (``torch.func.vjp`` of it), chunked over query rows (rows
    are independent). With ``create`` (``create_graph=True``) the result is differentiable again
    (double backward): each chunk runs under activation checkpointing, so the graph holds the
    chunks' inputs only (O(L) beside q, k, v) and the double backward recomputes one chunk's
    (B, H, rows, Lk) intermediates at a time; without, each chunk's are freed before the next.
    Peak either way: O(B * H * Lk) times a chunk's rows (``_CHUNK_SCORES`` score entries)."""
    scale, offset, left, right, dropout_p, seed = args
    B, H, Lq, _ = q.shape
    Lk = k.shape[2]
    wrt = [i for i, n in enumerate(needs) if n]
    rows = max(1, _CHUNK_SCORES // max(1, B * H * Lk))
    grads = [[] for _ in range(4)]
    for r0 in range(0, Lq, rows):
        r1 = min(Lq, r0 + rows)
        inputs = [q[:, :, r0:r1], k, v, None if mask is None else mask[:, :, r0:r1]]

        def chunk(*xs, inputs=inputs, r0=r0):
            a = list(inputs)
            for i, x in zip(wrt, xs):
                a[i] = x
            return _naive(*a, scale, offset + r0, left, right, dropout_p, seed, r0)

        xs = [inputs[i] for i in wrt]
        if create and torch._C._functorch.peek_interpreter_stack() is None:
            # Checkpointed (not under a torch.func transform: its wrapped tensors take the vjp): the graph keeps this chunk's inputs, not its (B, H, rows, Lk)
            # intermediates, which the double backward recomputes one chunk at a time.
            cots = (_cotangent(dout, r0, r1, q, v), _cotangent(dlse, r0, r1, q, None))
            chunk_grads = torch.utils.checkpoint.checkpoint(
                _graph_vjp, chunk, xs, *cots, use_reentrant=False)
        else:
            (out_c, lse_c), pull = torch.func.vjp(chunk, *xs)
            cot_out = torch.zeros_like(out_c) if dout is None else dout[:, :, r0:r1].to(out_c.dtype)
            cot_lse = torch.zeros_like(lse_c) if dlse is None else dlse[:, :, r0:r1].to(lse_c.dtype)
            chunk_grads = pull((cot_out, cot_lse))
        for i, g in zip(wrt, chunk_grads):
            grads[i].append(g)
    dq = torch.cat(grads[0], 2) if needs[0] else None
    dk = torch.stack(grads[1]).sum(0) if needs[1] else None
    dv = torch.stack(grads[2]).sum(0) if needs[2] else None
    dmask = torch.cat(grads[3], 2) if needs[3] else None
    return dq, dk, dv, dmask


try:  # what torch's Function.apply uses on its way to the C++ apply (see _Attention.apply)
    from torch._functorch.utils import unwrap_dead_wrappers as _unwrap_dead_wrappers

    _FAST_APPLY = hasattr(torch._C, "_are_functorch_transforms_active")
except ImportError:  # pragma: no cover - a torch without them takes torch's own path
    _FAST_APPLY = False


class _Attention(torch.autograd.Function):
    """A compiled backend's forward op with all three derivatives: backward by its fused kernel
    (or, for ``create_graph=True`` and for a gradient flowing into lse, by
    :func:`_differentiable_backward`), forward-mode AD by its fused JVP op, vmap by the ops'
    rules (:func:`_fold_vmap_rule`)."""

    generate_vmap_rule = True

    @classmethod
    def apply(cls, *args):
        """torch's ``Function.apply`` binds default arguments through ``inspect.signature`` on
        every call of a Function with ``setup_context`` (~180 us of the ~440 us a small CPU call
        took, measured). :meth:`forward` has no defaults and is always called with all its
        arguments, so outside functorch's transforms this goes straight to the C++ apply, as
        torch's own ``apply`` does after binding; under them, torch's path."""
        if _FAST_APPLY and not torch._C._are_functorch_transforms_active():
            return super(torch.autograd.Function, cls).apply(*_unwrap_dead_wrappers(args))
        return super().apply(*args)

    @staticmethod
    def forward(q, k, v, mask, scale, offset, left, right, dropout_p, seed, fwd, bwd, jvp, name):
        # fwd is the registered backend function (eager_autograd: under this Function, grad mode
        # is off, so in plain eager mode it calls the op below its Python autograd layer)
        return fwd(q, k, v, mask, scale, offset, left, right, dropout_p, seed)

    @staticmethod
    def setup_context(ctx, inputs, output):
        q, k, v, mask, scale, offset, left, right, dropout_p, seed, _, bwd, jvp, name = inputs
        out, lse = output
        ctx.save_for_backward(q, k, v, out, lse, mask)
        ctx.save_for_forward(q, k, v, mask)
        ctx.args = (scale, offset, left, right, dropout_p, seed)
        ctx.ops = (bwd, jvp, name)
        ctx.float_mask = mask is not None and mask.is_floating_point()
        ctx.set_materialize_grads(False)

    @staticmethod
    def backward(ctx, dout, dlse):
        # (restated for the cpu backend's one-call training path: csrc/eager.cpp AttentionFn;
        # change both, tests/test_eager_fast_path.py compares their bits)
        q, k, v, out, lse, mask = ctx.saved_tensors
        needs = (*ctx.needs_input_grad[:3], ctx.float_mask and ctx.needs_input_grad[3])
        none = (None,) * 10
        if (dout is None and dlse is None) or not any(needs):
            return (None, None, None, None, *none)
        # create_graph=True: grad mode is on and the inputs are on a graph (not so under the
        # reverse-mode transforms of torch.func, whose inputs this level sees unwrapped)
        create = torch.is_grad_enabled() and any(t is not None and t.requires_grad for t in (q, k, v, mask))
        if create or dlse is not None:
            return (*_differentiable_backward(q, k, v, mask, ctx.args, dout, dlse, needs, create), *none)
        return (*_fused_grads(ctx.ops[0], dout, ctx.saved_tensors, ctx.args, needs[3]), *none)

    @staticmethod
    def jvp(ctx, tq, tk, tv, tmask, *_):
        q, k, v, mask = ctx.saved_tensors
        _, jvp, name = ctx.ops
        if jvp is None:  # backends.select refuses these before; a last guard, never a wrong tangent
            raise ValueError(f"backend {name!r} has no forward-mode AD (JVP) kernel for attention")
        if not ctx.float_mask:
            tmask = None
        tq, tk, tv = (last_dim_contiguous(t) for t in (tq, tk, tv))
        return jvp(q, k, v, mask, tq, tk, tv, tmask, *ctx.args)


def _within(max_head_dim: int, max_len: int | None = None):
    """A backend's limits on the call (the facts the public function passes to select)."""

    def limits(head_dim=None, head_dim_v=None, lq=None, lk=None, **_):
        worst = max(head_dim or 0, head_dim_v or 0)
        if worst > max_head_dim:
            return f"head dim {worst} > {max_head_dim}"
        longest = max(lq or 0, lk or 0)
        if max_len is not None and longest > max_len:
            return f"sequence length {longest} > {max_len}"
        return None

    return limits


_kernels = triton_kernels("attention_launch")
_jvp_kernels = triton_kernels("attention_jvp")
_DEFINED = define_op(
    "attention",
    fake_fwd=_fake_fwd,
    fake_bwd=_fake_bwd,
    fake_jvp=_fake_jvp,
    setup_context=_setup_context,
    backward=_backward,
    triton_fwd=_triton_fwd,
    triton_bwd=_triton_bwd,
    triton_jvp=_triton_jvp,
    naive=_naive,
    caps={
        "triton": dict(limits=_within(256)),  # kernels/attention.py _MAX_HEAD_DIM
        # csrc/cuda/attention_kernels.cuh: 16-bit inputs only, kMaxHeadDim, kMaxSeqLen
        "cuda": dict(dtypes=(torch.float16, torch.bfloat16), limits=_within(256, 1 << 29)),
    },
    each_op=_fold_vmap_rule,
)
# name -> (fwd, bwd, jvp, op) of the compiled backends: the registered function, the ops of
# _Attention's derivatives, and the forward op's own callable (called directly when nothing is
# differentiated: fewer Python steps, each costly in a model where every call runs cold).
_COMPILED: dict[str, tuple] = {name: (_DEFINED.registered[name], eager_first(c.bwd), c.jvp,
                                      op_callable(c.fwd))
                               for name, c in _DEFINED.compiled.items()}


# ---------------------------------------------------------------------------------------------
# Public functions.


def _validate(q, k, v, mask, dropout_p, enable_gqa, causal, window):
    for name, t in (("query", q), ("key", k), ("value", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
        if t.dim() != 4:
            raise ValueError(f"{name} must be 4-D (batch, heads, length, dim), got shape {list(t.shape)}")
    if q.dtype not in _DTYPES:
        raise TypeError(f"query has dtype {q.dtype}; supported: {list(_DTYPES)}")
    if not q.dtype == k.dtype == v.dtype:
        raise TypeError(f"query, key and value must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    device = q.device
    if k.device != device or v.device != device:
        raise ValueError(f"query, key and value must be on one device, got {q.device}, {k.device}, {v.device}")
    B, H, _, D = q.shape
    if k.shape[0] != B or v.shape[0] != B:
        raise ValueError(f"batch sizes differ: query {list(q.shape)}, key {list(k.shape)}, value {list(v.shape)}")
    if k.shape[1] != v.shape[1] or k.shape[2] != v.shape[2]:
        raise ValueError(f"key {list(k.shape)} and value {list(v.shape)} must share heads and length")
    if k.shape[3] != D:
        raise ValueError(f"query head dim {D} differs from key head dim {k.shape[3]}")
    hkv = k.shape[1]
    if hkv != H and not enable_gqa:
        raise ValueError(f"query has {H} heads and key/value {hkv}: pass enable_gqa=True for grouped-query attention")
    if H % hkv != 0:
        raise ValueError(f"query heads ({H}) must be a multiple of key/value heads ({hkv})")
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    if causal not in _CAUSAL:
        raise ValueError(f"causal must be one of {_CAUSAL}, got {causal!r}")
    if window is not None and (len(window) != 2 or any(w is not None and w < 0 for w in window)):
        raise ValueError(f"window must be (left, right) with non-negative ints or None, got {window!r}")
    target = (B, H, q.shape[2], k.shape[2])
    if mask is not None:
        if not isinstance(mask, Tensor):
            raise TypeError(f"attn_mask must be a Tensor, got {type(mask).__name__}")
        if mask.dtype != torch.bool and not mask.is_floating_point():
            raise TypeError(f"attn_mask must be bool or floating, got {mask.dtype}")
        if mask.device != device:
            raise ValueError(f"attn_mask is on {mask.device} but query is on {q.device}")
        if not broadcasts_to(mask.shape, target):
            raise ValueError(
                f"attn_mask of shape {list(mask.shape)} is not broadcastable to (B, H, Lq, Lk) = {list(target)}"
            )
        mask = mask.expand(target)
    return mask


def _check_op(q, k, v, mask, dropout_p, **like):
    """The registered Triton ops' check of their arguments (they may be called directly, through
    ``torch.ops.fastattn``): the public function's :func:`_validate` (mask already of shape
    (B, H, Lq, Lk)), plus each ``name=(tensor, shape, dtype)`` of ``like`` (dO, O, lse, tangents)
    on q's device. The kernels' launchers check only their own limits."""
    _validate(q, k, v, mask, dropout_p, True, False, None)
    check_like(q.device, **like)


def attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    mask: Tensor | None = None,
    *,
    causal: bool | str = False,
    window: tuple[int | None, int | None] | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    seed: int | None = None,
    enable_gqa: bool = False,
    return_lse: bool = False,
    backend: str | None = None,
):
    """Fused attention with the full set of fastattn's masks.

    ``softmax(scale * q @ k^T + mask, band) @ v`` where ``mask`` is bool (True = may attend) or
    float (added), broadcastable to (B, H, Lq, Lk) and never expanded in memory;
    ``causal`` is False, True / "top_left" (SDPA) or "bottom_right" (KV caches: the last query
    sees every key); ``window=(left, right)`` limits each query to keys within ``left`` before
    and ``right`` after its diagonal. Rows with nothing to attend output 0 (gradient 0).
    Dropout draws from a counter-based RNG seeded by ``seed`` (default: from torch's generator),
    the same mask on every backend. With ``return_lse=True`` also returns the float32
    log-sum-exp of each row's scores (B, H, Lq) (-inf for empty rows, whose gradient and tangent
    are 0).

    Derivatives: reverse mode, double backward (``create_graph=True``) and forward mode
    (``torch.func.jvp``, ``torch.autograd.forward_ad``, ``jacfwd``; tangents of q, k, v and a
    float mask) on every backend but ``cuda``, which has no JVP kernel (selecting it for forward
    mode raises a ValueError; the automatic choice passes over it).
    """
    if mask is None and window is None and dropout_p == 0.0 and not return_lse and (
            out := eager_fast_path("attention", backend, query, key, value, causal, scale, enable_gqa)
    ) is not None:
        return out  # (the cpu backend's one-call path)
    mask = _validate(query, key, value, mask, dropout_p, enable_gqa, causal, window)
    return _attend(query, key, value, mask, causal, window, scale, dropout_p, seed, return_lse, backend)


def _attend(query, key, value, mask, causal, window, scale, dropout_p, seed, return_lse, backend):
    """:func:`attention` on arguments already checked (by :func:`_validate`, or by
    :func:`_sdpa_shapes` for the SDPA drop-in): mask None or (B, H, Lq, Lk)."""
    scale = 1.0 / math.sqrt(query.shape[-1]) if scale is None else as_float("scale", scale)
    offset, left, right = band(query.shape[2], key.shape[2], causal, window)
    if dropout_p > 0 and seed is None:
        seed = int(torch.randint(0, 2**31 - 1, (), device="cpu"))
    query, key, value = last_dim_contiguous(query), last_dim_contiguous(key), last_dim_contiguous(value)
    needs = forward_ad_needs(query, key, value, mask)
    name, impl = backends.select("attention", query.device, backend, query.dtype, needs=needs,
                                 head_dim=query.shape[-1], head_dim_v=value.shape[-1],
                                 lq=query.shape[2], lk=key.shape[2])
    args = (scale, offset, left, right, float(dropout_p), int(seed or 0))
    compiled = _COMPILED.get(name)
    if compiled is None or compiled[0] is not impl:  # a backend registered by a user
        out, lse = impl(query, key, value, mask, *args)
    elif no_autograd(query, key, value, mask):  # plain eager with nothing to differentiate
        with BELOW_AUTOGRAD():
            out, lse = compiled[3](query, key, value, mask, *args)
    elif IS_COMPILING():
        out, lse = impl(query, key, value, mask, *args)
    else:
        out, lse = _Attention.apply(query, key, value, mask, *args, *compiled[:3], name)
    return (out, lse) if return_lse else out


def _sdpa_shapes(q, k, v, attn_mask, dropout_p, enable_gqa):
    """torch's rules for scaled_dot_product_attention's arguments. Returns ``(batch, H, Hkv)``:
    the broadcast leading dims before the heads, and the query and key/value head counts."""
    for name, t in (("query", q), ("key", k), ("value", v)):
        if not isinstance(t, Tensor):
            raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
        if t.dim() < 2:
            raise ValueError(f"query, key and value must be at least 2-D (..., length, dim), got shapes "
                             f"{list(q.shape)}, {list(k.shape)}, {list(v.shape)}")
    if not (q.dtype == k.dtype == v.dtype):
        raise TypeError(f"query, key and value must share a dtype, got {q.dtype}, {k.dtype}, {v.dtype}")
    if q.dtype not in _DTYPES:
        raise TypeError(f"query has dtype {q.dtype}; supported: {list(_DTYPES)}")
    if not (q.device == k.device == v.device):
        raise ValueError(f"query, key and value must be on one device, got {q.device}, {k.device}, {v.device}")
    if k.shape[-1] != q.shape[-1]:
        raise ValueError(f"query {list(q.shape)} and key {list(k.shape)} must share the last dim (the head dim)")
    if k.shape[-2] != v.shape[-2]:
        raise ValueError(f"key {list(k.shape)} and value {list(v.shape)} must share the length (dim -2)")
    if not 0.0 <= dropout_p <= 1.0:
        raise ValueError(f"dropout_p must be in [0, 1], got {dropout_p}")
    try:
        if enable_gqa and min(q.dim(), k.dim(), v.dim()) >= 3 and k.shape[-3] != q.shape[-3]:
            H, hkv = q.shape[-3], k.shape[-3]
            if v.shape[-3] != hkv:
                raise ValueError(f"key {list(k.shape)} and value {list(v.shape)} must share the heads (dim -3)")
            if hkv == 0 or H % hkv:
                raise ValueError(f"query heads ({H}) must be a multiple of key/value heads ({hkv}) (dim -3)")
            batch = broadcast_shapes(q.shape[:-3], k.shape[:-3], v.shape[:-3])
        else:
            lead = broadcast_shapes(q.shape[:-2], k.shape[:-2], v.shape[:-2])
            batch, H = (lead[:-1], lead[-1]) if lead else (torch.Size(), 1)
            hkv = H
    except RuntimeError:
        raise ValueError(f"the leading dims of query {list(q.shape)}, key {list(k.shape)} and value "
                         f"{list(v.shape)} do not broadcast (pass enable_gqa=True for fewer key/value heads)") from None
    if attn_mask is not None:
        if not isinstance(attn_mask, Tensor):
            raise TypeError(f"attn_mask must be a Tensor, got {type(attn_mask).__name__}")
        if attn_mask.dtype not in (torch.bool, torch.float32, q.dtype):
            raise TypeError(f"attn_mask must be bool, float32 or the query's dtype {q.dtype}, got {attn_mask.dtype}")
        if attn_mask.device != q.device:
            raise ValueError(f"attn_mask is on {attn_mask.device} but query is on {q.device}")
        target = (*batch, H, q.shape[-2], k.shape[-2])
        if not broadcasts_to(attn_mask.shape, target):
            raise ValueError(f"attn_mask of shape {list(attn_mask.shape)} is not broadcastable to the "
                             f"attention weights' shape {list(target)}")
    return batch, H, hkv


def _zeros_on_graph(shape, *inputs) -> Tensor:
    """Zeros of ``shape`` whose gradient with respect to each input is zero (not None), as
    PyTorch returns for outputs that depend on nothing (no keys, dropout_p=1)."""
    out = inputs[0].new_zeros(shape)
    for t in inputs:
        if t is not None and t.requires_grad:
            out = out + t.flatten()[:0].sum()  # an exact 0 that keeps the input on the graph
    return out


def scaled_dot_product_attention(
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attn_mask: Tensor | None = None,
    dropout_p: float = 0.0,
    is_causal: bool = False,
    *,
    scale: float | None = None,
    enable_gqa: bool = False,
    backend: str | None = None,
) -> Tensor:
    """Drop-in for :func:`torch.nn.functional.scaled_dot_product_attention`, with its rules:
    ``query (..., L, E)``, ``key (..., S, E)``, ``value (..., S, Ev)`` with any number of leading
    dims, broadcast against each other (with ``enable_gqa``, dim -3 holds the heads and the
    query's may be a multiple of the key/value's); ``attn_mask`` bool (True = may attend) or
    float (added; float32 or the query's dtype), broadcastable to the weights ``(..., L, S)``;
    ``is_causal`` a bool (top-left aligned; not with a mask); ``scale`` and ``enable_gqa``
    keyword-only, as in torch; ``dropout_p`` in [0, 1]. Returns
    ``(..., L, Ev)``. Corner cases as PyTorch: head dim 0 (all scores 0), no keys (output 0),
    empty outputs, ``dropout_p=1`` (output 0, gradients 0).

    A query row that may attend no key outputs 0 with gradient 0.
    """
    if not isinstance(is_causal, bool):  # (the one-call path reads a string as fastattn.attention's causal)
        raise TypeError(f"is_causal must be a bool, as in torch, got {type(is_causal).__name__}: "
                        "use fastattn.attention(causal=...) for a bottom-right band")
    if attn_mask is None and dropout_p == 0.0 and (
            out := eager_fast_path("attention", backend, query, key, value, is_causal, scale, enable_gqa)
    ) is not None:
        return out  # (the cpu backend's one-call path)
    if is_causal and attn_mask is not None:
        # PyTorch documents this as an error (its math kernel raises; its CPU flash kernel
        # happens to combine them): fastattn.attention takes both.
        raise ValueError("pass either attn_mask or is_causal=True, not both (as documented by PyTorch)")
    batch, H, hkv = _sdpa_shapes(query, key, value, attn_mask, dropout_p, enable_gqa)
    L, E, S, Ev = query.shape[-2], query.shape[-1], key.shape[-2], value.shape[-1]
    out_shape = (*batch, H, L, Ev) if max(query.dim(), key.dim(), value.dim()) > 2 else (L, Ev)
    if math.prod(out_shape) == 0 or S == 0 or dropout_p == 1.0:
        return _zeros_on_graph(out_shape, query, key, value, attn_mask)

    B = math.prod(batch)

    def four_d(t: Tensor, heads: int) -> Tensor:  # (*batch, heads, len, dim) -> (B, heads, len, dim)
        if t.dim() == 4 and t.shape[:2] == (B, heads):
            return t
        return t.expand(*batch, heads, *t.shape[-2:]).reshape(B, heads, *t.shape[-2:])

    q, k, v = four_d(query, H), four_d(key, hkv), four_d(value, hkv)
    mask = None
    if attn_mask is not None:
        # a float32 mask stays float32 with 16-bit q, k, v (added in float32, as torch does;
        # every backend reads a float mask of any dtype)
        mask = attn_mask.expand(*batch, H, L, S).reshape(B, H, L, S)
    if E == 0:  # every score is 0 whatever the scale (PyTorch's 1/sqrt(0) multiplies nothing);
        scale, backend = 1.0, "naive"  # the compiled kernels need a head dim, the result is the same
    # (checked above with PyTorch's rules, which cover attention's own: no second check)
    out = _attend(q, k, v, mask, is_causal, None, scale, dropout_p, None, False, backend)
    return out if out.shape == out_shape else out.reshape(out_shape)
