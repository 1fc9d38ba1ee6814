"""Plan files: a KV cache layout chosen per layer and per K/V, on disk.

``kvq tune`` writes one; ``--kv-cache-plan PLAN.json`` (``kvq generate``, ``serve``,
``eval``, ``plan``, ``LLM(kv_cache_plan=...)``) loads it.  The file names a format
*spec* for the K and the V of every layer (``int4_kivi``, ``int2_kivi:g64`` for a
KIVI group other than 32), the windows every layer shares (sink tokens and the
recent window, kept in the model dtype) and optionally a block size; the rest
(``meta``: how it was chosen, predicted loss, budget) is for people.  Once loaded
it is a :class:`~kvq.cache.plan.CachePlan` like any other: nothing downstream
knows it was tuned.

Example::

    {"kvq_plan": 1, "name": "tuned-5.0b",
     "model": {"name": "SmolLM2-135M-Instruct", "num_layers": 30, "num_kv_heads": 3, "head_dim": 64},
     "sink_tokens": 4, "residual_tokens": 128, "block_size": null,
     "layers": [{"k": "int4_kivi", "v": "int2_kivi:g64"}, ...],
     "meta": {...}}
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass, field
from pathlib import Path

from kvq.formats.registry import KIVI_GROUP_SIZE, lookup, resolve_format
from kvq.formats.spec import KVFormat, TensorFormat

PLAN_VERSION = 1
_KEYS = ("kvq_plan", "name", "model", "sink_tokens", "residual_tokens", "layers")
_OPTIONAL = ("block_size", "meta")
_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_.+-]{0,63}$")


def tensor_spec(t: TensorFormat) -> str:
    """The spec that names one of K or V in a plan file: the format, with ``:gN`` when its
    KIVI group is not the default."""
    if t.group_size and t.group_size != KIVI_GROUP_SIZE:
        return f"{t.name}:g{t.group_size}"
    return t.name


def parse_tensor_spec(spec: str, role: str, model_dtype: str) -> TensorFormat:
    """``name[:gN]`` -> the :class:`TensorFormat` of K (``role="k"``) or V; ValueError naming
    what is valid."""
    if not isinstance(spec, str) or not spec.strip():
        raise ValueError(f"a {role.upper()} format must be a format name such as int4_kivi, got {spec!r}")
    name, *opts = [x.strip() for x in spec.split(":")]
    group = None
    for opt in opts:
        if not (opt[:1] == "g" and opt[1:].isdigit()):
            raise ValueError(f"format spec {spec!r}: {opt!r} is not gN (a KIVI group size)")
        group = int(opt[1:])
    t = resolve_format(name, role, model_dtype=model_dtype, group_size=group)
    if group is not None and t.group_size is None:
        raise ValueError(f"format spec {spec!r}: {lookup(name).name} has no groups")
    return t


def layer_spec(fmt: KVFormat) -> dict[str, str]:
    return {"k": tensor_spec(fmt.k), "v": tensor_spec(fmt.v)}


@dataclass(frozen=True)
class PlanFile:
    """A plan file's contents, checked (see the module docstring)."""

    name: str
    model: dict  # name, num_layers, num_kv_heads, head_dim (+ config_hash when known)
    layers: tuple[tuple[str, str], ...]  # (K spec, V spec) per layer
    sink_tokens: int
    residual_tokens: int
    block_size: int | None = None
    meta: dict = field(default_factory=dict, compare=False)
    path: str | None = field(default=None, compare=False)

    def __post_init__(self) -> None:
        where = self.path or "plan"
        if not isinstance(self.name, str) or not _NAME.match(self.name):
            raise ValueError(f"{where}: name {self.name!r} must be 1-64 letters, digits or _.+- "
                             "(it names the plan in reports and file names)")
        if not self.layers:
            raise ValueError(f"{where}: no layers")
        for key in ("sink_tokens", "residual_tokens"):
            val = getattr(self, key)
            if not isinstance(val, int) or isinstance(val, bool) or val < 0:
                raise ValueError(f"{where}: {key} must be an int >= 0, got {val!r}")
        b = self.block_size
        if b is not None and (not isinstance(b, int) or isinstance(b, bool) or b < 1):
            raise ValueError(f"{where}: block_size must be an int >= 1 or null, got {b!r}")
        for key in ("num_layers", "num_kv_heads", "head_dim"):
            if not isinstance(self.model.get(key), int):
                raise ValueError(f"{where}: model.{key} must be an int, got {self.model.get(key)!r}")
        if self.model["num_layers"] != len(self.layers):
            raise ValueError(f"{where}: model.num_layers is {self.model['num_layers']} but {len(self.layers)} "
                             "layers are listed")
        for i, (k, v) in enumerate(self.layers):
            for role, spec in (("k", k), ("v", v)):
                try:
                    parse_tensor_spec(spec, role, "bfloat16")
                except ValueError as e:
                    raise ValueError(f"{where}: layer {i} {role.upper()}: {e}") from None

    # -- the formats ------------------------------------------------------------------------
    def formats(self, model_dtype: str) -> tuple[KVFormat, ...]:
        return tuple(KVFormat(parse_tensor_spec(k, "k", model_dtype), parse_tensor_spec(v, "v", model_dtype),
                              requested=f"k={k},v={v}" if k != v else k)
                     for k, v in self.layers)

    def check_model(self, shape) -> None:
        """ValueError unless the plan was made for a model of ``shape``'s KV geometry."""
        got = {"num_layers": shape.num_layers, "num_kv_heads": shape.num_kv_heads, "head_dim": shape.head_dim}
        want = {k: self.model[k] for k in got}
        if got != want:
            diff = ", ".join(f"{k} {want[k]} (model has {got[k]})" for k in got if got[k] != want[k])
            raise ValueError(f"{self.path or 'plan'} was made for {self.model.get('name', 'another model')}: {diff}")

    # -- files ------------------------------------------------------------------------------
    def to_json(self) -> dict:
        return {"kvq_plan": PLAN_VERSION, "name": self.name, "model": self.model,
                "sink_tokens": self.sink_tokens, "residual_tokens": self.residual_tokens,
                "block_size": self.block_size, "layers": [{"k": k, "v": v} for k, v in self.layers],
                "meta": self.meta}

    def save(self, path: str | Path) -> None:
        Path(path).write_text(json.dumps(self.to_json(), indent=1) + "\n")

    @classmethod
    def load(cls, path: str | Path) -> PlanFile:
        """Read and check a plan file; ValueError naming the file and what is wrong."""
        p = Path(path)
        if not p.is_file():
            raise ValueError(f"--kv-cache-plan {path}: no such file")
        try:
            obj = json.loads(p.read_text(encoding="utf-8"))
        except (UnicodeDecodeError, json.JSONDecodeError) as e:
            raise ValueError(f"--kv-cache-plan {path}: not a JSON plan file ({e})") from None
        if not isinstance(obj, dict) or "kvq_plan" not in obj:
            raise ValueError(f"--kv-cache-plan {path}: not a kvq plan file (no \"kvq_plan\" key; "
                             "`kvq tune --out` writes them)")
        if obj["kvq_plan"] != PLAN_VERSION:
            raise ValueError(f"{path}: plan file version {obj['kvq_plan']!r}; this kvq reads version {PLAN_VERSION}")
        missing = [k for k in _KEYS if k not in obj]
        extra = [k for k in obj if k not in _KEYS + _OPTIONAL]
        if missing or extra:
            raise ValueError(f"{path}: " + "; ".join(
                ([f"missing {', '.join(missing)}"] if missing else []) + ([f"unknown {', '.join(extra)}"] if extra else [])))  # noqa: E501
        if not isinstance(obj["model"], dict):
            raise ValueError(f"{path}: model must be an object with num_layers, num_kv_heads, head_dim")
        layers = obj["layers"]
        if not isinstance(layers, list) or not all(isinstance(x, dict) and set(x) == {"k", "v"} for x in layers):
            raise ValueError(f"{path}: layers must be a list of {{\"k\": spec, \"v\": spec}} objects")
        return cls(name=obj["name"], model=obj["model"], layers=tuple((x["k"], x["v"]) for x in layers),
                   sink_tokens=obj["sink_tokens"], residual_tokens=obj["residual_tokens"],
                   block_size=obj.get("block_size"), meta=obj.get("meta") or {}, path=str(path))
