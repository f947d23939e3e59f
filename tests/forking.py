"""What a test's forked child does first."""

from __future__ import annotations

import torch


def one_thread_after_fork() -> None:
    """A forked child computes on one thread: the parent's OpenMP pool does not survive fork, and libgomp
    hangs or segfaults starting a team in the child once the parent has used one (seen in the full suite)."""
    torch.set_num_threads(1)
