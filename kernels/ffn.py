"""Feed-forward block ``out = act(x w1^T + b1) w2^T + b2`` and its backward (Triton backend).

Math (``nn.Linear`` layout; gated activations split the first layer's output ``[gate, up]``):

    forward   pre = x w1^T + b1                     (M, F), or (M, 2F) for swiglu / geglu
              a   = act(pre)                        elementwise; gated: f(gate) * up
              out = a w2^T + b2                     (M, D2)
    backward  da   = dout w2                        (M, F)
              dpre = da * act'(pre)                 gated: [da * up * f'(gate), da * f(gate)]
              dx = dpre w1,  dw1 = dpre^T x,  db1 = sum_rows dpre
              dw2 = dout^T a,                       db2 = sum_rows dout

Activations: gelu (exact, erf), gelu_tanh, relu, silu, and the gated swiglu (f = silu) and geglu
(f = gelu).

Work split: one generic tiled matmul kernel ``C = A B`` (operands read through strides, so
``w^T`` and ``dpre^T`` are views, never copies) computes every product. Each program owns a
``BLOCK_M x BLOCK_N`` tile of ``C`` (grouped ordering for L2 reuse), loops over ``K`` in
``BLOCK_K`` steps with a float32 accumulator, and ends in a constexpr-selected epilogue:

* forward (``ACT_GRAD=False``): ``+ bias``; with an activation the tile's pre-activation is stored
  to ``Pre`` and ``act`` is applied in registers before the store, so the hidden activation is
  never re-read by an elementwise pass. Gated: the program accumulates the matching gate and up
  tiles (rows ``n`` and ``F + n`` of ``w1``) in two accumulators and stores ``f(gate) * up``.
* activation gradient (``ACT_GRAD=True``, used for ``da = dout w2``): loads the ``pre`` tile,
  stores ``dpre`` (both halves when gated) and the recomputed activation ``a = act(pre)`` (the
  operand of ``dw2 = dout^T a``: the recomputation is fused into this epilogue, no separate pass),
  and optionally (``COLSUM``) the column sums of ``dpre`` over each group of ``PARTIAL_ROWS``
  rows into a float32 ``(cdiv(M, PARTIAL_ROWS), width)`` buffer. ``db1`` is that buffer's sum over
  its rows (a small torch ``.sum``), so ``dpre`` is never re-read. The groups do not depend on the
  tile size, so every buffer row is written by exactly one program whatever config autotuning
  picks. ``db2 = dout.sum(0)`` is a plain torch reduction in float32 (``dout`` is an input; no
  kernel produces it).

Backward recomputes ``act`` from the stored ``pre`` rather than keeping ``a``; forward needs ``a``
for the second matmul, as a temporary freed on return. Forward applies ``act`` to ``pre`` rounded
to the storage dtype, so the ``a`` recomputed in backward is the ``a`` used in forward.

Tile sizes: autotuned on GPU (key: M, N, K rounded up to powers of two (``kernels.tuning.bucket``),
the epilogue flags and the operand dtypes; configs
whose activation epilogue would spill registers are pruned first); under ``TRITON_INTERPRET=1`` a
single small fixed config (decided once at import).

Limits: x, w1, w2, biases and dout share one dtype (float32, float16, bfloat16; the arguments
are checked by fastattn.ops, the launchers check the dtype and the int32 index arithmetic: row and
column indices, K offsets ``BLOCK_K * stride``); any M, D, F, D2 (masked edges) below about 2**31;
2-D operands with any strides. Precision: float32 accumulation and epilogue math;
outputs rounded once to the input dtype. float32 matmuls use ``input_precision="ieee"`` (exact
float32 products, no TF32); float16 / bfloat16 use the tensor cores' native products. Under the
interpreter every product is taken in float32 (its bfloat16 ``tl.dot`` is wrong), which gives the
same results: 16-bit products are exact in float32.
"""

import math

import torch
import triton
import triton.language as tl

from fastattn import activations as act

from . import tuning

__all__ = ["ffn_fwd", "ffn_bwd"]

