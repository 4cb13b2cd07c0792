"""A private network of hosts on one machine: one network namespace per host, all on one bridge.

``NetLab()`` makes a switch namespace holding a bridge; ``lab.add_host(name)``
makes a namespace for one host, links its ``eth0`` (a veth pair) to a port of
the bridge and gives it the next address of ``SUBNET`` (a /24 that exists
only inside the lab's namespaces: nothing is added to the machine's own
network namespace, so labs of concurrent test runs never meet). Processes
run in a host with ``host.argv(command)`` (``ip netns exec``, which keeps the
process id); code of this process runs there with ``host.call(fn)`` (a
thread that entered the namespace with ``setns``: every socket it opens
belongs to that host). ``lab.close()`` kills whatever still runs in the
lab's namespaces and deletes them; a lab whose creator died is removed by
the next ``NetLab``.

``unavailable_reason()`` says why a lab cannot be made here (not root, a tool
missing, namespaces refused), or None.

The faults a host's network can suffer live in ``testing.netfaults``.
"""

from __future__ import annotations

import ctypes
import itertools
import os
import shutil
import signal
import subprocess
import threading
from collections.abc import Callable, Sequence
from concurrent.futures import Future
from dataclasses import dataclass, field
from pathlib import Path
from typing import TypeVar

T = TypeVar("T")

SUBNET = "10.213.7"
"""The lab's /24; the switch has no address, hosts get .10, .11, ..."""
NETNS_DIR = Path("/run/netns")
LAB_PREFIX = "kvlab"
REQUIRED_TOOLS = {"ip": "iproute2", "nft": "nftables", "tc": "iproute2", "nsenter": "util-linux"}
CLONE_NEWNET = 0x40000000
_labs = itertools.count()


class LabError(RuntimeError):
    """A namespace command failed; the message has the command and its stderr."""


def sh(*argv: str, check: bool = True, timeout: float = 30.0) -> subprocess.CompletedProcess[str]:
    """Run a command of the machine (``ip``, ``nft``, ``tc``...); ``LabError`` naming it when it fails."""
    done = subprocess.run(argv, capture_output=True, text=True, timeout=timeout)
    if check and done.returncode != 0:
        raise LabError(f"{' '.join(argv)} exited with {done.returncode}: {done.stderr.strip()}")
    return done


def unavailable_reason() -> str | None:
    """Why network namespaces cannot be made here, or None when they can."""
    if os.geteuid() != 0:
        return "network namespace tests need root (CI runs them as root through .ci/run)"
    for tool, package in REQUIRED_TOOLS.items():
        if shutil.which(tool) is None:
            return f"'{tool}' is missing: apt-get install {package} (.ci/run installs it)"
    probe = f"{LAB_PREFIX}-probe-{os.getpid()}"
    try:
        sh("ip", "netns", "add", probe)
    except LabError as exc:
        return f"this machine refuses network namespaces: {exc}"
    sh("ip", "netns", "del", probe, check=False)
    return None


def enter_netns(netns: str) -> None:
    """Move the calling thread into network namespace ``netns`` (sockets it opens from now on live there)."""
    libc = ctypes.CDLL(None, use_errno=True)
    fd = os.open(NETNS_DIR / netns, os.O_RDONLY)
    try:
        if libc.setns(fd, CLONE_NEWNET) != 0:
            err = ctypes.get_errno()
            raise LabError(f"setns into {netns} failed: {os.strerror(err)}")
    finally:
        os.close(fd)


def call_in_netns(netns: str, fn: Callable[[], T], timeout: float | None = 120.0) -> T:
    """``fn()`` run on a fresh thread inside ``netns``; its result, or its exception re-raised here."""
    done: Future[T] = Future()

    def body() -> None:
        try:
            enter_netns(netns)
            done.set_result(fn())
        except BaseException as exc:  # noqa: BLE001 - handed to the caller
            done.set_exception(exc)

    threading.Thread(target=body, name=f"in-{netns}", daemon=True).start()
    return done.result(timeout)


