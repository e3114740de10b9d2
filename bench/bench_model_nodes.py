"""Benchmark of a model's start-up on four nodes (network namespaces, root only): how long until every node
has loaded it, and how many bytes the shared store served, with tierstore and with what users load with
today.

A model of `--size` (1 GiB by default: `--tensors` float16 tensors) is saved into a tierstore repository
and exported as one safetensors file, both on the stand-in shared store (`tierstore.testing.slowfs` with its
default latencies and a read bandwidth of `--bandwidth`). Four
nodes, each in its own network namespace with its own agent and tiers on /dev/shm, load it at the same
moment (each process imports first, then all start together); the time is from that start to the last
node's end. Each loader exits only once all have loaded (a node's exit is no part of its start-up, and here
it would take the cores the other nodes load on). Setups:

  tierstore           `Repository(path).load(name)`, the repository read through each node's cache (the
                      default cache, configured by TIERSTORE_* with cluster sharing inclusive): the pack is
                      fetched from the store by its owner and sent to the others by their agents
  tierstore, 1 node   the same job, one node loading while the other three only run their agents: the bar
                      for "all four as fast as one"
  tierstore-rehash    the four nodes' job with the manifest's pack hash ignored (as for a version saved
                      before packs' hashes were recorded): every tensor hashed again by the load
  repository direct   `Repository(path, cache=False).load(name)` on each node: every node reads the store
  safetensors         `safetensors.torch.load_file` of the exported file on each node
  runai streamer      Run:ai Model Streamer (`runai-model-streamer`), `SafetensorsStreamer.stream_file` of
                      the exported file (its file-system backend) on each node, every tensor taken

Each setup loads the whole model, then a partial load of `--partial` of its bytes (the first tensors,
named; `tensor_names=` for the streamer, `get_tensor` of each for safetensors). Each job starts with empty
tiers. One kernel serves all four namespaces: so that no node reads pages another node's read brought into
its page cache, each node reads the store through a mount of its own (`--direct-io`, each capped at a
quarter of `--bandwidth`: the store's bandwidth shared by four readers at once), except tierstore's nodes,
which share one mount capped at the whole `--bandwidth` (a cluster cache needs the source at one path on
every node, and only the pack's owner reads the store). The store's own
backing files stay in the page cache (it is not dropped, so that other work on the machine is not
disturbed): the store's speed is its bandwidth cap, not this VM's disk. A safetensors `load_file` maps the
file lazily, so each of its tensors has one byte of every page read, which is what bringing it in costs.

Targets (issue 27): four nodes loading one version read 1.00x its pack bytes from the store; all four
loaded in at most 1.3x the time one node takes alone, and faster than each node loading with safetensors or
the Run:ai streamer from the store. The exit status is 1 when one is missed.

    sudo .venv/bin/python bench/bench_model_nodes.py --out docs/benchmarks/model-nodes.md --plot docs/benchmarks/model-nodes.png
"""

from __future__ import annotations

import argparse
import contextlib
import functools
import hashlib
import json
import os
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from collections.abc import Callable, Iterator, Sequence
from dataclasses import dataclass
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent / "python"))

import page
from tierstore.testing.netns import Nodes
from tierstore.testing.slowfs import mounted
from tierstore.testing.slowfs import read_stats as store_stats

MiB, GiB = 1 << 20, 1 << 30
NODES = 4
NAME = "model"

