"""Per-call resource limits, and the server maxima that bound what a caller may ask for."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field

from tirl.sandbox.result import human_bytes

KiB = 1024
MiB = 1024 * KiB


class Limits(BaseModel):
    """What one call may use. Every field can be lowered (or raised up to the server maxima) per call."""

    model_config = ConfigDict(extra="forbid", allow_inf_nan=False)

    timeout_s: float = Field(5.0, gt=0, description="wall-clock limit of the user code")
    memory_mb: int = Field(
        1024, ge=32, description="memory of all processes of the call (cgroup + AS backstop)"
    )
    output_bytes: int = Field(
        16 * MiB, ge=1024, description="hard cap on stdout+stderr; beyond it the call is killed"
    )
    keep_bytes: int = Field(8 * KiB, ge=256, description="head and tail of each stream kept for the result")
    max_procs: int = Field(32, ge=1, description="processes/threads of the call")
    file_size_mb: int = Field(
        64, ge=1, description="largest file the code may write (also the tmpfs workdir size)"
    )
    open_files: int = Field(256, ge=16, description="RLIMIT_NOFILE")

    def clamp(self, maxima: Limits) -> Limits:
        """This request's limits, none above the server's maxima."""
        fields = self.model_dump()
        top = maxima.model_dump()
        return Limits(**{k: min(v, top[k]) for k, v in fields.items()})

    def with_overrides(self, **overrides: float | int | None) -> Limits:
        """A copy with the given (non-None) fields replaced."""
        changes = {k: v for k, v in overrides.items() if v is not None}
        return self.model_validate({**self.model_dump(), **changes}) if changes else self


def host_memory_bytes() -> int | None:
    """The machine's RAM (MemTotal), or None where /proc/meminfo is unreadable."""
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemTotal:"):
                    return int(line.split()[1]) * KiB
    except (OSError, ValueError, IndexError):
        pass
    return None


def fitting_memory_mb(slots: int, ceiling_mb: int = 16 * 1024) -> int:
    """The largest per-call memory limit such that every slot at its limit still fits in RAM."""
    total = host_memory_bytes()
    return ceiling_mb if total is None else max(32, min(ceiling_mb, total // MiB // max(slots, 1)))


DEFAULT_LIMITS = Limits()
SERVER_MAXIMA = Limits(
    timeout_s=300.0, memory_mb=16 * 1024, output_bytes=256 * MiB, keep_bytes=1 * MiB, max_procs=512,
    file_size_mb=1024, open_files=4096,
)  # fmt: skip

__all__ = [
    "DEFAULT_LIMITS",
    "SERVER_MAXIMA",
    "KiB",
    "Limits",
    "MiB",
    "fitting_memory_mb",
    "host_memory_bytes",
    "human_bytes",
]