def start_in_netns(netns: str, fn: Callable[[], object], name: str) -> threading.Thread:
    """A started daemon thread that enters ``netns`` and then runs ``fn``."""

    def body() -> None:
        enter_netns(netns)
        fn()

    thread = threading.Thread(target=body, name=name, daemon=True)
    thread.start()
    return thread


@dataclass
class Host:
    """One host of a lab: its namespace, its address, and the bridge port its cable plugs into."""

    lab: NetLab
    name: str
    netns: str
    ip: str
    port: str
    """The veth end in the switch namespace (``ip -n SWITCH link set PORT down`` pulls the cable)."""

    def argv(self, command: Sequence[str]) -> list[str]:
        """``command`` run inside this host (``ip netns exec`` execs it: the process id stays the command's)."""
        return ["ip", "netns", "exec", self.netns, *command]

    def sh(self, *argv: str, check: bool = True) -> subprocess.CompletedProcess[str]:
        return sh(*self.argv(argv), check=check)

    def call(self, fn: Callable[[], T], timeout: float | None = 120.0) -> T:
        """``fn()`` on a thread inside this host's namespace."""
        return call_in_netns(self.netns, fn, timeout)

    def pids(self) -> list[int]:
        out = sh("ip", "netns", "pids", self.netns, check=False).stdout
        return [int(p) for p in out.split()]


@dataclass
class NetLab:
    """The switch namespace with its bridge, and the hosts plugged into it."""

    tag: str = field(default_factory=lambda: f"{os.getpid()}-{next(_labs)}")
    hosts: dict[str, Host] = field(default_factory=dict)

    def __post_init__(self) -> None:
        remove_orphan_labs()
        self.prefix = f"{LAB_PREFIX}-{self.tag}"
        self.switch = f"{self.prefix}-switch"
        sh("ip", "netns", "add", self.switch)
        sh("ip", "-n", self.switch, "link", "add", "br0", "type", "bridge")
        sh("ip", "-n", self.switch, "link", "set", "br0", "up")

    def add_host(self, name: str) -> Host:
        """A new host on the bridge, with the next address of ``SUBNET``."""
        if name in self.hosts:
            raise ValueError(f"the lab already has a host named {name!r}")
        index = len(self.hosts)
        netns, port, ip = f"{self.prefix}-{name}", f"p{index}", f"{SUBNET}.{10 + index}"
        sh("ip", "netns", "add", netns)
        sh("ip", "-n", self.switch, "link", "add", port, "type", "veth", "peer", "name", "eth0", "netns", netns)
        sh("ip", "-n", self.switch, "link", "set", port, "master", "br0", "up")
        sh("ip", "-n", netns, "addr", "add", f"{ip}/24", "dev", "eth0")
        sh("ip", "-n", netns, "link", "set", "eth0", "up")
        sh("ip", "-n", netns, "link", "set", "lo", "up")
        host = self.hosts[name] = Host(self, name, netns, ip, port)
        return host

    def close(self) -> None:
        """Kill every process left in the lab's hosts, then delete their namespaces and the switch."""
        remove_lab(self.prefix)


def _lab_namespaces(prefix: str) -> list[str]:
    if not NETNS_DIR.is_dir():
        return []
    return sorted(p.name for p in NETNS_DIR.iterdir() if p.name.startswith(prefix + "-"))


def remove_lab(prefix: str) -> None:
    """Kill the processes of every namespace named ``prefix-*`` and delete those namespaces."""
    names = _lab_namespaces(prefix)
    for name in names:
        for pid in sh("ip", "netns", "pids", name, check=False).stdout.split():
            try:
                os.kill(int(pid), signal.SIGKILL)
            except ProcessLookupError:
                pass
    for name in names:
        sh("ip", "netns", "del", name, check=False)


def remove_orphan_labs() -> None:
    """Remove the labs whose creating process is gone (a test run that was killed)."""
    tags = {name.split("-")[1] for name in _lab_namespaces(LAB_PREFIX) if name.count("-") >= 3}
    for pid in tags:
        if pid.isdigit() and not Path(f"/proc/{pid}").exists():
            for prefix in {"-".join(n.split("-")[:3]) for n in _lab_namespaces(f"{LAB_PREFIX}-{pid}")}:
                remove_lab(prefix)
