"""Prometheus metrics of one server, in its own ``CollectorRegistry``.

Events (counters, histograms) are recorded where they happen: request
outcomes by the HTTP front end, token timings and finish reasons by the engine
thread (:class:`EngineEvents`).  State (queue lengths, KV blocks, the KV format)
is read at scrape time from the engine thread's latest snapshot
(:class:`EngineStateCollector`), so a scrape never touches the engine.

Names follow seed 002 where it has one (``swapped_requests``,
``inter_token_seconds``) and vLLM's otherwise, under the ``kvq_`` prefix;
docs/server.md lists them all.
"""

from __future__ import annotations

from prometheus_client import CollectorRegistry, Counter, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily, InfoMetricFamily

from kvq.connectors.remote_prefill import FAILURE_REASONS as KV_FAILURE_REASONS

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5, 10.0,
                20.0, 40.0, 80.0, 160.0, 640.0)
TOKEN_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 10.0,
                 20.0, 80.0)
E2E_BUCKETS = (0.1, 0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 60.0, 120.0, 240.0, 480.0,
               960.0, 1920.0)

# HTTP generation requests by how they ended (kvq_requests_total{outcome})
OUTCOMES = ("success", "abort", "invalid", "overloaded", "unavailable", "error")
# engine sequences by finish reason (kvq_request_finished_total{finished_reason})
FINISH_REASONS = ("stop", "length", "abort", "error")


class EngineEvents:
    """Token timings and finish reasons, recorded on the engine thread (prometheus_client is thread-safe).

    ``registry=None`` records nothing (an engine without a server).
    """

    def __init__(self, registry: CollectorRegistry | None):
        self.enabled = registry is not None
        if not self.enabled:
            return
        r = registry
        self.ttft = Histogram("kvq_time_to_first_token_seconds", "Time to first token, from arrival at the engine",
                              buckets=TTFT_BUCKETS, registry=r)
        self.tpot = Histogram("kvq_time_per_output_token_seconds", "Mean time per output token after the first, "
                              "per finished request", buckets=TOKEN_BUCKETS, registry=r)
        self.itl = Histogram("kvq_inter_token_seconds", "Gap between consecutive output tokens of a request",
                             buckets=TOKEN_BUCKETS, registry=r)
        self.e2e = Histogram("kvq_e2e_request_latency_seconds", "Arrival at the engine to the last token",
                             buckets=E2E_BUCKETS, registry=r)
        self.prompt_tokens = Counter("kvq_prompt_tokens", "Prompt tokens of requests that produced a token",
                                     registry=r)
        self.generation_tokens = Counter("kvq_generation_tokens", "Output tokens generated", registry=r)
        self.preemptions = Counter("kvq_num_preemptions", "Preemptions (by recompute) of running requests",
                                   registry=r)
        self.finish = Counter("kvq_request_finished", "Engine sequences that ended, by finish reason",
                              ["finished_reason"], registry=r)
        for reason in FINISH_REASONS:
            self.finish.labels(reason)

    def observe(self, out, seen: dict) -> None:
        """One RequestOutput; ``seen`` holds what earlier outputs of the request already counted."""
        if not self.enabled:
            return
        n, m = len(out.outputs[0].token_ids), out.metrics
        if n > seen["tokens"]:
            if seen["tokens"] == 0:
                self.prompt_tokens.inc(len(out.prompt_token_ids))
                if m.get("ttft") is not None:
                    self.ttft.observe(m["ttft"])
            self.generation_tokens.inc(n - seen["tokens"])
            seen["tokens"] = n
        itl = m.get("itl") or []
        for gap in itl[seen["itl"]:]:
            self.itl.observe(gap)
        seen["itl"] = len(itl)
        pre = m.get("num_preemptions", 0)
        if pre > seen["preemptions"]:
            self.preemptions.inc(pre - seen["preemptions"])
            seen["preemptions"] = pre
        if out.finished and m.get("tpot") is not None:
            self.tpot.observe(m["tpot"])

    def finished(self, reason: str, e2e: float | None = None) -> None:
        if not self.enabled:
            return
        self.finish.labels(reason if reason in FINISH_REASONS else "stop").inc()
        if e2e is not None:
            self.e2e.observe(e2e)


SWAPPED_DOC = "Requests whose KV is parked in the host tier (--preemption-mode swap)"

