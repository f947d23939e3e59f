"""The chunked loss head equals the full-logits computation (values and gradients) and never builds
full-vocabulary logits for the whole micro-batch."""

from __future__ import annotations

import pytest
import torch
from torch.utils._python_dispatch import TorchDispatchMode

from tirl.rl.losses import chunked_logprobs, entropy_from_logits


def _reference(hidden, weight, targets):
    logits = (hidden @ weight.t()).float()
    logprobs = torch.log_softmax(logits, -1).gather(-1, targets.unsqueeze(-1)).squeeze(-1)
    return logprobs, entropy_from_logits(logits)


def _inputs(seed: int = 0, b: int = 3, t: int = 7, h: int = 16, v: int = 50):
    g = torch.Generator().manual_seed(seed)
    hidden = torch.randn(b, t, h, generator=g, dtype=torch.float64, requires_grad=True)
    weight = torch.randn(v, h, generator=g, dtype=torch.float64, requires_grad=True)
    targets = torch.randint(0, v, (b, t), generator=g)
    a, c = torch.randn(b, t, generator=g), torch.randn(b, t, generator=g)
    return hidden, weight, targets, a.double(), c.double()


def _grads(fn, hidden, weight, targets, a, c, use_entropy: bool):
    hidden.grad = weight.grad = None
    logprobs, entropy = fn(hidden, weight, targets)
    loss = (logprobs.double() * a).sum() + ((entropy.double() * c).sum() if use_entropy else 0.0)
    loss.backward()
    return logprobs.detach(), entropy.detach(), hidden.grad.clone(), weight.grad.clone()


@pytest.mark.parametrize("chunk", [1, 4, 21, 100])
@pytest.mark.parametrize("use_entropy", [False, True])
def test_chunked_head_equals_full_logits(chunk, use_entropy):
    """Log-probs, entropies, and the gradients to hidden states and head weight, for chunks smaller
    than, not dividing, equal to and larger than the 21 tokens; with and without an entropy term."""
    inputs = _inputs()
    want = _grads(_reference, *inputs, use_entropy)
    got = _grads(lambda h, w, t: chunked_logprobs(h, w, t, chunk), *inputs, use_entropy)
    for g, w in zip(got, want, strict=True):
        assert torch.allclose(g.double(), w.double(), rtol=1e-5, atol=1e-6)


def test_entropy_as_a_metric_needs_no_gradient():
    """Entropy read only as a metric (not in the loss): no gradient work for it, log-prob grads intact."""
    hidden, weight, targets, a, _ = _inputs(seed=1)
    logprobs, entropy = chunked_logprobs(hidden, weight, targets, 5)
    (logprobs * a).sum().backward()
    ref_h, ref_w = hidden.grad.clone(), weight.grad.clone()
    hidden.grad = weight.grad = None
    _reference_lp, _ = _reference(hidden, weight, targets)
    (_reference_lp * a).sum().backward()
    assert torch.allclose(ref_h, hidden.grad, atol=1e-5) and torch.allclose(ref_w, weight.grad, atol=1e-5)
    assert float(entropy.detach().min()) > 0


class _LargestTensor(TorchDispatchMode):
    """Records the largest tensor any op produces."""

    def __init__(self) -> None:
        super().__init__()
        self.largest = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else [out]:
            if isinstance(t, torch.Tensor):
                self.largest = max(self.largest, t.numel())
        return out


def test_no_op_builds_full_logits_for_the_batch():
    """Forward and backward of 200 tokens x 300 vocabulary in chunks of 8: no tensor is larger than the
    head weight or one chunk's logits (the full logits would be 60,000 entries)."""
    hidden, weight, targets, a, c = _inputs(b=4, t=50, h=8, v=300)
    with _LargestTensor() as probe:
        logprobs, entropy = chunked_logprobs(hidden, weight, targets, 8)
        ((logprobs * a).sum() + (entropy * c).sum()).backward()
    assert probe.largest <= max(weight.numel(), 8 * 300)


def test_policy_forward_matches_the_stock_head(tiny_model_dir):
    """Policy.forward (chunked head inside the HF forward) gives the stock `model(...).logits` path's
    log-probs, entropies and weight gradients."""
    from transformers import AutoModelForCausalLM

    from tirl.distributed.groups import init_distributed
    from tirl.rl.config import OptimConfig
    from tirl.rl.policy import Policy, TrainSample

    optim = OptimConfig(lr=1e-3, warmup_steps=0, device="cpu", gradient_checkpointing=False)
    policy = Policy(str(tiny_model_dir), optim, init_distributed("cpu"), 1)
    samples = [TrainSample([5, 9, 11, 3, 7], [1, 1, 0, 1]), TrainSample([4, 6, 8], [0, 1])]
    mb = policy.forward(samples, with_entropy=True)
    ((mb.logprobs * mb.mask).sum() + (mb.entropy * mb.mask).sum()).backward()

    stock = AutoModelForCausalLM.from_pretrained(tiny_model_dir, dtype=torch.float32)
    ids = torch.tensor([[5, 9, 11, 3, 7], [4, 6, 8, 0, 0]])
    attn = torch.tensor([[1, 1, 1, 1, 1], [1, 1, 1, 0, 0]])
    logits = stock(input_ids=ids, attention_mask=attn).logits[:, :-1].float()
    logprobs = torch.log_softmax(logits, -1).gather(-1, ids[:, 1:, None]).squeeze(-1)
    entropy = entropy_from_logits(logits)
    ((logprobs * mb.mask).sum() + (entropy * mb.mask).sum()).backward()
    assert torch.allclose(mb.logprobs.detach(), logprobs.detach(), atol=1e-5)
    assert torch.allclose(mb.entropy.detach() * mb.mask, entropy.detach() * mb.mask, atol=1e-5)
    for name, p in stock.named_parameters():
        mine = policy.model.get_parameter(name).grad
        assert torch.allclose(mine, p.grad, atol=1e-5), name


