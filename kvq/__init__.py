"""kvq: an LLM inference engine core with a quantized, paged KV cache.

``from kvq import LLM, SamplingParams`` gives the engine API; importing it is
lazy so that ``kvq formats`` / ``kvq plan`` stay light.
"""

from kvq.engine.registry import register_connector, register_executor

__all__ = ["LLM", "SamplingParams"]

# executors above the engine floor, imported only when a config asks for one (kvq.engine.executor)
register_executor("tensor_parallel", "kvq.parallel.executor:TensorParallelExecutor")
# KV connectors above the engine floor, built when a config asks for one (kvq.engine.connector)
register_connector("cpu_prefix_tier", "kvq.connectors.cpu_prefix_tier:CPUPrefixTierConnector")
register_connector("remote_prefill", "kvq.connectors.remote_prefill:RemotePrefillConnector")
register_connector("kv_export", "kvq.connectors.kv_export:KVExportConnector")
register_connector("swap", "kvq.connectors.swap:SwapConnector")


def __getattr__(name):
    if name == "LLM":
        from kvq.engine.llm import LLM

        return LLM
    if name == "SamplingParams":
        from kvq.engine.sampling_params import SamplingParams

        return SamplingParams
    raise AttributeError(name)
