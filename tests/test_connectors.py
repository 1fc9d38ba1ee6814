"""The KV connector seam (kvq.engine.connector): the engine builds every connector by its registered
name, calls each at the fixed points of its step and knows nothing else of any; prefill/decode
disaggregation goes through its two connectors (here with an in-process prefill engine in place of
the HTTP + NIXL peer: tests/test_transfer_serve.py runs the real one), and swap's copies through the
worker's swap connector.  A tiny dummy-weight model on the CPU."""

from __future__ import annotations

import json

import pytest
import torch
from kvq.connectors.cpu_prefix_tier import CPUPrefixTierConnector
from kvq.connectors.kv_export import KVExporter
from kvq.connectors.remote_prefill import RemotePrefill, RemoteResult
from kvq.connectors.swap import SwapConnector
from kvq.engine.connector import ConnectorContext, ConnectorOutput, KVConnector, make_connector
from kvq.engine.llm_engine import EngineConfig, LLMEngine
from kvq.engine.registry import CONNECTORS
from kvq.engine.sampling_params import SamplingParams

TINY = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=256, hidden_size=64,
            intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
            rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=False,
            torch_dtype="float32")
PROMPTS = [[(7 * i + 3) % 250 + 1 for i in range(n)] for n in (21, 40, 9)]
GREEDY = SamplingParams(max_tokens=8, temperature=0, ignore_eos=True)


@pytest.fixture
def model(tmp_path):
    (tmp_path / "config.json").write_text(json.dumps(TINY))
    return str(tmp_path)


def _engine(model: str, **kw) -> LLMEngine:
    kw = {"kv_cache_memory": "4MiB", "max_num_seqs": 4, "max_num_batched_tokens": 64, "device": "cpu", **kw}
    return LLMEngine(EngineConfig(model=model, load_format="dummy", progress=False, seed=0, **kw))


def _run(engine: LLMEngine) -> list:
    outs = []
    while engine.has_unfinished():
        outs += engine.step()
    return outs


def _tokens(outs) -> dict[int, list[int]]:
    return {o.request_id: o.outputs[0].token_ids for o in outs if o.finished}


def _register(monkeypatch, name: str, cls) -> None:
    monkeypatch.setitem(CONNECTORS, name, f"{__name__}:{cls.__name__}")


# -- built by name ----------------------------------------------------------------------------------
class CountingTier(CPUPrefixTierConnector):
    built = 0

    def __init__(self, ctx):
        super().__init__(ctx)
        CountingTier.built += 1


def test_the_engine_builds_its_connectors_by_registered_name(model, monkeypatch):
    assert {"cpu_prefix_tier", "remote_prefill", "kv_export", "swap"} <= CONNECTORS.keys()  # kvq/__init__.py
    _register(monkeypatch, "cpu_prefix_tier", CountingTier)
    CountingTier.built = 0
    eng = _engine(model)
    assert CountingTier.built == 1 and isinstance(eng.connector("cpu_prefix_tier"), CountingTier)
    assert eng.connectors == [eng.connector("cpu_prefix_tier")] and eng.connector("kv_export") is None
    monkeypatch.delitem(CONNECTORS, "cpu_prefix_tier")
    with pytest.raises(RuntimeError, match="no KV connector 'cpu_prefix_tier' is registered"):
        _engine(model)
    with pytest.raises(RuntimeError, match="no KV connector 'disk'"):
        make_connector("disk", ConnectorContext(pool=None))


# -- called at the fixed points of the step --------------------------------------------------------------
class Recorder(KVConnector):
    """Logs every call and checks what each point promises."""

    name = "recorder"

    def __init__(self, ctx, log: list):
        self.ctx, self.log = ctx, log

    def add_request(self, seq, kv_transfer) -> bool:
        """Takes "mine"; takes the first "refuse" and refuses the next."""
        if kv_transfer == "refuse" and any(e[0] == "add_request" and e[2] == "refuse" for e in self.log):
            self.log.append(("add_request", seq.seq_id, kv_transfer))
            raise ValueError("refused by the recorder")
        self.log.append(("add_request", seq.seq_id, kv_transfer))
        return kv_transfer in ("mine", "refuse")

    def poll(self, wait=False):
        self.log.append(("poll", wait))
        return []

    def before_forward(self, sched):
        self.log.append(("before_forward", tuple(s.seq_id for s in sched.scheduled)))

    def after_forward(self, sched):
        self.log.append(("after_forward", tuple(s.seq_id for s in sched.scheduled)))

    def sampled(self, seqs):
        # the sampled token is not appended yet, and a finishing request's blocks are still held
        bm = self.ctx.block_manager
        self.log.append(("sampled", tuple((s.seq_id, s.num_output_tokens, len(bm.block_table(s.seq_id)) > 0)
                                          for s in seqs)))
        return {s.seq_id: ("kv of", s.seq_id, s.num_tokens) for s in seqs if s.params.max_tokens == 1}

    def end_step(self):
        self.log.append(("end_step",))

    def request_finished(self, seq_id):
        self.log.append(("request_finished", seq_id))

    def issue(self, ops):
        raise AssertionError("the engine never calls issue: a connector's scheduler side does")


