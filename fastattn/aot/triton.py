"""The Triton half of the Hopper compile gate: every launch the launchers make, compiled for sm_90.

How: each case below calls a real launcher (``fastattn.kernels.*``) on small CPU tensors with
``kernels.tuning.TARGET`` set to an H100 (132 SMs, capability 9.0), so launch plans are the GPU's.
While a case runs, Triton's ``Autotuner.run`` and ``JITFunction.run`` only record their arguments;
nothing executes. Each recorded launch is then expanded into the configs its autotuner's pruner
keeps (the first one only with ``kernels.tuning.AUTOTUNE`` off, i.e. what the GPU test suite runs)
and compiled with ``triton.compile(ASTSource(...), target=GPUTarget("cuda", 90, 32))``, the way
Triton's own launch path would on the device. Each variant gives a :class:`report.Row`: ptxas's
registers and spills, the shared memory Triton asks for, and the SASS features (cuobjdump).

Descriptor (TMA) and pointer paths are both compiled for attention (``kernels.descriptors.TMA``
forced to 1 and 0); warp-specialized configs are kept where the pruner keeps them on a Hopper GPU with
FASTATTN_TRITON_WS=1.
Tensor contents never matter, only shapes, dtypes, strides and 16-byte alignment.

Spill budget: 0 bytes for every kept config, unless :data:`SPILL_BUDGET` names the kernel.
"""

from __future__ import annotations

import contextlib
import dataclasses
import io
import os
import subprocess
import tempfile
import warnings
from typing import Callable

import torch

from fastattn.aot.report import (Row, parse_ptxas, sass_digest, sass_features, sass_of,
                                  undefined_uniform_reads)

H100 = {"capability": (9, 0), "sms": 132, "shared_bytes": 227 * 1024}

#: (kernel, a word of the case) -> (bytes of spill stores + loads allowed, why). Every other
#: variant may not spill at all.
SPILL_BUDGET: dict[tuple[str, str], tuple[int, str]] = {
    # (none: float32 attention has configs of its own that do not spill, kernels/attention.py)
}


#: Features a kernel's SASS must hold on the descriptor path (attention): TMA loads. A
#: warp-specialized config must also hold setmaxnreg (else Triton did not specialize it).
REQUIRED_TMA = ("tma",)


@dataclasses.dataclass
class Case:
    """One launcher call: ``run()`` calls it on CPU tensors; ``name`` says what it stands for;
    ``paths`` are the values of kernels.descriptors.TMA it is run under."""
    op: str
    name: str
    run: Callable[[], object]
    quick: bool = False
    paths: tuple[str, ...] = ("0",)
    tune: bool = True   # full runs compile every kept config (else the first, and WS ones)


@dataclasses.dataclass
class Launch:
    case: str
    path: str
    fn: object          # triton Autotuner or JITFunction
    args: tuple
    kwargs: dict


# ---------------------------------------------------------------------------------------------
# The cases: representative shapes for every launcher
# ---------------------------------------------------------------------------------------------

def _t(*shape, dtype=torch.bfloat16):
    return torch.empty(shape, dtype=dtype)


_SHORT = {torch.bfloat16: "bf16", torch.float16: "fp16", torch.float32: "fp32"}


