"""Length-prefixed JSON frames between the pool and its zygotes (4-byte big-endian length)."""

from __future__ import annotations

import json
import os
import re
import struct
from typing import TYPE_CHECKING

if TYPE_CHECKING:  # the zygotes use only the blocking half: asyncio (and ssl) stay out of their image
    import asyncio

_HEADER = struct.Struct(">I")


def encode(obj: object) -> bytes:
    body = json.dumps(obj).encode()  # ASCII: lone surrogates in user strings survive
    return _HEADER.pack(len(body)) + body


# Lone surrogates other than U+DC80-U+DCFF (which stand for undecodable bytes): no UTF-8 holds them.
_UNENCODABLE = re.compile("[\ud800-\udc7f\udd00-\udfff]")


def text_bytes(text: str) -> bytes:
    """A request's text (its stdin) as the bytes the program reads; never raises.

    U+DC80-U+DCFF become the bytes a client could not decode (surrogateescape); any other lone
    surrogate (e.g. a model's tool call with "\\ud800" in its input) becomes its \\udXXX escape, as in
    results. Raising here would turn the caller's text into a sandbox error.
    """
    try:
        return text.encode("utf-8", "surrogateescape")
    except UnicodeEncodeError:
        escaped = _UNENCODABLE.sub(lambda m: m.group().encode("utf-8", "backslashreplace").decode(), text)
        return escaped.encode("utf-8", "surrogateescape")


def _read_exactly(fd: int, n: int) -> bytes:
    buf = bytearray()
    while len(buf) < n:
        chunk = os.read(fd, n - len(buf))
        if not chunk:
            raise EOFError("control pipe closed")
        buf += chunk
    return bytes(buf)


def read_frame(fd: int) -> object:
    (n,) = _HEADER.unpack(_read_exactly(fd, _HEADER.size))
    return json.loads(_read_exactly(fd, n))


def write_frame(fd: int, obj: object) -> None:
    data = memoryview(encode(obj))
    while data:
        data = data[os.write(fd, data) :]


async def read_frame_async(reader: asyncio.StreamReader) -> object:
    (n,) = _HEADER.unpack(await reader.readexactly(_HEADER.size))
    return json.loads(await reader.readexactly(n))
