"""`tirl analyze`: entropies equal a direct forward pass, hand-built trajectories are classified right,
and the command writes the tables for one or two real (tiny) models."""

from __future__ import annotations

import json

import pytest
import torch
from typer.testing import CliRunner

from tirl.analysis import classify_positions, high_entropy_tokens, read_trajectories, token_entropies
from tirl.analysis.entropy import AnalysisError, load_model
from tirl.cli import app


def record(prompt_ids, response_ids, loss_mask, reward=1.0) -> dict:
    return {"prompt_ids": prompt_ids, "response_ids": response_ids, "loss_mask": loss_mask, "reward": reward}


def write(path, records) -> str:
    path.write_text("".join(json.dumps(r) + "\n" for r in records))
    return str(path)


def test_entropies_equal_a_direct_forward_pass(tiny_model_dir, tmp_path):
    gen = torch.Generator().manual_seed(0)
    records = []
    for prompt, response in ((5, 9), (12, 30), (3, 2), (7, 17)):  # unequal lengths: padded batches
        ids = torch.randint(10, 400, (prompt + response,), generator=gen).tolist()
        records.append(record(ids[:prompt], ids[prompt:], [1] * response))
    trajs = read_trajectories(write(tmp_path / "t.jsonl", records))
    model = load_model(tiny_model_dir)
    batched = token_entropies(model, trajs, max_tokens=64)  # several batches, right padding
    for t, got in zip(trajs, batched, strict=True):
        with torch.no_grad():
            logits = model(input_ids=torch.tensor([t.prompt_ids + t.response_ids])).logits[0]
        p = len(t.prompt_ids)
        direct = torch.distributions.Categorical(logits=logits[p - 1 : -1]).entropy()
        assert len(got) == len(t.response_ids)
        assert torch.allclose(torch.tensor(got), direct, atol=1e-5)


def test_positions_after_a_tool_response_are_reflection_within_the_window():
    mask = [1, 1, 1, 0, 0, 1, 1, 1, 1, 0, 1]
    F, R = "forking", "reflection"
    assert classify_positions(mask, window=2) == [F, F, F, None, None, R, R, F, F, None, R]
    assert classify_positions([1, 1], window=5) == [F, F]  # no tool call: all the model's own reasoning


def test_high_entropy_tokens_of_hand_built_trajectories():
    # Two trajectories; tokens are named by id. Generated tokens: 11 forking, 4 reflection (window 2).
    masks = [[1, 1, 1, 1, 0, 0, 1, 1, 1], [1, 1, 1, 1, 1, 1, 0, 1, 1]]
    ids = [[1, 2, 3, 4, 90, 91, 5, 6, 7], [1, 2, 8, 4, 4, 3, 92, 5, 9]]
    ents = [[0.1, 0.2, 0.1, 3.0, 9.0, 9.0, 2.5, 0.1, 0.3], [0.1, 0.2, 0.1, 0.2, 2.8, 0.1, 9.9, 2.6, 0.1]]
    r = high_entropy_tokens(ents, masks, ids, lambda i: f"t{i}", top=0.2, window=2)
    # 15 generated tokens; the top 20% are the 3 highest: 3.0 (t4, forking), 2.8 (t4, forking), 2.6 (t5, reflection)
    # 2.5 (t5, reflection) is the 4th: below the 80th percentile. Tool-response entropies (9.x) never count.
    assert r.generated == {"forking": 11, "reflection": 4}
    assert r.high == {"forking": 2, "reflection": 1}
    assert r.tokens["forking"].most_common() == [("t4", 2)] and r.tokens["reflection"].most_common() == [
        ("t5", 1)
    ]
    assert r.share("reflection") == pytest.approx(1 / 3) and r.rate("reflection") == pytest.approx(1 / 4)


def test_analyze_command_with_two_models(tiny_model_dir, tmp_path):
    from tirl.engines.tokenizer import load_tokenizer
    from tirl.tiny_model import create_tiny_model

    tok = load_tokenizer(str(tiny_model_dir))

    def enc(text):
        return tok(text, add_special_tokens=False)["input_ids"]

    prompt = enc("<|im_start|>user\nWhat is 12 times 34 modulo 5?<|im_end|>\n<|im_start|>assistant\n")
    turn1, tool, turn2 = (
        enc("Let me compute it.<tool_call>"),
        enc("<tool_response>3</tool_response>"),
        enc("So 3."),
    )
    rec = record(prompt, turn1 + tool + turn2, [1] * len(turn1) + [0] * len(tool) + [1] * len(turn2))
    no_tool = record(prompt, enc("It is about 2."), [1] * len(enc("It is about 2.")), reward=0.0)
    path = write(tmp_path / "trajectories.jsonl", [rec, no_tool])
    other = create_tiny_model(tmp_path / "other", preset="tiny", seed=1)
    out = tmp_path / "analysis"
    args = ["analyze", "--trajectories", path, "--model", str(tiny_model_dir), "--model2", str(other)]
    result = CliRunner().invoke(app, [*args, "--out", str(out), "--window", "3"])
    assert result.exit_code == 0, result.output
    analysis = json.loads((out / "analysis.json").read_text())
    generated = len(turn1) + len(turn2) + len(enc("It is about 2."))
    reflection = min(3, len(turn2))
    for name in ("model", "model2"):
        res = analysis["results"][name]
        assert res["generated"] == {"forking": generated - reflection, "reflection": reflection}
        assert sum(res["high_entropy"].values()) == pytest.approx(0.2 * generated, abs=1)
    assert analysis["plotted_trajectory"] == 0  # the one with a tool response
    report = (out / "report.md").read_text()
    assert "Most frequent high-entropy reflection tokens (model2)" in report and "same trajectories" in report
    assert (out / "entropy_trajectory.png").read_bytes()[:4] == b"\x89PNG"


@pytest.mark.parametrize(
    ("line", "message"),
    [
        ("not json", "not valid JSON"),
        ('{"prompt_ids": [1], "response_ids": [2]}', "missing loss_mask"),
        ('{"prompt_ids": [1], "response_ids": [2, 3], "loss_mask": [1]}', "loss_mask has 1 entries for 2"),
        ('{"prompt_ids": [], "response_ids": [2], "loss_mask": [1]}', "empty prompt_ids"),
    ],
)
def test_bad_trajectories_say_what_is_wrong(tmp_path, line, message):
    path = tmp_path / "bad.jsonl"
    path.write_text(line + "\n")
    with pytest.raises(AnalysisError, match=message):
        read_trajectories(path)


def test_cli_reports_bad_input_in_one_line(tmp_path):
    result = CliRunner().invoke(
        app, ["analyze", "--trajectories", str(tmp_path / "none.jsonl"), "--model", "x"]
    )
    assert result.exit_code == 2 and "trajectories file not found" in result.output
