"""Static KV scales: the file's checks, the observers on real K/V of the default model, and
`kvq calibrate` -> `--kv-scales FILE` end to end on the CPU."""

from pathlib import Path

import pytest
import torch

from kvq.cache.plan import KVCacheConfig
from kvq.cache.scales_file import KVScales, ScalesError, load_scales
from kvq.calibration.scales import scales_from_stats
from kvq.cli import main
from kvq.formats import fp8
from kvq.formats.reference import roundtrip
from kvq.formats.registry import resolve_format
from kvq.models.source import model_shape, resolve_model
from kvq.transfer.describe import ModelIdentity, model_identity

FIXTURE = Path(__file__).parent / "fixtures" / "kv_smollm2.pt"
H = 3  # KV heads of the default model


@pytest.fixture(scope="module")
def ident():
    return model_identity(resolve_model("default"))


def _plan(fmt="fp8_e4m3"):
    return KVCacheConfig(dtype=fmt).plan(model_shape(resolve_model("default")))


def _file(tmp_path, ident, scales=None, **meta) -> Path:
    scales = scales or {i: (torch.full((H,), 0.02), torch.full((H,), 0.001)) for i in range(30)}
    path = tmp_path / "s.safetensors"
    KVScales(scales, {"config_hash": ident.config_hash, "weights_hash": ident.weights_hash, **meta}).save(path)
    return path


def test_scales_file_round_trip_and_every_refusal(tmp_path, ident):
    got = load_scales(_file(tmp_path, ident), _plan(), ident)
    assert sorted(got) == list(range(30)) and torch.equal(got[3][1], torch.full((H,), 0.001))
    with pytest.raises(ScalesError, match="takes no static scales; static-scaled formats: fp8_e4m3"):
        load_scales(_file(tmp_path, ident), _plan("int8"), ident)
    with pytest.raises(ScalesError, match="no such file"):
        load_scales(tmp_path / "missing", _plan(), ident)
    (tmp_path / "junk").write_bytes(b"not safetensors")
    with pytest.raises(ScalesError, match="not a safetensors file"):
        load_scales(tmp_path / "junk", _plan(), ident)
    other = ModelIdentity("0" * 64, ident.weights_hash)
    with pytest.raises(ScalesError, match="measured on another model"):
        load_scales(_file(tmp_path, other), _plan(), ident)
    bad = {i: (torch.full((H,), 0.02), torch.full((H,), 0.001)) for i in range(30)}
    for broken, needle in (({**bad, 5: (torch.ones(4), bad[5][1])}, "has 4 values; the model has 3 KV heads"),
                           ({**bad, 6: (torch.tensor([0.1, -1.0, 0.1]), bad[6][1])}, "positive and finite"),
                           ({**bad, 7: (bad[7][0], torch.tensor([0.1, float("nan"), 0.1]))}, "positive and finite"),
                           ({i: bad[i] for i in range(29)}, "layers.29.k_scale is missing")):
        with pytest.raises(ScalesError, match=needle):
            load_scales(_file(tmp_path, ident, broken), _plan(), ident)
    from safetensors.torch import save_file

    save_file({"x": torch.ones(1)}, str(tmp_path / "foreign"))
    with pytest.raises(ScalesError, match="not a kvq scales file"):
        load_scales(tmp_path / "foreign", _plan(), ident)


