"""Decode dispatch and CUDA graphs.

CPU: a step that mixes decodes and prefill chunks sends its leading one-token
sequences to the decode kernel and the rest to the prefill kernel; the result
equals one prefill-kernel call over the whole step.  GPU: a decode step replayed
from a CUDA graph gives the logits of the same step run eagerly, for a 16-bit,
an 8-bit and a KIVI cache, with batches that need padding rows (KIVI's block seals
run inside the replayed graph).
"""

from __future__ import annotations

import dataclasses
import json

import pytest
import torch

from kvq.attention import reference
from kvq.cache.plan import bare_model, make_plan
from kvq.cache.pool import KVPool
from kvq.cache.step import HostStep, to_device
from kvq.engine.cuda_graphs import capture_sizes
from kvq.models.llama import attend


def test_capture_sizes_cover_every_batch_with_little_padding():
    for max_batch in (1, 3, 8, 64, 100, 256, 512):
        sizes = capture_sizes(max_batch)
        assert sizes == sorted(set(sizes)) and sizes[0] == 1 and sizes[-1] == max_batch
        for b in range(1, max_batch + 1):
            g = next(s for s in sizes if s >= b)
            assert g - b < max(16, b // 4 + 1), (max_batch, b, g)


def test_num_decodes_counts_leading_single_token_sequences():
    assert HostStep([], [], [], [1, 1, 5, 1]).num_decodes == 2
    assert HostStep([], [], [], [3, 1]).num_decodes == 0
    assert HostStep([], [], [], [1, 1]).num_decodes == 2


@pytest.mark.parametrize("fmt", ["bfloat16", "fp8_e4m3", "int4_kivi"])
def test_mixed_step_dispatch_matches_one_prefill_call(fmt):
    torch.manual_seed(0)
    shape = bare_model(2, 2, 64, dtype="float32")
    plan = make_plan(shape, fmt, block_size=32)
    nb = 24
    pool = KVPool.create(plan, nb, nb, "cpu")
    layer = pool.layers[0]
    # three decodes (lengths 40, 7, 70) then two prefill chunks (5 new of 37, 33 new of 33)
    lens, new = [40, 7, 70, 37, 33], [1, 1, 1, 5, 33]
    tables, slots, next_block = [], [], 0
    for n, k in zip(lens, new):
        blocks = -(-n // 32)
        table = [-(next_block + j) - 1 for j in range(blocks)]  # hp blocks: any format takes any token
        next_block += blocks
        tables.append(table)
        slots += [-((-table[p // 32] - 1) * 32 + p % 32) - 1 for p in range(n)]
    T = sum(lens)
    k = torch.randn(T, 2, 64)
    v = torch.randn(T, 2, 64)
    reference.write_kv(layer, k, v, torch.tensor(slots))
    step = HostStep(slots=[], tables=tables, seq_lens=lens, num_new=new)
    meta = to_device(step, 32, "cpu")
    assert meta.num_decodes == 3
    q = torch.randn(sum(new), 8, 64)
    got = attend(reference, q, layer, meta, 0.125)
    want = reference.paged_attention(q, layer, meta.cu_seqlens_q, meta.block_tables, meta.seq_lens, 0.125)
    torch.testing.assert_close(got, want, rtol=1e-5, atol=1e-5)


TINY_LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=4096, hidden_size=512,
                  intermediate_size=1024, num_hidden_layers=3, num_attention_heads=8, num_key_value_heads=2,
                  head_dim=64, rms_norm_eps=1e-5, rope_theta=500000.0, max_position_embeddings=2048,
                  tie_word_embeddings=False, torch_dtype="bfloat16")


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fmt", ["bfloat16", "fp8_e4m3", "int4_kivi", "fp8_e4m3>int4_kivi@160"])
def test_graph_replay_matches_eager_decode(fmt, tmp_path):
    """(The tiered cache: blocks 160 tokens behind their head age into int4_kivi; graphs replay steps whose
    tables hold them, each tier by its own launch, and the steps that demote them, from static lists.)"""
    from kvq.cache.plan import KVCacheConfig
    from kvq.engine.llm_engine import EngineConfig, LLMEngine
    from kvq.engine.sampling_params import SamplingParams

    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    eng = LLMEngine(EngineConfig(model=str(tmp_path), load_format="dummy", kv_cache=KVCacheConfig().with_spec(fmt),
                                 kv_cache_memory="256MiB", max_num_seqs=16, progress=False))
    graphs = eng.runner.graphs
    from kvq.attention.cuda import decode8

    if fmt == "fp8_e4m3" and decode8.unavailable_reason() is None:  # the CUDA 8-bit decode is captured too
        assert eng.backend_choice.resolved == "cuda", eng.backend_choice
    assert graphs is not None and eng.info["cuda_graphs"]["batch_sizes"] == capture_sizes(16)
    g = torch.Generator().manual_seed(1)
    for n in (3, 40, 150, 300, 17):  # 5 sequences: replays the graph of 8 with 3 padding rows
        ids = torch.randint(0, 4096, (n,), generator=g).tolist()
        eng.add_request(ids, SamplingParams(max_tokens=40, ignore_eos=True))
    checked = sealed_in_graph = tiered_replays = demoted_in_graph = 0
    while eng.has_unfinished():
        sched = eng.scheduler.schedule()
        seqs = {s.seq_id: eng.scheduler.get(s.seq_id) for s in sched.scheduled}
        runner = eng.runner
        before = runner.graph_steps
        logits, sample_ids = runner.execute(sched, seqs)
        if runner.graph_steps > before:  # replayed: run the same step eagerly (same K/V rewritten)
            replayed = logits.clone()
            runner.graphs = None
            sched_again = dataclasses.replace(sched, ops=())
            eager, _ = runner.execute(sched_again, seqs)
            runner.graphs = graphs
            torch.testing.assert_close(replayed, eager, rtol=2e-2, atol=2e-2)
            # greedy tokens agree in every row whose top two logits are further apart than the replay can move
            # them (dummy weights tie some rows: H100, session 27, margins 0.0078 and 0.0 flipped at a gap of 0.0156)
            gap = (replayed.float() - eager.float()).abs().max().item()
            top2 = eager.float().topk(2, dim=-1).values
            clear = (top2[:, 0] - top2[:, 1]) > 2 * gap
            assert torch.equal(replayed.argmax(-1)[clear], eager.argmax(-1)[clear]), (gap, top2.tolist())
            checked += 1
            sealed_in_graph += len(sched.ops)
            demoted_in_graph += sum(type(op).__name__ == "DemoteOp" for op in sched.ops)
            tiered_replays += graphs.num_tiers > 0 and int(graphs.part_lens[1].sum()) > 0
        tokens = logits.argmax(-1).tolist() if logits is not None else []
        eng.scheduler.update(sched, dict(zip(sample_ids, tokens)))
    assert checked >= 30
    if fmt == "int4_kivi":  # KIVI K blocks seal as they fill: inside the replayed graph
        assert sealed_in_graph > 0
    if ">" in fmt:
        assert eng.block_manager.num_demotions[1] > 0 and tiered_replays >= 10, (eng.block_manager.num_demotions,
                                                                                 tiered_replays)
        assert demoted_in_graph > 0  # the age policy's demotions, inside the replayed graphs
    eng.block_manager.check_integrity()


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
@pytest.mark.parametrize("fmt", ["bfloat16", "int4_kivi"])
def test_async_scheduling_feeds_graphs_the_same_tokens(fmt, tmp_path):
    """Asynchronous scheduling on the GPU: pending tokens reach the replayed graphs from the
    previous step's sampler output on the device; the tokens equal a synchronous run's."""
    from kvq.engine.llm_engine import EngineConfig, LLMEngine
    from kvq.engine.sampling_params import SamplingParams

    (tmp_path / "config.json").write_text(json.dumps(TINY_LLAMA))
    g = torch.Generator().manual_seed(2)
    prompts = [torch.randint(0, 4096, (n,), generator=g).tolist() for n in (5, 70, 200, 33, 9)]
    got = {}
    for async_ in (False, True):
        eng = LLMEngine(EngineConfig(model=str(tmp_path), load_format="dummy", kv_cache_dtype=fmt,
                                     kv_cache_memory="256MiB", max_num_seqs=16, progress=False,
                                     async_scheduling=async_))
        ids = [eng.add_request(p, SamplingParams(max_tokens=40 + 3 * i, ignore_eos=True))
               for i, p in enumerate(prompts)]
        done = {}
        while eng.has_unfinished():
            for o in eng.step():
                if o.finished:
                    done[o.request_id] = o.outputs[0].token_ids
        got[async_] = [done[i] for i in ids]
        assert eng.runner.graph_steps > 20
        eng.block_manager.check_integrity()
    assert got[True] == got[False]
