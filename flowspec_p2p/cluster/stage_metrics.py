"""``GET /metrics`` of every agent's server: its own stage in Prometheus text format, read at scrape time from the
stage host (cumulative over the plan epochs it served), names prefixed ``flowspec_stage_``:

    flowspec_stage_compute_seconds_total    forwards computed (the emulated slowdown's wait excluded)
    flowspec_stage_busy_seconds_total       forwards including an emulated device's wait
    flowspec_stage_frames_in_total, flowspec_stage_frames_out_total, flowspec_stage_dropped_frames_total
    flowspec_stage_forwards_total, flowspec_stage_tokens_total, flowspec_stage_prunes_total,
    flowspec_stage_errors_total
    flowspec_stage_link_sent_bytes_total    frames sent to the successor (websocket links; 0 in process)
    flowspec_stage_engine_calls_total, flowspec_stage_engine_rows_total   engine calls and the rows they computed:
                                            their ratio is the batch rows per stage forward
    flowspec_stage_batched_forwards_total   forwards run with other requests' in one engine call
    flowspec_stage_reused_requests_total    requests started from retained KV (the prompt cache)
    flowspec_stage_cache_bytes              K/V cache held for open requests (gauge)
    flowspec_stage_open_requests, flowspec_stage_queue_depth, flowspec_stage_index (gauges; index 0: no stage)
    flowspec_agent_info{agent,name,role,cluster}  1

plus the process's own (``process_*``: memory, CPU, open files) where the platform has them. On the leader, the
API's /metrics (api/metrics.py) covers the cluster and its requests. In a keyed cluster the agent server answers
authenticated key holders only (guard.py), on this route as on every other.
"""

from __future__ import annotations

from collections.abc import Callable

from aiohttp import web
from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, ProcessCollector, generate_latest
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from .control import PeerInfo
from .stage_host import StageHost

METRICS_PATH = "/metrics"

# (metric name, help, StageHost.totals() key)
STAGE_COUNTERS = (
    ("flowspec_stage_compute_seconds", "Seconds this stage computed forwards", "compute_s"),
    ("flowspec_stage_busy_seconds", "Seconds this stage was busy (an emulated device's wait included)", "busy_s"),
    ("flowspec_stage_frames_in", "Frames this stage received", "frames_in"),
    ("flowspec_stage_frames_out", "Frames this stage sent on", "frames_out"),
    ("flowspec_stage_dropped_frames", "Frames this stage could not send on", "dropped_out"),
    ("flowspec_stage_forwards", "Forwards this stage computed", "forwards"),
    ("flowspec_stage_tokens", "Tree nodes this stage computed", "tokens"),
    ("flowspec_stage_prunes", "Prunes this stage applied", "prunes"),
    ("flowspec_stage_errors", "Requests that failed on this stage", "errors"),
    ("flowspec_stage_link_sent_bytes", "Bytes this stage sent to its successor", "sent_bytes"),
    ("flowspec_stage_engine_calls", "Engine calls (one per forward, or per batch of several requests' forwards)",
     "engine_calls"),
    ("flowspec_stage_engine_rows", "Rows those calls computed (over engine calls: batch rows per stage forward)",
     "engine_rows"),
    ("flowspec_stage_batched_forwards", "Forwards that ran batched with other requests' in one engine call",
     "batched_forwards"),
    ("flowspec_stage_reused_requests", "Requests that started from a retained request's KV (the prompt cache)",
     "reused"),
)
STAGE_GAUGES = (
    ("flowspec_stage_cache_bytes", "K/V cache bytes held for open requests", "cache_bytes"),
    ("flowspec_stage_open_requests", "Requests with state on this stage", "open_requests"),
    ("flowspec_stage_queue_depth", "Messages waiting for this stage", "queued"),
    ("flowspec_stage_index", "This agent's place in the ring (1 = first stage; 0 = none)", "stage"),
)


def prometheus_response(registry: CollectorRegistry) -> web.Response:
    """A scrape of ``registry`` in the text format."""
    resp = web.Response(body=generate_latest(registry))
    resp.headers["Content-Type"] = CONTENT_TYPE_LATEST
    return resp


class StageCollector:
    """``stage_host`` and ``info`` are read at each scrape (the agent server starts before either exists)."""

    def __init__(self, stage_host: Callable[[], StageHost | None], info: Callable[[], PeerInfo | None]):
        self.stage_host, self.info = stage_host, info

    def collect(self):
        host, info = self.stage_host(), self.info()
        totals = host.totals() if host is not None else {}
        for name, doc, key in STAGE_COUNTERS:
            yield CounterMetricFamily(name, doc, value=totals.get(key, 0))
        for name, doc, key in STAGE_GAUGES:
            yield GaugeMetricFamily(name, doc, value=totals.get(key, 0))
        if info is not None:
            agent = GaugeMetricFamily("flowspec_agent_info", "This agent", labels=["agent", "name", "role", "cluster"])
            agent.add_metric([info.id, info.name, info.role, info.cluster], 1)
            yield agent


def stage_registry(stage_host: Callable[[], StageHost | None], info: Callable[[], PeerInfo | None]
                   ) -> CollectorRegistry:
    registry = CollectorRegistry()
    registry.register(StageCollector(stage_host, info))
    ProcessCollector(registry=registry)
    return registry


def install_stage_metrics(app: web.Application, stage_host: Callable[[], StageHost | None],
                          info: Callable[[], PeerInfo | None]) -> None:
    """Serve this agent's stage metrics at /metrics of ``app`` (its agent server)."""
    registry = stage_registry(stage_host, info)

    async def handle(request: web.Request) -> web.Response:
        return prometheus_response(registry)

    app.router.add_get(METRICS_PATH, handle)