@pytest.mark.parametrize("observer", ["absmax", "mse"])
def test_observers_on_real_kv(observer):
    """On real K/V of the default model: the mse observer never loses to absmax on the data it was
    fitted on (its search includes the absmax clip).  Scaled to reach 4x e4m3's 448, as a
    model with large activations would give, the values saturate at scale 1.0: calibrated scales then cut
    the held-out error more than tenfold.  (Unscaled, the default model's K/V lie in e4m3's
    normal range, where a per-head scale barely moves a floating-point format's error: measured
    -7%..+14% on the held-out half; docs/calibration.md.)"""
    d = torch.load(FIXTURE, weights_only=False)
    tf = resolve_format("fp8_e4m3", "k", model_dtype="bfloat16")
    store = fp8.torch_dtype(tf.storage)
    for name in ("k", "v"):
        for layer in range(d[name].shape[0]):
            x = d[name][layer].float()  # [T, H, D]
            fit, held = x[: len(x) // 2], x[len(x) // 2:]

            def err(data, scale):
                b = data.permute(1, 0, 2).unsqueeze(0)  # [1, H, T, D]
                return (roundtrip(tf, b, scale) - b).pow(2).mean().item()

            s = scales_from_stats(fit, tf.qmax, observer, store)
            if observer == "mse":
                assert err(fit, s) <= err(fit, scales_from_stats(fit, tf.qmax, "absmax", store)) * (1 + 1e-6)
            gain = 4 * tf.qmax / x.abs().max()  # activations 4x past e4m3's largest value
            big_fit, big_held = gain * fit, gain * held
            s = scales_from_stats(big_fit, tf.qmax, observer, store)
            assert err(big_held, s) < 0.1 * err(big_held, 1.0), (name, layer)


def test_kvq_calibrate_then_generate_with_the_file(tmp_path, capsys):
    out = tmp_path / "scales.safetensors"
    assert main(["calibrate", "--num-tokens", "96", "--window", "48", "--device", "cpu", "--out", str(out)]) == 0
    assert "30 layers, 96 tokens" in capsys.readouterr().err
    from kvq.engine.llm_engine import EngineConfig, LLMEngine
    from kvq.engine.sampling_params import SamplingParams

    engine = LLMEngine(EngineConfig(kv_cache_dtype="fp8_e4m3", kv_scales=str(out), kv_cache_memory="16MiB",
                                    max_model_len=256, progress=False))
    want = load_scales(out, engine.plan, model_identity(resolve_model("default")))
    assert all(torch.equal(engine.pool.layers[i].static_scale("k").cpu(), want[i][0]) for i in range(30))
    assert engine.info["kv_scales"] == str(out)
    rid = engine.add_request("The capital of France is", SamplingParams(max_tokens=4, temperature=0))
    outs = []
    while engine.has_unfinished():
        outs += [o for o in engine.step() if o.request_id == rid and o.finished]
    assert len(outs[0].outputs[0].token_ids) == 4
    assert main(["generate", "--kv-cache-dtype", "int8", "--kv-scales", str(out), "hi"]) == 2
    assert "takes no static scales" in capsys.readouterr().err
    assert main(["calibrate", "--kv-cache-dtype", "int8", "--out", str(tmp_path / "x")]) == 2
    assert "takes no static scales; valid: fp8_e4m3, fp8_e5m2" in capsys.readouterr().err


# -- scales shipped in checkpoints ------------------------------------------------------------------
TINY = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=256, hidden_size=64,
            intermediate_size=64, num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2, head_dim=16,
            rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=128, tie_word_embeddings=False,
            torch_dtype="float32")


def _checkpoint(path: Path, tensors: dict, **config) -> str:
    import json

    from safetensors.torch import save_file

    path.mkdir(parents=True, exist_ok=True)
    (path / "config.json").write_text(json.dumps({**TINY, **config}))
    save_file({"model.norm.weight": torch.ones(64), **tensors}, str(path / "model.safetensors"))
    return str(path)


def _engine(model: str, fmt: str = "fp8_e4m3", **kw):
    from kvq.engine.llm_engine import EngineConfig, LLMEngine

    return LLMEngine(EngineConfig(model=model, load_format="dummy", device="cpu", kv_cache_dtype=fmt,
                                  kv_cache_memory="2MiB", max_num_seqs=2, progress=False, **kw))


def _scales_of(engine, role: str) -> list[list[float]]:
    return [engine.pool.layers[i].static_scale(role).tolist() for i in range(2)]


CT = {f"model.layers.{i}.self_attn.{r}_scale": torch.tensor([0.5 + i + (r == "v")]) for i in range(2) for r in "kv"}


