"""Packed variable-length attention and paged KV-cache decoding: public functions, validation,
registered ops and backends.

The API mirrors FlashAttention's ``flash_attn_varlen_func`` / ``flash_attn_with_kvcache``
(docs/api.md). Backend contracts (``backends.register_backend(op, name, fn)``)::

    varlen_attention:  fn(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                          scale, bottom_right, left, right, dropout_p, seed) -> (out, lse)
    paged_attention:   fn(q, k_cache, v_cache, block_table, cache_seqlens,
                          scale, bottom_right, left, right) -> (out, lse)

with inputs validated: q (total_q, H, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv), cu_seqlens
int32 (batch + 1,) on q's device, max_seqlen_* >= every length; out (total_q, H, Dv), lse
(H, total_q) float32. Paged: q (B, H, Lq, D), caches (num_blocks, block_size, Hkv, D/Dv),
block_table int32 (B, max_blocks), cache_seqlens int32 (B,); out (B, H, Lq, Dv), lse (B, H, Lq).
The band of each sequence is ``(offset, left, right)`` of docs/numerics.md with its own lengths:
``offset = Lk_b - Lq_b`` when ``bottom_right`` else 0; an unbounded side is passed as a value of
at least ``max_seqlen_q + max_seqlen_k`` (``Lq + max_blocks * block_size`` for paged).
Gradients of varlen flow through autograd; paged attention is forward only.

``paged_cache_append`` is one op for every backend (``fastattn::paged_cache_append``, a
torch.library custom op that mutates the caches; eager torch indexing, any device).
"""

from __future__ import annotations

import math

import torch
from torch import Tensor

from fastattn import backends
from fastattn.ops._library import as_float, check_like, define_op, eager_fast_path, last_dim_contiguous, triton_kernels
from fastattn.ops.attention import _CAUSAL, _DTYPES, _within, _naive as _naive_attention

_DROPOUT_STREAM = 0x9E3779B9


def _sequence_seed(seed: int, b: int, H: int) -> int:
    """The seed whose batch-0 dropout streams are batch row ``b``'s (docs/numerics.md: the stream
    hashes ``seed + 0x9E3779B9 * (b * H + h)``), so one sequence can run as a batch of one."""
    return (seed + _DROPOUT_STREAM * b * H) % (1 << 32)


def _heads(t: Tensor) -> Tensor:
    """(L, H, D) -> the (1, H, L, D) view the dense attention contract takes."""
    return t.permute(1, 0, 2).unsqueeze(0)


# ---------------------------------------------------------------------------------------------
# naive: each sequence through the eager dense attention (autograd records the graph).


def _naive_varlen(q, k, v, cu_q, cu_k, max_q, max_k, scale, bottom_right, left, right, dropout_p, seed):
    H, Dv = q.shape[1], v.shape[2]
    cq, ck = cu_q.tolist(), cu_k.tolist()
    outs, lses = [], []
    for b in range(len(cq) - 1):
        q0, q1, k0, k1 = cq[b], cq[b + 1], ck[b], ck[b + 1]
        lq, lk = q1 - q0, k1 - k0
        if lq == 0:
            continue
        if lk == 0:  # every row of the sequence is fully masked
            outs.append(q.new_zeros(lq, H, Dv) + 0 * q[q0:q1, :, :1].sum())
            lses.append(torch.full((H, lq), float("-inf"), device=q.device))
            continue
        o, lse = _naive_attention(
            _heads(q[q0:q1]), _heads(k[k0:k1]), _heads(v[k0:k1]), None, scale,
            lk - lq if bottom_right else 0, min(left, lq + lk), min(right, lq + lk), dropout_p,
            _sequence_seed(seed, b, H))
        outs.append(o[0].permute(1, 0, 2))
        lses.append(lse[0])
    if not outs:
        return q.new_zeros(q.shape[0], H, Dv) + 0 * q.sum(), torch.empty(H, 0, device=q.device)
    return torch.cat(outs, 0), torch.cat(lses, 1)