# One process per node: imports, says "ready", waits for "go" on stdin, loads, prints what it did, and waits
# for "exit" before it exits (see `load_at_once`).
LOADER = r"""
import json, sys, time
setup, path, keys, mmap = sys.argv[1], sys.argv[2], json.loads(sys.argv[3]), sys.argv[4] == "mmap"
import torch
if setup in ("tierstore", "tierstore-rehash", "direct"):
    from tierstore.models import Repository
    repo = Repository(path, create=False, cache=None if setup.startswith("tierstore") else False)
    if setup == "tierstore-rehash":  # as a manifest written before packs' hashes were: every tensor hashed
        import tierstore.models.repository
        tierstore.models.repository._pack_hash = lambda m, pack: None
elif setup == "safetensors":
    from safetensors import safe_open
    from safetensors.torch import load_file
else:
    from runai_model_streamer import SafetensorsStreamer
print("ready", flush=True)
sys.stdin.readline()
start, cpu_start = time.time(), time.process_time()
nbytes = 0
if setup in ("tierstore", "tierstore-rehash", "direct"):
    got = repo.load("model", keys=keys, mmap=mmap)
    nbytes = sum(t.nbytes for t in got.values())
elif setup == "safetensors":
    if keys is None:
        got = load_file(path)
    else:
        with safe_open(path, framework="pt") as f:
            got = {k: f.get_tensor(k) for k in keys}
    for t in got.values():  # a mapped file is read when touched: one byte of every page
        t.view(-1).view(torch.uint8)[::4096].sum()
    nbytes = sum(t.nbytes for t in got.values())
else:
    with SafetensorsStreamer() as s:
        s.stream_file(path, tensor_names=keys)
        for name, t in s.get_tensors():
            nbytes += t.nbytes
end, cpu = time.time(), time.process_time() - cpu_start
stats, vouched = None, 0
if setup.startswith("tierstore"):
    import tierstore
    stats = tierstore.default_cache().stats()["source"]
    vouched = repo._packs.vouched  # packs whose tensors were not hashed again (see Packs.read)
with open("/proc/self/io") as f:
    io = {k: int(v) for k, v in (line.split(": ") for line in f)}
print(json.dumps({"start": start, "end": end, "cpu": cpu, "bytes": nbytes, "stats": stats,
                  "vouched": vouched, "written": io["wchar"], "read": io["rchar"]}), flush=True)
sys.stdin.readline()
"""


@dataclass
class Model:
    pack_bytes: int
    names: list[str]
    nbytes: dict[str, int]


def make_model(backing: Path, size: int, tensors: int) -> Model:
    import torch

    from tierstore.models import Repository

    each = size // tensors // 2  # float16
    g = torch.Generator().manual_seed(0)
    state = {
        f"layers.{i:03d}.weight": torch.randint(-30000, 30000, (each,), dtype=torch.int16, generator=g).view(
            torch.float16
        )
        for i in range(tensors)
    }
    repo = Repository(backing / "repo", cache=False)
    repo.save(NAME, state)
    repo.export(NAME, "latest", backing / "model.safetensors")
    pack_bytes = sum(p.stat().st_size for p in (backing / "repo" / "packs").iterdir())
    return Model(
        pack_bytes,
        list(state),
        {k: v.nbytes for k, v in state.items()},
    )


def rate(bandwidth: str, share: int) -> str:
    """`bandwidth` ("500MiB/s") divided among `share` readers, in bytes per second."""
    from tierstore.testing.slowfs import parse_rate

    return f"{int(parse_rate(bandwidth) / share)}B/s"


def partial_keys(model: Model, share: float) -> list[str]:
    """The first tensors, in order, that hold about `share` of the model's bytes."""
    total, chosen, acc = sum(model.nbytes.values()), [], 0
    for k in model.names:
        if acc >= share * total:
            break
        chosen.append(k)
        acc += model.nbytes[k]
    return chosen


def node_env(work: Path, i: int, addresses: list[str], source: Path, token: Path) -> dict[str, str]:
    runtime = work / f"run{i}"
    runtime.mkdir(parents=True, exist_ok=True)
    return {
        **os.environ,
        "XDG_RUNTIME_DIR": str(runtime),
        "TIERSTORE_SOURCE": str(source),
        "TIERSTORE_TIERS": f"{work / 'shm' / f'tier{i}'}:4G",
        "TIERSTORE_SHARING": "inclusive",
        "TIERSTORE_PEERS": ",".join(addresses),
        "TIERSTORE_NODE": addresses[i],
        "TIERSTORE_LISTEN": addresses[i],
        "TIERSTORE_TOKEN_FILE": str(token),
    }


