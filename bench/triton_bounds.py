"""Bounds-checked Triton kernels under the CPU interpreter (``TRITON_INTERPRET=1``).

The interpreter runs a kernel's loads and stores on the host copies of its tensor arguments,
at whatever address the kernel computes: an out-of-bounds access reads (or overwrites) the
neighbouring heap memory silently, where a GPU may fault ("an illegal memory access") or not,
depending on what lies there. :class:`BoundsChecker` patches the interpreter's memory entry
points (``InterpreterBuilder.create_masked_load`` / ``create_masked_store``, which plain,
descriptor (TMA), gather and scatter loads and stores all go through, and the atomics) so that
every address a load or store touches *with its mask True* is checked to lie inside one of the
launch's tensor arguments ([storage base, storage base + storage bytes)). An access outside
them is recorded (kernel, constexprs, source lines, the argument it lies nearest to and the
offset) and dropped from the access (its lanes read ``other``), so the run goes on and reports
every one. Loads with a mask but no ``other`` (a GPU leaves their masked-off lanes undefined)
are recorded separately, as notes.

What it cannot see: an access that lands inside *another* argument's storage (the CPU allocator
may place them side by side), unless the same access also has lanes in its own (a tile that
runs off one tensor into the next: reported as "spanning"); views of one storage count as the
whole storage (as on a GPU, where only unmapped memory faults). Programs run one after the
other, so races are out of its reach too.

A test uses it as a context manager::

    with triton_bounds.BoundsChecker() as check:
        fastattn.attention(q, k, v, ...)
    assert not check.violations, check.report()

As a script it runs the Triton attention forward and backward of the seeded cases of
tests/test_combinations.py (``_draw_attention``), every config that the pruners keep on an H100
(not the interpreter's single 16 x 16 one), on the path the GPU would take (descriptor or
pointer, ``--path`` to force), with the GPU's block sizes for the backward's preprocess and
the packed/paged kernels::

    TRITON_INTERPRET=1 python bench/triton_bounds.py                  # seeds 0-11, fwd + bwd
    TRITON_INTERPRET=1 python bench/triton_bounds.py --seeds 0 --path both --op attention
    TRITON_INTERPRET=1 python bench/triton_bounds.py --op varlen,paged
    TRITON_INTERPRET=1 python bench/triton_bounds.py --careful   # + every block's careful path
    TRITON_INTERPRET=1 python bench/triton_bounds.py --nonfinite # NaN / inf in some k, v rows

On a GPU the same cases and configs run compiled (no bounds check there: run it under
``compute-sanitizer --tool memcheck``), each config ``--repeat`` times with a synchronize after
each launch, e.g. for test_attention_combinations[triton-0]'s forward::

    TRITON_INTERPRET=0 python bench/triton_bounds.py --device cuda --seeds 0 --forward-only \
        --first-only --repeat 5000

Exit status 1 when any access was out of bounds, a config left an output unwritten or a launch
failed.
"""

import argparse
import contextlib
import dataclasses
import functools
import importlib.util
import os
import sys
import time
from pathlib import Path

import numpy as np

if __name__ == "__main__":  # before triton is imported
    os.environ.setdefault("TRITON_INTERPRET", "1")

import triton  # noqa: E402
import triton.language as tl  # noqa: E402

from fastattn.aot.triton import H100, planning_for  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]

# ---------------------------------------------------------------------------------------------
# The checker
# ---------------------------------------------------------------------------------------------


@dataclasses.dataclass
class Allocation:
    name: str       # the kernel's argument name
    start: int      # storage base address (host copy)
    nbytes: int     # storage size in bytes
    itemsize: int
    dtype: str

    @property
    def end(self):
        return self.start + self.nbytes

    def describe(self, addr, size):
        """Where ``addr`` (an access of ``size`` bytes) lies relative to this allocation."""
        rel = addr - self.start
        if rel < 0:
            where = f"{-rel} B before its start"
        elif rel + size > self.nbytes:
            where = f"{rel + size - self.nbytes} B past its end"
        else:
            where = "inside"
        return (f"{self.name} ({self.dtype}, {self.nbytes} B): byte offset {rel} "
                f"(element {rel / self.itemsize:g} of {self.nbytes // self.itemsize}), {where}")