# (name, key of LLMEngine.host_offload_stats(), help) of the CPU prefix cache's counters
TIER_COUNTERS = (
    ("kvq_kv_cpu_offload_blocks", "stored_blocks", "KV blocks stored to the CPU prefix cache"),
    ("kvq_kv_cpu_offload_bytes", "stored_bytes", "Bytes stored to the CPU prefix cache (scales included)"),
    ("kvq_kv_cpu_offload_failed", "store_failed", "Stores to the CPU prefix cache that failed"),
    ("kvq_kv_cpu_offload_rejected", "tier_rejected", "Blocks not stored: every host block was being "
                                                      "stored or loaded"),
    ("kvq_kv_cpu_offload_evicted", "tier_evictions", "Host blocks evicted (least recently used) for new ones"),
    ("kvq_kv_cpu_offload_replaced", "tier_replaced", "Host blocks replaced by the same block from another tier "
                                                     "(elastic precision: demoted since it was stored)"),
    ("kvq_kv_cpu_reload_blocks", "reloaded_blocks", "KV blocks loaded back from the CPU prefix cache"),
    ("kvq_kv_cpu_reload_bytes", "reloaded_bytes", "Bytes loaded back from the CPU prefix cache"),
    ("kvq_kv_cpu_reload_failed", "load_failed", "Loads from the CPU prefix cache that failed (recomputed)"),
    ("kvq_kv_cpu_reload_timeouts", "load_timeouts", "Loads given up after the load timeout (recomputed)"),
    ("kvq_kv_cpu_tier_hits", "tier_hits", "Prompt blocks found in the CPU prefix cache (device misses)"),
    ("kvq_cpu_offload_seconds", "store_seconds", "Seconds from issue to observed end of the stores, summed"),
    ("kvq_cpu_reload_seconds", "reload_seconds", "Seconds from issue to observed end of the loads, summed"),
)


def _prefix_tier_metrics(stats: dict):
    for name, key, doc in TIER_COUNTERS:
        yield CounterMetricFamily(name, doc, value=stats[key])
    yield GaugeMetricFamily("kvq_kv_cpu_tier_blocks", "KV blocks held in the CPU prefix cache (loadable or "
                            "being stored)", value=stats["tier_num_used_blocks"])


class EngineStateCollector:
    """Gauges from the engine thread's snapshot and the engine's resolved configuration."""

    def __init__(self, async_engine):
        self.ae = async_engine

    def collect(self):
        ae, info = self.ae, self.ae.engine.info
        snap = ae.snapshot
        for name, key, doc in (("kvq_running_requests", "running", "Requests in PREFILL or DECODE"),
                               ("kvq_waiting_requests", "waiting", "Requests queued for admission"),
                               ("kvq_swapped_requests", "swapped", SWAPPED_DOC)):
            yield GaugeMetricFamily(name, doc, value=snap[key])
        gauges = {s: GaugeMetricFamily(f"kvq_kv_blocks_{s}", f"KV cache blocks: {doc}", labels=["pool"])
                  for s, doc in (("used", "referenced by a request"), ("free", "allocatable (free or cached)"),
                                 ("cached", "unreferenced, content kept for prefix reuse"),
                                 ("capacity", "in the pool"))}
        for pool, b in snap["kv_blocks"].items():
            for state, g in gauges.items():
                g.add_metric([pool], b["total" if state == "capacity" else state])
        yield from gauges.values()
        swap = snap["swap"]
        for name, key, doc in (("kvq_requests_swapped", "out", "Preempted requests whose KV went to the host tier"),
                               ("kvq_requests_resumed", "in", "Swapped requests brought back to the device"),
                               ("kvq_swap_fallbacks", "fallbacks", "Preemptions that found the host tier full "
                                                                   "and recomputed instead"),
                               ("kvq_swap_failures", "failures", "Requests whose swap copy failed, recomputed")):
            yield CounterMetricFamily(name, doc, value=swap[key])
        if snap["tiers"]:  # elastic precision (--kv-cache-tiers)
            tb = GaugeMetricFamily("kvq_kv_tier_bytes", "Bytes of KV blocks in use per tier", labels=["tier", "format"])
            tbl = GaugeMetricFamily("kvq_kv_tier_blocks", "KV blocks per tier", labels=["tier", "format", "state"])
            ts = GaugeMetricFamily("kvq_kv_tier_slabs", "Arena slabs each tier holds", labels=["tier", "format"])
            dm = CounterMetricFamily("kvq_kv_demotions", "Blocks moved down into each tier (age and pressure)",
                                     labels=["tier", "format"])
            for row in snap["tiers"]:
                lab = [str(row["tier"]), row["format"]]
                tb.add_metric(lab, row["used_bytes"])
                for state in ("used", "cached", "free"):
                    tbl.add_metric([*lab, state], row[state])
                ts.add_metric(lab, row["slabs"])
                dm.add_metric(lab, row["demotions"])
            yield from (tb, tbl, ts, dm)
            yield CounterMetricFamily("kvq_kv_pressure_demotions", "Blocks demoted where the scheduler would have "
                                      "preempted or could not admit", value=snap["pressure_demotions"])
            yield CounterMetricFamily("kvq_kv_demotion_seconds", "Time the demotion kernels took (device time, "
                                      "summed once each launch completed)", value=snap["demotion_seconds"])
        host = GaugeMetricFamily("kvq_cpu_offload_blocks", "Host-tier KV blocks (swap)", labels=["pool", "state"])
        for pool, b in swap["host_blocks"].items():
            host.add_metric([pool, "used"], b["used"])
            host.add_metric([pool, "capacity"], b["total"])
        yield host
        yield GaugeMetricFamily("kvq_cpu_offload_budget_bytes", "Bytes of the host tier (--cpu-offload-gb)",
                                value=info["cpu_offload"]["bytes"])
        yield from _prefix_tier_metrics(snap["cpu_offload"])
        q = snap["kv_blocks"]["q"]
        yield GaugeMetricFamily("kvq_kv_cache_usage_ratio", "Used share of the resident (q) pool",
                                value=q["used"] / q["total"] if q["total"] else 0.0)
        yield GaugeMetricFamily("kvq_kv_cache_bytes", "Bytes of the KV pools (data and scales)",
                                value=info["kv_pool"]["bytes"])
        block_bytes = GaugeMetricFamily("kvq_kv_cache_block_bytes", "Bytes per block across all layers, K+V, "
                                        "scales included", labels=["pool"])
        block_bytes.add_metric(["q"], ae.engine.plan.bytes_per_block)
        block_bytes.add_metric(["hp"], ae.engine.plan.hp_bytes_per_block)
        yield block_bytes
        kv = info["kv_cache_dtype"]
        fmt = InfoMetricFamily("kvq_kv_cache_format", "The resolved KV cache format")
        fmt.add_metric([], {"requested": str(kv["requested"]), "k": kv["k"], "v": kv["v"],
                            "block_size": str(info["block_size"])})
        yield fmt
        layers = InfoMetricFamily("kvq_kv_cache_layer_format", "KV cache format of each layer", labels=["layer"])
        for i, name in enumerate(kv["per_layer"]):
            layers.add_metric([str(i)], {"format": str(name)})
        yield layers
        be = info["attention_backend"]
        backend = InfoMetricFamily("kvq_attention_backend", "Requested and resolved attention backend")
        backend.add_metric([], {"requested": be["requested"], "resolved": be["resolved"]})
        yield backend
        yield CounterMetricFamily("kvq_engine_steps", "Engine steps run", value=snap["steps"])
        yield CounterMetricFamily("kvq_engine_recoveries", "Engine steps that raised and were recovered from",
                                  value=snap["recoveries"])
        yield GaugeMetricFamily("kvq_engine_alive", "1 while the engine thread serves requests",
                                value=1.0 if ae.alive else 0.0)
        yield GaugeMetricFamily("kvq_server_draining", "1 from the start of the shutdown's drain (SIGTERM, Ctrl-C): "
                                "new requests get 503", value=1.0 if ae.draining else 0.0)


