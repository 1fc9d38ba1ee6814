"""How much each tensor of the cache costs in quality, per candidate format (``kvq tune``).

The sensitivity of (layer, K or V, format) is the mean token KL against the
baseline (every layer in the model dtype) when only that one tensor is stored in
that format, every other in the model dtype: measured through the real cache, on
real text, with the windows the plan will use (sink tokens and the recent window
read exact, per query).  Each pass is :func:`kvq.eval.scoring.score_stream` at
one bin: the context is prefilled in chunks, then ``scored`` positions are fed in
block-sized chunks as decode would feed them, so the scored queries read the
quantized past exactly as they would while serving.  One engine per measured
tensor, the checkpoint loaded once; a tensor's run starts at its layer, from the
baseline's recorded inputs (:mod:`kvq.calibration.layer_tap`: the layers before it
compute what the baseline did), about half the layers' work on average.

A :class:`Space` names what is measured; :func:`measure` returns a
:class:`Sensitivity` that :mod:`kvq.calibration.tune` turns into solver items
and that can be saved and reused (``--sensitivity FILE``).
"""

from __future__ import annotations

import hashlib
import json
import math
import tempfile
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

from kvq.cache.plan_file import PlanFile, parse_tensor_spec

#: Candidates of ``kvq tune`` by default: K per channel (KIVI) or 8-bit, V per token or 8-bit;
#: the model dtype is always a candidate (free to measure: its loss is 0).
DEFAULT_K = ("fp8_e4m3", "int4_kivi", "int2_kivi")
DEFAULT_V = ("fp8_e4m3", "int4_kivi", "int4_kivi:g64", "int2_kivi", "int2_kivi:g64")
SENSITIVITY_VERSION = 1


@dataclass(frozen=True)
class Space:
    """What a tuning measures and chooses among (everything the sensitivities depend on)."""

    model: str
    candidates_k: tuple[str, ...]
    candidates_v: tuple[str, ...]
    sink_tokens: int
    residual_tokens: int
    block_size: int
    context: int  # tokens per pass (the bin)
    scored: int  # scored positions per pass, at its end
    passages: int
    text_sha256: str = ""  # of the scored token ids

    def key(self) -> str:
        return hashlib.sha256(json.dumps(asdict(self), sort_keys=True).encode()).hexdigest()[:16]


def check_candidates(shape, specs, role: str, block_size: int) -> tuple[str, ...]:
    """The candidate specs of one role, checked against the model and block size (ValueError
    naming the bad one); the model dtype is added, duplicates are refused."""
    out = []
    seen = set()
    for spec in specs:
        t = parse_tensor_spec(spec, role, shape.dtype)
        key = (t.name, t.group_size)
        if key in seen:
            raise ValueError(f"candidate {spec!r} for {role.upper()} is listed twice")
        seen.add(key)
        if t.reference_only:
            raise ValueError(f"candidate {spec!r}: {t.name} has no kernel (reference path only)")
        try:
            t.check_shape(shape.num_kv_heads, shape.head_dim, block_size)
        except ValueError as e:
            raise ValueError(f"candidate {spec!r} for {role.upper()}: {e}") from None
        if t.is_quantized:
            out.append(spec)
    return tuple(out)


def model_entry(shape) -> dict:
    return {"name": shape.name, "num_layers": shape.num_layers, "num_kv_heads": shape.num_kv_heads,
            "head_dim": shape.head_dim}


def single_tensor_plan(shape, space: Space, layer: int, role: str, spec: str) -> PlanFile:
    """Every layer in the model dtype but ``role`` of ``layer``, stored as ``spec``."""
    layers = [("auto", "auto")] * shape.num_layers
    layers[layer] = (spec, "auto") if role == "k" else ("auto", spec)
    return PlanFile(name=f"L{layer}{role}-{spec.replace(':', '-')}", model=model_entry(shape),
                    layers=tuple(layers), sink_tokens=space.sink_tokens, residual_tokens=space.residual_tokens,
                    block_size=space.block_size)


@dataclass
class Sensitivity:
    """Measured losses: ``kl[(layer, role, spec)]`` mean token KL (nats), with its standard error."""

    space: Space
    kl: dict[tuple[int, str, str], float]
    stderr: dict[tuple[int, str, str], float] = field(default_factory=dict)
    meta: dict = field(default_factory=dict)

    def to_json(self) -> dict:
        return {"kvq_sensitivity": SENSITIVITY_VERSION, "space": asdict(self.space),
                "kl": [[i, r, s, v, self.stderr.get((i, r, s))] for (i, r, s), v in sorted(self.kl.items())],
                "meta": self.meta}

    def save(self, path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path) -> Sensitivity:
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"--sensitivity {path}: no such file")
        try:
            obj = json.loads(p.read_text())
            if obj.get("kvq_sensitivity") != SENSITIVITY_VERSION:
                raise ValueError("not a kvq sensitivity file of this version")
            space = Space(**{**obj["space"], "candidates_k": tuple(obj["space"]["candidates_k"]),
                             "candidates_v": tuple(obj["space"]["candidates_v"])})
            kl = {(int(i), r, s): float(v) for i, r, s, v, _ in obj["kl"]}
            err = {(int(i), r, s): float(e) for i, r, s, _, e in obj["kl"] if e is not None}
        except (ValueError, KeyError, TypeError, json.JSONDecodeError) as e:
            raise ValueError(f"--sensitivity {path}: {e}") from None
        return cls(space, kl, err, obj.get("meta") or {})