def _attention_cases():
    from fastattn.kernels import attention_launch as AL

    def attn(d, dtype, L=4096, Lk=None, causal=False, mask=None, dropout=0.0, backward=True,
             dmask=False, window=None, mask_dtype=None, dv=None, blhd=False):
        Lk = L if Lk is None else Lk
        dv = d if dv is None else dv

        def x(n, width):  # (B, H, L, D), or a (B, L, H, D) tensor seen as one
            return _t(1, n, 2, width, dtype=dtype).transpose(1, 2) if blhd else \
                _t(1, 2, n, width, dtype=dtype)
        q, k, v = x(L, d), x(Lk, d), x(Lk, dv)
        m = None
        if mask == "bool":
            m = torch.empty(1, 1, L, Lk, dtype=torch.bool).expand(1, 2, L, Lk)
        elif mask == "float":
            m = torch.empty(1, 1, L, Lk, dtype=mask_dtype or dtype).expand(1, 2, L, Lk)
        left, right = (window or (Lk, 0)) if causal or window else (Lk, Lk)
        band = (Lk - L, left, right)

        def run():
            out, lse = AL.attention_forward(q, k, v, m, d ** -0.5, *band, dropout, 1)
            if backward:
                AL.attention_backward(out, q, k, v, out, lse, m, d ** -0.5, *band, dropout,
                                      1, dmask)
        return run

    def jvp(d, dtype, L=4096):
        from fastattn.kernels import attention_jvp as J
        q, k, v, tq, tk, tv = (_t(1, 2, L, d, dtype=dtype) for _ in range(6))

        def run():
            J.attention_jvp(q, k, v, None, tq, tk, tv, None, 0.125, 0, L, 0, 0.0, 1)
        return run

    cases = [
        # test_attention_combinations[triton-0], the forward that faulted on the H100 on
        # 2026-11-27: head dims 100 and 1, (B, L, H, D) inputs whose row strides (200, 2) are
        # not multiples of 16 bytes (pointer path only), a causal window and a bool mask
        Case("attention", "bf16 D100 Dv1 blhd L33x40 causal window bool mask",
             attn(100, torch.bfloat16, L=33, Lk=40, causal=True, window=(15, 0), mask="bool",
                  dv=1, blhd=True), quick=True),
    ]
    # Head dims that are not multiples of 16: no row of q, k or v starts on a 16-byte boundary
    # that Triton can know of (their strides are not multiples of 16), so tiles are loaded
    # element by element, without cp.async
    for d in (40, 100):
        cases += [
            Case("attention", f"bf16 D{d} L1k causal", attn(d, torch.bfloat16, L=1024,
                                                             causal=True)),
            Case("attention", f"bf16 D{d} L1k bool mask",
                 attn(d, torch.bfloat16, L=1024, mask="bool", backward=False)),
            Case("attention", f"bf16 D{d} decode 1x4k",
                 attn(d, torch.bfloat16, L=1, Lk=4096, causal=True, backward=False)),
        ]
    cases.append(Case("attention", "bf16 D200 decode 1x4k",
                      attn(200, torch.bfloat16, L=1, Lk=4096, causal=True, backward=False)))
    for dtype in (torch.bfloat16, torch.float16, torch.float32):
        for d in (64, 128, 256, 80):
            quick = dtype == torch.bfloat16 and d in (64, 128)
            tag = f"{_SHORT[dtype]} D{d}"
            # float32 never takes the descriptor path on its own (kernels.descriptors.use_tma)
            paths = ("0",) if dtype == torch.float32 else ("1", "0")
            # Every kept config for the causal case (it has the most code: edge and interior
            # loops); the others differ in flags that barely move register pressure.
            cases.append(Case("attention", f"{tag} L4k", attn(d, dtype), quick, paths,
                              tune=False))
            cases.append(Case("attention", f"{tag} L4k causal", attn(d, dtype, causal=True),
                              quick, paths))
            if dtype == torch.float32:
                if d == 64:  # float32 configs are kernels.attention's; the JVP kernel took them
                    # with a constexpr it lacks, a KeyError at its first GPU launch (2026-11-26)
                    cases.append(Case("attention", f"{tag} L4k causal jvp", jvp(d, dtype),
                                      True, ("0",), tune=False))
                continue
            cases.append(Case("attention", f"{tag} decode 1x4k", attn(d, dtype, L=1, Lk=4096,
                                                                       causal=True, backward=False),
                              False, ("1", "0")))
            if d in (64, 128):
                tune = dtype == torch.bfloat16
                cases += [
                    Case("attention", f"{tag} L1k bool mask", attn(d, dtype, L=1024, mask="bool"),
                         tune=tune),
                    Case("attention", f"{tag} L1k float mask+grad",
                         attn(d, dtype, L=1024, mask="float", dmask=True), tune=tune),
                    # a mask and a causal band at once: the edge and interior loops both read
                    # mask tiles; and a short query (a 64-row tile's first choice, where L1k
                    # takes 128 rows)
                    Case("attention", f"{tag} L1k causal bool mask",
                         attn(d, dtype, L=1024, mask="bool", causal=True), tune=tune),
                    Case("attention", f"{tag} L1k causal float mask",
                         attn(d, dtype, L=1024, mask="float", causal=True, backward=False),
                         tune=tune),
                    Case("attention", f"{tag} L33x40 window bool mask",
                         attn(d, dtype, L=33, Lk=40, mask="bool", window=(15, 0)),
                         tune=tune),
                    Case("attention", f"{tag} L4k dropout", attn(d, dtype, dropout=0.1),
                         tune=tune),
                    # a float32 bias (allowed with 16-bit inputs) and dropout at once: the
                    # largest mask tiles, on both paths (the H100 run of 2026-11-26 met a D128
                    # forward config over the shared-memory limit here; on the descriptor
                    # path D64 128x128 w8s3 asked for 246,784 B before the pruner counted
                    # the mask's staged tiles)
                    Case("attention", f"{tag} L1k fp32 mask+dropout",
                         attn(d, dtype, L=1024, mask="float", dropout=0.25,
                              mask_dtype=torch.float32), tune=tune, paths=("1", "0")),
                    Case("attention", f"{tag} L4k window", attn(d, dtype, window=(256, 0)),
                         paths=("1",), tune=False),
                    # the JVP kernel (kernels/attention_jvp.py: pointer path only); not in the
                    # quick CI subset until a GPU session has compiled its configs
                    Case("attention", f"{tag} L4k causal jvp", jvp(d, dtype), paths=("0",),
                         tune=tune),
                ]
    return cases


