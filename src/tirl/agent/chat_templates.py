"""Chat templates tirl ships for model families beyond Qwen, for tokenizers that come without one.

`LLAMA3_CHAT_TEMPLATE` is tirl's own rendering of the Llama 3.x prompt format as Meta documents it:
`<|begin_of_text|>`, each message as `<|start_header_id|>ROLE<|end_header_id|>\\n\\n` + content +
`<|eot_id|>`, tool results in the `ipython` role, tool calls as one JSON object
`{"name": ..., "parameters": {...}}`, the function signatures listed in the system message. Unlike
Meta's file it does not trim message text, so what the model generated renders back unchanged and a
recorded conversation extends turn by turn (tirl.agent.openai_server).
"""

from __future__ import annotations

# Newlines right after a block tag are written as {{ '\n' }}: transformers renders with trim_blocks.
LLAMA3_CHAT_TEMPLATE = (
    "{{ bos_token }}"
    "{% set sys = messages[0].content if messages and messages[0].role == 'system' else '' %}"
    "{% if sys or tools %}<|start_header_id|>system<|end_header_id|>{{ '\\n\\n' }}{{ sys }}"
    "{% if tools %}{{ '\\n\\n' if sys else '' }}You can call these functions. To call one, answer with "
    'only a JSON object {"name": function name, "parameters": its arguments}.'
    "{% for t in tools %}{{ '\\n' }}{{ t | tojson }}{% endfor %}{% endif %}<|eot_id|>{% endif %}"
    "{% for m in messages %}"
    "{% if m.role == 'system' %}"
    "{% elif m.role in ['tool', 'ipython'] %}"
    "<|start_header_id|>ipython<|end_header_id|>{{ '\\n\\n' }}{{ m.content }}<|eot_id|>"
    "{% else %}<|start_header_id|>{{ m.role }}<|end_header_id|>{{ '\\n\\n' }}{{ m.content or '' }}"
    "{% for tc in m.tool_calls or [] %}{% set f = tc.function if tc.function else tc %}"
    '{"name": "{{ f.name }}", "parameters": '
    "{{ f.arguments if f.arguments is string else f.arguments | tojson }}}"
    "{% endfor %}<|eot_id|>{% endif %}"
    "{% endfor %}"
    "{% if add_generation_prompt %}<|start_header_id|>assistant<|end_header_id|>{{ '\\n\\n' }}{% endif %}"
)

TEMPLATES = {"llama3": LLAMA3_CHAT_TEMPLATE}


def use_template(tokenizer, family: str):
    """Give `tokenizer` tirl's template of `family` (e.g. a Llama 3 tokenizer.json without a config)."""
    if family not in TEMPLATES:
        raise ValueError(f"no tirl chat template {family!r}: choose one of {', '.join(TEMPLATES)}")
    tokenizer.chat_template = TEMPLATES[family]
    return tokenizer