# Activation ids: the codes of the one activation table (fastattn/activations.py).
_IDENTITY, _GELU, _GELU_TANH, _RELU, _SILU = (
    tl.constexpr(c) for c in (act.IDENTITY, act.GELU, act.GELU_TANH, act.RELU, act.SILU)
)
_SQRT1_2: tl.constexpr = tl.constexpr(math.sqrt(0.5))
_INV_SQRT_2PI: tl.constexpr = tl.constexpr(1.0 / math.sqrt(2.0 * math.pi))
_SQRT_2_OVER_PI: tl.constexpr = tl.constexpr(math.sqrt(2.0 / math.pi))
_GELU_TANH_C: tl.constexpr = tl.constexpr(0.044715)
_THREE_GELU_TANH_C: tl.constexpr = tl.constexpr(3 * 0.044715)
_TWO_SQRT_2_OVER_PI: tl.constexpr = tl.constexpr(2.0 * math.sqrt(2.0 / math.pi))

_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
_INTERPRET = tuning.INTERPRET

if _INTERPRET:
    _CONFIGS = [triton.Config({"BLOCK_M": 16, "BLOCK_N": 32, "BLOCK_K": 16, "GROUP_M": 4})]
else:
    _CONFIGS = [
        triton.Config({"BLOCK_M": bm, "BLOCK_N": bn, "BLOCK_K": bk, "GROUP_M": 8},
                      num_stages=stages, num_warps=warps)
        for bm, bn, bk, stages, warps in (
            (128, 256, 64, 3, 8),
            (128, 128, 64, 3, 8),
            (128, 128, 32, 4, 4),
            (64, 256, 32, 4, 4),
            (128, 64, 64, 4, 8),
            (64, 128, 64, 4, 8),
            (128, 64, 32, 4, 4),
            (64, 128, 32, 4, 4),
            (64, 64, 64, 4, 4),
            (32, 64, 32, 5, 2),
        )
    ]
#: The largest block size of any config (the launchers' int32 bounds).
_MAX_BLOCK = max(c.kwargs[k] for c in _CONFIGS for k in ("BLOCK_M", "BLOCK_N", "BLOCK_K"))
#: Row-group size of the db1 partial sums: divides every config's BLOCK_M.
PARTIAL_ROWS = min(c.kwargs["BLOCK_M"] for c in _CONFIGS)
assert all(c.kwargs["BLOCK_M"] % PARTIAL_ROWS == 0 for c in _CONFIGS)


# float32's IEEE products are FMA loops (no tensor cores) in which each thread holds whole rows
# of both operand tiles: the tiles (BLOCK_M, BLOCK_N, BLOCK_K, num_warps) that compiled without
# spills in every float32 launch of the Hopper gate (plain, gelu, relu, swiglu, forward and
# gradient epilogues; sm_90, Triton 3.6). 128x256x64 w8, 128x128x32 and 64x256x32 w4 spilled
# 0.3-6 KB in plain products, 128x128x64 w8 79 KB with the gated epilogue (bench/aot/README.md).
_FP32_TILES = {(64, 64, 64, 4), (32, 64, 32, 2)}


def _tile(config):
    k = config.kwargs
    return k["BLOCK_M"], k["BLOCK_N"], k["BLOCK_K"], config.num_warps


def _prune_configs(configs, named_args, **kwargs):
    """Drop tiles whose activation epilogue would spill registers (checked with ptxas, sm_90).

    Plain products keep every config; a forward activation epilogue keeps <= 64 accumulator
    values per thread, an activation-gradient epilogue (it also loads the pre tile(s) and writes
    two outputs) <= 32, gated or not (non-gated 128x128 with 8 warps = 64 spilled 724 B).
    float32 keeps only :data:`_FP32_TILES`. Only the first kept config when autotuning is off
    (kernels.tuning).
    """
    args = {**named_args, **kwargs}
    if args["A"].dtype == torch.float32 and not _INTERPRET:
        configs = [c for c in configs if _tile(c) in _FP32_TILES]
    if args["ACTIVATION"] == _IDENTITY.value:
        return tuning.limit(configs)
    per_thread = 32 if args["ACT_GRAD"] else 64
    fits = [c for c in configs
            if c.kwargs["BLOCK_M"] * c.kwargs["BLOCK_N"] <= per_thread * 32 * c.num_warps]
    return tuning.limit(fits)