@contextlib.contextmanager
def agents(nodes: Nodes, envs: list[dict[str, str]]) -> Iterator[None]:
    for n, env in zip(nodes.nodes, envs, strict=True):
        p = subprocess.run(n.cmd(sys.executable, "-m", "tierstore.cli", "agent", "start"), env=env,
                           capture_output=True, text=True, timeout=60)  # fmt: skip
        if p.returncode != 0:
            raise RuntimeError(f"agent on {n.name}: {p.stderr}")
    try:
        yield
    finally:
        for n, env in zip(nodes.nodes, envs, strict=True):
            subprocess.run(n.cmd(sys.executable, "-m", "tierstore.cli", "agent", "stop"), env=env,
                           capture_output=True, timeout=60)  # fmt: skip


def load_at_once(
    nodes: Nodes,
    envs: list[dict[str, str]],
    which: list[int],
    setup: str,
    paths: list[Path],
    keys: list[str] | None,
    mode: str,
) -> tuple[list[dict[str, Any]], float, float]:
    """Starts a loader on each node of `which` (node i loads `paths[i]`), lets them all go at once, and
    returns what each reported, with the machine's busy CPU core-seconds and the wall-clock seconds from
    the go to the last loader's report (their imports and start-up left out).

    The loaders exit only once every one has reported. A node's exit is no part of a start-up (a real
    replica goes on to serve), and these nodes share one machine's two cores: a loader done early used to
    exit while the others still loaded, and the interpreter's last collection of a process holding torch
    took about 0.3 core-seconds each, on the cores the others were loading on (`perf` of the window:
    Python's `gc_collect_main` at 15.6% of the 4 nodes' busy time, every sample in an exiting loader)."""
    procs = [
        subprocess.Popen(
            nodes.nodes[i].cmd(sys.executable, "-c", LOADER, setup, str(paths[i]), json.dumps(keys), mode),
            env=envs[i],
            stdin=subprocess.PIPE,
            stdout=subprocess.PIPE,
            stderr=subprocess.PIPE,
            text=True,
        )
        for i in which
    ]
    for p in procs:
        assert p.stdout is not None
        line = p.stdout.readline()
        if line.strip() != "ready":
            raise RuntimeError(f"{setup} loader failed to start: {line}{p.communicate()[1][-3000:]}")
    busy, start = cpu_busy(), time.monotonic()
    for p in procs:
        assert p.stdin is not None
        p.stdin.write("go\n")
        p.stdin.flush()
    out = []
    try:
        for p in procs:
            assert p.stdout is not None
            line = p.stdout.readline()  # its report; it waits for "exit"
            if not line.strip():
                raise RuntimeError(f"{setup} loader failed: {p.communicate(timeout=60)[1][-3000:]}")
            out.append(json.loads(line))
    except BaseException:
        for p in procs:  # the others wait for "exit"
            p.kill()
            p.wait()
        raise
    busy, seconds, end = cpu_busy() - busy, time.monotonic() - start, time.monotonic()
    for p in procs:
        _, stderr = p.communicate("exit\n", timeout=600)
        if p.returncode != 0:
            raise RuntimeError(f"{setup} loader failed: {stderr[-3000:]}")
    # The window on CLOCK_MONOTONIC, for a profile taken with `perf record -k CLOCK_MONOTONIC`.
    print(f"{setup}: the loads ran from {start:.3f} to {end:.3f} (CLOCK_MONOTONIC)", flush=True)
    return out, busy, seconds


