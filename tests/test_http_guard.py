"""tirl.http_guard's rules on their own (each server's tests attack them over real HTTP: the endpoint in
tests/agent/test_endpoint_hostile.py and test_endpoint_browser.py, the sandbox service in
tests/sandbox, the viewer in tests/view/test_serve_guard.py)."""

from __future__ import annotations

import pytest

from tirl.http_guard import GuardPolicy, check, host_name, unguessable_id

JSON = {"content-type": "application/json"}


@pytest.mark.parametrize(
    ("host", "name"),
    [
        ("127.0.0.1:8080", "127.0.0.1"),
        ("LocalHost", "localhost"),
        ("[::1]:80", "[::1]"),
        ("[::1]", "[::1]"),
        ("example.org", "example.org"),
        ("", ""),
    ],
)
def test_host_name(host, name):
    assert host_name(host) == name


def test_without_a_token_the_host_must_name_this_machine():
    policy = GuardPolicy.for_server("0.0.0.0", ["box.lan"])
    assert policy.allowed_hosts >= {"localhost", "127.0.0.1", "[::1]", "box.lan"}
    assert "0.0.0.0" not in policy.allowed_hosts, "a wildcard bind address is no Host name"
    for host in ("127.0.0.1:9", "localhost", "[::1]:9", "BOX.lan:80"):
        assert check(policy, "GET", "/", {"host": host}) is None, host
    for host in ("attacker.example", "127.0.0.1.attacker.example", "", "localhost.:80"):
        refusal = check(policy, "GET", "/", {"host": host})
        assert refusal is not None and refusal.status == 421, host


def test_a_foreign_origin_is_refused_and_our_own_is_not():
    policy = GuardPolicy.for_server()
    base = {"host": "127.0.0.1:8000", **JSON}
    assert check(policy, "POST", "/x", {**base, "origin": "http://127.0.0.1:8000"}) is None
    for origin in ("http://attacker.example", "null", "http://rebind.test:8000", "http://[::1", ""):
        refusal = check(policy, "POST", "/x", {**base, "origin": origin})
        assert refusal is not None and refusal.status == 403, origin


@pytest.mark.parametrize(
    "media", ["text/plain", "application/x-www-form-urlencoded", "multipart/form-data", ""]
)
def test_without_a_token_a_post_must_be_json(media):
    policy = GuardPolicy.for_server()
    refusal = check(policy, "POST", "/x", {"host": "localhost", "content-type": media})
    assert refusal is not None and refusal.status == 415
    assert (
        check(policy, "POST", "/x", {"host": "localhost", "content-type": "application/json; charset=utf-8"})
        is None
    )


def test_a_token_replaces_the_host_origin_and_media_rules_but_is_needed_everywhere_else():
    policy = GuardPolicy.for_server(token="t0k")
    assert "t0k" not in repr(policy)
    remote = {"host": "10.0.0.5:8000", "content-type": "text/plain"}
    assert check(policy, "POST", "/run", {**remote, "authorization": "Bearer t0k"}) is None
    for given in ("", "Bearer t0", "Bearer t0k ", "t0k", "Bearer \u00e9"):
        refusal = check(policy, "POST", "/run", {**remote, "authorization": given})
        assert refusal is not None and refusal.status == 401, given
    assert check(policy, "GET", "/health", remote) is None  # public
    with pytest.raises(ValueError, match="token is empty"):
        GuardPolicy.for_server(token=" ")


def test_a_declared_body_over_the_limit_is_refused_before_it_is_read():
    policy = GuardPolicy.for_server(max_body_bytes=100)
    headers = {"host": "localhost", **JSON}
    assert check(policy, "POST", "/x", {**headers, "content-length": "100"}) is None
    refusal = check(policy, "POST", "/x", {**headers, "content-length": "101"})
    assert refusal is not None and refusal.status == 413 and "limit 100 bytes" in refusal.message


def test_ids_are_unguessable():
    ids = {unguessable_id("t-") for _ in range(1000)}
    assert len(ids) == 1000 and all(i.startswith("t-") and len(i) == 2 + 22 for i in ids)
