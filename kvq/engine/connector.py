"""KV connectors: the seam between the engine's KV cache and storage or peers outside the device.

A connector has two sides, as vLLM v1's ``KVConnectorBase_V1``:

* the scheduler side decides what to load or send and when -- for the CPU prefix tier the block
  manager (``kvq.cache.block_loads``) and the scheduler (``kvq.engine.scheduler_loads``) hand out
  the copies as each step's ``host_ops``;
* the worker side (a :class:`KVConnector`) issues those copies on its own stream after the step's
  forward is enqueued, polls their ends without a host sync and reports each to the scheduler.

The engine calls a connector at three points of its loop and knows nothing else of it:
:meth:`KVConnector.poll` before it schedules, :meth:`KVConnector.issue` after each forward (and with
the blocks of finished requests), and :meth:`KVConnector.stats` for the server's metrics.
Implementations live above the engine floor and are registered by name
(:mod:`kvq.engine.registry`); the engine builds the ones its config asks for.
"""

from __future__ import annotations

import importlib

from kvq.engine.registry import CONNECTORS


class KVConnector:
    """The worker side of a connector (module docstring)."""

    def issue(self, ops) -> None:
        """Start copies the scheduler decided (this step's, or a finished request's)."""
        raise NotImplementedError

    def poll(self, wait: bool = False) -> int:
        """Report copies that have ended to the scheduler (all of them, waiting, with ``wait``);
        -> how many are still in flight."""
        raise NotImplementedError

    def stats(self) -> dict:
        """Counters for the server's metrics."""
        return {}


def make_connector(name: str, **kwargs) -> KVConnector:
    """The connector registered as ``name`` (kvq/__init__.py registers kvq's), built with ``kwargs``."""
    target = CONNECTORS.get(name)
    if target is None:
        raise RuntimeError(f"no KV connector {name!r} is registered; registered: {', '.join(CONNECTORS) or 'none'}")
    module, _, cls = target.partition(":")
    return getattr(importlib.import_module(module), cls)(**kwargs)
