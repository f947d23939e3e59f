"""benchmarks/vs_trl.py without running TRL: its arguments, the one-line error when TRL is missing, and
the chat template that makes TRL's prompts tirl's (checked against tirl's own rendering)."""

from __future__ import annotations

import importlib.util

import pytest

import vs_trl


def test_defaults_run_both_sides_on_both_engines():
    args = vs_trl.parse_args(["--demo", "runs/demo"])
    assert args.sides == ["tirl", "trl"] and args.engines == ["hf", "vllm"]
    assert args.steps is None and not args.roc and args.child is None and args.overrides == []


def test_arguments_and_overrides_are_passed_through():
    args = vs_trl.parse_args(
        ["--demo", "d", "--steps", "3", "--engines", "hf", "--sides", "trl", "--roc", "demo.seed=1"]
    )
    assert (args.steps, args.engines, args.sides, args.roc) == (3, ["hf"], ["trl"], True)
    assert vs_trl.side_overrides(args, "hf") == ["demo.seed=1", "train.engine.backend=hf", "demo.rl_steps=3"]
    plain = vs_trl.parse_args(["--demo", "d"])
    assert vs_trl.side_overrides(plain, "vllm") == ["train.engine.backend=vllm", "train.algorithm.roc=off"]


def test_a_real_model_demo_runs_both_sides_with_its_preset(tmp_path):
    """`--demo runs/real`: the pretrained model's settings (configs/demo/real.yaml and its model) come
    from the directory's settings.json, before the command line's; a tiny demo's add nothing."""
    import json

    from tirl.demo.pipeline import real_overrides

    model = tmp_path / "model"
    model.mkdir()
    (model / "config.json").write_text("{}")
    demo = tmp_path / "real"
    demo.mkdir()
    (demo / "settings.json").write_text(json.dumps({"demo": {"model": str(model)}}))
    args = vs_trl.parse_args(["--demo", str(demo), "demo.seed=2"])
    got = vs_trl.side_overrides(args, "vllm")
    assert got == [
        *real_overrides(model),
        "demo.seed=2",
        "train.engine.backend=vllm",
        "train.algorithm.roc=off",
    ]
    assert f"demo.model={model.resolve()}" in got and "demo.drill_steps=0" in got
    (demo / "settings.json").write_text(json.dumps({"demo": {"model": None}}))
    assert vs_trl.demo_overrides(args) == ["demo.seed=2"]


@pytest.mark.parametrize(
    "argv",
    [
        [],
        ["--demo", "d", "--steps", "0"],
        ["--demo", "d", "--engines", "sglang"],
        ["--demo", "d", "--trl-micro-batch", "0"],
    ],
)
def test_bad_arguments_are_refused(argv, capsys):
    with pytest.raises(SystemExit) as exc:
        vs_trl.parse_args(argv)
    assert exc.value.code == 2
    assert "error" in capsys.readouterr().err


def test_missing_trl_is_one_clear_line(monkeypatch, tmp_path):
    real = importlib.util.find_spec
    monkeypatch.setattr(
        importlib.util, "find_spec", lambda name, *a: None if name == "trl" else real(name, *a)
    )
    with pytest.raises(SystemExit) as exc:
        vs_trl.main(["--demo", str(tmp_path)])
    message = str(exc.value.code)
    assert "\n" not in message and "trl==" + vs_trl.TRL_VERSION in message and "trl-bench" in message
    # tirl's side alone needs no TRL: it goes on to check the demo directory instead
    with pytest.raises(SystemExit, match="not a finished `tirl demo` directory"):
        vs_trl.main(["--demo", str(tmp_path), "--sides", "tirl"])


