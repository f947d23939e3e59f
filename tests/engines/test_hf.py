"""HFEngine on the tiny Qwen3 model: batching, stop conditions, seeds, logprobs, weight loading."""

from __future__ import annotations

import asyncio
import time

import pytest
import pytest_asyncio
import torch
from tests.logprobs import reference_logprobs

from tirl.engines import EngineConfig, SamplingParams, build_engines, build_pool, load_tokenizer
from tirl.engines.base import Engine, SingleEnginePool
from tirl.engines.hf import HFEngine


@pytest_asyncio.fixture(loop_scope="module", scope="module")
async def engine(tiny_model_dir):
    [eng] = build_engines(
        EngineConfig(model=str(tiny_model_dir), device="cpu", max_model_len=512, max_batch_size=8)
    )
    yield eng
    await eng.close()


@pytest.fixture(scope="module")
def prompts(tiny_model_dir):
    tok = load_tokenizer(tiny_model_dir)
    return [
        tok(f"Problem {i}: what is {i} + {i * 3}?", add_special_tokens=False)["input_ids"] for i in range(12)
    ]


pytestmark = pytest.mark.asyncio(loop_scope="module")


async def _until(condition, limit_s: float = 120.0) -> None:
    """Wait for the engine thread to get somewhere (a hang guard, not a timing assumption)."""
    deadline = time.monotonic() + limit_s
    while not condition():
        assert time.monotonic() < deadline, "the engine never got there"
        await asyncio.sleep(0.01)


async def test_engine_protocol_and_factory(engine, tiny_model_dir):
    assert isinstance(engine, Engine) and isinstance(engine, HFEngine)
    assert isinstance(build_pool([engine], engine.cfg), SingleEnginePool)
    cap = engine.capacity()
    assert cap.total_tokens == 8 * 512 and cap.free_tokens == cap.total_tokens


async def test_seed_gives_identical_output_and_different_seeds_differ(engine, prompts):
    params = SamplingParams(temperature=1.0, max_tokens=24, seed=7)
    a = await engine.generate(prompts[0], params)
    b = await engine.generate(prompts[0], params)
    c = await engine.generate(prompts[0], SamplingParams(temperature=1.0, max_tokens=24, seed=8))
    assert a.token_ids == b.token_ids and a.logprobs == b.logprobs
    assert a.token_ids != c.token_ids


async def test_concurrent_requests_are_batched_and_match_solo_runs(engine, prompts):
    params = [SamplingParams(temperature=1.0, max_tokens=16 + 3 * i, seed=i) for i in range(len(prompts))]
    steps0 = engine.steps
    together = await asyncio.gather(*(engine.generate(p, s) for p, s in zip(prompts, params, strict=True)))
    batched_steps = engine.steps - steps0
    assert batched_steps < sum(len(g.token_ids) for g in together) / 2  # many sequences per decode step
    for i in (0, 5, 11):  # a request's tokens do not depend on what shares its batch
        solo = await engine.generate(prompts[i], params[i])
        assert solo.token_ids == together[i].token_ids
        assert solo.logprobs == pytest.approx(together[i].logprobs, abs=1e-4)
    assert all(
        len(g.token_ids) == params[i].max_tokens
        for i, g in enumerate(together)
        if g.finish_reason == "length"
    )


@pytest.mark.parametrize(("temperature", "top_p"), [(1.0, 1.0), (0.7, 1.0), (1.3, 0.9)])
async def test_logprobs_match_a_forward_pass(engine, prompts, temperature, top_p):
    gen = await engine.generate(
        prompts[1], SamplingParams(temperature=temperature, top_p=top_p, max_tokens=20, seed=3)
    )
    ref = reference_logprobs(engine.model, prompts[1], gen.token_ids, temperature).tolist()
    if top_p == 1.0:
        assert gen.logprobs == pytest.approx(ref, abs=1e-4)
    else:  # the nucleus is renormalized: each sampled token is at least as likely as under the full softmax
        assert all(lp >= r - 1e-5 for lp, r in zip(gen.logprobs, ref, strict=True))


async def test_greedy_is_argmax(engine, prompts):
    gen = await engine.generate(prompts[2], SamplingParams(temperature=0.0, max_tokens=10))
    with torch.no_grad():
        logits = engine.model(torch.tensor([prompts[2] + gen.token_ids])).logits[0]
    assert gen.token_ids == logits[len(prompts[2]) - 1 : -1].argmax(-1).tolist()


