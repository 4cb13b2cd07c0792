"""Ports handed to servers come from below the kernel's ephemeral range, free, and never twice in a row."""

from __future__ import annotations

import socket

import pytest

from kvrelay.launch import ports
from kvrelay.launch.ports import free_port, port_span


def test_the_span_lies_just_below_the_ephemeral_range() -> None:
    assert port_span("32768\t60999") == range(20768, 32768)
    assert port_span("15000 60999") == range(10000, 15000)
    assert not port_span("1024 65535")


def test_ports_are_free_outside_the_ephemeral_range_and_distinct() -> None:
    span = ports._span()
    handed = [free_port() for _ in range(300)]
    assert len(set(handed)) == len(handed)
    assert all(p in span for p in handed)
    for port in handed[:20]:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))


def test_a_port_the_kernel_hands_out_is_never_drawn() -> None:
    with socket.socket() as kernels:
        kernels.bind(("127.0.0.1", 0))
        taken = kernels.getsockname()[1]
        assert taken not in ports._span()
        assert all(free_port() != taken for _ in range(100))


def test_a_port_in_use_is_not_handed_out_and_the_kernel_steps_in(monkeypatch: pytest.MonkeyPatch) -> None:
    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        port = busy.getsockname()[1]
        busy.listen()
        monkeypatch.setattr(ports, "_span", lambda: range(port, port + 1))
        other = free_port()
        assert other != port