def _gather_cache(cache: Tensor, block_table: Tensor, b: int, n: int) -> Tensor:
    """The first ``n`` cached rows of sequence ``b`` as (1, Hkv, n, D)."""
    t = torch.arange(n, device=cache.device)
    rows = cache[block_table[b, t // cache.shape[1]].long(), t % cache.shape[1]]
    return _heads(rows)


def _naive_paged(q, k_cache, v_cache, block_table, cache_seqlens, scale, bottom_right, left, right):
    B, H, Lq, _ = q.shape
    out = q.new_zeros(B, H, Lq, v_cache.shape[-1])
    lse = torch.full((B, H, Lq), float("-inf"), device=q.device)
    for b, n in enumerate(cache_seqlens.tolist()):
        if n == 0 or Lq == 0:
            continue
        o, l = _naive_attention(
            q[b:b + 1], _gather_cache(k_cache, block_table, b, n),
            _gather_cache(v_cache, block_table, b, n), None, scale,
            n - Lq if bottom_right else 0, min(left, Lq + n), min(right, Lq + n), 0.0, 0)
        out[b], lse[b] = o[0], l[0]
    return out, lse


# ---------------------------------------------------------------------------------------------
# Compiled backends: one fake impl and one autograd formula for the C++ and Triton ops.


def _fake_varlen_fwd(q, k, v, cu_q, cu_k, max_q, max_k, scale, bottom_right, left, right, dropout_p, seed):
    return q.new_empty(q.shape[0], q.shape[1], v.shape[2]), q.new_empty(q.shape[1], q.shape[0], dtype=torch.float32)


def _fake_varlen_bwd(dout, q, k, v, out, lse, cu_q, cu_k, max_q, max_k, scale, bottom_right, left,
                     right, dropout_p, seed):
    return torch.empty_like(q), torch.empty_like(k), torch.empty_like(v)


def _fake_paged_fwd(q, k_cache, v_cache, block_table, cache_seqlens, scale, bottom_right, left, right):
    B, H, Lq, _ = q.shape
    return q.new_empty(B, H, Lq, v_cache.shape[-1]), q.new_empty(B, H, Lq, dtype=torch.float32)


def _setup_context(ctx, inputs, output):
    q, k, v, cu_q, cu_k = inputs[:5]
    out, lse = output
    ctx.save_for_backward(q, k, v, out, lse, cu_q, cu_k)
    ctx.args = inputs[5:]


def _backward(ops, ctx, dout, _dlse):
    if dout is None:  # (lse gets no gradient from this formula)
        return (None,) * 13
    q, k, v, out, lse, cu_q, cu_k = ctx.saved_tensors
    dq, dk, dv = ops.bwd(last_dim_contiguous(dout), q, k, v, out, lse, cu_q, cu_k, *ctx.args)
    return (dq, dk, dv) + (None,) * 10


def _triton_fwd(
    q: Tensor, k: Tensor, v: Tensor, cu_seqlens_q: Tensor, cu_seqlens_k: Tensor,
    max_seqlen_q: int, max_seqlen_k: int, scale: float, bottom_right: bool, left: int,
    right: int, dropout_p: float, seed: int,
) -> tuple[Tensor, Tensor]:
    _check_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, dropout_p, max_seqlen_q, max_seqlen_k)
    return _kernels.varlen_forward(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k,
                                   scale, bottom_right, left, right, dropout_p, seed)


def _triton_bwd(
    dout: Tensor, q: Tensor, k: Tensor, v: Tensor, out: Tensor, lse: Tensor,
    cu_seqlens_q: Tensor, cu_seqlens_k: Tensor, max_seqlen_q: int, max_seqlen_k: int,
    scale: float, bottom_right: bool, left: int, right: int, dropout_p: float, seed: int,
) -> tuple[Tensor, Tensor, Tensor]:
    _check_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, dropout_p, max_seqlen_q, max_seqlen_k)
    rows = (*q.shape[:2], v.shape[-1])
    check_like(q.device, dout=(dout, rows, q.dtype), out=(out, rows, q.dtype),
               lse=(lse, q.shape[1::-1], torch.float32))
    dout, out = last_dim_contiguous(dout), last_dim_contiguous(out)
    return _kernels.varlen_backward(dout, q, k, v, out, lse, cu_seqlens_q, cu_seqlens_k,
                                    max_seqlen_q, max_seqlen_k, scale, bottom_right, left,
                                    right, dropout_p, seed)


