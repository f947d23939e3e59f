"""How the agent runs a trajectory: turns, budgets, sampling, tool limits, prompt."""

from __future__ import annotations

from pydantic import BaseModel, ConfigDict, Field, model_validator

from tirl.agent.tools import DEFAULT_TOOLS, toolbox


class AgentConfig(BaseModel):
    model_config = ConfigDict(extra="forbid")

    max_turns: int = Field(10, ge=1)  # T: 10 in RL stages 1-2, 15 in stage 3, 30 at evaluation
    max_response_tokens: int = Field(8192, ge=1)  # budget for generated + tool-response tokens
    max_turn_tokens: int | None = Field(None, ge=1)  # cap on one turn's generation (None: the budget left)
    temperature: float = Field(1.0, ge=0.0)
    top_p: float = Field(1.0, gt=0.0, le=1.0)
    tool_timeout: float = Field(10.0, gt=0)  # execution limit per call, enforced by the sandbox (s)
    tool_wait_timeout: float = Field(120.0, gt=0)  # hard cap on waiting for the executor (queue + retries)
    generation_timeout: float = Field(1800.0, gt=0)  # hard cap on one turn's generation (s)
    tool_output_max_chars: int = Field(2048, ge=64)  # longer tool output keeps its head and tail
    show_exec_time: bool = True  # run time in tool responses; off = same code, same text (reproducible)
    max_calls_per_turn: int = Field(1, ge=1)  # extra calls in one turn get an error response
    stop_at_tool_call: bool = True  # end a turn at </tool_call> so the call runs at once
    # A turn in which the model writes a <tool_response> frame itself ends where the frame starts: the
    # made-up observation is neither run nor trained on (it is counted either way: forged_observations).
    stop_at_forged_observation: bool = True
    system_prompt: str | None = None  # None: the paper's prompt (tirl.agent.protocol.DEFAULT_SYSTEM_PROMPT)
    user_prompt: str | None = None  # template with {problem}; None: DEFAULT_USER_PROMPT
    # Tools the model may call: built-in names (tirl.agent.tools.BUILTIN_TOOLS) or `module:Class` paths
    # of tirl.agent.tools.Tool subclasses; all their schemas go into the prompt's <tools>.
    tools: list[str] = Field(default_factory=lambda: list(DEFAULT_TOOLS))
    tool_schema: dict | None = None  # replaces the FIRST tool's schema as the model sees it (None: its own)
    prefill: str = "<reason>"  # written after <|im_start|>assistant\n of the first turn
    continue_prefill: str | None = None  # after a tool response; None: the same as prefill
    use_chat_template: bool = True  # the tokenizer's template when it supports tools, else built-in ChatML

    @model_validator(mode="after")
    def _tools_load(self) -> AgentConfig:
        toolbox(self.tools, self.tool_schema)  # a bad path or schema fails here, at config load
        return self
