"""`kvq tune` and plan files: the exact solver against brute force, plan files (round trip, errors,
equal to the uniform format they spell, mixed formats per layer in the pools and the handshake),
single-tensor sensitivities (shards merge to the whole), and the command's choices."""

import itertools
import json

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from kvq import cli
from kvq.cache.plan import KVCacheConfig, bare_model, make_plan
from kvq.cache.plan_file import PlanFile, parse_tensor_spec
from kvq.calibration.solver import Option, solve

TINY = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=256, hidden_size=64,
            intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=32,
            rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=False,
            torch_dtype="float32")


@pytest.fixture(autouse=True)
def _threads():
    torch.set_num_threads(1)


@pytest.fixture(scope="module")
def tiny(tmp_path_factory) -> str:
    path = tmp_path_factory.mktemp("tiny")
    (path / "config.json").write_text(json.dumps(TINY))
    return str(path)


def _plan_file(path, layers, sinks=0, residual=0, name="p", H=2, D=32, block_size=None):
    pf = PlanFile(name, {"name": "tiny", "num_layers": len(layers), "num_kv_heads": H, "head_dim": D},
                  tuple(layers), sinks, residual, block_size)
    pf.save(path)
    return str(path)


# -- solver --------------------------------------------------------------------------------------
options = st.lists(st.tuples(st.sampled_from([0, 2, 3, 5, 8, 12, 16]), st.floats(0, 1)), min_size=1, max_size=4)


@settings(max_examples=150, deadline=None)
@given(st.lists(options, min_size=1, max_size=5), st.integers(0, 80))
def test_solver_is_exact_against_brute_force(raw, budget):
    items = [[Option(f"o{j}", c, loss) for j, (c, loss) in enumerate(opts)] for opts in raw]
    floor = sum(min(o.cost for o in opts) for opts in items)
    if budget < floor:
        with pytest.raises(ValueError, match="below the cheapest plan"):
            solve(items, budget)
        return
    got = solve(items, budget)
    best = min(sum(items[i][j].loss for i, j in enumerate(c))
               for c in itertools.product(*[range(len(x)) for x in items])
               if sum(items[i][j].cost for i, j in enumerate(c)) <= budget)
    assert got.cost <= budget and got.cost == sum(items[i][j].cost for i, j in enumerate(got.choice))
    assert got.loss == pytest.approx(best, abs=1e-9)


def test_solver_prefers_the_cheaper_of_equal_losses_and_names_bad_input():
    items = [[Option("a", 4, 0.0), Option("b", 2, 0.0)], [Option("c", 1, 0.5), Option("d", 3, 0.1)]]
    assert solve(items, 10).choice == (1, 1)  # b (free loss, fewer bytes), d
    assert solve(items, 3).choice == (1, 0)
    with pytest.raises(ValueError, match="no options"):
        solve([[]], 3)
    with pytest.raises(ValueError, match="finite"):
        Option("x", 1, float("nan"))


# -- plan files ----------------------------------------------------------------------------------
def test_plan_file_round_trip_and_errors(tmp_path):
    model = bare_model(2, 2, 64)
    path = _plan_file(tmp_path / "p.json", [("int4_kivi", "int2_kivi:g64"), ("fp8_e4m3", "bf16")], 4, 64, D=64)
    cfg = KVCacheConfig(plan_file=path)
    plan = cfg.plan(model)
    assert plan.name == "plan:p" and cfg.requested == f"plan:{path}"
    assert plan.layer_names() == ["k=int4_kivi,v=int2_kivi:g64", "k=fp8_e4m3,v=bfloat16"]
    assert plan.layers[0].v.group_size == 64 and plan.layers[0].k.group_size == 32
    assert (plan.sink_tokens, plan.residual_tokens, plan.block_size) == (4, 64, 32)
    # bytes: each layer's own formats, summed
    want = sum(parse_tensor_spec(spec, role, "bfloat16").block_bytes(2, 64, 32)
               for pair in (("int4_kivi", "int2_kivi:g64"), ("fp8_e4m3", "bf16")) for role, spec in zip("kv", pair))
    assert plan.bytes_per_block == want
    assert PlanFile.load(path) == PlanFile.load(path)
    bad = {"kvq_plan": 1, "name": "x", "model": {"num_layers": 1, "num_kv_heads": 2, "head_dim": 64},
           "sink_tokens": 0, "residual_tokens": 0, "layers": [{"k": "int3", "v": "bf16"}]}
    cases = [({**bad}, "layer 0 K: unknown KV cache format 'int3'"),
             ({**bad, "layers": [{"k": "fp8_e4m3:g64", "v": "bf16"}]}, "has no groups"),
             ({**bad, "kvq_plan": 7}, "version 7"), ({**bad, "extra": 1}, "unknown extra"),
             ({**bad, "name": "a b"}, "name 'a b'"), ({**bad, "sink_tokens": -1}, "sink_tokens must be"),
             ({k: v for k, v in bad.items() if k != "layers"}, "missing layers")]
    for i, (obj, msg) in enumerate(cases):
        f = tmp_path / f"bad{i}.json"
        f.write_text(json.dumps(obj))
        with pytest.raises(ValueError, match=msg):
            KVCacheConfig(plan_file=str(f))
    with pytest.raises(ValueError, match="made for tiny: num_layers 2 \\(model has 3\\)"):
        cfg.plan(bare_model(3, 2, 64))
    with pytest.raises(ValueError, match="drop --kv-cache-dtype, --kv-sink-tokens"):
        KVCacheConfig(dtype="int8", sink_tokens=4, plan_file=path)
    with pytest.raises(ValueError, match="block size 16 must be a multiple of 32"):
        KVCacheConfig(plan_file=path, block_size=16).plan(model)


