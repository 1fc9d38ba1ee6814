"""Llama-family decoder (Llama 2/3, Mistral, Qwen2/2.5, Qwen3, SmolLM2) on the paged cache.

Module and parameter names follow Hugging Face transformers, except that q/k/v
and gate/up projections are stored concatenated (``qkv_proj``, ``gate_up_proj``:
one GEMM each instead of three and two); :meth:`LlamaForCausalLM.load_hf_state_dict`
concatenates an HF state dict's tensors.  Norms, RoPE and the gated activation
run as fused kernels on CUDA (:mod:`kvq.models.fused`).  Attention goes through a backend's kernels
(:mod:`kvq.attention.backends`): each layer writes its new K/V into the paged
cache in the cache's format, then attends over the cache as stored.

Shapes inside a step (T = tokens computed this step across all sequences):
    input_ids, positions  [T]
    hidden                [T, hidden_size]
    q                     [T, Hq, D];  k, v [T, Hkv, D]
"""

from __future__ import annotations

import contextlib
import contextvars
import math
from dataclasses import dataclass, field

import torch
from torch import nn

from kvq.cache.pool import KVPool
from kvq.cache.step import StepMetadata
from kvq.models.fused import add_rms_norm, add_rms_norm_torch, apply_rope, silu_mul
from kvq.cache.partition import Partition

SUPPORTED_MODEL_TYPES = ("llama", "mistral", "qwen2", "qwen3")


@dataclass(frozen=True)
class LlamaConfig:
    vocab_size: int
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    rope_scaling: dict | None = None
    tie_word_embeddings: bool = False
    attention_bias: bool = False  # Qwen2: biases on q/k/v
    qk_norm: bool = False  # Qwen3: RMSNorm on q and k per head
    max_position_embeddings: int = 4096
    model_type: str = "llama"
    sliding_window: int | None = None
    extra: dict = field(default_factory=dict)

    @classmethod
    def from_hf(cls, cfg) -> "LlamaConfig":
        cfg = getattr(cfg, "text_config", None) or cfg
        mt = getattr(cfg, "model_type", "llama")
        if mt not in SUPPORTED_MODEL_TYPES:
            raise ValueError(f"model type {mt!r} is not supported; supported: {', '.join(SUPPORTED_MODEL_TYPES)}")
        heads = cfg.num_attention_heads
        rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
        theta = rope.get("rope_theta", getattr(cfg, "rope_theta", 10000.0))
        scaling = dict(rope) if rope.get("rope_type", rope.get("type", "default")) not in ("default", None) else None
        sliding = getattr(cfg, "sliding_window", None) if getattr(cfg, "use_sliding_window", True) else None
        return cls(
            vocab_size=cfg.vocab_size,
            hidden_size=cfg.hidden_size,
            intermediate_size=cfg.intermediate_size,
            num_layers=cfg.num_hidden_layers,
            num_heads=heads,
            num_kv_heads=getattr(cfg, "num_key_value_heads", None) or heads,
            head_dim=getattr(cfg, "head_dim", None) or cfg.hidden_size // heads,
            rms_norm_eps=cfg.rms_norm_eps,
            rope_theta=float(theta),
            rope_scaling=scaling,
            tie_word_embeddings=bool(getattr(cfg, "tie_word_embeddings", False)),
            attention_bias=bool(getattr(cfg, "attention_bias", mt == "qwen2")),
            qk_norm=mt == "qwen3",
            max_position_embeddings=cfg.max_position_embeddings,
            model_type=mt,
            sliding_window=sliding,
        )


def rope_inv_freq(cfg: LlamaConfig) -> torch.Tensor:
    """[D/2] inverse frequencies, with llama3-style scaling when the config asks for it."""
    D = cfg.head_dim
    inv = 1.0 / (cfg.rope_theta ** (torch.arange(0, D, 2, dtype=torch.float64) / D))
    sc = cfg.rope_scaling
    if not sc:
        return inv.float()
    kind = sc.get("rope_type", sc.get("type"))
    if kind == "llama3":
        factor, lo, hi = sc["factor"], sc.get("low_freq_factor", 1.0), sc.get("high_freq_factor", 4.0)
        old = sc.get("original_max_position_embeddings", 8192)
        lo_wave, hi_wave = old / lo, old / hi
        wave = 2 * math.pi / inv
        scaled = torch.where(wave > lo_wave, inv / factor, inv)
        smooth = (old / wave - lo) / (hi - lo)
        mid = (1 - smooth) * scaled / factor + smooth * scaled
        is_mid = (wave <= lo_wave) & (wave >= hi_wave)
        return torch.where(is_mid, mid, scaled).float()
    if kind == "linear":
        return (inv / sc["factor"]).float()
    raise ValueError(f"rope scaling {kind!r} is not supported (supported: default, linear, llama3)")


