"""KV connectors (kvq.engine.connector): the CPU prefix tier's copies between the device pools and host
memory (:mod:`~kvq.connectors.cpu_prefix_tier`), request-level swap's copies
(:mod:`~kvq.connectors.swap`), and prefill/decode disaggregation: a decode engine's prefill peer
(:mod:`~kvq.connectors.remote_prefill`) and a prefill engine's export (:mod:`~kvq.connectors.kv_export`)."""