def test_a_connector_is_called_at_the_fixed_points_of_each_step(model, monkeypatch):
    _register(monkeypatch, "recorder", Recorder)
    eng = _engine(model)
    log: list = []
    rec = eng.add_connector("recorder", log=log)
    assert rec.ctx.scheduler is eng.scheduler and rec.ctx.pool is eng.pool and eng.connectors[-1] is rec
    a = eng.add_request(PROMPTS[0], SamplingParams(max_tokens=1, temperature=0), kv_transfer="mine")
    b = eng.add_request(PROMPTS[1], SamplingParams(max_tokens=2, temperature=0))
    assert log == [("add_request", a, "mine"), ("add_request", b, None)]
    log.clear()
    outs = eng.step()  # both prompts in one step (64 tokens of budget), both sample
    assert log == [("poll", False), ("before_forward", (a, b)), ("after_forward", (a, b)),
                   ("sampled", ((a, 0, True), (b, 0, True))), ("request_finished", a), ("end_step",)]
    assert [(o.request_id, o.finished, o.kv_transfer) for o in outs] == [
        (a, True, ("kv of", a, len(PROMPTS[0]))), (b, False, None)]
    log.clear()
    outs += eng.step()
    assert log == [("poll", False), ("before_forward", (b,)), ("after_forward", (b,)), ("sampled", ((b, 1, True),)),
                   ("request_finished", b), ("end_step",)]
    assert not eng.has_unfinished() and len(_tokens(outs)[b]) == 2


def test_a_kv_transfer_no_connector_takes_is_refused_and_nothing_stays_queued(model, monkeypatch):
    _register(monkeypatch, "recorder", Recorder)
    eng = _engine(model)
    with pytest.raises(ValueError, match="no KV connector of this engine takes it"):
        eng.add_request(PROMPTS[0], GREEDY, kv_transfer="mine")
    log: list = []
    eng.add_connector("recorder", log=log)
    with pytest.raises(ValueError, match="prompt 1: refused by the recorder"):
        eng.add_requests(PROMPTS[:2], [GREEDY, GREEDY], kv_transfer="refuse")
    first, second = log[0][1], log[1][1]
    assert ("request_finished", first) in log and ("request_finished", second) in log  # both dropped
    assert not eng.scheduler.has_unfinished() and not eng.has_unfinished()
    eng.block_manager.check_integrity()


class Mover(KVConnector):
    """Moves its (finished) requests on outside the step: holds each back until it is polled
    ``hold`` times, then reports it failed, as a peer's fill that fails without fallback would."""

    name = "mover"

    def __init__(self, ctx, hold: int):
        self.hold, self.held = hold, {}
        self.polls: list[bool] = []

    def add_request(self, seq, kv_transfer) -> bool:
        if kv_transfer == "move":
            self.held[seq.seq_id] = [self.hold, seq]
            return True
        return False

    def poll(self, wait=False):
        self.polls.append(wait)
        out = []
        for sid, held in list(self.held.items()):
            held[0] -= 1
            if held[0] < 0:
                del self.held[sid]
                out.append(ConnectorOutput(held[1], error="moved by the mover"))
        return out

    def has_pending(self) -> bool:
        return bool(self.held)

    def issue(self, ops):
        pass


def test_a_connectors_outputs_become_request_outputs_and_its_pending_work_keeps_the_engine_stepping(
        model, monkeypatch):
    _register(monkeypatch, "mover", Mover)
    eng = _engine(model)
    mover = eng.add_connector("mover", hold=4)
    rid = eng.add_request(PROMPTS[2], SamplingParams(max_tokens=200, temperature=0, ignore_eos=True),
                          kv_transfer="move")
    eng.scheduler.abort(rid)  # nothing left to schedule: only the connector's work keeps the engine going
    assert eng.has_unfinished()
    outs = _run(eng)
    assert [(o.request_id, o.finished, o.error) for o in outs] == [(rid, True, "moved by the mover")]
    # each idle step waits for the connector with pending work (not spinning); the next step reports it
    assert mover.polls == [False, True] * 2 + [False] and not eng.has_unfinished()


