# The commands the README names. `demo` and `test` set themselves up on a fresh machine.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := .stamps
RUST_SRC := $(shell find crates -name '*.rs' -o -name Cargo.toml) Cargo.toml pyproject.toml

.PHONY: setup demo test test-rust test-python bench lint fmt clean

setup: $(STAMP)/installed $(STAMP)/system

# System packages the tests and benchmarks need: fuse3 for the stand-in parallel file system (FUSE), a C
# compiler for the LD_PRELOAD test program, rsync for the tool conformance test (tests/test_tools.py),
# redis-server for the cluster registry's tests, iperf3 for the cluster benchmark's baseline. Installed
# with apt when missing and we are root (CI is).
SYSTEM_PACKAGES := fuse3 gcc rsync redis-server iperf3
$(STAMP)/system:
	@mkdir -p $(STAMP)
	@if ! command -v fusermount3 >/dev/null || ! command -v cc >/dev/null || ! command -v rsync >/dev/null \
		|| ! command -v redis-server >/dev/null || ! command -v iperf3 >/dev/null; then \
		if [ "$$(id -u)" = 0 ]; then \
			(export DEBIAN_FRONTEND=noninteractive; apt-get install -y -q $(SYSTEM_PACKAGES) || (apt-get update -q && apt-get install -y -q $(SYSTEM_PACKAGES))); \
		else \
			echo "tierstore: install $(SYSTEM_PACKAGES) (e.g. sudo apt-get install $(SYSTEM_PACKAGES)) for the tests" >&2; exit 1; \
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
	$(PY) bench/bench_s3.py --out BENCHMARKS-s3.md --plot bench/s3.png
	$(PY) bench/bench_revalidate.py --out BENCHMARKS-revalidate.md
	$(PY) bench/bench_order.py --out BENCHMARKS-order.md --plot bench/order.png
	$(PY) bench/bench_order.py --step-ms 80 --out BENCHMARKS-order-step80.md
	$(PY) bench/bench_stream.py --out BENCHMARKS-stream.md --plot bench/stream.png
	$(PY) bench/bench_stream.py --large 4GB --out BENCHMARKS-stream-4gb.md
	$(PY) bench/bench_writeback.py --no-dcp --out BENCHMARKS-writeback.md --plot bench/writeback.png
	$(PY) bench/bench_writeback.py --dcp-only --repeats 3 --out BENCHMARKS-writeback-dcp.md
	$(PY) bench/bench_schedule.py --out BENCHMARKS-schedule.md --plot bench/schedule.png
	@if [ "$$(id -u)" = 0 ]; then $(PY) bench/bench_cluster.py --out BENCHMARKS-cluster.md --plot bench/cluster.png; \
	else echo "bench_cluster.py skipped: network namespaces need root"; fi

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