def _triton_paged(
    q: Tensor, k_cache: Tensor, v_cache: Tensor, block_table: Tensor, cache_seqlens: Tensor,
    scale: float, bottom_right: bool, left: int, right: int,
) -> tuple[Tensor, Tensor]:
    _check_tensor("q", q, 4, "(batch, heads, new_tokens, head_dim)")
    _check_paged_shapes("q", q, k_cache, v_cache, block_table, cache_seqlens)
    _check_paged_heads(q, k_cache)
    return _kernels.paged_forward(q, k_cache, v_cache, block_table, cache_seqlens, scale,
                                  bottom_right, left, right)


_kernels = triton_kernels("varlen")
define_op("varlen_attention", fake_fwd=_fake_varlen_fwd, fake_bwd=_fake_varlen_bwd,
          setup_context=_setup_context, backward=_backward, triton_fwd=_triton_fwd,
          triton_bwd=_triton_bwd, naive=_naive_varlen,
          # csrc/cuda/varlen.cu (the attention kernels, narrowed per sequence): 16-bit inputs only
          caps={"cuda": dict(dtypes=(torch.float16, torch.bfloat16), limits=_within(256, 1 << 29))})
define_op("paged_attention", fake_fwd=_fake_paged_fwd, triton_fwd=_triton_paged, naive=_naive_paged,
          # csrc/cuda/paged.cu: 16-bit inputs only, head dims up to 256
          caps={"cuda": dict(dtypes=(torch.float16, torch.bfloat16), limits=_within(256))})


# ---------------------------------------------------------------------------------------------
# paged_cache_append: one registered op (eager torch indexing) for every backend.