@triton.jit
def _activation(h, ACTIVATION: tl.constexpr):
    """f(h) for a (non-identity) elementwise activation id; float32 in and out."""
    if ACTIVATION == _GELU:
        f = h * (0.5 + 0.5 * tl.erf(h * _SQRT1_2))
    elif ACTIVATION == _GELU_TANH:
        f = h * tl.sigmoid((h + h * h * h * _GELU_TANH_C) * _TWO_SQRT_2_OVER_PI)
    elif ACTIVATION == _RELU:
        f = tl.maximum(h, 0.0)
    else:
        tl.static_assert(ACTIVATION == _SILU)
        f = h * tl.sigmoid(h)
    return f


@triton.jit
def _activation_and_grad(h, ACTIVATION: tl.constexpr):
    """(f(h), f'(h)) for a (non-identity) elementwise activation id; float32."""
    if ACTIVATION == _GELU:
        cdf = 0.5 + 0.5 * tl.erf(h * _SQRT1_2)
        f = h * cdf
        df = cdf + h * tl.exp(-0.5 * h * h) * _INV_SQRT_2PI
    elif ACTIVATION == _GELU_TANH:
        # 0.5 (1 + tanh(u)) = sigmoid(2u);  0.5 (1 - tanh(u)^2) = 2 s (1 - s)
        s = tl.sigmoid((h + h * h * h * _GELU_TANH_C) * _TWO_SQRT_2_OVER_PI)
        f = h * s
        du = (1.0 + h * h * _THREE_GELU_TANH_C) * _SQRT_2_OVER_PI
        df = s + 2.0 * h * s * (1.0 - s) * du
    elif ACTIVATION == _RELU:
        f = tl.maximum(h, 0.0)
        df = tl.where(h > 0.0, 1.0, 0.0)
    else:
        tl.static_assert(ACTIVATION == _SILU)
        s = tl.sigmoid(h)
        f = h * s
        df = s * (1.0 + h * (1.0 - s))
    return f, df


@triton.jit
def _store_column_partials(Partial, vals, tile_mask, pid_m, rn, n_ok, n_groups,
                           stride_partial_row, BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
                           PARTIAL_ROWS: tl.constexpr):
    """Column sums of ``vals`` over each group of PARTIAL_ROWS rows of the tile."""
    GROUPS: tl.constexpr = BLOCK_M // PARTIAL_ROWS
    vals = tl.where(tile_mask, vals, 0.0)
    sums = tl.sum(tl.reshape(vals, (GROUPS, PARTIAL_ROWS, BLOCK_N)), axis=1)
    groups = pid_m * GROUPS + tl.arange(0, GROUPS)
    ptrs = Partial + groups.to(tl.int64)[:, None] * stride_partial_row + rn[None, :]
    tl.store(ptrs, sums, mask=(groups < n_groups)[:, None] & n_ok[None, :])


@triton.autotune(configs=_CONFIGS,
                 key=["m_bucket", "n_bucket", "k_bucket", "HAS_BIAS", "ACTIVATION", "GATED",
                      "ACT_GRAD", "COLSUM"],
                 prune_configs_by={"early_config_prune": _prune_configs},
                 do_bench=tuning.do_bench)