# -- prefill/decode disaggregation through its two connectors -------------------------------------------
def _blocks(pool):
    """(pool name, tensor [num_blocks, ...]) of every plane of every layer."""
    for layer in pool.layers:
        for role in ("k", "v"):
            yield from (("q", t) for t in layer.planes(role).values())
            yield "hp", layer.hp(role)


class BlockCopy(KVExporter):
    """A prefill engine's export straight into a decode engine's pool: the tag is the decode side's
    RemoteLoadOp, whose blocks are laid out as the prefill side's (same plan)."""

    def __init__(self, dst_pool):
        self.dst = dst_pool

    def export(self, request_id, pool, table, num_tokens, tag):
        assert num_tokens == tag.num_tokens and [r.pool for r in table] == [r.pool for r in tag.table]
        for (kind, src), (_, dst) in zip(_blocks(pool), _blocks(self.dst)):
            for s, d in zip(table, tag.table):
                if s.pool == kind:
                    dst[d.block_id].copy_(src[s.block_id])
        return {"blocks": len(table)}


class InProcessPeer(RemotePrefill):
    """A prefill engine in this process (in place of kvq.transfer.peer.PrefillClient): ``start``
    prefills the prompt there, whose ``kv_export`` connector copies its KV into the reserved blocks;
    ``poll`` reports a fill ``delay`` polls later.  ``fail``: every fill fails instead."""

    def __init__(self, prefill: LLMEngine, decode: LLMEngine, delay: int = 0, fail: bool = False,
                 fallback: bool = True):
        self.prefill, self.delay, self.fail, self.fallback = prefill, delay, fail, fallback
        self.exports = []
        prefill.add_connector("kv_export", exporter=BlockCopy(decode.pool))
        self.waiting: list[list] = []  # [polls left, RemoteResult]

    def start(self, op, token_ids, params) -> None:
        if self.fail:
            result = RemoteResult(op, None, "peer_unreachable", "nobody there")
        else:
            rid = self.prefill.add_request(list(token_ids), SamplingParams(max_tokens=1, temperature=0),
                                           kv_transfer=op)
            out = [o for o in _run(self.prefill) if o.request_id == rid][-1]
            self.exports.append(out.kv_transfer)
            result = RemoteResult(op, out.outputs[0].token_ids[0], nbytes=1)
        self.waiting.append([self.delay, result])

    def poll(self, timeout=0.0):
        ready = [r for left, r in self.waiting if left <= 0]
        self.waiting = [[left - 1, r] for left, r in self.waiting if left > 0]
        return ready

    def num_pending(self) -> int:
        return len(self.waiting)


