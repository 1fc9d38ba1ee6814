"""Quality metrics of a format against the baseline, as pure functions of tensors.

Every function takes the *same positions* scored twice: once with the baseline
cache (bf16 or the model dtype) and once with the format under test, on the
same tokens.  Shapes::

    logprobs   [N, V] float32   log-softmax of next-token logits at N scored positions
    targets    [N] int64        the real next token at each position
    tokens     [n] ints         a greedy continuation

All reductions are means over positions; KL is in nats.
"""

from __future__ import annotations

import math
from collections.abc import Sequence

import torch


def log_softmax(logits: torch.Tensor) -> torch.Tensor:
    """[N, V] logits -> [N, V] float32 log-probabilities."""
    return torch.log_softmax(logits.float(), dim=-1)


def token_nll(logprobs: torch.Tensor, targets: torch.Tensor) -> torch.Tensor:
    """[N] negative log-likelihood of each target token."""
    assert logprobs.dim() == 2 and targets.shape == logprobs.shape[:1], (logprobs.shape, targets.shape)
    return -logprobs.gather(1, targets.long().view(-1, 1)).squeeze(1)


def perplexity(nll: torch.Tensor | Sequence[float]) -> float:
    """exp(mean NLL)."""
    t = torch.as_tensor(nll, dtype=torch.float64)
    if t.numel() == 0:
        raise ValueError("perplexity of zero tokens is undefined")
    return math.exp(float(t.mean()))


def relative_change(value: float, baseline: float) -> float:
    """(value - baseline) / baseline; 0 when both are equal."""
    if value == baseline:
        return 0.0
    return (value - baseline) / baseline


def kl_per_position(base_logprobs: torch.Tensor, test_logprobs: torch.Tensor) -> torch.Tensor:
    """[N] float64 KL(P_base || P_test) of each position, nats.  Identical inputs give exactly 0."""
    assert base_logprobs.shape == test_logprobs.shape, (base_logprobs.shape, test_logprobs.shape)
    p = base_logprobs.double()
    terms = p.exp() * (p - test_logprobs.double())
    terms = torch.where(p == float("-inf"), torch.zeros_like(terms), terms)  # 0 * log 0 = 0, not nan
    return terms.sum(-1).clamp_min(0)


def mean_kl(base_logprobs: torch.Tensor, test_logprobs: torch.Tensor) -> float:
    """Mean over positions of KL(P_base || P_test), nats."""
    return float(kl_per_position(base_logprobs, test_logprobs).mean())


def top1_agreement(base_logprobs: torch.Tensor, test_logprobs: torch.Tensor) -> float:
    """Share of positions whose most likely next token is the same."""
    assert base_logprobs.shape == test_logprobs.shape, (base_logprobs.shape, test_logprobs.shape)
    return float((base_logprobs.argmax(-1) == test_logprobs.argmax(-1)).double().mean())


def greedy_agreement(base_tokens: Sequence[int], test_tokens: Sequence[int]) -> dict[str, float]:
    """Two greedy continuations of the same context.

    ``prefix_match``: tokens equal before the first difference (how long the
    format follows the baseline); ``positionwise``: share of equal positions
    (after a divergence the two texts differ in context, so this is the weaker
    figure).  Both are over ``len(base_tokens)`` tokens.
    """
    n = len(base_tokens)
    if n == 0 or len(test_tokens) != n:
        raise ValueError(f"continuations must be non-empty and of equal length ({n} vs {len(test_tokens)})")
    prefix = next((i for i, (a, b) in enumerate(zip(base_tokens, test_tokens)) if a != b), n)
    same = sum(int(a == b) for a, b in zip(base_tokens, test_tokens))
    return {"prefix_match": prefix, "prefix_match_frac": prefix / n, "positionwise": same / n}