def test_plan_flags_on_the_command_line(tmp_path, capsys):
    path = _plan_file(tmp_path / "p.json", [("int4_kivi", "int2_kivi")] * 2, 4, 64, D=64, name="mine")
    args = ["plan", "--num-layers", "2", "--num-kv-heads", "2", "--head-dim", "64", "--kv-cache-plan", path]
    assert cli.main(args + ["--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert rec["kv_cache_dtype"] == "plan:mine" and rec["layers"] == ["k=int4_kivi,v=int2_kivi"] * 2
    assert rec["bytes_per_block"] == make_plan(bare_model(2, 2, 64), "auto", k="int4_kivi", v="int2_kivi"
                                               ).bytes_per_block
    assert cli.main(args + ["--kv-cache-dtype", "fp8"]) == 2
    assert "--kv-cache-plan sets the format of every layer" in capsys.readouterr().err
    assert cli.main(args[:-1] + [str(tmp_path / "none.json")]) == 2
    assert "no such file" in capsys.readouterr().err
    assert cli.main(["plan", "--num-layers", "3", "--num-kv-heads", "2", "--head-dim", "64",
                     "--kv-cache-plan", path]) == 2
    assert "num_layers 2 (model has 3)" in capsys.readouterr().err


def _engine(tiny, **kv):
    from kvq.engine.llm_engine import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig(model=tiny, load_format="dummy", device="cpu", kv_cache_memory="8MiB",
                                  max_num_seqs=4, progress=False, seed=3, **kv))


def _greedy(engine, n=40):
    from kvq.engine.sampling_params import SamplingParams

    prompts = [list(range(5, 5 + 70)), list(range(100, 100 + 33))]
    ids = engine.add_requests(prompts, [SamplingParams(max_tokens=n, temperature=0, ignore_eos=True)] * 2)
    out = {}
    while engine.has_unfinished():
        for o in engine.step():
            if o.finished:
                out[o.request_id] = o.outputs[0].token_ids
    return [out[i] for i in ids]


def test_a_plan_of_one_format_serves_exactly_as_that_format(tiny, tmp_path):
    """Every layer int4_kivi in a plan file = --kv-cache-dtype int4_kivi with the same windows: same
    bytes per block, same greedy tokens token for token (the cache is read the same way)."""
    path = _plan_file(tmp_path / "u.json", [("int4_kivi", "int4_kivi")] * 2, 4, 32)
    a = _engine(tiny, kv_cache_plan=path)
    b = _engine(tiny, kv_cache_dtype="int4_kivi", kv_sink_tokens=4, kv_residual_tokens=32)
    assert a.plan.bytes_per_block == b.plan.bytes_per_block and a.plan.layers == b.plan.layers
    assert a.info["kv_cache_dtype"]["name"] == "plan:p"
    assert _greedy(a) == _greedy(b)


def test_mixed_plan_pools_and_handshake(tiny, tmp_path):
    """Each layer's pool holds its own K and V formats, generation runs, and the transfer description of
    the plan rebuilds the same layers on a peer."""
    from kvq.transfer.describe import KVDescription, ModelIdentity, describe_plan
    from kvq.transfer.peer import plan_from_description

    path = _plan_file(tmp_path / "m.json", [("int2_kivi", "fp8_e4m3"), ("int8", "int4_kivi:g32")], 4, 32)
    e = _engine(tiny, kv_cache_plan=path)
    for layer, (k, v) in zip(e.pool.layers, (("int2_kivi", "fp8_e4m3"), ("int8", "int4_kivi"))):
        assert (layer.fmt.k.name, layer.fmt.v.name) == (k, v)
    out = _greedy(e, 12)
    assert all(len(x) == 12 for x in out)
    e.block_manager.check_integrity()
    desc = describe_plan(e.plan, model_id=ModelIdentity("c" * 64, "e" * 64), tokenizer_hash="a" * 64)
    peer = plan_from_description(KVDescription.from_json(desc.to_json()), e.plan.model)
    assert peer.layers == tuple(type(f)(f.k, f.v) for f in e.plan.layers)
    assert peer.bytes_per_block == e.plan.bytes_per_block and peer.block_size == e.plan.block_size


# -- sensitivity ---------------------------------------------------------------------------------
def test_sensitivity_shards_merge_to_the_whole_measurement(tiny):
    from kvq.calibration import sensitivity as S
    from kvq.models.source import model_shape

    shape = model_shape(tiny)
    space = S.Space(tiny, S.check_candidates(shape, ["int2_kivi", "fp8_e4m3", "bf16"], "k", 32),
                    S.check_candidates(shape, ["int2_kivi"], "v", 32), 4, 32, 32, context=128, scored=32, passages=2)
    assert space.candidates_k == ("int2_kivi", "fp8_e4m3")  # the model dtype is always a choice, never measured
    gen = torch.Generator().manual_seed(0)
    ids = torch.randint(0, 256, (600,), generator=gen).tolist()
    windows = S.calibration_windows(ids, space)
    assert [len(w) for w in windows] == [129, 129] and windows[-1][-1] == ids[-1]
    kw = dict(device="cpu", threads=1, load_format="dummy", seed=3)
    whole = S.measure(space, windows, **kw)
    parts = [S.measure(space, windows, shard=(k, 2), **kw) for k in range(2)]
    merged = S.merge(parts)
    assert merged.kl == whole.kl and len(whole.kl) == 2 * 3 and not S.missing(merged, 2)
    assert all(v > 0 for v in whole.kl.values())
    assert sum(whole.kl[(i, "k", "int2_kivi")] for i in range(2)) > sum(whole.kl[(i, "k", "fp8_e4m3")] for i in range(2))  # noqa: E501
    with pytest.raises(ValueError, match="measured twice"):
        S.merge([parts[0], parts[0]])
    with pytest.raises(ValueError, match="candidate 'int4_kivi:g64' for K"):
        S.check_candidates(shape, ["int4_kivi:g64"], "k", 32)


def test_a_tensors_run_from_its_layer_gives_the_full_runs_losses(tiny, monkeypatch):
    """Each measured tensor's run starts at its layer from the baseline's recorded inputs: the same KL to
    the bit as running every layer (what the layers before it compute is the baseline's), the layers
    before it not run; a resumed run whose calls differ from the recording's fails loudly."""
    from kvq.calibration import layer_tap
    from kvq.calibration import sensitivity as S
    from kvq.models.source import model_shape

    shape = model_shape(tiny)
    space = S.Space(tiny, S.check_candidates(shape, ["int2_kivi"], "k", 32), (), 4, 32, 32, context=128,
                    scored=32, passages=1)
    ids = torch.randint(0, 256, (300,), generator=torch.Generator().manual_seed(1)).tolist()
    windows = S.calibration_windows(ids, space)
    kw = dict(device="cpu", threads=1, load_format="dummy", seed=3)
    starts = []
    enter = layer_tap.LayerTap.enter

    def counted(self, input_ids, positions):
        out = enter(self, input_ids, positions)
        starts.append(out[0])
        return out

    monkeypatch.setattr(layer_tap.LayerTap, "enter", counted)
    skipped = S.measure(space, windows, **kw)
    assert set(starts) == {0, 1} and starts.count(1) == starts.count(0) // 2  # baseline and layer 0's from 0
    monkeypatch.setattr(layer_tap.LayerTap, "enter", lambda self, i, p: (enter(self, i, p), (0, None, None))[1])
    full = S.measure(space, windows, **kw)  # every run from the embedding (the calls still checked)
    assert skipped.kl == full.kl and len(full.kl) == 2 and all(v > 0 for v in full.kl.values())
    assert skipped.meta["from_own_layer"]
    monkeypatch.undo()
    monkeypatch.setattr(layer_tap, "MAX_BYTES", 1000)  # a recording too large to keep: every run from the start
    dropped = S.measure(space, windows, **kw)
    assert dropped.kl == full.kl and not dropped.meta["from_own_layer"]
    monkeypatch.undo()
    tap = layer_tap.LayerTap()
    tap.record()
    tap.enter(torch.arange(4), torch.arange(4))
    tap.resume(1)
    with pytest.raises(RuntimeError, match="other tokens or positions"):
        tap.enter(torch.arange(4), torch.arange(1, 5))


@pytest.mark.slow
def test_tune_solves_from_saved_sensitivities_and_keeps_uniform_when_the_plan_loses(tmp_path, monkeypatch, capsys):
    """From a sensitivity file (checked against the settings): layer 0's K, made very sensitive, is the
    one tensor the 3.3-bit budget keeps in the model dtype; when validation says the plan loses to a
    uniform format, the file holds that format for every layer instead."""
    from kvq.calibration import sensitivity as S
    from kvq.calibration import tune
    from kvq.eval.data import eval_token_ids, tokens_sha256
    from kvq.models.loader import load_tokenizer
    from kvq.models.source import resolve_model

    flags = ["--candidates-k", "int2_kivi", "--candidates-v", "int2_kivi", "--context", "256", "--scored", "64",
             "--passages", "1"]
    ids = eval_token_ids(load_tokenizer(resolve_model("default")), None)
    space = S.Space("default", ("int2_kivi",), ("int2_kivi",), 4, 128, 32, 256, 64, 1)
    space = S.Space(**{**space.__dict__, "text_sha256": tokens_sha256(S.calibration_windows(ids, space)[0])})
    kl = {(i, r, "int2_kivi"): 0.01 for i in range(30) for r in "kv"}
    kl[(0, "k", "int2_kivi")] = 1.0
    S.Sensitivity(space, kl).save(tmp_path / "s.json")
    out = tmp_path / "plan.json"
    assert cli.main(["tune", *flags, "--sensitivity", str(tmp_path / "s.json"), "--budget", "3.3",
                     "--no-validate", "--out", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert plan["layers"][0] == {"k": "auto", "v": "int2_kivi"}
    assert all(x == {"k": "int2_kivi", "v": "int2_kivi"} for x in plan["layers"][1:])
    assert plan["meta"]["predicted_kl_sum"] == pytest.approx(0.59) and plan["meta"]["kept"] == "tuned"
    assert plan["meta"]["bits_per_value"] == pytest.approx(3 + 13 / 60)
    # the same file refused for other settings
    assert cli.main(["tune", *flags[:-1], "2", "--sensitivity", str(tmp_path / "s.json"), "--budget", "3",
                     "--no-validate", "--out", str(out)]) == 2
    assert "measured for other settings (passages, text_sha256)" in capsys.readouterr().err

    def losing(args, shape, space, path, uniforms, held_out):
        name = f"plan:{PlanFile.load(path).name}"
        return {name: {512: {"kl_mean": 0.2, "ppl_rel_change": 0.1}},
                uniforms[0]: {512: {"kl_mean": 0.1, "ppl_rel_change": 0.05}}}

    monkeypatch.setattr(tune, "validate_plan", losing)
    assert cli.main(["tune", *flags, "--sensitivity", str(tmp_path / "s.json"), "--budget", "3.3",
                     "--validate-bins", "512", "--out", str(out)]) == 0
    plan = json.loads(out.read_text())
    assert plan["name"] == "uniform-int2_kivi" and plan["meta"]["kept"] == "uniform int2_kivi"
    assert all(x == {"k": "int2_kivi", "v": "int2_kivi"} for x in plan["layers"])
    assert plan["meta"]["validation"]["beats_best_uniform"] is False


@pytest.mark.slow
def test_tune_end_to_end_on_the_default_model(tmp_path, capsys, monkeypatch):
    """Measure (K only, one pass), solve, validate with kvq eval on held-out text, write the plan;
    `kvq generate` serves it."""
    from kvq.eval import runner

    # The validation's formats in this process, not one spawned process per core (each imports torch and
    # loads the model again): the same records to the bit (test_eval.py's worker-process test).
    monkeypatch.setattr(runner, "resolve_workers", lambda s, device, jobs: 1)
    out = tmp_path / "plan.json"
    assert cli.main(["tune", "--candidates-k", "int2_kivi", "--candidates-v", "", "--context", "288", "--scored",
                     "32", "--passages", "1", "--budget", "12", "--validate-bins", "320", "--validate-passages",
                     "1", "--threads", "1", "--no-progress", "--save-sensitivity", str(tmp_path / "s.json"),
                     "--out", str(out)]) == 0
    plan = json.loads(out.read_text())
    sens = json.loads((tmp_path / "s.json").read_text())
    assert len(sens["kl"]) == 30 and all(v > 0 for _, _, _, v, _ in sens["kl"])  # keys [32, 128) read quantized
    val = plan["meta"]["validation"]
    assert val["held_out_tokens"] > 50000 and set(val["results"]) >= {"auto", "int2_kivi:r128:s4"}
    if plan["meta"]["kept"] == "tuned":
        assert val["beats_best_uniform"] and all(x["v"] == "auto" for x in plan["layers"])
        mine = val["results"][f"plan:{plan['name']}"]["320"]["kl_mean"]
        assert mine < val["results"]["int2_kivi:r128:s4"]["320"]["kl_mean"]
    assert cli.main(["generate", "Hello", "--kv-cache-plan", str(out), "--max-tokens", "4", "--device", "cpu"]) == 0