def job(
    work: Path,
    nodes: Nodes,
    mounts: list[Path],
    model: Model,
    setup: str,
    keys: list[str] | None,
    alone: bool,
    mode: str,
) -> dict[str, Any]:
    """One job: empty tiers, then the loads; the time to the last node's end and the store's bytes.

    Tierstore's nodes share one mount of the store (a cluster cache needs the source at the same path on
    every node; only the owner of the pack reads it); the other setups read through a mount of each node's
    own, capped at a quarter of the store's bandwidth, so that no node reads pages another brought into
    the one kernel's page cache."""
    shutil.rmtree(work / "shm", ignore_errors=True)
    (work / "shm").mkdir()
    addresses = [n.address for n in nodes.nodes]
    envs = [node_env(work, i, addresses, mounts[0], work / "token") for i in range(NODES)]
    cached = setup.startswith("tierstore")
    name = "repo" if cached or setup == "direct" else "model.safetensors"
    paths = [(mounts[0] if cached else m) / name for m in mounts[1:]]
    which = [0] if alone else list(range(NODES))
    with agents(nodes, envs) if cached else contextlib.nullcontext():
        before = [store_stats(m).get("bytes_read", 0) for m in mounts]
        reports, busy, window = load_at_once(nodes, envs, which, setup, paths, keys, mode)
        after = [store_stats(m).get("bytes_read", 0) for m in mounts]
    want = sum(model.nbytes[k] for k in (keys if keys is not None else model.names))
    if any(r["bytes"] != want for r in reports):
        raise RuntimeError(f"{setup}: a node loaded {[r['bytes'] for r in reports]} bytes, not {want}")
    return {
        "setup": label(setup, alone),
        "partial": keys is not None,
        "seconds": max(r["end"] for r in reports) - min(r["start"] for r in reports),
        "per_node": [r["end"] - r["start"] for r in reports],
        "store_bytes": sum(after) - sum(before),
        "peer_bytes": sum((r["stats"] or {}).get("peer_bytes", 0) for r in reports),
        "loaded": want,
        # The whole machine's, from the go to the last loader's report; and the loaders' own, go to end.
        "cpu_seconds": busy,
        "loader_cpu_seconds": sum(r["cpu"] for r in reports),
        # Each loader's bytes through read and write calls (/proc/self/io), its whole life.
        "loader_written": [r["written"] for r in reports],
        "loader_read": [r["read"] for r in reports],
        # The loaders whose pack was hashed once, by the cache as it arrived (see `Packs.read`).
        "hashed_once": sum(r["vouched"] for r in reports),
        "cpu_share": busy / (window * (os.cpu_count() or 1)),
    }


def cpu_busy() -> float:
    """Core-seconds the machine's CPUs have spent busy since boot (all but idle and iowait, /proc/stat)."""
    with open("/proc/stat") as f:
        fields = [int(x) for x in f.readline().split()[1:]]
    idle = fields[3] + fields[4]
    return (sum(fields[:8]) - idle) / os.sysconf("SC_CLK_TCK")


def label(setup: str, alone: bool) -> str:
    return setup + (", 1 node" if alone else "")


def attempt(run: Callable[[], dict[str, Any]], setup: str, partial: bool) -> dict[str, Any]:
    """`run()`, one job of `setup`, tried once more if a loader fails (the Run:ai streamer's partial loads
    through FUSE end in "File access error" under four concurrent readers, now and then or every time); the
    failures are reported, and a setup that fails twice is left out of its comparison (seconds None)."""
    failed = ""
    for _ in range(2):
        try:
            return {**run(), "failed": failed}
        except RuntimeError as e:
            print(f"{setup}: {e}", flush=True)
            failed = f"twice: {failed}" if failed else str(e).strip().splitlines()[-1][:200]
    return {"setup": setup, "partial": partial, "seconds": None, "failed": failed}


SETUPS = [
    ("tierstore", True),
    ("tierstore", False),
    ("tierstore-rehash", False),
    ("direct", False),
    ("safetensors", False),
    ("runai", False),
]


def run(a: argparse.Namespace) -> tuple[list[dict[str, Any]], Model]:
    work = Path(tempfile.mkdtemp(prefix="ts-bench-model-nodes-", dir="/dev/shm"))
    disk = Path(tempfile.mkdtemp(prefix="ts-bench-model-nodes-", dir="/var/tmp"))
    rows: list[dict[str, Any]] = []
    try:
        token = work / "token"
        token.write_text(hashlib.sha256(str(work).encode()).hexdigest())
        token.chmod(0o600)
        backing = disk / "store"
        backing.mkdir()
        print(f"saving a {a.size / GiB:.2f} GiB model of {a.tensors} tensors", flush=True)
        model = make_model(backing, a.size, a.tensors)
        keys = partial_keys(model, a.partial)
        with contextlib.ExitStack() as stack:
            # mounts[0]: tierstore's, the whole bandwidth; mounts[1:]: one per node for the others, a
            # quarter each (node 0 of the other setups reads through mounts[NODES])
            mounts = [
                stack.enter_context(
                    mounted(
                        backing,
                        disk / f"mnt{i}",
                        bandwidth=rate(a.bandwidth, 1 if i == 0 else NODES),
                        direct_io=True,
                    )
                )
                for i in range(NODES + 1)
            ]
            with Nodes(NODES) as nodes:
                for r in range(a.rounds):
                    chosen = [(setup, alone) for setup, alone in SETUPS if setup in a.setups]
                    order = chosen if r % 2 == 0 else chosen[::-1]
                    for partial in (False, True):
                        for setup, alone in order:
                            if partial and setup == "tierstore-rehash":
                                continue  # a partial load of an uncached pack reads parts, hashed alike
                            run = functools.partial(
                                job,
                                work,
                                nodes,
                                mounts,
                                model,
                                setup,
                                keys if partial else None,
                                alone,
                                a.mode,
                            )
                            row = attempt(run, label(setup, alone), partial)
                            row["round"] = r
                            rows.append(row)
                            print(f"round {r}: {row}", flush=True)
        return rows, model
    finally:
        shutil.rmtree(work, ignore_errors=True)
        shutil.rmtree(disk, ignore_errors=True)


