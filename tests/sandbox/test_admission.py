"""The pool's one admission rule (tirl.sandbox.admission) at its edges: what may queue, the session cap,
the sessions' share of the memory budget and the share kept for stateless calls. Pure counters, no
processes: the pools and the HTTP service that ask this rule are tested in test_budgets.py and
test_sessions.py."""

from __future__ import annotations

import pytest

from tirl.sandbox.admission import Admission, SessionError, default_calls_reserve_mb
from tirl.sandbox.result import Status


def rule(**fields: int) -> Admission:
    return Admission(
        **({"max_queue": 2, "max_sessions": 3, "budget_mb": 1000, "calls_reserve_mb": 300} | fields)
    )


@pytest.mark.parametrize(
    ("budget", "slots", "call_mb", "reserve"),
    [(1000, 1, 256, 256), (1000, 2, 256, 500), (1001, 4, 256, 500), (4096, 0, 256, 0)],
)
def test_the_default_calls_share_is_every_slot_at_the_default_limit_but_at_most_half(
    budget, slots, call_mb, reserve
):
    assert default_calls_reserve_mb(budget, slots, call_mb) == reserve


@pytest.mark.parametrize("reserve", [0, 1000])
def test_the_calls_share_may_be_none_or_the_whole_budget(reserve):
    assert rule(calls_reserve_mb=reserve).sessions_share_mb == 1000 - reserve


@pytest.mark.parametrize("reserve", [-1, 1001])
def test_a_calls_share_outside_the_budget_is_refused_with_both_numbers(reserve):
    with pytest.raises(ValueError) as err:
        rule(calls_reserve_mb=reserve)
    assert str(err.value) == f"calls_reserve_mb={reserve} must lie between 0 and the memory budget (1000 MiB)"


def test_the_queue_refuses_when_full_or_closed_and_not_a_call_before():
    r = rule(max_queue=2)
    r.waiting = 1
    assert r.queue_refusal() is None, "one place left"
    r.waiting = 2
    full = r.queue_refusal()
    assert full is not None and full.status == Status.QUEUE_TIMEOUT
    assert full.message == "queue full (2 calls and session cells waiting)"
    r.waiting, r.closed = 0, True
    closed = r.queue_refusal()
    assert closed is not None and (closed.status, closed.message) == (
        Status.SANDBOX_ERROR,
        "the sandbox pool is closed",
    )


def test_a_call_that_fills_the_budget_exactly_runs_and_one_mebibyte_more_does_not():
    r = rule()
    r.admit_session(300)
    assert r.reserve_call(400) is None and r.reserve_call(300) is None
    assert r.calls_mb == 700 and r.reserved_mb == 1000
    assert r.reserve_call(1) == (
        "memory budget: 1000 of 1000 MiB are held by running calls (700 MiB) and live sessions (300 MiB), "
        "1 MiB more do not fit (retry later or ask for less memory)"
    )
    assert r.calls_mb == 700, "a refused call holds nothing"
    r.release_call(700)
    assert r.calls_mb == 0 and r.reserved_mb == 300


def test_sessions_fill_their_share_exactly_and_no_further():
    r = rule()
    r.admit_session(400)
    r.admit_session(300)
    assert (r.sessions_held, r.sessions_mb) == (2, 700)
    with pytest.raises(SessionError) as err:
        r.admit_session(1)
    assert str(err.value) == (
        "memory budget: sessions hold 700 of the 700 MiB they may share (300 of 1000 MiB are kept for "
        "stateless calls), 1 MiB more do not fit (close idle sessions, or ask for less memory)"
    )
    assert (r.sessions_held, r.sessions_mb) == (2, 700), "a refused session holds nothing"
    assert r.reserve_call(300) is None, "the calls' share is free whatever the sessions hold"
    r.release_call(300)
    r.release_session(400)
    assert (r.sessions_held, r.sessions_mb) == (1, 300)


def test_a_session_fits_its_share_but_not_what_running_calls_hold():
    r = rule()
    assert r.reserve_call(900) is None, "calls may use what sessions leave free"
    r.admit_session(100)  # 900 + 100: the budget exactly
    with pytest.raises(SessionError) as err:
        r.admit_session(1)  # within the sessions' share (101 of 700), over the budget
    assert str(err.value) == (
        "memory budget: 1000 of 1000 MiB are held by running calls and live sessions, 1 MiB more do not "
        "fit (retry later, or ask for less memory)"
    )
    assert (r.sessions_held, r.sessions_mb) == (1, 100)


def test_the_session_cap_counts_sessions_held_not_memory():
    r = rule(max_sessions=2)
    r.admit_session(0)
    r.admit_session(0)
    with pytest.raises(SessionError) as err:
        r.admit_session(0)
    assert str(err.value) == (
        "2 sessions are live or opening (the cap): close some, or wait for idle ones to expire"
    )
    r.release_session(0)
    r.admit_session(0)
    assert r.sessions_held == 2


def test_a_closed_pool_admits_no_session():
    r = rule()
    r.closed = True
    with pytest.raises(SessionError, match=r"^the sandbox pool is closed$"):
        r.admit_session(1)
    assert (r.sessions_held, r.sessions_mb) == (0, 0)


def test_an_idle_session_shrinks_to_its_use_and_grows_back_for_a_cell_only_if_it_fits():
    adm = rule(budget_mb=1024, calls_reserve_mb=256, max_sessions=8)
    adm.admit_session(512)
    assert adm.resize_session(512, 20) is None and adm.sessions_mb == 20  # idle: what it uses
    adm.admit_session(700)  # fits beside the idle one, not beside its limit
    assert adm.resize_session(700, 700) is None
    why = adm.resize_session(20, 512)  # its next cell needs its limit back: no room in the share
    assert why is not None and "retry later" in why and adm.sessions_mb == 720
    assert adm.resize_session(700, 10) is None and adm.resize_session(20, 512) is None
    assert adm.sessions_mb == 522


def test_a_session_grows_to_exactly_what_is_left_and_not_a_mib_more():
    adm = rule(budget_mb=1024, calls_reserve_mb=256)  # the sessions' share: 768
    adm.admit_session(700)
    assert adm.resize_session(700, 768) is None and adm.sessions_mb == 768  # the whole share
    why = adm.resize_session(768, 769)
    assert why is not None and "sessions hold 768 of the 768 MiB" in why and adm.sessions_mb == 768
    adm = rule(budget_mb=1024, calls_reserve_mb=256)
    adm.admit_session(300)
    assert adm.reserve_call(700) is None  # calls may use what sessions leave: 1000 of 1024 held
    assert adm.resize_session(300, 324) is None and adm.reserved_mb == 1024  # the whole budget
    why = adm.resize_session(324, 325)
    assert why is not None and "1024 of 1024 MiB are held by running calls" in why and adm.sessions_mb == 324