# ---- bf16: the head's GEMMs in the weight's dtype (issue 41, item 8) ----


def _bf16_inputs(seed: int, n: int = 96, h: int = 64, v: int = 500):
    g = torch.Generator().manual_seed(seed)
    hidden = (torch.randn(n, h, generator=g) / h**0.5).bfloat16().requires_grad_()
    weight = torch.randn(v, h, generator=g).bfloat16().requires_grad_()
    targets = torch.randint(0, v, (n,), generator=g)
    return hidden, weight, targets, torch.randn(n, generator=g), torch.randn(n, generator=g)


def _rel(got: torch.Tensor, want: torch.Tensor) -> float:
    return float((got.double() - want.double()).norm() / want.double().norm())


def test_bf16_head_equals_the_unchunked_bf16_head():
    """In bf16 the chunked head's log-probs, entropies and both gradients equal the stock head's
    (`linear(hidden, weight).float()` then fp32 log-softmax, autograd throughout) within bf16
    tolerance, and both are as close to the float64 computation."""
    for seed in range(3):
        hidden, weight, targets, a, c = _bf16_inputs(seed)
        got = _grads(lambda h, w, t: chunked_logprobs(h, w, t, 7), hidden, weight, targets, a, c, True)
        stock = _grads(_reference, hidden, weight, targets, a, c, True)
        exact = [hidden.detach().double().requires_grad_(), weight.detach().double().requires_grad_()]
        want = _grads(_reference, *exact, targets, a.double(), c.double(), True)
        for name, g, s, w in zip(
            ("logprobs", "entropy", "d hidden", "d weight"), got, stock, want, strict=True
        ):
            assert g.dtype == s.dtype, name
            assert _rel(g, s) < 1e-2, (name, _rel(g, s))
            assert _rel(g, w) < max(1e-2, 2 * _rel(s, w)), (name, _rel(g, w), _rel(s, w))


class _MatmulDtypes(TorchDispatchMode):
    """Records the operand dtypes of every matrix product, and the largest fp32 tensor made."""

    MATMULS = ("aten.mm", "aten.addmm", "aten.addmm_", "aten.bmm", "aten.baddbmm")

    def __init__(self) -> None:
        super().__init__()
        self.matmuls: list[tuple[str, tuple[torch.dtype, ...]]] = []
        self.largest_fp32 = 0

    def __torch_dispatch__(self, func, types, args=(), kwargs=None):
        name = str(func.overloadpacket)
        if name in self.MATMULS:
            self.matmuls.append((name, tuple(a.dtype for a in args if isinstance(a, torch.Tensor))))
        out = func(*args, **(kwargs or {}))
        for t in out if isinstance(out, tuple | list) else [out]:
            if isinstance(t, torch.Tensor) and t.dtype == torch.float32:
                self.largest_fp32 = max(self.largest_fp32, t.numel())
        return out


def test_bf16_head_backward_multiplies_in_bf16_without_an_fp32_weight_accumulator():
    """The backward's matrix products (the weight gradient's among them) take bf16 operands, and no
    fp32 tensor the size of the head weight is made: before, the weight gradient was an fp32 GEMM
    into an fp32 [V, H] accumulator (2.9 GiB at 14B, and tensor cores unused)."""
    hidden, weight, targets, a, c = _bf16_inputs(0, n=40, h=32, v=700)
    logprobs, entropy = chunked_logprobs(hidden, weight, targets, 8)
    loss = (logprobs * a).sum() + (entropy * c).sum()
    with _MatmulDtypes() as probe:
        loss.backward()
    # per chunk of 8 (5 chunks): the logits rebuilt, the weight's and the hidden states' gradients
    assert len(probe.matmuls) == 3 * 5, probe.matmuls
    assert all(dtypes == (torch.bfloat16,) * len(dtypes) for _, dtypes in probe.matmuls), probe.matmuls
    assert probe.largest_fp32 < weight.numel(), (probe.largest_fp32, weight.numel())
    assert weight.grad.dtype == torch.bfloat16 and hidden.grad.dtype == torch.bfloat16
