"""The peer tier over real HTTP on loopback: a worker serves its ram and ssd chunks, another fetches."""

from __future__ import annotations

import http.client
import logging
import mmap
import socket
import struct
import threading
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import pytest
import torch

from kvrelay.protocol.chunk_keys import chunk_chain
from kvrelay.store.chunk_format import decode_header, encode_chunk
from kvrelay.store.files import SsdTier
from kvrelay.store.peer import PeerServer, PeerTier
from kvrelay.store.ram import RamTier
from kvrelay.store.tier import CorruptChunk
from kvrelay.store.tier_stack import TierStack

FP = b"tiny-qwen3|float32|64"
SHAPE = (2, 2, 8, 1, 8)
KEYS = chunk_chain(FP, list(range(64 * 6)), 64)


def chunk(i: int) -> bytearray:
    return encode_chunk(KEYS[i], FP, torch.full(SHAPE, float(i)))


@pytest.fixture()
def peer(tmp_path: Path) -> Iterator[tuple[RamTier, SsdTier, PeerServer]]:
    ram = RamTier(1 << 20, verify_payload=False)
    ssd = SsdTier(tmp_path / "peer-ssd", 1 << 20, fsync=False)
    server = PeerServer([ram, ssd])
    yield ram, ssd, server
    server.close()


def test_serves_ram_and_ssd_chunks_and_404s_the_rest(peer: tuple[RamTier, SsdTier, PeerServer]) -> None:
    ram, ssd, server = peer
    ram.put(chunk(0))
    ssd.put(chunk(1))
    assert server.url.startswith("http://127.0.0.1:")
    client = PeerTier(server.url, timeout_s=5.0)
    for i in (0, 1):
        view = client.get(KEYS[i], FP)
        assert view is not None and torch.equal(view.tensor(), torch.full(SHAPE, float(i)))
    assert client.get(KEYS[2], FP) is None
    assert client.contains(KEYS[1]) and not client.contains(KEYS[2])
    c = client.counters()
    assert (c.hits, c.misses, c.errors, c.bytes_read) == (2, 1, 0, 2 * len(chunk(0)))
    served = server.counters()
    assert (served.hits, served.misses) == (2, 2)


def test_malformed_key_gets_400_naming_the_expected_form(peer: tuple[RamTier, SsdTier, PeerServer]) -> None:
    _, _, server = peer
    host, port = server.url.removeprefix("http://").split(":")
    conn = http.client.HTTPConnection(host, int(port), timeout=5)
    conn.request("GET", "/chunks/not-hex")
    response = conn.getresponse()
    assert response.status == 400 and b"/chunks/<32 hex digits>" in response.read()
    conn.close()
    assert server.counters().errors == 1


def test_peer_detects_its_own_corrupt_ssd_chunk_and_answers_404(peer: tuple[RamTier, SsdTier, PeerServer]) -> None:
    _, ssd, server = peer
    ssd.put(chunk(3))
    path = ssd.path_for(KEYS[3])
    data = bytearray(path.read_bytes())
    data[decode_header(data).header_len] ^= 0x01
    path.write_bytes(data)
    assert PeerTier(server.url).get(KEYS[3], FP) is None
    assert ssd.counters().corrupt == 1 and not ssd.contains(KEYS[3])


@pytest.mark.parametrize("part", ["payload", "header"])
def test_client_detects_corrupt_bytes_from_a_peer(peer: tuple[RamTier, SsdTier, PeerServer], part: str) -> None:
    ram, _, server = peer
    blob = chunk(4)
    ram.put(blob)
    blob[decode_header(blob).header_len + 9 if part == "payload" else 12] ^= 0x01
    reports: list[CorruptChunk] = []
    client = PeerTier(server.url, on_corrupt=reports.append)
    if part == "header":
        # The serving ram tier checks headers even when it skips payload digests: nothing is sent.
        assert client.get(KEYS[4], FP) is None and reports == []
        assert ram.counters().corrupt == 1
        return
    assert client.get(KEYS[4], FP) is None
    assert client.counters().corrupt == 1
    assert [(r.tier, r.key, r.source) for r in reports] == [("peer", KEYS[4], server.url)]


def test_a_connection_its_client_resets_is_logged_not_printed(
    peer: tuple[RamTier, SsdTier, PeerServer], capfd: pytest.CaptureFixture[str]
) -> None:
    _, _, server = peer
    ended = threading.Event()
    records: list[logging.LogRecord] = []

    class Catch(logging.Handler):
        def emit(self, record: logging.LogRecord) -> None:
            records.append(record)
            ended.set()

    logger = logging.getLogger("kvrelay.store.peer")
    catch, level = Catch(), logger.level
    logger.addHandler(catch)
    logger.setLevel(logging.DEBUG)
    try:
        host, port = server.url.removeprefix("http://").split(":")
        with socket.create_connection((host, int(port)), timeout=5) as sock:
            sock.sendall(b"GET /chunks/")  # half a request line: the handler waits for the rest
            sock.setsockopt(socket.SOL_SOCKET, socket.SO_LINGER, struct.pack("ii", 1, 0))  # close with a reset
        assert ended.wait(10), "the server did not log the reset connection"
    finally:
        logger.removeHandler(catch)
        logger.setLevel(level)
    assert records[0].levelno == logging.DEBUG and "ended" in records[0].getMessage()
    assert "Exception occurred" not in capfd.readouterr().err


