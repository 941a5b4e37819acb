"""Triton LayerNorm / RMSNorm with an optional fused residual add, forward and backward.

Math (per row of N elements, all arithmetic in float32):
    forward   h = x + residual (rounded to x.dtype; h = x without a residual)
              LayerNorm: mean = E[h], rstd = 1 / sqrt(E[(h - mean)^2] + eps),
                         y = (h - mean) * rstd * w + b
              RMSNorm:   rstd = 1 / sqrt(E[h^2] + eps), y = h * rstd * w
    backward  xhat = (h - mean) * rstd (h * rstd for RMSNorm), g = dy * w (dy without a weight)
              LayerNorm: dx = rstd * (g - E[g] - xhat * E[g * xhat]) + dh
              RMSNorm:   dx = rstd * (g - xhat * E[g * xhat]) + dh
              dweight = sum over rows of dy * xhat, dbias = sum over rows of dy (LayerNorm only)

Split over programs:
- Short rows are held in registers, BLOCK_N = next_power_of_2(N): forward up to
  FWD_MAX_FUSED_BYTES (32 KiB) of input per row (N <= 8192 for float32, N <= 16384 for
  float16/bfloat16), backward up to N <= BWD_MAX_FUSED_N (8192) whatever the dtype (it keeps
  about twice as many float32 values live per element). num_warps follows the tile size.
  A program works on a (BLOCK_M, BLOCK_N) tile of whole rows; short rows are packed so a tile
  holds ~_TILE_ELEMS elements. Forward reads x (and residual) once and writes y (and h) once;
  backward reads dy, h (and dh) once and writes dx once.
- Longer rows take the looped kernels, one row at a time in chunks of _LOOP_BLOCK_N elements:
  forward pass 1 computes the statistics (chunk mean/M2 merged with Chan's formula; h is written
  here), pass 2 normalizes; backward pass 1 reduces E[g] and E[g * xhat], pass 2 writes dx.
  Pass-1 loads are marked evict_last so that the pass-2 re-read mostly hits L2. There is no
  upper limit on N.
- Backward without atomics: each program owns a contiguous range of rows and accumulates
  dweight/dbias in float32 into its own row of a (programs, N) buffer (in registers for short
  rows; read-modify-write of its own partial row, ordered by a barrier, for long rows), which
  is then summed over programs with torch. The program count is between one and a few waves of SMs, aiming at
  >= 64 rows per program so the partial buffer stays small next to dy/h/dx.

Limits (checked by the launchers; the arguments themselves are checked by fastattn.ops): rows of
at least one element with a unit last stride (any row stride), at most 2**31 - 4097 rows (row
indices are int32; element offsets are int64).

Precision: inputs float32/float16/bfloat16 (x, residual, weight, bias may differ in dtype);
statistics, reductions and partial sums are float32; y, h and dx are rounded to x.dtype (h.dtype)
once; mean/rstd are float32; dweight/dbias come back in weight's dtype.
"""

import torch
import triton
import triton.language as tl

from . import tuning

__all__ = ["layer_norm_fwd", "layer_norm_bwd", "FWD_MAX_FUSED_BYTES", "BWD_MAX_FUSED_N"]

_SUPPORTED_DTYPES = (torch.float32, torch.float16, torch.bfloat16)
FWD_MAX_FUSED_BYTES = 32768
BWD_MAX_FUSED_N = 8192
_TILE_ELEMS = 4096
_LOOP_BLOCK_N = 4096
_LOOP_NUM_WARPS = 8
_MIN_ROWS_PER_PROGRAM = 64
_WARPS_PER_SM = 32
#: Row indices are int32 (a tile's last index, rows + BLOCK_M - 1, must not wrap).
_MAX_ROWS = 2**31 - 1 - _TILE_ELEMS


# ---------------------------------------------------------------------------------------------
# Kernels: rows held in registers
# ---------------------------------------------------------------------------------------------