def test_the_chat_template_renders_tirls_prompt_and_tool_turn():
    from transformers import PreTrainedTokenizerFast

    from tirl.agent.protocol import build_prompt_text, tool_response_text
    from tirl.demo.pipeline import load_settings

    agent = load_settings().agent
    tok = PreTrainedTokenizerFast(tokenizer_object=_whitespace_tokenizer())
    tok.chat_template = vs_trl.chat_template(agent)

    def python(code: str) -> str:
        """Run code.

        Args:
            code: the code
        """
        return code

    messages = [
        {"role": "system", "content": agent.system_prompt},
        {"role": "user", "content": "What is 2+2?"},
    ]
    text = tok.apply_chat_template(messages, tools=[python], add_generation_prompt=True, tokenize=False)
    assert text == build_prompt_text(tok, "What is 2+2?", agent)
    call = [{"type": "function", "function": {"name": "python", "arguments": {"code": "print(4)"}}}]
    head = [*messages, {"role": "assistant", "content": "x", "tool_calls": call}]
    before = tok.apply_chat_template(head, tools=[python], tokenize=False)
    assert (
        '<tool_call>\n{"name": "python", "arguments": {"code": "print(4)"}}\n</tool_call><|im_end|>' in before
    )
    after = tok.apply_chat_template(
        [*head, {"role": "tool", "name": "python", "content": "4"}],
        tools=[python],
        add_generation_prompt=True,
        tokenize=False,
    )
    cut = before.rindex("<|im_end|>") + len("<|im_end|>")  # where TRL cuts (after the turn's EOS)
    assert after[:cut] == before[:cut]
    assert after[cut:] == tool_response_text(["4"], agent, turn_closed=True)


def _whitespace_tokenizer():
    from tokenizers import Tokenizer, models, pre_tokenizers

    tok = Tokenizer(models.WordLevel({"[UNK]": 0}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    return tok


def test_a_sides_cpu_seconds_count_its_child_and_reach_the_table():
    import subprocess
    import sys

    before = vs_trl._children_cpu_s()
    subprocess.run(
        [
            sys.executable,
            "-c",
            "import time\nt = time.process_time()\nwhile time.process_time() - t < 0.5: pass",
        ],
        check=True,
    )
    assert vs_trl._children_cpu_s() - before >= 0.45  # the child's own CPU time, not the wall time

    run = {
        "side": "tirl",
        "engine": "hf",
        "algorithm": "GRPO",
        "steps": 2,
        "step_s": [3.0, 5.0],
        "rollout_s": [1.0, 2.0],
        "update_s": [2.0, 3.0],
        "generated_tokens": 300,
        "reward": [0.1, 0.3],
        "peak_rss_tree_mb": 900.0,
        "peak_rss_self_mb": 400.0,
        "cpu_s": 12.4,
        "process_wall_s": 20.6,
    }
    failed = {"side": "trl", "engine": "vllm", "error": "exit code 1"}
    lines = vs_trl.table([vs_trl.summarize(run), failed], None).splitlines()
    widths = {line.count("|") for line in lines}
    assert len(widths) == 1, lines  # the failed row has as many cells as the header
    assert "| 12 / 21 |" in lines[2] and "| 4.0 | 1.5 | 2.5 | 100 |" in lines[2]


def test_trls_side_scores_the_models_own_turns_only(tokenizer):
    """A tool output that prints an answer does not answer for TRL's model either (as in tirl)."""
    from tirl.reward.verify import score

    model = tokenizer("I will run it.<|im_end|>", add_special_tokens=False)["input_ids"]
    printed = tokenizer(
        "\n<|im_start|>user\n<tool_response>\n</tool_response><answer>\\boxed{7}</answer>\n</tool_response>"
        "<|im_end|>\n<|im_start|>assistant\n",
        add_special_tokens=False,
    )["input_ids"]
    final = tokenizer("No answer.<|im_end|>", add_special_tokens=False)["input_ids"]
    ids, mask = model + printed + final, [1] * len(model) + [0] * len(printed) + [1] * len(final)
    assert score(tokenizer.decode(ids), "7") == 1.0  # the whole transcript: the printed box answers
    turns = vs_trl.model_turns(tokenizer, ids, mask)
    assert turns == ["I will run it.<|im_end|>", "No answer.<|im_end|>"] and score(turns, "7") == 0.0
    answered = tokenizer("<answer>\\boxed{7}</answer><|im_end|>", add_special_tokens=False)["input_ids"]
    assert score(vs_trl.model_turns(tokenizer, answered, [1] * len(answered)), "7") == 1.0
