"""Prompt logprobs (SamplingParams.prompt_logprobs; kvq.engine.prompt_logprobs) on the CPU: the values
against transformers (the default model, and exactly on a float32 tiny model with the same weights),
chunked prefill, preemption, async scheduling, prefix caching, a quantized format, unchanged outputs,
validation."""

import json
import math

import pytest
import torch

from kvq.engine.errors import RequestError
from kvq.engine.llm import LLM
from kvq.engine.sampling_params import SamplingParams

TEXT = ("The printing press was invented in the fifteenth century by Johannes Gutenberg, a goldsmith from "
        "Mainz. It changed how books were made, and it helped new ideas spread quickly across all of Europe.")
K = 5
SCORE = SamplingParams(max_tokens=1, temperature=0, prompt_logprobs=K)
TINY = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=256, hidden_size=64,
            intermediate_size=128, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=False,
            torch_dtype="float32", initializer_range=0.3)


def _values(pl) -> list[float]:
    return [e["logprob"] for e in pl[1:]]


def _check_shape(pl, ids, k=K):
    """One entry per prompt token, None first; each entry's token is the prompt's, k alternatives."""
    assert len(pl) == len(ids) and pl[0] is None
    assert [e["token_id"] for e in pl[1:]] == list(ids[1:])
    for e in pl[1:]:
        assert len(e["top"]) == k and all(math.isfinite(lp) for _, lp in e["top"]) and math.isfinite(e["logprob"])
        tops = [lp for _, lp in e["top"]]
        assert tops == sorted(tops, reverse=True) and (not k or e["logprob"] <= tops[0] + 1e-6)
        if e["token_id"] in dict(e["top"]):
            assert dict(e["top"])[e["token_id"]] == pytest.approx(e["logprob"], abs=1e-6)


@pytest.fixture(scope="module")
def ids():
    from kvq.models.loader import load_tokenizer

    out = load_tokenizer("default")(TEXT, add_special_tokens=True)["input_ids"]
    assert 35 <= len(out) <= 50
    return out


@pytest.fixture(scope="module")
def bf16():
    return LLM("default", kv_cache_dtype="bfloat16", kv_cache_memory="64MiB", max_num_seqs=4, progress=False)


def _hf_logprobs(lm, ids, kv_dtype=None) -> torch.Tensor:
    """[P, V] log_softmax (float32) of a transformers model's logits at every prompt position; with
    ``kv_dtype`` K (after RoPE) and V are rounded to it, as the paged cache stores them."""
    from transformers.models.llama import modeling_llama as ml

    orig, hooks = ml.apply_rotary_pos_emb, []
    if kv_dtype is not None:
        def rounded(q, k, *a, **kw):
            q, k = orig(q, k, *a, **kw)
            return q, k.to(kv_dtype).float()

        ml.apply_rotary_pos_emb = rounded
        hooks = [layer.self_attn.v_proj.register_forward_hook(lambda m, i, o: o.to(kv_dtype).float())
                 for layer in lm.model.layers]
    try:
        with torch.no_grad():
            return lm(torch.tensor([ids])).logits[0].float().log_softmax(-1)
    finally:
        ml.apply_rotary_pos_emb = orig
        for h in hooks:
            h.remove()


def test_default_model_matches_transformers(bf16, ids):
    """bf16 KV: the cache holds K and V in bfloat16 (the model's dtype; the CPU computes in float32),
    so the reference is transformers in float32 with K and V rounded the same way.  Two independent
    implementations differ in the last bits before that rounding, and a bit that flips a bfloat16
    rounding moves a logprob by up to ~1e-2 on this prompt (mean ~1e-3); the exact comparison (1e-4)
    is the float32 test below.  A wrong row, position or target would be off by whole nats."""
    from kvq.models.loader import load_hf_model

    ref = _hf_logprobs(load_hf_model("default", progress=False).model, ids, torch.bfloat16)
    pl = bf16.generate([ids], SCORE, use_tqdm=False)[0].prompt_logprobs
    _check_shape(pl, ids)
    want = ref[:-1].gather(1, torch.tensor(ids[1:])[:, None])[:, 0]
    got = torch.tensor(_values(pl))
    assert (got - want).abs().max().item() < 5e-2
    assert (got - want).abs().mean().item() < 5e-3
    for p, e in enumerate(pl[1:]):
        assert [i for i, _ in e["top"]] == ref[p].topk(K).indices.tolist(), p