@triton.jit
def _layer_norm_fwd_kernel(
    X, RES, W, B, Y, H, Mean, Rstd,
    stride_x_row, stride_res_row, stride_y_row, stride_h_row,
    M, N, eps,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    RMS: tl.constexpr,
):
    rows = tl.program_id(0) * BLOCK_M + tl.arange(0, BLOCK_M)
    cols = tl.arange(0, BLOCK_N)
    row_mask = rows < M
    col_mask = cols < N
    mask = row_mask[:, None] & col_mask[None, :]
    rows64 = rows.to(tl.int64)[:, None]

    x = tl.load(X + rows64 * stride_x_row + cols[None, :], mask=mask, other=0.0,
                eviction_policy="evict_first")
    if HAS_RESIDUAL:
        res = tl.load(RES + rows64 * stride_res_row + cols[None, :], mask=mask, other=0.0,
                      eviction_policy="evict_first")
        x = (x.to(tl.float32) + res.to(tl.float32)).to(X.dtype.element_ty)
        tl.store(H + rows64 * stride_h_row + cols[None, :], x, mask=mask)
    h = x.to(tl.float32)

    if RMS:
        rstd = tl.rsqrt(tl.sum(h * h, axis=1) / N + eps)
        xhat = h * rstd[:, None]
    else:
        mean = tl.sum(h, axis=1) / N
        hc = tl.where(mask, h - mean[:, None], 0.0)
        rstd = tl.rsqrt(tl.sum(hc * hc, axis=1) / N + eps)
        xhat = hc * rstd[:, None]
        tl.store(Mean + rows, mean, mask=row_mask)
    tl.store(Rstd + rows, rstd, mask=row_mask)

    y = xhat
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=col_mask, other=0.0, eviction_policy="evict_last")
        y = y * w.to(tl.float32)[None, :]
    if HAS_BIAS:
        b = tl.load(B + cols, mask=col_mask, other=0.0, eviction_policy="evict_last")
        y = y + b.to(tl.float32)[None, :]
    tl.store(Y + rows64 * stride_y_row + cols[None, :], y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _layer_norm_bwd_kernel(
    DY, DH, H, W, Mean, Rstd, DX, DW, DB,
    stride_dy_row, stride_dh_row, stride_h_row, stride_dx_row,
    M, N, tiles_per_program,
    BLOCK_M: tl.constexpr, BLOCK_N: tl.constexpr,
    HAS_DH: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    COMPUTE_DW: tl.constexpr, COMPUTE_DB: tl.constexpr, RMS: tl.constexpr,
):
    pid = tl.program_id(0)
    cols = tl.arange(0, BLOCK_N)
    col_mask = cols < N
    if HAS_WEIGHT:
        w = tl.load(W + cols, mask=col_mask, other=0.0).to(tl.float32)
    if COMPUTE_DW:
        dw_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)
    if COMPUTE_DB:
        db_acc = tl.zeros((BLOCK_M, BLOCK_N), dtype=tl.float32)

    tile_start = pid * tiles_per_program
    for tile in range(tile_start, tile_start + tiles_per_program):
        rows = tile * BLOCK_M + tl.arange(0, BLOCK_M)
        row_mask = rows < M
        mask = row_mask[:, None] & col_mask[None, :]
        rows64 = rows.to(tl.int64)[:, None]

        h = tl.load(H + rows64 * stride_h_row + cols[None, :], mask=mask, other=0.0,
                    eviction_policy="evict_first").to(tl.float32)
        dy = tl.load(DY + rows64 * stride_dy_row + cols[None, :], mask=mask, other=0.0,
                     eviction_policy="evict_first").to(tl.float32)
        rstd = tl.load(Rstd + rows, mask=row_mask, other=0.0)
        if RMS:
            xhat = h * rstd[:, None]
        else:
            mean = tl.load(Mean + rows, mask=row_mask, other=0.0)
            xhat = tl.where(mask, h - mean[:, None], 0.0) * rstd[:, None]
        if HAS_WEIGHT:
            g = dy * w[None, :]
        else:
            g = dy
        c_xhat = tl.sum(g * xhat, axis=1) / N
        if RMS:
            dx = (g - xhat * c_xhat[:, None]) * rstd[:, None]
        else:
            c_g = tl.sum(g, axis=1) / N
            dx = (g - c_g[:, None] - xhat * c_xhat[:, None]) * rstd[:, None]
        if HAS_DH:
            dh = tl.load(DH + rows64 * stride_dh_row + cols[None, :], mask=mask, other=0.0,
                         eviction_policy="evict_first")
            dx = dx + dh.to(tl.float32)
        tl.store(DX + rows64 * stride_dx_row + cols[None, :], dx.to(DX.dtype.element_ty),
                 mask=mask)
        if COMPUTE_DW:
            dw_acc += dy * xhat
        if COMPUTE_DB:
            db_acc += dy

    if COMPUTE_DW:
        tl.store(DW + pid * N + cols, tl.sum(dw_acc, axis=0), mask=col_mask)
    if COMPUTE_DB:
        tl.store(DB + pid * N + cols, tl.sum(db_acc, axis=0), mask=col_mask)