class RotaryEmbedding(nn.Module):
    """Rotate-half RoPE (the HF Llama convention) at arbitrary positions."""

    def __init__(self, cfg: LlamaConfig):
        super().__init__()
        self.register_buffer("inv_freq", rope_inv_freq(cfg), persistent=False)

    def forward(self, q: torch.Tensor, k: torch.Tensor, positions: torch.Tensor):
        """q [T, Hq, D], k [T, Hkv, D], positions [T] -> rotated (q, k)."""
        return apply_rope(q, k, positions, self.inv_freq)


class RMSNorm(nn.Module):
    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.weight = nn.Parameter(torch.ones(dim))
        self.eps = eps

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return add_rms_norm_torch(x, None, self.weight, self.eps)[0]

    def add_norm(self, x: torch.Tensor, residual: torch.Tensor | None):
        """-> (norm(x + residual), x + residual): the residual stream's add fused with the norm."""
        return add_rms_norm(x, residual, self.weight, self.eps)


#: Row multiples tried, smallest first, for :func:`cpu_row_multiple`.
CPU_ROW_MULTIPLES = (4, 8, 16, 32)
_row_multiple: dict[tuple, int] = {}


def cpu_row_multiple(weight: torch.Tensor) -> int:
    """The smallest row multiple (of :data:`CPU_ROW_MULTIPLES`) at which this CPU's GEMM computes
    a row of ``x @ weight.T`` exactly as it does among 64 rows, whatever the batch; measured once
    per weight shape, dtype and thread count.  Machines differ: on one (AVX2) every multiple of 4
    matched; on a Sapphire Rapids (AMX) core, one thread, 4-12 rows took another kernel than 16 or
    more (the last bits differ), so there it is 16."""
    key = (tuple(weight.shape), weight.stride(), weight.dtype, torch.get_num_threads())
    found = _row_multiple.get(key)
    if found is None:
        g = torch.Generator().manual_seed(0)
        x = torch.randn(64, weight.shape[1], generator=g).to(weight.dtype)
        with torch.inference_mode():
            full = torch.nn.functional.linear(x, weight)
            found = next((r for r in CPU_ROW_MULTIPLES
                          if all(torch.equal(torch.nn.functional.linear(x[:n], weight), full[:n])
                                 for n in range(r, 64, r))), 64)
        _row_multiple[key] = found
    return found


#: True while :func:`weights_from_checkpoint` is active: :class:`Linear` and :class:`VocabEmbedding`
#: skip torch's random init.
_NO_RANDOM_INIT = contextvars.ContextVar("kvq_no_random_init", default=False)


@contextlib.contextmanager
def weights_from_checkpoint():
    """Build a model whose weights a checkpoint will overwrite: its projections and embedding skip
    torch's random init (kaiming-uniform over ~135M values: about 0.7 s of each engine build of the
    default model on one CPU core) and hold uninitialised memory until then.  Only for callers that
    load every one of those weights next (:meth:`LlamaForCausalLM.load_hf_state_dict` raises on a
    missing one); dummy weights (``load_format="dummy"``) keep torch's init and its random stream."""
    token = _NO_RANDOM_INIT.set(True)
    try:
        yield
    finally:
        _NO_RANDOM_INIT.reset(token)


