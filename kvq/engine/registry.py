"""Names of the executors and KV connectors implemented above the engine floor (no imports: the
package's entry point registers them when kvq is imported, and the engine imports one only when a
config asks for it)."""

from __future__ import annotations

#: executor name -> "module:Class" (see kvq.engine.executor.make_executor)
EXECUTORS: dict[str, str] = {}


def register_executor(name: str, target: str) -> None:
    """Make the executor class ``target`` ("package.module:Class") available as ``name``."""
    EXECUTORS[name] = target


#: KV connector name -> "module:Class" (see kvq.engine.connector.make_connector)
CONNECTORS: dict[str, str] = {}


def register_connector(name: str, target: str) -> None:
    """Make the KV connector class ``target`` ("package.module:Class") available as ``name``."""
    CONNECTORS[name] = target
