"""Prometheus metrics of one server: request latencies measured here, cluster state read at scrape time.

`ServerMetrics` owns a `CollectorRegistry` per app (never the process-global one, so several
apps in one process, as in tests, do not collide). Request histograms follow vLLM's names with
`disagg:` for `vllm:` (TTFT, inter-token latency, per-request time per output token, end-to-end
latency) and are observed when a request ends; counters count tokens, successes by finish reason,
aborts and failures by reason (as the HTTP server saw them). `ClusterCollector` turns
`cluster.stats()` into per-instance gauges (running, waiting, KV pages used/total, usage, push
GB/s, prefix-cache pages) and counters (preemptions, pushed bytes, doorbell wait, prefix-cache
queries and hits in prompt tokens), the router's queue, outcomes,
aborts and failures by reason, and the dead instances' count (`disagg:num_instances_degraded`),
when /metrics is scraped.
"""

from __future__ import annotations

import logging
import math
from typing import Any, Callable, Iterable

from prometheus_client import CollectorRegistry, Counter, Gauge, Histogram, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily
from prometheus_client.registry import Collector

from disagg.cluster.serve.generation import GenerationTimes

logger = logging.getLogger(__name__)

TTFT_BUCKETS = (0.001, 0.005, 0.01, 0.02, 0.04, 0.06, 0.08, 0.1, 0.25, 0.5, 0.75, 1.0, 2.5, 5.0,
                7.5, 10.0, 20.0, 40.0, 80.0, 160.0, 640.0, 2560.0)
TOKEN_BUCKETS = (0.01, 0.025, 0.05, 0.075, 0.1, 0.15, 0.2, 0.3, 0.4, 0.5, 0.75, 1.0, 2.5, 5.0, 7.5,
                 10.0, 20.0, 40.0, 80.0)
E2E_BUCKETS = (0.3, 0.5, 0.8, 1.0, 1.5, 2.0, 2.5, 5.0, 10.0, 15.0, 20.0, 30.0, 40.0, 50.0, 60.0,
               120.0, 240.0, 480.0, 960.0, 1920.0, 7680.0)
CONTENT_TYPE = "text/plain; version=0.0.4; charset=utf-8"

# cluster.stats() per-instance key -> (metric name, help): gauges of the instance's current state.
INSTANCE_GAUGES = {
    "running": ("disagg:num_requests_running", "Requests running on the instance."),
    "tensor_parallel": ("disagg:instance_tensor_parallel", "Tensor-parallel ranks of the instance (GPUs, or "
                                                           "shares of one)."),
    "waiting": ("disagg:num_requests_waiting", "Requests waiting on the instance."),
    "used_pages": ("disagg:kv_pages_used", "KV cache pages in use on the instance."),
    "total_pages": ("disagg:kv_pages_total", "KV cache pages of the instance."),
    "kv_cache_usage_perc": ("disagg:kv_cache_usage_perc", "KV cache usage of the instance; 1 means 100 percent."),
    "leases": ("disagg:num_kv_leases", "Decode reservations whose KV has not landed yet."),
    "quarantined": ("disagg:num_requests_quarantined", "Aborted decode reservations whose pages wait for "
                    "their doorbell or lease expiry before reuse."),
    "alive": ("disagg:instance_alive", "1 while the instance's actor is alive."),
    "push_gbps": ("disagg:kv_push_gbps", "Recent KV push rate of a prefill instance, GB/s."),
    "prefix_cached_pages": ("disagg:prefix_cache_pages", "KV pages held only by the prefix cache (evictable; "
                            "counted as free)."),
}
# Per-instance totals since launch.
INSTANCE_COUNTERS = {
    "num_preemptions": ("disagg:num_preemptions", "Preemptions on the instance."),
    "num_forwards": ("disagg:num_forwards", "Model forwards run by the instance."),
    "pushed_bytes": ("disagg:kv_pushed_bytes", "KV bytes pushed by a prefill instance to decode instances."),
    "push_s": ("disagg:kv_push_seconds", "Seconds of the prefill forwards that pushed KV (compute included)."),
    "doorbell_wait_s": ("disagg:doorbell_wait_seconds", "Time decode reservations waited for their KV "
                        "(reserve to doorbell ring), summed, seconds."),
    "num_doorbells_rung": ("disagg:kv_doorbells_rung", "Decode reservations whose KV landed (doorbell rang)."),
    "prefix_query_tokens": ("disagg:prefix_cache_queries", "Prompt tokens of new requests looked up in the "
                            "instance's prefix cache (vLLM's prefix_cache_queries; a preempted request "
                            "re-entering is not counted)."),
    "prefix_hit_tokens": ("disagg:prefix_cache_hits", "Prompt tokens found in the instance's prefix cache, "
                          "so not computed (prefill) or not received (decode)."),
}


