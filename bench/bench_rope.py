"""RoPE: fastattn's backends against the eager formula, pytest-benchmark style.

    python -m pytest bench/bench_rope.py --benchmark-only                 # the device's sizes
    python -m pytest bench/bench_rope.py --benchmark-only --bench-quick   # fewer sizes
    python bench/bench_rope.py [--quick]                                  # one table, via fastattn.bench.compare

Providers: ``fastattn-<backend>`` (each compiled backend that runs here at full speed), ``naive``
(fastattn's eager backend, float32 arithmetic) and ``torch`` — the eager Hugging Face LLaMA
formula ``x * cos + rotate_half(x) * sin`` in the input dtype, with the tables gathered by
position — the peer the ``x torch`` speedup is measured against; on a GPU also
``torch.compile(torch)``. Cases are prefill shapes (positions ``0 .. L - 1``) and one batched
decode step (L = 1, every sequence at its own position, read from a 4096-row table). Throughput is
GB/s of the minimum traffic (x read, y written; twice that forward + backward).

The cases are defined here by ``rope_suite`` (the signature of ``fastattn.bench.suites`` suites);
timing goes through ``run_bench`` of bench/conftest.py like every other bench file.
"""

from __future__ import annotations

import os
import sys
from typing import Callable

import pytest
import torch

from fastattn import bench
from fastattn.reference import rope as reference_rope
from fastattn.bench import Case
from fastattn.bench.suites import Options, compiled, fastattn_backends
from fastattn.ops.rope import rope, rotary_cos_sin
from fastattn.testing import to_numpy

if __name__ != "__main__":
    pytest.importorskip("pytest_benchmark", reason="needs pytest-benchmark (pip install pytest-benchmark)")

OP = "rope"
DEVICE = torch.device(os.environ.get("FASTATTN_BENCH_DEVICE") or ("cuda" if torch.cuda.is_available() else "cpu"))
TABLE_ROWS = 4096  # decode cases read positions from a table this long
REFERENCE_MAX_ELEMENTS = 2**22  # larger cases compare batch 0, head 0 only

SHAPES = {  # (B, H, L, D, decode)
    "gpu": [(4, 32, 4096, 128, False), (1, 32, 16384, 128, False), (16, 16, 1024, 64, False),
            (8, 40, 2048, 80, False), (256, 32, 1, 128, True)],
    "cpu": [(1, 8, 1024, 64, False), (4, 16, 512, 128, False), (64, 16, 1, 128, True)],
    "tiny": [(1, 2, 16, 8, False), (4, 2, 1, 16, True)],
}


def _rotate_half(x):
    x1, x2 = x.chunk(2, dim=-1)
    return torch.cat((-x2, x1), dim=-1)


def eager_rope(x, cos, sin, positions):
    """The eager Hugging Face formula in x's dtype (the ``torch`` provider)."""
    if positions is None:
        c, s = cos[: x.shape[2]], sin[: x.shape[2]]
    else:
        c, s = cos[positions][:, None], sin[positions][:, None]
    c = torch.cat((c, c), dim=-1).to(x.dtype)
    s = torch.cat((s, s), dim=-1).to(x.dtype)
    return x * c + _rotate_half(x) * s


def rope_suite(device: torch.device, dtype: torch.dtype, modes, quick: bool, options: Options | None = None):
    """``(providers, cases)`` for RoPE on ``device`` (a ``fastattn.bench.suites`` suite)."""
    o = options or Options()
    preset = "tiny" if o.tiny else ("gpu" if device.type == "cuda" else "cpu")
    use_compile = o.compile if o.compile is not None else (device.type == "cuda" and not o.tiny)
    shapes = SHAPES[preset]
    if quick and preset != "tiny":
        shapes = shapes[:1] + shapes[-1:]

    providers: dict[str, Callable] = {
        f"fastattn-{name}": (lambda name: lambda x, c, s, p: rope(x, c, s, positions=p, backend=name))(name)
        for name in fastattn_backends("rope", device)
    }
    providers["naive"] = lambda x, c, s, p: rope(x, c, s, positions=p, backend="naive")
    providers["torch"] = eager_rope
    if use_compile:
        providers["torch.compile(torch)"] = compiled(eager_rope)

    def ref(x, c, s, p):
        x, p = _corner(x, p)
        return reference_rope.rope(to_numpy(x), to_numpy(c), to_numpy(s), positions=_positions(x, p))

    def grad_ref(inputs, dout):
        x, c, s, p = inputs
        x, p = _corner(x, p)
        dout = dout[tuple(slice(0, n) for n in x.shape)]
        return [reference_rope.rope_backward(dout, to_numpy(x), to_numpy(c), to_numpy(s), positions=_positions(x, p))[0]]

    elt = torch.empty(0, dtype=dtype).element_size()
    cases = []
    for B, H, L, D, decode in shapes:
        for mode in modes:
            traffic = {"fwd": 2, "bwd": 2, "fwd_bwd": 4}[mode] * B * H * L * D * elt

            def make(B=B, H=H, L=L, D=D, decode=decode, mode=mode):
                gen = torch.Generator().manual_seed(B * 31 + L)
                x = torch.randn((B, H, L, D), generator=gen).to(device=device, dtype=dtype)
                x.requires_grad_(mode != "fwd")
                cos, sin = rotary_cos_sin(TABLE_ROWS if decode else L, D, device=device)
                positions = torch.randint(0, TABLE_ROWS, (B, L), generator=gen).to(device) if decode else None
                return x, cos, sin, positions

            cases.append(Case(
                "rope", f"{B}x{H}x{L}x{D}" + (" decode" if decode else ""), dtype, mode, make, bytes=traffic,
                reference=ref, grad_reference=grad_ref, params={"L": L, "D": D}, sweep="L",
            ))
    return providers, cases


def _corner(x, positions):
    """x (and positions) whole when small, else batch 0, head 0: the reference's share."""
    if x.numel() <= REFERENCE_MAX_ELEMENTS:
        return x, positions
    return x[:1, :1], None if positions is None else positions[:1]


def _positions(x, positions):
    return None if positions is None else positions.cpu().numpy()


def pytest_generate_tests(metafunc):
    """Parametrize ``rope_case`` with every (case, provider) of :func:`rope_suite`."""
    if "rope_case" not in metafunc.fixturenames:
        return
    config = metafunc.config
    modes = [m for m in config.getoption("--bench-mode").split(",") if m]
    options = Options(tiny=config.getoption("--bench-tiny"), compile=config.getoption("--bench-compile"))
    providers, cases = rope_suite(DEVICE, bench.default_dtype(DEVICE), modes, config.getoption("--bench-quick"), options)
    params = [
        pytest.param((case, name, fn), id=f"{case.shape.replace(' ', '-')}-{case.mode}-{name}")
        for case in cases
        for name, fn in providers.items()
    ]
    metafunc.parametrize("rope_case", params)


def test_rope(rope_case, run_bench):
    run_bench(rope_case)


if __name__ == "__main__":
    quick = "--quick" in sys.argv
    providers, cases = rope_suite(DEVICE, bench.default_dtype(DEVICE), ["fwd", "fwd_bwd"], quick)
    bench.print_table(bench.compare(providers, cases, device=DEVICE), title=f"rope on {DEVICE}")
