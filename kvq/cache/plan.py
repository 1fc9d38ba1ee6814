"""The cache plan: per-layer KV formats, windows, block size, and what fits.

A :class:`CachePlan` is built once from a model's shape and the user's choices
and answers every capacity question: bytes per block (summed over layers, K and
V, scales included, all from the format spec), blocks and tokens that fit a
memory budget, and the high-precision overhead of sink tokens and the recent
residual window.  The pools and the engine size themselves from it.

Two kinds of block exist (see :mod:`kvq.cache.block_manager`):

* resident blocks, in each layer's quantized format (``bytes_per_block``);
* high-precision blocks in the model dtype (``hp_bytes_per_block``) for the
  first ``sink_tokens`` tokens and the tail that still overlaps the residual
  window (and, for formats sealed per block, the partly filled last block).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, replace

from kvq.cache.tiers import TierRule, age_tier, parse_ages, parse_policies, parse_tiers
from kvq.cache.window import WindowPolicy, block_state, rule_counts
from kvq.formats.registry import default_window, resolve_kv
from kvq.formats.spec import FP8_MAX, KVFormat
from kvq.cache.shape import ModelShape

DEFAULT_BLOCK_SIZE = 16
SKIP_KEYWORDS = ("sliding_window",)


@dataclass(frozen=True)
class Capacity:
    """What fits in a memory budget."""

    memory_bytes: int
    num_blocks: int  # resident blocks, if the whole budget held resident blocks
    num_tokens: int
    context_len: int  # for the per-sequence figures below
    blocks_per_sequence: int  # resident blocks of one sequence at context_len
    hp_blocks_per_sequence: int  # high-precision blocks of one sequence at context_len
    bytes_per_sequence: int
    sequences: int  # sequences of context_len that fit, windows included
    tokens_at_context: int  # sequences * context_len


@dataclass(frozen=True)
class CachePlan:
    model: ModelShape
    layers: tuple[KVFormat, ...]  # one per model layer
    hp: KVFormat  # the model dtype: sinks, residual window, skipped layers
    block_size: int
    sink_tokens: int
    residual_tokens: int
    skip_layers: tuple[int, ...]
    label: str | None = None  # a plan file's name (``kvq tune``); None: named after its format
    #: elastic precision (kvq.cache.tiers): the formats of tiers 1, 2, ... per layer, and their rule
    tiers: tuple[tuple[KVFormat, ...], ...] = ()
    tier_rule: TierRule | None = None
    #: a tensor parallel rank's arena: the blocks of each tier a slab, shared by every rank (kvq.cache.arena)
    arena_per_slab: tuple[int, ...] = ()

    def __post_init__(self) -> None:
        assert len(self.layers) == self.model.num_layers, (len(self.layers), self.model.num_layers)
        assert all(len(t) == self.model.num_layers for t in self.tiers), "a tier needs one format per layer"
        assert (self.tier_rule is None) == (not self.tiers), "tiers come with their rule"
        assert self.tier_rule is None or self.tier_rule.num_tiers == len(self.tiers)
        m = self.model
        for fmt in (*self.layers, self.hp, *(f for t in self.tiers for f in t)):
            fmt.k.check_shape(m.num_kv_heads, m.head_dim, self.block_size)
            fmt.v.check_shape(m.num_kv_heads, m.head_dim, self.block_size)

    # -- tiers -----------------------------------------------------------------------------
    @property
    def num_tiers(self) -> int:
        """Tiers below the resident format (0 without elastic precision)."""
        return len(self.tiers)

    def tier_layers(self, tier: int) -> tuple[KVFormat, ...]:
        """Each layer's format in ``tier`` (0: the resident formats)."""
        return self.layers if tier == 0 else self.tiers[tier - 1]

    def tier_layer_bytes(self, tier: int, layer: int) -> int:
        """Bytes of one block of ``tier`` in ``layer``, K and V, sidecars included."""
        m = self.model
        return self.tier_layers(tier)[layer].block_bytes(m.num_kv_heads, m.head_dim, self.block_size)

    def tier_bytes_per_block(self, tier: int) -> int:
        """One block of ``tier`` across all layers (tier 0: :attr:`bytes_per_block`)."""
        return sum(self.tier_layer_bytes(tier, i) for i in range(self.model.num_layers))

    def tier_names(self) -> list[str]:
        """The ladder, resident format first: ``['fp8_e4m3', 'int4_kivi']``."""
        def name(fmts):
            stored = [fmts[i] for i in self.stored_layers] or list(fmts)
            return stored[0].name
        return [name(self.tier_layers(t)) for t in range(self.num_tiers + 1)]

    # -- bytes -----------------------------------------------------------------------------
    def layer_block_bytes(self, layer: int) -> int:
        return self.layers[layer].block_bytes(self.model.num_kv_heads, self.model.head_dim, self.block_size)

    @property
    def bytes_per_block(self) -> int:
        """One resident block across all layers, K and V, sidecars included."""
        return sum(self.layer_block_bytes(i) for i in range(self.model.num_layers))

    @property
    def hp_bytes_per_block(self) -> int:
        """One high-precision block across all layers."""
        m = self.model
        return m.num_layers * self.hp.block_bytes(m.num_kv_heads, m.head_dim, self.block_size)

    @property
    def bytes_per_token(self) -> float:
        return self.bytes_per_block / self.block_size

    @property
    def ratio_vs_model_dtype(self) -> float:
        """How many times more resident tokens fit than with the model dtype."""
        return self.hp_bytes_per_block / self.bytes_per_block

    # -- windows ---------------------------------------------------------------------------
    @property
    def is_quantized(self) -> bool:
        return any(f.is_quantized for f in self.layers)

    @property
    def window_policy(self) -> WindowPolicy:
        return WindowPolicy(
            block_size=self.block_size,
            sink_blocks=math.ceil(self.sink_tokens / self.block_size),
            residual_tokens=self.residual_tokens,
            write_direct=all(f.write_direct for f in self.layers),
        )

    def blocks_for(self, num_tokens: int) -> tuple[int, int]:
        """(resident, high-precision) blocks one sequence of ``num_tokens`` holds."""
        return rule_counts(num_tokens, self.window_policy)

    # -- capacity --------------------------------------------------------------------------
    def capacity(self, memory_bytes: int, context_len: int | None = None) -> Capacity:
        if memory_bytes < 1:
            raise ValueError(f"memory budget must be positive, got {memory_bytes}")
        L = context_len or self.model.max_position_embeddings
        if L < 1:
            raise ValueError(f"context length must be >= 1, got {L}")
        num_blocks = memory_bytes // self.bytes_per_block
        q, hp = self.blocks_for(L)
        per_seq = q * self.bytes_per_block + hp * self.hp_bytes_per_block
        if self.tier_rule is not None and self.tier_rule.ages:  # aged blocks sit in the lower tiers' bytes
            pol, bs = self.window_policy, self.block_size
            per_seq = hp * self.hp_bytes_per_block + sum(
                self.tier_bytes_per_block(age_tier(i, L, self.tier_rule))
                for i in range(-(-L // bs)) if block_state(i, L, pol) == "q")
        seqs = memory_bytes // per_seq
        return Capacity(
            memory_bytes=memory_bytes,
            num_blocks=num_blocks,
            num_tokens=num_blocks * self.block_size,
            context_len=L,
            blocks_per_sequence=q,
            hp_blocks_per_sequence=hp,
            bytes_per_sequence=per_seq,
            sequences=seqs,
            tokens_at_context=seqs * L,
        )

    def check_numerics(self, device="cpu") -> None:
        """Start-up check of every FP8 encoding the plan stores (seed 001)."""
        from kvq.formats.fp8 import check_fp8_numerics  # torch: only where tensors are made

        for storage in sorted({t.storage for f in self.layers for t in (f.k, f.v)}):
            if storage in FP8_MAX:
                check_fp8_numerics(storage, device)

    def layer_names(self) -> list[str]:
        """Each layer's format, ``k=...,v=...`` where they differ, a KIVI group other than 32 as ``:gN``."""
        from kvq.cache.plan_file import tensor_spec

        out = []
        for f in self.layers:
            k, v = tensor_spec(f.k), tensor_spec(f.v)
            out.append(k if k == v else f"k={k},v={v}")
        return out

    @property
    def stored_layers(self) -> tuple[int, ...]:
        """Layers stored in the chosen format (all but the skipped ones)."""
        return tuple(i for i in range(len(self.layers)) if i not in self.skip_layers)

    @property
    def name(self) -> str:
        """The plan in one string: its format (``k=...,v=...`` when they differ), with the
        skipped layers, e.g. ``fp8_e4m3 (layers 0,31 in bfloat16)``; a plan file's ``plan:NAME``."""
        if self.label:
            return f"plan:{self.label}{self.tier_suffix()}"
        ref = self.layers[self.stored_layers[0]] if self.stored_layers else self.hp
        base = ref.name
        if self.skip_layers and self.stored_layers:
            which = ",".join(str(i) for i in self.skip_layers)
            base += f" (layer{'s' if len(self.skip_layers) > 1 else ''} {which} in {self.hp.name})"
        return base + self.tier_suffix()

    def tier_suffix(self) -> str:
        """The ladder in a name: ``>int4_kivi@1152`` (age policy), ``>int4_kivi`` (pressure), both:
        ``>int4_kivi>int2_kivi@1152/2304+pressure``; empty without tiers.  A format spec takes the same
        suffix (:meth:`KVCacheConfig.with_spec`)."""
        if not self.tiers:
            return ""
        r = self.tier_rule
        out = "".join(f">{n}" for n in self.tier_names()[1:])
        if r.ages:
            out += "@" + "/".join(map(str, r.ages)) + ("+pressure" if r.pressure else "")
        return out

    def describe(self) -> dict:
        """What every report names: the plan's name, K and V of its stored layers (not of layer
        0, which may be skipped), per-layer formats, windows (the sinks as asked and as kept:
        whole blocks) and block size."""
        ref = self.layers[self.stored_layers[0]] if self.stored_layers else self.hp
        if self.label:  # a plan file: K and V differ from layer to layer
            ks, vs = ({getattr(f, r).name for f in self.layers} for r in ("k", "v"))
            ref = KVFormat(ref.k if len(ks) == 1 else replace(ref.k, name="per-layer"),
                           ref.v if len(vs) == 1 else replace(ref.v, name="per-layer"))
        return {"name": self.name, "k": ref.k.name, "v": ref.v.name, "per_layer": self.layer_names(),
                "skip_layers": list(self.skip_layers), "sink_tokens": self.sink_tokens,
                "sink_tokens_kept": self.window_policy.sink_blocks * self.block_size,  # whole blocks
                "residual_tokens": self.residual_tokens, "block_size": self.block_size,
                **({"tiers": self.tier_names()[1:], "tier_policy": list(self.tier_rule.policies),
                    "tier_ages": list(self.tier_rule.ages)} if self.tiers else {})}


def _skip_set(model: ModelShape, skip_layers) -> tuple[int, ...]:
    out: set[int] = set()
    for item in skip_layers or ():
        s = str(item).strip().lower()
        if s in SKIP_KEYWORDS:
            out.update(model.sliding_window_layers)
            continue
        try:
            idx = int(s)
        except ValueError:
            raise ValueError(
                f"--kv-cache-dtype-skip-layers: {item!r} is neither a layer index (0..{model.num_layers - 1}) "
                f"nor one of {', '.join(SKIP_KEYWORDS)}"
            ) from None
        if not 0 <= idx < model.num_layers:
            raise ValueError(f"--kv-cache-dtype-skip-layers: layer {idx} out of range 0..{model.num_layers - 1}")
        out.add(idx)
    return tuple(sorted(out))


@dataclass(frozen=True)
class KVCacheConfig:
    """The user's KV-cache choices, whole, from the CLI or the API to the plan.

    Field names follow what users type (``--kv-cache-dtype``, ``--kv-cache-dtype-k``...);
    :meth:`plan` resolves them against a model (every bad choice raises ValueError
    naming what is valid).  Nothing downstream of the plan reads this again."""

    dtype: str = "auto"
    k: str | None = None
    v: str | None = None
    skip_layers: tuple = ()
    sink_tokens: int | None = None
    residual_tokens: int | None = None
    group_size: int | None = None
    block_size: int | None = None
    plan_file: str | None = None  # ``--kv-cache-plan``: formats per layer and K/V from a file (kvq tune)
    tiers: tuple[str, ...] = ()  # ``--kv-cache-tiers``: formats below the resident one (kvq.cache.tiers)
    tier_age: tuple[int, ...] = ()  # ``--kv-tier-age``: the age policy's thresholds, one per tier
    tier_policy: tuple[str, ...] = ()  # ``--kv-tier-policy``: age, pressure or both (default from tier_age)

    def __post_init__(self) -> None:
        """Types and ranges, before any model is read (what needs the model: :meth:`plan`)."""
        if self.plan_file is not None:
            self._load_plan_file()
        for name in ("dtype", "k", "v"):
            val = getattr(self, name)
            if not (val is None and name != "dtype") and (not isinstance(val, str) or not val.strip()):
                raise ValueError(f"KV cache format {name!r} must be a format name (see `kvq formats`), got {val!r}")
        skips = self.skip_layers
        skips = (skips,) if isinstance(skips, (str, int)) else tuple(skips or ())
        object.__setattr__(self, "skip_layers", skips)
        for name, flag, low in (("sink_tokens", "--kv-sink-tokens", 0), ("residual_tokens", "--kv-residual-tokens", 0),
                                ("group_size", "--kivi-group-size", 1), ("block_size", "--block-size", 1)):
            val = getattr(self, name)
            if val is not None and (not isinstance(val, int) or isinstance(val, bool) or val < low):
                raise ValueError(f"{flag} must be an int >= {low}, got {val!r}")
        if self.group_size is not None and self.group_size & (self.group_size - 1):
            raise ValueError(f"--kivi-group-size must be a power of two, got {self.group_size}")
        object.__setattr__(self, "tiers", parse_tiers(self.tiers))
        object.__setattr__(self, "tier_age", parse_ages(self.tier_age))
        if self.tiers:
            object.__setattr__(self, "tier_policy", parse_policies(self.tier_policy, bool(self.tier_age)))
        elif self.tier_age or self.tier_policy:
            raise ValueError("--kv-tier-age and --kv-tier-policy need --kv-cache-tiers (the formats blocks move "
                             "down to)")

    def _load_plan_file(self) -> None:
        from kvq.cache.plan_file import PlanFile

        given = [flag for flag, val, default in (
            ("--kv-cache-dtype", self.dtype, "auto"), ("--kv-cache-dtype-k", self.k, None),
            ("--kv-cache-dtype-v", self.v, None), ("--kv-cache-dtype-skip-layers", tuple(self.skip_layers or ()), ()),
            ("--kv-sink-tokens", self.sink_tokens, None), ("--kv-residual-tokens", self.residual_tokens, None),
            ("--kivi-group-size", self.group_size, None)) if val != default]
        if given:
            raise ValueError(f"--kv-cache-plan sets the format of every layer and the windows; drop "
                             f"{', '.join(given)} (or edit the plan file)")
        pf = PlanFile.load(self.plan_file)
        if self.block_size is not None and pf.block_size is not None and self.block_size != pf.block_size:
            raise ValueError(f"--block-size {self.block_size} differs from the plan file's block_size "
                             f"{pf.block_size} ({self.plan_file})")
        object.__setattr__(self, "_plan", pf)

    @property
    def requested(self) -> str:
        """What the user asked for, in one string: the format name, or the plan file."""
        return f"plan:{self.plan_file}" if self.plan_file is not None else self.dtype

    @property
    def plan_spec(self):
        """The loaded :class:`~kvq.cache.plan_file.PlanFile` (None without ``plan_file``)."""
        return getattr(self, "_plan", None)

    def check_options_apply(self) -> None:
        """Raise ValueError for a format option the chosen formats do not use (``--kivi-group-size``
        with a format that has no groups); the CLI and ``LLM`` call it, `kvq eval` (one group size
        for several formats) does not."""
        if self.group_size is None or self.plan_file is not None:
            return
        fmt = resolve_kv(self.dtype, self.k, self.v, group_size=self.group_size)
        if fmt.k.group_size is None and fmt.v.group_size is None:
            from kvq.formats.registry import entries

            grouped = [e.name for e in entries() if resolve_kv(e.name).k.group_size or resolve_kv(e.name).v.group_size]
            raise ValueError(f"--kivi-group-size applies only to formats quantized in groups ({', '.join(grouped)}); "
                             f"{fmt.requested or fmt.k.name} has none")

    def with_spec(self, spec: str) -> KVCacheConfig:
        """This config with a format spec applied: ``name[:rN][:sN][:gN][>TIER...[@AGE[/AGE...]][+pressure]]``,
        the format plus its recent window (r), sink tokens (s) or KIVI group size (g), e.g.
        ``fp8_e4m3:r128:s4`` (how one `kvq eval` run compares a format with and without its windows),
        and elastic precision's tiers with the age policy's thresholds (pressure without ages), e.g.
        ``fp8_e4m3:r128:s4>int4_kivi@1152`` (the suffix of the plan's name)."""
        spec, sep, ladder = str(spec).partition(">")
        tiers = {}
        if sep:
            rest, pressure = (ladder[:-len("+pressure")], True) if ladder.endswith("+pressure") else (ladder, False)
            rungs, _, ages = rest.partition("@")
            try:
                ages = tuple(int(a) for a in ages.split("/")) if ages else ()
            except ValueError:
                raise ValueError(f"format spec {spec + sep + ladder!r}: tier ages are numbers of tokens joined by "
                                 "'/' (e.g. >int4_kivi>int2_kivi@1152/4096)") from None
            tiers = dict(tiers=tuple(rungs.split(">")), tier_age=ages,
                         tier_policy=(("age", "pressure") if pressure else ("age",)) if ages else ("pressure",))
        name, *opts = [x.strip() for x in spec.split(":")]
        if not name:
            raise ValueError(f"format spec {spec!r} has no format name (e.g. fp8_e4m3:r128:s4)")
        fields = {"dtype": name}
        for opt in opts:
            key, num = opt[:1], opt[1:]
            if key not in SPEC_KEYS or not num.isdigit():
                raise ValueError(f"format spec {spec!r}: {opt!r} is not one of " +
                                 ", ".join(f"{k}N ({v})" for k, v in SPEC_KEYS.items()))
            fields[SPEC_KEYS[key]] = int(num)
        return replace(self, **fields, **tiers)

    def plan(self, model: ModelShape) -> CachePlan:
        if self.plan_file is not None:
            return plan_from_file(model, self.plan_spec, block_size=self.block_size, tiers=self.tiers,
                                  tier_age=self.tier_age, tier_policy=self.tier_policy)
        return make_plan(model, self.dtype, k=self.k, v=self.v, block_size=self.block_size,
                         skip_layers=self.skip_layers, sink_tokens=self.sink_tokens,
                         residual_tokens=self.residual_tokens, group_size=self.group_size, tiers=self.tiers,
                         tier_age=self.tier_age, tier_policy=self.tier_policy)


#: Option letters of a format spec (:meth:`KVCacheConfig.with_spec`) -> the field they set.
SPEC_KEYS = {"r": "residual_tokens", "s": "sink_tokens", "g": "group_size"}


def make_plan(
    model: ModelShape,
    kv_cache_dtype: str = "auto",
    *,
    k: str | None = None,
    v: str | None = None,
    block_size: int | None = None,
    skip_layers=(),
    sink_tokens: int | None = None,
    residual_tokens: int | None = None,
    group_size: int | None = None,
    tiers=(),
    tier_age=(),
    tier_policy=(),
) -> CachePlan:
    """Build a plan; every bad choice raises ValueError naming what is valid."""
    fmt = resolve_kv(kv_cache_dtype, k, v, model_dtype=model.dtype, group_size=group_size)
    hp = resolve_kv(model.dtype, model_dtype=model.dtype)
    skips = _skip_set(model, skip_layers)
    layers = tuple(hp if i in skips else fmt for i in range(model.num_layers))
    ladder = _tier_formats(model, parse_tiers(tiers), layers, hp, group_size)
    min_bs = math.lcm(*(f.min_block_size() for f in (*layers, *(f for t in ladder for f in t))))
    if block_size is None:
        block_size = math.lcm(DEFAULT_BLOCK_SIZE, min_bs)
    elif block_size < 1 or block_size % min_bs:
        raise ValueError(
            f"block size {block_size} does not fit {fmt.name}: it must be a positive multiple of {min_bs} "
            f"(KIVI K is quantized over whole groups of tokens inside one block)"
        )
    # Windows not given: the resident format's own in high precision, and the ladder's widest (fp8_e4m3 over
    # int4_kivi: KIVI's 4 sinks and 128 recent tokens) kept out of the lower tiers, i.e. in the resident
    # format.  High-precision windows for the whole ladder cost an fp8_e4m3 cache with an int4_kivi tier
    # 11.5 of its 52.7 GB at 384 requests on an H100 (docs/engine.md), more than fp8_e4m3 alone before a
    # single block moved down.  Given windows are both.
    keep_sink, keep_res = (max(w) for w in zip(*(default_window(f) for f in (fmt, *(t[0] for t in ladder)))))
    if sink_tokens is None:
        sink_tokens = default_window(fmt)[0]
    else:
        sink_tokens = keep_sink = int(sink_tokens)
    if residual_tokens is None:
        residual_tokens = default_window(fmt)[1]
    else:
        residual_tokens = keep_res = int(residual_tokens)
    if sink_tokens < 0 or residual_tokens < 0:
        raise ValueError(f"sink and residual tokens must be >= 0 (got {sink_tokens}, {residual_tokens})")
    rule = _tier_rule(ladder, block_size, keep_sink, keep_res, parse_ages(tier_age),
                      parse_policies(tier_policy, bool(tier_age)) if ladder else ())
    if not any(f.is_quantized for f in layers):
        sink_tokens = residual_tokens = 0  # everything is already high precision (a tier's windows: its rule)
    return CachePlan(model, layers, hp, block_size, sink_tokens, residual_tokens, skips, tiers=ladder, tier_rule=rule)


def _tier_formats(model: ModelShape, names: tuple[str, ...], layers: tuple[KVFormat, ...], hp: KVFormat,
                  group_size: int | None) -> tuple[tuple[KVFormat, ...], ...]:
    """Each tier's format per layer (layers kept in the model dtype stay so in every tier); raises
    ValueError unless every rung takes fewer bytes a block than the one above it."""
    if not names:
        return ()
    H, D = model.num_kv_heads, model.head_dim
    stored = [i for i, f in enumerate(layers) if (f.k, f.v) != (hp.k, hp.v)] or range(len(layers))
    ladder, above = [], layers
    for name in names:
        try:
            fmt = resolve_kv(name, model_dtype=model.dtype, group_size=group_size)
        except ValueError as e:
            raise ValueError(f"--kv-cache-tiers: {e}") from None
        tier = tuple(fmt if i in stored else layers[i] for i in range(len(layers)))
        # a block size that lays out every format: bytes compared at the least common one
        bs = math.lcm(DEFAULT_BLOCK_SIZE, *(f.min_block_size() for f in (*above, *tier)))
        new, old = (sum(t[i].block_bytes(H, D, bs) for i in stored) for t in (tier, above))
        if new >= old:
            raise ValueError(f"--kv-cache-tiers: {fmt.name} takes {new} bytes a block of {bs} tokens, not fewer than "
                             f"{above[stored[0]].name} above it ({old}); a tier must be smaller than the one above")
        ladder.append(tier)
        above = tier
    return tuple(ladder)


def _tier_rule(ladder, block_size: int, sink_tokens: int, residual_tokens: int, ages: tuple[int, ...],
               policies: tuple[str, ...]) -> TierRule | None:
    if not ladder:
        return None
    if ages and len(ages) == 1 and len(ladder) > 1:
        ages = tuple(ages[0] * (t + 1) for t in range(len(ladder)))  # one age for all: tier t at t x age
    if ages and ages[0] < residual_tokens:
        raise ValueError(f"--kv-tier-age {ages[0]} lies inside the recent window ({residual_tokens} tokens kept in "
                         f"high precision): give an age >= {residual_tokens}")
    return TierRule(len(ladder), block_size, math.ceil(sink_tokens / block_size), residual_tokens,
                    ages=ages if "age" in policies else (), pressure="pressure" in policies)


def plan_from_file(model: ModelShape, pf, block_size: int | None = None, tiers=(), tier_age=(),
                   tier_policy=()) -> CachePlan:
    """The plan a :class:`~kvq.cache.plan_file.PlanFile` describes, for ``model`` (ValueError when
    it was made for another geometry, or its formats cannot lay out the block size)."""
    pf.check_model(model)
    layers = pf.formats(model.dtype)
    hp = resolve_kv(model.dtype, model_dtype=model.dtype)
    ladder = _tier_formats(model, parse_tiers(tiers), layers, hp, None)
    block_size = block_size or pf.block_size
    min_bs = math.lcm(*(f.min_block_size() for f in (*layers, *(f for t in ladder for f in t))))
    if block_size is None:
        block_size = math.lcm(DEFAULT_BLOCK_SIZE, min_bs)
    elif block_size % min_bs:
        raise ValueError(f"{pf.path or 'plan'}: block size {block_size} must be a multiple of {min_bs} "
                         f"(KIVI K is quantized over whole groups of tokens inside one block)")
    quantized = any(f.is_quantized for f in layers)
    rule = _tier_rule(ladder, block_size, pf.sink_tokens, pf.residual_tokens, parse_ages(tier_age),
                      parse_policies(tier_policy, bool(tier_age)) if ladder else ())
    sink, resid = (pf.sink_tokens, pf.residual_tokens) if quantized else (0, 0)
    skips = tuple(i for i, f in enumerate(layers) if (f.k, f.v) == (hp.k, hp.v))
    return CachePlan(model, layers, hp, block_size, sink, resid, skips, label=pf.name, tiers=ladder, tier_rule=rule)


def bare_model(num_layers: int, num_kv_heads: int, head_dim: int, *, num_attention_heads: int | None = None,
               max_position_embeddings: int = 8192, dtype: str = "bfloat16") -> ModelShape:
    """A model shape from numbers alone, to plan for models not on disk."""
    return ModelShape(
        name=f"{num_layers}x{num_kv_heads}x{head_dim}",
        num_layers=num_layers,
        num_kv_heads=num_kv_heads,
        head_dim=head_dim,
        num_attention_heads=num_attention_heads or num_kv_heads,
        max_position_embeddings=max_position_embeddings,
        dtype=dtype,
    )
