"""Commands started the way a terminal starts its foreground command, for the Ctrl-C tests."""

from __future__ import annotations

import sys

# An ignored signal stays ignored across exec, and a shell that starts a job in the background without
# job control (`cmd &` in a script, nohup) ignores SIGINT for it: a test run started so would pass that
# on to every command it starts, and Ctrl-C could never reach them. A terminal's foreground command
# starts with SIGINT at its default; this exec wrapper restores that before the command runs.
_DEFAULT_SIGINT = "import os, signal, sys; signal.signal(signal.SIGINT, signal.SIG_DFL); os.execv(sys.argv[1], sys.argv[1:])"


def foreground(argv: list[str]) -> list[str]:
    """`argv` (a program and its arguments) run with SIGINT at its default disposition, in this process's
    place: the pid Popen returns is the command's own."""
    return [sys.executable, "-c", _DEFAULT_SIGINT, *argv]