def merge(parts: list[Sensitivity]) -> Sensitivity:
    """One sensitivity from shards measured apart (``kvq tune --shard``): same space, disjoint keys."""
    first = parts[0]
    kl, err, seconds = {}, {}, 0.0
    for part in parts:
        if part.space != first.space:
            raise ValueError("sensitivity files measured for different settings cannot be merged")
        twice = set(kl) & set(part.kl)
        if twice:
            raise ValueError(f"sensitivity measured twice for {sorted(twice)[0]}")
        kl.update(part.kl)
        err.update(part.stderr)
        seconds += part.meta.get("seconds", 0.0)
    meta = {**first.meta, "seconds": round(seconds, 1), "tensors_measured": len(kl), "shards": len(parts)}
    return Sensitivity(first.space, kl, err, meta)


def all_jobs(space: Space, num_layers: int) -> list[tuple[int, str, str]]:
    """Every (layer, role, spec) a space measures, in a fixed order (shards take every n-th)."""
    return [(i, r, s) for i in range(num_layers) for r, cands in (("k", space.candidates_k),
                                                                 ("v", space.candidates_v)) for s in cands]


def missing(sens: Sensitivity, num_layers: int) -> list[tuple[int, str, str]]:
    return [j for j in all_jobs(sens.space, num_layers) if j not in sens.kl]


def calibration_windows(ids: list[int], space: Space) -> list[list[int]]:
    """``passages`` disjoint windows of ``context + 1`` tokens (the last target included) from the
    end of ``ids`` (so the start of the text stays held out for validation)."""
    need = space.context + 1
    if len(ids) < need * space.passages:
        raise ValueError(f"the text has {len(ids)} tokens; {space.passages} passes of {space.context} need "
                         f"{need * space.passages} (lower --passages or --context, or give a longer --text)")
    start = len(ids) - need * space.passages
    return [ids[start + k * need:start + (k + 1) * need] for k in range(space.passages)]


def measure(space: Space, windows: list[list[int]], *, device: str = "auto", dtype: str = "auto",
            threads: int | None = None, load_format: str = "auto", seed: int = 0, shard: tuple[int, int] = (0, 1),
            progress=None) -> Sensitivity:
    """Measure every (layer, role, candidate) of ``space`` on ``windows`` (module docstring); with
    ``shard=(k, n)`` only every n-th of them from the k-th (:func:`merge` joins the shards)."""
    import torch

    from kvq.cache.plan import KVCacheConfig
    from kvq.calibration.layer_tap import LayerTap
    from kvq.engine.llm_engine import EngineConfig, LLMEngine
    from kvq.eval import metrics
    from kvq.eval.scoring import StreamSpec, score_stream
    from kvq.eval.session import CacheSession
    from kvq.models.source import model_shape

    shape = model_shape(space.model)
    spec = StreamSpec((space.context,), space.scored, chunk=max(space.block_size, 512 // space.block_size *
                                                                space.block_size),
                      score_chunk=space.block_size, greedy_tokens=0)
    spec.check(space.block_size)
    hp_token_bytes = 2 * shape.num_layers * shape.num_kv_heads * shape.head_dim * 4

    def engine(kv: KVCacheConfig):
        return LLMEngine(EngineConfig(
            model=space.model, kv_cache=kv, device=device, dtype=dtype, enforce_eager=True, max_num_seqs=2,
            load_format=load_format, seed=seed,
            max_num_batched_tokens=max(spec.chunk, 64), kv_cache_memory=max(32 << 20, 3 * space.context * hp_token_bytes),  # noqa: E501
            progress=False, threads=threads))

    info = {}
    tap = LayerTap()

    def run(kv: KVCacheConfig, start: int | None = None) -> list:
        """Score the windows; ``start``: from layer ``start`` on, the layers before it as the baseline
        computed them (kvq.calibration.layer_tap), else recording the baseline."""
        eng = engine(kv)
        info.update(device=eng.info["device"], dtype=eng.info["dtype"],
                    attention_backend=eng.info["attention_backend"]["resolved"])
        model = eng.runner.model
        if start is None:
            tap.record()
            model.tap = tap
        elif not tap.dropped:
            tap.resume(start)
            model.tap = tap
        try:
            session = CacheSession(eng)
            out = [score_stream(session, w, spec, space.block_size)[0] for w in windows]
        finally:
            model.tap = None
        if start is not None and not tap.dropped and tap.pending():
            raise RuntimeError(f"a run from layer {start} made fewer forward calls than the baseline")
        eng.block_manager.check_integrity()
        return out

    t0 = time.perf_counter()
    base = run(KVCacheConfig(block_size=space.block_size))
    jobs = all_jobs(space, shape.num_layers)[shard[0]::shard[1]]
    kl, err = {}, {}
    with tempfile.TemporaryDirectory(prefix="kvq-tune-") as tmp:
        for n, (i, r, s) in enumerate(jobs):
            pf = single_tensor_plan(shape, space, i, r, s)
            path = Path(tmp) / f"{pf.name}.json"
            pf.save(path)
            got = run(KVCacheConfig(plan_file=str(path)), start=i)
            per_pos = torch.cat([metrics.kl_per_position(b.logprobs, g.logprobs) for b, g in zip(base, got)])
            kl[(i, r, s)] = float(per_pos.mean())
            err[(i, r, s)] = float(per_pos.std() / math.sqrt(per_pos.numel())) if per_pos.numel() > 1 else 0.0
            if progress:
                progress(n + 1, len(jobs), (i, r, s), kl[(i, r, s)])
    meta = {"seconds": round(time.perf_counter() - t0, 1), **info, "positions": space.scored * len(windows),
            "tensors_measured": len(jobs), "from_own_layer": not tap.dropped}
    return Sensitivity(space, kl, err, meta)
