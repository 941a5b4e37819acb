"""Backend registry and selection: the order of choice, clear errors, user backends."""

import os
import subprocess
import sys

import pytest
import torch

import fastattn
from fastattn import backends


def test_naive_is_always_available_and_status_explains_the_rest():
    status = fastattn.backend_status()
    assert set(backends.BUILTIN) <= set(status)
    assert status["naive"] is None
    assert "naive" in fastattn.available_backends()
    for name, reason in status.items():
        assert (reason is None) == (name in fastattn.available_backends())
        assert reason is None or isinstance(reason, str) and reason


def test_triton_counts_on_cpu_only_under_the_interpreter():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    code = "import fastattn; print('triton' in fastattn.available_backends())"
    env = {k: v for k, v in os.environ.items() if k != "TRITON_INTERPRET"}
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "False"
    env["TRITON_INTERPRET"] = "1"
    out = subprocess.run([sys.executable, "-c", code], env=env, capture_output=True, text=True, check=True)
    assert out.stdout.strip() == "True"


def test_unknown_backend_is_a_clear_error():
    x = torch.randn(2, 4)
    with pytest.raises(ValueError, match="unknown backend 'nope'.*available backends"):
        fastattn.layer_norm(x, (4,), backend="nope")
    with pytest.raises(ValueError, match="unknown backend"):
        with fastattn.use_backend("nope"):
            pass


def test_backend_that_cannot_run_the_device_is_a_clear_error():
    if torch.cuda.is_available():
        pytest.skip("a GPU is present")
    with pytest.raises(ValueError, match="backend 'cuda'.*cannot run layer_norm.*backends that can"):
        fastattn.layer_norm(torch.randn(2, 4), (4,), backend="cuda")


def _spy(monkeypatch):
    calls = []

    def impl(x, residual, normalized_shape, weight, bias, eps, rms):
        calls.append("spy")
        return torch.zeros_like(x), None

    monkeypatch.setitem(backends._REGISTRY, "spy", backends.Backend("spy", ("cpu",)))
    fastattn.register_backend("layer_norm", "spy", impl)
    return calls


def test_choice_order_argument_then_context_then_environment(monkeypatch):
    calls = _spy(monkeypatch)
    x = torch.randn(2, 4)
    monkeypatch.setenv("FASTATTN_BACKEND", "spy")
    fastattn.layer_norm(x, (4,))
    assert calls == ["spy"]
    with fastattn.use_backend("naive"):
        y = fastattn.layer_norm(x, (4,))  # the context beats the environment
        assert calls == ["spy"] and y.abs().sum() > 0
        fastattn.layer_norm(x, (4,), backend="spy")  # the argument beats the context
        assert calls == ["spy", "spy"]
    monkeypatch.delenv("FASTATTN_BACKEND")
    name, _ = backends.select("layer_norm", x.device)
    assert name == ("cpu" if "cpu" in fastattn.available_backends() else "naive")


def test_kernels_are_not_importable_as_top_level_package():
    """From the repository root, top-level ``kernels`` is an empty stand-in (so that probes such
    as transformers' see no package; tests/test_hf_clone_root.py), never fastattn's kernels."""
    root = os.path.dirname(os.path.dirname(os.path.abspath(__file__)))
    out = subprocess.run(
        [sys.executable, "-c", "import kernels; kernels.attention"], cwd=root, capture_output=True, text=True
    )
    assert out.returncode != 0 and "import it as fastattn.kernels" in out.stderr


def test_import_works_without_the_extension():
    code = (
        "import sys; sys.modules['fastattn._C'] = None\n"
        "import torch, fastattn\n"
        "s = fastattn.backend_status()\n"
        "assert 'not built' in s['cpu'] and 'not built' in s['cuda'], s\n"
        "assert 'cpu' not in fastattn.available_backends()\n"
        "x = torch.randn(3, 8)\n"
        "assert torch.allclose(fastattn.layer_norm(x, (8,)), torch.nn.functional.layer_norm(x, (8,)), atol=1e-5)\n"
        "print('ok')"
    )
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True)
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "ok"


def test_every_op_has_a_typed_contract_that_its_backends_fit():
    """fastattn.contracts types each op's backend contract; every registered implementation
    (built-in or user) can be called as it says, and each op that define_op wired has one."""
    from fastattn import contracts
    from fastattn.ops._library import DEFINED

    assert set(DEFINED) <= set(contracts.CONTRACTS), set(DEFINED) - set(contracts.CONTRACTS)
    checked = 0
    for name, backend in backends._REGISTRY.items():
        for op, fn in backend.impls.items():
            assert contracts.mismatch(op, fn) is None, (op, name)
            checked += 1
    assert checked >= len(DEFINED)  # at least naive for every op
    assert contracts.arguments("attention") == ["q", "k", "v", "mask", "scale", "offset", "left",
                                                "right", "dropout_p", "seed"]


