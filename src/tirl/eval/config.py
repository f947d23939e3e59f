"""How an evaluation samples (the paper: 16 samples, temperature 0.6, 30 turns, up to 30K tokens), and
which agent settings (prompt, tool schema, template, budgets) it prompts the model with."""

from __future__ import annotations

from pathlib import Path

from pydantic import BaseModel, ConfigDict, Field

from tirl.agent.config import AgentConfig

# A model tirl did not train gets the paper's prompt and tool with the paper's evaluation budgets.
PAPER_EVAL_AGENT = AgentConfig(max_turns=30, max_response_tokens=30000)


class EvalConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    samples: int = Field(16, ge=1)  # k: trajectories per problem
    temperature: float = Field(0.6, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    max_turns: int | None = Field(None, ge=1)  # None: the agent settings' (the paper's: 30)
    max_tokens: int | None = Field(None, ge=1)  # response budget (generated + tool-response tokens);
    # None: the agent settings' max_response_tokens (the paper's: 30000)
    seed: int = 0  # sample j of problem i is seeded by (seed, i, j): reruns reproduce
    concurrency: int = Field(256, ge=1)  # trajectories in flight
    # The rest (prompt, tool schema, template, tool limits). None: the settings saved with the model
    # (tirl_agent.yaml, written by tirl sft/train), else PAPER_EVAL_AGENT. The fields above override it.
    agent: AgentConfig | None = None

    def agent_config(self) -> AgentConfig:
        update = {"temperature": self.temperature, "top_p": self.top_p}
        if self.max_turns is not None:
            update["max_turns"] = self.max_turns
        if self.max_tokens is not None:
            update["max_response_tokens"] = self.max_tokens
        return (self.agent or PAPER_EVAL_AGENT).model_copy(update=update)


def with_model_agent(cfg: EvalConfig, model_path: str | Path) -> tuple[EvalConfig, str]:
    """`cfg` with the agent settings to use for this model, and a line saying which they are."""
    from tirl.rl.checkpoint import saved_agent_settings

    if cfg.agent is not None:
        return cfg, "agent settings: as given (--agent or the eval config's agent section)"
    saved = saved_agent_settings(model_path)
    if saved is None:
        return cfg, (
            "agent settings: the paper's prompt and tool (the model has no tirl_agent.yaml; "
            "give --agent FILE for others)"
        )
    agent, path = saved
    return cfg.model_copy(update={"agent": agent}), f"agent settings: saved with the model ({path})"
