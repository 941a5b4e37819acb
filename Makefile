# make bench: install, then run the main job (the benchmark against naive and PyTorch).
# make test:  install, then run the test suite, a worker a CPU (what CI runs).
# make aot:   the Hopper compile gate, quick (CI): Triton kernels compiled for sm_90 with the GPU
#             image's Triton, in a venv of its own, and their eager launches checked to be direct
#             (.ci/eager_launch.py); make aot-full: every config the pruners keep.
PY ?= python3
# .install stands for "this tree is installed into $(PY)"; it goes when $(PY) finds fastattn
# elsewhere or not at all (a new environment, a moved clone), so that `make install` reinstalls.
INSTALLED_AT := $(shell cd / && $(PY) -c "import importlib.util as u, os; s = u.find_spec('fastattn'); \
	print(os.path.realpath(s.submodule_search_locations[0]) if s else '')" 2>/dev/null)
ifneq ($(INSTALLED_AT),$(realpath $(CURDIR))/fastattn)
$(shell rm -f .install)
endif
SOURCES := setup.py pyproject.toml $(wildcard csrc/*.cpp csrc/*/*.cpp csrc/*/*.h csrc/*/*.cu csrc/include/*/*.h)

# The Triton version of the GPU image (docs/benchmarking.md): the gate compiles with it.
AOT_TRITON ?= 3.6.0

.PHONY: install bench test check-cuda aot aot-full

.install: $(SOURCES)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install "torch==2.13.0"
	$(PY) -m pip install ninja wheel "setuptools>=70.1"
	$(PY) -m pip install --no-build-isolation -e ".[test,bench]"
	touch .install

install: .install

bench: .install
	fastattn info
	fastattn bench

# (-n auto: a worker a CPU, pytest-xdist; CI's 2 cores ran the suite in 522 s against ~600-850
# in one process, 2026-11-28)
test: .install
	$(PY) -m pytest -n auto

# Compile every CUDA source with nvcc (compile only: no GPU needed), as CI does.
check-cuda: .install
	$(PY) .ci/compile_cuda.py

# (A venv made by a venv's python sees the base interpreter's packages, not that venv's: the
# .pth line adds $(PY)'s site-packages, where torch and fastattn are, after the venv's own.)
.venv-aot/.ok-$(AOT_TRITON): .install
	$(PY) -m venv --system-site-packages .venv-aot
	$(PY) -c "import site; print('import site; ' + '; '.join(f'site.addsitedir({d!r})' for d in site.getsitepackages()))" \
		> "$$(.venv-aot/bin/python -c 'import sysconfig; print(sysconfig.get_path("purelib"))')/fastattn-base.pth"
	.venv-aot/bin/python -m pip install -q "triton==$(AOT_TRITON)"
	touch $@

aot: .venv-aot/.ok-$(AOT_TRITON)
	.venv-aot/bin/python -m fastattn.aot --triton --quick
	.venv-aot/bin/python .ci/eager_launch.py

aot-full: .venv-aot/.ok-$(AOT_TRITON)
	.venv-aot/bin/python -m fastattn.aot --triton --json aot-full.json
