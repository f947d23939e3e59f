"""Deterministic, resumable prompt sampling (the seeds that make rollouts reproducible: tirl.seeds)."""

from __future__ import annotations

import numpy as np


class EpochSampler:
    """Walks a fresh permutation of range(n) per epoch (seeded by (seed, epoch)); state = position."""

    def __init__(self, n: int, seed: int):
        if n < 1:
            raise ValueError("cannot sample from an empty problem set: check the stage's data")
        self.n, self.seed = n, seed
        self.epoch, self.position = 0, 0
        self._order = self._permutation()

    def _permutation(self) -> np.ndarray:
        return np.random.default_rng([self.seed, self.epoch]).permutation(self.n)

    def next(self, k: int) -> list[int]:
        out: list[int] = []
        while len(out) < k:
            if self.position == self.n:
                self.epoch, self.position = self.epoch + 1, 0
                self._order = self._permutation()
            take = min(k - len(out), self.n - self.position)
            out += self._order[self.position : self.position + take].tolist()
            self.position += take
        return out

    def state_dict(self) -> dict:
        return {"n": self.n, "seed": self.seed, "epoch": self.epoch, "position": self.position}

    def load_state_dict(self, state: dict) -> None:
        if state["n"] != self.n:
            raise ValueError(f"checkpoint sampled from {state['n']} problems, the data now has {self.n}")
        self.seed, self.epoch, self.position = state["seed"], state["epoch"], state["position"]
        self._order = self._permutation()
