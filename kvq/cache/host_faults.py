"""Opt-in fault injection for the host pool's copies, for soak and chaos tests (benchmarks/soak.py).

Off unless the environment of the process that builds the host pool sets ``KVQ_FAULT_HOST_COPY``;
nothing in kvq sets it.  Its value is ``store=P,load=P[,seed=S]``: each
:meth:`HostKVPool.store <kvq.cache.host_pool.HostKVPool.store>` (device to host) or ``load`` (host
to device) call raises :class:`InjectedCopyFault` with probability P before it copies anything --
what a failed copy looks like to its caller.  The CPU prefix tier's connector turns such a failure
into a recompute (kvq/connectors/cpu_prefix_tier.py), and so does swap's (a failed swap copy's
sequence is recomputed: kvq/connectors/swap.py, Scheduler.swap_failed).  Draws are seeded (``seed``,
default 0), so a run is repeatable.
"""

from __future__ import annotations

import logging
import os
import random
from dataclasses import dataclass, field

log = logging.getLogger(__name__)

FAULT_ENV = "KVQ_FAULT_HOST_COPY"
KINDS = ("store", "load")


class InjectedCopyFault(RuntimeError):
    """A host copy failed on purpose (``KVQ_FAULT_HOST_COPY``)."""


@dataclass
class CopyFaults:
    """Probability of failing each kind of copy; counts what it failed."""

    rates: dict[str, float]
    seed: int = 0
    injected: dict[str, int] = field(default_factory=lambda: dict.fromkeys(KINDS, 0))

    def __post_init__(self) -> None:
        self._rng = random.Random(self.seed)

    @classmethod
    def parse(cls, text: str) -> CopyFaults:
        """``store=P,load=P[,seed=S]`` (either rate may be left out: 0) -> CopyFaults; ValueError naming
        the variable and the part that is wrong."""
        rates, seed = dict.fromkeys(KINDS, 0.0), 0
        for part in filter(None, (p.strip() for p in text.split(","))):
            key, sep, value = part.partition("=")
            key = key.strip()
            try:
                if not sep or key not in (*KINDS, "seed"):
                    raise ValueError
                if key == "seed":
                    seed = int(value)
                else:
                    rates[key] = float(value)
                    if not 0.0 <= rates[key] <= 1.0:
                        raise ValueError
            except ValueError:
                raise ValueError(f"{FAULT_ENV}={text!r}: {part!r} is not one of store=P, load=P (P in [0, 1]) "
                                 f"or seed=N") from None
        return cls(rates, seed)

    @classmethod
    def from_env(cls) -> CopyFaults | None:
        text = os.environ.get(FAULT_ENV, "").strip()
        if not text:
            return None
        faults = cls.parse(text)
        log.warning("%s=%s: host KV copies fail on purpose (store %.0f%%, load %.0f%%)", FAULT_ENV, text,
                    100 * faults.rates["store"], 100 * faults.rates["load"])
        return faults

    def maybe_fail(self, kind: str) -> None:
        """Raise :class:`InjectedCopyFault` with the probability set for ``kind`` ("store" or "load")."""
        if self._rng.random() < self.rates[kind]:
            self.injected[kind] += 1
            direction = "device-to-host" if kind == "store" else "host-to-device"
            raise InjectedCopyFault(f"injected fault ({FAULT_ENV}): the {direction} copy failed")