@dataclasses.dataclass
class Violation:
    kernel: str
    op: str             # load, store, atomic
    config: str         # the launch's constexprs
    where: str          # kernel source lines, innermost first
    lanes: int = 0      # out-of-bounds lanes, summed over the occurrences
    count: int = 0      # accesses with at least one
    programs: list = dataclasses.field(default_factory=list)  # first few program ids
    examples: list = dataclasses.field(default_factory=list)  # first few addresses, described

    def __str__(self):
        lines = [f"OUT OF BOUNDS {self.op} in {self.kernel} [{self.config}] at {self.where}: "
                 f"{self.count} access(es), {self.lanes} lane(s); programs {self.programs}"]
        lines += [f"    {e}" for e in self.examples]
        return "\n".join(lines)


def _constexpr_text(kwargs, names):
    parts = []
    for k in names:
        if k in kwargs and not hasattr(kwargs[k], "data_ptr"):
            v = kwargs[k]
            parts.append(f"{k}={getattr(v, 'value', v)}")
    return " ".join(parts)


class BoundsChecker:
    """Context manager: while active, every interpreted Triton launch's loads and stores are
    checked against its tensor arguments' storages. ``violations`` (list of
    :class:`Violation`, one per kernel, op, source line and config), ``undefined_other``
    (``{(kernel, where): count}``: masked loads without ``other`` whose mask was False
    somewhere), ``launches`` (kernel names launched, in order)."""

    def __init__(self, max_examples=4, source_dir=None, frames=5):
        self.max_examples = max_examples
        self.frames = frames
        self.source_dir = str(source_dir or ROOT / "kernels")
        self.violations: list[Violation] = []
        self._by_key = {}
        self.undefined_other: dict = {}
        self.launches: list[str] = []
        self._launch = None
        self._saved = None

    # -- patching ------------------------------------------------------------------------------

    def __enter__(self):
        from triton.runtime import interpreter as I

        if not hasattr(I, "GridExecutor"):
            raise RuntimeError("triton_bounds needs TRITON_INTERPRET=1's interpreter")
        B, G = I.InterpreterBuilder, I.GridExecutor
        self._saved = [(B, name, B.__dict__[name]) for name in (
            "create_masked_load", "create_masked_store", "create_atomic_rmw", "create_atomic_cas")
            if name in B.__dict__] + [(G, "_init_args_hst", G.__dict__["_init_args_hst"])]
        checker = self
        orig = {name: fn for _, name, fn in self._saved}

        def init_args_hst(ex, args_dev, kwargs):
            args_hst, kwargs_hst = orig["_init_args_hst"](ex, args_dev, kwargs)
            checker._begin(ex, args_hst, kwargs_hst)
            return args_hst, kwargs_hst

        # (the cache arguments after `other` / `mask`: (cache_policy, is_volatile) in Triton
        # 3.9, (cache_modifier, eviction_policy, is_volatile) in 3.6, the GPU image's)
        def masked_load(builder, ptrs, mask, other, *cache):
            mask = checker._check("load", ptrs, mask)
            if other is None and not np.all(mask.data):
                checker._note_undefined_other()
            return orig["create_masked_load"](builder, ptrs, mask, other, *cache)

        def masked_store(builder, ptrs, value, mask, *cache):
            mask = checker._check("store", ptrs, mask)
            return orig["create_masked_store"](builder, ptrs, value, mask, *cache)

        G._init_args_hst = init_args_hst
        B.create_masked_load = masked_load
        B.create_masked_store = masked_store
        if "create_atomic_rmw" in orig:
            def atomic_rmw(builder, rmw_op, ptr, val, mask, sem, scope):
                mask = checker._check("atomic", ptr, mask)
                return orig["create_atomic_rmw"](builder, rmw_op, ptr, val, mask, sem, scope)
            B.create_atomic_rmw = atomic_rmw
        if "create_atomic_cas" in orig:
            def atomic_cas(builder, ptr, cmp, val, sem, scope):
                checker._check("atomic", ptr, None)
                return orig["create_atomic_cas"](builder, ptr, cmp, val, sem, scope)
            B.create_atomic_cas = atomic_cas
        return self

    def __exit__(self, *exc):
        for owner, name, fn in reversed(self._saved or []):
            setattr(owner, name, fn)
        self._saved = None
        self._launch = None
        return False

    # -- bookkeeping -----------------------------------------------------------------------------

    def _begin(self, ex, args_hst, kwargs_hst):
        """A launch starts: record its tensor arguments' storages."""
        from triton.runtime import interpreter as I

        allocs = []

        def add(name, arg):
            if isinstance(arg, tuple):
                for i, a in enumerate(arg):
                    add(f"{name}[{i}]", a)
                return
            base = getattr(arg, "base", None)
            if base is not None and hasattr(base, "data_ptr") and not hasattr(arg, "data_ptr"):
                arg = base  # a host-side TensorDescriptor
            if not hasattr(arg, "data_ptr"):
                return
            t = I._unwrap_tensor(arg)
            st = t.untyped_storage()
            allocs.append(Allocation(name, st.data_ptr(), st.nbytes(), t.element_size(),
                                     str(t.dtype).replace("torch.", "")))

        for name, arg in zip(ex.arg_names, args_hst):
            add(name, arg)
        for name, arg in kwargs_hst.items():
            add(name, arg)
        merged = {}  # arguments on one storage (a stand-in pointer, dQ passed as dS) count once
        for al in allocs:
            key = (al.start, al.nbytes)
            if key in merged:
                merged[key].name += "/" + al.name
            else:
                merged[key] = al
        allocs = list(merged.values())
        name = getattr(ex.fn, "__name__", str(ex.fn))
        const = {**dict(zip(ex.arg_names, args_hst)), **kwargs_hst}
        self._launch = (name, _constexpr_text(const, ex.constexprs), allocs)
        self.launches.append(name)

    def _where(self):
        """The kernel source lines of the current access, innermost first."""
        frame = sys._getframe(2)
        found = []
        while frame is not None and len(found) < self.frames:
            code = frame.f_code
            if code.co_filename.startswith(self.source_dir):
                found.append(f"{Path(code.co_filename).name}:{frame.f_lineno} {code.co_name}")
            frame = frame.f_back
        return " <- ".join(found) or "?"

    def _note_undefined_other(self):
        if self._launch is None:
            return
        key = (self._launch[0], self._where())
        self.undefined_other[key] = self.undefined_other.get(key, 0) + 1

    def _check(self, op, ptrs, mask):
        """Record the out-of-bounds lanes of an access; returns the mask without them."""
        from triton.runtime import interpreter as I

        if self._launch is None:
            return mask
        kernel, config, allocs = self._launch
        addr = np.asarray(ptrs.data).astype(np.uint64)
        if mask is None:
            active = np.ones(addr.shape, dtype=bool)
        else:
            active = np.broadcast_to(np.asarray(mask.data, dtype=bool), addr.shape)
        elem = ptrs.get_element_ty()
        size = max(1, elem.primitive_bitwidth // 8) if hasattr(elem, "primitive_bitwidth") else 8
        a = addr.astype(np.int64)
        owner = np.full(addr.shape, -1)
        for i, al in enumerate(allocs):
            owner[(owner < 0) & (a >= al.start) & (a + size <= al.end)] = i
        inside = owner >= 0
        bad = active & ~inside
        owners = np.unique(owner[active & inside])
        if len(owners) > 1:
            # One access (a tile of one tensor) whose lanes lie in several arguments' storages:
            # it ran off the one it meant into a neighbour (which the check above cannot see).
            # Counted as out of bounds in all but the storage most of its lanes lie in.
            counts = [(int((owner[active] == o).sum()), o) for o in owners]
            main = max(counts)[1]
            bad = active & (owner != main)
            op += " (spanning " + ", ".join(allocs[o].name for o in owners) + ")"
        if not bad.any():
            return mask
        where = self._where()
        key = (kernel, op, where, config)
        v = self._by_key.get(key)
        if v is None:
            v = self._by_key[key] = Violation(kernel, op, config, where)
            self.violations.append(v)
        v.count += 1
        v.lanes += int(bad.sum())
        grid_idx = tuple(int(i) for i in I.interpreter_builder.grid_idx)
        if len(v.programs) < 8 and grid_idx not in v.programs:
            v.programs.append(grid_idx)
        if len(v.examples) < self.max_examples:
            for idx in np.argwhere(bad)[: self.max_examples - len(v.examples)]:
                ad = int(a[tuple(idx)])
                near = min(allocs, key=lambda al: 0 if al.start <= ad < al.end
                           else min(abs(ad - al.start), abs(ad - al.end)))
                lane = tuple(int(i) for i in idx)
                v.examples.append(f"program {grid_idx} lane {lane} of {addr.shape}: {size}-byte "
                                  f"{op} nearest {near.describe(ad, size)}")
        return I.TensorHandle(active & ~bad, tl.int1)

    def report(self):
        lines = [str(v) for v in self.violations]
        for (kernel, where), n in self.undefined_other.items():
            lines.append(f"note: {kernel}: masked load without `other` (lanes undefined on a GPU) "
                         f"at {where}: {n} access(es)")
        return "\n".join(lines) or "no out-of-bounds access"


@contextlib.contextmanager
def bounds_checking(**kwargs):
    """``with bounds_checking() as check: ...``; see :class:`BoundsChecker`."""
    with BoundsChecker(**kwargs) as check:
        yield check


# ---------------------------------------------------------------------------------------------
# What an H100 would run: the attention pruners' configs, planned for sm_90
# ---------------------------------------------------------------------------------------------


@functools.lru_cache(maxsize=None)
def h100_attention_module():
    """kernels/attention.py loaded again as if not interpreting (``_INTERPRET`` False): its
    config lists and pruner are the GPU's. Only those are used (its kernels are not run)."""
    from fastattn.kernels import attention, tuning

    saved = tuning.INTERPRET
    tuning.INTERPRET = False
    try:
        spec = importlib.util.spec_from_file_location("fastattn.kernels._attention_h100_view",
                                                      attention.__file__)
        module = importlib.util.module_from_spec(spec)
        spec.loader.exec_module(module)
    finally:
        tuning.INTERPRET = saved
    assert not module._INTERPRET
    return module


_KINDS = {"_attn_fwd_kernel": ("fwd", "_FWD_CONFIGS"),
          "_attn_bwd_dkdv_kernel": ("dkdv", "_DKDV_CONFIGS"),
          "_attn_bwd_dq_kernel": ("dq", "_DQ_CONFIGS")}


def h100_configs(kernel_name, nargs, kwargs):
    """The configs the pruner of ``kernel_name`` keeps on an H100 for this launch, in order
    (the first is what runs with FASTATTN_AUTOTUNE=0)."""
    view = h100_attention_module()
    kind, configs = _KINDS[kernel_name]
    with planning_for(H100, True, warp_specialize=False):
        return view._prune(getattr(view, configs), nargs, kernel=kind, **kwargs)


# Outputs of the attention kernels: filled with a sentinel (no output comes near it) before each
# config, so a config that leaves part of one unwritten shows; compared across configs.
_OUTPUTS = {"_attn_fwd_kernel": ("Out", "Lse"), "_attn_bwd_dkdv_kernel": ("DK", "DV"),
            "_attn_bwd_dq_kernel": ("DQ", "DMask")}


_SENTINEL = -12288.0  # (exact in float16, bfloat16 and float32)


@dataclasses.dataclass
class ConfigRun:
    kernel: str
    config: str
    first: bool
    seconds: float
    unwritten: dict      # output name -> elements left unwritten
    max_diff: dict       # output name -> max |difference| from the first config's
    error: str = ""      # the launch that failed (repeats)


@contextlib.contextmanager
def every_h100_config(record, only_first=False, repeats=1, kernels=None, sync=True, pick=None):
    """The dense attention kernels (forward, dK/dV, dQ; ``kernels``: only those named) run, at
    each launch, every config the H100 pruner keeps, one after the other on the same arguments
    (the last one's outputs stay); each run is appended to ``record`` (:class:`ConfigRun`).
    ``repeats``: launches per config, on a GPU synchronized one by one (``sync``; else back to
    back, as an autotuner's benchmark runs them, and once at the end); the first failing one is
    recorded, then raised. ``pick`` (e.g. "64x64 w4s3"): instead, the kernel's configs whose
    text starts with it, kept by the pruner or not."""
    import torch
    from fastattn.kernels import attention, tuning

    tuners = {name: getattr(attention, name) for name in _KINDS}

    def runner(name, tuner):
        def run(*args, **kwargs):
            nargs = dict(zip(tuner.arg_names, args))
            if pick:
                configs = [c for c in getattr(h100_attention_module(), _KINDS[name][1])
                           if tuning.config_text(c).startswith(pick)]
            else:
                configs = h100_configs(name, nargs, kwargs)
            if only_first:
                configs = configs[:1]
            outs = [nargs[o] for o in _OUTPUTS[name] if o in nargs]
            if name == "_attn_bwd_dq_kernel" and not kwargs.get("NEED_DMASK"):
                outs = outs[:1]  # (DMask is dq itself then)
            reference = None
            for i, config in enumerate(configs):
                for o in outs:
                    o.fill_(_SENTINEL)
                start = time.time()
                for rep in range(repeats):
                    try:
                        tuner.fn.run(*args, **kwargs, **config.all_kwargs())
                        if outs and outs[0].is_cuda and (sync or rep == repeats - 1):
                            torch.cuda.synchronize()
                    except Exception as exc:
                        record.append(ConfigRun(name, tuning.config_text(config), i == 0,
                                                time.time() - start, {}, {},
                                                f"launch {rep + 1} of {repeats}: {exc!r}"[:300]))
                        raise
                seconds = time.time() - start
                got = [o.detach().float().clone() for o in outs]
                unwritten = {n: int((g == _SENTINEL).sum()) for n, g in zip(_OUTPUTS[name], got)
                             if (g == _SENTINEL).any()}
                diff = {}
                if reference is None:
                    reference = got
                else:
                    for n, g, r in zip(_OUTPUTS[name], got, reference):
                        both = torch.isfinite(g) & torch.isfinite(r)
                        diff[n] = float((g - r)[both].abs().max()) if both.any() else 0.0
                path = "tma" if kwargs.get("USE_TMA") else "ptr"
                record.append(ConfigRun(name, f"{tuning.config_text(config)} {path}", i == 0,
                                        seconds, unwritten, diff))
        return run

    for name, tuner in tuners.items():
        if kernels is None or name in kernels:
            tuner.run = runner(name, tuner)
    try:
        yield
    finally:
        for tuner in tuners.values():
            vars(tuner).pop("run", None)


@contextlib.contextmanager
def gpu_launch_plans(path="gpu"):
    """What else differs between the interpreter and an H100: the backward preprocess's and the
    packed/paged kernels' block sizes, the SM count, and the descriptor path (``path``: "gpu"
    takes it where an H100 would: 16-bit inputs, 16-byte aligned; "tma" or "ptr" force it)."""
    from fastattn.kernels import attention_launch, descriptors, varlen

    saved = (attention_launch._PRE_BLOCK_M, varlen._INTERPRET, descriptors.use_tma)

    def use_tma(*tensors):
        if path == "ptr" or not descriptors.HAS_DESCRIPTORS:
            return False
        if path == "tma":
            return all(descriptors.tma_aligned(t) for t in tensors)
        import torch
        return (tensors[0].dtype != torch.float32
                and all(descriptors.tma_aligned(t) for t in tensors))

    attention_launch._PRE_BLOCK_M = h100_attention_module()._PRE_BLOCK_M
    varlen._INTERPRET = False
    descriptors.use_tma = use_tma
    try:
        with planning_for(H100, True, warp_specialize=False):
            yield
    finally:
        attention_launch._PRE_BLOCK_M, varlen._INTERPRET, descriptors.use_tma = saved


@triton.jit
def _always_nan(x, rows_ok):
    """(stands in for kernels.attention._any_nan) True: every block takes the careful path."""
    row = tl.sum(x, 1)
    return tl.max(tl.where(row == row, 1, 1), 0) > 0


@contextlib.contextmanager
def forcing_careful(on=True):
    """Every program of the attention kernels (dense, packed, paged) recomputes its block on
    the NaN rule's careful path, as a block whose output held a NaN does (the interpreted
    kernels look their helpers up in their module at each call)."""
    from fastattn.kernels import attention, varlen

    if not on:
        yield
        return
    modules = [m for m in (attention, varlen) if "_any_nan" in vars(m)]
    saved = [m._any_nan for m in modules]
    for m in modules:
        m._any_nan = _always_nan
    try:
        yield
    finally:
        for m, fn in zip(modules, saved):
            m._any_nan = fn


# ---------------------------------------------------------------------------------------------
# The seeded cases of tests/test_combinations.py
# ---------------------------------------------------------------------------------------------


def _combinations():
    sys.path.insert(0, str(ROOT / "tests"))
    try:
        import test_combinations
    finally:
        sys.path.remove(str(ROOT / "tests"))
    return test_combinations


def attention_case(seed, dtype=None, device="cpu"):
    """(case dict, q, k, v, mask, options, generator) as test_attention_combinations builds
    them."""
    import torch
    T = _combinations()
    c = T._draw_attention(seed)
    if dtype is not None:
        c["dtype"] = dtype
    g = torch.Generator().manual_seed(seed)
    B, H, Hkv, Lq, Lk = c["B"], c["H"], c["Hkv"], c["Lq"], c["Lk"]
    q = T._tensor(g, (B, H, Lq, c["D"]), device, c["dtype"], c["blhd"]).requires_grad_()
    k = T._tensor(g, (B, Hkv, Lk, c["D"]), device, c["dtype"], c["blhd"]).requires_grad_()
    v = T._tensor(g, (B, Hkv, Lk, c["Dv"]), device, c["dtype"], c["blhd"]).requires_grad_()
    mask = T._mask(c["mask"], (B, H, Lq, Lk), g, device, c["dtype"])
    if mask is not None and mask.is_floating_point():
        mask.requires_grad_()
    options = dict(causal=c["causal"], window=c["window"], scale=c["scale"],
                   dropout_p=c["dropout_p"], seed=seed, enable_gqa=H != Hkv)
    return c, q, k, v, mask, options, g


def run_attention(seed, path="gpu", only_first=False, dtype=None, careful=False, device="cpu",
                  repeats=1, forward_only=False, record=None, sync=True, nonfinite=False,
                  pick=None):
    """Forward and backward of case ``seed`` under the checker, every H100 config (careful:
    every block also on the careful path, :func:`forcing_careful`). On a GPU (``device``
    "cuda", TRITON_INTERPRET=0) the checker sees nothing; ``repeats`` launches each config
    that many times, synchronized, for faults that do not come every time."""
    import torch
    import fastattn

    c, q, k, v, mask, options, g = attention_case(seed, dtype, device)
    record = [] if record is None else record
    if nonfinite:
        _poison_rows(g, k, v)
    kernels = ("_attn_fwd_kernel",) if forward_only else None
    with BoundsChecker() as check, gpu_launch_plans(path), \
            every_h100_config(record, only_first, repeats, kernels, sync, pick), \
            forcing_careful(careful):
        out, lse = fastattn.attention(q, k, v, mask, return_lse=True, backend="triton", **options)
        if not forward_only:
            inputs = [q, k, v] + ([mask] if mask is not None and mask.requires_grad else [])
            dout = _combinations()._tensor(g, out.shape, device, c["dtype"])
            torch.autograd.grad(out, inputs, dout)
    return c, check, record


def _poison_rows(g, k, v):
    """NaN and inf in some key and value rows (some of them masked out, some attended): the
    careful path's rank-1 terms (:func:`kernels.attention._masked_dot`), whose loop and the dQ
    kernel's re-read of a key row go by the positions of non-finite values."""
    import torch
    with torch.no_grad():
        for t, value in ((k, float("inf")), (v, float("nan")), (k, float("nan"))):
            Lk, D = t.shape[-2], t.shape[-1]
            for _ in range(max(1, Lk // 8)):
                j = int(torch.randint(0, Lk, (1,), generator=g))
                d = int(torch.randint(0, D, (1,), generator=g))
                t[..., j, d] = value


def _drawn(name, seed, float64_as):
    """test_combinations' case ``seed`` of ``_draw_<name>``, with the module and the generator of
    its values; float64 (which the triton backend refuses) as ``float64_as``, or no generator."""
    import torch
    T = _combinations()
    c = getattr(T, f"_draw_{name}")(seed)
    if c["dtype"] == torch.float64:
        if float64_as is None:
            return T, c, None
        c["dtype"] = float64_as
    return T, c, torch.Generator().manual_seed(seed)


def run_varlen(seed, path="gpu", careful=False, float64_as=None):
    import torch
    import fastattn

    T, c, g = _drawn("varlen", seed, float64_as)
    if g is None:
        return c, None, "skipped (float64: the triton backend refuses it)"
    cu_q, cu_k = (torch.tensor(np.cumsum([0, *lens]), dtype=torch.int32)
                  for lens in (c["lq"], c["lk"]))
    q = T._tensor(g, (sum(c["lq"]), c["H"], c["D"]), "cpu", c["dtype"]).requires_grad_()
    k = T._tensor(g, (sum(c["lk"]), c["Hkv"], c["D"]), "cpu", c["dtype"]).requires_grad_()
    v = T._tensor(g, (sum(c["lk"]), c["Hkv"], c["Dv"]), "cpu", c["dtype"]).requires_grad_()
    options = dict(causal=c["causal"], window=c["window"], scale=c["scale"],
                   dropout_p=c["dropout_p"], seed=seed)
    with BoundsChecker() as check, gpu_launch_plans(path), forcing_careful(careful):
        out = fastattn.varlen_attention(q, k, v, cu_q, cu_k, max(c["lq"]), max(c["lk"]),
                                        backend="triton", **options)
        dout = T._tensor(g, out.shape, "cpu", c["dtype"])
        torch.autograd.grad(out, (q, k, v), dout, allow_unused=True)
    return c, check, None


def run_paged(seed, path="gpu", careful=False, float64_as=None):
    import math
    import torch
    import fastattn

    T, c, g = _drawn("paged", seed, float64_as)
    if g is None:
        return c, None, "skipped (float64: the triton backend refuses it)"
    B, bs = len(c["lens"]), c["block_size"]
    per_row = max(math.ceil(n / bs) for n in c["lens"]) + c["spare_blocks"]
    blocks = B * per_row + 3
    table = torch.randperm(blocks, generator=g)[: B * per_row].reshape(B, per_row).to(torch.int32)
    k_cache = T._tensor(g, (blocks, bs, c["Hkv"], c["D"]), "cpu", c["dtype"])
    v_cache = T._tensor(g, (blocks, bs, c["Hkv"], c["Dv"]), "cpu", c["dtype"])
    q = T._tensor(g, (B, c["H"], c["Lq"], c["D"]), "cpu", c["dtype"])
    seqlens = torch.tensor(c["lens"], dtype=torch.int32)
    options = dict(causal=c["causal"], window=c["window"], scale=c["scale"])
    with BoundsChecker() as check, gpu_launch_plans(path), forcing_careful(careful):
        fastattn.paged_attention(q, k_cache, v_cache, table, seqlens, backend="triton", **options)
    return c, check, None


def _short(c):
    skip = ("dtype",)
    return f"{str(c['dtype']).replace('torch.', '')} " + " ".join(
        f"{k}={v}" for k, v in c.items() if k not in skip)


def main(argv=None):
    parser = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    parser.add_argument("--seeds", default="0-11", help="e.g. 0-11 or 0,5,7")
    parser.add_argument("--op", default="attention", help="attention,varlen,paged")
    parser.add_argument("--path", default="gpu", choices=("gpu", "ptr", "tma", "both"))
    parser.add_argument("--first-only", action="store_true",
                        help="only the first kept config (what FASTATTN_AUTOTUNE=0 runs)")
    parser.add_argument("--careful", action="store_true",
                        help="force every block onto the NaN rule's careful path too")
    parser.add_argument("--device", default="cpu",
                        help="cuda: run on a GPU (with TRITON_INTERPRET=0): no bounds check, "
                             "but --repeat launches each config many times")
    parser.add_argument("--repeat", type=int, default=1, help="launches per config")
    parser.add_argument("--no-sync", action="store_true",
                        help="with --repeat on a GPU: launch back to back, synchronize at the end")
    parser.add_argument("--forward-only", action="store_true")
    parser.add_argument("--config", help='only configs whose text starts with this (e.g. '
                        '"64x64 w4s3"), whether the pruner keeps them or not')
    parser.add_argument("--unaligned-mask", action="store_true",
                        help="give the kernels the caller's mask as it is, not a copy with "
                             "16-element aligned rows (kernels.attention_launch.ALIGN_MASK)")
    parser.add_argument("--nonfinite", action="store_true",
                        help="NaN and inf in some key and value rows (the careful path's "
                             "rank-1 terms)")
    parser.add_argument("--float64-as", default="bfloat16",
                        help="dtype to run the float64 cases in (the triton backend refuses "
                             "float64; 'skip' to skip them)")
    args = parser.parse_args(argv)
    if args.unaligned_mask:
        from fastattn.kernels import attention_launch
        attention_launch.ALIGN_MASK = False
    seeds = []
    for part in args.seeds.split(","):
        lo, _, hi = part.partition("-")
        seeds += list(range(int(lo), int(hi or lo) + 1))
    paths = ("ptr", "tma") if args.path == "both" else (args.path,)

    import warnings

    import torch
    import fastattn  # noqa: F401
    from fastattn.testing import round_bf16_in_interpreter, strict_launches_in_interpreter
    # (numpy's "invalid value" warnings of NaN arithmetic in the interpreter: expected)
    warnings.filterwarnings("ignore", category=RuntimeWarning, module="triton")
    round_bf16_in_interpreter()
    strict_launches_in_interpreter()

    bad = False
    for op in args.op.split(","):
        for seed in seeds:
            for path in paths:
                start = time.time()
                if op == "attention":
                    c = _combinations()._draw_attention(seed)
                    dtype = None
                    note = ""
                    if c["dtype"] == torch.float64:
                        if args.float64_as == "skip":
                            print(f"attention seed {seed}: skipped (float64)")
                            continue
                        dtype = getattr(torch, args.float64_as)
                        note = f" (float64 case run as {args.float64_as})"
                    record, failure = [], None
                    try:
                        c, check, record = run_attention(seed, path, args.first_only, dtype,
                                                         args.careful, args.device, args.repeat,
                                                         args.forward_only, record,
                                                         not args.no_sync, args.nonfinite,
                                                         args.config)
                    except Exception as exc:  # noqa: BLE001 - reported with the configs run
                        failure = exc
                    print(f"attention seed {seed} [{path}]{note}: {_short(c)}  "
                          f"({time.time() - start:.0f} s)")
                    for r in record:
                        flag = "  <- first (AUTOTUNE=0)" if r.first else ""
                        extra = f" UNWRITTEN {r.unwritten}" if r.unwritten else ""
                        extra += f" FAILED {r.error}" if r.error else ""
                        diff = " ".join(f"{k}:{v:.2g}" for k, v in r.max_diff.items())
                        print(f"    {r.kernel:24s} {r.config:22s} {r.seconds:5.1f} s"
                              f"{' diff ' + diff if diff else ''}{extra}{flag}")
                        bad |= bool(r.unwritten)
                    if failure is not None:
                        print(f"    FAILED: {failure!r}"[:2000])
                        return 1
                else:
                    c, check, skipped = (run_varlen if op == "varlen" else run_paged)(
                        seed, path, args.careful,
                        None if args.float64_as == "skip" else getattr(torch, args.float64_as))
                    print(f"{op} seed {seed} [{path}]: {_short(c)}  ({time.time() - start:.0f} s)")
                    if skipped:
                        print(f"    {skipped}")
                        continue
                print("    launches: " + ", ".join(sorted(set(check.launches))))
                print("    " + check.report().replace("\n", "\n    "))
                bad |= bool(check.violations)
                sys.stdout.flush()
    return 1 if bad else 0


if __name__ == "__main__":
    sys.path[:] = [p for p in sys.path if Path(os.path.abspath(p or ".")).resolve() != ROOT]
    sys.exit(main())
