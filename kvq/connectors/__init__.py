"""KV connectors (kvq.engine.connector): the CPU prefix tier's copies between the device pools and host
memory (:mod:`~kvq.connectors.cpu_prefix_tier`)."""