@torch.library.custom_op("fastattn::paged_cache_append", mutates_args=("k_cache", "v_cache"))
def _append_op(k_cache: Tensor, v_cache: Tensor, block_table: Tensor, cache_seqlens: Tensor,
               k_new: Tensor, v_new: Tensor) -> None:
    Lnew = k_new.shape[2]
    if Lnew == 0 or k_new.shape[0] == 0:
        return
    bs = k_cache.shape[1]
    pos = cache_seqlens.long()[:, None] + torch.arange(Lnew, device=k_cache.device)
    blocks = block_table.long().gather(1, pos // bs)
    slots = pos % bs
    k_cache[blocks, slots] = k_new.permute(0, 2, 1, 3)
    v_cache[blocks, slots] = v_new.permute(0, 2, 1, 3)


@_append_op.register_fake
def _(k_cache, v_cache, block_table, cache_seqlens, k_new, v_new) -> None:
    return None


# ---------------------------------------------------------------------------------------------
# Validation.


def _check_tensor(name: str, t, dim: int, what: str) -> None:
    if not isinstance(t, Tensor):
        raise TypeError(f"{name} must be a Tensor, got {type(t).__name__}")
    if t.dim() != dim:
        raise ValueError(f"{name} must be {dim}-D {what}, got shape {list(t.shape)}")


def _check_float(name: str, t: Tensor, like: Tensor, like_name: str) -> None:
    if t.dtype not in _DTYPES:
        raise TypeError(f"{name} has dtype {t.dtype}; supported: {list(_DTYPES)}")
    if t.dtype != like.dtype:
        raise TypeError(f"{name} has dtype {t.dtype} but {like_name} has {like.dtype}")
    if t.device != like.device:
        raise ValueError(f"{name} is on {t.device} but {like_name} is on {like.device}")


def _check_int32(name: str, t, dim: int, what: str, device) -> None:
    _check_tensor(name, t, dim, what)
    if t.dtype != torch.int32:
        raise TypeError(f"{name} must be int32, got {t.dtype} (shape {list(t.shape)})")
    if t.device != device:
        raise ValueError(f"{name} is on {t.device} but query is on {device}")


def _check_band(causal, window) -> None:
    if causal not in _CAUSAL:
        raise ValueError(f"causal must be one of {_CAUSAL}, got {causal!r}")
    if window is not None and (
        len(window) != 2 or any(w is not None and (not isinstance(w, int) or w < 0) for w in window)
    ):
        raise ValueError(f"window must be (left, right) with non-negative ints or None, got {window!r}")


def _check_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, dropout_p, *max_seqlens) -> None:
    """The structural checks of a packed call (ranks, dtypes, devices, shapes), run by
    :func:`varlen_attention` and by the registered Triton ops (callable through ``torch.ops``);
    the kernels' launchers check only their own limits. No device-to-host sync: the values of
    cu_seqlens are checked by the public function."""
    _check_tensor("q", q, 3, "(total_q, heads, head_dim)")
    _check_tensor("k", k, 3, "(total_k, kv_heads, head_dim)")
    _check_tensor("v", v, 3, "(total_k, kv_heads, head_dim_v)")
    _check_float("q", q, q, "q")
    _check_float("k", k, q, "q")
    _check_float("v", v, q, "q")
    if k.shape[:2] != v.shape[:2]:
        raise ValueError(f"k {list(k.shape)} and v {list(v.shape)} must share total length and kv heads")
    if k.shape[2] != q.shape[2]:
        raise ValueError(f"q head dim {q.shape[2]} differs from k head dim {k.shape[2]} "
                         f"(q {list(q.shape)}, k {list(k.shape)})")
    if k.shape[1] == 0 or q.shape[1] % k.shape[1] != 0:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of kv heads ({k.shape[1]})")
    _check_int32("cu_seqlens_q", cu_seqlens_q, 1, "(batch + 1,)", q.device)
    _check_int32("cu_seqlens_k", cu_seqlens_k, 1, "(batch + 1,)", q.device)
    if not 0.0 <= dropout_p < 1.0:
        raise ValueError(f"dropout_p must be in [0, 1), got {dropout_p}")
    batch1 = cu_seqlens_q.shape[0]
    if batch1 < 1 or cu_seqlens_k.shape[0] != batch1:
        raise ValueError(f"cu_seqlens_q {list(cu_seqlens_q.shape)} and cu_seqlens_k {list(cu_seqlens_k.shape)} "
                         f"must both be (batch + 1,) with batch >= 0")
    if any(m is not None and m < 0 for m in max_seqlens):
        raise ValueError(f"max_seqlen_q / max_seqlen_k must be >= 0, got {max_seqlens}")


def _band_args(causal, window, unbounded: int) -> tuple[bool, int, int]:
    """``(bottom_right, left, right)`` with unbounded sides as ``unbounded``."""
    left = right = unbounded
    if window is not None:
        left = unbounded if window[0] is None else min(int(window[0]), unbounded)
        right = unbounded if window[1] is None else min(int(window[1]), unbounded)
    if causal is not False:
        right = 0 if window is None else min(right, 0)
    return causal == "bottom_right", left, right


def _seqlens(name: str, host: Tensor, total: int) -> Tensor:
    """The lengths of a cu_seqlens (its host copy), checked: 0 first, non-decreasing, last = total."""
    if int(host[0]) != 0:
        raise ValueError(f"{name} must start at 0, got {int(host[0])}")
    lengths = host[1:] - host[:-1]
    if bool((lengths < 0).any()):
        b = int(torch.nonzero(lengths < 0)[0, 0])
        raise ValueError(f"{name} must be non-decreasing, got {int(host[b])} then {int(host[b + 1])} at {b}")
    if int(host[-1]) != total:
        raise ValueError(f"{name} must end at the total length {total}, got {int(host[-1])}")
    return lengths


def _max_seqlen(name: str, given, lengths: Tensor) -> int:
    longest = int(lengths.max()) if lengths.numel() else 0
    if given is None:
        return longest
    if isinstance(given, bool) or not isinstance(given, int):
        raise TypeError(f"{name} must be an int or None, got {type(given).__name__}")
    if given < longest:
        raise ValueError(f"{name}={given} is smaller than the longest sequence ({longest})")
    return given