def test_register_backend_refuses_a_function_that_does_not_fit_the_contract():
    with pytest.raises(TypeError, match=r"contract.*fn\(x, cos, sin, positions, interleaved\)"):
        fastattn.register_backend("rope", "too_few", lambda x, cos, sin: x)
    with pytest.raises(TypeError, match="SoftmaxBackend"):
        fastattn.register_backend("softmax", "keyword_only", lambda x, *, mask, scale, is_causal: x)
    assert "too_few" not in backends.implementations("rope")

    def mine(x, mask, scale, is_causal, extra=None):  # extra defaults: fits
        return x
    fastattn.register_backend("softmax", "fits_test", mine)
    try:
        assert "fits_test" in backends.implementations("softmax")
    finally:
        del backends._REGISTRY["fits_test"]


def test_a_remembered_choice_follows_the_registry_context_and_environment(monkeypatch):
    x = torch.randn(2, 4)
    fastattn.layer_norm(x, (4,))  # the automatic choice, now remembered
    calls = _spy(monkeypatch)
    fastattn.layer_norm(x, (4,), backend="spy")
    with fastattn.use_backend("spy"):
        fastattn.layer_norm(x, (4,))
    monkeypatch.setenv("FASTATTN_BACKEND", "spy")
    fastattn.layer_norm(x, (4,))
    monkeypatch.delenv("FASTATTN_BACKEND")
    fastattn.layer_norm(x, (4,))
    assert calls == ["spy"] * 3
    # an implementation put back by hand (as test fixtures do) is not shadowed by the memory
    before = backends._REGISTRY["spy"].impls["layer_norm"]
    backends._REGISTRY["spy"].impls["layer_norm"] = lambda *a: (calls.append("other"), before(*a))[1]
    fastattn.layer_norm(x, (4,), backend="spy")
    assert calls[-2:] == ["other", "spy"]


def test_availability_is_marked_constant_as_torch_marks_it():
    """fastattn marks the availability check for torch.compile as torch's own decorator would,
    without importing torch._dynamo (which is 2.7 s of an import): the same mark, and nothing
    else, so a torch that changes how it marks fails here."""
    def ours():
        pass

    def torchs():
        pass

    assert backends.assume_constant_result(ours) is ours
    assert torch.compiler.assume_constant_result(torchs) is torchs
    assert ours.__dict__ == torchs.__dict__ != {}


def test_import_loads_neither_dynamo_nor_inductor():
    """``import fastattn`` stays light on a machine with no GPU: torch.compile's machinery
    (torch._dynamo, torch._inductor: 4-5 s on this project's CPU) loads when it is used."""
    if torch.cuda.is_available():
        pytest.skip("with a GPU the Triton ops register through torch.library.triton_op, which loads both")
    code = "import sys, fastattn; print(sorted(m for m in ('torch._dynamo', 'torch._inductor') if m in sys.modules))"
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True,
                         env={**os.environ, "TRITON_INTERPRET": "0"})
    assert out.returncode == 0, out.stderr
    assert out.stdout.strip() == "[]"


@pytest.mark.parametrize("name", ["auto", *backends.BUILTIN])
def test_selection_compiles_without_graph_breaks(name, monkeypatch):
    """torch.compile(fullgraph=True) runs the choice of a backend (the first call of a kind, not
    yet remembered): each backend's availability check is read as a constant, not traced (an
    H100, torch 2.11, 2026-11-27: tracing the Triton check broke every fullgraph compile of a
    Triton op; here, torch 2.13 could not trace its environment read either)."""
    asked = None if name == "auto" else name
    if asked is not None and asked not in fastattn.available_backends():
        pytest.skip(f"{name} unavailable here")
    # on a device the backend runs on (cuda takes no CPU tensors: an H100, 2026-11-27)
    devices = ["cpu", *(["cuda"] if torch.cuda.is_available() else [])]
    device = next((d for d in devices if asked is None or backends._REGISTRY[asked].refuses(
        "layer_norm", torch.device(d), torch.float32, {}, ()) is None), None)
    if device is None:
        pytest.skip(f"{name} runs on none of {devices} here")
    x = torch.randn(3, device=device)
    monkeypatch.setattr(backends, "_CHOSEN", {})
    torch._dynamo.reset()

    def f(x):
        chosen, _ = backends.select("layer_norm", x.device, asked, x.dtype)
        return x * 2 if chosen == (asked or eager) else x

    eager = backends.select("layer_norm", x.device, asked, x.dtype)[0]
    backends._CHOSEN.clear()
    torch.testing.assert_close(torch.compile(f, fullgraph=True, backend="eager")(x), x * 2)
