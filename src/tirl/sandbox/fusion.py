"""SandboxFusion's /run_code request and response, so verl's SandboxFusion clients work unchanged."""

from __future__ import annotations

from typing import Any

from pydantic import BaseModel, ConfigDict, Field

from tirl.sandbox.result import ExecResult, Status

PYTHON_NAMES = frozenset({"python", "python3"})


class RunCodeRequest(BaseModel):
    model_config = ConfigDict(extra="ignore", allow_inf_nan=False)

    code: str
    language: str = "python"
    stdin: str | None = ""
    run_timeout: float | None = Field(None, gt=0)
    compile_timeout: float | None = None  # Python compiles as it runs: accepted and ignored
    memory_limit_MB: int | None = -1
    files: dict[str, Any] = Field(default_factory=dict)
    fetch_files: list[str] = Field(default_factory=list)


def to_fusion(r: ExecResult) -> dict:
    """Map an ExecResult onto SandboxFusion's RunCodeResponse."""
    if r.is_infra_error:
        return {
            "status": "SandboxError",
            "message": r.message or str(r.status),
            "compile_result": None,
            "run_result": None,
            "executor_pod_name": None,
            "files": {},
        }
    code = r.exit_code if r.exit_code is not None else -(r.signal or 9)
    run = {
        "status": "TimeLimitExceeded" if r.status == Status.TIMEOUT else "Finished",
        "execution_time": r.wall_ms / 1000,
        "return_code": code,
        "stdout": r.stdout,
        "stderr": r.stderr
        if r.status in (Status.OK, Status.RUNTIME_ERROR, Status.SYNTAX_ERROR) or not r.message
        else (r.stderr + ("\n" if r.stderr and not r.stderr.endswith("\n") else "") + r.message),
    }
    return {
        "status": "Success" if r.ok else "Failed",
        "message": r.message,
        "compile_result": None,
        "run_result": run,
        "executor_pod_name": None,
        "files": {},
    }