class ServerMetrics:
    """The metrics of one HTTP server (one app), in their own registry.

    Args:
        model_name: the `model_name` label of every request metric.
    """

    def __init__(self, model_name: str) -> None:
        self.registry = CollectorRegistry(auto_describe=True)
        self.model_name = model_name
        labels = ["model_name"]
        reg = self.registry
        self.ttft = Histogram("disagg:time_to_first_token_seconds", "Time to first token, seconds.",
                              labels, buckets=TTFT_BUCKETS, registry=reg).labels(model_name)
        self.itl = Histogram("disagg:inter_token_latency_seconds", "Time between two output tokens, seconds.",
                             labels, buckets=TOKEN_BUCKETS, registry=reg).labels(model_name)
        self.tpot = Histogram("disagg:time_per_output_token_seconds",
                              "Per request: (e2e - ttft) / (output tokens - 1), seconds.",
                              labels, buckets=TOKEN_BUCKETS, registry=reg).labels(model_name)
        self.e2e = Histogram("disagg:e2e_request_latency_seconds", "Arrival to last token, seconds.",
                             labels, buckets=E2E_BUCKETS, registry=reg).labels(model_name)
        # vLLM's request phase histograms, from the cluster's own clocks (RequestMetrics).
        self.queue_time = Histogram("disagg:request_queue_time_seconds", "Arrival at the router to "
                                    "placement (decode pages reserved, or handed to the instance that "
                                    "computes it), seconds.", labels, buckets=TTFT_BUCKETS,
                                    registry=reg).labels(model_name)
        self.prefill_time = Histogram("disagg:request_prefill_time_seconds", "Placement to the first "
                                      "token at the instance (queueing there, the prompt's steps and its "
                                      "push), seconds.", labels, buckets=TTFT_BUCKETS,
                                      registry=reg).labels(model_name)
        self.decode_time = Histogram("disagg:request_decode_time_seconds", "First to last token at the "
                                     "instances, seconds.", labels, buckets=E2E_BUCKETS,
                                     registry=reg).labels(model_name)
        self.prompt_tokens = Counter("disagg:prompt_tokens", "Prompt tokens of finished requests.",
                                     labels, registry=reg).labels(model_name)
        self.generation_tokens = Counter("disagg:generation_tokens", "Output tokens sent to clients.",
                                         labels, registry=reg).labels(model_name)
        self.success = Counter("disagg:request_success", "Requests finished, by finish reason.",
                               labels + ["finished_reason"], registry=reg)
        self.aborts = Counter("disagg:request_aborts", "Requests aborted before they finished, by reason.",
                              labels + ["reason"], registry=reg)
        self.failures = Counter("disagg:request_failures", "Requests refused or failed, by reason "
                                "(the error code or HTTP status class).", labels + ["reason"], registry=reg)
        self.in_flight = Gauge("disagg:num_requests_in_flight", "Requests admitted by the HTTP server "
                               "and not yet answered.", labels, registry=reg).labels(model_name)

    def watch_cluster(self, stats: Callable[[], dict]) -> None:
        """Export `stats()` (cluster.stats) as per-instance gauges at every scrape."""
        self.registry.register(ClusterCollector(stats))

    def record_failure(self, reason: str) -> None:
        self.failures.labels(self.model_name, reason).inc()

    def record(self, times: GenerationTimes, num_prompt_tokens: int) -> None:
        """Observe one request that ended (finished, aborted or failed)."""
        outcome = times.outcome
        if outcome in ("stop", "length"):
            self.success.labels(self.model_name, outcome).inc()
        elif outcome in ("abort", "client_disconnect"):
            self.aborts.labels(self.model_name, outcome).inc()
        else:
            self.record_failure(outcome)
        self.prompt_tokens.inc(num_prompt_tokens)
        self.generation_tokens.inc(times.num_output_tokens)
        if times.first_token is None or times.finished is None:
            return
        ttft = times.first_token - times.arrival
        e2e = times.finished - times.arrival
        self.ttft.observe(ttft)
        self.e2e.observe(e2e)
        if times.num_output_tokens > 1:
            self.tpot.observe((e2e - ttft) / (times.num_output_tokens - 1))
        emits = times.token_emit_times
        for earlier, later in zip(emits, emits[1:]):
            self.itl.observe(max(0.0, later - earlier))
        self._record_phases(times.cluster_metrics)

    def _record_phases(self, metrics: Any) -> None:
        """Queue, prefill and decode time of one request from its `RequestMetrics` (if it has them)."""
        if metrics is None or metrics.dispatch_time is None:
            return
        self.queue_time.observe(max(0.0, metrics.dispatch_time - metrics.arrival_time))
        if metrics.first_token_time is None:
            return
        self.prefill_time.observe(max(0.0, metrics.first_token_time - metrics.dispatch_time))
        if metrics.token_times:
            self.decode_time.observe(max(0.0, metrics.token_times[-1] - metrics.first_token_time))

    def render(self) -> bytes:
        return generate_latest(self.registry)


