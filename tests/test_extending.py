"""The extension kit: fastattn's headers for users' extensions, a JIT-compiled user op run through
the backend registry, user backends of fastattn's own ops, and the testing helpers."""

import importlib.util
import os
import re
import shlex
import shutil
import subprocess
import sys
import textwrap
import time

import numpy as np
import pytest
import torch

import fastattn
from fastattn import backends, extending
from fastattn.reference import rope as reference_rope
from fastattn.ops.rope import rope
from fastattn.testing import (
    ODD_HEAD_DIMS,
    ODD_SIZES,
    assert_op_matches_reference,
    odd_shapes,
    opcheck,
    to_numpy,
)

HAVE_COMPILER = shutil.which(os.environ.get("CXX", "c++")) is not None and importlib.util.find_spec("ninja") is not None


@pytest.fixture
def registry():
    """Restore the backend registry after the test (new backends and new op entries alike)."""
    saved = {name: dict(b.impls) for name, b in backends._REGISTRY.items()}
    yield backends._REGISTRY
    for name in list(backends._REGISTRY):
        if name not in saved:
            del backends._REGISTRY[name]
        else:
            backends._REGISTRY[name].impls = saved[name]


# ---------------------------------------------------------------------------------------------
# Headers.


def test_include_paths_find_the_headers():
    paths = extending.include_paths()
    assert paths == [extending.extension_include_dir()]
    assert os.path.isfile(os.path.join(paths[0], "fastattn", "common.h"))
    assert os.path.isfile(os.path.join(paths[0], "fastattn", "cuda_helpers.cuh"))


def test_include_dir_in_an_installed_layout(tmp_path):
    # A wheel ships the headers as package data in site-packages/fastattn/include/fastattn/.
    pkg = tmp_path / "site" / "fastattn"
    (pkg / "include" / "fastattn").mkdir(parents=True)
    (pkg / "include" / "fastattn" / "common.h").write_text("#pragma once\n")
    shutil.copy(extending.__file__, pkg / "extending.py")
    spec = importlib.util.spec_from_file_location("installed_extending", pkg / "extending.py")
    installed = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(installed)
    assert installed.extension_include_dir() == str(pkg / "include")


def test_include_dir_override_and_missing_headers(tmp_path, monkeypatch):
    (tmp_path / "fastattn").mkdir()
    (tmp_path / "fastattn" / "common.h").write_text("#pragma once\n")
    monkeypatch.setenv("FASTATTN_INCLUDE_DIR", str(tmp_path))
    assert extending.include_paths() == [str(tmp_path)]
    monkeypatch.setattr(extending, "_candidates", lambda: [tmp_path / "nowhere"])
    with pytest.raises(FileNotFoundError, match="FASTATTN_INCLUDE_DIR"):
        extending.include_paths()


# ---------------------------------------------------------------------------------------------
# A user backend of one of fastattn's ops.


def test_user_backend_of_a_fastattn_op(registry):
    calls = []

    def mine(x, cos, sin, positions, interleaved):  # the rope backend contract
        calls.append(x.shape)
        return backends.select("rope", x.device, "naive")[1](x, cos, sin, positions, interleaved)

    fastattn.register_backend("rope", "mine", mine, devices=("cpu",))
    assert "mine" in backends.implementations("rope") and "mine" in fastattn.available_backends()
    x = torch.randn(1, 2, 5, 8)
    torch.testing.assert_close(rope(x, backend="mine"), rope(x, backend="naive"))
    with fastattn.use_backend("mine"):
        rope(x)
        with pytest.raises(ValueError, match="no implementation of layer_norm"):
            fastattn.layer_norm(x, (8,))
    assert len(calls) == 2
    with pytest.raises(ValueError, match="does not run on meta"):
        rope(x.to("meta"), backend="mine")


# ---------------------------------------------------------------------------------------------
# A user op JIT-compiled against fastattn's headers, run through the registry.

