"""Capture real K, V and Q from the default model into a small test fixture.

Runs SmolLM2-135M-Instruct (float32, CPU) over the first ``--tokens`` tokens of
:func:`kvq.text.reference_text` and saves, for a few layers, what attention
actually reads:

    k, v   [L, T, H, D]    bfloat16, post-RoPE K as cached by the model, and V
    q      [L, P, Hq, D]   bfloat16, post-RoPE queries at P positions
    o      [L, P, Hq, D]   bfloat16, the model's own attention output there
                           (the input of o_proj, per query head)
    q_positions [P], layers [L], token_ids [T]  int64
    meta   dict of plain values (model, text source, rope_applied, ...)

K and V come from the returned cache (``past_key_values``, a DynamicCache); Q is the q_proj output with
the layer's own ``position_embeddings`` applied through transformers'
``apply_rotary_pos_emb`` (exactly what LlamaAttention does).  Before saving, the
script recomputes causal GQA attention from the captured Q/K/V and asserts it
equals the model's attention output, both from the float32 captures (tight) and
from the bf16 fixture tensors (~1e-2), so a wrong capture cannot be written.

    python scripts/capture_kv_fixture.py [--out tests/fixtures/kv_smollm2.pt]
"""

from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

os.environ.setdefault("HF_HUB_OFFLINE", "1")

import torch  # noqa: E402

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

from kvq.models.source import DEFAULT_MODEL_FILE, default_model_source  # noqa: E402
from kvq.text import TEXT_SOURCE, reference_text  # noqa: E402

DEFAULT_OUT = ROOT / "tests" / "fixtures" / "kv_smollm2.pt"
#: Layer 0 has outlier channels in K; 1 is next to it; 14 is mid-depth; 29 is the last.
LAYERS = (0, 1, 14, 29)
#: 896 = 28 blocks of 32 tokens; keeps 4 layers of bf16 K+V under 3 MB.
TOKENS = 896
NUM_QUERIES = 16


