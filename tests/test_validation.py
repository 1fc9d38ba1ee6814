"""Bad input is refused before any weights load: one line and exit code 2 from the CLI, ValueError
naming what is valid from the API.  Every case runs with the model loaders replaced by a function
that fails the test if called, so a check that slipped to after the load shows up here."""

import json
import math
import struct
import time

import numpy as np
import pytest

from kvq.cli import main
from kvq.engine.llm import LLM
from kvq.engine.llm_engine import EngineConfig
from kvq.engine.sampling_params import SamplingParams

TINY = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=256, hidden_size=64,
            intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
            rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=False,
            torch_dtype="float32")


@pytest.fixture
def no_load(monkeypatch):
    """The weight loaders fail the test if anything reaches them."""
    from kvq.engine import worker
    from kvq.models import builder, loader

    def forbidden(*a, **k):
        raise AssertionError("the model was loaded before the bad input was reported")

    monkeypatch.setattr(worker, "build_model", forbidden)
    monkeypatch.setattr(builder, "_load_checkpoint", forbidden)
    monkeypatch.setattr(loader, "load_hf_model", forbidden)


@pytest.fixture(scope="module")
def files(tmp_path_factory):
    """Model files, good and broken: a tiny HF folder and a small GGUF written with gguf's writer,
    then damaged the ways downloads and disks damage them."""
    from gguf import GGUFWriter

    d = tmp_path_factory.mktemp("models")
    (d / "tiny").mkdir()
    (d / "tiny" / "config.json").write_text(json.dumps(TINY))
    for name, text in (("empty", "{}"), ("badjson", '{"num_attention_heads": '), ("list", "[1, 2]"),
                       ("zeroheads", json.dumps(dict(TINY, num_attention_heads=0)))):
        (d / name).mkdir()
        (d / name / "config.json").write_text(text)
    w = GGUFWriter(str(d / "ok.gguf"), "llama")
    for key, value in (("block_count", 2), ("context_length", 256), ("embedding_length", 64),
                       ("attention.head_count", 2), ("attention.head_count_kv", 1)):
        w.add_uint32(f"llama.{key}", value)
    w.add_tensor("token_embd.weight", np.zeros((16, 64), dtype=np.float32))
    w.write_header_to_file()
    w.write_kv_data_to_file()
    w.write_tensors_to_file()
    w.close()
    data = (d / "ok.gguf").read_bytes()
    (d / "head64.gguf").write_bytes(data[:64])  # truncated inside the header
    (d / "half.gguf").write_bytes(data[:len(data) - 1000])  # header whole, tensor data cut
    (d / "version.gguf").write_bytes(data[:4] + struct.pack("<I", 0xFFFFFFFF) + data[8:])  # garbled header
    (d / "text.gguf").write_bytes(b"not a gguf file at all" * 10)
    return d


def test_good_files_read(files):
    from kvq.models.source import model_shape

    m = model_shape(str(files / "ok.gguf"))
    assert (m.num_layers, m.num_kv_heads, m.head_dim, m.max_position_embeddings) == (2, 1, 32, 256)
    assert model_shape(str(files / "tiny")).num_layers == 2