USER_OP = textwrap.dedent(
    r"""
    // myext::scale_rows(x, scale): y[r, :] = x[r, :] * scale[r], using fastattn's checks and
    // dtype dispatch (fastattn/common.h).
    #include <ATen/ATen.h>
    #include <ATen/Parallel.h>
    #include <torch/library.h>

    #include <type_traits>

    #include "fastattn/common.h"

    namespace {

    at::Tensor scale_rows(const at::Tensor& x, const at::Tensor& scale) {
      fastattn::check_rows(x, "x");
      fastattn::check_float_dtype(x, "x", /*allow_double=*/true);
      fastattn::check_device(scale, x, "scale", "x");
      fastattn::check_shape(scale, {x.size(0)}, "scale");
      fastattn::check_dtype(scale, x.scalar_type(), "scale");
      const int64_t m = x.size(0), n = x.size(1);
      at::Tensor y = at::empty({m, n}, x.options());
      const at::Tensor s = scale.contiguous();
      FASTATTN_DISPATCH_FLOATING_HALF_BF16(x.scalar_type(), "scale_rows", [&] {
        const scalar_t* xp = x.const_data_ptr<scalar_t>();
        const scalar_t* sp = s.const_data_ptr<scalar_t>();
        scalar_t* yp = y.data_ptr<scalar_t>();
        const int64_t stride = x.stride(0);
        // float arithmetic for float / half / bfloat16, double for double (so gradcheck works)
        using acc_t = std::conditional_t<std::is_same_v<scalar_t, double>, double, float>;
        at::parallel_for(0, m, 1, [&](int64_t r0, int64_t r1) {
          for (int64_t r = r0; r < r1; ++r) {
            const acc_t f = static_cast<acc_t>(sp[r]);
            for (int64_t i = 0; i < n; ++i) {
              yp[r * n + i] = static_cast<scalar_t>(static_cast<acc_t>(xp[r * stride + i]) * f);
            }
          }
        });
      });
      return y;
    }

    }  // namespace

    TORCH_LIBRARY(myext, m) { m.def("scale_rows(Tensor x, Tensor scale) -> Tensor"); }
    TORCH_LIBRARY_IMPL(myext, CPU, m) { m.impl("scale_rows", &scale_rows); }
    """
)


@pytest.fixture(scope="module")
def myext(tmp_path_factory):
    """Build the user op once (about 30-60 s of compiling on a laptop), register fake + autograd."""
    if not HAVE_COMPILER:
        pytest.skip("needs a C++ compiler and ninja")
    src_dir = tmp_path_factory.mktemp("myext_src")
    source = src_dir / "myext.cpp"
    source.write_text(USER_OP)
    start = time.perf_counter()
    extending.load("fastattn_test_myext", [source], build_directory=str(tmp_path_factory.mktemp("myext_build")))
    print(f"myext built in {time.perf_counter() - start:.1f} s")
    op = torch.ops.myext.scale_rows.default

    torch.library.register_fake("myext::scale_rows", lambda x, scale: x.new_empty(x.shape))

    def setup_context(ctx, inputs, output):
        ctx.save_for_backward(*inputs)

    def backward(ctx, dy):
        x, scale = ctx.saved_tensors
        dy = dy.contiguous()
        dx = op(dy, scale) if ctx.needs_input_grad[0] else None
        dscale = (dy.float() * x.float()).sum(1).to(scale.dtype) if ctx.needs_input_grad[1] else None
        return dx, dscale

    torch.library.register_autograd("myext::scale_rows", backward, setup_context=setup_context)
    return op


def scale_rows(x, scale, *, backend=None):
    """The user's public function: dispatches through fastattn's registry like fastattn's ops."""
    _, impl = backends.select("scale_rows", x.device, backend, x.dtype)
    return impl(x, scale)


