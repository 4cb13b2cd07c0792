"""Network and disk faults of one lab host, made with the machine's standard tools, and their healing.

All of them act inside the namespaces of a ``testing.netns`` lab only:

- ``drop_random(host, percent)``: every packet in or out of ``host`` is lost
  with that probability (nftables ``numgen random mod 100 < N drop``; this
  kernel has no ``netem``);
- ``partition(src, dst)``: packets from ``src`` to ``dst`` are dropped (an
  nftables rule in ``src``'s output hook): a directed partition, the other
  direction still flows;
- ``blackhole(src, dst)``: ``src`` routes ``dst`` into a blackhole route
  (another directed partition, made by routing rather than filtering);
- ``limit_rate(host, rate)``: ``host``'s egress shaped by a token bucket
  (``tc qdisc ... tbf``);
- ``cable(host, up)``: the host's bridge port set down or up (the cable pulled
  or plugged back);
- ``fill_disk(pid, directory)`` / ``free_disk``: the file system of
  ``directory`` as process ``pid`` sees it (its mount namespace) filled to the
  last byte, then freed;
- ``heal(host)`` removes every network fault of ``host`` (its nftables table,
  blackhole routes and shaping) and plugs its cable back.

Delay, jitter and reordering come from ``testing.tcp_proxy`` between hosts.
"""

from __future__ import annotations

from kvrelay.testing.netns import Host, sh

TABLE = "kvlab_faults"
FILL_NAME = ".kvlab-fill"


def _ensure_table(host: Host) -> None:
    """The host's fault table with an input and an output chain (made once, flushed by ``heal``)."""
    if host.sh("nft", "list", "table", "inet", TABLE, check=False).returncode == 0:
        return
    host.sh("nft", "add", "table", "inet", TABLE)
    for chain, hook in (("in", "input"), ("out", "output")):
        host.sh("nft", "add", "chain", "inet", TABLE, chain, f"{{ type filter hook {hook} priority 0 ; }}")


def drop_random(host: Host, percent: int) -> None:
    """Lose ``percent`` % of the packets ``host`` sends or receives on its cable (each drawn at random)."""
    if not 0 < percent < 100:
        raise ValueError(f"loss must be between 1 and 99 %, got {percent}")
    _ensure_table(host)
    for chain, direction in (("in", "iifname"), ("out", "oifname")):
        rule = [direction, "eth0", "numgen", "random", "mod", "100", "<", str(percent), "counter", "drop"]
        host.sh("nft", "add", "rule", "inet", TABLE, chain, *rule)


def partition(src: Host, dst: Host) -> None:
    """Drop every packet ``src`` sends to ``dst`` (``dst`` -> ``src`` still flows)."""
    _ensure_table(src)
    src.sh("nft", "add", "rule", "inet", TABLE, "out", "ip", "daddr", dst.ip, "counter", "drop")


def blackhole(src: Host, dst: Host) -> None:
    """Route ``src``'s packets for ``dst`` into a blackhole."""
    src.sh("ip", "route", "replace", "blackhole", f"{dst.ip}/32")


def limit_rate(host: Host, rate: str, burst: str = "16kb", latency: str = "200ms") -> None:
    """Shape ``host``'s egress to ``rate`` (tc syntax: ``1mbit``) with a token bucket."""
    host.sh("tc", "qdisc", "replace", "dev", "eth0", "root", "tbf", "rate", rate, "burst", burst, "latency", latency)


def cable(host: Host, up: bool) -> None:
    """Set ``host``'s bridge port down (the cable pulled) or up."""
    sh("ip", "-n", host.lab.switch, "link", "set", host.port, "up" if up else "down")


def dropped_packets(host: Host) -> int:
    """Packets the host's fault rules have dropped so far (their nftables counters)."""
    listing = host.sh("nft", "list", "table", "inet", TABLE, check=False).stdout
    words = listing.split()
    return sum(int(words[i + 1]) for i, w in enumerate(words) if w == "packets" and i + 1 < len(words))


def heal(host: Host) -> None:
    """Undo every network fault of ``host``: rules, blackhole routes, shaping, the cable."""
    host.sh("nft", "delete", "table", "inet", TABLE, check=False)
    routes = host.sh("ip", "route", "show", "type", "blackhole").stdout.split("\n")
    for route in filter(None, (r.split()[1] if len(r.split()) > 1 else "" for r in routes)):
        host.sh("ip", "route", "del", "blackhole", route, check=False)
    host.sh("tc", "qdisc", "del", "dev", "eth0", "root", check=False)
    cable(host, True)


def fill_disk(pid: int, directory: str) -> None:
    """Fill the file system holding ``directory``, as process ``pid``'s mount namespace sees it, to the last byte."""
    path = f"{directory}/{FILL_NAME}"
    done = sh("nsenter", "-t", str(pid), "-m", "--", "sh", "-c", f"cat /dev/zero > {path}", check=False)
    if "No space left" not in done.stderr:
        raise AssertionError(f"filling {directory} of process {pid} did not run out of space: {done.stderr.strip()}")


def free_disk(pid: int, directory: str) -> None:
    """Remove what ``fill_disk`` wrote."""
    sh("nsenter", "-t", str(pid), "-m", "--", "rm", "-f", f"{directory}/{FILL_NAME}")