async def test_stop_token_ids_and_stop_strings(engine, prompts):
    free = await engine.generate(prompts[3], SamplingParams(temperature=0.0, max_tokens=30))
    stop_tok = free.token_ids[5]
    first = free.token_ids.index(stop_tok)
    by_id = await engine.generate(
        prompts[3], SamplingParams(temperature=0.0, max_tokens=30, stop_token_ids=[stop_tok])
    )
    assert by_id.token_ids == free.token_ids[: first + 1] and by_id.finish_reason == "stop"
    text = engine.tokenizer.decode(free.token_ids[:12], skip_special_tokens=False)
    needle = text[-3:]  # a stop string that may end mid-token
    by_str = await engine.generate(
        prompts[3], SamplingParams(temperature=0.0, max_tokens=30, stop_strings=[needle])
    )
    out = engine.tokenizer.decode(by_str.token_ids, skip_special_tokens=False)
    assert (by_str.finish_reason == "stop" and out.endswith(needle)) or needle in out
    assert needle not in engine.tokenizer.decode(by_str.token_ids[:-1], skip_special_tokens=False)
    assert by_str.token_ids == free.token_ids[: len(by_str.token_ids)]


async def test_length_limits_and_bad_input(engine, prompts):
    gen = await engine.generate(prompts[4], SamplingParams(temperature=1.0, max_tokens=5, seed=1))
    assert len(gen.token_ids) <= 5 and len(gen.logprobs) == len(gen.token_ids)
    long_prompt = prompts[4] * 60  # > max_model_len
    with pytest.raises(ValueError, match="max_model_len"):
        await engine.generate(long_prompt, SamplingParams(max_tokens=5))
    near = (prompts[4] * 40)[:509]
    gen = await engine.generate(
        near, SamplingParams(temperature=1.0, max_tokens=50, seed=1, stop_token_ids=[])
    )
    assert len(gen.token_ids) <= 3 and (gen.finish_reason == "length" or gen.finish_reason == "stop")


def _in_use(engine: HFEngine) -> int:
    """KV tokens held by requests in the batch or waiting (what the scheduler sees)."""
    capacity = engine.capacity()
    return capacity.total_tokens - capacity.free_tokens


async def test_cancelled_request_leaves_the_batch(engine, prompts):
    # seed 1: the untrained model's first end-of-turn token comes after ~600 tokens (see below), so
    # the request is still decoding when it is cancelled
    task = asyncio.create_task(
        engine.generate(prompts[0], SamplingParams(max_tokens=10_000, seed=1, stop_token_ids=[]))
    )
    await _until(lambda: _in_use(engine) > len(prompts[0]))  # in the batch, decoding
    task.cancel()
    with pytest.raises(asyncio.CancelledError):
        await task
    ok = await engine.generate(prompts[6], SamplingParams(max_tokens=4, seed=0))
    assert len(ok.token_ids) <= 4
    await _until(lambda: _in_use(engine) == 0)  # dropped at the decode step after the cancel


async def test_load_weights_changes_outputs(engine, prompts):
    params = SamplingParams(temperature=0.0, max_tokens=12)
    before = await engine.generate(prompts[7], params)
    saved = {k: v.clone() for k, v in engine.model.state_dict().items()}
    gen = torch.Generator().manual_seed(0)
    new = [
        (n, torch.randn(p.shape, generator=gen) * 0.5)
        for n, p in engine.model.named_parameters()
        if "mlp" in n
    ]
    engine.load_weights(new)
    after = await engine.generate(prompts[7], params)
    assert after.token_ids != before.token_ids
    with pytest.raises(KeyError, match="no parameter"):
        engine.load_weights([("model.nope.weight", torch.zeros(1))])
    engine.load_weights(saved.items())
    assert (await engine.generate(prompts[7], params)).token_ids == before.token_ids


