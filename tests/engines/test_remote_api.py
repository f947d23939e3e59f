"""engine.backend=remote without a server: the wire formats (vLLM, SGLang), metrics parsing, the
weights written once per sync, and the errors that say what to set."""

from __future__ import annotations

import socket
from pathlib import Path

import pytest
import torch

from tirl.engines.base import SamplingParams
from tirl.engines.config import EngineConfig, RemoteServers
from tirl.engines.factory import build_engines
from tirl.engines.remote import (
    ServerEngine,
    ServerError,
    ServerFleet,
    SGLangServerAPI,
    VLLMServerAPI,
    parse_sglang_load,
    parse_vllm_metrics,
)

METRICS = """# TYPE vllm:kv_cache_usage_perc gauge
vllm:kv_cache_usage_perc{engine="0",model_name="tiny"} 0.25
# TYPE vllm:num_preemptions_total counter
vllm:num_preemptions_total{engine="0",model_name="tiny"} 3.0
# TYPE vllm:cache_config_info gauge
vllm:cache_config_info{block_size="128",engine="0",num_gpu_blocks="76"} 1.0
"""


def config(model: str, urls: list[str], weights_dir: Path | str = "", **remote) -> EngineConfig:
    servers = RemoteServers(urls=urls, weights_dir=str(weights_dir), **remote)
    return EngineConfig(backend="remote", model=model, remote=servers)


def test_vllm_metrics_give_total_free_kv_and_preemptions():
    load = parse_vllm_metrics(METRICS)
    assert (load.total_tokens, load.used_share, load.preemptions) == (76 * 128, 0.25, 3)


def test_vllm_request_is_token_ids_with_logprobs_spelled_as_ids():
    api = VLLMServerAPI("tiny")
    body = api.generate_body([1, 2, 3], SamplingParams(0.7, 0.9, 16, [2], ["</tool_call>"], 5), 16)
    assert body["prompt"] == [1, 2, 3] and body["logprobs"] == 0
    assert body["return_tokens_as_token_ids"] and body["return_token_ids"]
    assert body["include_stop_str_in_output"] and not body["skip_special_tokens"]
    assert (body["seed"], body["stop"], body["stop_token_ids"]) == (5, ["</tool_call>"], [2])
    answer = {
        "choices": [
            {
                "token_ids": [7, 2],
                "logprobs": {"tokens": ["token_id:7", "token_id:2"], "token_logprobs": [-0.5, -1.0]},
                "finish_reason": "stop",
            }
        ]
    }
    gen = api.parse_generation(answer)
    assert (gen.token_ids, gen.logprobs, gen.finish_reason) == ([7, 2], [-0.5, -1.0], "stop")
    answer["choices"][0]["logprobs"]["tokens"] = ["token_id:7", "token_id:3"]
    with pytest.raises(ServerError, match="do not match"):
        api.parse_generation(answer)
    answer["choices"][0]["logprobs"]["tokens"] = ["a", "b"]
    with pytest.raises(ServerError, match="return_tokens_as_token_ids"):
        api.parse_generation(answer)


def test_sglang_request_and_answer():
    api = SGLangServerAPI()
    body = api.generate_body([4, 5], SamplingParams(1.0, 1.0, 8, [2], ["x"], 9), 8)
    assert body["input_ids"] == [4, 5] and body["return_logprob"]
    sp = body["sampling_params"]
    assert (sp["max_new_tokens"], sp["stop"], sp["sampling_seed"], sp["no_stop_trim"]) == (8, ["x"], 9, True)
    answer = {
        "output_ids": [6, 2],
        "meta_info": {
            "output_token_logprobs": [[-0.1, 6, None], [-0.2, 2, None]],
            "finish_reason": {"type": "length", "length": 2},
        },
    }
    gen = api.parse_generation(answer)
    assert (gen.token_ids, gen.logprobs, gen.finish_reason) == ([6, 2], [-0.1, -0.2], "length")
    answer["output_ids"] = [6, 3]
    with pytest.raises(ServerError, match="disagree"):
        api.parse_generation(answer)


def test_sglang_load_sums_data_parallel_ranks():
    body = {"loads": [{"max_total_num_tokens": 100, "num_used_tokens": 30}, {"max_total_num_tokens": 100}]}
    load = parse_sglang_load(body)
    assert (load.total_tokens, load.used_share) == (200, 0.15)


def test_one_weights_file_per_sync_for_all_servers(tmp_path, tiny_model_dir):
    """The runtime hands every engine the same list: the fleet writes it once; a tied head is written
    out (an in-place reload unties it)."""
    from safetensors.torch import load_file

    fleet = ServerFleet()
    cfg = config(str(tiny_model_dir), ["http://unused"], weights_dir=tmp_path)
    weights = [("model.embed_tokens.weight", torch.ones(4, 2)), ("model.norm.weight", torch.ones(2))]
    first = fleet.write_weights(cfg, weights)
    assert fleet.write_weights(cfg, weights) == first and fleet.syncs == 1
    written = load_file(str(Path(first) / "model.safetensors"))
    assert set(written) == {"model.embed_tokens.weight", "model.norm.weight", "lm_head.weight"}
    weights[1][1].add_(1)  # a training step updates a tensor in place: a new sync, in a new list or not
    second = fleet.write_weights(cfg, list(weights))
    assert second != first and not Path(first).exists() and fleet.syncs == 2
    assert [p.name for p in tmp_path.iterdir()] == [Path(second).name]
    assert fleet.write_weights(cfg, list(weights)) == second  # the same tensors, unchanged: no rewrite


def test_a_sync_that_reuses_the_last_ones_list_or_addresses_is_written_again(tmp_path, tiny_model_dir):
    """What a sync wrote is recognised by the tensors themselves, not by addresses a later sync may reuse
    (here: the same list object and first tensor, a new second tensor): stale weights never reload."""
    from safetensors.torch import load_file

    fleet = ServerFleet()
    cfg = config(str(tiny_model_dir), ["http://unused"], weights_dir=tmp_path)
    weights = [("model.embed_tokens.weight", torch.ones(4, 2)), ("model.norm.weight", torch.ones(2))]
    first = fleet.write_weights(cfg, weights)
    weights[1] = ("model.norm.weight", torch.full((2,), 3.0))
    second = fleet.write_weights(cfg, weights)
    assert second != first and fleet.syncs == 2
    assert load_file(str(Path(second) / "model.safetensors"))["model.norm.weight"].tolist() == [3.0, 3.0]


def test_no_weights_dir_says_what_to_set(tiny_model_dir):
    with pytest.raises(ValueError, match=r"engine\.remote\.weights_dir"):
        ServerFleet().write_weights(config(str(tiny_model_dir), ["http://x"]), [("w", torch.ones(1))])


def test_factory_asks_for_urls_and_a_tokenizer_copy(tiny_model_dir):
    with pytest.raises(ValueError, match=r"engine\.remote\.urls"):
        build_engines(config(str(tiny_model_dir), []))
    with pytest.raises(ValueError, match=r"engine\.model is empty"):
        build_engines(config("", ["http://127.0.0.1:9"]))


def test_a_server_that_never_answers_fails_with_its_url(tiny_model_dir):
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    url = f"http://127.0.0.1:{port}"
    with pytest.raises(RuntimeError, match=url):
        ServerEngine(config(str(tiny_model_dir), [url], start_timeout_s=1.0), url, "remote0")
