# cpumla: developer entry points. `make test` is the README's test command and what CI runs.
PY ?= python3
PIP ?= $(PY) -m pip

.PHONY: install dev test test-py test-native test-arm test-nehalem test-sanitize cross-deps bench performance info clean help

help:
	@echo "make install      install cpumla (builds the kernel library for every ISA of this arch)"
	@echo "make test         install with test extras, then every test: Python, C runner natively,"
	@echo "                  NEON under qemu-aarch64, and the x86 build on an emulated Nehalem (no AVX)"
	@echo "make test-py      Python tests only (kernels over every runnable ISA, CLI)"
	@echo "make test-native  C kernel runner on this CPU"
	@echo "make test-sanitize C runner under ASan+UBSan and under TSan, then a Python smoke and parity"
	@echo "                  subset on an ASan+UBSan build of the extension (libasan preloaded)"
	@echo "make bench        kernel micro-benchmark (GEMV GB/s vs measured read bandwidth)"
	@echo "make performance  rerun every measurement of docs/performance.md and rewrite it (about 20 minutes;"
	@echo "                  LLAMA=\"--llama-lib DIR --llama-sdist DIR --convert FILE\" adds llama.cpp)"

install:
	$(PIP) install .

# Editable install with the test extras (torch pinned to the CPU build 2.13.0: never a CUDA build).
dev:
	$(PIP) install -q -e '.[test]'

test: dev test-py test-native test-arm test-nehalem test-sanitize

test-py:
	$(PY) -m pytest -q tests

test-native:
	bash tests/native/run.sh host

# ~4 minutes on 2 cores: part of `make test`. The Python half builds into build/sanitize/ and leaves
# the in-place build alone (tests/sanitize_py.sh says how).
test-sanitize:
	SANITIZE=address bash tests/native/run.sh host
	SANITIZE=thread bash tests/native/run.sh host
	PY=$(PY) bash tests/sanitize_py.sh

cross-deps:
	bash tests/native/cross-deps.sh

test-arm: cross-deps
	bash tests/native/run.sh arm

test-nehalem: cross-deps
	@if [ "$$(uname -m)" = x86_64 ]; then bash tests/native/run.sh nehalem; \
	else echo "nehalem: skipped (not an x86-64 host)"; fi

bench:
	cpumla bench --kernels

performance:
	$(PY) benchmarks/performance.py $(LLAMA)

info:
	cpumla info

clean:
	rm -rf build dist *.egg-info cpumla/native/_cpumla*.so cpumla/native/_cpumla.c