def test_jit_user_op_through_the_registry(myext, registry):
    fastattn.register_backend("scale_rows", "naive", lambda x, s: x * s[:, None])
    fastattn.register_backend("scale_rows", "mine", lambda x, s: myext(x, s), devices=("cpu",))
    x = torch.randn(17, 130)
    s = torch.randn(17)
    torch.testing.assert_close(scale_rows(x, s, backend="mine"), x * s[:, None])
    with fastattn.use_backend("mine"):
        torch.testing.assert_close(scale_rows(x[:, 3:], s), x[:, 3:] * s[:, None])  # row-strided
    for dtype in (torch.float32, torch.bfloat16, torch.float16):
        assert_op_matches_reference(
            lambda x, s: scale_rows(x, s, backend="mine"),
            lambda x, s: x * s[:, None],
            [torch.randn(17, 40), torch.randn(17)],
            dtype=dtype,
            ref_backward=lambda dy, x, s: (dy * s[:, None], (dy * x).sum(1)),
            baseline=lambda x, s: x * s[:, None],
            arg_names=["x", "scale"],
        )
    # fastattn's argument checks, compiled into the user's op, name the argument.
    with pytest.raises(RuntimeError, match="x must be 2-D"):
        myext(torch.randn(2, 3, 4), s)
    with pytest.raises(RuntimeError, match="scale must have shape"):
        myext(x, torch.randn(3))
    opcheck("myext::scale_rows", (torch.randn(5, 33), torch.randn(5)))
    torch.autograd.gradcheck(lambda x, s: scale_rows(x, s, backend="mine"),
                             (torch.randn(3, 5, dtype=torch.float64, requires_grad=True),
                              torch.randn(3, dtype=torch.float64, requires_grad=True)))


_RUNTIME_SYMBOL = re.compile(r" (_Unwind_|__cxa_|__gxx_personality)")


def _own_cxx_runtime(library) -> int:
    """How many C++ runtime / unwinder symbols a shared library defines and exports: 0 when it
    uses the shared libstdc++ that torch uses."""
    out = subprocess.run(["nm", "-D", "--defined-only", str(library)], capture_output=True,
                         text=True, check=True).stdout
    return sum(bool(_RUNTIME_SYMBOL.search(line)) for line in out.splitlines())


needs_nm = pytest.mark.skipif(not sys.platform.startswith("linux") or shutil.which("nm") is None,
                              reason="ELF symbol tables: Linux with binutils' nm")


@needs_nm
def test_link_flags_keep_the_shared_cxx_runtime(tmp_path):
    """A compiler whose library path finds libstdc++.a before libstdc++.so links a copy of the
    C++ runtime into each shared library: CXX on the GPU image of 2026-11-26 (a GCC relocated
    under /opt/gcc) did, and every C++ error of fastattn._C crashed the process there (signal
    11). Modelled here by putting the runtime's archive first on the library path; with
    DEFAULT_LDFLAGS, which setup.py and extending.load link with, the runtime stays the shared
    one."""
    cxx = shutil.which(os.environ.get("CXX", "c++"))
    if cxx is None:
        pytest.skip("no C++ compiler")
    archive = subprocess.run([cxx, "-print-file-name=libstdc++.a"], capture_output=True,
                             text=True).stdout.strip()
    if not os.path.isabs(archive) or not os.path.isfile(archive):
        pytest.skip("this compiler has no libstdc++.a")
    (tmp_path / "lib").mkdir()
    (tmp_path / "lib" / "libstdc++.a").symlink_to(archive)
    wrapper = tmp_path / "g++"
    wrapper.write_text(f'#!/bin/sh\nexec {shlex.quote(cxx)} -L{shlex.quote(str(tmp_path / "lib"))} "$@"\n')
    wrapper.chmod(0o755)
    src = tmp_path / "thrower.cpp"
    src.write_text("#include <stdexcept>\n"
                   "extern \"C\" void thrower(int x) { if (x) throw std::runtime_error(\"x\"); }\n")

    def build(name, flags):
        lib = tmp_path / f"{name}.so"
        subprocess.run([str(wrapper), "-shared", "-fPIC", str(src), "-o", str(lib), *flags],
                       capture_output=True, text=True, check=True)
        return _own_cxx_runtime(lib)

    assert build("bare", []) > 0, "the archive first on the path should be linked in"
    assert build("lstdcxx", ["-lstdc++"]) > 0  # (why the flag names the shared file)
    assert build("fastattn", list(extending.DEFAULT_LDFLAGS)) == 0