async def test_closed_engine_fails_fast(tiny_model_dir, prompts):
    eng = HFEngine(EngineConfig(model=str(tiny_model_dir), device="cpu"))
    # The untrained model emits an end-of-turn token by chance; with seed 1 its first one comes after
    # ~600 tokens, so the request is surely still decoding when the engine closes.
    pending = asyncio.create_task(
        eng.generate(prompts[0], SamplingParams(max_tokens=10_000, stop_token_ids=[], seed=1))
    )
    await _until(lambda: _in_use(eng) > len(prompts[0]))
    await eng.close()
    with pytest.raises(RuntimeError, match="closed"):
        await asyncio.wait_for(pending, 10)
    with pytest.raises(RuntimeError, match="closed"):
        await eng.generate(prompts[0], SamplingParams(max_tokens=2))


async def test_factory_errors(tiny_model_dir):
    with pytest.raises(ValueError, match="num_engines"):
        build_engines(EngineConfig(model=str(tiny_model_dir), num_engines=0))
    with pytest.raises(ValueError, match="engine\\.model is empty"):
        build_engines(EngineConfig(model=""))
    with pytest.raises(ValueError, match="cannot load a tokenizer"):
        load_tokenizer("/nonexistent/model")


async def test_sleep_on_cpu_frees_nothing_and_says_so(engine, prompts):
    """On CPU the weights already live in host memory and the KV cache only exists while requests
    run: sleep() reports that it freed nothing, and the engine keeps serving."""
    params = SamplingParams(temperature=1.0, max_tokens=12, seed=3)
    before = await engine.generate(prompts[0], params)
    assert engine.sleep() is False
    engine.wake_up()
    assert (await engine.generate(prompts[0], params)).token_ids == before.token_ids


@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA GPU (run on a lent one)")
async def test_sleep_on_a_gpu_frees_the_weights_and_wakes_up_the_same(tiny_model_dir, prompts):
    """Colocated with a trainer rank on one GPU: asleep, the engine holds no device memory (weights
    moved to the host, cached blocks returned to CUDA) and takes no requests; awake, it samples
    exactly what it sampled before."""
    [gpu] = build_engines(
        EngineConfig(model=str(tiny_model_dir), device="cuda:0", max_model_len=512, max_batch_size=8)
    )
    params = SamplingParams(temperature=1.0, max_tokens=24, seed=5)
    try:
        before = await asyncio.gather(*(gpu.generate(p, params) for p in prompts[:4]))
        weights = sum(t.nbytes for t in [*gpu.model.parameters(), *gpu.model.buffers()])
        awake, held = torch.cuda.memory_allocated(), torch.cuda.memory_reserved()
        assert gpu.sleep() is True
        assert torch.cuda.memory_allocated() <= awake - weights and torch.cuda.memory_reserved() < held
        with pytest.raises(RuntimeError, match="asleep"):
            await gpu.generate(prompts[0], params)
        gpu.wake_up()
        after = await asyncio.gather(*(gpu.generate(p, params) for p in prompts[:4]))
        assert [a.token_ids for a in after] == [b.token_ids for b in before]
    finally:
        await gpu.close()


def test_the_growing_cache_appends_in_place_and_matches_transformers_cache(tiny_model_dir):
    """The decode loop's KV cache writes each token into spare room (no whole-cache copy per step),
    adopts tensors assigned from outside, and gives the same logits as transformers' DynamicCache."""
    from transformers import AutoModelForCausalLM, DynamicCache

    from tirl.engines.hf import _growing_cache

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    ids = torch.randint(3, 200, (3, 20), generator=torch.Generator().manual_seed(0))

    def decode(cache, steps: int = 12) -> tuple[torch.Tensor, list[int]]:
        out = model(input_ids=ids, past_key_values=cache, use_cache=True)
        ptrs, logits = [], []
        for t in range(steps):
            nxt = out.logits[:, -1].argmax(-1, keepdim=True)
            if t == 6:  # rows replaced from outside: the layer must copy them into a new buffer
                for layer in cache.layers:
                    layer.keys, layer.values = layer.keys[[0, 2]], layer.values[[0, 2]]
                nxt = nxt[[0, 2]]
            out = model(input_ids=nxt, past_key_values=cache, use_cache=True)
            ptrs.append(cache.layers[0].keys.data_ptr())
            logits.append(out.logits[:, -1].flatten())
        return torch.cat(logits), ptrs

    with torch.inference_mode():
        want, _ = decode(DynamicCache(config=model.config))
        got, ptrs = decode(_growing_cache(model.config))
    assert torch.equal(got, want)
    # One buffer from the prefill up to the replacement, one after: steps 1-5 and 7-11 never move.
    assert len(set(ptrs[:6])) == 1 and len(set(ptrs[6:])) == 1 and ptrs[0] != ptrs[6]