class Linear(nn.Linear):
    """``nn.Linear`` whose output rows on the CPU do not depend on the other rows of the batch.

    The CPU GEMM picks its kernel and splits its work by the row count: in float32 a row
    computed among few rows, or in a remainder tile split off across threads, differs in the
    last bits from the same row computed among others, and a quantized cache turns such bits
    into different codes.  Padding the rows to a multiple of :func:`cpu_row_multiple` (4 on the
    machine where this was first checked, bit for bit on the default model's projection shapes
    for 1, 2 and 4 threads; 16 on another) keeps every row on the same kernel path, so a
    request's greedy output is the same alone and batched (``tests/test_batch_invariance.py``).
    It costs a one-sequence CPU decode about 1.3x at 4 rows (8 measured 1.6x; 16 about 1.5-2x per
    GEMM).  On CUDA the GEMM is left to cuBLAS, which chooses its algorithm by the batch
    (docs/engine.md)."""

    def reset_parameters(self) -> None:
        if not _NO_RANDOM_INIT.get():
            super().reset_parameters()

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        if x.device.type != "cpu":
            return super().forward(x)
        pad = -x.shape[0] % cpu_row_multiple(self.weight)
        if pad == 0:
            return super().forward(x)
        return super().forward(torch.cat([x, x.new_zeros(pad, *x.shape[1:])]))[: x.shape[0]]


def attend(kernels, q: torch.Tensor, layer, meta: StepMetadata, scale: float,
           k: torch.Tensor | None = None, v: torch.Tensor | None = None) -> torch.Tensor:
    """Attention of a step's queries over the cache: the leading one-token sequences
    (decodes) through the split-K decode kernel, the rest (prefill chunks) through the
    chunked-prefill kernel, which also gets the step's new K/V (``k``, ``v`` as computed,
    before the cache stored them) for the prefill window (:class:`~kvq.cache.step.PrefillWindow`)."""
    T, nd = q.shape[0], meta.num_decodes
    win = {} if meta.prefill_host is None else dict(host=meta.prefill_host)
    if k is not None and nd < T:  # the prefill window's exact rows, and a library prefill's fresh prompts' keys
        win.update(k_new=k[nd:], v_new=v[nd:])
    if meta.window is not None:
        win["window"] = meta.window
    if meta.prefill_tiers:  # a tiered cache whose prefill rows' tables hold lower tiers' blocks (kvq.cache.tiers)
        win.update(tiered=True)
    if nd == 0:
        return kernels.paged_attention(q, layer, meta.cu_seqlens_q, meta.block_tables, meta.seq_lens, scale,
                                       max_q_len=meta.max_q_len, has_hp=meta.has_hp, max_seq_len=meta.max_seq_len,
                                       **win)
    dec = kernels.paged_decode(q[:nd], layer, meta.block_tables[:nd], meta.seq_lens[:nd], scale,
                               max_seq_len=meta.max_seq_len, has_hp=meta.has_hp,
                               **({} if meta.tiers is None else {"tiers": meta.tiers}))
    if nd == T:
        return dec
    pre = kernels.paged_attention(q[nd:], layer, meta.prefill_cu, meta.block_tables[nd:], meta.seq_lens[nd:], scale,
                                  max_q_len=meta.max_q_len, has_hp=meta.has_hp, max_seq_len=meta.max_seq_len, **win)
    return torch.cat([dec, pre])


class Attention(nn.Module):
    """Tensor parallel (``tp`` not None): this rank's query heads and the KV heads of their groups
    (``part``), o_proj row-parallel with its partial sums all-reduced."""

    def __init__(self, cfg: LlamaConfig, index: int, part: Partition, tp=None):
        super().__init__()
        self.index, self.tp = index, tp
        self.Hq, self.Hkv, self.D = part.local_heads, part.local_kv_heads, cfg.head_dim
        self.qkv_proj = Linear(cfg.hidden_size, (self.Hq + 2 * self.Hkv) * self.D, bias=cfg.attention_bias)
        self.o_proj = Linear(self.Hq * self.D, cfg.hidden_size, bias=False)
        if cfg.qk_norm:
            self.q_norm = RMSNorm(self.D, cfg.rms_norm_eps)
            self.k_norm = RMSNorm(self.D, cfg.rms_norm_eps)
        self.qk_norm = cfg.qk_norm
        self.scale = self.D ** -0.5

    def forward(self, x, positions, rope: RotaryEmbedding, pool: KVPool, meta: StepMetadata, kernels):
        T = x.shape[0]
        qkv = self.qkv_proj(x)
        nq, nk = self.Hq * self.D, self.Hkv * self.D
        q = qkv[:, :nq].view(T, self.Hq, self.D)
        k = qkv[:, nq:nq + nk].view(T, self.Hkv, self.D)
        v = qkv[:, nq + nk:].view(T, self.Hkv, self.D)
        if self.qk_norm:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = rope(q, k, positions)
        if v.stride() != k.stride():  # the CPU's RoPE returns new tensors (the GPU's rotates in place): one layout
            v = v.contiguous()
        layer = pool.layers[self.index]
        if pool.observer is not None:  # static-scale warm-up (kvq.cache.scales_warmup)
            pool.observer.observe(self.index, k, v)
        if meta.seals is not None:  # before the write, which may reuse a sealed hp block
            kernels.seal_pairs(layer, meta.seals)
        kernels.write_kv(layer, k, v, meta.slots, meta.full_blocks)
        o = attend(kernels, q, layer, meta, self.scale, k, v)
        out = self.o_proj(o.reshape(T, self.Hq * self.D))
        return out if self.tp is None else self.tp.all_reduce(out)