def summary(rows: list[dict[str, Any]]) -> dict[tuple[str, bool], dict[str, float]]:
    out: dict[tuple[str, bool], dict[str, float]] = {}
    for key in {(r["setup"], r["partial"]) for r in rows if r["seconds"] is not None}:
        these = [r for r in rows if (r["setup"], r["partial"]) == key and r["seconds"] is not None]
        out[key] = {
            "seconds": statistics.median(r["seconds"] for r in these),
            "store_bytes": statistics.median(r["store_bytes"] for r in these),
            "peer_bytes": statistics.median(r["peer_bytes"] for r in these),
            "cpu_seconds": statistics.median(r.get("cpu_seconds", float("nan")) for r in these),
            "cpu_share": statistics.median(r.get("cpu_share", float("nan")) for r in these),
            "loader_cpu_seconds": statistics.median(r.get("loader_cpu_seconds", float("nan")) for r in these),
            "loaded": these[0]["loaded"],
        }
    return out


LABELS = {
    "tierstore": "tierstore (through the cache)",
    "tierstore, 1 node": "tierstore, one node alone",
    "tierstore-rehash": "tierstore, every tensor hashed again (no pack hash in the manifest)",
    "direct": "repository read directly",
    "safetensors": "safetensors `load_file`",
    "runai": "Run:ai Model Streamer",
}