@pytest.fixture(scope="module")
def tiny(tmp_path_factory):
    """A float32 tiny Llama (its cache's high-precision pool is float32 too) and transformers with the
    same weights (kvq loads the transformers state dict)."""
    from transformers import LlamaConfig, LlamaForCausalLM

    d = tmp_path_factory.mktemp("tiny_plp")
    (d / "config.json").write_text(json.dumps(TINY))
    torch.manual_seed(0)
    hf = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in TINY.items() if k not in ("architectures", "model_type")}))
    hf = hf.float().eval()
    llm = LLM(str(d), load_format="dummy", kv_cache_memory="4MiB", max_num_seqs=4, max_num_batched_tokens=256,
              progress=False)
    llm.engine.model.load_hf_state_dict({k: v.detach().clone() for k, v in hf.state_dict().items()})
    return d, hf, llm


def _tiny_llm(tiny, **kw) -> LLM:
    d, hf, _ = tiny
    llm = LLM(str(d), load_format="dummy", kv_cache_memory=kw.pop("kv_cache_memory", "4MiB"), progress=False, **kw)
    llm.engine.model.load_hf_state_dict({k: v.detach().clone() for k, v in hf.state_dict().items()})
    return llm


TINY_IDS = [(7 * i * i + 3 * i + 1) % 256 for i in range(90)]


def test_float32_model_matches_transformers_exactly(tiny):
    _, hf, llm = tiny
    ref = _hf_logprobs(hf, TINY_IDS)
    out = llm.generate([TINY_IDS], SCORE, use_tqdm=False)[0]
    pl = out.prompt_logprobs
    _check_shape(pl, TINY_IDS)
    want = ref[:-1].gather(1, torch.tensor(TINY_IDS[1:])[:, None])[:, 0]
    assert (torch.tensor(_values(pl)) - want).abs().max().item() < 1e-4
    for p, e in enumerate(pl[1:]):
        assert [i for i, _ in e["top"]] == ref[p].topk(K).indices.tolist(), p
        assert [lp for _, lp in e["top"]] == pytest.approx(ref[p].topk(K).values.tolist(), abs=1e-4)
    # the sampled token is still the argmax at the last prompt position
    assert out.outputs[0].token_ids == [int(ref[-1].argmax())]


def test_chunks_preemption_async_and_prefix_cache_keep_the_values(tiny):
    """Chunked prefill (16-token chunks), preemption by recompute in the middle of prompts (a pool
    too small for the batch), asynchronous scheduling, and a prompt whose prefix is cached: the same
    values, each position once, every position scored (no prefix hit taken)."""
    _, _, one = tiny
    prompts = [TINY_IDS, TINY_IDS[5:80], [3] + TINY_IDS[:60], TINY_IDS[::-1][:70]]
    sp = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True, prompt_logprobs=2)
    want = one.generate(prompts, sp, use_tqdm=False)
    small = _tiny_llm(tiny, max_num_batched_tokens=16, max_num_seqs=4,
                      kv_cache_memory=8 * one.engine.plan.bytes_per_block)  # 128 tokens; the longest needs 95
    for llm in (small, _tiny_llm(tiny, max_num_batched_tokens=16, max_num_seqs=4, async_scheduling=True)):
        got = llm.generate(prompts, sp, use_tqdm=False)
        if llm is small:
            assert sum(o.metrics["num_preemptions"] for o in got) > 0, "the small pool should force preemption"
        for w, g, p in zip(want, got, prompts):
            _check_shape(g.prompt_logprobs, p, 2)
            assert max(abs(a - b) for a, b in zip(_values(w.prompt_logprobs), _values(g.prompt_logprobs))) < 1e-5
            assert [e["top"][0][0] for e in g.prompt_logprobs[1:]] == [e["top"][0][0] for e in w.prompt_logprobs[1:]]
            assert g.outputs[0].token_ids == w.outputs[0].token_ids
    assert small.engine.block_manager.num_free_blocks("q") == small.engine.pool.num_q_blocks
    # prefix cache: the prompt's blocks are cached by now; a scored request takes no hit
    bm = one.engine.block_manager
    plain = SamplingParams(max_tokens=1, temperature=0)
    one.generate([TINY_IDS], plain, use_tqdm=False)
    hits = bm.allocator("q").num_hits + bm.allocator("hp").num_hits
    again = one.generate([TINY_IDS], sp, use_tqdm=False)[0]
    assert bm.allocator("q").num_hits + bm.allocator("hp").num_hits == hits
    assert _values(again.prompt_logprobs) == pytest.approx(_values(want[0].prompt_logprobs), abs=1e-5)
    one.generate([TINY_IDS], plain, use_tqdm=False)  # and the unscored one still hits
    assert bm.allocator("q").num_hits + bm.allocator("hp").num_hits > hits


