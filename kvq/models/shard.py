"""This rank's slice of a checkpoint (Hugging Face names, before q/k/v and gate/up are fused).

Column-parallel (rows of the weight): q_proj by this rank's query heads, k_proj and v_proj by its
KV heads (with their biases), gate_proj and up_proj by its intermediate rows, embed_tokens and
lm_head by its rows of the padded vocabulary.  Row-parallel (columns): o_proj by its query heads,
down_proj by its intermediate rows.  Norms and per-head q/k norms are replicated.
"""

from __future__ import annotations

import torch

from kvq.cache.partition import Partition


def _rows(t: torch.Tensor, a: int, b: int) -> torch.Tensor:
    return t[a:b].clone()


def _padded_rows(t: torch.Tensor, part: Partition) -> torch.Tensor:
    pad = part.padded_vocab - t.shape[0]
    if pad:
        t = torch.cat([t, t.new_zeros(pad, *t.shape[1:])])
    return _rows(t, *part.vocab)


def shard_state_dict(state: dict[str, torch.Tensor], cfg, part: Partition) -> dict[str, torch.Tensor]:
    """-> the tensors rank ``part.rank`` holds, under the same names."""
    D = cfg.head_dim
    qa, qb = part.heads
    ka, kb = part.kv_heads
    ia, ib = part.intermediate
    out = {}
    for name, t in state.items():
        if name.endswith(("q_proj.weight", "q_proj.bias")):
            out[name] = _rows(t, qa * D, qb * D)
        elif name.endswith(("k_proj.weight", "k_proj.bias", "v_proj.weight", "v_proj.bias")):
            out[name] = _rows(t, ka * D, kb * D)
        elif name.endswith(("gate_proj.weight", "up_proj.weight")):
            out[name] = _rows(t, ia, ib)
        elif name.endswith("o_proj.weight"):
            out[name] = t[:, qa * D: qb * D].clone()
        elif name.endswith("down_proj.weight"):
            out[name] = t[:, ia:ib].clone()
        elif name.endswith(("embed_tokens.weight", "lm_head.weight")):
            out[name] = _padded_rows(t, part)
        elif name.endswith(("o_proj.bias", "down_proj.bias")):
            raise ValueError(f"{name}: a bias on a row-parallel layer is not supported with tensor parallelism")
        else:
            out[name] = t
    return out