@pytest.mark.parametrize("fmt", ["auto", "int4_kivi"])
def test_prefill_decode_through_the_connectors_gives_the_colocated_tokens(model, fmt):
    kw = {"kv_cache_dtype": fmt, "kv_residual_tokens": 16} if fmt == "int4_kivi" else {}
    colocated = _engine(model, **kw)
    colocated.add_requests(PROMPTS, [GREEDY] * 3)
    want = list(_tokens(_run(colocated)).values())
    decode = _engine(model, **kw)
    peer = InProcessPeer(_engine(model, **kw), decode, delay=2)
    rp = decode.add_connector("remote_prefill", peer=peer)
    assert decode.connectors == [decode.connector("cpu_prefix_tier"), rp] and rp.loads_prompts
    decode.add_requests(PROMPTS, [GREEDY] * 3)
    got = _tokens(_run(decode))
    assert list(got.values()) == want
    bs = decode.plan.block_size
    assert [e["blocks"] for e in peer.exports] == [-(-len(p) // bs) for p in PROMPTS]
    assert rp.stats() == {"filled": 3, "failed": 0, "discarded": 0, "bytes": 3, "seconds": 0.0}
    assert decode.scheduler.num_remote_loads == 3 and peer.prefill.connector("kv_export").tags == {}
    decode.block_manager.check_integrity()
    assert decode.block_manager.allocator("q").num_used == 0


def test_failed_fills_fall_back_or_fail_through_the_connector(model):
    colocated = _engine(model)
    colocated.add_requests(PROMPTS[:2], [GREEDY] * 2)
    want = list(_tokens(_run(colocated)).values())
    decode = _engine(model)
    rp = decode.add_connector("remote_prefill", peer=InProcessPeer(_engine(model), decode, fail=True))
    decode.add_requests(PROMPTS[:2], [GREEDY] * 2)
    assert list(_tokens(_run(decode)).values()) == want  # prefilled here instead
    assert rp.stats()["failed"] == 2
    rp.peer.fallback = False  # read at each result, as the server's tests patch it
    rid = decode.add_request(PROMPTS[0], GREEDY)
    (out,) = _run(decode)
    assert out.request_id == rid and out.finished and out.outputs[0].token_ids == []
    assert out.error == "KV transfer from the prefill peer failed (peer_unreachable): nobody there"
    decode.block_manager.check_integrity()


def test_an_aborted_requests_fill_is_discarded_when_it_ends(model):
    decode = _engine(model)
    rp = decode.add_connector("remote_prefill", peer=InProcessPeer(_engine(model), decode, delay=3))
    rid = decode.add_request(PROMPTS[1], GREEDY)
    assert decode.step() == [] and rp.has_pending()  # the fill started before the forward
    decode.abort(rid)
    assert not decode.scheduler.has_unfinished() and decode.has_unfinished()  # its blocks wait for the fill
    assert _run(decode) == [] and rp.stats()["discarded"] == 1
    decode.block_manager.check_integrity()
    assert decode.block_manager.allocator("q").num_used == 0


# -- swap's copies through the worker's connector ---------------------------------------------------------
class CountingSwap(SwapConnector):
    ops: list = []

    def issue(self, ops):
        CountingSwap.ops += list(ops)
        super().issue(ops)


needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.mark.parametrize("device,fmt", [("cpu", "auto"),
                                        pytest.param("cuda", "bfloat16", marks=[pytest.mark.gpu, needs_cuda]),
                                        pytest.param("cuda", "int4_kivi", marks=[pytest.mark.gpu, needs_cuda])])
def test_swap_copies_go_through_the_workers_swap_connector(model, monkeypatch, device, fmt):
    """On CUDA the copies are asynchronous (pinned host slots, a copy stream) and the decode steps
    replay CUDA graphs: the swapped requests still give the tokens of a run that never swapped."""
    sp = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)
    dev = {"device": device, "kv_cache_dtype": fmt}
    if fmt == "int4_kivi":
        dev.update(kv_residual_tokens=32, block_size=32)
    roomy = _engine(model, **dev)
    roomy.add_requests(PROMPTS, [sp] * 3)
    want = _tokens(_run(roomy))
    plan = roomy.plan
    hp = 2 if fmt != "int4_kivi" else 4 * 4  # KIVI: each running sequence holds its window's hp blocks
    small = dict(kv_cache_memory=5 * plan.bytes_per_block + hp * plan.hp_bytes_per_block, preemption_mode="swap",
                 cpu_offload_gb=0.01, **dev)
    _register(monkeypatch, "swap", CountingSwap)
    CountingSwap.ops = []
    eng = _engine(model, **small)
    assert isinstance(eng.worker.swap, CountingSwap) and eng.worker.runner.swap is eng.worker.swap
    eng.add_requests(PROMPTS, [sp] * 3)
    assert list(_tokens(_run(eng)).values()) == list(want.values())
    s, st = eng.scheduler, eng.worker.swap.stats()
    assert s.num_swapped_out > 0 and s.num_swapped_in == s.num_swapped_out
    assert {op.direction for op in CountingSwap.ops} == {"out", "in"}
    assert st["swapped_out_blocks"] == st["swapped_in_blocks"] == sum(
        len(op.q) + len(op.hp) for op in CountingSwap.ops if op.direction == "out")
    monkeypatch.delitem(CONNECTORS, "swap")
    with pytest.raises(RuntimeError, match="no KV connector 'swap'"):
        _engine(model, **small)


# -- the CPU prefix tier's stores of an aborted request -------------------------------------------------
def test_stores_decided_while_no_step_runs_keep_the_engine_stepping_until_their_blocks_are_back(model):
    """Aborting the last running request decides stores of its full blocks into the CPU prefix tier with
    no step left to issue them: the connector reports them pending, so a server's loop keeps stepping
    and the device blocks come back (found by benchmarks/soak.py: they stayed held while the engine idled)."""
    eng = _engine(model, cpu_offload_gb=0.01)
    tier = eng.connector("cpu_prefix_tier")
    rid = eng.add_request(PROMPTS[1], SamplingParams(max_tokens=30, temperature=0, ignore_eos=True))
    for _ in range(4):
        eng.step()
    eng.abort(rid)
    bm = eng.block_manager
    assert not eng.scheduler.has_unfinished() and bm.num_host_ops_queued > 0  # stores decided, not issued
    assert tier.has_pending() and eng.has_unfinished()
    assert bm.allocator("q").num_used > 0  # held by the stores
    steps = 0
    while eng.has_unfinished():
        assert eng.step() == []
        steps += 1
        assert steps < 10
    assert tier.stats()["stored_blocks"] > 0 and bm.num_host_ops_queued == 0
    assert bm.allocator("q").num_used == 0 and bm.allocator("hp").num_used == 0
    bm.check_integrity()