# (argv, substring of the one-line error); "{d}" is the folder of `files`
CLI_CASES = [
    (["plan", "--num-layers", "4", "--num-kv-heads", "2", "--head-dim", "64", "--max-model-len", "0"],
     "--max-model-len must be >= 1"),
    (["plan", "--num-layers", "0", "--num-kv-heads", "2", "--head-dim", "64"], "--num-layers must be >= 1"),
    (["plan", "--model", "{d}/tiny", "--context-len", "0"], "--context-len must be >= 1"),
    (["plan", "--model", "{d}/tiny", "--memory", "0"], "size must be positive"),
    (["plan", "--model", "{d}/tiny", "--kivi-group-size", "64", "--kv-cache-dtype", "fp8"],
     "--kivi-group-size applies only"),
    (["plan", "--model", "{d}/tiny", "--kivi-group-size", "48", "--kv-cache-dtype", "int4_kivi"], "power of two"),
    (["plan", "--model", "{d}/head64.gguf"], "head64.gguf: GGUF header ends early"),
    (["formats", "--model", "{d}/version.gguf"], "version.gguf: GGUF version 4294967295"),
    (["generate", "hi", "--model", "{d}/tiny", "--max-model-len", "0"], "--max-model-len must be an int >= 1"),
    (["generate", "hi", "--model", "{d}/tiny", "--max-model-len", "1000"], "exceeds the model's 256 positions"),
    (["generate", "hi", "--model", "{d}/tiny", "--gpu-memory-utilization", "1.5"], "in (0, 1]"),
    (["generate", "hi", "--model", "{d}/tiny", "--gpu-memory-utilization", "-1"], "in (0, 1]"),
    (["generate", "hi", "--model", "{d}/tiny", "--gpu-memory-utilization", "nan"], "in (0, 1]"),
    (["generate", "hi", "--model", "{d}/tiny", "--max-num-seqs", "0"], "--max-num-seqs must be an int >= 1"),
    (["generate", "hi", "--model", "{d}/tiny", "--max-num-batched-tokens", "0"], "--max-num-batched-tokens"),
    (["generate", "hi", "--model", "{d}/tiny", "--max-num-seqs", "8", "--max-num-batched-tokens", "4"],
     "must be >= max_num_seqs"),
    (["generate", "hi", "--model", "{d}/tiny", "--max-num-seqs", "x"], "invalid int value: 'x'"),
    (["generate", "hi", "--model", "{d}/tiny", "--kv-cache-memory", "abc"], "cannot read 'abc' as a size"),
    (["generate", "hi", "--model", "{d}/tiny", "--device", "cpu", "--kv-cache-memory", "1PiB"], "cannot read"),
    (["generate", "hi", "--model", "{d}/tiny", "--device", "cpu", "--kv-cache-memory", "1000TiB"],
     "of RAM available"),
    (["generate", "hi", "--model", "{d}/tiny", "--kv-cache-memory", "1KiB"], "too small for this plan"),
    (["generate", "hi", "--model", "{d}/tiny", "--kv-cache-dtype", "fp9"], "valid formats"),
    (["generate", "hi", "--model", "{d}/tiny", "--kv-cache-dtype", "fp8", "--kivi-group-size", "64"],
     "--kivi-group-size applies only"),
    (["generate", "hi", "--model", "{d}/tiny", "--kv-sink-tokens", "-1"], "--kv-sink-tokens must be an int >= 0"),
    (["generate", "hi", "--model", "{d}/tiny", "--block-size", "0"], "--block-size must be an int >= 1"),
    (["generate", "hi", "--model", "{d}/tiny", "--kv-cache-dtype-skip-layers", "7"], "layer 7 out of range 0..1"),
    (["generate", "hi", "--model", "{d}/tiny", "--device", "tpu"], "unknown device 'tpu'; valid: auto, cpu, cuda"),
    (["generate", "hi", "--model", "{d}/tiny", "--dtype", "int8"], "unknown dtype 'int8'; valid"),
    (["generate", "hi", "--model", "{d}/tiny", "--attention-backend", "flash"], "valid: auto"),
    (["generate", "hi", "--model", "{d}/tiny", "--load-format", "pt"], "valid: auto, dummy"),
    (["generate", "hi", "--model", "{d}/tiny", "--threads", "-1"], "--threads must be an int >= 0"),
    (["generate", "hi", "--model", "{d}/tiny", "--temperature", "inf"], "temperature must be a finite number"),
    (["generate", "hi", "--model", "{d}/tiny", "--top-p", "0"], "top_p must be in (0, 1]"),
    (["generate", "hi", "--model", "{d}/tiny", "--max-tokens", "0"], "max_tokens must be an int >= 1"),
    (["generate", "hi", "--model", "{d}/tiny", "--max-tokens", "256"], "leaves no room for a prompt"),
    (["generate", "", "--model", "{d}/tiny"], "the prompt is empty"),
    (["generate", "hi", "--model", "{d}/empty"], "empty/config.json: no 'num_attention_heads'"),
    (["generate", "hi", "--model", "{d}/badjson"], "badjson/config.json: not valid JSON"),
    (["generate", "hi", "--model", "{d}/list"], "list/config.json: expected a JSON object"),
    (["generate", "hi", "--model", "{d}/zeroheads"], "num_attention_heads is 0, must be >= 1"),
    (["generate", "hi", "--model", "{d}/head64.gguf"], "head64.gguf: GGUF header ends early at byte 64 of 64"),
    (["generate", "hi", "--model", "{d}/half.gguf"], "half.gguf: truncated"),
    (["generate", "hi", "--model", "{d}/version.gguf"], "version.gguf: GGUF version"),
    (["generate", "hi", "--model", "{d}/text.gguf"], "text.gguf: not a GGUF file"),
    (["generate", "hi", "--model", "{d}/nowhere"], "never downloads"),
    (["serve", "--model", "{d}/tiny", "--device", "tpu"], "unknown device 'tpu'"),
    (["serve", "--model", "{d}/tiny", "--max-num-seqs", "0"], "--max-num-seqs must be an int >= 1"),
    (["serve", "--model", "{d}/tiny", "--threads", "-2"], "--threads must be an int >= 0"),
    (["eval", "--model", "{d}/tiny", "--min-top1", "2"], "--min-top1 must be in [0, 1]"),
    (["eval", "--model", "{d}/tiny", "--threads", "-1"], "--threads must be >= 0"),
    (["eval", "--model", "{d}/tiny", "--device", "tpu"], "unknown device"),
    (["eval", "--model", "{d}/tiny", "--kv-cache-dtype", "fp8", "--kivi-group-size", "64"],
     "--kivi-group-size applies only"),
]


