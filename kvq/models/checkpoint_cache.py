"""A converted copy of each GGUF checkpoint on local disk: only the first load pays for the conversion.

transformers reads a GGUF file three times (tokenizer, config, weights), walks its
49k-entry vocabulary in Python each time and dequantizes every tensor: about 20 s
for the 135M default model on one core, in every process that loads it (each
``kvq`` command, each server, each tensor-parallel rank).  The first load writes
what it converted as an ordinary Hugging Face folder::

    $KVQ_CACHE_DIR (default $XDG_CACHE_HOME/kvq, else ~/.cache/kvq)
      gguf/<file stem>-<sha256 of the file, 16 hex>/
        config.json  tokenizer.json  tokenizer_config.json ...   (save_pretrained)
        model.safetensors                                        (float32, exactly the dequantized weights)
        kvq-checkpoint.json                                      (written last: the entry is complete)

and later loads read that folder (about 1 s).  The key is the file's content hash
(0.15 s for 98 MB) together with the transformers version that converted it, so a
changed file or another converter never reads a stale entry.  Entries are built in
a temporary folder and renamed into place, so concurrent processes (test workers,
ranks) never see half an entry.  ``KVQ_CACHE_DIR=off`` turns the cache off; a
cache folder that cannot be written is reported once and the GGUF is read directly.
"""

from __future__ import annotations

import functools
import hashlib
import json
import logging
import os
import shutil
import tempfile
from pathlib import Path

from kvq.models.source import ModelSource

log = logging.getLogger("kvq")

CACHE_ENV = "KVQ_CACHE_DIR"
MANIFEST = "kvq-checkpoint.json"
#: Bumped when what an entry holds changes.
SCHEMA = 1
_OFF = ("", "0", "off", "none", "false")


def cache_root() -> Path | None:
    """The cache folder, or None when ``KVQ_CACHE_DIR`` turns the cache off."""
    env = os.environ.get(CACHE_ENV)
    if env is not None:
        return None if env.strip().lower() in _OFF else Path(os.path.expanduser(env))
    base = os.environ.get("XDG_CACHE_HOME") or os.path.join(os.path.expanduser("~"), ".cache")
    return Path(base) / "kvq"


@functools.lru_cache(maxsize=8)
def _file_sha256(path: str, size: int, mtime_ns: int) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        for block in iter(lambda: f.read(1 << 22), b""):
            h.update(block)
    return h.hexdigest()


def _key(src: ModelSource) -> dict:
    import transformers

    st = src.path.stat()
    return {"schema": SCHEMA, "sha256": _file_sha256(str(src.path), st.st_size, st.st_mtime_ns),
            "transformers": transformers.__version__}


def entry_dir(src: ModelSource) -> Path | None:
    """Where ``src``'s converted copy lives (whether or not it exists yet); None if caching is off
    or ``src`` is not a GGUF file."""
    root = cache_root()
    if root is None or not src.gguf_file:
        return None
    key = _key(src)
    return root / "gguf" / f"{Path(src.gguf_file).stem}-{key['sha256'][:16]}"


def cached_folder(src: ModelSource) -> Path | None:
    """The complete converted copy of ``src``, or None when there is none (yet)."""
    d = entry_dir(src)
    if d is None:
        return None
    try:
        manifest = json.loads((d / MANIFEST).read_text())
    except (OSError, ValueError):
        return None
    want = _key(src)
    if any(manifest.get(k) != v for k, v in want.items()):
        return None  # another converter (a transformers upgrade) wrote it: convert again
    return d


_warned: set[str] = set()


def _save_weights(model, folder: Path) -> None:
    """config.json and model.safetensors of an HF model transformers loaded from GGUF (its own
    save_pretrained refuses a model marked as GGUF-quantized, though the weights are plain)."""
    from safetensors.torch import save_file

    cfg = model.config.to_dict()
    cfg.pop("quantization_config", None)  # the weights below are dequantized
    (folder / "config.json").write_text(json.dumps(cfg, indent=1, default=str))
    state, seen = {}, {}
    for name, t in model.state_dict().items():
        ptr = (t.data_ptr(), t.shape)
        if ptr in seen:  # tied (lm_head = embedding): stored once, re-tied by the config on load
            continue
        seen[ptr] = name
        state[name] = t.detach().contiguous().cpu()
    save_file(state, str(folder / "model.safetensors"), metadata={"format": "pt"})


def store(src: ModelSource, model, tokenizer) -> Path | None:
    """Write ``model`` (an HF model with the weights converted from ``src``) and ``tokenizer`` as
    ``src``'s entry; -> its folder, or None if it could not be written (reported once, never fatal:
    the weights in hand are correct either way)."""
    d = entry_dir(src)
    if d is None:
        return None
    tmp = None
    try:
        d.parent.mkdir(parents=True, exist_ok=True)
        tmp = Path(tempfile.mkdtemp(prefix=f".{d.name}.", dir=d.parent))
        _save_weights(model, tmp)
        if tokenizer is not None:
            tokenizer.save_pretrained(tmp)
        (tmp / MANIFEST).write_text(json.dumps({**_key(src), "source": str(src.path)}, indent=1))
        try:
            os.rename(tmp, d)  # atomic; fails if another process finished first, which is as good
        except OSError:
            if cached_folder(src) is None:
                raise
        else:
            tmp = None
        log.info("kvq: converted %s once into %s (later loads read it; %s=off to disable)", src.path, d, CACHE_ENV)
        return d
    except OSError as e:
        if str(d) not in _warned:
            _warned.add(str(d))
            log.warning("kvq: cannot cache the converted checkpoint in %s (%s); every load converts %s again "
                        "(set %s to a writable folder, or to off)", d.parent, e, src.path, CACHE_ENV)
        return None
    finally:
        if tmp is not None:
            shutil.rmtree(tmp, ignore_errors=True)
