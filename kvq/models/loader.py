"""Loading a model's tokenizer and weights from disk, offline, with progress.

Weights come through transformers' own loaders (safetensors folders, or GGUF
files that it dequantizes).  The hub is switched off before transformers is
imported and every call passes ``local_files_only``: a missing file is an
error, never a download.  A stage bar shows progress; transformers adds its own
per-tensor bars for GGUF conversion and weight loading.
"""

from __future__ import annotations

import contextlib
import os
from dataclasses import dataclass

import torch
from tqdm.auto import tqdm

from kvq.models.source import ModelFileError, ModelSource, resolve_model

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")


@dataclass
class LoadedModel:
    source: ModelSource
    tokenizer: object
    model: torch.nn.Module


def _kwargs(src: ModelSource) -> dict:
    kw = {"local_files_only": True}
    if src.gguf_file:
        kw["gguf_file"] = src.gguf_file
    return kw


def load_tokenizer(model: str | ModelSource):
    """The tokenizer of ``model``; a GGUF file's from its converted copy once there is one
    (:mod:`kvq.models.checkpoint_cache`)."""
    from transformers import AutoTokenizer

    from kvq.models.checkpoint_cache import cached_folder

    src = resolve_model(model) if isinstance(model, str) else model
    folder = cached_folder(src) if src.gguf_file else None
    with named_errors(src, "tokenizer"):
        if folder is not None:
            return AutoTokenizer.from_pretrained(str(folder), local_files_only=True)
        return AutoTokenizer.from_pretrained(str(src.folder), **_kwargs(src))


@contextlib.contextmanager
def named_errors(src: ModelSource, what: str):
    """A checkpoint transformers cannot read (truncated safetensors, garbled GGUF tensors, missing
    files) -> one ModelFileError naming the file and the loader's complaint, not a traceback."""
    try:
        yield
    except (ModelFileError, MemoryError, KeyboardInterrupt):
        raise
    except Exception as e:  # noqa: BLE001 - transformers, safetensors and gguf raise many types here
        msg = " ".join(str(e).split())[:300]
        raise ModelFileError(f"{src.path}: cannot load the {what} ({type(e).__name__}: {msg})") from e


def load_hf_model(model: str | ModelSource = "default", dtype: torch.dtype = torch.float32,
                  device: str | torch.device = "cpu", progress: bool = True) -> LoadedModel:
    """Tokenizer + transformers causal LM for ``model`` ('default', .gguf path, HF folder).  A GGUF
    file is converted once and read from its converted copy after that
    (:mod:`kvq.models.checkpoint_cache`)."""
    from transformers import AutoModelForCausalLM

    from kvq.models.checkpoint_cache import cached_folder, store

    src = resolve_model(model) if isinstance(model, str) else model
    folder = cached_folder(src) if src.gguf_file else None
    with tqdm(total=3, desc=f"loading {src.name}", disable=not progress, unit="stage") as bar:
        bar.set_postfix_str("tokenizer")
        tok = load_tokenizer(src)
        bar.update()
        bar.set_postfix_str("weights" if folder is None else "weights (converted copy)")
        with named_errors(src, "weights"):
            if folder is not None:
                lm = AutoModelForCausalLM.from_pretrained(str(folder), dtype=dtype, local_files_only=True)
            else:
                lm = AutoModelForCausalLM.from_pretrained(str(src.folder), dtype=dtype, **_kwargs(src))
                if src.gguf_file and dtype == torch.float32:  # the exact dequantized weights
                    store(src, lm, tok)
        bar.update()
        bar.set_postfix_str(f"to {device}")
        lm = lm.to(device).eval()
        bar.update()
    return LoadedModel(src, tok, lm)
