"""The Python API's contract on a tiny random-weight model with a word-level tokenizer (CPU, seconds):
generate is all or nothing, a closed stream frees its blocks, threads and the logged configuration."""

import json
import logging

import pytest
import torch

from kvq.cli import build_parser, engine_config_from_args
from kvq.engine.llm import LLM
from kvq.engine.sampling_params import SamplingParams

TINY = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=256, hidden_size=64,
            intermediate_size=64, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
            rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=False,
            torch_dtype="float32")
LONG = SamplingParams(max_tokens=40, temperature=0, ignore_eos=True)


@pytest.fixture(scope="module")
def model_dir(tmp_path_factory):
    """config.json plus a word-level tokenizer.json: text prompts and streamed text work."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers

    d = tmp_path_factory.mktemp("tiny")
    (d / "config.json").write_text(json.dumps(TINY))
    words = ["<unk>", "<s>", "</s>"] + [chr(c) for c in range(ord("a"), ord("z") + 1)] + [f"w{i}" for i in range(227)]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.Whitespace()
    tok.decoder = decoders.WordPiece()  # words joined by spaces
    tok.save(str(d / "tokenizer.json"))
    (d / "tokenizer_config.json").write_text(json.dumps(
        {"tokenizer_class": "PreTrainedTokenizerFast", "eos_token": "</s>", "unk_token": "<unk>"}))
    return d


@pytest.fixture(scope="module")
def llm(model_dir):
    return LLM(str(model_dir), load_format="dummy", kv_cache_memory="2MiB", max_num_seqs=4, progress=False)


def _idle(llm) -> bool:
    eng = llm.engine
    bm = eng.block_manager
    eng.scheduler.check_integrity()
    return (not eng.has_unfinished() and bm.num_free_blocks("q") == eng.pool.num_q_blocks
            and bm.num_free_blocks("hp") == eng.pool.num_hp_blocks)


def test_generate_is_all_or_nothing(llm):
    """A bad prompt anywhere in the batch queues none of them: nothing runs during the next call."""
    assert _idle(llm)
    with pytest.raises(ValueError, match="prompt 1: the prompt is empty"):
        llm.generate(["a b c", "", "d e"], LONG, use_tqdm=False)
    assert _idle(llm)
    # the third is judged by the scheduler (too long) after the first two were queued: rolled back
    too_long = list(range(3, 3 + 250))
    with pytest.raises(ValueError, match="prompt 2: .*exceeds max_model_len"):
        llm.generate([[5, 6, 7], "a b", too_long], LONG, use_tqdm=False)
    assert _idle(llm)
    with pytest.raises(ValueError, match="prompt 1: token ids must be in"):
        llm.generate([[5, 6], [5, 999]], LONG, use_tqdm=False)
    with pytest.raises(ValueError, match="sampling params must be a SamplingParams"):
        llm.generate(["a b"], [{"max_tokens": 3}], use_tqdm=False)
    with pytest.raises(ValueError, match="2 prompts but 1 sampling params"):
        llm.generate(["a b", "c"], [LONG], use_tqdm=False)
    assert _idle(llm)
    steps = []
    step = llm.engine.step
    llm.engine.step = lambda: (steps.append(1), step())[1]
    try:
        outs = llm.generate(["Hello there"], SamplingParams(max_tokens=3, temperature=0, ignore_eos=True),
                            use_tqdm=False)
    finally:
        del llm.engine.step
    assert [len(o.outputs[0].token_ids) for o in outs] == [3]
    assert len(steps) == 3, "only this call's request ran (a ghost would add its 40 tokens of steps)"
    assert _idle(llm)


def test_generate_aborts_its_requests_when_interrupted(llm):
    calls = []
    step = llm.engine.step

    def interrupted():
        calls.append(1)
        if len(calls) == 3:
            raise KeyboardInterrupt
        return step()

    llm.engine.step = interrupted
    try:
        with pytest.raises(KeyboardInterrupt):
            llm.generate(["a b c", "d e f"], LONG, use_tqdm=False)
    finally:
        del llm.engine.step
    assert _idle(llm)


def test_closing_a_stream_aborts_and_frees_its_blocks(llm):
    eng = llm.engine
    gen = llm.stream("a b c d e f", LONG)
    first = next(gen)
    assert isinstance(first, str) and first
    assert eng.has_unfinished() and eng.block_manager.num_free_blocks("q") < eng.pool.num_q_blocks
    gen.close()
    assert _idle(llm), "the closed stream's request must be aborted and its blocks back in the pool"
    # breaking out of a for loop closes the generator too (here through garbage collection)
    for _ in llm.stream("g h i", LONG):
        break
    assert _idle(llm)
    # a stream read to the end finishes normally and leaves nothing behind
    text = "".join(llm.stream("a b", SamplingParams(max_tokens=4, temperature=0, ignore_eos=True)))
    assert text and _idle(llm)


def test_threads_option(model_dir, monkeypatch):
    before = torch.get_num_threads()
    kw = dict(load_format="dummy", kv_cache_memory="1MiB", max_num_seqs=2, progress=False)
    try:
        llm = LLM(str(model_dir), threads=2, **kw)
        assert torch.get_num_threads() == 2 and llm.engine.info["threads"] == 2
        monkeypatch.delenv("OMP_NUM_THREADS", raising=False)
        llm = LLM(str(model_dir), **kw)  # the CPU default
        assert torch.get_num_threads() == 1 and llm.engine.info["threads"] == 1
        torch.set_num_threads(2)
        monkeypatch.setenv("OMP_NUM_THREADS", "2")
        LLM(str(model_dir), **kw)  # the environment's choice is kept
        assert torch.get_num_threads() == 2
        LLM(str(model_dir), threads=0, **kw)  # 0: torch's own, untouched
        assert torch.get_num_threads() == 2
    finally:
        torch.set_num_threads(before)


@pytest.mark.parametrize("command", ["generate", "serve"])
def test_threads_flag_on_engine_commands(command, model_dir):
    argv = [command] + (["hi"] if command == "generate" else [])
    args = build_parser().parse_args(argv + ["--model", str(model_dir), "--threads", "3"])
    assert engine_config_from_args(args).threads == 3
    args = build_parser().parse_args(argv + ["--model", str(model_dir)])
    assert engine_config_from_args(args).threads is None  # the engine's default
    assert build_parser().parse_args(["eval", "--threads", "2"]).threads == 2


def test_resolved_configuration_is_logged_in_one_info_line(model_dir, caplog):
    with caplog.at_level(logging.INFO, logger="kvq"):
        llm = LLM(str(model_dir), load_format="dummy", kv_cache_dtype="int4_kivi", kv_cache_memory="1MiB",
                  max_num_seqs=2, threads=1, progress=False)
    lines = [r for r in caplog.records if r.name == "kvq" and r.levelno == logging.INFO]
    assert len(lines) == 1
    msg = lines[0].getMessage()
    assert "\n" not in msg
    info = llm.engine.info
    for part in (f"model {model_dir}", "on cpu (float32)", "KV int4_kivi (K int4_kivi, V int4_kivi)",
                 f"{info['kv_pool']['q_blocks']} blocks = {info['kv_pool']['tokens']} tokens",
                 f"{info['kv_pool']['hp_blocks']} high-precision blocks", "attention torch", "prefill torch",
                 "threads 1",
                 "async scheduling off"):
        assert part in msg, (part, msg)


@pytest.mark.parametrize("bad, exc, words", [
    (None, TypeError, "prompts must be a str, a list of token ids, or a list of those, got NoneType"),
    (5, TypeError, "got int"),
    ({"a": 1}, TypeError, "got dict"),
    ([1.5], TypeError, r"prompts\[0\] is float"),
    ([[5, 6], None], TypeError, r"prompts\[1\] is NoneType"),
])
def test_generate_names_the_prompts_argument(llm, bad, exc, words):
    """Bad prompts raise TypeError naming the argument and what it accepts; nothing is queued."""
    with pytest.raises(exc, match=words):
        llm.generate(bad, LONG, use_tqdm=False)
    assert _idle(llm)


def test_generate_names_sampling_params_and_fields(llm):
    with pytest.raises(TypeError, match="sampling_params must be a SamplingParams, a list of them"):
        llm.generate(["a b"], {"max_tokens": 3}, use_tqdm=False)
    with pytest.raises(TypeError, match="messages must be a conversation"):
        llm.chat(None, use_tqdm=False)
    from kvq.engine.errors import RequestError

    with pytest.raises(RequestError) as e:
        SamplingParams(temperature=-1)
    assert e.value.param == "temperature"
    # the engine's refusals carry the field and no internal id, with the prompt's index in a batch
    with pytest.raises(RequestError) as e:
        llm.generate([[5, 6], [5, 6, 7]], SamplingParams(max_tokens=10_000), use_tqdm=False)
    assert e.value.param == "max_tokens" and str(e.value).startswith("prompt 0: the prompt (2 tokens) + max_tokens")
    with pytest.raises(RequestError) as e:
        llm.generate([[]], LONG, use_tqdm=False)
    assert e.value.param == "prompt" and str(e.value) == "the prompt is empty"
    assert _idle(llm)