@triton.jit(do_not_specialize=["m_bucket", "n_bucket", "k_bucket"])
def _matmul_kernel(
    A, B, C, Bias, Pre, Act, Partial,
    M, N, K, m_bucket, n_bucket, k_bucket, n_groups, b_up_offset,
    stride_a_m, stride_a_k, stride_b_k, stride_b_n, stride_c_m,
    stride_pre_m, stride_pre_n, stride_act_m, stride_partial_row,
    HAS_BIAS: tl.constexpr, ACTIVATION: tl.constexpr, GATED: tl.constexpr,
    ACT_GRAD: tl.constexpr, COLSUM: tl.constexpr, DOT_PRECISION: tl.constexpr,
    PARTIAL_ROWS: tl.constexpr,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr, BLOCK_K: tl.constexpr, GROUP_M: tl.constexpr,
):
    """C[M, N] = A[M, K] @ B[K, N] + epilogue (see the module docstring).

    Forward (ACT_GRAD=False): C = act(A B + Bias); a non-identity ACTIVATION also stores
    A B + Bias to Pre. GATED: B has 2N columns (the up half starts b_up_offset elements after
    the gate half), C = f(gate) * up and Pre gets both halves.
    ACT_GRAD: reads Pre (width N, or 2N when GATED), C = dpre (same width), Act = act(Pre) (width
    N), and with COLSUM the dpre column partial sums go to Partial.
    """
    pid = tl.program_id(0)
    num_pid_m = tl.cdiv(M, BLOCK_M)
    num_pid_n = tl.cdiv(N, BLOCK_N)
    num_pid_in_group = GROUP_M * num_pid_n
    first_pid_m = (pid // num_pid_in_group) * GROUP_M
    group_size_m = min(num_pid_m - first_pid_m, GROUP_M)
    pid_m = first_pid_m + (pid % num_pid_in_group) % group_size_m
    pid_n = (pid % num_pid_in_group) // group_size_m

    rm = pid_m * BLOCK_M + tl.arange(0, BLOCK_M)
    rn = pid_n * BLOCK_N + tl.arange(0, BLOCK_N)
    rk = tl.arange(0, BLOCK_K)
    # Out-of-range rows / columns wrap onto valid ones, so only the K edge needs load masks;
    # their results are discarded by the store masks.
    a_ptrs = A + (rm % M).to(tl.int64)[:, None] * stride_a_m + rk[None, :] * stride_a_k
    b_ptrs = B + rk[:, None] * stride_b_k + (rn % N).to(tl.int64)[None, :] * stride_b_n
    acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if GATED and not ACT_GRAD:
        acc_up = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    for k in range(0, tl.cdiv(K, BLOCK_K)):
        k_ok = rk < K - k * BLOCK_K
        a = tl.load(a_ptrs, mask=k_ok[None, :], other=0.0)
        b = tl.load(b_ptrs, mask=k_ok[:, None], other=0.0)
        if DOT_PRECISION == "ieee":
            a = a.to(tl.float32)
            b = b.to(tl.float32)
        acc = tl.dot(a, b, acc, input_precision=DOT_PRECISION)
        if GATED and not ACT_GRAD:
            b_up = tl.load(b_ptrs + b_up_offset, mask=k_ok[:, None], other=0.0)
            if DOT_PRECISION == "ieee":
                b_up = b_up.to(tl.float32)
            acc_up = tl.dot(a, b_up, acc_up, input_precision=DOT_PRECISION)
        a_ptrs += BLOCK_K * stride_a_k
        b_ptrs += BLOCK_K * stride_b_k

    m_ok = rm < M
    n_ok = rn < N
    tile_mask = m_ok[:, None] & n_ok[None, :]
    rm64 = rm.to(tl.int64)
    c_ptrs = C + rm64[:, None] * stride_c_m + rn[None, :]
    if ACT_GRAD:
        pre_ptrs = Pre + rm64[:, None] * stride_pre_m + rn[None, :] * stride_pre_n
        act_ptrs = Act + rm64[:, None] * stride_act_m + rn[None, :]
        f, df = _activation_and_grad(tl.load(pre_ptrs, mask=tile_mask, other=0.0).to(tl.float32),
                                     ACTIVATION)
        # Each result is stored as soon as it exists, to keep few tiles live at once.
        if GATED:
            up = tl.load(pre_ptrs + N * stride_pre_n, mask=tile_mask, other=0.0).to(tl.float32)
            tl.store(act_ptrs, (f * up).to(Act.dtype.element_ty), mask=tile_mask)
            d_up = acc * f
            tl.store(c_ptrs + N, d_up.to(C.dtype.element_ty), mask=tile_mask)
            if COLSUM:
                _store_column_partials(Partial + N, d_up, tile_mask, pid_m, rn, n_ok, n_groups,
                                       stride_partial_row, BLOCK_M, BLOCK_N, PARTIAL_ROWS)
            d_pre = acc * up * df
        else:
            tl.store(act_ptrs, f.to(Act.dtype.element_ty), mask=tile_mask)
            d_pre = acc * df
        tl.store(c_ptrs, d_pre.to(C.dtype.element_ty), mask=tile_mask)
        if COLSUM:
            _store_column_partials(Partial, d_pre, tile_mask, pid_m, rn, n_ok, n_groups,
                                   stride_partial_row, BLOCK_M, BLOCK_N, PARTIAL_ROWS)
    else:
        if HAS_BIAS:
            acc += tl.load(Bias + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
            if GATED:
                acc_up += tl.load(Bias + N + rn, mask=n_ok, other=0.0).to(tl.float32)[None, :]
        if ACTIVATION != _IDENTITY:
            pre_ptrs = Pre + rm64[:, None] * stride_pre_m + rn[None, :] * stride_pre_n
            h = acc.to(Pre.dtype.element_ty)
            tl.store(pre_ptrs, h, mask=tile_mask)
            acc = _activation(h.to(tl.float32), ACTIVATION)
            if GATED:
                up = acc_up.to(Pre.dtype.element_ty)
                tl.store(pre_ptrs + N * stride_pre_n, up, mask=tile_mask)
                acc = acc * up.to(tl.float32)
        tl.store(c_ptrs, acc.to(C.dtype.element_ty), mask=tile_mask)


def _matmul(name, a, b, c, n, *, bias=None, pre=None, act=None, partial=None,
            activation=_IDENTITY.value, gated=False, act_grad=False):
    """Launch ``c = a @ b`` (+ epilogue) for views ``a`` (M, K) and ``b`` (K, N or 2N); ``name``
    (e.g. ``"x @ w1^T"``) names the product in errors.

    ``n`` is the epilogue's logical width N (half of ``b``'s columns for a gated forward).
    ``c``, ``act`` and ``partial`` are freshly allocated, contiguous.
    """
    M, K = a.shape
    if M == 0 or n == 0:
        return
    _check_int32(name, a, b, n, pre)

    def grid(meta):
        return (tuning.cdiv(M, meta["BLOCK_M"]) * tuning.cdiv(n, meta["BLOCK_N"]),)

    pre_strides = pre.stride() if pre is not None else (0, 0)
    tuning.wrap_triton(_matmul_kernel)[grid](
        a, b, c, bias, pre, act, partial,
        M, n, K, tuning.bucket(M), tuning.bucket(n), tuning.bucket(K),
        partial.shape[0] if partial is not None else 0,
        n * b.stride(1) if gated and not act_grad else 0,
        a.stride(0), a.stride(1), b.stride(0), b.stride(1), c.stride(0),
        pre_strides[0], pre_strides[1],
        act.stride(0) if act is not None else 0,
        partial.stride(0) if partial is not None else 0,
        HAS_BIAS=bias is not None, ACTIVATION=activation, GATED=gated, ACT_GRAD=act_grad,
        COLSUM=partial is not None,
        DOT_PRECISION="ieee" if a.dtype == torch.float32 or _INTERPRET else "tf32",
        PARTIAL_ROWS=PARTIAL_ROWS,
    )


def _check_dtype(x):
    """The dtypes these kernels are built for (x's; the arguments themselves - ranks, shapes, one
    dtype and device for all, the activation - are checked once, in fastattn.ops)."""
    if x.dtype not in _DTYPES:
        raise TypeError(f"the triton ffn kernels take float32, float16 or bfloat16, got x {x.dtype}")


def _dims(x, w1, w2, activation):
    """``(M, D, F, D2, width of pre, activation id, gated)`` of checked arguments."""
    spec = act.lookup(activation)
    M, D = x.shape
    width = w1.shape[0]
    F = width // 2 if spec.gated else width
    return M, D, F, w2.shape[0], width, spec.code, spec.gated


def _check_int32(name, a, b, n, pre):
    """The int32 index arithmetic of one :func:`_matmul` launch, checked cheaply: row and column
    indices up to a tile past M and N, K offsets up to BLOCK_K * stride, and (with pre) its column
    offsets up to (2N + BLOCK_N) * stride; the row offsets themselves are int64."""
    big = _MAX_BLOCK
    spans = [("rows", a.shape[0] + big, 1), ("columns", n + big, 1),
             ("K offsets of the left operand", big, a.stride(1)),
             ("K offsets of the right operand", big, b.stride(0))]
    if pre is not None:
        spans.append(("pre's column offsets", 2 * n + big, pre.stride(1)))
    for what, count, stride in spans:
        if count * abs(stride) >= 2**31:
            raise ValueError(
                f"the triton ffn kernels compute {what} of {name} in int32: {count} * stride "
                f"{stride} >= 2**31 (operands {tuple(a.shape)} with strides {a.stride()}, "
                f"{tuple(b.shape)} with strides {b.stride()})")


def ffn_fwd(x, w1, b1, w2, b2, activation):
    """``out = act(x w1^T + b1) w2^T + b2``; returns ``(out, pre)``.

    x (M, D); w1 (F, D), or (2F, D) for swiglu / geglu; w2 (D2, F); b1 (w1.shape[0],) and b2
    (D2,) or None. ``pre = x w1^T + b1`` (M, w1.shape[0]) is kept for :func:`ffn_bwd`.
    """
    _check_dtype(x)
    M, D, F, D2, width, act_id, gated = _dims(x, w1, w2, activation)
    pre = torch.empty((M, width), dtype=x.dtype, device=x.device)
    a = torch.empty((M, F), dtype=x.dtype, device=x.device)
    out = torch.empty((M, D2), dtype=x.dtype, device=x.device)
    _matmul("x @ w1^T", x, w1.t(), a, F, bias=b1, pre=pre, activation=act_id, gated=gated)
    _matmul("act @ w2^T", a, w2.t(), out, D2, bias=b2)
    return out, pre


def ffn_bwd(dout, x, w1, w2, pre, activation, output_mask):
    """Gradients of :func:`ffn_fwd`; returns ``(dx, dw1, db1, dw2, db2)``.

    ``output_mask = [want db1, want db2]``; an unwanted bias gradient is an empty tensor.
    """
    _check_dtype(x)
    want_db1, want_db2 = (bool(v) for v in output_mask)
    M, D, F, D2, width, act_id, gated = _dims(x, w1, w2, activation)
    opts = dict(dtype=x.dtype, device=x.device)
    dpre = torch.empty((M, width), **opts)
    a = torch.empty((M, F), **opts)
    partial = None
    if want_db1:
        partial = torch.empty((tuning.cdiv(M, PARTIAL_ROWS), width), dtype=torch.float32,
                              device=x.device)
    _matmul("dout @ w2", dout, w2, dpre, F, pre=pre, act=a, partial=partial, activation=act_id,
            gated=gated, act_grad=True)
    dx = torch.empty((M, D), **opts)
    dw1 = torch.empty((width, D), **opts)
    dw2 = torch.empty((D2, F), **opts)
    _matmul("dpre @ w1", dpre, w1, dx, D)
    _matmul("dpre^T @ x", dpre.t(), x, dw1, D)
    _matmul("dout^T @ act", dout.t(), a, dw2, F)
    # Unwanted gradients are empty tensors, one each (op outputs may not alias each other).
    db1 = partial.sum(0).to(x.dtype) if want_db1 else torch.empty(0, **opts)
    db2 = dout.sum(0, dtype=torch.float32).to(x.dtype) if want_db2 else torch.empty(0, **opts)
    return dx, dw1, db1, dw2, db2