def test_checkpoint_scales_in_each_convention(tmp_path):
    e = _engine(_checkpoint(tmp_path / "ct", CT, quantization_config={"kv_cache_scheme": {"num_bits": 8}}))
    assert _scales_of(e, "k") == [[0.5, 0.5], [1.5, 1.5]] and _scales_of(e, "v") == [[1.5, 1.5], [2.5, 2.5]]
    assert e.info["kv_scales"] == "checkpoint (compressed-tensors)"
    mo = {f"model.layers.{i}.self_attn.{r}_proj.{r}_scale": torch.tensor([0.25, 0.75]) * (i + 1)
          for i in range(2) for r in "kv"}
    e = _engine(_checkpoint(tmp_path / "mo", mo))
    assert _scales_of(e, "v") == [[0.25, 0.75], [0.5, 1.5]] and e.info["kv_scales"] == "checkpoint (modelopt)"
    legacy = {f"model.layers.{i}.self_attn.kv_scale": torch.tensor(2.0 + i) for i in range(2)}
    e = _engine(_checkpoint(tmp_path / "legacy", legacy))
    assert _scales_of(e, "k") == _scales_of(e, "v") == [[2.0, 2.0], [3.0, 3.0]]
    e = _engine(_checkpoint(tmp_path / "auto", CT), fmt="auto")  # nothing quantized: nothing to apply
    assert e.info["kv_scales"].startswith("checkpoint (compressed-tensors): unused")


def test_checkpoint_scales_that_cannot_be_used_are_errors(tmp_path):
    with pytest.raises(ScalesError, match="ships compressed-tensors KV scales.*int8 cannot use them"):
        _engine(_checkpoint(tmp_path / "a", CT), fmt="int8")
    with pytest.raises(ScalesError, match="cover some layers but not layer 1 k"):
        _engine(_checkpoint(tmp_path / "b", {k: v for k, v in CT.items() if "layers.1.self_attn.k" not in k}))
    with pytest.raises(ScalesError, match="has 3 values; the model has 2 KV heads"):
        _engine(_checkpoint(tmp_path / "c", {**CT, "model.layers.0.self_attn.k_scale": torch.ones(3)}))
    with pytest.raises(ScalesError, match="positive and finite"):
        _engine(_checkpoint(tmp_path / "d", {**CT, "model.layers.0.self_attn.v_scale": torch.tensor([0.0])}))
    with pytest.raises(ScalesError, match="declares quantization_config.kv_cache_scheme"):
        _engine(_checkpoint(tmp_path / "e", {}, quantization_config={"kv_cache_scheme": {"num_bits": 8}}))
    legacy = {f"model.layers.{i}.self_attn.kv_scale": torch.tensor(2.0) for i in range(2)}
    with pytest.raises(ScalesError, match="more than one convention"):
        _engine(_checkpoint(tmp_path / "f", {**CT, **legacy}))


def test_a_scales_file_wins_over_the_checkpoint(tmp_path):
    model = _checkpoint(tmp_path / "ct", CT)
    ident = model_identity(resolve_model(model))
    path = tmp_path / "mine.safetensors"
    KVScales({i: (torch.tensor([4.0, 5.0]), torch.tensor([6.0, 7.0])) for i in range(2)},
             {"config_hash": ident.config_hash, "weights_hash": ident.weights_hash}).save(path)
    e = _engine(model, kv_scales=str(path))
    assert _scales_of(e, "k") == [[4.0, 5.0]] * 2 and e.info["kv_scales"] == str(path)


def test_eval_kv_scales_flag_is_checked_before_any_model_loads(tmp_path, capsys):
    assert main(["eval", "--kv-cache-dtype", "int8", "--kv-scales", str(tmp_path / "s")]) == 2
    assert "none of int8 takes static scales" in capsys.readouterr().err
    assert main(["eval", "--kv-cache-dtype", "fp8_e4m3", "--kv-scales", str(tmp_path / "s")]) == 2
    assert "no such file" in capsys.readouterr().err


# -- the warm-up route ------------------------------------------------------------------------------
def _export_engine(model: str, fmt: str, **kw):
    """A dummy-weight engine whose K/V projections are scaled so K and V reach past e4m3's 448, and an
    exporter that keeps each prompt's cached K and V ([n, H, D] float32 per layer and role)."""
    from kvq.attention import reference
    from kvq.cache.pool import encode_table
    from kvq.engine.llm_engine import EngineConfig, LLMEngine
    from kvq.connectors.kv_export import KVExporter

    class Keep(KVExporter):
        def __init__(self):
            self.kv = {}

        def export(self, request_id, pool, table, num_tokens, tag):
            ids = torch.tensor(encode_table(table), dtype=torch.int64)
            self.kv[tag] = {(i, r): reference.gather_kv(layer, r, ids, num_tokens, torch.float32).transpose(0, 1)
                            for i, layer in enumerate(pool.layers) for r in "kv"}

    e = LLMEngine(EngineConfig(model=model, load_format="dummy", device="cpu", kv_cache_dtype=fmt, block_size=16,
                               kv_cache_memory="2MiB", max_num_seqs=2, progress=False, seed=5,
                               enable_prefix_caching=False, **kw))
    for layer in e.model.model.layers:
        layer.self_attn.qkv_proj.weight.data[64:] *= 4000.0  # K and V rows (after the 4 x 16 query rows)
    e.add_connector("kv_export", exporter=Keep())
    return e


