"""Drives a paged cache through prompt + decode steps, keeping the exact K/V beside it.

Shared by the attention tests; not a test module itself.
"""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from kvq.cache.block_manager import BlockManager
from kvq.cache.plan import bare_model, make_plan
from kvq.cache.pool import KVPool
from kvq.cache.step import apply_ops, build_metadata
from kvq.formats.reference import roundtrip


@dataclass
class Harness:
    plan: object
    manager: BlockManager
    pool: KVPool
    kernels: object
    device: str
    group: int
    exact_k: dict = field(default_factory=dict)  # seq -> [n, H, D] bf16 values written
    exact_v: dict = field(default_factory=dict)

    @property
    def layer(self):
        return self.pool.layers[0]


def make_harness(fmt, kernels, *, H=2, D=64, group=2, block_size=None, sink=None, residual=None,
                 num_q=64, num_hp=32, device="cpu", dtype="bfloat16") -> Harness:
    model = bare_model(1, H, D, num_attention_heads=H * group, dtype=dtype)
    if "/" in fmt:  # "K_SPEC/V_SPEC", e.g. int4_kivi/int2_kivi:g64: K and V differ in family or group
        from kvq.cache.plan import plan_from_file
        from kvq.cache.plan_file import PlanFile

        k, v = fmt.split("/")
        pf = PlanFile("mixed", {"num_layers": 1, "num_kv_heads": H, "head_dim": D}, ((k, v),),
                      sink_tokens=sink or 0, residual_tokens=residual or 0)
        plan = plan_from_file(model, pf, block_size=block_size)
    else:
        plan = make_plan(model, fmt, block_size=block_size, sink_tokens=sink, residual_tokens=residual)
    manager = BlockManager(num_q, num_hp, plan.window_policy, enable_prefix_caching=False)
    pool = KVPool.create(plan, num_q, num_hp, device)
    return Harness(plan, manager, pool, kernels, device, group)


def kv_data(gen: torch.Generator, T: int, H: int, D: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """bf16 K/V with per-token magnitude spread and two outlier channels in K."""
    k = torch.randn(T, H, D, generator=gen) * torch.rand(T, H, 1, generator=gen).add(0.2)
    k[:, :, 1] += 6.0
    k[:, :, D // 2 + 3] -= 4.0
    v = torch.randn(T, H, D, generator=gen) * torch.rand(T, H, 1, generator=gen).add(0.2)
    return k.bfloat16().to(device), v.bfloat16().to(device)


def schedule(manager, new: dict) -> list:
    """``new[seq]`` more tokens for each sequence of ``manager`` (a sequence it does not hold gets them as
    its prompt): -> the block ops to apply to the pools."""
    ops = []
    for sid, n in new.items():
        if sid in manager:
            ops += manager.append_slots(sid, [0] * n)
        else:
            manager.allocate_prompt(sid, list(range(n)))
    return ops


def step(h: Harness, new: dict, gen: torch.Generator, q_dtype=torch.bfloat16, kv: dict | None = None):
    """Add ``new[seq] = number of tokens`` to each sequence (new sequences get a prompt),
    write their K/V and return (q, metadata, out) of attention over the cache."""
    H, D = h.layer.num_kv_heads, h.layer.head_dim
    apply_ops(h.pool, h.kernels, schedule(h.manager, new))
    sids = list(new)
    meta = build_metadata(h.manager, sids, [new[s] for s in sids], h.device)
    ks, vs = [], []
    for sid in sids:
        if kv is not None:
            k, v = kv[sid]
        else:
            k, v = kv_data(gen, new[sid], H, D, h.device)
        h.exact_k[sid] = torch.cat([h.exact_k[sid], k]) if sid in h.exact_k else k
        h.exact_v[sid] = torch.cat([h.exact_v[sid], v]) if sid in h.exact_v else v
        ks.append(k)
        vs.append(v)
    k, v = torch.cat(ks), torch.cat(vs)
    h.kernels.write_kv(h.layer, k, v, meta.slots, meta.full_blocks)
    T = k.shape[0]
    q = torch.randn(T, H * h.group, D, generator=gen).to(q_dtype).to(h.device)
    sm = D ** -0.5
    out = h.kernels.paged_attention(q, h.layer, meta.cu_seqlens_q, meta.block_tables, meta.seq_lens, sm,
                                    max_q_len=meta.max_q_len, has_hp=meta.has_hp)
    return q, meta, out


def expected_kv(h: Harness, sid, role: str) -> torch.Tensor:
    """[H, n, D] float32: what the cache should hold, per its current table."""
    x = (h.exact_k if role == "k" else h.exact_v)[sid].float().cpu()
    fmt = h.layer.tensor_format(role)
    bs = h.plan.block_size
    parts = []
    for i, ref in enumerate(h.manager.block_table(sid)):
        blk = x[i * bs:(i + 1) * bs]  # [t, H, D]
        if ref.pool == "hp":
            parts.append(blk.bfloat16().float())
        else:
            planes_in = blk.permute(1, 0, 2)[None]  # [1, H, t, D]
            parts.append(roundtrip(fmt, planes_in, h.layer.static_scale(role).cpu())[0].permute(1, 0, 2))
    return torch.cat(parts).permute(1, 0, 2)


def dense_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, group: int) -> torch.Tensor:
    """q [t, Hq, D] (the last t positions), k/v [H, n, D] -> [t, Hq, D] float32."""
    t, n, D = q.shape[0], k.shape[1], q.shape[2]
    kk = k.repeat_interleave(group, 0)
    vv = v.repeat_interleave(group, 0)
    s = torch.einsum("thd,hnd->htn", q.float(), kk) * D ** -0.5
    mask = torch.arange(n)[None, :] > torch.arange(n - t, n)[:, None]
    s = s.masked_fill(mask, float("-inf"))
    return torch.einsum("htn,hnd->thd", s.softmax(-1), vv)
