"""Tiny Qwen3-architecture models with a locally trained tokenizer: no hub, no network.

The tokenizer splits digits one by one (the `demo` preset instead has one token per integer below
1000), keeps the chat and tool markup as single tokens, and ships a Qwen-style chat template with
tool support, so the same agent code path runs on the tiny model and on Qwen3.
"""

from __future__ import annotations

import json
from pathlib import Path

import torch
from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers
from transformers import AutoModelForCausalLM, PreTrainedTokenizerFast, Qwen3Config

SPECIAL_TOKENS = [
    "<|endoftext|>",
    "<|im_start|>",
    "<|im_end|>",
    "<tool_call>",
    "</tool_call>",
    "<tool_response>",
    "</tool_response>",
    "<think>",
    "</think>",
]
# Markup the agent protocol uses as text; single tokens make it cheap for a tiny model to emit.
MARKUP_TOKENS = ["<reason>", "</reason>", "<answer>", "</answer>", "\\boxed{"]

# ~1M parameters: tests and quick checks.
_TINY = dict(
    hidden_size=128,
    intermediate_size=384,
    num_hidden_layers=4,
    num_attention_heads=4,
    num_key_value_heads=2,
    head_dim=32,
    vocab_size=1024,
)
PRESETS: dict[str, dict] = {
    "tiny": _TINY,
    # The CPU demo (~1M parameters): a token for every integer below 1000, so copying a number (problem
    # -> code, tool output -> answer) is one token; 2 layers of 16 heads, because a model with many heads
    # per layer learns to copy far sooner, and copy heads (init_copy_heads), with which it learns to copy
    # in 75-100 drill steps instead of 325-575 on seeds 0-4 (configs/demo/drills.yaml, docs/results.md).
    "demo": {
        **_TINY,
        "num_hidden_layers": 2,
        "num_attention_heads": 16,
        "num_key_value_heads": 16,
        "number_tokens": True,
        "copy_heads": True,
    },
    # ~5M parameters.
    "small": dict(
        hidden_size=256,
        intermediate_size=768,
        num_hidden_layers=6,
        num_attention_heads=8,
        num_key_value_heads=4,
        head_dim=32,
        vocab_size=2048,
    ),
}

# A Qwen2.5/Qwen3-style template (written for tirl): tools go in the system turn inside <tools>,
# assistant tool calls are JSON in <tool_call>, tool results come back in a user turn. The string
# has no incidental whitespace, so no Jinja whitespace control is needed; a newline right after a
# block tag is written as {{ '\\n' }} because transformers renders with trim_blocks.
CHAT_TEMPLATE = (
    "{% set sys = messages[0].content if messages and messages[0].role == 'system' else '' %}"
    "{% if tools or sys %}<|im_start|>system\n{{ sys }}"
    "{% if tools %}{{ '\n\n' if sys else '' }}# Tools\n\nYou may call one or more functions to assist with "
    "the user query.\n\nYou are provided with function signatures within <tools></tools> XML tags:\n<tools>"
    "{% for tool in tools %}{{ '\\n' }}{{ tool | tojson }}{% endfor %}{{ '\\n' }}</tools>\n\nFor each function call, return a "
    "json object with function name and arguments within <tool_call></tool_call> XML tags:\n<tool_call>\n"
    '{"name": <function-name>, "arguments": <args-json-object>}\n</tool_call>'
    "{% endif %}<|im_end|>\n{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' %}"
    "{% elif m.role == 'tool' %}"
    "{% if loop.first or messages[loop.index0 - 1].role != 'tool' %}<|im_start|>user{% endif %}"
    "{{ '\\n' }}<tool_response>\n{{ m.content }}\n</tool_response>"
    "{% if loop.last or messages[loop.index0 + 1].role != 'tool' %}<|im_end|>\n{% endif %}"
    "{% else %}<|im_start|>{{ m.role }}\n{{ m.content if m.content else '' }}"
    "{% if m.tool_calls %}{% for tc in m.tool_calls %}"
    "{% set f = tc.function if tc.function else tc %}"
    "{{ '\n' if (m.content or not loop.first) else '' }}<tool_call>\n"
    '{"name": "{{ f.name }}", "arguments": {{ (f.arguments if f.arguments is string else f.arguments | tojson) }}}'
    "\n</tool_call>{% endfor %}{% endif %}<|im_end|>\n"
    "{% endif %}{% endfor %}"
    "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}"
)