def _prefill(engine, prompt, tag):
    from kvq.engine.sampling_params import SamplingParams

    engine.add_request(prompt, SamplingParams(max_tokens=1, temperature=0), kv_transfer=tag)
    while engine.has_unfinished():
        engine.step()
    return engine.connector("kv_export").exporter.kv[tag]


def test_warmup_scales_freeze_after_n_tokens_and_reencode_the_cache(tmp_path):
    """--kv-scales warmup:48: a 50-token prompt is written under scale 1.0 (K/V past 448 saturate) while
    the engine observes it; then the scales freeze at absmax/448 per layer and head (layer 0 equals the
    absmax of the exact K/V a float32 cache holds), the cached blocks are re-encoded, and a prompt
    served afterwards is stored within e4m3's rounding of the exact values."""
    model = _checkpoint(tmp_path / "m", {})
    ref = _export_engine(model, "float32")
    warm = _export_engine(model, "fp8_e4m3", kv_scales="warmup:48")
    assert warm.info["kv_scales"] == "warmup: observing (0/48 tokens)"
    assert warm.runner.warmup is not None and warm.pool.observer is warm.runner.warmup
    gen = torch.Generator().manual_seed(0)
    first, second = (torch.randint(3, 250, (n,), generator=gen).tolist() for n in (50, 40))
    exact1, got1 = _prefill(ref, first, "a"), _prefill(warm, first, "a")
    assert warm.info["kv_scales"] == "warmup: frozen after 50 tokens" and warm.pool.observer is None
    for r in "kv":
        amax = exact1[(0, r)].abs().amax(dim=(0, 2))
        assert bool((amax > 448).all())  # the case scales are for: scale 1.0 saturates
        assert torch.allclose(warm.pool.layers[0].static_scale(r), amax / 448, rtol=1e-6)
        assert torch.equal(warm.static_scales[0][0 if r == "k" else 1], warm.pool.layers[0].static_scale(r))
    exact2, got2 = _prefill(ref, second, "b"), _prefill(warm, second, "b")

    def rel_err(a, b):
        return float((a - b).norm() / b.norm())

    before, after = rel_err(got1[(0, "k")], exact1[(0, "k")]), rel_err(got2[(0, "k")], exact2[(0, "k")])
    assert after < 0.05 < before  # written before the freeze: saturated at 448, re-encoding cannot undo it
    scale1 = _export_engine(model, "fp8_e4m3")  # no warm-up: every prompt saturates
    assert rel_err(_prefill(scale1, second, "b")[(0, "k")], exact2[(0, "k")]) > 0.05


def test_warmup_refusals(tmp_path, capsys):
    from kvq.cache.scales_file import ScalesError
    from kvq.engine.llm_engine import EngineConfig

    model = _checkpoint(tmp_path / "m", {})
    with pytest.raises(ScalesError, match="takes no static scales"):
        _engine(model, "int8", kv_scales="warmup")
    for bad, msg in (("warmup:0", "warmup:N takes a number of tokens N >= 1"), ("warmup:x", "N >= 1")):
        with pytest.raises(ValueError, match=msg):
            EngineConfig(model=model, kv_scales=bad)
    with pytest.raises(ValueError, match="host tier"):
        EngineConfig(model=model, kv_scales="warmup", cpu_offload_gb=1)
    assert main(["serve", "--model", model, "--load-format", "dummy", "--kv-cache-dtype", "fp8_e4m3",
                 "--kv-scales", "warmup", "--kv-role", "prefill"]) == 2
    assert "--kv-role prefill" in capsys.readouterr().err