class MLP(nn.Module):
    """Tensor parallel: this rank's intermediate rows; down_proj row-parallel, all-reduced."""

    def __init__(self, cfg: LlamaConfig, part: Partition, tp=None):
        super().__init__()
        self.tp = tp
        self.gate_up_proj = Linear(cfg.hidden_size, 2 * part.local_intermediate, bias=False)
        self.down_proj = Linear(part.local_intermediate, cfg.hidden_size, bias=False)

    def forward(self, x):
        out = self.down_proj(silu_mul(self.gate_up_proj(x)))
        return out if self.tp is None else self.tp.all_reduce(out)


class VocabEmbedding(nn.Embedding):
    """The token embedding; tensor parallel: this rank's rows of the (padded) vocabulary, the
    others' tokens looked up as zeros, and the ranks' rows summed (exact: one term is not zero)."""

    def __init__(self, cfg: LlamaConfig, part: Partition, tp=None):
        super().__init__(part.local_vocab if tp is not None else cfg.vocab_size, cfg.hidden_size)
        self.tp, self.start = tp, part.vocab[0]

    def reset_parameters(self) -> None:
        if not _NO_RANDOM_INIT.get():
            super().reset_parameters()

    def forward(self, ids: torch.Tensor) -> torch.Tensor:
        if self.tp is None:
            return super().forward(ids)
        local = ids - self.start
        inside = (local >= 0) & (local < self.num_embeddings)
        x = super().forward(local.clamp(0, self.num_embeddings - 1)) * inside[:, None].to(self.weight.dtype)
        return self.tp.all_reduce(x)


class DecoderLayer(nn.Module):
    def __init__(self, cfg: LlamaConfig, index: int, part: Partition, tp=None):
        super().__init__()
        self.self_attn = Attention(cfg, index, part, tp)
        self.mlp = MLP(cfg, part, tp)
        self.input_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.post_attention_layernorm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)

    def forward(self, x, residual, positions, rope, pool, meta, kernels):
        """(x, residual) -> (mlp output, residual stream before it); residual None in the first layer."""
        h, residual = self.input_layernorm.add_norm(x, residual)
        h = self.self_attn(h, positions, rope, pool, meta, kernels)
        h, residual = self.post_attention_layernorm.add_norm(h, residual)
        return self.mlp(h), residual


class LlamaBody(nn.Module):
    def __init__(self, cfg: LlamaConfig, part: Partition, tp=None):
        super().__init__()
        self.embed_tokens = VocabEmbedding(cfg, part, tp)
        self.layers = nn.ModuleList(DecoderLayer(cfg, i, part, tp) for i in range(cfg.num_layers))
        self.norm = RMSNorm(cfg.hidden_size, cfg.rms_norm_eps)
        self.rotary_emb = RotaryEmbedding(cfg)


