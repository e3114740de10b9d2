"""Nodes on one machine, for tests and benchmarks of the cluster cache: network namespaces joined by veth
pairs and a bridge, each with its own address, optionally with its link shaped by `tc tbf`.

Every process of a node runs under `ip netns exec NAME`; the file systems are this machine's, so a store
mounted once is seen by every node as a shared file system is. Needs root.
"""

from __future__ import annotations

import os
import secrets
import shutil
import subprocess
import time
from dataclasses import dataclass, field
from typing import ClassVar

from tierstore import _core


class NetnsError(_core.TierstoreError, RuntimeError):
    """The namespaces could not be set up; the message names the command and its error. A
    `TierstoreError`, as every error of tierstore's own is (and a RuntimeError, as it always was)."""


def _sh(*args: str) -> None:
    p = subprocess.run(args, capture_output=True, text=True, timeout=30)
    if p.returncode != 0:
        raise NetnsError(f"{' '.join(args)}: {p.stderr.strip()}")


@dataclass
class Node:
    """One node: its namespace, its address, and the link it reaches the bridge by."""

    name: str
    address: str
    link: str
    #: The other end of `link`, in this machine's namespace, on the bridge: where everything the node sends
    #: or receives can be watched.
    port: str = ""

    def cmd(self, *argv: str) -> list[str]:
        """`argv` run inside this node."""
        return ["ip", "netns", "exec", self.name, *argv]


@dataclass
class Nodes:
    """`count` nodes on one bridge, torn down by `close` (or as a context manager)."""

    count: int
    nodes: list[Node] = field(default_factory=list)
    tag: str = ""
    _made: ClassVar[int] = 0

    def __post_init__(self) -> None:
        if os.geteuid() != 0:
            raise NetnsError("network namespaces need root")
        Nodes._made += 1
        subnet = f"10.{77 + Nodes._made % 100}.{os.getpid() % 200}"
        self._claim_bridge()
        try:
            _sh("ip", "link", "set", self.bridge, "up")
            for i in range(self.count):
                ns, host, inside = f"ts{self.tag}n{i}", f"ts{self.tag}v{i}", f"ts{self.tag}p{i}"
                _sh("ip", "netns", "add", ns)
                self.nodes.append(Node(ns, f"{subnet}.{i + 1}", inside, host))
                _sh("ip", "link", "add", host, "type", "veth", "peer", "name", inside)
                _sh("ip", "link", "set", inside, "netns", ns)
                _sh("ip", "link", "set", host, "master", self.bridge)
                _sh("ip", "link", "set", host, "up")
                _sh("ip", "netns", "exec", ns, "ip", "addr", "add", f"{subnet}.{i + 1}/24", "dev", inside)
                _sh("ip", "netns", "exec", ns, "ip", "link", "set", inside, "up")
                _sh("ip", "netns", "exec", ns, "ip", "link", "set", "lo", "up")
        except BaseException:
            self.close()
            raise

    def _claim_bridge(self) -> None:
        """Makes the bridge under a tag no other set of nodes holds: another test run on this machine, or
        one killed before it closed, may hold any tag, and its bridge is not ours to take down. The tag
        names every link and namespace of the set, all within the kernel's 15 characters."""
        for _ in range(64):
            self.tag = f"{secrets.randbelow(100_000):05d}"
            self.bridge = f"tsbr{self.tag}"
            made = subprocess.run(
                ["ip", "link", "add", self.bridge, "type", "bridge"],
                capture_output=True,
                text=True,
                timeout=30,
            )
            if made.returncode == 0:
                return
            if "File exists" not in made.stderr:
                raise NetnsError(f"ip link add {self.bridge} type bridge: {made.stderr.strip()}")
        raise NetnsError(
            "no free bridge name after 64 tries: remove the stale tsbr* links (`ip -br link show type bridge`)"
        )

    def shape(self, rate: str = "1gbit") -> None:
        """Caps every node's outgoing traffic at `rate` with a token bucket (tc tbf)."""
        for n in self.nodes:
            _sh(*n.cmd("tc", "qdisc", "replace", "dev", n.link, "root", "tbf", "rate", rate,
                       "burst", "1mb", "latency", "50ms"))  # fmt: skip

    def unshape(self) -> None:
        """Removes the caps `shape` set."""
        for n in self.nodes:
            subprocess.run(n.cmd("tc", "qdisc", "del", "dev", n.link, "root"), capture_output=True)

    def link_down(self, i: int) -> None:
        """Takes node `i`'s link down (its peers see it vanish without a reset)."""
        _sh(*self.nodes[i].cmd("ip", "link", "set", self.nodes[i].link, "down"))

    def close(self) -> None:
        """Kills what still runs in the namespaces, and removes them and the bridge."""
        for n in self.nodes:
            pids = subprocess.run(
                ["ip", "netns", "pids", n.name], capture_output=True, text=True
            ).stdout.split()
            for pid in pids:
                subprocess.run(["kill", "-9", pid], capture_output=True)
            subprocess.run(["ip", "netns", "del", n.name], capture_output=True)
        for i in range(self.count):
            # Gone with its namespace, unless a process held the namespace a moment longer.
            subprocess.run(["ip", "link", "del", f"ts{self.tag}v{i}"], capture_output=True)
        subprocess.run(["ip", "link", "del", self.bridge], capture_output=True)
        self.nodes = []

    def __enter__(self) -> Nodes:
        return self

    def __exit__(self, *exc: object) -> None:
        self.close()


def start_redis(
    address: str, port: int, *, node: Node | None = None, timeout: float = 20.0
) -> subprocess.Popen[bytes]:
    """A redis-server of a test's or benchmark's own, without persistence, listening on `address:port`
    (inside `node` when given); returns once it answers a PING. Stop it with `kill()`.

    Raises:
        NetnsError: redis-server is missing or did not answer within `timeout` seconds.
    """
    if shutil.which("redis-server") is None or shutil.which("redis-cli") is None:
        raise NetnsError(
            "redis-server is not installed: `make setup` installs it (apt-get install redis-server)"
        )
    inside = node.cmd if node is not None else (lambda *argv: list(argv))
    argv = ["redis-server", "--port", str(port), "--bind", address, "--protected-mode", "no",
            "--save", "", "--appendonly", "no"]  # fmt: skip
    proc = subprocess.Popen(inside(*argv), stdout=subprocess.DEVNULL, cwd="/tmp")
    ping = inside("redis-cli", "-h", address, "-p", str(port), "ping")
    deadline = time.monotonic() + timeout
    while subprocess.run(ping, capture_output=True, text=True).stdout.strip() != "PONG":
        if proc.poll() is not None or time.monotonic() > deadline:
            proc.kill()
            proc.wait()
            raise NetnsError(
                f"redis-server on {address}:{port} did not start (exit status {proc.returncode})"
            )
        time.sleep(0.02)
    return proc
