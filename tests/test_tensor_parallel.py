"""Tensor parallelism on the CPU over gloo: the partition (properties), the weight shards, and the
default model served by two ranks against one, token for token and byte for byte per KV head."""

from __future__ import annotations

import functools
import os
import subprocess
import sys

import pytest
import torch
from hypothesis import given
from hypothesis import strategies as st

from kvq.cache.plan import make_plan
from kvq.engine.llm import LLM
from kvq.engine.llm_engine import EngineConfig
from kvq.engine.sampling_params import SamplingParams
from kvq.models.llama import LlamaConfig, fuse_projections
from kvq.models.source import model_shape, resolve_model
from kvq.cache.partition import Partition, split
from kvq.models.shard import shard_state_dict


# -- the partition: tensor-free -------------------------------------------------------------------
@given(n=st.integers(1, 10_000), world=st.integers(1, 16))
def test_split_covers_everything_once_in_order(n, world):
    runs = [split(n, world, r) for r in range(world)]
    assert runs[0][0] == 0 and runs[-1][1] == n
    assert all(a[1] == b[0] for a, b in zip(runs, runs[1:]))
    sizes = [b - a for a, b in runs]
    assert max(sizes) - min(sizes) <= 1 and sizes == sorted(sizes, reverse=True)


@given(kv=st.integers(1, 16), group=st.integers(1, 8), world=st.integers(1, 16), vocab=st.integers(1, 100_000))
def test_partition_keeps_query_groups_with_their_kv_head(kv, group, world, vocab):
    if world > kv and (world % kv or (kv * group) % world):
        with pytest.raises(ValueError, match=r"valid: 1\.\.%d" % kv):
            Partition(world, 0, kv * group, kv, 64, vocab)
        return
    parts = [Partition(world, r, kv * group, kv, 64, vocab) for r in range(world)]
    replicas = max(1, world // kv)
    assert all(p.replicas == replicas and p.local_kv_heads >= 1 for p in parts)
    assert sum(p.local_kv_heads for p in parts) == kv * replicas  # each KV head on `replicas` ranks
    assert [h for p in parts for h in range(*p.heads)] == list(range(kv * group))  # each query head once
    for p in parts:
        (ka, kb), (qa, qb) = p.kv_heads, p.heads
        assert ka * group <= qa < qb <= kb * group  # a rank's queries read only the KV heads it holds
    assert {p.local_vocab for p in parts} == {parts[0].padded_vocab // world}
    assert parts[0].padded_vocab >= vocab > parts[0].padded_vocab - world


def test_shards_put_back_together_are_the_checkpoint():
    cfg = LlamaConfig(vocab_size=11, hidden_size=8, intermediate_size=10, num_layers=1, num_heads=6,
                      num_kv_heads=3, head_dim=4, attention_bias=True)
    g = torch.Generator().manual_seed(0)
    shapes = {"q_proj.weight": (24, 8), "q_proj.bias": (24,), "k_proj.weight": (12, 8), "k_proj.bias": (12,),
              "v_proj.weight": (12, 8), "v_proj.bias": (12,), "o_proj.weight": (8, 24)}
    state = {f"model.layers.0.self_attn.{k}": torch.randn(s, generator=g) for k, s in shapes.items()}
    state |= {f"model.layers.0.mlp.{k}": torch.randn(s, generator=g) for k, s in
              {"gate_proj.weight": (10, 8), "up_proj.weight": (10, 8), "down_proj.weight": (8, 10)}.items()}
    state |= {"model.embed_tokens.weight": torch.randn(11, 8, generator=g), "model.norm.weight": torch.randn(8)}
    shards = [shard_state_dict(state, cfg, Partition.of(cfg, 2, r)) for r in range(2)]
    for name, t in state.items():
        if name.endswith(("o_proj.weight", "down_proj.weight")):
            assert torch.equal(torch.cat([s[name] for s in shards], dim=1), t), name
        elif name.endswith("norm.weight"):
            assert all(torch.equal(s[name], t) for s in shards)
        else:
            whole = torch.cat([s[name] for s in shards])
            assert torch.equal(whole[: t.shape[0]], t), name
            assert not whole[t.shape[0]:].any()  # the vocabulary's padding row
    # rank 0 holds KV heads 0-1 with query heads 0-3, rank 1 KV head 2 with query heads 4-5
    fused = fuse_projections(shards[1])["model.layers.0.self_attn.qkv_proj.weight"]
    q, k, v = (state[f"model.layers.0.self_attn.{n}_proj.weight"] for n in "qkv")
    assert torch.equal(fused, torch.cat([q[16:24], k[8:12], v[8:12]]))


# -- errors, before any rank starts ---------------------------------------------------------------
def test_bad_tensor_parallel_choices_are_refused_up_front():
    with pytest.raises(ValueError, match="tensor_parallel_size must be an int >= 1"):
        EngineConfig(tensor_parallel_size=0)
    with pytest.raises(ValueError, match="cpu_offload_gb"):
        EngineConfig(tensor_parallel_size=2, cpu_offload_gb=1)
    with pytest.raises(ValueError, match="distributed_timeout_s"):
        EngineConfig(distributed_timeout_s=0)
    with pytest.raises(ValueError, match=r"exceeds the model.s 3 KV heads.*valid: 1\.\.3"):
        LLM(tensor_parallel_size=4, device="cpu", progress=False)


def test_cli_tensor_parallel_size_too_large_exits_2():
    r = subprocess.run([sys.executable, "-m", "kvq", "generate", "hi", "--tensor-parallel-size", "5",
                        "--device", "cpu", "--max-tokens", "2"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2, r.stderr[-2000:]
    assert "valid: 1..3" in r.stderr
    r = subprocess.run([sys.executable, "-m", "kvq", "serve", "--kv-role", "prefill", "--tensor-parallel-size", "2",
                        "--device", "cpu"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 2 and "--kv-role prefill with --tensor-parallel-size 2" in r.stderr, r.stderr[-2000:]


# -- two ranks against one on the default model ---------------------------------------------------
#: `make gpu-test-tp` runs these on two GPUs (NCCL); CI on the CPU (gloo)
DEVICE = os.environ.get("KVQ_TEST_TP_DEVICE", "cpu")
PROMPTS = ["The capital of France is", "def fibonacci(n):\n",
           "Once upon a time, in a small village by the sea, there lived"]
BLOCKS = 96


def _serve(tp: int, fmt: str):
    """Every rank's cache after the prompts' prefill, then greedy outputs with their top-5 logprobs;
    the KV memory of two ranks is set so that each rank's pool has as many blocks as the one
    rank's, so that block ids line up."""
    plan = make_plan(model_shape(resolve_model("default")), fmt)
    memory = BLOCKS * plan.bytes_per_block * 2 // 3 if tp == 2 else BLOCKS * plan.bytes_per_block
    llm = LLM(tensor_parallel_size=tp, kv_cache_dtype=fmt, device=DEVICE, progress=False, kv_cache_memory=memory,
              max_num_seqs=4, max_num_batched_tokens=256)
    try:
        llm.generate(PROMPTS, SamplingParams(max_tokens=1, temperature=0), use_tqdm=False)
        pools = llm.engine.rank_pools()
        outs = llm.generate(PROMPTS, SamplingParams(max_tokens=24, temperature=0, logprobs=5), use_tqdm=False)
        return [(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], pools, llm.engine.info
    finally:
        llm.shutdown()


def _head_slice(name: str, t: torch.Tensor, a: int, b: int) -> torch.Tensor:
    return t[a:b] if name.endswith("_scale") else t[:, a:b]  # static scales [H]; planes [blocks, H, ...]


def _same_or_near_tie(one, two) -> int:
    """Greedy outputs equal, or, where they first part, each run's token among the other's top 5
    (the test vLLM applies to its tensor-parallel runs): rounding in the last float32 bits, which
    a quantized cache can turn into another code, may decide a near tie.  -> prompts equal."""
    equal = 0
    for (t1, lp1), (t2, lp2) in zip(one, two):
        i = next((i for i, (a, b) in enumerate(zip(t1, t2)) if a != b), None)
        if i is None:
            assert len(t1) == len(t2)
            equal += 1
            continue
        top1, top2 = dict(lp1[i]["top"]), dict(lp2[i]["top"])
        assert t2[i] in top1 and t1[i] in top2, (i, t1, t2, top1, top2)
    return equal


# int8_per_token_head's scale planes are sliced by head like int4_kivi's; fp8_e4m3's static scales per head
# are sliced as test_per_head_checkpoint_scales_follow_their_heads checks (both left out for time)
@pytest.mark.parametrize("fmt", ["bfloat16", "int4_kivi"])
def test_two_ranks_match_one(fmt):
    out1, (pool1,), info1 = _serve(1, fmt)
    out2, pools2, info2 = _serve(2, fmt)
    equal = _same_or_near_tie(out1, out2)
    if fmt == "bfloat16":  # nothing quantized to turn last-bit differences into other codes: identical
        assert equal == len(PROMPTS)
    assert info2["kv_pool"]["q_blocks"] == info1["kv_pool"]["q_blocks"]
    tp = info2["tensor_parallel"]
    assert tp["kv_heads_per_rank"] == [[0, 2], [2, 3]] and tp["backend"] == ("gloo" if DEVICE == "cpu" else "nccl")
    assert tp["kv_pool_bytes_total"] == sum(tp["kv_pool_bytes_per_rank"]) == info1["kv_pool"]["bytes"]
    for (a, b), pool in zip(tp["kv_heads_per_rank"], pools2):
        for layer, (mine, whole) in enumerate(zip(pool, pool1)):
            assert mine.keys() == whole.keys()
            for name, t in mine.items():
                ref = _head_slice(name, whole[name], a, b)
                assert t.shape == ref.shape and t.dtype == ref.dtype, (layer, name)
                if t.numel() == 0:  # no high-precision blocks in a format without windows
                    continue
                same = t == ref
                if layer == 0:  # no all-reduce feeds layer 0's K/V (the embedding's is exact): bit for bit
                    assert same.all(), (name, a, b)
                else:  # the row-parallel sums round differently in the last float32 bits; bf16/fp8/int codes
                    # expose that rarely (measured: <= 11% of high-precision values, one unit apart)
                    assert same.float().mean() > 0.85, (layer, name, same.float().mean())


def test_a_dead_rank_fails_the_engine_and_stops_the_others():
    llm = LLM(tensor_parallel_size=2, device=DEVICE, progress=False, kv_cache_memory="64MiB", max_num_seqs=2,
              max_num_batched_tokens=64, distributed_timeout_s=60)
    workers = list(llm.engine.tp.workers)
    assert len(workers) == 1 and workers[0].is_alive()
    os.kill(workers[0].pid, 9)
    workers[0].join(timeout=30)
    with pytest.raises(RuntimeError, match="tensor parallel: a rank failed"):
        llm.generate(["hello"], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert not any(p.is_alive() for p in workers)


def test_kvq_plan_shows_every_rank_and_the_total():
    import json

    r = subprocess.run([sys.executable, "-m", "kvq", "plan", "--kv-cache-dtype", "int4_kivi", "--memory", "1GiB",
                        "--tensor-parallel-size", "2", "--json"], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    rec = json.loads(r.stdout)
    tp = rec["tensor_parallel"]
    assert [x["kv_heads"] for x in tp["ranks"]] == [[0, 2], [2, 3]]
    # bytes scale with the heads a rank holds; every rank keeps the blocks of the fullest one
    assert [x["bytes_per_block"] * 3 for x in tp["ranks"]] == [rec["bytes_per_block"] * 2, rec["bytes_per_block"]]
    fullest = tp["ranks"][0]["bytes_per_block"]
    assert tp["num_blocks"] == min(x["num_blocks"] for x in tp["ranks"]) == (1 << 30) // fullest
    assert tp["bytes_total"] == tp["num_blocks"] * rec["bytes_per_block"]


# -- replicated KV heads and per-head scales, on tiny checkpoints ------------------------------------
TINY = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=256, hidden_size=64,
            intermediate_size=96, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=1, head_dim=16,
            rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=False,
            torch_dtype="float32")


@functools.lru_cache(maxsize=1)
def _tokenizer():
    from kvq.models.loader import load_tokenizer

    return load_tokenizer("default")


def _tiny_checkpoint(path, extra: dict | None = None, **config) -> str:
    """An HF folder with random weights (seeded): config.json and model.safetensors."""
    import json

    from safetensors.torch import save_file

    cfg = {**TINY, **config}
    g = torch.Generator().manual_seed(1)
    H, D, kv, hq, inter = cfg["hidden_size"], cfg["head_dim"], cfg["num_key_value_heads"], cfg["num_attention_heads"], \
        cfg["intermediate_size"]
    w = {"model.embed_tokens.weight": (cfg["vocab_size"], H), "lm_head.weight": (cfg["vocab_size"], H)}
    for i in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{i}."
        w |= {p + "self_attn.q_proj.weight": (hq * D, H), p + "self_attn.k_proj.weight": (kv * D, H),
              p + "self_attn.v_proj.weight": (kv * D, H), p + "self_attn.o_proj.weight": (H, hq * D),
              p + "mlp.gate_proj.weight": (inter, H), p + "mlp.up_proj.weight": (inter, H),
              p + "mlp.down_proj.weight": (H, inter)}
    tensors = {k: torch.randn(s, generator=g) * 0.2 for k, s in w.items()}
    for i in range(cfg["num_hidden_layers"]):
        for n in ("input_layernorm", "post_attention_layernorm"):
            tensors[f"model.layers.{i}.{n}.weight"] = torch.ones(H)
    tensors["model.norm.weight"] = torch.ones(H)
    path.mkdir(parents=True, exist_ok=True)
    _tokenizer().save_pretrained(str(path))  # the default model's (prompts here are ids below 256)
    (path / "config.json").write_text(json.dumps(cfg))
    save_file({**tensors, **(extra or {})}, str(path / "model.safetensors"))
    return str(path)


def test_more_ranks_than_kv_heads_replicate_them(tmp_path):
    model = _tiny_checkpoint(tmp_path / "mqa")  # 4 query heads, 1 KV head: 2 ranks hold it both
    prompts = [[5, 17, 99, 3, 42, 7, 200, 11], [1, 2, 3, 4]]
    got = {}
    for tp in (1, 2):
        llm = LLM(model, tensor_parallel_size=tp, kv_cache_dtype="int8_per_token_head", device=DEVICE,
                  progress=False, kv_cache_memory="4MiB", max_num_seqs=2, max_num_batched_tokens=64)
        try:
            outs = llm.generate(prompts, SamplingParams(max_tokens=12, temperature=0, logprobs=5), use_tqdm=False)
            got[tp] = ([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs], llm.engine.rank_pools(),
                       llm.engine.info)
        finally:
            llm.shutdown()
    _same_or_near_tie(got[1][0], got[2][0])
    info = got[2][2]["tensor_parallel"]
    assert info["kv_head_replicas"] == 2 and info["kv_heads_per_rank"] == [[0, 1], [0, 1]]
    for pool in got[2][1]:  # each rank's copy of the KV head is layer 0 of the one-rank cache, bit for bit
        for name, t in pool[0].items():
            assert torch.equal(t, got[1][1][0][0][name]), name


def test_per_head_checkpoint_scales_follow_their_heads(tmp_path):
    scales = {f"model.layers.{i}.self_attn.{r}_proj.{r}_scale": torch.tensor([0.25, 0.75]) * (i + 1)
              for i in range(2) for r in "kv"}
    model = _tiny_checkpoint(tmp_path / "modelopt", scales, num_key_value_heads=2)
    llm = LLM(model, tensor_parallel_size=2, kv_cache_dtype="fp8_e4m3", device=DEVICE, progress=False,
              kv_cache_memory="4MiB", max_num_seqs=2, max_num_batched_tokens=64)
    try:
        pools = llm.engine.rank_pools()
    finally:
        llm.shutdown()
    for rank, pool in enumerate(pools):
        for layer in range(2):
            want = [(0.25, 0.75)[rank] * (layer + 1)]
            assert pool[layer]["k_scale"].tolist() == want and pool[layer]["v_scale"].tolist() == want


def test_a_hung_rank_times_out_and_every_rank_stops(tmp_path):
    import signal
    import time

    llm = LLM(_tiny_checkpoint(tmp_path / "tiny", num_key_value_heads=2), tensor_parallel_size=2, device=DEVICE,
              progress=False, kv_cache_memory="4MiB", max_num_seqs=2, max_num_batched_tokens=64,
              distributed_timeout_s=5)
    worker = llm.engine.tp.workers[0]
    os.kill(worker.pid, signal.SIGSTOP)  # alive, but answers nothing
    t = time.monotonic()
    with pytest.raises(RuntimeError, match="tensor parallel: a rank failed"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    assert time.monotonic() - t < 60
    worker.join(timeout=10)
    assert not worker.is_alive()


def test_a_rank_that_dies_while_the_engine_idles_is_seen_at_once(tmp_path):
    """The watchdog on the spawned ranks (kvq.parallel.group): no step needs to fail first.  The group's
    failure names the rank and how it died, the next step raises it at once, and the server reads it
    (kvq.server.launch.executor_failure) to exit non-zero."""
    import signal
    import time

    from kvq.server.launch import executor_failure

    llm = LLM(_tiny_checkpoint(tmp_path / "tiny", num_key_value_heads=2), tensor_parallel_size=2, device=DEVICE,
              progress=False, kv_cache_memory="4MiB", max_num_seqs=2, max_num_batched_tokens=64,
              distributed_timeout_s=60)
    worker = llm.engine.tp.workers[0]
    seen = []
    llm.engine.tp.on_failure(seen.append)
    assert llm.engine.executor.failure is None
    os.kill(worker.pid, signal.SIGKILL)
    deadline = time.monotonic() + 10
    # the failure is recorded first, then the callbacks run (TPGroup.fail): wait for both
    while (llm.engine.executor.failure is None or not seen) and time.monotonic() < deadline:
        time.sleep(0.01)
    want = f"tensor parallel: a rank failed: rank 1 (pid {worker.pid}) was killed by SIGKILL"
    assert llm.engine.executor.failure == want and seen == [want]

    class _Engine:  # what kvq.server.launch reads: the AsyncEngine's engine's executor
        engine = llm.engine

    assert executor_failure(_Engine) == want
    t = time.monotonic()
    with pytest.raises(RuntimeError, match=r"rank 1 \(pid \d+\) was killed by SIGKILL"):
        llm.generate([[1, 2, 3]], SamplingParams(max_tokens=4, temperature=0), use_tqdm=False)
    llm.shutdown()  # no stop message to a dead rank: nothing waits for the timeout
    assert time.monotonic() - t < 10


@pytest.mark.parametrize("spec", ["fp8_e4m3>int4_kivi>int2_kivi@160/320", "int8_per_token_head>int4_kivi",
                                  "bfloat16>fp8_e4m3"])
@pytest.mark.parametrize("world", [2, 3])
def test_ranks_share_their_arenas_blocks_per_slab(spec, world):
    """Alone, a rank with one KV head of the default model's three would cut its slabs otherwise than
    one with two ((15, 24, 40) against (5, 8, 13) blocks of the three tiers); the ranks' plans share
    one choice, with little waste on every rank."""
    from kvq.cache.arena import MAX_WASTE, arena_layout
    from kvq.cache.partition import rank_plans
    from kvq.cache.plan import KVCacheConfig

    plan = KVCacheConfig().with_spec(spec).plan(model_shape(resolve_model("default")))
    layouts = [arena_layout(p) for _, p in rank_plans(plan, world)]
    assert len({lay.per_slab for lay in layouts}) == 1, [lay.per_slab for lay in layouts]
    assert all(lay.waste(t) <= MAX_WASTE for lay in layouts for t in range(plan.num_tiers + 1))
    for (a, b), p in rank_plans(plan, world):  # each rank's blocks are its heads' bytes
        assert arena_layout(p).block_bytes[0][0] >= (b - a) * plan.layers[0].k.block_bytes(1, 64, plan.block_size)


def test_two_ranks_age_blocks_into_their_tier_as_one_does():
    """Elastic precision under tensor parallelism: every rank's arena holds the same blocks a slab (one
    scheduler's block ids name the same slab on each rank, whose heads differ), blocks age into the
    int4_kivi tier on both ranks alike, and two ranks generate what one does."""
    from kvq.cache.plan import KVCacheConfig

    import kvq

    prose = open(os.path.join(os.path.dirname(kvq.__file__), "data", "reference_prose.txt")).read()
    prompts = [prose[:1100], prose[2000:3000]]  # ~240 tokens: blocks 160 tokens behind the head age down
    runs = []
    for tp in (1, 2):
        llm = LLM(tensor_parallel_size=tp, kv_cache=KVCacheConfig().with_spec("fp8_e4m3>int4_kivi@160"),
                  device=DEVICE, progress=False, kv_cache_memory="48MiB", max_num_seqs=2, max_num_batched_tokens=256)
        try:
            outs = llm.generate(prompts, SamplingParams(max_tokens=16, temperature=0, logprobs=5), use_tqdm=False)
            runs.append(([(o.outputs[0].token_ids, o.outputs[0].logprobs) for o in outs],
                         list(llm.engine.block_manager.num_demotions), llm.engine.info))
        finally:
            llm.shutdown()
    (out1, dem1, info1), (out2, dem2, info2) = runs
    assert dem1[1] > 0 and dem1 == dem2, (dem1, dem2)
    assert [t["blocks_per_slab"] for t in info2["kv_pool"]["arena"]["tiers"]] == [5, 8]  # the ranks' shared ones
    _same_or_near_tie(out1, out2)