def _owned_slots(block_table):
    """Per row, how many leading block_table entries are blocks (the rest, from the first -1,
    are unused). A tensor, or a NumPy array (the same expression serves both)."""
    return ((block_table >= 0) * 1).cumprod(axis=1).sum(axis=1)


def _check_paged_shapes(q_name, q, k_cache, v_cache, block_table, cache_seqlens) -> None:
    """The structural part of :func:`_check_paged` (no device-to-host sync), also run by the
    registered Triton op."""
    _check_tensor("k_cache", k_cache, 4, "(num_blocks, block_size, kv_heads, head_dim)")
    _check_tensor("v_cache", v_cache, 4, "(num_blocks, block_size, kv_heads, head_dim_v)")
    _check_float("k_cache", k_cache, q, q_name)
    _check_float("v_cache", v_cache, q, q_name)
    if k_cache.shape[:3] != v_cache.shape[:3]:
        raise ValueError(f"k_cache {list(k_cache.shape)} and v_cache {list(v_cache.shape)} must share "
                         f"(num_blocks, block_size, kv_heads)")
    if k_cache.shape[1] == 0:
        raise ValueError(f"block_size (k_cache.shape[1]) must be >= 1, got shape {list(k_cache.shape)}")
    B = q.shape[0]
    _check_int32("block_table", block_table, 2, "(batch, max_blocks)", q.device)
    _check_int32("cache_seqlens", cache_seqlens, 1, "(batch,)", q.device)
    if block_table.shape[0] != B or cache_seqlens.shape[0] != B:
        raise ValueError(f"block_table {list(block_table.shape)} and cache_seqlens "
                         f"{list(cache_seqlens.shape)} must have {q_name}'s batch size {B}")


def _check_paged_heads(q, k_cache) -> None:
    """paged_attention's q against the caches: head dim, GQA group."""
    if k_cache.shape[3] != q.shape[3]:
        raise ValueError(f"q head dim {q.shape[3]} differs from k_cache head dim {k_cache.shape[3]} "
                         f"(q {list(q.shape)}, k_cache {list(k_cache.shape)})")
    if q.shape[1] % k_cache.shape[2] != 0:
        raise ValueError(f"query heads ({q.shape[1]}) must be a multiple of the caches' kv heads "
                         f"({k_cache.shape[2]})")


#: Backends whose paged_attention op checks block_table and cache_seqlens itself, with
#: :func:`_check_paged`'s rule and a ValueError naming them (csrc/cpu/varlen.cpp): it reads them
#: anyway, and the same test in Python (NumPy views, four reductions) was a decoding step's
#: largest fixed cost at batch 1 (~9 of ~25 us).
_CHECKS_PAGED_VALUES = frozenset({"cpu"})


