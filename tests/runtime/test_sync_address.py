"""A gloo sync group listens on the member's routable address (Ray's node IP), not on wherever this
host's name resolves: /etc/hosts often maps it to loopback (127.0.1.1 on Debian and Ubuntu images),
which engines on other nodes cannot reach (issue 41, "Also")."""

from __future__ import annotations

import os
import socket
import threading

import psutil
import pytest

from tirl.distributed.weight_sync import SyncChannel, SyncGroup
from tirl.ports import free_port


def _routable_ip_not_the_hostnames() -> tuple[str, str]:
    """An address of this machine's other than the one its hostname resolves to (here: the hostname is
    loopback and the node IP routable, as in the issue), and the hostname's."""
    by_name = socket.gethostbyname(socket.gethostname())
    with socket.socket(socket.AF_INET, socket.SOCK_DGRAM) as s:
        s.connect(("192.0.2.1", 9))  # no packet is sent: the kernel picks the outgoing interface
        routable = s.getsockname()[0]
    if routable == by_name:
        routable = "127.0.0.1"  # the hostname is routable here: ask for loopback to tell them apart
    return routable, by_name


def test_a_gloo_sync_group_listens_on_the_address_it_is_given(monkeypatch):
    monkeypatch.delenv("GLOO_SOCKET_IFNAME", raising=False)
    address, by_name = _routable_ip_not_the_hostnames()
    if address == by_name:
        pytest.skip("this machine has one address")
    group = SyncGroup("127.0.0.1", free_port(), 2, "gloo", timeout_s=60)
    before = {c.laddr for c in psutil.Process(os.getpid()).net_connections("tcp")}
    out: dict[int, SyncChannel] = {}
    threads = [
        threading.Thread(target=lambda r=r: out.__setitem__(r, SyncChannel(group, r, address)))
        for r in (0, 1)
    ]
    for t in threads:
        t.start()
    for t in threads:
        t.join(60)
    try:
        store_port = group.port
        pairs = {
            c.laddr.ip
            for c in psutil.Process(os.getpid()).net_connections("tcp")
            if c.laddr not in before and store_port not in (c.laddr.port, c.raddr.port if c.raddr else None)
        }
        assert pairs == {address}, (pairs, address, by_name)  # gloo's own sockets, on the given address
    finally:
        for channel in out.values():
            channel.close()