class ServerMetrics:
    """One server's registry: engine events, engine state, and HTTP request outcomes."""

    def __init__(self):
        self.registry = CollectorRegistry()
        self.events = EngineEvents(self.registry)
        self.outcomes = Counter("kvq_requests", "HTTP generation requests by outcome", ["outcome"],
                                registry=self.registry)
        for o in OUTCOMES:
            self.outcomes.labels(o)
        # prefill/decode disaggregation (kvq.transfer.peer): received on a decode server, staged for
        # reading on a prefill server
        self.kv_bytes = Counter("kvq_kv_transfer_bytes", "KV bytes moved between servers (payload, receiver's "
                                "format)", ["direction"], registry=self.registry)
        self.kv_seconds = Histogram("kvq_kv_transfer_seconds", "A decode server's fill of one prompt from its "
                                    "prefill peer: request sent to KV checked", buckets=TTFT_BUCKETS,
                                    registry=self.registry)
        self.kv_failed = Counter("kvq_kv_transfer_failed", "KV transfers that failed, by reason", ["reason"],
                                 registry=self.registry)
        for d in ("received", "sent"):
            self.kv_bytes.labels(d)
        for r in KV_FAILURE_REASONS:
            self.kv_failed.labels(r)

    def kv_result(self, result) -> None:
        """A decode server's ended fill (:class:`kvq.connectors.remote_prefill.RemoteResult`)."""
        if result.first_token is None:
            self.kv_failed.labels(result.reason).inc()
            return
        self.kv_bytes.labels("received").inc(result.nbytes)
        self.kv_seconds.observe(result.seconds)

    def watch(self, async_engine) -> None:
        """Export the state gauges of ``async_engine`` (once)."""
        self.registry.register(EngineStateCollector(async_engine))

    def outcome(self, name: str) -> None:
        assert name in OUTCOMES, name
        self.outcomes.labels(name).inc()

    def render(self) -> bytes:
        return generate_latest(self.registry)
