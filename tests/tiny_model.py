"""A tiny Llama checkpoint folder for engine tests (dummy weights: config.json only)."""

import json

TINY_LLAMA = dict(architectures=["LlamaForCausalLM"], model_type="llama", vocab_size=256, hidden_size=64,
                  intermediate_size=64, num_hidden_layers=1, num_attention_heads=2, num_key_value_heads=1,
                  head_dim=32, rms_norm_eps=1e-5, rope_theta=10000.0, max_position_embeddings=128,
                  tie_word_embeddings=False, torch_dtype="float32")


def write_tiny(path, **overrides) -> str:
    """Write TINY_LLAMA (with ``overrides``) as ``path``/config.json; -> the folder, a model name."""
    (path / "config.json").write_text(json.dumps({**TINY_LLAMA, **overrides}))
    return str(path)
