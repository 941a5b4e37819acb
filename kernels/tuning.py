"""What the kernel modules share about the GPU they plan launches for, and autotuning.

``FASTATTN_AUTOTUNE=0`` (read at import; ``AUTOTUNE`` is assignable) makes every autotuned
kernel run the first config its pruner keeps instead of timing all of them: one compile per
shape rather than one per config. The GPU test suite sets it (tests/conftest.py) so that its
many small shapes do not each autotune; benchmarks and users keep the default, full tuning.

``TARGET`` is the GPU that launch plans (grid sizes from the SM count, Hopper-only paths) are
made for when none is present: ``fastattn.aot`` compiles every launch for an H100 this way on a
machine without a GPU. ``None`` (the default) means the current device.
"""

import os
import sys

import torch

AUTOTUNE = os.environ.get("FASTATTN_AUTOTUNE", "1").strip().lower() not in (
    "0", "false", "no", "off")



def interpreting():
    """TRITON_INTERPRET as Triton itself reads it (now)."""
    try:
        from triton import knobs
        return bool(knobs.runtime.interpret)
    except (ImportError, AttributeError):  # no Triton, or one without knobs
        return os.environ.get("TRITON_INTERPRET", "0").strip().lower() in ("1", "true", "on")


#: Whether Triton runs kernels on the CPU: TRITON_INTERPRET as Triton itself reads it, at import.
INTERPRET = interpreting()


def _interpreted(kernel):
    return kernel


#: How every launcher launches a kernel, chosen once: ``torch.library.wrap_triton`` (so that a
#: launch can be traced), or under the interpreter the kernel as it is (the ops are then opaque
#: custom ops, never traced into). torch 2.13's wrap_triton hands an interpreted kernel back
#: itself; 2.12 and older refuse a bare one and fail at the launch of an autotuned one (torch
#: 2.11, the GPU image's, 2026-11-29).
wrap_triton = _interpreted if INTERPRET else torch.library.wrap_triton

#: ``None``, or ``{"capability": (major, minor), "sms": count}`` to plan for without a GPU.
TARGET = None

_SM_COUNT = {}


def limit(configs):
    """The pruned ``configs`` themselves, or only the first one when autotuning is off."""
    return list(configs) if AUTOTUNE else list(configs)[:1]


def do_bench(kernel_call, quantiles):
    """The autotuners' timer (``triton.autotune(do_bench=...)``): Triton's own, or with autotuning
    off none at all. Triton's autotuner times its pruned configs even when one is left, ~125 ms
    of launches (thousands for a small shape) at every new key: on a GPU, a test of a new shape
    spent more time there than in its own launches. With one config there is nothing to choose."""
    if not AUTOTUNE:
        return [0.0] * len(quantiles)
    from triton.runtime import driver
    return driver.active.get_benchmarker()(kernel_call, quantiles=quantiles)


def cdiv(a, b):
    """``ceil(a / b)`` on the host: what ``triton.cdiv`` computes, without its cost there
    (since Triton 3.4 it is a constexpr function, ~2 us a call from Python; a launcher makes
    several a call, and small ops are host-bound on a GPU: bench/host_overhead.py). Symbolic
    sizes (torch.compile) go through unchanged."""
    return (a + b - 1) // b


def next_power_of_2(n):
    """``triton.next_power_of_2(n)`` on the host (0 for 0), for the same reason as :func:`cdiv`.
    A symbolic size (torch.compile's dynamic shapes) gives an int, with a range guard a
    doubling: block sizes are constexprs, so they are specialized on anyway, and the bit
    arithmetic below, traced, left guards that sympy took minutes over (rope's launcher, an
    H100, 2026-11-27: opcheck past 150 s; 459 s on a CPU)."""
    if isinstance(n, torch.SymInt):
        power = 0 if n <= 0 else 1
        while power and n > power:
            power *= 2
        return power
    n -= 1
    for shift in (1, 2, 4, 8, 16, 32):
        n |= n >> shift
    return n + 1


