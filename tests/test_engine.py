"""The engine end to end on the default model (CPU): HF equivalence, batching
invariance, chunked prefill, preemption, prefix caching, stops, every KV format."""

import subprocess
import sys

import pytest
import torch

from kvq.engine.llm import LLM
from kvq.engine.sampling_params import SamplingParams
from tests.tiny_model import write_tiny

PROMPTS = ["The capital of France is", "def fibonacci(n):", "Once upon a time", "The three primary colors are"]
GREEDY = SamplingParams(max_tokens=12, temperature=0)


@pytest.fixture(scope="module")
def bf16():
    return LLM("default", kv_cache_dtype="bfloat16", kv_cache_memory="128MiB", max_num_seqs=8, progress=False)


@pytest.fixture(scope="module")
def bf16_greedy(bf16):
    """bf16's greedy outputs of PROMPTS, batched (generated once: the tests below read them)."""
    return bf16.generate(PROMPTS, GREEDY, use_tqdm=False)


@pytest.fixture(scope="module")
def hf_greedy():
    from kvq.models.loader import load_hf_model

    hf = load_hf_model("default", progress=False)
    out = {}
    for p in PROMPTS:
        ids = hf.tokenizer(p, return_tensors="pt").input_ids
        with torch.no_grad():
            gen = hf.model.generate(ids, max_new_tokens=GREEDY.max_tokens, do_sample=False)
        out[p] = gen[0, ids.shape[1]:].tolist()
    return out


def test_greedy_matches_hf_transformers_token_for_token(bf16_greedy, hf_greedy):
    for p, o in zip(PROMPTS, bf16_greedy):
        assert o.outputs[0].token_ids == hf_greedy[p], (p, o.outputs[0].text)
        assert o.outputs[0].finish_reason == "length" and o.finished