def test_the_growing_cache_joins_and_evicts_rows_in_its_buffers(tiny_model_dir):
    """A join of longer rows (the window widens to the left, both groups left-padded) and an eviction
    (the last row moves into the hole) stay in the batch's buffers, and every row then decodes as it
    does alone."""
    from transformers import AutoModelForCausalLM, DynamicCache

    from tirl.engines.hf import _growing_cache

    model = AutoModelForCausalLM.from_pretrained(tiny_model_dir).eval()
    gen = torch.Generator().manual_seed(1)
    short, long = torch.randint(3, 200, (3, 20), generator=gen), torch.randint(3, 200, (2, 26), generator=gen)
    rows = [*short, *long]

    def solo(row: torch.Tensor, steps: int) -> list[torch.Tensor]:
        cache, logits = DynamicCache(config=model.config), []
        out = model(input_ids=row[None], past_key_values=cache, use_cache=True)
        for _ in range(steps):
            out = model(
                input_ids=out.logits[:, -1].argmax(-1, keepdim=True), past_key_values=cache, use_cache=True
            )
            logits.append(out.logits[0, -1])
        return logits

    with torch.inference_mode():
        want = [solo(r, 4) for r in rows]
        batch, joining = _growing_cache(model.config), _growing_cache(model.config)
        first = model(input_ids=short, past_key_values=batch, use_cache=True).logits[:, -1]
        second = model(input_ids=long, past_key_values=joining, use_cache=True).logits[:, -1]
        for (
            layer
        ) in batch.layers:  # garbage around the window: what the join does not overwrite must be zeroed
            start = layer._start()
            for buf in layer._buffers:
                buf[3:] = float("nan")
                buf[:, :, :start] = float("nan")
        buffers = [[b.data_ptr() for b in layer._buffers] for layer in batch.layers]
        for layer, other in zip(batch.layers, joining.layers, strict=True):
            layer.stack(other, 26)
        assert batch.layers[0].keys.shape[:3] == (5, 2, 26)
        assert torch.equal(
            batch.layers[0].keys[:3, :, :6], torch.zeros(3, 2, 6, 32)
        )  # the short rows' padding
        mask = torch.cat([torch.zeros(3, 6, dtype=torch.long), torch.ones(3, 20, dtype=torch.long)], dim=1)
        mask = torch.cat([mask, torch.ones(2, 26, dtype=torch.long)])
        positions = torch.tensor([20, 20, 20, 26, 26])
        nxt = torch.cat([first, second]).argmax(-1)
        live = list(range(5))
        for step in range(4):
            if step == 2:  # row 1 leaves: row 4 moves into its place, column 0 is padding for all left
                for layer in batch.layers:
                    layer.compact([1], [4], 4, 0)
                order = [0, 4, 2, 3]
                live, mask, positions, nxt = (
                    [live[i] for i in order],
                    mask[order],
                    positions[order],
                    nxt[order],
                )
            mask = torch.cat([mask, torch.ones(len(live), 1, dtype=torch.long)], dim=1)
            out = model(
                input_ids=nxt[:, None],
                attention_mask=mask,
                position_ids=positions[:, None],
                past_key_values=batch,
                use_cache=True,
            )
            for j, row in enumerate(live):
                assert torch.allclose(out.logits[j, -1], want[row][step], atol=1e-5), (step, row)
            positions, nxt = positions + 1, out.logits[:, -1].argmax(-1)
    assert [[b.data_ptr() for b in layer._buffers] for layer in batch.layers] == buffers  # never reallocated


def test_a_sliding_window_model_gets_a_clear_error_not_a_wrong_cache():
    from transformers import Qwen3Config

    from tirl.engines.hf import _growing_cache

    config = Qwen3Config(
        num_hidden_layers=2, use_sliding_window=True, sliding_window=16, max_window_layers=0, layer_types=None
    )
    with pytest.raises(ValueError, match=r"full-attention models only.*engine\.backend=vllm"):
        _growing_cache(config)
    config.use_sliding_window, config.layer_types = False, ["full_attention", "full_attention"]
    assert len(_growing_cache(config).layers) == 2