def causal_gqa_attention(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, positions: torch.Tensor) -> torch.Tensor:
    """softmax(q k^T / sqrt(D)) v in float32 for queries at ``positions``, causal, GQA.

    q [P, Hq, D], k/v [T, H, D], positions [P] -> [P, Hq, D]; query head h reads
    KV head h // (Hq // H).
    """
    P, Hq, D = q.shape
    T, H, _ = k.shape
    kk = k.float().repeat_interleave(Hq // H, dim=1)  # [T, Hq, D]
    vv = v.float().repeat_interleave(Hq // H, dim=1)
    scores = torch.einsum("phd,thd->pht", q.float(), kk) / D**0.5  # [P, Hq, T]
    future = torch.arange(T).view(1, 1, T) > positions.view(P, 1, 1)
    probs = scores.masked_fill(future, float("-inf")).softmax(dim=-1)
    return torch.einsum("pht,thd->phd", probs, vv)


def rel_err(a: torch.Tensor, b: torch.Tensor) -> float:
    """||a - b|| / ||b|| (Frobenius), in float64."""
    return float((a.double() - b.double()).norm() / b.double().norm())


def query_positions(T: int, n: int) -> torch.Tensor:
    """n positions evenly spread over the sequence, the last one included."""
    return torch.linspace(T / n - 1, T - 1, n).round().long()


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--out", type=Path, default=DEFAULT_OUT)
    args = ap.parse_args()

    from transformers import AutoModelForCausalLM, AutoTokenizer
    from transformers.models.llama.modeling_llama import apply_rotary_pos_emb

    torch.manual_seed(0)
    torch.use_deterministic_algorithms(True)
    src = default_model_source()
    print(f"loading {src.path} (float32, CPU) ...", flush=True)
    t0 = time.time()
    tok = AutoTokenizer.from_pretrained(src.folder, gguf_file=src.gguf_file)
    model = AutoModelForCausalLM.from_pretrained(src.folder, gguf_file=src.gguf_file, dtype=torch.float32)
    model.eval()
    cfg = model.config
    Hq, H = cfg.num_attention_heads, cfg.num_key_value_heads
    D = getattr(cfg, "head_dim", None) or cfg.hidden_size // Hq
    print(f"loaded in {time.time() - t0:.1f} s: {cfg.num_hidden_layers} layers, Hq={Hq}, H={H}, D={D}", flush=True)

    ids = tok(reference_text(min_chars=8 * TOKENS), add_special_tokens=False, return_tensors="pt").input_ids
    assert ids.shape[1] >= TOKENS, ids.shape
    ids = ids[:, :TOKENS]
    T = ids.shape[1]
    pos = query_positions(T, NUM_QUERIES)

    # Hooks: q_proj output, the rotary (cos, sin) the attention receives, o_proj input.
    raw_q: dict[int, torch.Tensor] = {}
    rope: dict[int, tuple[torch.Tensor, torch.Tensor]] = {}
    attn_in: dict[int, torch.Tensor] = {}
    handles = []
    for li in LAYERS:
        attn = model.model.layers[li].self_attn

        def save_rope(mod, a, kw, li=li):
            rope[li] = kw["position_embeddings"]

        handles += [
            attn.register_forward_pre_hook(save_rope, with_kwargs=True),
            attn.q_proj.register_forward_hook(lambda m, a, out, li=li: raw_q.__setitem__(li, out.detach())),
            attn.o_proj.register_forward_pre_hook(lambda m, a, li=li: attn_in.__setitem__(li, a[0].detach())),
        ]

    print(f"forward over {T} tokens ...", flush=True)
    t0 = time.time()
    with torch.no_grad():
        out = model(input_ids=ids, use_cache=True)
    for h in handles:
        h.remove()
    print(f"forward done in {time.time() - t0:.1f} s", flush=True)
    cache = out.cache if hasattr(out, "cache") else out.past_key_values  # renamed in transformers 5.x

    ks, vs, qs, os_ = [], [], [], []
    for li in LAYERS:
        k = cache.layers[li].keys[0].transpose(0, 1)  # [1, H, T, D] -> [T, H, D]
        v = cache.layers[li].values[0].transpose(0, 1)
        assert k.shape == (T, H, D) and v.shape == (T, H, D), (k.shape, v.shape)
        q = raw_q[li].view(1, T, Hq, D).transpose(1, 2)  # as LlamaAttention: [1, Hq, T, D]
        cos, sin = rope[li]
        q, _ = apply_rotary_pos_emb(q, q, cos, sin)
        q = q[0].transpose(0, 1)[pos]  # [P, Hq, D]
        o = attn_in[li][0].view(T, Hq, D)[pos]  # model's attention output, [P, Hq, D]

        # The check: captured Q/K/V reproduce the model's own attention output.
        e32 = rel_err(causal_gqa_attention(q, k, v, pos), o)
        e16 = rel_err(causal_gqa_attention(q.bfloat16(), k.bfloat16(), v.bfloat16(), pos), o)
        print(f"layer {li:2d}: attention from captured Q/K/V vs model: rel err {e32:.2e} (fp32), {e16:.2e} (bf16)")
        assert e32 < 1e-4, f"layer {li}: float32 capture does not reproduce the model's attention ({e32:.3e})"
        assert e16 < 1e-2, f"layer {li}: bf16 fixture does not reproduce the model's attention ({e16:.3e})"
        ks.append(k.bfloat16())
        vs.append(v.bfloat16())
        qs.append(q.bfloat16())
        os_.append(o.bfloat16())

    fixture = {
        "k": torch.stack(ks).contiguous(),
        "v": torch.stack(vs).contiguous(),
        "q": torch.stack(qs).contiguous(),
        "o": torch.stack(os_).contiguous(),
        "q_positions": pos,
        "layers": torch.tensor(LAYERS, dtype=torch.long),
        "token_ids": ids[0].clone(),
        "meta": {
            "model": "SmolLM2-135M-Instruct",
            "model_file": DEFAULT_MODEL_FILE,
            "model_dtype": "float32",
            "text_source": TEXT_SOURCE,
            "num_tokens": T,
            "layers": list(LAYERS),
            "num_query_heads": Hq,
            "num_kv_heads": H,
            "head_dim": D,
            "rope_applied": True,
            "layout": "k/v [L, T, H, D]; q/o [L, P, Hq, D]; query head h reads KV head h // (Hq // H)",
            "torch": str(torch.__version__),
            "generated_by": "python scripts/capture_kv_fixture.py",
        },
    }
    args.out.parent.mkdir(parents=True, exist_ok=True)
    torch.save(fixture, args.out)
    size = args.out.stat().st_size
    print(f"wrote {args.out} ({size / 2**20:.2f} MiB, {size} bytes)")
    for name in ("k", "v", "q", "o", "q_positions", "layers", "token_ids"):
        t = fixture[name]
        print(f"  {name:12s} {str(tuple(t.shape)):20s} {t.dtype}")


if __name__ == "__main__":
    main()
