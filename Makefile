# make bench: install, then run the main job (the benchmark against naive and PyTorch).
# make test:  install, then run the test suite (what CI runs).
PY ?= python3
SOURCES := setup.py pyproject.toml $(wildcard csrc/*.cpp csrc/*/*.cpp csrc/*/*.cu csrc/include/*/*.h)

.PHONY: install bench test check-cuda

.install: $(SOURCES)
	$(PY) -c "import torch" 2>/dev/null || $(PY) -m pip install "torch==2.13.0"
	$(PY) -m pip install ninja wheel "setuptools>=70.1"
	$(PY) -m pip install --no-build-isolation -e ".[test,bench]"
	touch .install

install: .install

bench: .install
	fastattn info
	fastattn bench

test: .install
	$(PY) -m pytest

# Compile every CUDA source with nvcc (compile only: no GPU needed), as CI does.
check-cuda: .install
	$(PY) .ci/compile_cuda.py