def fuse_projections(state: dict[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    """HF names -> kvq's: q/k/v_proj concatenated into qkv_proj, gate/up_proj into gate_up_proj."""
    out = dict(state)
    groups = {"self_attn.qkv_proj": ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"),
              "mlp.gate_up_proj": ("mlp.gate_proj", "mlp.up_proj")}
    for key in list(state):
        for fused, parts in groups.items():
            for suffix in ("weight", "bias"):
                if key.endswith(f"{parts[0]}.{suffix}"):
                    prefix = key[: -len(f"{parts[0]}.{suffix}")]
                    names = [f"{prefix}{p}.{suffix}" for p in parts]
                    if all(n in out for n in names):
                        out[f"{prefix}{fused}.{suffix}"] = torch.cat([out.pop(n) for n in names], dim=0)
    return out


class LlamaForCausalLM(nn.Module):
    """The decoder and its LM head; ``forward`` returns logits of selected tokens only.

    Tensor parallel (``tp``, a :class:`~kvq.parallel.group.TPGroup`): this rank's share ``part``
    of every sharded layer (:mod:`kvq.cache.partition`); ``config`` stays the whole model's."""

    def __init__(self, cfg: LlamaConfig, part: Partition | None = None, tp=None):
        super().__init__()
        self.config = cfg
        self.part = part or Partition.of(cfg, 1, 0)
        self.tp = tp
        self.model = LlamaBody(cfg, self.part, tp)
        rows = self.part.local_vocab if tp is not None else cfg.vocab_size
        self.lm_head = Linear(cfg.hidden_size, rows, bias=False)
        if cfg.tie_word_embeddings:
            self.lm_head.weight = self.model.embed_tokens.weight
        self.tap = None  # kvq tune's sensitivity runs: kvq.calibration.layer_tap.LayerTap

    @torch.inference_mode()
    def forward(self, input_ids, positions, pool: KVPool, meta: StepMetadata, kernels,
                logits_indices: torch.Tensor) -> torch.Tensor:
        """input_ids/positions [T]; logits_indices [B] rows of the step to score -> [B, V] in the LM
        head's dtype (the model's): a float32 copy would hold the same values, and its pass over
        [B, V] cost 0.2 ms a step at 512 rows of a 128K vocabulary on the H200; consumers that need
        float32 (log-softmax, the sampler's sort path) convert."""
        tap, start, x, residual = self.tap, 0, None, None
        if tap is not None:  # record each layer's input, or start at a recorded one (kvq.calibration.layer_tap)
            start, x, residual = tap.enter(input_ids, positions)
        if start == 0:
            x, residual = self.model.embed_tokens(input_ids), None
        for src, dst, pairs in meta.demotes:  # every layer's, in one launch: before a seal or a write reuses
            kernels.demote_layers(pool.layers, pairs, src, dst)  # a demoted block (elastic precision)
        for i in range(start, len(self.model.layers)):
            if tap is not None:
                tap.layer_input(i, x, residual)
            x, residual = self.model.layers[i](x, residual, positions, self.model.rotary_emb, pool, meta, kernels)
        x = x.index_select(0, logits_indices)
        x, _ = self.model.norm.add_norm(x, residual.index_select(0, logits_indices))
        logits = self.lm_head(x)
        if self.tp is not None:  # every rank's vocabulary rows, padding cut
            logits = self.tp.gather_columns(logits)[:, : self.config.vocab_size]
        return logits

    def use_cpu_gemm_layout(self) -> None:
        """Store the decoder layers' projection weights column-major (the [out, in] tensor's transpose
        is contiguous), for CPU models only.  The CPU GEMM then reads ``weight.T`` as a plain [in, out]
        matrix instead of a transposed one: at the default model's shapes, one thread, 4 to 32 rows
        took 0.55-0.85x the time (601 -> 413 us for the fused gate/up projection at 4 rows) and 128
        to 256 rows about the same.  The LM head keeps its layout: at 16-128 rows (prompt logprobs,
        ``kvq eval``) the tied [49152, 576] head was up to 1.2x slower column-major.  The values are
        the checkpoint's; a row's last bits may differ from the row-major GEMM's, and
        :func:`cpu_row_multiple` measures the padding for this layout."""
        for m in self.model.layers.modules():
            if isinstance(m, Linear) and m.weight.device.type == "cpu" and m.weight.is_contiguous():
                m.weight.data = m.weight.data.t().contiguous().t()

    def load_hf_state_dict(self, state: dict[str, torch.Tensor]) -> None:
        """Copy an HF Llama-family state dict; every parameter must be covered."""
        state = {k: v for k, v in state.items() if "rotary_emb" not in k}
        if self.tp is not None:
            from kvq.models.shard import shard_state_dict

            state = shard_state_dict(state, self.config, self.part)
        state = fuse_projections(state)
        if self.config.tie_word_embeddings:
            state.pop("lm_head.weight", None)
        missing, unexpected = self.load_state_dict(state, strict=False)
        missing = [m for m in missing if not (self.config.tie_word_embeddings and m == "lm_head.weight")]
        if missing or unexpected:
            raise ValueError(f"weights do not match the model: missing {missing[:8]}, unexpected {unexpected[:8]}")
