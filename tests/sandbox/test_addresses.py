"""Reproducible tool answers (issue 42): only real object addresses are renumbered.

The tool numbers the addresses in printed reprs (`<function f at 0x7f...>` differs in every process),
so a seed shows the model the same tokens. Renumbering every hex number after " at " also rewrote
values a program computed, and two different values came out as one. Now the process that printed
the text reports which numbers are addresses in its own memory; each test runs real code in a real
pool and reads the answer the Python tool gives the model.
"""

from __future__ import annotations

import pytest

from tirl.agent.tools import exec_tool_result
from tirl.sandbox import Sandbox, Status

session_loop = pytest.mark.asyncio(loop_scope="session")
COMPUTED = [0x3000, 0x5000, 2**40, 2**40 + 8, 0x7F0000001000, 0x7F0000002000]


def light_pool() -> Sandbox:
    return Sandbox(slots=1, preload=[], warmup=[], limits={"timeout_s": 5.0, "memory_mb": 256})


async def answer(run, code: str) -> str:
    result = await run(code)
    assert result.status == Status.OK, result
    return exec_tool_result(result, show_time=False).text


@session_loop
async def test_two_different_computed_hex_values_after_at_stay_distinct():
    async with light_pool() as sb:
        for value in COMPUTED:
            for template in ("peak at {}", "<peak at {}>", "found at {}, then"):
                text = template.format(hex(value))
                assert await answer(sb.run, f"print({text!r})") == f"{text}\n[ok]", text
        both = await answer(sb.run, f"print('a at {hex(COMPUTED[4])}>', 'b at {hex(COMPUTED[5])}>')")
        assert both == f"a at {hex(COMPUTED[4])}> b at {hex(COMPUTED[5])}>\n[ok]"


@session_loop
async def test_real_object_addresses_are_numbered_by_first_appearance():
    code = "def f():\n    pass\no = object()\nprint(f, o, f, (x for x in []))"
    async with light_pool() as sb:
        first = await answer(sb.run, code)
        assert first == (
            "<function f at 0x#1> <object object at 0x#2> "
            "<function f at 0x#1> <generator object <genexpr> at 0x#3>\n[ok]"
        ), first
        mixed = await answer(sb.run, f"o = object()\nprint(o, '<x at {hex(COMPUTED[2])}>')")
        assert mixed == f"<object object at 0x#1> <x at {hex(COMPUTED[2])}>\n[ok]", mixed
        async with await sb.open_session() as session:
            await session.run("class A:\n    pass")
            cell = await answer(session.run, f"print(A(), 'peak at {hex(COMPUTED[3])}>')")
            assert cell == f"<__main__.A object at 0x#1> peak at {hex(COMPUTED[3])}>\n[ok]", cell


def test_without_a_report_only_a_reprs_shape_is_renumbered():
    """A result from a service that reports no addresses: only what looks like a CPython repr's."""
    from tirl.sandbox.addresses import stable_addresses

    text = "<f at 0x7f3a12345678> peak at 0x7f3a12345678 <g at 0x5000> <h at 0x7f3a12345679>"
    assert stable_addresses(text) == "<f at 0x#1> peak at 0x7f3a12345678 <g at 0x5000> <h at 0x7f3a12345679>"
    assert stable_addresses(text, []) == text, "the process said none of them is an address"


@session_loop
async def test_a_renumbered_address_never_equals_a_literal_the_program_printed():
    """Round 5, item 8: 0x000000000002 was both the second object's number and a literal the program
    printed, so two different values reached the model as one token."""
    code = "a, b = object(), object()\nprint(a, b, 'then 0x000000000002 and 0x#2 and 0x##1')"
    async with light_pool() as sb:
        text = await answer(sb.run, code)
    objects, literals = text.split(" then ")
    first, second = (part.removesuffix(">") for part in objects.split(" at ")[1:])
    assert first != second
    assert literals == "0x000000000002 and 0x#2 and 0x##1\n[ok]", text
    for number in (first, second):
        assert number not in literals.split(), (number, text)