class ClusterCollector(Collector):
    """Reads `cluster.stats()` at scrape time and exports what it finds.

    Expected shape (keys it lacks are skipped): ``{"instances": [{"name", "role", "running",
    "waiting", "free_pages", "total_pages", ...}, ...], "router": {"queued": ..., ...}}``; a
    plain ``{name: {role, ...}}`` mapping of instances works too.
    """

    def __init__(self, stats: Callable[[], dict]) -> None:
        self._stats = stats

    def describe(self) -> list:
        return []  # collected lazily: the registry must not call stats() at registration

    def collect(self) -> Iterable:
        try:
            stats = self._stats()
        except Exception as err:  # a scrape must not fail because one actor is slow or dead
            logger.warning("cluster.stats() failed during a /metrics scrape: %s", err)
            return []
        instances = list(_instances(stats))
        families = _instance_families(instances)
        router = stats.get("router") if isinstance(stats.get("router"), dict) else {}
        families.extend(_router_families(router))
        families.extend(_rank_families(instances))
        if isinstance(stats.get("degraded"), list):
            family = GaugeMetricFamily("disagg:num_instances_degraded", "Instances of the fleet that died "
                                       "(or were replaced); above 0 the survivors serve their work (degraded).")
            family.add_metric([], len(stats["degraded"]))
            families.append(family)
        rebuild = stats.get("rebuild")
        if isinstance(rebuild, dict):
            family = GaugeMetricFamily("disagg:fleet_rebuild_phase", "1 for the rebuild's phase now (waiting, "
                                       "draining, restarting; all 0 at full strength).", labels=["phase"])
            for phase in ("waiting", "draining", "restarting"):
                family.add_metric([phase], float(rebuild.get("phase") == phase))
            families.append(family)
            counter = CounterMetricFamily("disagg:fleet_rebuilds", "Rebuilds of the fleet begun since launch.")
            counter.add_metric([], float(rebuild.get("rebuilds", 0)))
            families.append(counter)
        return families


