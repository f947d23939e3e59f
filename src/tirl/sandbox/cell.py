"""Running one notebook-style cell inside the confined child.

The code is compiled as `<cell>`; if it ends with an expression and printed nothing, the
value's repr is echoed like IPython. Tracebacks keep only the user's `<cell>` frames, so no
host path reaches the model. The outcome travels to the zygote on fd 3 as one JSON line,
never as markers in stdout. Ends with os._exit so stray threads cannot keep the call alive.
"""

from __future__ import annotations

import ast
import builtins
import contextlib
import errno
import io
import json
import linecache
import os
import socket
import sys
import traceback
import types
import warnings

from tirl.sandbox import addresses

CELL = "<cell>"
RESULT_FD = 3


class _Watched(io.TextIOWrapper):
    """A text stream whose writes are checked for object addresses (addresses.py: reported as real
    only if they lie in this process's memory)."""

    def write(self, s: str) -> int:
        addresses.note(s)
        return super().write(s)


class _Stdout(_Watched):
    """Line-buffered stdout that remembers whether anything was printed (for the echo rule)."""

    printed = False

    def write(self, s: str) -> int:
        if s:
            self.printed = True
        return super().write(s)


def _stream(fd: int, cls: type[io.TextIOWrapper] = io.TextIOWrapper, mode: str = "wb") -> io.TextIOWrapper:
    raw = io.FileIO(fd, mode[0], closefd=False)
    buffered = io.BufferedWriter(raw) if mode == "wb" else io.BufferedReader(raw)
    return cls(buffered, encoding="utf-8", errors="backslashreplace", line_buffering=mode == "wb")


def _trim(te: traceback.TracebackException | None, seen: set[int] | None = None) -> None:
    """Drop every frame that is not the user's, in the exception and the ones it chains to."""
    seen = set() if seen is None else seen
    if te is None or id(te) in seen:
        return
    seen.add(id(te))
    te.stack = traceback.StackSummary.from_list([f for f in te.stack if f.filename == CELL])
    _trim(te.__cause__, seen)
    _trim(te.__context__, seen)


def _format_warning(message, category, filename, lineno, line=None) -> str:
    where = f"{CELL}:{lineno}: " if filename == CELL else ""
    return f"{where}{category.__name__}: {message}\n"


def _split_last_expression(tree: ast.Module) -> tuple[ast.Module, ast.Expression | None]:
    if tree.body and isinstance(tree.body[-1], ast.Expr):
        last = ast.Expression(tree.body.pop().value)
        return tree, last
    return tree, None


def report(outcome: str, end: bytes = b"", **info: object) -> None:
    """The outcome line on the result pipe (and, for a session, the end-of-cell marker)."""
    if (found := addresses.reported()) is not None:
        info["addresses"] = found
    with contextlib.suppress(OSError):  # the user closed fd 3: the sandbox falls back to the exit status
        os.write(RESULT_FD, json.dumps({"outcome": outcome, **info}).encode() + b"\n" + end)


def _flush() -> None:
    for stream in (sys.stdout, sys.stderr):
        with contextlib.suppress(OSError, ValueError):  # the user closed or broke the stream
            stream.flush()


NETWORK_ERRNOS = frozenset({errno.ENETUNREACH, errno.ECONNREFUSED, errno.EHOSTUNREACH, errno.EADDRNOTAVAIL})


def _network_blocked(exc: BaseException | None, depth: int = 0) -> bool:
    """Whether the error (or one it chains to) is the sandbox's missing network, e.g. urllib's URLError."""
    if exc is None or depth > 10:
        return False
    if isinstance(exc, socket.gaierror) or getattr(exc, "errno", None) in NETWORK_ERRNOS:
        return True
    reason = getattr(exc, "reason", None)
    return any(
        _network_blocked(e, depth + 1)
        for e in (exc.__cause__, exc.__context__, reason)
        if isinstance(e, BaseException)
    )


def _describe(exc: BaseException) -> str:
    text = traceback.format_exception_only(type(exc), exc)[-1].strip()
    return text[:300]


def reader(fd: int) -> io.TextIOWrapper:
    """sys.stdin over `fd` (a session re-opens it per call, on that call's stdin)."""
    return _stream(fd, mode="rb")


Streams = tuple[io.TextIOWrapper, io.TextIOWrapper, io.TextIOWrapper]


def make_streams() -> Streams:
    """stdin/stdout/stderr over fds 0-2, unused: the fork server makes them once, every call inherits
    them fresh (building them in each call copied ~50 pages of the image per call)."""
    return reader(0), _stream(1, _Stdout), _stream(2, _Watched)


def open_streams(streams: Streams) -> None:
    """Point sys.stdin/stdout/stderr at fds 0-2 (done before the call arrives: off the critical path)."""
    sys.stdin, sys.stdout, sys.stderr = streams
    warnings.formatwarning = _format_warning


def main_namespace() -> dict:
    """A fresh `__main__` module for the user's code, installed as sys.modules["__main__"]: what a cell
    defines pickles by reference, so multiprocessing and concurrent.futures can hand a cell's own
    functions to their workers (a fresh interpreter, as spawn starts, cannot find them: as in Jupyter)."""
    module = types.ModuleType("__main__")
    module.__builtins__ = builtins
    sys.modules["__main__"] = module
    return module.__dict__


def run_cell(code: str) -> None:
    """Execute `code` as the confined process's program and exit; never returns."""
    exit_code, result = execute(code, main_namespace())
    report(**result)
    os._exit(exit_code)


def execute(code: str, namespace: dict, keep: bool = False) -> tuple[int, dict]:
    """Run `code` in `namespace` like a notebook cell; returns (exit code, report for the sandbox).

    Output is flushed before returning, so the report always follows the cell's output. `keep`:
    the namespace outlives the cell (a session), so a MemoryError does not clear it.
    """
    linecache.cache[CELL] = (len(code), None, code.splitlines(True), CELL)
    if isinstance(sys.stdout, _Stdout):
        sys.stdout.printed = False
    try:
        tree, last = _split_last_expression(ast.parse(code, CELL))
        exec(compile(tree, CELL, "exec"), namespace)
        if last is not None:
            value = eval(compile(last, CELL, "eval"), namespace)
            if value is not None and not getattr(sys.stdout, "printed", True):
                print(repr(value))
        _flush()
        return 0, {"outcome": "ok"}
    except SyntaxError as exc:
        print("".join(traceback.format_exception_only(type(exc), exc)), end="", file=sys.stderr)
        _flush()
        return 1, {"outcome": "syntax_error", "error": _describe(exc)}
    except SystemExit as exc:
        exit_code = _exit_code(exc)
        _flush()
        return exit_code, {"outcome": "exit", "exit_code": exit_code}
    except MemoryError:
        if not keep:
            namespace.clear()  # free what the cell held so reporting itself has memory
        return 1, {"outcome": "memory_error", "error": "MemoryError"}
    except BaseException as exc:
        te = traceback.TracebackException.from_exception(exc)
        _trim(te)
        with contextlib.suppress(OSError, ValueError):
            print("".join(te.format()), end="", file=sys.stderr)
        _flush()
        return 1, {
            "outcome": "error",
            "error": _describe(exc),
            "type": type(exc).__name__,
            "network": _network_blocked(exc),
        }


def _exit_code(exc: SystemExit) -> int:
    """sys.exit semantics: None -> 0, int -> itself, anything else printed to stderr -> 1."""
    if exc.code is None:
        return 0
    if isinstance(exc.code, int):
        return exc.code & 0xFF
    print(exc.code, file=sys.stderr)
    return 1