def _norm_cases():
    from fastattn.kernels import layer_norm as LN
    from fastattn.kernels import rope as R
    from fastattn.kernels import softmax as S

    def ln(M, N, dtype, rms, residual):
        x = _t(M, N, dtype=dtype)
        res = _t(M, N, dtype=dtype) if residual else None
        w = _t(N, dtype=dtype)
        b = None if rms else _t(N, dtype=dtype)

        def run():
            y, h, mean, rstd = LN.layer_norm_fwd(x, res, w, b, 1e-5, rms)
            LN.layer_norm_bwd(y, h if residual else None, h if residual else x, w, mean, rstd,
                              rms, [True, not rms])
        return run

    def softmax(rows, N, dtype, causal):
        x = _t(1, 1, rows, N, dtype=dtype)

        def run():
            y = S.softmax_fwd(x, None, 0.125, causal)
            S.softmax_bwd(y, y, 0.125)
        return run

    def rope(L, D, dtype):
        x = _t(1, 8, L, D, dtype=dtype)
        cos, sin = _t(L, D // 2, dtype=torch.float32), _t(L, D // 2, dtype=torch.float32)

        def run():
            R.rope_fwd(x, cos, sin, None, False, False)
        return run

    cases = []
    for dtype in (torch.bfloat16, torch.float32):
        q = dtype == torch.bfloat16
        for N in (768, 4096, 16384 * 2):
            for rms, residual in ((False, False), (True, True)):
                M = 4096 if N < 16384 else 64
                name = f"{_SHORT[dtype]} {M}x{N} {'rms+res' if rms else 'ln'}"
                cases.append(Case("layer_norm", name, ln(M, N, dtype, rms, residual),
                                  q and N == 4096))
        for N, causal in ((1024, False), (4096, True), (65536, False)):
            cases.append(Case("softmax", f"{_SHORT[dtype]} rows x {N}{' causal' if causal else ''}",
                              softmax(N if N <= 4096 else 8, N, dtype, causal), q and N == 4096))
        cases.append(Case("rope", f"{_SHORT[dtype]} L4k D128", rope(4096, 128, dtype), q))
    return cases


def _ffn_cases():
    from fastattn.kernels import ffn as F

    def ffn(M, d, hidden, dtype, activation):
        gated = activation in ("swiglu", "geglu")
        x = _t(M, d, dtype=dtype)
        w1 = _t(hidden * (2 if gated else 1), d, dtype=dtype)
        b1 = _t(hidden * (2 if gated else 1), dtype=dtype)
        w2 = _t(d, hidden, dtype=dtype)
        b2 = _t(d, dtype=dtype)

        def run():
            out, pre = F.ffn_fwd(x, w1, b1, w2, b2, activation)
            F.ffn_bwd(out, x, w1, w2, pre, activation, [True, True])
        return run

    cases = []
    for dtype in (torch.bfloat16, torch.float32):
        for act in ("gelu", "swiglu", "relu"):
            cases.append(Case("ffn", f"{_SHORT[dtype]} 4096x1024x4096 {act}",
                              ffn(4096, 1024, 4096, dtype, act),
                              dtype == torch.bfloat16 and act != "relu"))
    return cases


def _varlen_cases():
    from fastattn.kernels import varlen as VL

    def packed(d, dtype, batch=8, L=2048):
        total = batch * L
        q, k, v = (_t(total, 8, d, dtype=dtype) for _ in range(3))
        cu = torch.arange(0, total + 1, L, dtype=torch.int32)

        def run():  # causal, scale 0.1, no dropout
            out, lse = VL.varlen_forward(q, k, v, cu, cu, L, L, 0.1, True, 2 * L, 0, 0.0, 0)
            VL.varlen_backward(out, q, k, v, out, lse, cu, cu, L, L, 0.1, True, 2 * L, 0, 0.0, 0)
        return run

    def paged(d, dtype, B=8, L=4096, block=16, Hkv=8, H=32, Lq=1):
        q = _t(B, H, Lq, d, dtype=dtype)
        cache = _t(B * L // block, block, Hkv, d, dtype=dtype)
        table = torch.zeros(B, L // block, dtype=torch.int32)
        lens = torch.zeros(B, dtype=torch.int32)
        return lambda: VL.paged_forward(q, cache, cache, table, lens, 0.1, True, L + 1, 0)

    cases = []
    for dtype in (torch.bfloat16, torch.float16):
        for d in (64, 128, 256):
            quick = dtype == torch.bfloat16 and d == 128
            tag = f"{_SHORT[dtype]} D{d}"
            cases.append(Case("varlen", f"{tag} packed 8x2k causal", packed(d, dtype), quick))
            cases.append(Case("decode", f"{tag} paged B8 L4k", paged(d, dtype), quick))
    # float32 has tiles of its own (kernels.varlen._FP32_TILES; the 16-bit ones spilled KBs).
    # The paged case with 5 queries x 4 heads a kv head: 32-row query tiles, over which the NaN
    # rule's 16-row loop once reassigned the tile's own names with another shape (a compile
    # error, 2026-11-26).
    for d in (64, 128, 256):
        cases.append(Case("varlen", f"fp32 D{d} packed 8x2k causal", packed(d, torch.float32),
                          d == 64))
        cases.append(Case("decode", f"fp32 D{d} paged B8 L4k 5 queries",
                          paged(d, torch.float32, Lq=5), d == 64))
    return cases


def cases(ops=None, quick=False):
    """The cases of the ops named (all by default); quick: the CI subset."""
    found = _attention_cases() + _norm_cases() + _ffn_cases() + _varlen_cases()
    return [c for c in found if (not quick or c.quick) and (ops is None or c.op in ops)]


# ---------------------------------------------------------------------------------------------
# Capture, expand, compile
# ---------------------------------------------------------------------------------------------

@contextlib.contextmanager
def _recording(into, case, path):
    """Triton's launch entry points record (fn, args, kwargs) into ``into`` instead of running."""
    from triton.runtime.autotuner import Autotuner
    from triton.runtime.jit import JITFunction

    saved = Autotuner.run, JITFunction.run

    def record(self, *args, **kwargs):
        kwargs.pop("grid", None)
        kwargs.pop("warmup", None)
        into.append(Launch(case, path, self, args, kwargs))

    Autotuner.run = JITFunction.run = record
    try:
        yield
    finally:
        Autotuner.run, JITFunction.run = saved


@contextlib.contextmanager
def planning_for(target, autotune, warp_specialize=True):
    """Launch plans made for ``target`` without a GPU, autotuning on or off; with
    ``warp_specialize``, warp-specialized configs kept where FASTATTN_TRITON_WS=1 would keep them
    (off by default, and known wrong on Hopper, kernels/descriptors.py; compiled here, without
    its warning, for work on them), else as the default leaves them out."""
    from fastattn.kernels import descriptors, tuning
    saved = tuning.TARGET, tuning.AUTOTUNE, descriptors.WARP_SPECIALIZE
    tuning.TARGET, tuning.AUTOTUNE = target, autotune
    descriptors.WARP_SPECIALIZE = "1" if warp_specialize else "0"
    try:
        with warnings.catch_warnings():
            warnings.filterwarnings("ignore", "FASTATTN_TRITON_WS=1", RuntimeWarning)
            yield
    finally:
        tuning.TARGET, tuning.AUTOTUNE, descriptors.WARP_SPECIALIZE = saved


def capture(selected, *, all_configs=True, target=H100):
    """The launches the selected cases make, each expanded to ``(launch, config)`` pairs: every
    config the pruner keeps (only the first when ``all_configs`` is False); config None for
    kernels that are not autotuned."""
    from triton.runtime.autotuner import Autotuner

    from fastattn.kernels import descriptors

    launches = []
    tuned = set()
    with planning_for(target, True):
        for case in selected:
            if case.tune:
                tuned.add(f"{case.op}: {case.name}")
            for path in case.paths:
                saved_tma = descriptors.TMA
                descriptors.TMA = path
                try:
                    with _recording(launches, f"{case.op}: {case.name}", path):
                        case.run()
                finally:
                    descriptors.TMA = saved_tma
        variants = []
        seen = set()
        for launch in launches:
            if isinstance(launch.fn, Autotuner):
                tuner = launch.fn
                tuner.nargs = dict(zip(tuner.arg_names, launch.args))
                try:
                    configs = tuner.prune_configs(launch.kwargs)
                finally:
                    tuner.nargs = None
                if not (all_configs and launch.case in tuned):
                    # what the tests run (the first kept config), and every WS variant
                    configs = configs[:1] + [c for c in configs[1:] if _warp_specialized(c)]
            else:
                configs = [None]
            for config in configs:
                key = _compile_key(launch, config, target)
                if key not in seen:
                    seen.add(key)
                    variants.append((launch, config))
    return variants


def _warp_specialized(config):
    return config is not None and bool(config.kwargs.get("WARP_SPECIALIZE"))


def _launch_kwargs(launch, config):
    """The launch's keyword arguments with the config's (block sizes, warps, stages) applied."""
    kwargs = {**launch.kwargs, **(config.all_kwargs() if config is not None else {})}
    kwargs.setdefault("debug", False)
    return kwargs


def _bind(launch, config, target):
    """Triton's binder for the target: fn, kwargs, backend, bound args, specialization, options."""
    from triton.backends.compiler import GPUTarget
    from triton.compiler import make_backend
    from triton.runtime.jit import create_function_from_signature

    fn = _jit_function(launch.fn)
    kwargs = _launch_kwargs(launch, config)
    major, minor = target["capability"]
    backend = make_backend(GPUTarget("cuda", major * 10 + minor, 32))
    binder = create_function_from_signature(fn.signature, fn.params, backend)
    bound = binder(*launch.args, **kwargs)
    # JITFunction.run refuses a keyword that is neither a parameter nor an option (a KeyError
    # at the first launch on a GPU, where the interpreter takes it): so does the gate
    options, names = backend.parse_options(kwargs).__dict__, {p.name for p in fn.params}
    unknown = sorted(k for k in kwargs if k not in names and k not in options)
    if unknown:
        raise KeyError(f"{fn.fn.__name__}: keyword argument(s) {unknown} are neither "
                       f"parameters of the kernel nor compile options ({launch.case})")
    # torch.compile (Inductor) compiles a wrap_triton launch from the arguments it names and
    # leaves a parameter's default out: FIXUP's was missing (an H100, 2026-11-27, session 23)
    named = set(kwargs) | {p.name for p in fn.params[:len(launch.args)]}
    defaulted = [p.name for p in fn.params if p.name not in named]
    if defaulted:
        raise KeyError(f"{fn.fn.__name__}: the launch leaves {defaulted} to their defaults, "
                       f"which torch.compile does not fill in: pass them ({launch.case})")
    return (fn, kwargs, backend, *bound)


def _compile_key(launch, config, target):
    """What the compiled binary depends on: the kernel, its argument specialization (dtypes,
    16-byte divisibility, constexpr values) and options. Launches equal in it compile once."""
    fn, kwargs, _, _, specialization, options = _bind(launch, config, target)
    return fn.fn.__name__, repr(specialization), repr(options)


def _kernel_name(fn):
    inner = getattr(fn, "fn", fn)
    while hasattr(inner, "fn") and not hasattr(inner, "params"):
        inner = inner.fn
    return getattr(getattr(inner, "fn", inner), "__name__", str(inner))


def _jit_function(fn):
    """The JITFunction under autotune/heuristics wrappers."""
    while not hasattr(fn, "params"):
        fn = fn.fn
    return fn


def _ptxas_log(kernel, arch):
    """``ptxas -v`` of the compiled kernel's PTX (Triton's own log is not kept)."""
    from triton.backends.nvidia.compiler import get_ptxas
    with tempfile.TemporaryDirectory() as tmp:
        src = os.path.join(tmp, "k.ptx")
        with open(src, "w") as f:
            f.write(kernel.asm["ptx"])
        proc = subprocess.run([get_ptxas(arch).path, "-v", f"--gpu-name=sm_{arch}a"
                               if arch >= 90 else f"--gpu-name=sm_{arch}", src,
                               "-o", os.path.join(tmp, "k.cubin")],
                              capture_output=True, text=True)
    return proc.stderr + proc.stdout


def compile_variant(launch, config, target=H100):
    """Compile one (launch, config) for ``target``; the Row that says how it went."""
    import triton
    from triton.backends.compiler import GPUTarget
    from triton.compiler import ASTSource

    from fastattn.kernels import descriptors, tuning

    fn = _jit_function(launch.fn)
    kwargs = _launch_kwargs(launch, config)
    major, minor = target["capability"]
    arch = major * 10 + minor
    name = fn.fn.__name__
    case = launch.case
    if case.startswith("attention"):
        case += " [tma]" if launch.path == "1" else " [ptr]"
    row = Row(kernel=name, case=case, config=tuning.config_text(config, kwargs),
              smem_limit=target.get("shared_bytes", 0))
    row.spill_budget = max([budget for (kernel, word), (budget, _) in SPILL_BUDGET.items()
                            if kernel == name and word in row.case.split()] or [0])
    if kwargs.get("USE_TMA", False) and descriptors.HAS_DESCRIPTORS:
        row.required = REQUIRED_TMA
    if _warp_specialized(config):  # producer/consumer warps resize their register files
        row.required += ("setmaxnreg",)
    try:
        gpu = GPUTarget("cuda", arch, 32)
        fn, kwargs, backend, bound_args, specialization, options = _bind(launch, config, target)
        options, signature, constexprs, attrs = fn._pack_args(backend, kwargs, bound_args,
                                                              specialization, options)
        src = ASTSource(fn, signature, constexprs, attrs)
        with contextlib.redirect_stdout(io.StringIO()), contextlib.redirect_stderr(io.StringIO()):
            kernel = triton.compile(src, target=gpu, options=options.__dict__)
    except Exception as exc:  # noqa: BLE001 - a compile failure is a result
        row.error = " ".join(f"{type(exc).__name__}: {exc}".split())[:300]
        return row
    stats = parse_ptxas(_ptxas_log(kernel, arch))
    mine = stats.get(kernel.metadata.name) or next(iter(stats.values()), {})
    row.regs = mine.get("regs")
    row.spill_stores, row.spill_loads = mine.get("spill_stores", 0), mine.get("spill_loads", 0)
    row.smem = max(int(kernel.metadata.shared), mine.get("smem", 0))
    sass = sass_of(kernel.asm["cubin"])
    text = sass.get(kernel.metadata.name, "\n".join(sass.values()))
    row.features, row.digest = sass_features(text), sass_digest(text)
    row.undefined = undefined_uniform_reads(text)
    return row


def triton_rows(quick=False, ops=None, kernels=None, names=None, all_configs=None, jobs=None,
                progress=None):
    """Compile the selected cases' launches for the H100 in ``jobs`` processes; one Row each.
    ``kernels``: only kernels whose names contain one of these; ``names``: only cases whose
    names contain one of these. ``all_configs`` defaults to
    ``not quick`` (quick: the first kept config, as the tests run, and warp-specialized ones)."""
    import concurrent.futures
    import multiprocessing

    if all_configs is None:
        all_configs = not quick
    selected = [c for c in cases(ops, quick) if not names or any(n in c.name for n in names)]
    variants = capture(selected, all_configs=all_configs)
    if kernels:
        variants = [(launch, config) for launch, config in variants
                    if any(k in _kernel_name(launch.fn) for k in kernels)]
    jobs = jobs or os.cpu_count() or 1
    if jobs == 1:
        rows = []
        for i, (launch, config) in enumerate(variants):
            rows.append(compile_variant(launch, config))
            if progress:
                progress(i + 1, len(variants), rows[-1])
        return rows
    # Forked workers inherit the captured launches (kernels and tensors do not pickle well).
    global _VARIANTS
    _VARIANTS = variants
    ctx = multiprocessing.get_context("fork")
    rows = [None] * len(variants)
    with concurrent.futures.ProcessPoolExecutor(jobs, mp_context=ctx) as pool:
        futures = {pool.submit(_compile_index, i): i for i in range(len(variants))}
        for n, fut in enumerate(concurrent.futures.as_completed(futures)):
            rows[futures[fut]] = fut.result()
            if progress:
                progress(n + 1, len(variants), rows[futures[fut]])
    _VARIANTS = []
    return rows


_VARIANTS = []


def _compile_index(i):
    return compile_variant(*_VARIANTS[i])