def test_outputs_unchanged_and_every_output_carries_them(tiny):
    """Greedy tokens (and a seeded sample) are the same with and without prompt_logprobs, batched
    beside requests without them; a one-token prompt has [None]; a streamed request has the list on
    every output; without the option the field is None."""
    _, _, llm = tiny
    p2 = TINY_IDS[10:50]
    plain = [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True),
             SamplingParams(max_tokens=8, temperature=0.8, seed=7, ignore_eos=True)]
    scored = [SamplingParams(max_tokens=8, temperature=0, ignore_eos=True, prompt_logprobs=0),
              SamplingParams(max_tokens=8, temperature=0.8, seed=7, ignore_eos=True, prompt_logprobs=3)]
    a = llm.generate([TINY_IDS, p2], plain, use_tqdm=False)
    b = llm.generate([TINY_IDS, p2], [scored[0], plain[1]], use_tqdm=False)
    c = llm.generate([TINY_IDS, p2], scored, use_tqdm=False)
    for x in (b, c):
        assert [o.outputs[0].token_ids for o in x] == [o.outputs[0].token_ids for o in a]
    assert a[0].prompt_logprobs is None and b[1].prompt_logprobs is None
    _check_shape(c[0].prompt_logprobs, TINY_IDS, 0)
    _check_shape(c[1].prompt_logprobs, p2, 3)
    assert llm.generate([[5]], scored[0], use_tqdm=False)[0].prompt_logprobs == [None]
    eng = llm.engine
    rid = eng.add_request(TINY_IDS, scored[0])
    seen = []
    while eng.has_unfinished():
        seen += [o.prompt_logprobs for o in eng.step() if o.request_id == rid]
    assert len(seen) == 8 and all(s is not None and s == seen[0] for s in seen)
    assert seen[0] == c[0].prompt_logprobs


def test_default_model_greedy_unchanged_and_chunked_identical(bf16, ids):
    sp = SamplingParams(max_tokens=8, temperature=0)
    want = [o.outputs[0].token_ids for o in bf16.generate([ids, "Once upon a time"], sp, use_tqdm=False)]
    scored = SamplingParams(max_tokens=8, temperature=0, prompt_logprobs=K)
    got = bf16.generate([ids, "Once upon a time"], [scored, sp], use_tqdm=False)
    assert [o.outputs[0].token_ids for o in got] == want
    chunked = LLM("default", kv_cache_dtype="bfloat16", kv_cache_memory="64MiB", max_num_seqs=4,
                  max_num_batched_tokens=8, progress=False)
    c = chunked.generate([ids], scored, use_tqdm=False)[0]
    assert c.outputs[0].token_ids == want[0]
    assert max(abs(x - y) for x, y in zip(_values(c.prompt_logprobs), _values(got[0].prompt_logprobs))) < 1e-5


@pytest.mark.parametrize("kw", [dict(kv_cache_dtype="int4_kivi", kv_sink_tokens=0, kv_residual_tokens=0),
                                dict(kv_cache_dtype="fp8_e4m3")], ids=["int4_kivi", "fp8_e4m3"])
def test_quantized_format_has_its_own_values(bf16, ids, kw):
    """No sink or residual window kept in high precision (KIVI's default 128-token window would hold
    the whole prompt in bf16, and the values would be bf16's exactly): the prompt's keys are read
    quantized, and the logprobs move, a little."""
    q = LLM("default", kv_cache_memory="64MiB", max_num_seqs=4, progress=False, **kw)
    pl = q.generate([ids], SCORE, use_tqdm=False)[0].prompt_logprobs
    _check_shape(pl, ids)
    ref = _values(bf16.generate([ids], SCORE, use_tqdm=False)[0].prompt_logprobs)
    diff = [abs(a - b) for a, b in zip(_values(pl), ref)]
    assert max(diff) > 1e-2, "quantized KV should move the prompt logprobs"
    assert sum(diff) / len(diff) < 0.5, "but stay near bf16's"


@pytest.mark.parametrize("bad", [-1, 21, 2.0, True, "3"])
def test_validation_names_prompt_logprobs(bad):
    with pytest.raises(RequestError, match="prompt_logprobs") as e:
        SamplingParams(prompt_logprobs=bad)
    assert e.value.param == "prompt_logprobs"
    assert SamplingParams(prompt_logprobs=20).prompt_logprobs == 20
    assert SamplingParams(prompt_logprobs=0).prompt_logprobs == 0