def _rank_families(instances: list[tuple[str, dict]]) -> list:
    """``disagg:instance_rank_info{instance, role, rank, pe, device} 1``: where each rank runs."""
    family = GaugeMetricFamily("disagg:instance_rank_info", "One per rank of each instance: its PE in the "
                               "heap and its device.", labels=["instance", "role", "rank", "pe", "device"])
    found = False
    for name, inst in instances:
        for rank in inst.get("ranks") or ():
            if isinstance(rank, dict):
                family.add_metric([name, str(inst.get("role", "")), str(rank.get("rank", "")),
                                   "" if rank.get("pe") is None else str(rank["pe"]), str(rank.get("device") or "")], 1)
                found = True
    return [family] if found else []


def _router_families(router: dict) -> list:
    families = []
    for key, name, doc in (("queued", "disagg:num_requests_queued", "Requests in the router's queue waiting "
                            "for decode pages."),
                           ("live", "disagg:num_requests_live", "Requests the router holds (queued to finished).")):
        if isinstance(router.get(key), (int, float)):
            family = GaugeMetricFamily(name, doc)
            family.add_metric([], router[key])
            families.append(family)
    for key, name, doc, label in (
            ("counts", "disagg:router_requests", "Requests the router saw, by outcome (submitted, stop, "
             "length, abort, error, migrated: moved off a dead instance).", "outcome"),
            ("aborts", "disagg:cluster_request_aborts", "Requests the cluster aborted, by reason (caller, "
             "request_timed_out, no_live_instance: shutting down, ...).", "reason"),
            ("failures", "disagg:cluster_request_failures", "Requests the cluster failed, by reason "
             "(instance_died, no_live_instance, request_refused, signal_timeout: lease expired, ...).", "reason"),
            ("placements", "disagg:router_placements", "Prompts placed, by path (remote: a prefill instance "
             "pushed it; local: the decode instance prefilled it; kept: a prefill instance prefilled and "
             "decoded it; router.placement).", "path")):
        counts = router.get(key)
        if isinstance(counts, dict):
            family = CounterMetricFamily(name, doc, labels=[label])
            for value_label, value in sorted(counts.items()):
                family.add_metric([str(value_label)], value)
            families.append(family)
    return families


def _instances(stats: dict) -> Iterable[tuple[str, dict]]:
    listed = stats.get("instances")
    if isinstance(listed, dict):
        listed = [dict(v, name=v.get("name", k)) for k, v in listed.items()]
    if isinstance(listed, list):
        for index, inst in enumerate(listed):
            if isinstance(inst, dict):
                yield str(inst.get("name", index)), inst
        return
    for name, inst in stats.items():
        if isinstance(inst, dict) and "role" in inst:
            yield str(name), inst


def _instance_families(instances: list[tuple[str, dict]]) -> list:
    labels = ["instance", "role"]
    gauges = {key: GaugeMetricFamily(name, doc, labels=labels) for key, (name, doc) in INSTANCE_GAUGES.items()}
    counters = {key: CounterMetricFamily(name, doc, labels=labels) for key, (name, doc) in INSTANCE_COUNTERS.items()}
    seen: set[str] = set()
    for name, inst in instances:
        values = dict(inst)
        total, free = values.get("total_pages"), values.get("free_pages")
        if isinstance(total, (int, float)) and isinstance(free, (int, float)):
            values.setdefault("used_pages", total - free)
            values.setdefault("kv_cache_usage_perc", (total - free) / total if total else 0.0)
        label_values = [name, str(values.get("role", ""))]
        for key, family in list(gauges.items()) + list(counters.items()):
            value = values.get(key)
            if isinstance(value, (int, float)) and math.isfinite(value):  # bools (alive) count as 0/1
                family.add_metric(label_values, value)
                seen.add(key)
    return [f for key, f in list(gauges.items()) + list(counters.items()) if key in seen]
