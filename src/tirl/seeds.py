"""The one seed derivation: every random choice in tirl is seeded by a tuple of integers.

(seed, step, group) picks RoC's draws, (seed, stage) the prompt order, (seed, problem, sample, turn)
the engine's sampling; each derived seed depends on its tuple alone, so a resumed run or a rollout
finishing in another order draws exactly the same numbers.
"""

from __future__ import annotations

import numpy as np


def derive_seed(*parts: int) -> int:
    """A 63-bit seed determined by `parts` alone (fits an int64 for engines; any numpy/torch RNG)."""
    words = [int(p) & 0xFFFFFFFFFFFFFFFF for p in parts]
    return int(np.random.SeedSequence(words).generate_state(2, np.uint64)[0] >> 1)
