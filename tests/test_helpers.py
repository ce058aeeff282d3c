"""The test helpers that other tests trust without seeing: a repeated port fails a cluster's start at random."""

from __future__ import annotations

import socket

from tests.helpers import free_ports


def test_free_ports_are_distinct_and_each_can_be_bound() -> None:
    ports = free_ports(64)
    assert len(set(ports)) == len(ports)
    for port in ports:
        with socket.socket() as sock:
            sock.bind(("127.0.0.1", port))