def report(
    rows: list[dict[str, Any]], model: Model, a: argparse.Namespace, argv: list[str], started: float
) -> tuple[str, bool]:
    s = summary(rows)
    ok = True
    command = f"sudo .venv/bin/python bench/bench_model_nodes.py {' '.join(argv)}".rstrip()
    lines = [
        "# Model start-up on four nodes",
        "",
        f"Command: `{command}` ({time.strftime('%Y-%m-%d %H:%M UTC', time.gmtime(started))}, {time.time() - started:.0f} s)",
        "",
        "Load average at the end: {:.2f}, {:.2f}, {:.2f} (1, 5, 15 min); the machine is shared, and the CPU "
        "columns count all of its work.".format(*os.getloadavg()),
        "",
        f"Machine: {platform.node()}, {os.cpu_count()} cores, Linux {platform.release()}. Four network "
        f"namespaces on one bridge (unshaped veth), one kernel. The model: {len(model.names)} float16 tensors, "
        f"{sum(model.nbytes.values()) / GiB:.2f} GiB ({model.pack_bytes / GiB:.2f} GiB of pack), in a tierstore "
        f"repository and as one safetensors file on the stand-in store (read bandwidth {a.bandwidth}; mounted with "
        f"--direct-io, one mount a node capped at a quarter of it for the setups where each node reads the store, "
        f"one shared by tierstore's nodes with the whole of it). {a.rounds} round(s), setups alternated; the tables give "
        "medians, the targets each round's paired ratio (PASS: met in every round; FAIL: in none; UNDECIDED: "
        "the rounds straddle it). Time: from the common start to the "
        "last node's end. Partial: the first tensors, "
        f"{a.partial:.0%} of the bytes. Every job starts with empty tiers. Repository loads "
        f"{'map the pack (mmap=True, the default)' if a.mode == 'mmap' else 'copy the tensors out (mmap=False)'}.",
        "",
    ]
    for partial in (False, True):
        base = s.get(("tierstore, 1 node", partial))
        lines += [
            f"## {'Partial' if partial else 'Full'} load",
            "",
            "| setup | all 4 loaded (s) | vs tierstore | store bytes / loaded bytes x4 | peer bytes (GiB) "
            f"| CPU busy (core-s) | of the {os.cpu_count()} cores | the loaders' own CPU (core-s) |",
            "| --- | --- | --- | --- | --- | --- | --- | --- |",
        ]
        ours = s.get(("tierstore", partial))
        for setup in LABELS:
            v = s.get((setup, partial))
            if v is None:
                continue
            nodes = 1 if setup.endswith("1 node") else NODES
            ratio = v["seconds"] / ours["seconds"] if ours else float("nan")
            lines.append(
                f"| {LABELS[setup]} | {v['seconds']:.2f} | {ratio:.2f}x | "
                f"{v['store_bytes'] / (v['loaded'] * nodes):.3f} ({v['store_bytes'] / GiB:.2f} GiB) | "
                f"{v['peer_bytes'] / GiB:.2f} | {v['cpu_seconds']:.1f} | "
                f"{v['cpu_share']:.0%} | {v['loader_cpu_seconds']:.1f} |"
            )
        lines.append("")
        if ours and base:
            # Every target from each round's jobs: round r's tierstore job against round r's others.
            def per_round(setup: str, partial: bool = partial) -> dict[int, dict[str, Any]]:
                return {r["round"]: r for r in rows
                        if (r["setup"], r["partial"]) == (setup, partial) and r["seconds"] is not None}  # fmt: skip

            mine, alone = per_round("tierstore"), per_round("tierstore, 1 node")
            checks: list[tuple[str, bool | None]] = []
            if not partial:
                store = [mine[i]["store_bytes"] / model.pack_bytes for i in sorted(mine)]
                what = "the pack bytes (target 1.00x)"
            else:
                store = [mine[i]["store_bytes"] / mine[i]["loaded"] for i in sorted(mine)]
                what = "the bytes loaded (target 1.00x: their blocks only)"
            each = ", ".join(f"{x:.3f}" for x in store)
            checks.append((f"store bytes {statistics.median(store):.3f}x (rounds {each}) {what}",
                           all(x <= 1.01 for x in store)))  # fmt: skip
            both = sorted(set(mine) & set(alone))
            scale = [mine[i]["seconds"] / alone[i]["seconds"] for i in both]
            checks.append((f"4 nodes in {page.rounds(scale)} one node's time (target <= 1.3x)",
                           page.met([1 / x for x in scale], 1 / 1.3)))  # fmt: skip
            rehash = per_round("tierstore-rehash")
            paired = sorted(set(mine) & set(rehash))
            if paired and not partial:
                # The pack's hash in the manifest against none, paired: the loaders' own CPU (not noisy) and
                # the time.
                cpu = [mine[i]["loader_cpu_seconds"] / rehash[i]["loader_cpu_seconds"] for i in paired]
                speed = [rehash[i]["seconds"] / mine[i]["seconds"] for i in paired]
                once = [f"{mine[i]['hashed_once']}/{NODES}" for i in paired]
                checks.append(
                    (
                        f"each pack hashed once (loads that did: {', '.join(once)}): the loaders' own CPU "
                        f"{page.rounds(cpu)} that of loads hashing every tensor again; {page.rounds(speed)} faster",
                        page.met([1 / x for x in cpu], 1.0),
                    )
                )
            for other in ("safetensors", "runai"):
                theirs = per_round(other)
                paired = sorted(set(mine) & set(theirs))
                if paired:
                    speed = [theirs[i]["seconds"] / mine[i]["seconds"] for i in paired]
                    cpu = [theirs[i]["cpu_seconds"] / mine[i]["cpu_seconds"] for i in paired]
                    checks.append(
                        (
                            f"{page.rounds(speed)} faster than {LABELS[other]} (the machine's busy core-seconds, "
                            f"its job's over tierstore's: {page.rounds(cpu)})",
                            page.met(speed, 1.0),
                        )
                    )
            for text, met in checks:
                ok &= met is not False
                lines.append(f"- {({True: 'PASS', False: 'FAIL', None: 'UNDECIDED'})[met]}: {text}")
            lines.append("")
    lines += ["## Every job", "", "| round | setup | partial | seconds | per node (s) | store GiB | peer GiB "
              "| CPU busy (core-s) | the loaders' own | loads that hashed the pack once |",
              "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |"]  # fmt: skip
    for r in rows:
        if r["seconds"] is None:
            continue  # listed below
        lines.append(
            f"| {r['round']} | {r['setup']} | {'yes' if r['partial'] else 'no'} | {r['seconds']:.2f} | "
            f"{', '.join(f'{x:.2f}' for x in r['per_node'])} | {r['store_bytes'] / GiB:.3f} | {r['peer_bytes'] / GiB:.3f} | "
            f"{r['cpu_seconds']:.2f} | {r['loader_cpu_seconds']:.2f} | "
            f"{r.get('hashed_once', 0)} of {len(r['per_node'])} |"
        )
    failures = [r for r in rows if r["failed"]]
    if failures:
        lines += [
            "",
            'Jobs whose loader failed (each tried once more; "twice" means left out of its comparison):',
            "",
        ]
        lines += [
            f"- round {r['round']}, {r['setup']}{' (partial)' if r['partial'] else ''}: {r['failed']}"
            for r in failures
        ]
    return "\n".join(lines) + "\n", ok


