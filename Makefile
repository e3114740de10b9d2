# The commands the README names. `demo` and `test` set themselves up on a fresh machine.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := .stamps
RUST_SRC := $(shell find crates -name '*.rs' -o -name Cargo.toml) Cargo.toml pyproject.toml

.PHONY: setup demo test test-rust test-python bench lint fmt clean

setup: $(STAMP)/installed $(STAMP)/system

# System packages the tests need: fuse3 for the stand-in parallel file system (FUSE), a C compiler for
# the LD_PRELOAD test program, rsync for the tool conformance test (tests/test_tools.py). Installed with
# apt when missing and we are root (CI is).
$(STAMP)/system:
	@mkdir -p $(STAMP)
	@if ! command -v fusermount3 >/dev/null || ! command -v cc >/dev/null || ! command -v rsync >/dev/null; then \
		if [ "$$(id -u)" = 0 ]; then \
			(apt-get install -y -q fuse3 gcc rsync || (apt-get update -q && apt-get install -y -q fuse3 gcc rsync)); \
		else \
			echo "tierstore: install fuse3, gcc and rsync (e.g. sudo apt-get install fuse3 gcc rsync) for the FUSE tests" >&2; exit 1; \
		fi; \
	fi
	@touch $@

$(STAMP)/venv:
	@mkdir -p $(STAMP)
	python3 -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	@touch $@

# An editable install: the Python package is used in place and the Rust extension is built into it.
$(STAMP)/installed: $(STAMP)/venv $(RUST_SRC)
	$(PY) -m pip install --quiet -e '.[dev]'
	@touch $@

demo: setup
	$(PY) examples/demo.py

test: setup test-rust test-python

test-rust:
	cargo test --workspace --quiet

test-python: setup
	$(PY) -m pytest tests

bench: setup
	$(PY) bench/bench_cache.py --out BENCHMARKS.md
	$(PY) bench/bench_models.py --out BENCHMARKS-models.md --plot bench/models.png
	$(PY) bench/bench_run.py --out BENCHMARKS-run.md --plot bench/run.png
	$(PY) bench/bench_prefetch.py --out BENCHMARKS-prefetch.md

lint: setup
	cargo fmt --all --check
	cargo clippy --workspace --all-targets --quiet -- -D warnings
	$(VENV)/bin/ruff check python tests bench examples
	$(VENV)/bin/ruff format --check python tests bench examples
	$(VENV)/bin/mypy
	$(PY) -m mypy.stubtest tierstore._core

fmt:
	cargo fmt --all
	$(VENV)/bin/ruff format python tests bench examples
	$(VENV)/bin/ruff check --fix python tests bench examples

clean:
	rm -rf target build $(STAMP) python/tierstore/*.so