def test_cli_bad_input_exits_2_in_one_line_before_loading(files, no_load, capsys):
    slow = []
    for argv, want in CLI_CASES:
        argv = [a.replace("{d}", str(files)) for a in argv]
        t = time.perf_counter()
        code = main(argv)
        seconds = time.perf_counter() - t
        err = capsys.readouterr().err
        assert code == 2, (argv, err)
        assert err.startswith("kvq: error: ") and err.count("\n") == 1, (argv, err)
        assert want in err, (argv, err)
        if seconds > 5:
            slow.append((argv, round(seconds, 1)))
    assert not slow, f"checks that should not wait for anything took seconds: {slow}"


# (EngineConfig keyword arguments, substring of the ValueError); model "{d}" means the tiny folder
API_CASES = [
    (dict(max_model_len=0), "max_model_len must be an int >= 1"),
    (dict(max_model_len=1000), "exceeds the model's 256 positions"),
    (dict(max_num_seqs=0), "max_num_seqs must be an int >= 1"),
    (dict(max_num_seqs=2.5), "max_num_seqs must be an int"),
    (dict(max_num_batched_tokens=-3), "max_num_batched_tokens must be an int >= 1"),
    (dict(gpu_memory_utilization=1.5), "gpu_memory_utilization must be a fraction in (0, 1]"),
    (dict(gpu_memory_utilization=0), "gpu_memory_utilization"),
    (dict(gpu_memory_utilization=math.nan), "gpu_memory_utilization"),
    (dict(kv_cache_memory="abc"), "cannot read 'abc' as a size"),
    (dict(kv_cache_memory=0), "size must be positive"),
    (dict(kv_cache_memory=True), "kv_cache_memory must be a size"),
    (dict(kv_cache_memory="1000TiB", device="cpu"), "of RAM available"),
    (dict(kv_cache_dtype="fp8", kivi_group_size=64), "--kivi-group-size applies only"),
    (dict(kv_cache_dtype="int4_kivi", kivi_group_size=0), "--kivi-group-size must be an int >= 1"),
    (dict(kv_residual_tokens=-1), "--kv-residual-tokens must be an int >= 0"),
    (dict(kv_cache_dtype=""), "must be a format name"),
    (dict(device="tpu"), "unknown device 'tpu'; valid: auto, cpu, cuda, cuda:N"),
    (dict(device="cuda:x"), "unknown device"),
    (dict(dtype="bf16"), "unknown dtype 'bf16'; valid: auto, bfloat16, float16, float32"),
    (dict(attention_backend="flash"), "unknown attention backend 'flash'"),
    (dict(load_format="safetensors"), "unknown load format"),
    (dict(threads=-1), "threads must be an int >= 0"),
    (dict(threads="2"), "threads must be an int"),
    (dict(async_scheduling="yes"), "async_scheduling must be True, False or None"),
    (dict(enforce_eager=None), "enforce_eager must be True or False"),
    (dict(model=""), "model must be"),
    (dict(model="{d}/empty"), "no 'num_attention_heads'"),
    (dict(model="{d}/head64.gguf"), "head64.gguf: GGUF header ends early"),
    (dict(model="{d}/half.gguf"), "half.gguf: truncated"),
    (dict(model="{d}/tiny", max_num_seqs=-1, nonsense=1), "unknown LLM argument(s) nonsense"),
]