def _check_paged(q_name, q, k_cache, v_cache, block_table, cache_seqlens, extra: int = 0,
                 values: bool = True) -> None:
    """Checks shared by paged_attention (q (B, H, Lq, D)) and paged_cache_append (k_new, with
    ``extra`` new tokens that must fit in the blocks each row owns too, and may not share a slot).
    The value checks run where the tensors are, with one device-to-host sync; only a failure is
    diagnosed on the host. ``values=False``: shapes only, for a kernel that checks the values
    itself with this rule (:data:`_CHECKS_PAGED_VALUES`)."""
    _check_paged_shapes(q_name, q, k_cache, v_cache, block_table, cache_seqlens)
    if not values:
        return
    B = q.shape[0]
    num_blocks, bs = k_cache.shape[0], k_cache.shape[1]
    # On the CPU through NumPy views (a decoding step's fixed cost: ~10 torch ops of ~5 us each
    # on tiny tensors); elsewhere on the device, with one device-to-host sync.
    host = block_table.device.type == "cpu"
    table, lens = (block_table.numpy(), cache_seqlens.numpy()) if host else (block_table, cache_seqlens)

    def value_flags():  # per entry: not a block; per row: the slots it owns, a length over them
        bad_entry = (table < -1) | (table >= num_blocks)
        room = _owned_slots(table) * bs
        return bad_entry, room, (lens < 0) | (lens + extra > room)

    # On the CPU, a table with no unused (-1) entry passes in four reductions, the same test:
    # every row then owns all its slots (measured 26 -> 11-16 us at B1, max_blocks 64).
    if (host and table.size and table.min() >= 0 and int(table.max()) < num_blocks
            and lens.min() >= 0 and int(lens.max()) + extra <= table.shape[1] * bs):
        failed = False
    else:
        bad_entry, room, over = value_flags()
        failed = bad_entry.any() | over.any()
    if extra and B:
        pos = cache_seqlens.long()[:, None] + torch.arange(extra, device=q.device)
        slots = block_table.long().gather(1, torch.clamp(pos // bs, max=block_table.shape[1] - 1)) * bs + pos % bs
        shared = (slots.flatten().sort().values.diff() == 0).any()
        failed = (bool(shared) or bool(failed)) if host else (shared | failed)
    if not bool(failed):
        return
    # Diagnose on the host.
    bad_entry, room, over = (torch.as_tensor(flags).cpu() for flags in value_flags())
    table, lens = block_table.cpu(), cache_seqlens.cpu()
    if bool(bad_entry.any()):
        b, s = torch.nonzero(bad_entry)[0].tolist()
        raise ValueError(f"block_table[{b}, {s}] = {int(table[b, s])} is not a block of the caches "
                         f"(0 <= index < num_blocks = {num_blocks}, or -1 for no block)")
    if bool((lens < 0).any()):
        raise ValueError(f"cache_seqlens must be >= 0, got {lens.tolist()}")
    if bool(over.any()):
        b = int(torch.nonzero(over)[0, 0])
        what = f"cache_seqlens[{b}] = {int(lens[b])}" + (f" + {extra} new tokens" if extra else "")
        raise ValueError(f"{what} exceeds the {int(room[b])} positions of the blocks row {b} of "
                         f"block_table owns (block_size {bs})")
    raise ValueError("two rows of block_table would write the same cache slot (shared blocks must "
                     "not receive new tokens)")


# ---------------------------------------------------------------------------------------------
# Public functions.


def varlen_attention(
    q: Tensor,
    k: Tensor,
    v: Tensor,
    cu_seqlens_q: Tensor,
    cu_seqlens_k: Tensor,
    max_seqlen_q: int | None = None,
    max_seqlen_k: int | None = None,
    *,
    causal: bool | str = False,
    window: tuple[int | None, int | None] | None = None,
    scale: float | None = None,
    dropout_p: float = 0.0,
    seed: int | None = None,
    return_lse: bool = False,
    backend: str | None = None,
):
    """Attention over a packed batch of sequences of different lengths, without padding.

    q (total_q, H, D), k (total_k, Hkv, D), v (total_k, Hkv, Dv): sequence ``b`` is rows
    ``cu_seqlens_q[b]:cu_seqlens_q[b+1]`` of q and ``cu_seqlens_k[b]:cu_seqlens_k[b+1]`` of k, v
    (int32, (batch + 1,), starting at 0, non-decreasing, ending at the totals). Each sequence
    attends only to its own keys, as :func:`fastattn.attention` would on its slice: ``causal``
    (False, True / "top_left", "bottom_right") and ``window`` apply per sequence with its own
    lengths; GQA when H is a multiple of Hkv. ``max_seqlen_*`` (default: computed) must be at
    least the longest length. Returns out (total_q, H, Dv), and with ``return_lse`` also the
    float32 lse (H, total_q). Dropout draws batch row ``b``'s mask of the shared RNG for
    sequence ``b`` (docs/numerics.md). Rows with nothing to attend (empty key sequences
    included) output 0 with gradient 0.
    """
    _check_packed(q, k, v, cu_seqlens_q, cu_seqlens_k, dropout_p)
    _check_band(causal, window)
    batch1 = cu_seqlens_q.shape[0]
    host = torch.cat([cu_seqlens_q, cu_seqlens_k]).cpu()  # one device-to-host copy
    max_seqlen_q = _max_seqlen("max_seqlen_q", max_seqlen_q, _seqlens("cu_seqlens_q", host[:batch1], q.shape[0]))
    max_seqlen_k = _max_seqlen("max_seqlen_k", max_seqlen_k, _seqlens("cu_seqlens_k", host[batch1:], k.shape[0]))
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else as_float("scale", scale)
    bottom_right, left, right = _band_args(causal, window, max_seqlen_q + max_seqlen_k)
    if dropout_p > 0 and seed is None:
        seed = int(torch.randint(0, 2**31 - 1, (), device="cpu"))
    q, k, v = (last_dim_contiguous(t) for t in (q, k, v))
    _, impl = backends.select("varlen_attention", q.device, backend, q.dtype, head_dim=q.shape[-1],
                              head_dim_v=v.shape[-1], lq=max_seqlen_q, lk=max_seqlen_k)
    out, lse = impl(q, k, v, cu_seqlens_q, cu_seqlens_k, max_seqlen_q, max_seqlen_k, scale,
                    bottom_right, left, right, float(dropout_p), int(seed or 0))
    return (out, lse) if return_lse else out


def paged_attention(
    q: Tensor,
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    cache_seqlens: Tensor,
    *,
    causal: bool | str = "bottom_right",
    window: tuple[int | None, int | None] | None = None,
    scale: float | None = None,
    return_lse: bool = False,
    backend: str | None = None,
):
    """Attention of new queries over a paged KV cache (decoding; forward only).

    q (B, H, Lq, D); k_cache, v_cache (num_blocks, block_size, Hkv, D / Dv); ``block_table``
    int32 (B, max_blocks): row ``b`` lists the blocks of sequence ``b`` in order (key ``t`` is at
    block ``block_table[b, t // block_size]``, slot ``t % block_size``; ``-1`` marks unused
    slots after the last block); ``cache_seqlens`` int32 (B,): the valid keys of each sequence,
    the new tokens' included. ``causal`` defaults to "bottom_right" (query ``i`` of ``Lq`` sees
    keys up to ``cache_seqlens[b] - Lq + i``). Returns out (B, H, Lq, Dv), with ``return_lse``
    also lse (B, H, Lq) float32.
    """
    if window is None and not return_lse and (out := eager_fast_path(  # (cpu backend: one call)
            "paged_attention", backend, q, k_cache, v_cache, block_table, cache_seqlens, causal,
            scale)) is not None:
        return out
    _check_tensor("q", q, 4, "(batch, heads, new_tokens, head_dim)")
    _check_float("q", q, q, "q")
    _check_band(causal, window)
    name, impl = backends.select("paged_attention", q.device, backend, q.dtype, head_dim=q.shape[-1],
                                 head_dim_v=v_cache.shape[-1] if isinstance(v_cache, Tensor) and v_cache.dim() else None)
    _check_paged("q", q, k_cache, v_cache, block_table, cache_seqlens,
                 values=name not in _CHECKS_PAGED_VALUES)
    _check_paged_heads(q, k_cache)
    scale = 1.0 / math.sqrt(q.shape[-1]) if scale is None else as_float("scale", scale)
    unbounded = q.shape[2] + block_table.shape[1] * k_cache.shape[1]
    bottom_right, left, right = _band_args(causal, window, unbounded)
    q, k_cache, v_cache = (last_dim_contiguous(t) for t in (q, k_cache, v_cache))
    out, lse = impl(q, k_cache, v_cache, block_table, cache_seqlens, scale, bottom_right, left, right)
    return (out, lse) if return_lse else out


def paged_cache_append(
    k_cache: Tensor,
    v_cache: Tensor,
    block_table: Tensor,
    cache_seqlens: Tensor,
    k_new: Tensor,
    v_new: Tensor,
) -> None:
    """Write ``k_new`` / ``v_new`` (B, Hkv, Lnew, D / Dv) into the paged caches, in place, at
    positions ``cache_seqlens[b] .. cache_seqlens[b] + Lnew - 1`` of each sequence. Nothing else
    in the caches changes; ``cache_seqlens`` is not updated (pass ``cache_seqlens + Lnew`` to
    :func:`paged_attention`). Every written position must lie in a block the row owns, and no two
    rows may write the same slot."""
    _check_tensor("k_new", k_new, 4, "(batch, kv_heads, new_tokens, head_dim)")
    _check_tensor("v_new", v_new, 4, "(batch, kv_heads, new_tokens, head_dim_v)")
    _check_float("k_new", k_new, k_new, "k_new")
    _check_float("v_new", v_new, k_new, "k_new")
    _check_paged("k_new", k_new, k_cache, v_cache, block_table, cache_seqlens, extra=k_new.shape[2])
    B, Hkv, Lnew, _ = k_new.shape
    if (v_new.shape[0], v_new.shape[1], v_new.shape[2]) != (B, Hkv, Lnew):
        raise ValueError(f"k_new {list(k_new.shape)} and v_new {list(v_new.shape)} must share batch, "
                         f"kv heads and length")
    if Hkv != k_cache.shape[2] or k_new.shape[3] != k_cache.shape[3] or v_new.shape[3] != v_cache.shape[3]:
        raise ValueError(f"k_new {list(k_new.shape)} / v_new {list(v_new.shape)} do not fit the caches "
                         f"k_cache {list(k_cache.shape)} / v_cache {list(v_cache.shape)} "
                         f"(kv heads and head dims must match)")
    _append_op(k_cache, v_cache, block_table, cache_seqlens, k_new, v_new)


# ---------------------------------------------------------------------------------------------
# Hugging Face padding-free (packed) batches.


def hf_varlen_attention_forward(
    module: torch.nn.Module,
    query: Tensor,
    key: Tensor,
    value: Tensor,
    attention_mask: Tensor | None = None,
    scaling: float | None = None,
    dropout: float = 0.0,
    *,
    cu_seq_lens_q: Tensor,
    cu_seq_lens_k: Tensor,
    max_length_q: int | Tensor | None = None,
    max_length_k: int | Tensor | None = None,
    is_causal: bool | None = None,
    sliding_window: int | None = None,
    backend: str | None = None,
    **kwargs,
) -> tuple[Tensor, None]:
    """transformers' ``AttentionInterface`` signature for a padding-free (packed) batch: what the
    attention function should call when transformers passes ``cu_seq_lens_q/k`` (and
    ``max_length_q/k``), e.g. from ``DataCollatorWithFlattening(return_flash_attn_kwargs=True)``.

    ``query (1, H, total_q, D)``, ``key``/``value (1, Hkv, total_k, D)``; the sequences are
    delimited by the cumulative lengths (int32 or int64; transformers builds them from
    ``position_ids``). ``attention_mask`` is ignored: the sequence bounds are the mask. Causal
    (``is_causal``, else ``module.is_causal``, default True) is bottom-right aligned as in
    FlashAttention; ``sliding_window`` w keeps keys within w - 1 of the diagonal, as
    transformers' flash path does. Returns ``(out (1, total_q, H, Dv), None)``.
    """
    if kwargs.get("softcap") is not None:
        raise ValueError("fastattn attention does not support `softcap`; use attn_implementation='eager'")
    if query.shape[0] != 1:
        raise ValueError(f"a packed batch has batch size 1, got query of shape {list(query.shape)}")
    causal = is_causal if is_causal is not None else getattr(module, "is_causal", True)
    window = None if sliding_window is None else (int(sliding_window) - 1, int(sliding_window) - 1)
    cu_q, cu_k = cu_seq_lens_q.to(torch.int32), cu_seq_lens_k.to(torch.int32)
    max_q = None if max_length_q is None else int(max_length_q)
    max_k = None if max_length_k is None else int(max_length_k)
    out = varlen_attention(
        query[0].transpose(0, 1), key[0].transpose(0, 1), value[0].transpose(0, 1), cu_q, cu_k, max_q, max_k,
        causal="bottom_right" if causal else False, window=window, scale=scaling, dropout_p=float(dropout),
        backend=backend,
    )
    return out[None], None