def plot(rows: list[dict[str, Any]], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    s = summary(rows)
    setups = [k for k in LABELS if (k, False) in s]
    fig, axes = plt.subplots(1, 2, figsize=(11, 4))
    for ax, what, title in ((axes[0], "seconds", "time until all nodes loaded (s)"),
                            (axes[1], "store_bytes", "bytes read from the store (GiB)")):  # fmt: skip
        for j, partial in enumerate((False, True)):
            vals = [
                s[(k, partial)][what] / (GiB if what == "store_bytes" else 1) if (k, partial) in s else 0.0
                for k in setups
            ]
            ax.bar([i + 0.4 * j - 0.2 for i in range(len(setups))], vals, 0.4,
                   label="partial load" if partial else "full load")  # fmt: skip
        ax.set_xticks(range(len(setups)), [LABELS[k].replace(" (", "\n(") for k in setups], fontsize=7)
        ax.set_title(title)
        ax.legend()
    fig.tight_layout()
    fig.savefig(path, dpi=100)


def main(argv: Sequence[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--size", type=lambda t: int(float(t.rstrip("GgMm")) * (GiB if t[-1] in "Gg" else MiB)),
                    default="1G", help="model size, e.g. 1G or 512M")  # fmt: skip
    ap.add_argument("--tensors", type=int, default=64)
    ap.add_argument("--partial", type=float, default=0.15, help="share of the bytes a partial load reads")
    ap.add_argument("--bandwidth", default="500MiB/s", help="the store's read bandwidth cap")
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--setups", type=lambda t: t.split(","),
                    default=["tierstore", "tierstore-rehash", "direct", "safetensors", "runai"],
                    help="the setups to run, comma-separated (a quick check of one: --setups tierstore)")  # fmt: skip
    ap.add_argument("--mode", choices=["mmap", "copy"], default="mmap",
                    help="how tierstore and the repository read directly load: mapped (the default of "
                    "Repository.load) or copied out (mmap=False, as a load onto a GPU)")  # fmt: skip
    ap.add_argument("--out", type=Path)
    ap.add_argument("--plot", type=Path)
    a = ap.parse_args(argv)
    if os.geteuid() != 0:
        print("bench_model_nodes.py needs root for network namespaces", file=sys.stderr)
        return 2
    started = time.time()
    rows, model = run(a)
    text, ok = report(rows, model, a, list(argv if argv is not None else sys.argv[1:]), started)
    if a.out and a.plot:
        text += f"\n![start-up of four nodes]({os.path.relpath(a.plot, a.out.parent)})\n"
    print(text)
    if a.out:
        a.out.write_text(text)
    if a.plot:
        plot(rows, a.plot)
    return 0 if ok else 1


if __name__ == "__main__":
    sys.exit(main())