# ---------------------------------------------------------------------------------------------
# Kernels: long rows streamed in BLOCK_N chunks
# ---------------------------------------------------------------------------------------------

@triton.jit
def _layer_norm_fwd_looped_kernel(
    X, RES, W, B, Y, H, Mean, Rstd,
    stride_x_row, stride_res_row, stride_y_row, stride_h_row,
    N, eps,
    BLOCK_N: tl.constexpr,
    HAS_RESIDUAL: tl.constexpr, HAS_WEIGHT: tl.constexpr, HAS_BIAS: tl.constexpr,
    RMS: tl.constexpr,
):
    row = tl.program_id(0)
    row64 = row.to(tl.int64)
    x_row = X + row64 * stride_x_row
    res_row = RES + row64 * stride_res_row
    h_row = H + row64 * stride_h_row
    y_row = Y + row64 * stride_y_row
    offs = tl.arange(0, BLOCK_N)

    # Pass 1: statistics (and h = x + residual).
    sq_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
    count = 0.0
    mean = 0.0
    m2 = 0.0
    for start in range(0, N, BLOCK_N):
        cols = start + offs
        mask = cols < N
        x = tl.load(x_row + cols, mask=mask, other=0.0, eviction_policy="evict_last")
        if HAS_RESIDUAL:
            res = tl.load(res_row + cols, mask=mask, other=0.0, eviction_policy="evict_first")
            x = (x.to(tl.float32) + res.to(tl.float32)).to(X.dtype.element_ty)
            tl.store(h_row + cols, x, mask=mask, eviction_policy="evict_last")
        h = x.to(tl.float32)
        if RMS:
            sq_acc += h * h
        else:
            n_chunk = tl.minimum(N - start, BLOCK_N).to(tl.float32)
            chunk_mean = tl.sum(h, axis=0) / n_chunk
            hc = tl.where(mask, h - chunk_mean, 0.0)
            chunk_m2 = tl.sum(hc * hc, axis=0)
            total = count + n_chunk
            delta = chunk_mean - mean
            mean = mean + delta * (n_chunk / total)
            m2 = m2 + chunk_m2 + delta * delta * (count * n_chunk / total)
            count = total
    if RMS:
        rstd = tl.rsqrt(tl.sum(sq_acc, axis=0) / N + eps)
    else:
        rstd = tl.rsqrt(m2 / N + eps)
        tl.store(Mean + row, mean)
    tl.store(Rstd + row, rstd)

    # Pass 2: normalize. With a residual, h is re-read from what pass 1 wrote; the barrier makes
    # those stores visible to every thread of the program.
    if HAS_RESIDUAL:
        tl.debug_barrier()
        src_row = h_row
    else:
        src_row = x_row
    for start in range(0, N, BLOCK_N):
        cols = start + offs
        mask = cols < N
        h = tl.load(src_row + cols, mask=mask, other=0.0,
                    eviction_policy="evict_first").to(tl.float32)
        if RMS:
            y = h * rstd
        else:
            y = (h - mean) * rstd
        if HAS_WEIGHT:
            w = tl.load(W + cols, mask=mask, other=0.0, eviction_policy="evict_last")
            y = y * w.to(tl.float32)
        if HAS_BIAS:
            b = tl.load(B + cols, mask=mask, other=0.0, eviction_policy="evict_last")
            y = y + b.to(tl.float32)
        tl.store(y_row + cols, y.to(Y.dtype.element_ty), mask=mask)