def test_batching_invariance(bf16, bf16_greedy):
    alone = bf16.generate([PROMPTS[2]], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    batched = bf16_greedy[2].outputs[0].token_ids
    assert alone == batched


def test_chunked_prefill_and_preemption_give_the_same_tokens(bf16):
    sp = SamplingParams(max_tokens=32, temperature=0)
    want = [o.outputs[0].token_ids for o in bf16.generate(PROMPTS, sp, use_tqdm=False)]
    # 8-token prefill chunks, and a pool of 8 blocks (128 tokens) for 4 requests of ~55 + 32 tokens:
    # some must be preempted and recomputed
    small = LLM("default", kv_cache_dtype="bfloat16", max_num_batched_tokens=8, max_num_seqs=4,
                kv_cache_memory=8 * bf16.engine.plan.bytes_per_block, progress=False)
    outs = small.generate(PROMPTS, sp, use_tqdm=False)
    assert [o.outputs[0].token_ids for o in outs] == want
    assert sum(o.metrics["num_preemptions"] for o in outs) > 0, "the small pool should have forced preemption"
    assert small.engine.block_manager.num_free_blocks("q") == small.engine.pool.num_q_blocks


def test_prefix_cache_hit_keeps_output(bf16):
    long = "The history of the printing press begins in the fifteenth century, when " * 3
    first = bf16.generate([long], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    hits = bf16.engine.block_manager.allocator("q").num_hits
    again = bf16.generate([long], GREEDY, use_tqdm=False)[0].outputs[0].token_ids
    assert bf16.engine.block_manager.allocator("q").num_hits > hits
    assert again == first


def test_stop_string_and_max_tokens(bf16):
    o = bf16.generate(["Count: one, two, three,"], SamplingParams(max_tokens=30, temperature=0, stop=["six"]),
                      use_tqdm=False)[0].outputs[0]
    assert o.finish_reason == "stop" and o.stop_reason == "six" and "six" not in o.text
    o = bf16.generate(["Hello"], SamplingParams(max_tokens=3, temperature=0), use_tqdm=False)[0].outputs[0]
    assert len(o.token_ids) == 3 and o.finish_reason == "length"


def test_seeded_sampling_is_reproducible(bf16):
    sp = SamplingParams(max_tokens=12, temperature=0.9, top_p=0.95, seed=123)
    a = bf16.generate([PROMPTS[0]], sp, use_tqdm=False)[0].outputs[0].token_ids
    b = bf16.generate([PROMPTS[1], PROMPTS[0]], [GREEDY, sp], use_tqdm=False)[1].outputs[0].token_ids
    assert a == b


@pytest.mark.parametrize("fmt", ["fp8_e4m3", "fp8_e5m2", "int8_per_token_head", "fp8_per_block", "int4_kivi",
                                 "int2_kivi"])
def test_every_format_generates_and_agreement_is_reported(bf16_greedy, fmt, capsys):
    want = [o.outputs[0].token_ids for o in bf16_greedy]
    llm = LLM("default", kv_cache_dtype=fmt, kv_cache_memory="128MiB", max_num_seqs=8, progress=False)
    assert (llm.engine.info["kv_cache_dtype"]["k"], llm.engine.info["kv_cache_dtype"]["v"]) == (fmt, fmt)
    outs = llm.generate(PROMPTS, GREEDY, use_tqdm=False)
    agree = []
    for w, o in zip(want, outs):
        got = o.outputs[0].token_ids
        assert len(got) == GREEDY.max_tokens
        n = next((i for i, (x, y) in enumerate(zip(w, got)) if x != y), len(w))
        agree.append(n / len(w))
    with capsys.disabled():
        print(f"\n[{fmt}] greedy agreement with bf16 KV (prefix fraction per prompt): {agree}")
    assert llm.engine.block_manager.num_free_blocks("q") == llm.engine.pool.num_q_blocks


def test_bad_requests_raise(bf16):
    with pytest.raises(ValueError, match="max_tokens"):
        SamplingParams(max_tokens=0)
    with pytest.raises(ValueError):
        bf16.generate(["x" * 10], SamplingParams(max_tokens=bf16.engine.max_model_len), use_tqdm=False)
    with pytest.raises(ValueError, match="valid formats"):
        LLM("default", kv_cache_dtype="fp9", progress=False)
    with pytest.raises(ValueError, match="cannot serve"):
        LLM("default", attention_backend="triton", device="cpu", progress=False)


def test_cli_generate_streams_text():
    r = subprocess.run([sys.executable, "-m", "kvq.cli", "generate", "--no-chat", "--max-tokens", "5",
                        "--kv-cache-dtype", "fp8", "--kv-cache-memory", "64MiB", "The capital of France is"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 0, r.stderr[-2000:]
    assert "Paris" in r.stdout
    assert "backend torch" in r.stderr and "KV fp8_e4m3/fp8_e4m3" in r.stderr
    r = subprocess.run([sys.executable, "-m", "kvq.cli", "generate", "--kv-cache-dtype", "nope", "hi"],
                       capture_output=True, text=True, timeout=600)
    assert r.returncode == 2 and "valid formats" in r.stderr


@pytest.mark.parametrize("kv", [{"kv_cache_dtype": "int4_kivi"},
                                {"kv_cache_dtype": "fp8_e4m3", "kv_cache_tiers": "int4_kivi"}], ids=["int4", "tiered"])
def test_profile_step_runs_through_the_runner(tmp_path, kv):
    """The memory profiler's step (largest prefill, max_num_seqs scored rows) goes through a
    ModelRunner like every other forward, on a scratch pool of the plan (a tiered plan's counts
    slabs); on the CPU it runs, only the peak is CUDA's."""

    from kvq.engine.llm_engine import EngineConfig, LLMEngine

    model = write_tiny(tmp_path, vocab_size=512, hidden_size=128, intermediate_size=128, num_hidden_layers=2,
                       num_attention_heads=4, num_key_value_heads=2, max_position_embeddings=256)
    eng = LLMEngine(EngineConfig(model=model, load_format="dummy", device="cpu", **kv,
                                 max_num_seqs=3, max_num_batched_tokens=100, kv_cache_memory="8MiB", progress=False))
    runner, step, seqs = eng.profile_step()
    logits, rows = runner.execute(step, seqs)
    assert logits.shape == (3, 512) and rows == [0, 0, 0] and torch.isfinite(logits).all()


def test_freeze_gc_option(tmp_path):
    """freeze_gc=True freezes the collector's view of the built engine and raises its first threshold
    (the CUDA default); off on the CPU."""
    import gc

    from kvq.engine.llm_engine import EngineConfig, LLMEngine

    kw = dict(model=write_tiny(tmp_path), load_format="dummy", device="cpu", kv_cache_memory="4MiB", progress=False)
    gc.unfreeze()
    before = gc.get_threshold()
    try:
        gc.set_threshold(700, 10, 10)
        LLMEngine(EngineConfig(**kw))
        assert gc.get_freeze_count() == 0 and gc.get_threshold() == (700, 10, 10)  # CPU default: off
        LLMEngine(EngineConfig(freeze_gc=True, max_num_seqs=1024, **kw))
        # frozen, and one step's outputs (~5 tracked objects per running request) below the first threshold
        assert gc.get_freeze_count() > 0 and gc.get_threshold() == (20 * 1024, 10, 10)
    finally:
        gc.unfreeze()
        gc.set_threshold(*before)


@pytest.mark.parametrize("fmt", ["int4_kivi", "fp8_per_block"])
def test_seals_run_inside_the_forward_like_apply_ops(tmp_path, monkeypatch, fmt):
    """A step whose ops are all seals hands them to the forward, each layer sealing just
    before its own K/V write; the tokens and every pool byte equal those of running the
    ops first (the old order), and seals really happened."""

    from kvq.engine import model_runner
    from kvq.engine.llm_engine import EngineConfig, LLMEngine
    from kvq.engine.sampling_params import SamplingParams

    write_tiny(tmp_path, num_hidden_layers=2, max_position_embeddings=256)

    def run(in_forward: bool):
        if not in_forward:
            monkeypatch.setattr(model_runner, "layer_ops", lambda ops: None)
        eng = LLMEngine(EngineConfig(model=str(tmp_path), load_format="dummy", device="cpu", kv_cache_dtype=fmt,
                                     kv_sink_tokens=0, kv_residual_tokens=40, max_num_seqs=4,
                                     max_num_batched_tokens=64, kv_cache_memory="4MiB", progress=False, seed=0))
        sealed = []
        execute = eng.runner.execute
        eng.runner.execute = lambda sched, seqs, feed=None: (sealed.append(len(sched.ops)),
                                                             execute(sched, seqs, feed))[1]
        for prompt in ([1, 2, 3] * 10, [5, 6] * 30):
            eng.add_request(prompt, SamplingParams(max_tokens=60, ignore_eos=True))
        tokens = {}
        while eng.has_unfinished():
            for o in eng.step():
                tokens[o.request_id] = list(o.outputs[0].token_ids)
        monkeypatch.undo()
        return tokens, eng.pool, sum(sealed)

    tok_a, pool_a, n_a = run(True)
    tok_b, pool_b, n_b = run(False)
    assert n_a == n_b > 0
    assert tok_a == tok_b
    for la, lb in zip(pool_a.layers, pool_b.layers):
        for ta, tb in zip(la.tensors(), lb.tensors()):
            assert torch.equal(ta.view(torch.uint8), tb.view(torch.uint8))


def test_async_scheduling_gives_the_same_outputs(bf16):
    """Asynchronous scheduling (step N+1 scheduled and launched before step N's tokens are
    read, pending tokens fed from the sampler's output on the device) changes no output:
    greedy and seeded sampling, a stop string one step late, chunked prefill and
    preemption with tokens in flight, logprobs."""
    params = [SamplingParams(max_tokens=48, temperature=0, logprobs=2),
              SamplingParams(max_tokens=48, temperature=0.8, seed=7),
              SamplingParams(max_tokens=48, temperature=0, stop=[" the"]),
              SamplingParams(max_tokens=44, temperature=0)]
    want = bf16.generate(PROMPTS, params, use_tqdm=False)
    assert any(o.outputs[0].finish_reason == "stop" for o in want), "the stop string should end one request"
    for kw in (dict(kv_cache_memory="128MiB", max_num_seqs=8),
               dict(max_num_batched_tokens=8, max_num_seqs=4, kv_cache_memory=8 * bf16.engine.plan.bytes_per_block)):
        llm = LLM("default", kv_cache_dtype="bfloat16", async_scheduling=True, progress=False, **kw)
        got = llm.generate(PROMPTS, params, use_tqdm=False)
        for w, g in zip(want, got):
            a, b = w.outputs[0], g.outputs[0]
            assert (b.token_ids, b.text, b.finish_reason, b.stop_reason) == \
                (a.token_ids, a.text, a.finish_reason, a.stop_reason), kw
            assert [x["token_id"] for x in b.logprobs or []] == [x["token_id"] for x in a.logprobs or []]
        eng = llm.engine
        assert not eng.has_unfinished() and eng.block_manager.num_free_blocks("q") == eng.pool.num_q_blocks
        if "max_num_batched_tokens" in kw:
            assert sum(o.metrics["num_preemptions"] for o in got) > 0, "the small pool should force preemption"


def test_a_step_crosses_to_the_device_in_one_copy(bf16):
    """The runner stages every input of an eager step (metadata, ids, positions, logit rows,
    fed rows) through one host->device copy: on the CPU the staging counts its copies."""
    eng = bf16.engine
    assert eng.info["async_scheduling"] is False  # the CPU default: nothing to overlap
    copies = eng.runner.staging.copies
    steps = 0
    eng.add_request(eng.tokenizer.encode("Counting copies"), SamplingParams(max_tokens=5, temperature=0))
    while eng.has_unfinished():
        eng.step()
        steps += 1
    assert steps >= 5 and eng.runner.staging.copies - copies == steps