def test_api_bad_input_raises_value_error_before_loading(files, no_load):
    for kw, want in API_CASES:
        kw = {"model": "{d}/tiny", "load_format": "dummy", "progress": False, **kw}
        if isinstance(kw["model"], str):
            kw["model"] = kw["model"].replace("{d}", str(files))
        with pytest.raises(ValueError) as e:
            LLM(**kw)
        assert want in str(e.value), (kw, str(e.value))


@pytest.mark.parametrize("kw,want", [
    (dict(temperature=math.inf), "finite"), (dict(temperature=math.nan), "finite"), (dict(temperature=-0.5), ">= 0"),
    (dict(top_p=math.nan), "top_p"), (dict(top_p=1.5), "top_p"), (dict(top_k=-2), "top_k"),
    (dict(max_tokens=0), "max_tokens"), (dict(max_tokens=True), "max_tokens"), (dict(logprobs=21), "logprobs"),
    (dict(stop=[""]), "stop strings"), (dict(stop_token_ids=[-1]), "stop_token_ids"), (dict(n=2), "valid values: 1"),
])
def test_sampling_params_ranges(kw, want):
    with pytest.raises(ValueError, match=want):
        SamplingParams(**kw)


def test_kv_cache_config_ranges():
    from kvq.cache.plan import KVCacheConfig

    for kw, want in ((dict(sink_tokens=-1), "--kv-sink-tokens"), (dict(block_size=0), "--block-size"),
                     (dict(group_size=24), "power of two"), (dict(dtype=None), "format name"),
                     (dict(k=""), "format name"), (dict(residual_tokens=1.5), "--kv-residual-tokens")):
        with pytest.raises(ValueError, match=want):
            KVCacheConfig(**kw)
    assert KVCacheConfig(skip_layers=[0, "sliding_window"]).skip_layers == (0, "sliding_window")
    KVCacheConfig(dtype="int4_kivi", group_size=64).check_options_apply()
    KVCacheConfig(dtype="fp8", k="int4_kivi", group_size=64).check_options_apply()  # K has groups: it applies


def test_engine_config_is_checked_when_built():
    """A bad EngineConfig fails when it is made, wherever it is made (the server builds one too)."""
    with pytest.raises(ValueError, match="max_num_seqs"):
        EngineConfig(max_num_seqs=0)
    with pytest.raises(ValueError, match="unknown device"):
        EngineConfig(device="tpu")
    EngineConfig(device="cuda:1", threads=0)  # valid names; whether the device exists is checked at start
    import torch

    assert EngineConfig(device=torch.device("cpu")).device == "cpu"


def test_memory_budget_checked_against_the_device(monkeypatch):
    from kvq.engine import config

    avail = config.available_host_memory()
    assert avail is None or avail > 0
    monkeypatch.setattr(config, "available_host_memory", lambda: 3 << 30)
    import torch

    config.check_memory_fits(2 << 30, torch.device("cpu"))
    with pytest.raises(ValueError, match="exceeds the 3.00 GiB of RAM available"):
        config.check_memory_fits(4 << 30, torch.device("cpu"))
