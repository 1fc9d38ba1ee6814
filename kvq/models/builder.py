"""Build a kvq model: real weights through transformers' loaders, or dummy weights.

``load_format="auto"`` loads the checkpoint (GGUF or HF folder, offline) and
copies its weights into :class:`kvq.models.llama.LlamaForCausalLM`;
``load_format="dummy"`` builds random weights at the config's real shapes
directly on the device (for benchmarks: a shipped config such as
``llama-3-8b`` has no weights at all).
"""

from __future__ import annotations

import torch

from kvq.models.llama import SUPPORTED_MODEL_TYPES, LlamaConfig, LlamaForCausalLM, weights_from_checkpoint
from kvq.models.source import ModelFileError, ModelSource, read_hf_config, resolve_model

LOAD_FORMATS = ("auto", "dummy")


def _hf_config(src: ModelSource):
    from transformers import AutoConfig

    kw = {"local_files_only": True}
    if src.gguf_file:
        kw["gguf_file"] = src.gguf_file
    if src.gguf_file is None and (src.folder / "config.json").is_file():
        data = read_hf_config(src.folder)
        data.pop("_comment", None)
        from transformers import CONFIG_MAPPING

        mt = data.get("model_type", "llama")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ModelFileError(f"{src.folder / 'config.json'}: model_type {mt!r} is not one kvq builds; valid: "
                                 f"{', '.join(SUPPORTED_MODEL_TYPES)}")
        return CONFIG_MAPPING[mt](**{k: v for k, v in data.items() if k != "model_type"})
    try:
        return AutoConfig.from_pretrained(str(src.folder), **kw)
    except (OSError, ValueError, KeyError) as e:
        raise ModelFileError(f"{src.path}: cannot read the model config ({type(e).__name__}: {e})") from None


def build_model(model: str | ModelSource = "default", *, load_format: str = "auto", dtype: torch.dtype = torch.float32,
                device: str | torch.device = "cpu", seed: int = 0, progress: bool = True, tp=None):
    """-> (LlamaForCausalLM in eval mode on ``device``, tokenizer or None).  ``tp`` (a
    :class:`~kvq.parallel.group.TPGroup`): this rank's shard only (dummy weights: seeded per rank,
    so they differ between tensor-parallel sizes)."""
    if load_format not in LOAD_FORMATS:
        raise ValueError(f"unknown load format {load_format!r}; valid: {', '.join(LOAD_FORMATS)}")
    src = resolve_model(model) if isinstance(model, str) else model
    if load_format == "dummy":
        cfg = LlamaConfig.from_hf(_hf_config(src))
        torch.manual_seed(seed + (tp.rank if tp is not None else 0))
        default = torch.get_default_dtype()
        torch.set_default_dtype(dtype)  # made in the model dtype: a 70B shard in float32 would not fit a GPU
        try:
            with torch.device(device):
                lm = LlamaForCausalLM(cfg, _partition(cfg, tp), tp).to(dtype)  # (buffers as before)
        finally:
            torch.set_default_dtype(default)
        for p in lm.parameters():  # small random weights at the real shapes, made on the device
            p.data.normal_(0.0, 0.02)
        for name, p in lm.named_parameters():
            if name.endswith("norm.weight"):
                p.data.fill_(1.0)
        lm.use_cpu_gemm_layout()
        tok = None
        try:
            from kvq.models.loader import load_tokenizer

            tok = load_tokenizer(src) if src.gguf_file or (src.folder / "tokenizer.json").is_file() else None
        except Exception:  # noqa: BLE001 - a dummy model may have no tokenizer; callers pass token ids
            tok = None
        return lm.eval(), tok
    if not src.gguf_file and not any(src.folder.glob("*.safetensors")) and not any(src.folder.glob("*.bin")):
        raise ValueError(f"{src.name} has no weights on disk; use --load-format dummy for its shapes")
    cfg, state, tok = _load_checkpoint(src, progress)
    with torch.device(device), weights_from_checkpoint():  # no random init: every weight is loaded next
        lm = LlamaForCausalLM(cfg, _partition(cfg, tp), tp)
    lm.load_hf_state_dict(state)
    lm = lm.to(dtype=dtype)
    lm.use_cpu_gemm_layout()
    return lm.eval(), tok


def _partition(cfg: LlamaConfig, tp):
    from kvq.cache.partition import Partition

    return Partition.of(cfg, tp.world if tp is not None else 1, tp.rank if tp is not None else 0)


def ensure_converted(model: str | ModelSource) -> None:
    """Make sure a GGUF checkpoint has its converted copy on disk (kvq.models.checkpoint_cache), so
    processes started next read it instead of converting the file each at the same time."""
    from kvq.models.checkpoint_cache import cached_folder, entry_dir

    src = resolve_model(model) if isinstance(model, str) else model
    if src.gguf_file and entry_dir(src) is not None and cached_folder(src) is None:
        _load_checkpoint(src, False)


#: (source, what :func:`_load_checkpoint` returned for it): the last checkpoint loaded.
_last_checkpoint: tuple | None = None


def _load_checkpoint(src: ModelSource, progress: bool):
    """(config, float32 CPU state dict, tokenizer) of the last checkpoint loaded; engines built
    one after another on the same model (evaluation of several formats, tests) share it, whether
    or not they draw a progress bar (``progress``: the bar of a load that reads the files)."""
    global _last_checkpoint
    if _last_checkpoint is not None and _last_checkpoint[0] == src:
        return _last_checkpoint[1]
    _last_checkpoint = None  # the previous model's tensors are freed before the next is read
    from kvq.models.checkpoint_cache import cached_folder
    from kvq.models.loader import load_hf_model

    folder = cached_folder(src) if src.gguf_file else None
    if folder is not None:
        checkpoint = read_converted(src, folder)
    else:
        loaded = load_hf_model(src, dtype=torch.float32, device="cpu", progress=progress)
        state = {k: v.detach() for k, v in loaded.model.state_dict().items()}
        checkpoint = (LlamaConfig.from_hf(loaded.model.config), state, loaded.tokenizer)
    _last_checkpoint = (src, checkpoint)
    return checkpoint


def read_converted(src: ModelSource, folder) -> tuple:
    """(config, float32 state dict, tokenizer) of a GGUF checkpoint's converted copy
    (kvq.models.checkpoint_cache), its weights read straight from the safetensors file the conversion
    wrote: the same tensors as transformers' model built from that folder (tests/test_model_loader.py)
    without building it (LLM('default') in a fresh process 4.3 -> 3.6-3.8 s on the 2-core CPU: each
    server, rank and worker).  A tied output head is absent from the file, as kvq's model expects."""
    from safetensors.torch import load_file
    from transformers import AutoConfig

    from kvq.models.loader import load_tokenizer, named_errors

    tok = load_tokenizer(src)
    files = sorted(folder.glob("*.safetensors"))  # (one file, or the shards of a large model)
    if not files:
        raise ModelFileError(f"{folder}: the converted copy of {src.path} holds no safetensors weights")
    state = {}
    with named_errors(src, "weights"):
        hf_cfg = AutoConfig.from_pretrained(str(folder), local_files_only=True)
        for f in files:
            state.update(load_file(str(f)))
    return LlamaConfig.from_hf(hf_cfg), state, tok
