"""The transformers backend: continuous batching over a background decode loop (CPU or CUDA).

Concurrent generate() calls join one running batch at the next decode step and leave it the moment
they finish, so hundreds of trajectories share the model without waiting for each other. The batch
keeps one left-padded KV cache; a joining group is prefilled on its own and padded into it.
Sampling is vectorized but seeded per request (one uniform per token from the request's own RNG),
so a request's tokens do not depend on what else shares the batch, as far as the forward pass gives
each row the same numbers: on CPU with one intra-op thread it does; with two, the GEMMs round rows
differently and SmolLM2-135M at temperature 1 sampled two requests of the same prompt and seed, side by
side in one batch, differently (the same two every time: deterministic, but not batch-invariant).
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
import threading
from collections import deque
from collections.abc import Iterable
from dataclasses import dataclass, field

import numpy as np
import torch
from transformers.cache_utils import DynamicCache, DynamicLayer

from tirl.devices import resolve_device, resolve_dtype
from tirl.engines.base import Generation, KVCapacity, SamplingParams
from tirl.engines.config import EngineConfig

log = logging.getLogger(__name__)


class EngineClosedError(RuntimeError):
    """generate() on an engine that was closed (or closed while the request was in flight)."""


@dataclass
class _Request:
    prompt_ids: list[int]
    params: SamplingParams
    max_new: int
    future: asyncio.Future
    loop: asyncio.AbstractEventLoop
    rng: np.random.Generator
    stop_ids: frozenset[int]
    stop_window: int  # tokens to decode when looking for a stop string
    out_ids: list[int] = field(default_factory=list)
    out_logprobs: list[float] = field(default_factory=list)
    cancelled: bool = False

    @property
    def length(self) -> int:
        return len(self.prompt_ids) + len(self.out_ids)


class _Batch:
    """The running sequences and their shared left-padded KV cache (engine thread only)."""

    def __init__(self) -> None:
        self.requests: list[_Request] = []
        self.cache = None  # transformers DynamicCache, batch-major
        self.mask: torch.Tensor | None = None  # [B, L] 1 = real token, 0 = left padding
        self.positions: torch.Tensor | None = None  # [B] position of each row's next token
        self.next_tokens: torch.Tensor | None = None  # [B] token fed at the next step

    def __len__(self) -> int:
        return len(self.requests)


def _growing_cache(config) -> DynamicCache:
    """A DynamicCache of `_GrowingLayer`s (full attention only: the batch trims and pads every layer's
    columns alike, which a sliding window's shorter cache does not allow)."""
    cache = DynamicCache(config=config)
    if any(type(layer) is not DynamicLayer for layer in cache.layers):
        raise ValueError(
            f"the HF engine runs full-attention models only; {config.model_type} has sliding-window or "
            "other cache layers: use engine.backend=vllm"
        )
    cache.layers = [_GrowingLayer() for _ in cache.layers]
    return cache


class _GrowingLayer(DynamicLayer):
    """A DynamicLayer whose keys and values are windows into buffers with spare room on every side.

    DynamicLayer concatenates its whole cache at every decode step, and the batch's joins and evictions
    copied it again: O(cache) copies per token that took more of a CPU decode step of the demo's model
    than the model did (benchmarks/hf_decode.py). Here a step writes its token after the window, a join
    writes the joining rows below it (widening it to the left when they are longer: caches are
    left-padded, right-aligned), and an eviction moves the last rows into the holes: each copies only
    what is new or moved until a buffer runs out of room, when a larger one takes everything once.
    """

    def update(self, key_states, value_states, *args, **kwargs):
        if not self.is_initialized:
            self.lazy_initialization(key_states, value_states)
            self._buffers: list[torch.Tensor | None] = [None, None]
        width = self.keys.shape[2] if self.keys.dim() == 4 else 0  # lazy_initialization: an empty 1-d tensor
        self._resize(key_states.shape[0], 0, key_states.shape[2], (key_states, value_states))
        self.keys[:, :, width:] = key_states
        self.values[:, :, width:] = value_states
        return self.keys, self.values

    def stack(self, other: _GrowingLayer, width: int) -> None:
        """Append `other`'s rows below ours, both left-padded with zeros to `width` columns."""
        rows, old_width = self.keys.shape[0], self.keys.shape[2]
        self._resize(rows + other.keys.shape[0], width - old_width, 0, (self.keys, self.values))
        for mine, theirs in ((self.keys, other.keys), (self.values, other.values)):
            mine[:rows, :, : width - old_width].zero_()  # zeros, not garbage: 0 * NaN would reach real rows
            mine[rows:, :, : width - theirs.shape[2]].zero_()
            mine[rows:, :, width - theirs.shape[2] :] = theirs

    def compact(self, holes: list[int], movers: list[int], rows: int, first: int) -> None:
        """Keep the first `rows` rows, rows `movers` moved into `holes`, from column `first` on (in place)."""
        for name in ("keys", "values"):
            t = getattr(self, name)
            if holes:
                t[holes] = t[movers]
            setattr(self, name, t[:rows, :, first:])

    def _resize(self, rows: int, left: int, right: int, like: tuple[torch.Tensor, torch.Tensor]) -> None:
        """Widen the window by `left` and `right` columns and make it `rows` tall: in place while the
        buffers have room, else by one copy into new buffers with room again (O(1) amortized)."""
        start = self._start()
        width = self.keys.shape[2] if self.keys.dim() == 4 else 0  # lazy_initialization: an empty 1-d tensor
        buf = self._buffers[0]
        if (
            start is not None
            and rows <= buf.shape[0]
            and left <= start
            and start + width + right <= buf.shape[2]
        ):
            self.keys, self.values = (
                b[:rows, :, start - left : start + width + right] for b in self._buffers
            )
            return
        new_width = left + width + right
        spare = max(64, new_width // 2)
        windows = []
        for slot, (old, t) in enumerate(((self.keys, like[0]), (self.values, like[1]))):
            buf = t.new_empty(rows + max(8, rows // 2), t.shape[1], spare + new_width + spare, t.shape[-1])
            self._buffers[slot] = buf
            windows.append(buf[:rows, :, spare : spare + new_width])
            if width:
                windows[-1][: old.shape[0], :, left : left + width] = old
        self.keys, self.values = windows

    def _start(self) -> int | None:
        """The column where the window starts in the buffers; None if the keys or values are not
        windows of them (not yet written, or assigned from outside)."""
        starts = set()
        for t, buf in zip((self.keys, self.values), self._buffers, strict=True):
            if buf is None or t.dim() != 4 or t.stride() != buf.stride():
                return None
            if t.untyped_storage().data_ptr() != buf.untyped_storage().data_ptr():
                return None
            starts.add((t.storage_offset() - buf.storage_offset()) // t.stride(2))
        return starts.pop() if len(starts) == 1 else None


def _left_pad(t: torch.Tensor, n: int, dim: int) -> torch.Tensor:
    if n == 0:
        return t
    shape = list(t.shape)
    shape[dim] = n
    return torch.cat([t.new_zeros(shape), t], dim=dim)


class HFEngine:
    """Engine protocol (tirl.engines.base) on a transformers causal LM."""

    def __init__(
        self, cfg: EngineConfig, name: str = "hf0", model: torch.nn.Module | None = None, tokenizer=None
    ):
        from transformers import AutoModelForCausalLM

        self.cfg, self.name = cfg, name
        self.device = resolve_device(cfg.device)
        if model is None:
            if not cfg.model:
                raise ValueError("engine.model is empty: give a model path (e.g. from `tirl model init`)")
            dtype = resolve_dtype(cfg.dtype, self.device)
            model = AutoModelForCausalLM.from_pretrained(cfg.model, dtype=dtype)
            model.to(self.device)
        self.model = model.eval()
        self.device = next(model.parameters()).device
        if tokenizer is None and cfg.model:
            from tirl.engines.tokenizer import load_tokenizer

            tokenizer = load_tokenizer(cfg.model)
        self.tokenizer = tokenizer  # only needed for stop strings
        gen_cfg = getattr(model, "generation_config", None)
        eos = getattr(gen_cfg, "eos_token_id", None) if gen_cfg is not None else None
        self._eos_ids = frozenset([eos] if isinstance(eos, int) else (eos or []))

        self._pending: deque[_Request] = deque()
        self._cond = threading.Condition()
        self._model_lock = threading.Lock()  # a decode step or a weight update, never both
        self._batch = _Batch()
        self._closed = False
        self._asleep = False
        self.steps = 0  # decode steps run (batching is visible in it)
        self._thread = threading.Thread(target=self._run, name=f"tirl-{name}", daemon=True)
        self._thread.start()

    # ---- Engine protocol ----

    async def generate(self, prompt_ids: list[int], params: SamplingParams) -> Generation:
        if self._closed:
            raise EngineClosedError(f"engine {self.name} is closed")
        if self._asleep:
            raise RuntimeError(f"engine {self.name} is asleep (its trainer is running): wake_up() first")
        if not prompt_ids:
            raise ValueError("generate() needs a non-empty prompt")
        room = self.cfg.max_model_len - len(prompt_ids)
        if room <= 0:
            raise ValueError(
                f"prompt of {len(prompt_ids)} tokens does not fit max_model_len={self.cfg.max_model_len}: "
                "shorten it or raise engine.max_model_len"
            )
        if params.stop_strings and self.tokenizer is None:
            raise ValueError("stop strings need a tokenizer: pass tokenizer= or set engine.model")
        loop = asyncio.get_running_loop()
        req = _Request(
            prompt_ids=list(prompt_ids),
            params=params,
            max_new=min(params.max_tokens, room),
            future=loop.create_future(),
            loop=loop,
            rng=np.random.default_rng(params.seed),
            stop_ids=frozenset(params.stop_token_ids) | self._eos_ids,
            stop_window=max((len(s) for s in params.stop_strings), default=0) + 2,
        )
        if req.max_new <= 0:
            return Generation([], [], "length")
        with self._cond:
            self._pending.append(req)
            self._cond.notify()
        try:
            return await asyncio.shield(req.future)
        except asyncio.CancelledError:
            req.cancelled = True  # the decode loop drops it at its next step
            raise

    def capacity(self) -> KVCapacity:
        total = self.cfg.max_batch_size * self.cfg.max_model_len
        with self._cond:
            used = sum(r.length for r in self._batch.requests) + sum(len(r.prompt_ids) for r in self._pending)
        return KVCapacity(total_tokens=total, free_tokens=max(0, total - used))

    def load_weights(self, weights: Iterable[tuple[str, torch.Tensor]]) -> None:
        """Copy (name, tensor) pairs into the live model between two decode steps."""
        params = self.model.state_dict(keep_vars=True)  # tied weights appear under each of their names
        with self._model_lock, torch.no_grad():
            for name, tensor in weights:
                if name not in params:
                    raise KeyError(f"load_weights: the model has no parameter {name!r}")
                target = params[name]
                if target.shape != tensor.shape:
                    raise ValueError(
                        f"load_weights: {name} has shape {tuple(target.shape)}, got {tuple(tensor.shape)}"
                    )
                target.copy_(tensor.to(device=target.device, dtype=target.dtype))

    def sleep(self) -> bool:
        """On a GPU: move the weights to host memory and hand the freed blocks (and the KV cache's,
        which the batch dropped when its last request left) back to CUDA. On CPU there is nothing to
        free: the weights already live in host memory and the KV cache exists only while requests run."""
        if self.device.type != "cuda":
            return False
        with self._cond, self._model_lock:
            if self._batch.requests or self._pending:
                raise RuntimeError(f"engine {self.name}: sleep() with requests in flight")
            self._asleep = True
            self.model.to("cpu")
        torch.cuda.empty_cache()
        return True

    def wake_up(self) -> None:
        if self._asleep:
            with self._model_lock:
                self.model.to(self.device)
                self._asleep = False

    async def close(self) -> None:
        with self._cond:
            self._closed = True
            self._cond.notify()
        await asyncio.to_thread(self._thread.join)

    # ---- the decode loop (engine thread) ----

    def _run(self) -> None:
        while True:
            with self._cond:
                while not self._closed and not self._pending and not self._batch.requests:
                    self._cond.wait()
                if self._closed:
                    break
                room = self.cfg.max_batch_size - len(self._batch)
                joining = [self._pending.popleft() for _ in range(min(room, len(self._pending)))]
            joining = [r for r in joining if not r.cancelled]
            try:
                with self._model_lock, torch.inference_mode():
                    if joining:
                        self._prefill(joining)
                    if self._batch.requests:
                        self._decode_step()
            except Exception as exc:  # a failed step fails its requests, never the engine thread
                log.exception("engine %s: decode step failed", self.name)
                for req in self._batch.requests + joining:
                    self._resolve(req, exc)
                self._batch = _Batch()
        self._fail_all(EngineClosedError(f"engine {self.name} was closed"))

    def _fail_all(self, exc: Exception) -> None:
        with self._cond:
            pending = list(self._pending)
            self._pending.clear()
        for req in self._batch.requests + pending:
            self._resolve(req, exc)
        self._batch = _Batch()

    def _prefill(self, joining: list[_Request]) -> None:
        width = max(len(r.prompt_ids) for r in joining)
        ids = torch.zeros(len(joining), width, dtype=torch.long)
        mask = torch.zeros(len(joining), width, dtype=torch.long)
        for i, r in enumerate(joining):
            ids[i, width - len(r.prompt_ids) :] = torch.tensor(r.prompt_ids)
            mask[i, width - len(r.prompt_ids) :] = 1
        ids, mask = ids.to(self.device), mask.to(self.device)
        positions = (mask.cumsum(-1) - 1).clamp(min=0)
        cache = _growing_cache(self.model.config)
        out = self.model(
            input_ids=ids,
            attention_mask=mask,
            position_ids=positions,
            past_key_values=cache,
            use_cache=True,
            logits_to_keep=1,
        )
        self._zero_padding(cache, mask)
        self._merge(joining, cache, mask, positions[:, -1] + 1)
        self._sample_and_advance(
            out.logits[:, -1, :], rows=range(len(self._batch) - len(joining), len(self._batch))
        )

    def _decode_step(self) -> None:
        b = self._batch
        b.mask = torch.cat([b.mask, b.mask.new_ones(len(b), 1)], dim=1)
        out = self.model(
            input_ids=b.next_tokens[:, None],
            attention_mask=b.mask,
            position_ids=b.positions[:, None],
            past_key_values=b.cache,
            use_cache=True,
        )
        b.positions = b.positions + 1
        self._sample_and_advance(out.logits[:, -1, :], rows=range(len(b)))

    @staticmethod
    def _zero_padding(cache, mask: torch.Tensor) -> None:
        # Padded query rows attend to nothing; whatever they wrote must not leak as NaN into real rows.
        pad = ~mask.bool()[:, None, :, None]
        for layer in cache.layers:
            layer.keys.masked_fill_(pad, 0.0)  # in place: the window stays in its buffer
            layer.values.masked_fill_(pad, 0.0)

    def _merge(self, joining: list[_Request], cache, mask: torch.Tensor, positions: torch.Tensor) -> None:
        """Pad the joining group's cache and the running one to a common length and stack them."""
        b = self._batch
        next_tokens = torch.zeros(len(joining), dtype=torch.long, device=self.device)
        if not b.requests:
            b.requests, b.cache, b.mask, b.positions, b.next_tokens = (
                list(joining),
                cache,
                mask,
                positions,
                next_tokens,
            )
            return
        width_old, width_new = b.mask.shape[1], mask.shape[1]
        width = max(width_old, width_new)
        for old, new in zip(b.cache.layers, cache.layers, strict=True):
            old.stack(new, width)
        b.mask = torch.cat([_left_pad(b.mask, width - width_old, 1), _left_pad(mask, width - width_new, 1)])
        b.positions = torch.cat([b.positions, positions])
        b.next_tokens = torch.cat([b.next_tokens, next_tokens])
        b.requests.extend(joining)

    def _sample_and_advance(self, logits: torch.Tensor, rows: range) -> None:
        b = self._batch
        reqs = [b.requests[i] for i in rows]
        tokens, logprobs = _sample(logits.float(), reqs)
        b.next_tokens[rows.start : rows.stop] = tokens.to(self.device)
        self.steps += 1
        done: list[int] = []
        for i, req, tok, lp in zip(rows, reqs, tokens.tolist(), logprobs.tolist(), strict=True):
            req.out_ids.append(tok)
            req.out_logprobs.append(lp)
            reason = self._finish_reason(req, tok)
            if reason is not None:
                done.append(i)
                self._resolve(req, Generation(req.out_ids, req.out_logprobs, reason))
        done.extend(i for i, r in enumerate(b.requests) if r.cancelled and i not in done)
        if done:
            self._evict(sorted(set(done)))

    def _finish_reason(self, req: _Request, tok: int) -> str | None:
        if req.cancelled:
            return "abort"
        if tok in req.stop_ids:
            return "stop"
        if req.params.stop_strings:
            tail = self.tokenizer.decode(req.out_ids[-req.stop_window :], skip_special_tokens=False)
            if any(s in tail for s in req.params.stop_strings):
                return "stop"
        if len(req.out_ids) >= req.max_new:
            return "length"
        return None

    def _evict(self, done: list[int]) -> None:
        b = self._batch
        rows = len(b) - len(done)
        if not rows:
            self._batch = _Batch()
            return
        # The last rows kept move into the holes below `rows`: only they are copied, not the whole cache.
        gone = set(done)
        holes = [i for i in done if i < rows]
        movers = [i for i in range(rows, len(b)) if i not in gone]
        order = list(range(rows))
        for hole, mover in zip(holes, movers, strict=True):
            order[hole] = mover
        idx = torch.tensor(order, device=self.device)
        b.requests = [b.requests[i] for i in order]
        b.mask, b.positions, b.next_tokens = b.mask[idx], b.positions[idx], b.next_tokens[idx]
        # Drop the columns that are padding for every remaining row (the longest sequence left).
        first_real = int((b.mask.shape[1] - b.mask.sum(-1)).min())
        b.mask = b.mask[:, first_real:]
        for layer in b.cache.layers:
            layer.compact(holes, movers, rows, first_real)

    @staticmethod
    def _resolve(req: _Request, result: Generation | Exception) -> None:
        def settle() -> None:
            if req.future.done():
                return
            if isinstance(result, Exception):
                req.future.set_exception(result)
            else:
                req.future.set_result(result)

        with contextlib.suppress(RuntimeError):  # the caller's event loop is gone: nobody is waiting
            req.loop.call_soon_threadsafe(settle)


def _sample(logits: torch.Tensor, reqs: list[_Request]) -> tuple[torch.Tensor, torch.Tensor]:
    """One token per row and its logprob under the sampling distribution.

    The sampling distribution is softmax(logits / T) restricted to the top-p nucleus and renormalized;
    for greedy rows (T = 0) the logprob is taken under softmax(logits).
    """
    temps = torch.tensor([r.params.temperature for r in reqs], device=logits.device)
    greedy = temps <= 0
    logp = torch.log_softmax(logits / torch.where(greedy, 1.0, temps)[:, None], dim=-1)
    tokens = logp.argmax(-1)
    chosen = logp.gather(1, tokens[:, None])[:, 0]
    sampled = [i for i, r in enumerate(reqs) if r.params.temperature > 0]
    if sampled:
        uniforms = torch.tensor([reqs[i].rng.random() for i in sampled], device=logits.device)
        rows = torch.tensor(sampled, device=logits.device)
        top_p = torch.tensor([reqs[i].params.top_p for i in sampled], device=logits.device)
        tok, lp = _sample_nucleus(logp[rows], top_p, uniforms)
        tokens[rows], chosen[rows] = tok, lp
    return tokens.cpu(), chosen.cpu()


def _sample_nucleus(
    logp: torch.Tensor, top_p: torch.Tensor, u: torch.Tensor
) -> tuple[torch.Tensor, torch.Tensor]:
    """Inverse-CDF sampling with one uniform per row; sorts the vocabulary only for rows with top_p < 1."""
    if bool((top_p >= 1).all()):
        cdf = logp.exp().cumsum(-1)
        tok = torch.searchsorted(cdf, (u * cdf[:, -1])[:, None])[:, 0].clamp(max=logp.shape[1] - 1)
        return tok, logp.gather(1, tok[:, None])[:, 0]
    sorted_logp, order = logp.sort(dim=-1, descending=True)
    probs = sorted_logp.exp()
    before = probs.cumsum(-1) - probs  # mass strictly above each token: keep while below top_p
    probs = torch.where(before < top_p[:, None], probs, 0.0)
    mass = probs.sum(-1, keepdim=True)
    cdf = probs.cumsum(-1)
    pos = torch.searchsorted(cdf, (u[:, None] * mass)).clamp(max=logp.shape[1] - 1)
    pos = torch.minimum(pos, (probs > 0).sum(-1, keepdim=True) - 1)
    tok = order.gather(1, pos)[:, 0]
    lp = sorted_logp.gather(1, pos)[:, 0] - mass[:, 0].log()
    return tok, lp
