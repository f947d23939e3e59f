"""tirl.ports: the port it names is one the caller can bind, on loopback and on every interface."""

from __future__ import annotations

import socket

import pytest

from tirl.ports import free_port


@pytest.mark.parametrize("host", ["127.0.0.1", ""])
def test_free_port_is_one_the_caller_can_listen_on(host: str) -> None:
    port = free_port(host)
    assert 1024 <= port < 65536
    with socket.socket() as s:
        s.bind((host, port))
        s.listen()
        assert s.getsockname()[1] == port


def test_free_port_on_an_ipv6_host_binds_an_ipv6_socket() -> None:
    if not socket.has_ipv6:
        pytest.skip("this Python has no IPv6")
    try:
        port = free_port("::1")
    except OSError as e:  # a kernel with IPv6 off: nothing for the family choice to show
        pytest.skip(f"no IPv6 loopback here: {e}")
    with socket.socket(socket.AF_INET6) as s:
        s.bind(("::1", port))