def _corpus() -> list[str]:
    """Text shaped like what the tiny model will read and write: prompts, reasoning, Python, JSON."""
    words = (
        "Compute find the value of sum product remainder when divided by how many integers between and "
        "inclusive are divisible the number of ways to choose last digits digit greatest common divisor "
        "least multiple factorial power modulo prime primes less than equal greater Let Solve problem "
        "answer final Please reason step by step put your within I will use Python to compute this "
        "result is so The tool returned output error fix code again check verify"
    ).split()
    python = [
        "print(sum(range(1, 101)))",
        "import math\nprint(math.comb(10, 3))",
        "from math import gcd, factorial\nprint(gcd(12, 18), factorial(5))",
        "n = int(input())\nprint(n * (n + 1) // 2)",
        "total = 0\nfor i in range(1, 1000):\n    if i % 3 == 0 or i % 5 == 0:\n        total += i\nprint(total)",
        "print(pow(2, 100, 1000007))",
        "import sympy\nprint(sympy.isprime(97), sympy.factorint(360))",
        "def f(x):\n    return x ** 2 + 3 * x - 4\n\nprint([f(k) for k in range(5)])",
        "count = len([k for k in range(2, 50) if all(k % d for d in range(2, k))])\nprint(count)",
        "Traceback (most recent call last):\nNameError: name 'x' is not defined\nSyntaxError: invalid syntax",
    ]
    chat = [
        '{"name": "execute_python_code_with_standard_io", "arguments": {"code": "print(1 + 1)", "input": ""}}',
        "<reason>I will use Python to compute this.</reason>\n<answer>The answer is \\boxed{42}.</answer>",
        "Please reason step by step, and put your final answer within \\boxed{}.",
    ]
    sentences = [" ".join(words[i : i + 12]) for i in range(0, len(words), 6)]
    digits = [" ".join(str(n) for n in range(k, k + 40)) for k in range(0, 400, 40)]
    return sentences * 20 + python * 30 + chat * 30 + digits * 5


def number_tokens() -> list[str]:
    """Every 1-3 digit string ("7", "07", "007", ..., "999"): longer numbers split into 3-digit chunks."""
    return [f"{i:0{width}d}" for width in (1, 2, 3) for i in range(10**width)]


def build_tokenizer(vocab_size: int, numbers_as_tokens: bool = False) -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        special_tokens=SPECIAL_TOKENS,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tok.train_from_iterator(_corpus(), trainer=trainer)
    fast = PreTrainedTokenizerFast(
        tokenizer_object=tok,
        eos_token="<|im_end|>",
        pad_token="<|endoftext|>",
        additional_special_tokens=SPECIAL_TOKENS[1:],
        model_max_length=32768,
    )
    fast.add_tokens(MARKUP_TOKENS)
    if numbers_as_tokens:
        # Added tokens match leftmost-longest before pre-tokenization: "3249855" -> "324" "985" "5".
        fast.add_tokens(number_tokens())
    fast.chat_template = CHAT_TEMPLATE
    return fast


def create_tiny_model(out_dir: str | Path, preset: str = "tiny", seed: int = 0) -> Path:
    """Write a randomly initialized Qwen3 model + tokenizer to `out_dir`; returns the path."""
    if preset not in PRESETS:
        raise ValueError(f"unknown preset {preset!r}; choose one of {sorted(PRESETS)}")
    spec = dict(PRESETS[preset])
    out = Path(out_dir)
    out.mkdir(parents=True, exist_ok=True)
    tokenizer = build_tokenizer(spec.pop("vocab_size"), numbers_as_tokens=spec.pop("number_tokens", False))
    copy_heads = spec.pop("copy_heads", False)
    # Round the embedding up to a multiple of 64 (added tokens sit past the BPE vocabulary).
    vocab = (len(tokenizer) + 63) // 64 * 64
    config = Qwen3Config(
        vocab_size=vocab,
        max_position_embeddings=8192,
        rope_theta=10000.0,
        tie_word_embeddings=True,
        bos_token_id=None,
        eos_token_id=tokenizer.convert_tokens_to_ids("<|im_end|>"),
        pad_token_id=tokenizer.pad_token_id,
        torch_dtype="float32",
        **spec,
    )
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config)
    if copy_heads:
        init_copy_heads(model, seed)
    model.generation_config.eos_token_id = [
        config.eos_token_id,
        tokenizer.convert_tokens_to_ids("<|endoftext|>"),
    ]
    model.generation_config.pad_token_id = tokenizer.pad_token_id
    model.save_pretrained(out)
    tokenizer.save_pretrained(out)
    (out / "tirl_preset.json").write_text(json.dumps({"preset": preset, "seed": seed}))
    return out


def init_copy_heads(model: torch.nn.Module, seed: int = 0) -> None:
    """Start every attention head as a copy head: its value -> output map is the identity on a random
    head_dim-wide subspace of the residual stream (value = U^T, output = U, U orthonormal).

    With tied embeddings, a head that attends to a token then writes that token's own direction, so
    its logit rises: what a model needs to copy a number from a problem into code or from a tool's
    output into the answer. Pretraining gives a real model that; a model trained from scratch has to
    find it in an abrupt phase change whose step moves with the seed by hundreds of steps (docs/results.md,
    issue 44). With copy heads it only has to learn where to attend (queries and keys keep their random init).
    """
    config = model.config
    if config.num_key_value_heads != config.num_attention_heads:
        raise ValueError("copy heads need as many key/value heads as query heads")
    d, gen = config.head_dim, torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for layer in model.model.layers:
            attn = layer.self_attn
            for h in range(config.num_attention_heads):
                u, _ = torch.linalg.qr(torch.randn(config.hidden_size, d, generator=gen))
                attn.v_proj.weight[h * d : (h + 1) * d] = u.T
                attn.o_proj.weight[:, h * d : (h + 1) * d] = u
