"""Elastic precision: the ladder of formats a layer's sealed blocks move down.

Tier 0 is the plan's resident format (the ``q`` pool); tiers 1, 2, ... are the formats of
``--kv-cache-tiers``, each stored in fewer bytes than the one above it, all out of one byte
arena (:mod:`kvq.cache.arena`).  A sealed block moves down one tier at a time, by two
policies that combine:

* ``age``: a block whose end lies at least ``ages[t - 1]`` tokens behind its sequence's head
  belongs in tier ``t`` or below (:func:`age_tier`; vLLM feature request #49198's policy);
* ``pressure``: when the scheduler would preempt or cannot admit, the coldest sealed blocks
  of running sequences move down until the step fits; preemption only when no block can.

Neither ever touches a protected block: the sinks and the blocks that still overlap the
recent window (:func:`protected`) stay where the window rule puts them.  With a quantized
resident format those are the high-precision blocks already; with a 16-bit resident format
(``bf16`` with an ``fp8_e4m3`` tier) the windows are the tiers' own.

Host only: no tensors (the scheduler and the block manager count with it).
"""

from __future__ import annotations

from dataclasses import dataclass

#: ``--kv-tier-policy`` values (several may be combined: ``age,pressure``).
TIER_POLICIES = ("age", "pressure")


def tier_pool(tier: int) -> str:
    """The block manager's pool name of ``tier``: ``q`` (the resident format), ``q1``, ``q2``..."""
    if not isinstance(tier, int) or tier < 0:
        raise ValueError(f"a tier is an int >= 0, got {tier!r}")
    return "q" if tier == 0 else f"q{tier}"


def pool_tier(pool: str) -> int | None:
    """The tier of a q pool name (:func:`tier_pool`), None for ``hp``."""
    if pool == "hp":
        return None
    if pool == "q":
        return 0
    if pool.startswith("q") and pool[1:].isdigit() and int(pool[1:]) >= 1:
        return int(pool[1:])
    raise ValueError(f"unknown pool {pool!r}; valid: hp, q, q1, q2, ...")


@dataclass(frozen=True)
class TierRule:
    """Which tier a sealed block belongs in, and which blocks never move (module docstring)."""

    num_tiers: int  # tiers below the resident one (>= 1)
    block_size: int
    sink_blocks: int = 0
    residual_tokens: int = 0
    ages: tuple[int, ...] = ()  # age policy: one threshold per tier, strictly increasing; () without it
    pressure: bool = False

    def __post_init__(self) -> None:
        for name, lo in (("num_tiers", 1), ("block_size", 1), ("sink_blocks", 0), ("residual_tokens", 0)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < lo:
                raise ValueError(f"TierRule.{name} must be an int >= {lo}, got {v!r}")
        if self.ages and len(self.ages) != self.num_tiers:
            raise ValueError(f"the age policy needs one age per tier ({self.num_tiers}), got {list(self.ages)}")
        if any(b <= a for a, b in zip(self.ages, self.ages[1:])) or any(a < 1 for a in self.ages):
            raise ValueError(f"--kv-tier-age: ages must be >= 1 and strictly increasing, got {list(self.ages)}")
        if not self.ages and not self.pressure:
            raise ValueError("a tier rule needs the age policy, the pressure policy or both")

    @property
    def policies(self) -> tuple[str, ...]:
        return tuple(p for p, on in (("age", bool(self.ages)), ("pressure", self.pressure)) if on)

    @property
    def pools(self) -> tuple[str, ...]:
        """The q pools of every tier, resident first."""
        return tuple(tier_pool(t) for t in range(self.num_tiers + 1))


def protected(i: int, n: int, rule: TierRule) -> bool:
    """Whether logical block ``i`` of a sequence of ``n`` cached tokens must keep its tier: a sink
    block, one that overlaps the last ``residual_tokens`` tokens, or one not yet full."""
    return i < rule.sink_blocks or (i + 1) * rule.block_size > n - rule.residual_tokens


def age_tier(i: int, n: int, rule: TierRule) -> int:
    """Tier of logical block ``i`` at length ``n`` under the age policy (0 without it): the
    number of ages its end lies at least that far behind the head.  Monotone in ``n``."""
    if not rule.ages or protected(i, n, rule):
        return 0
    end = (i + 1) * rule.block_size
    return sum(1 for a in rule.ages if end <= n - a)


def parse_tiers(value) -> tuple[str, ...]:
    """``--kv-cache-tiers``: format names, comma-separated or a sequence; () for none."""
    if value is None:
        return ()
    items = value.split(",") if isinstance(value, str) else list(value)
    out = tuple(str(x).strip() for x in items)
    if any(not x for x in out):
        raise ValueError(f"--kv-cache-tiers: an empty format name in {value!r} (e.g. int4_kivi,int2_kivi)")
    return out


def parse_ages(value) -> tuple[int, ...]:
    """``--kv-tier-age``: tokens behind the head, one per tier, comma-separated or a sequence."""
    if value is None:
        return ()
    items = str(value).split(",") if isinstance(value, (str, int)) else list(value)
    out = []
    for x in items:
        s = str(x).strip()
        if not s.isdigit() or int(s) < 1:
            raise ValueError(f"--kv-tier-age: {x!r} is not a positive number of tokens (e.g. 1152 or 1152,4096)")
        out.append(int(s))
    return tuple(out)


def parse_policies(value, have_ages: bool) -> tuple[str, ...]:
    """``--kv-tier-policy``: a subset of :data:`TIER_POLICIES`, comma-separated; default ``age`` when
    ages are given, else ``pressure``."""
    if value is None or value == () or value == "":
        return ("age",) if have_ages else ("pressure",)
    items = value.split(",") if isinstance(value, str) else list(value)
    out = tuple(dict.fromkeys(str(x).strip() for x in items))
    bad = [x for x in out if x not in TIER_POLICIES]
    if bad:
        raise ValueError(f"--kv-tier-policy: unknown policy {bad[0]!r}; valid: {', '.join(TIER_POLICIES)} "
                         "(or both, comma-separated)")
    if "age" in out and not have_ages:
        raise ValueError("--kv-tier-policy age needs --kv-tier-age (tokens behind the head, one per tier)")
    if "age" not in out and have_ages:
        raise ValueError("--kv-tier-age is given but --kv-tier-policy leaves out 'age'")
    return out