def bucket(n):
    """The autotuning key of a size: the next power of two (1 for 0). Kernels take it as an
    extra argument keyed on instead of the exact size, so a generation loop over lengths
    1..4096 tunes 13 times, not 4096; the pruners depend on sizes only through it."""
    return 1 << max(int(n) - 1, 0).bit_length()


def num_sms(device):
    """Multiprocessor count of a CUDA device (of TARGET when set); 1 elsewhere (the interpreter
    runs programs one after the other, so fewer, larger programs are faster there)."""
    if TARGET is not None:
        return TARGET["sms"]
    if device.type != "cuda":
        return 1
    index = device.index if device.index is not None else torch.cuda.current_device()
    if index not in _SM_COUNT:
        _SM_COUNT[index] = torch.cuda.get_device_properties(index).multi_processor_count
    return _SM_COUNT[index]


def capability():
    """Compute capability ``(major, minor)`` of TARGET or of the current CUDA device; ``(0, 0)``
    without one."""
    if TARGET is not None:
        return tuple(TARGET["capability"])
    if not torch.cuda.is_available():
        return (0, 0)
    return torch.cuda.get_device_capability()


def check_layout(kernels, name, t, dtypes):
    """The launcher limit every kernel module shares: ``t`` (argument ``name`` of the triton
    ``kernels``) in one of ``dtypes``, with a unit last stride (an empty tensor or a size-1 last
    dim passes). TypeError / ValueError naming the argument otherwise."""
    if t.dtype not in dtypes:
        raise TypeError(f"the triton {kernels} kernels take {name} in "
                        f"{', '.join(map(str, dtypes))}, got {t.dtype}")
    if t.numel() > 1 and t.shape[-1] > 1 and t.stride(-1) != 1:
        raise ValueError(f"the triton {kernels} kernels take {name} with a unit last stride, got "
                         f"shape {tuple(t.shape)} with strides {tuple(t.stride())}")


def config_text(config, launch_kwargs=None):
    """A launch's config in short: block sizes, warps and stages, "ws" when warp-specialized,
    "r<n>" with a register cap (e.g. "128x64 w8s3 r255"); ``config`` None: read from the
    launch's own keywords (kernels that are not autotuned)."""
    if config is None:
        kwargs = launch_kwargs or {}
        blocks = {k: v for k, v in kwargs.items() if k.startswith("BLOCK")}
        warps, stages = kwargs.get("num_warps", 4), kwargs.get("num_stages", 3)
    else:
        blocks = {k: v for k, v in config.kwargs.items() if k.startswith("BLOCK")}
        warps, stages = config.num_warps, config.num_stages
    text = "x".join(str(v) for v in blocks.values()) + f" w{warps}s{stages}"
    if config is not None and config.kwargs.get("WARP_SPECIALIZE"):
        text += " ws"
    if config is not None and getattr(config, "maxnreg", None):
        text += f" r{config.maxnreg}"
    return text


def _autotuners():
    """(name, Autotuner) of every autotuned kernel in the loaded kernel modules, once each
    (launcher modules import their kernels by name)."""
    from triton.runtime.autotuner import Autotuner
    found = {}
    for name, module in list(sys.modules.items()):
        if name.startswith("fastattn.kernels.") and module is not None:
            for attr, value in vars(module).items():
                if isinstance(value, Autotuner):
                    found[id(value)] = (attr, value)
    return found.values()


def chosen_configs(reset=False):
    """``{kernel: config_text}`` of every autotuned kernel that has launched since the last
    ``reset`` (its Autotuner's ``best_config``: the config of its last launch), for the record
    of a benchmark; ``reset=True`` forgets them first and returns ``{}``. Kernels launched bare
    through ``wrap_triton`` outside their op are not seen (fastattn.testing.launching_directly)."""
    chosen = {}
    for attr, tuner in _autotuners():
        if reset:
            tuner.best_config = None
        elif getattr(tuner, "best_config", None) is not None:
            chosen[attr.strip("_")] = config_text(tuner.best_config)
    return chosen