@triton.jit
def _layer_norm_bwd_looped_kernel(
    DY, DH, H, W, Mean, Rstd, DX, DW, DB,
    stride_dy_row, stride_dh_row, stride_h_row, stride_dx_row,
    M, N, rows_per_program,
    BLOCK_N: tl.constexpr,
    HAS_DH: tl.constexpr, HAS_WEIGHT: tl.constexpr,
    COMPUTE_DW: tl.constexpr, COMPUTE_DB: tl.constexpr, RMS: tl.constexpr,
):
    pid = tl.program_id(0)
    offs = tl.arange(0, BLOCK_N)
    dw_row = DW + pid * N
    db_row = DB + pid * N
    row_start = pid * rows_per_program
    row_end = tl.minimum(row_start + rows_per_program, M)
    for row in range(row_start, row_end):
        row64 = tl.cast(row, tl.int64)
        h_row = H + row64 * stride_h_row
        dy_row = DY + row64 * stride_dy_row
        rstd = tl.load(Rstd + row)
        if RMS:
            mean = 0.0
        else:
            mean = tl.load(Mean + row)

        # Pass 1: E[g * xhat] and E[g].
        gx_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        g_acc = tl.zeros((BLOCK_N,), dtype=tl.float32)
        for start in range(0, N, BLOCK_N):
            cols = start + offs
            mask = cols < N
            h = tl.load(h_row + cols, mask=mask, other=0.0,
                        eviction_policy="evict_last").to(tl.float32)
            g = tl.load(dy_row + cols, mask=mask, other=0.0,
                        eviction_policy="evict_last").to(tl.float32)
            if HAS_WEIGHT:
                g = g * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
            xhat = tl.where(mask, h - mean, 0.0) * rstd
            gx_acc += g * xhat
            if not RMS:
                g_acc += g
        c_xhat = tl.sum(gx_acc, axis=0) / N
        c_g = tl.sum(g_acc, axis=0) / N

        # Pass 2: dx, and dweight/dbias into this program's float32 partial row.
        for start in range(0, N, BLOCK_N):
            cols = start + offs
            mask = cols < N
            h = tl.load(h_row + cols, mask=mask, other=0.0,
                        eviction_policy="evict_first").to(tl.float32)
            dy = tl.load(dy_row + cols, mask=mask, other=0.0,
                         eviction_policy="evict_first").to(tl.float32)
            xhat = tl.where(mask, h - mean, 0.0) * rstd
            if HAS_WEIGHT:
                g = dy * tl.load(W + cols, mask=mask, other=0.0).to(tl.float32)
            else:
                g = dy
            if RMS:
                dx = (g - xhat * c_xhat) * rstd
            else:
                dx = (g - c_g - xhat * c_xhat) * rstd
            if HAS_DH:
                dh = tl.load(DH + row64 * stride_dh_row + cols, mask=mask, other=0.0,
                             eviction_policy="evict_first")
                dx = dx + dh.to(tl.float32)
            tl.store(DX + row64 * stride_dx_row + cols, dx.to(DX.dtype.element_ty), mask=mask)
            if COMPUTE_DW:
                dw = tl.load(dw_row + cols, mask=mask, other=0.0)
                tl.store(dw_row + cols, dw + dy * xhat, mask=mask)
            if COMPUTE_DB:
                db = tl.load(db_row + cols, mask=mask, other=0.0)
                tl.store(db_row + cols, db + dy, mask=mask)
        # The next row's read-modify-write of the partial rows must see this row's stores.
        if COMPUTE_DW or COMPUTE_DB:
            tl.debug_barrier()


# ---------------------------------------------------------------------------------------------
# Launchers
# ---------------------------------------------------------------------------------------------