@needs_nm
def test_the_extension_uses_the_shared_cxx_runtime():
    """fastattn._C as built here defines none of the C++ runtime's symbols (see above)."""
    from fastattn import _extension
    if _extension.error():
        pytest.skip(_extension.error())
    import fastattn._C as C
    assert _own_cxx_runtime(C.__file__) == 0


# ---------------------------------------------------------------------------------------------
# The testing helpers.


def test_odd_shapes():
    shapes = list(odd_shapes())
    assert len(shapes) == 9 and all(len(s) == 4 for s in shapes)
    assert {s[2] for s in shapes} == set(ODD_SIZES) and {s[3] for s in shapes} == set(ODD_HEAD_DIMS)
    rows = list(odd_shapes("rows", max_numel=100))
    assert rows and all(m * n <= 100 for m, n in rows)
    with pytest.raises(ValueError, match="kind"):
        list(odd_shapes("nope"))


def test_assert_op_matches_reference_catches_wrong_forward_and_gradient():
    ref = lambda x: np.tanh(x)  # noqa: E731
    ref_bwd = lambda dy, x: (dy * (1 - np.tanh(x) ** 2),)  # noqa: E731
    x = [torch.randn(4, 6)]
    errors = assert_op_matches_reference(torch.tanh, ref, x, dtype=torch.bfloat16, ref_backward=ref_bwd,
                                         baseline=torch.tanh)
    assert set(errors) == {"output", "dinput0"}
    # Finite differences when no reference backward is given.
    assert_op_matches_reference(torch.tanh, ref, x, dtype=torch.float32)
    with pytest.raises(AssertionError, match="output"):
        assert_op_matches_reference(lambda x: torch.tanh(x) + 1e-3, ref, x, dtype=torch.float32)

    class WrongGrad(torch.autograd.Function):
        @staticmethod
        def forward(ctx, x):
            return torch.tanh(x)

        @staticmethod
        def backward(ctx, dy):
            return dy

    with pytest.raises(AssertionError, match="dx"):
        assert_op_matches_reference(WrongGrad.apply, ref, x, dtype=torch.float32, arg_names=["x"])


def test_assert_op_matches_reference_on_rope_with_integer_inputs():
    # Integer inputs (positions) reach the reference as integer arrays and get no gradient.
    x = torch.randn(2, 2, 5, 8)
    positions = torch.tensor([[4, 3, 2, 1, 0], [0, 0, 1, 1, 2]])
    errors = assert_op_matches_reference(
        lambda x, p: rope(x, positions=p, backend="naive"),
        lambda x, p: reference_rope.rope(x, positions=p),
        [x, positions],
        dtype=torch.float32,
        ref_backward=lambda dy, x, p: reference_rope.rope_backward(dy, x, positions=p)[:1],
        arg_names=["x", "positions"],
    )
    assert set(errors) == {"output", "dx"}
    assert to_numpy(x).dtype == np.float64


def test_opcheck_resolves_names_and_requires_grad():
    gpu = torch.device("cuda" if torch.cuda.is_available() else "cpu")
    ops = []
    if hasattr(torch.ops.fastattn, "triton_layer_norm_fwd"):
        ops.append((torch.ops.fastattn.triton_layer_norm_fwd, gpu))  # a packet: its default overload
    if hasattr(torch.ops.fastattn, "layer_norm_fwd"):
        ops.append(("fastattn::layer_norm_fwd", torch.device("cpu")))
    if not ops:
        pytest.skip("no compiled layer_norm op here")
    for op, device in ops:
        args = (torch.randn(3, 8, device=device), None, torch.randn(8, device=device),
                torch.randn(8, device=device), 1e-5, False)
        result = opcheck(op, args)
        assert all(v == "SUCCESS" for v in result.values()), result