def test_unreachable_peer_is_a_counted_miss_within_the_timeout() -> None:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port = sock.getsockname()[1]
    client = PeerTier(f"http://127.0.0.1:{port}", timeout_s=1.0)
    assert client.get(KEYS[0], FP) is None
    assert client.counters().errors == 1 and client.counters().misses == 1
    with pytest.raises(ValueError, match="http://host:port"):
        PeerTier("ftp://nowhere")


def test_localize_from_peer_into_local_ram_without_writing_a_file(
    peer: tuple[RamTier, SsdTier, PeerServer], tmp_path: Path
) -> None:
    _, peer_ssd, server = peer
    peer_ssd.put(chunk(5))
    local = TierStack(RamTier(1 << 20), SsdTier(tmp_path / "local-ssd", 1 << 20, fsync=False), None)
    hit = local.fetch(KEYS[5], FP, remotes=[PeerTier(server.url)])
    assert hit is not None and hit.tier == "peer"
    assert isinstance(hit.view.buffer, bytearray)  # the fetched buffer itself, kept by ram
    assert torch.equal(hit.view.tensor(), torch.full(SHAPE, 5.0))
    assert local.residency(KEYS[5]) == ("ram",)
    assert list((tmp_path / "local-ssd").glob("*.kvc")) == []
    again = local.fetch(KEYS[5], FP, remotes=[PeerTier(server.url)])
    assert again is not None and again.tier == "ram"
    assert server.counters().hits == 1


def test_a_peer_chunk_ram_cannot_hold_goes_to_local_ssd_read_mapped(
    peer: tuple[RamTier, SsdTier, PeerServer], tmp_path: Path
) -> None:
    _, peer_ssd, server = peer
    peer_ssd.put(chunk(5))
    local = TierStack(RamTier(len(chunk(5)) - 1), SsdTier(tmp_path / "local-ssd", 1 << 20, fsync=False), None)
    hit = local.fetch(KEYS[5], FP, remotes=[PeerTier(server.url)])
    assert hit is not None and hit.tier == "peer"
    assert isinstance(hit.view.buffer, mmap.mmap)
    assert torch.equal(hit.view.tensor(), torch.full(SHAPE, 5.0))
    assert local.residency(KEYS[5]) == ("ssd",)
    again = local.fetch(KEYS[5], FP, remotes=[PeerTier(server.url)])
    assert again is not None and again.tier == "ssd"


def test_a_restore_of_many_chunks_opens_one_connection(
    peer: tuple[RamTier, SsdTier, PeerServer], monkeypatch: pytest.MonkeyPatch
) -> None:
    ram, _, server = peer
    for i in range(6):
        ram.put(chunk(i))
    opened: list[object] = []
    connect = socket.create_connection

    def counted(*args: Any, **kwargs: Any) -> socket.socket:
        opened.append(args[0])
        return connect(*args, **kwargs)

    monkeypatch.setattr(http.client.socket, "create_connection", counted)
    client = PeerTier(server.url)
    views = [client.get(KEYS[i], FP) for i in range(6)]
    assert all(v is not None and torch.equal(v.tensor(), torch.full(SHAPE, float(i))) for i, v in enumerate(views))
    assert client.contains(KEYS[0]) and client.get(KEYS[0], FP) is not None
    assert len(opened) == 1 and server.counters().hits == 7


def kept_then_closed(peer: tuple[RamTier, SsdTier, PeerServer]) -> PeerTier:
    """A client that fetched chunk 0 over a connection it keeps, from a server closed since."""
    ram, _, server = peer
    ram.put(chunk(0))
    client = PeerTier(server.url, timeout_s=2.0)
    assert client.get(KEYS[0], FP) is not None
    server.close()
    return client


def test_a_closed_server_serves_nothing_over_the_connections_it_held(
    peer: tuple[RamTier, SsdTier, PeerServer],
) -> None:
    client = kept_then_closed(peer)
    assert client.get(KEYS[0], FP) is None
    assert client.counters().errors == 1 and peer[2].counters().hits == 1


def test_a_kept_connection_the_server_dropped_is_retried_on_a_new_one(
    peer: tuple[RamTier, SsdTier, PeerServer],
) -> None:
    ram, ssd, server = peer
    client = kept_then_closed(peer)
    restarted = PeerServer([ram, ssd], port=int(server.url.rsplit(":", 1)[1]))
    try:
        view = client.get(KEYS[0], FP)
        assert view is not None and torch.equal(view.tensor(), torch.full(SHAPE, 0.0))
        assert client.counters().errors == 0 and restarted.counters().hits == 1
    finally:
        restarted.close()
