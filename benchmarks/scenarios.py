"""Capacity-bound serving loads and the decode-step floor (benchmarks/bench_engine.py --scenarios).

A scenario is a list of requests (arrival time, prompt length, output length),
built from a seed, the same for every KV format compared.  The three loads of
issue 30 are sized for Llama-3-8B on one H200 (bf16 weights, 90% of the memory):
bf16's pool holds about 425 sequences of 3072 tokens there, so each needs more
KV than bf16 can hold, and a format that stores more tokens can run more
sequences at once:

* ``decode_heavy``: 512 requests of 1024 prompt + 2048 output tokens, all at once;
* ``prefill_heavy``: 256 requests of 7936 + 256, all at once;
* ``mixed``: 1024 requests arriving as a Poisson process at 40 per second, prompt
  and output lengths drawn log-normally (medians 1024 and 384, clipped to
  64-8192 and 16-2048), the shape of a chat service's traffic.

``scale`` shrinks the request count (``--scenario-scale``; tests and smoke runs).

The floor of one decode step (:func:`step_floor_s`) is what the hardware needs at
least for it: the weights read once or the GEMMs' FLOPs, whichever takes longer,
plus every running sequence's KV bytes read once at the measured copy bandwidth
(quantized planes and scales, and the high-precision sink and recent-window
tokens at the model dtype's bytes).  A step's time over its floor is what the
kernels, the launches and the host leave on the table.
"""

from __future__ import annotations

import math
import random
from dataclasses import dataclass

#: bf16 dense matmul throughput of an H200 as measured on ours (about 790 TFLOP/s)
H200_BF16_FLOPS = 790e12


@dataclass(frozen=True)
class Request:
    arrival_s: float  # after the scenario's start
    input_len: int
    output_len: int


@dataclass(frozen=True)
class Scenario:
    name: str
    description: str
    requests: tuple[Request, ...]

    @property
    def arrivals_spread(self) -> bool:
        return any(r.arrival_s > 0 for r in self.requests)


def _wave(name: str, n: int, inp: int, out: int) -> Scenario:
    return Scenario(name, f"{n} requests of {inp} prompt + {out} output tokens, all at once",
                    tuple(Request(0.0, inp, out) for _ in range(n)))


def _lognormal(rng: random.Random, median: float, sigma: float, lo: int, hi: int) -> int:
    return int(min(hi, max(lo, round(median * math.exp(sigma * rng.gauss(0.0, 1.0))))))


def mixed(n: int = 1024, rate: float = 40.0, seed: int = 0) -> Scenario:
    rng = random.Random(seed)
    t, reqs = 0.0, []
    for _ in range(n):
        reqs.append(Request(t, _lognormal(rng, 1024, 0.8, 64, 8192), _lognormal(rng, 384, 0.9, 16, 2048)))
        t += rng.expovariate(rate)
    return Scenario("mixed", f"{n} requests arriving at {rate:g}/s (Poisson), prompts log-normal around 1024 "
                             f"tokens (64-8192), outputs around 384 (16-2048)", tuple(reqs))


NAMES = ("decode_heavy", "prefill_heavy", "mixed")


def scenario(name: str, scale: float = 1.0, seed: int = 0) -> Scenario:
    """The named load with ``scale`` times its requests (at least one); ValueError naming the valid names."""
    if not 0 < scale <= 1:
        raise ValueError(f"scenario scale must be in (0, 1], got {scale}")

    def n(k: int) -> int:
        return max(1, round(k * scale))

    if name == "decode_heavy":
        return _wave(name, n(512), 1024, 2048)
    if name == "prefill_heavy":
        return _wave(name, n(256), 7936, 256)
    if name == "mixed":
        return mixed(n(1024), 40.0, seed)  # the same arrival rate: fewer requests arrive over a shorter time
    raise ValueError(f"unknown scenario {name!r}; valid: {', '.join(NAMES)}")


def shrink(s: Scenario, max_input: int, max_output: int) -> Scenario:
    """The same arrivals with lengths capped (a smoke model's short positions)."""
    return Scenario(s.name, s.description + f" (capped at {max_input} + {max_output})",
                    tuple(Request(r.arrival_s, min(r.input_len, max_input), min(r.output_len, max_output))
                          for r in s.requests))


def kv_read_bytes(plan, context: int) -> float:
    """Bytes one decode step reads of a sequence's KV at ``context`` tokens: its high-precision tokens
    (sinks, recent window, whole blocks the rule keeps) at the model dtype, the rest as stored."""
    _, hp_blocks = plan.blocks_for(context)
    hp_tokens = min(context, hp_blocks * plan.block_size)
    hp_per_token = plan.hp_bytes_per_block / plan.block_size
    return hp_tokens * hp_per_token + (context - hp_tokens) * plan.bytes_per_token


def step_floor_s(weight_bytes: float, gemm_flops_per_token: float, plan, contexts, bandwidth: float,
                 flops: float = H200_BF16_FLOPS) -> float:
    """Floor of one decode step of ``len(contexts)`` sequences (module docstring)."""
    weights = max(weight_bytes / bandwidth, gemm_flops_per_token * len(contexts) / flops)
    return weights + sum(kv_read_bytes(plan, c) for c in contexts) / bandwidth


class StepFloor:
    """:func:`step_floor_s` of one format's plan, with the KV bytes per context length memoized (a
    scenario's steps ask for the same lengths again and again)."""

    def __init__(self, plan, weight_bytes: float, gemm_flops_per_token: float, bandwidth: float,
                 flops: float = H200_BF16_FLOPS):
        self.plan, self.weight_bytes, self.gemm_flops = plan, weight_bytes, gemm_flops_per_token
        self.bandwidth, self.flops = bandwidth, flops
        self._kv: dict[int, float] = {}

    def kv(self, context: int) -> float:
        got = self._kv.get(context)
        if got is None:
            got = self._kv[context] = kv_read_bytes(self.plan, context)
        return got

    def __call__(self, contexts) -> float:
        weights = max(self.weight_bytes / self.bandwidth, self.gemm_flops * len(contexts) / self.flops)
        return weights + sum(map(self.kv, contexts)) / self.bandwidth