def _num_warps(elems, elems_per_thread):
    """Warps for a tile of `elems` elements at about `elems_per_thread` each (1 to 16)."""
    return max(1, min(16, elems // (32 * elems_per_thread)))


def _fwd_fused_limit(dtype):
    """Largest N the forward holds in registers for this input dtype (a power of two)."""
    return FWD_MAX_FUSED_BYTES // dtype.itemsize


def _rows_per_tile(block_n, m, num_sms):
    """Pack short rows into ~_TILE_ELEMS-element tiles, keeping >= 4 tiles per SM if rows allow."""
    block_m = max(1, _TILE_ELEMS // block_n)
    while block_m > 1 and tuning.cdiv(m, block_m) < 4 * num_sms:
        block_m //= 2
    return block_m


def _check_limits(M, N, **tensors):
    """What only these kernels know, checked cheaply; the arguments themselves (shapes, devices,
    eps, rms without bias) are checked once, in fastattn.ops. Each of ``tensors`` (None: absent)
    must have a dtype the kernels are built for (float32 for mean / rstd) and a unit last stride;
    rows have at least one element, and the row index (int32) stays below 2**31."""
    for name, t in tensors.items():
        if t is None:
            continue
        tuning.check_layout("layer_norm", name, t,
                            (torch.float32,) if name in ("mean", "rstd") else _SUPPORTED_DTYPES)
    if N < 1:
        raise ValueError(f"the triton layer_norm kernels take rows of at least one element, got N = {N}")
    if M > _MAX_ROWS:
        raise ValueError(f"the triton layer_norm kernels take at most {_MAX_ROWS} rows "
                         f"(int32 row indices), got {M}")


def layer_norm_fwd(x, residual, weight, bias, eps, rms):
    """LayerNorm (rms=False) or RMSNorm (rms=True) over the last dim of x (M, N).

    x, residual: (M, N), contiguous last dim, any row stride; weight, bias: (N,) or None (bias
    must be None with rms). Returns (y, h, mean, rstd): y (M, N) contiguous in x.dtype;
    h = x + residual rounded to x.dtype, or an empty tensor (numel 0) without residual;
    mean, rstd float32 (M,) (mean empty for rms).
    """
    M, N = x.shape
    rms = bool(rms)
    _check_limits(M, N, x=x, residual=residual, weight=weight, bias=bias)

    y = torch.empty((M, N), dtype=x.dtype, device=x.device)
    h = torch.empty((M, N) if residual is not None else (0,), dtype=x.dtype, device=x.device)
    mean = torch.empty((0,) if rms else (M,), dtype=torch.float32, device=x.device)
    rstd = torch.empty((M,), dtype=torch.float32, device=x.device)
    if M == 0:
        return y, h, mean, rstd

    # Placeholders for absent tensors; the constexpr flags keep the kernel from touching them.
    res_arg = residual if residual is not None else x
    h_arg = h if residual is not None else y
    w_arg = weight if weight is not None else x
    b_arg = bias if bias is not None else x
    mean_arg = rstd if rms else mean
    stride_res = residual.stride(0) if residual is not None else 0
    stride_h = h.stride(0) if residual is not None else 0
    flags = dict(HAS_RESIDUAL=residual is not None, HAS_WEIGHT=weight is not None,
                 HAS_BIAS=bias is not None, RMS=rms)

    if N <= _fwd_fused_limit(x.dtype):
        block_n = tuning.next_power_of_2(N)
        block_m = _rows_per_tile(block_n, M, tuning.num_sms(x.device))
        grid = (tuning.cdiv(M, block_m),)
        tuning.wrap_triton(_layer_norm_fwd_kernel)[grid](
            x, res_arg, w_arg, b_arg, y, h_arg, mean_arg, rstd,
            x.stride(0), stride_res, y.stride(0), stride_h,
            M, N, float(eps),
            BLOCK_M=block_m, BLOCK_N=block_n, **flags,
            num_warps=_num_warps(block_m * block_n, 16),
        )
    else:
        tuning.wrap_triton(_layer_norm_fwd_looped_kernel)[(M,)](
            x, res_arg, w_arg, b_arg, y, h_arg, mean_arg, rstd,
            x.stride(0), stride_res, y.stride(0), stride_h,
            N, float(eps),
            BLOCK_N=_LOOP_BLOCK_N, **flags,
            num_warps=_LOOP_NUM_WARPS,
        )
    return y, h, mean, rstd


def layer_norm_bwd(dy, dh, h, weight, mean, rstd, rms, output_mask):
    """Gradients of layer_norm_fwd with respect to x (also residual), weight and bias.

    h is the normalized input (x, or the h returned by the forward); dh (or None) is the gradient
    flowing into the returned h and is added to dx. output_mask = [want dweight, want dbias].
    mean is ignored (may be empty) for rms. Returns (dx, dweight, dbias): dx (M, N) contiguous
    in h.dtype; dweight, dbias (N,) in weight.dtype. An unwanted gradient, both when weight is
    None, and dbias for rms come back as empty tensors (numel 0, h.dtype).
    """
    M, N = h.shape
    rms = bool(rms)
    _check_limits(M, N, h=h, dy=dy, dh=dh, weight=weight, mean=None if rms else mean, rstd=rstd)
    compute_dw = bool(output_mask[0]) and weight is not None
    compute_db = bool(output_mask[1]) and weight is not None and not rms

    dx = torch.empty((M, N), dtype=h.dtype, device=h.device)
    if M == 0:
        dweight = torch.zeros_like(weight) if compute_dw else h.new_empty((0,))
        dbias = torch.zeros_like(weight) if compute_db else h.new_empty((0,))
        return dx, dweight, dbias

    num_sms = tuning.num_sms(h.device)
    looped = N > BWD_MAX_FUSED_N
    if looped:
        block_n, block_m, num_warps = _LOOP_BLOCK_N, 1, _LOOP_NUM_WARPS
    else:
        block_n = tuning.next_power_of_2(N)
        block_m = _rows_per_tile(block_n, M, num_sms)
        num_warps = _num_warps(block_m * block_n, 8)
    num_tiles = tuning.cdiv(M, block_m)
    if compute_dw or compute_db:
        waves = max(1, _WARPS_PER_SM // num_warps)
        programs = max(num_sms, min(num_sms * waves, tuning.cdiv(M, _MIN_ROWS_PER_PROGRAM)))
        programs = min(num_tiles, programs)
    else:
        programs = num_tiles
    tiles_per_program = tuning.cdiv(num_tiles, programs)
    programs = tuning.cdiv(num_tiles, tiles_per_program)

    alloc = torch.zeros if looped else torch.empty
    dw_part = alloc((programs, N) if compute_dw else (1,), dtype=torch.float32, device=h.device)
    db_part = alloc((programs, N) if compute_db else (1,), dtype=torch.float32, device=h.device)

    dh_arg = dh if dh is not None else dy
    w_arg = weight if weight is not None else dy
    mean_arg = rstd if rms else mean
    stride_dh = dh.stride(0) if dh is not None else 0
    flags = dict(HAS_DH=dh is not None, HAS_WEIGHT=weight is not None,
                 COMPUTE_DW=compute_dw, COMPUTE_DB=compute_db, RMS=rms)
    args = (dy, dh_arg, h, w_arg, mean_arg, rstd, dx, dw_part, db_part,
            dy.stride(0), stride_dh, h.stride(0), dx.stride(0), M, N, tiles_per_program)
    if looped:
        tuning.wrap_triton(_layer_norm_bwd_looped_kernel)[(programs,)](
            *args, BLOCK_N=block_n, **flags, num_warps=num_warps)
    else:
        tuning.wrap_triton(_layer_norm_bwd_kernel)[(programs,)](
            *args, BLOCK_M=block_m, BLOCK_N=block_n, **flags, num_warps=num_warps)

    # Distinct empty tensors: outputs of a custom op must not alias each other.
    dweight = dw_part.sum(0).to(weight.dtype) if compute_dw else h.new_empty((0,))
    dbias = db_part.sum(0).to(weight.dtype) if compute_db else h.new_empty((0,))
    return dx, dweight, dbias
