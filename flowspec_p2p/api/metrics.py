"""``GET /metrics`` of the leader's API: Prometheus text format (prometheus-client), every name prefixed
``flowspec_``, in a registry of the app's own (two leaders in one process never mix).

Recorded as requests end, a view of each request's ledger (ledger.py):

    flowspec_requests_total{mode,status}               completion requests by decoding mode and HTTP status (a
                                                       stream that fails after it started counts with the error's)
    flowspec_prompt_tokens_total{mode}, flowspec_generation_tokens_total{mode}
    flowspec_time_to_first_token_seconds{mode}         histogram, from the request's arrival (its wait included)
    flowspec_inter_token_latency_seconds{mode}         histogram, one observation per token after the first: the gap
                                                       since the previous chunk over the chunk's tokens
    flowspec_request_duration_seconds{mode}            histogram
    flowspec_accepted_tokens_per_walk{mode}            histogram: tokens each verification walk emitted (accepted
                                                       drafts + the bonus): tau, without the prefill step
    flowspec_accepted_draft_tokens_total{mode,depth}   walks whose draft the target confirmed at tree depth ``depth``
                                                       (accepted, or FlowSpec's next root still in flight); over
                                                       depth - 1's: the acceptance rate at that depth
    flowspec_draft_tokens_total{mode}                  drafted tree nodes sent down the pipeline to be verified
    flowspec_pipeline_stage_busy_seconds_total{stage}  each stage's busy time, reported in band (Forward.stage_s)
    flowspec_pipeline_stage_bubble_seconds_total{stage} the time it idled while a request had work in the ring
    flowspec_link_bytes_total{direction}               "out": frames the leader sent on its first hop (websocket
                                                       links only); "in": tensor payload of the results back
    flowspec_ring_round_trip_seconds                   histogram: a Forward's trip from the leader round the ring
    flowspec_errors_total{status,reason}               every 4xx/5xx reply by reason (OpenAI error code or type)
    flowspec_queue_wait_seconds                        histogram: a request's wait for its turn (admission)
    flowspec_prompt_cached_tokens_total                prompt tokens whose KV came from the prompt cache

Read at scrape time: flowspec_queue_depth, flowspec_requests_in_flight, flowspec_max_requests (the plan's requests
in flight), flowspec_prompt_cache_entries, flowspec_pipeline_ready, flowspec_pipeline_stages,
flowspec_pipeline_stage_rows_per_forward{stage} (each stage's rows per engine call: requests batched and tree
nodes, from its counters), flowspec_cluster_members, flowspec_plan_epoch (gauges); flowspec_replans_total (plans
put into service after the first), flowspec_resumes_total (requests continued on a new pipeline),
flowspec_leader_requests_total{outcome} (the leader's own counts: completed, cancelled, failed, busy, not_ready).

Each member serves its own stage's metrics on its agent server (cluster/stage_metrics.py).
"""

from __future__ import annotations

import inspect
from collections.abc import Awaitable, Callable

from aiohttp import web
from prometheus_client import CollectorRegistry, Counter, Histogram
from prometheus_client.core import CounterMetricFamily, GaugeMetricFamily

from ..cluster.stage_metrics import prometheus_response
from ..decoding.leader import Leader
from ..ledger import Ledger, itl_gaps

METRICS_PATH = "/metrics"
TTFT_BUCKETS = (0.05, 0.1, 0.25, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0)
ITL_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
QUEUE_BUCKETS = (0.01, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5, 5.0, 10.0, 30.0, 60.0)
DURATION_BUCKETS = (0.1, 0.5, 1.0, 2.0, 5.0, 10.0, 30.0, 60.0, 120.0, 300.0)
WALK_BUCKETS = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16)
TRIP_BUCKETS = (0.005, 0.01, 0.025, 0.05, 0.1, 0.25, 0.5, 1.0, 2.5)
LEADER_OUTCOMES = ("completed", "cancelled", "failed", "busy", "not_ready")

View = Callable[[], dict | Awaitable[dict]]


async def cluster_state(view: View | None) -> dict:
    """What the control plane knows (``cluster_view()``), awaited when it is a coroutine; {} without one."""
    if view is None:
        return {}
    known = view()
    return await known if inspect.isawaitable(known) else known


class ApiMetrics:
    def __init__(self, leader: Leader, view: View | None = None):
        self.leader, self.view = leader, view
        self.registry = r = CollectorRegistry()
        self.requests = Counter("flowspec_requests", "Completion requests by decoding mode and HTTP status",
                                ["mode", "status"], registry=r)
        self.prompt_tokens = Counter("flowspec_prompt_tokens", "Prompt tokens of requests served", ["mode"],
                                     registry=r)
        self.generation_tokens = Counter("flowspec_generation_tokens", "Tokens generated", ["mode"], registry=r)
        self.ttft = Histogram("flowspec_time_to_first_token_seconds", "From a request's arrival to its first token",
                              ["mode"], buckets=TTFT_BUCKETS, registry=r)
        self.itl = Histogram("flowspec_inter_token_latency_seconds", "Per token after the first: the gap since the "
                             "previous chunk over the chunk's tokens", ["mode"], buckets=ITL_BUCKETS, registry=r)
        self.duration = Histogram("flowspec_request_duration_seconds", "From a request's arrival to its end",
                                  ["mode"], buckets=DURATION_BUCKETS, registry=r)
        self.walk_tokens = Histogram("flowspec_accepted_tokens_per_walk", "Tokens each verification walk emitted "
                                     "(accepted drafts + the bonus)", ["mode"], buckets=WALK_BUCKETS, registry=r)
        self.depth = Counter("flowspec_accepted_draft_tokens", "Walks whose draft the target confirmed at this tree "
                             "depth", ["mode", "depth"], registry=r)
        self.drafted = Counter("flowspec_draft_tokens", "Drafted tree nodes sent to be verified", ["mode"],
                               registry=r)
        self.stage_busy = Counter("flowspec_pipeline_stage_busy_seconds", "Each stage's busy time for requests "
                                  "(reported in band)", ["stage"], registry=r)
        self.stage_bubble = Counter("flowspec_pipeline_stage_bubble_seconds", "Time a stage idled while a request "
                                    "had work in the ring", ["stage"], registry=r)
        self.link_bytes = Counter("flowspec_link_bytes", "Bytes on the leader's links: out = frames on its first "
                                  "hop, in = tensor payload back", ["direction"], registry=r)
        self.trips = Histogram("flowspec_ring_round_trip_seconds", "A Forward's trip from the leader round the ring",
                               buckets=TRIP_BUCKETS, registry=r)
        self.errors = Counter("flowspec_errors", "4xx and 5xx replies by status and reason", ["status", "reason"],
                              registry=r)
        self.queue_wait = Histogram("flowspec_queue_wait_seconds", "A request's wait for its turn",
                                    buckets=QUEUE_BUCKETS, registry=r)
        self.cached_tokens = Counter("flowspec_prompt_cached_tokens", "Prompt tokens whose KV came from the prompt "
                                     "cache", registry=r)
        self.state = _StateCollector(leader)
        r.register(self.state)

    def reply(self, status: int, reason: str | None, ledger: Ledger | None, completion: bool) -> None:
        """One API reply went out (``ledger``: of a completion request that was validated)."""
        if status >= 400:
            self.errors.labels(str(status), reason or "unknown").inc()
        if completion:
            self.requests.labels(ledger.mode if ledger is not None else "none", str(status)).inc()
        if ledger is not None and ledger.finished is not None:  # it got as far as the leader
            self._request(ledger)

    def _request(self, t: Ledger) -> None:
        mode = t.mode
        self.queue_wait.observe(t.queued_s)
        self.cached_tokens.inc(t.cached_tokens)
        self.prompt_tokens.labels(mode).inc(t.prompt_tokens)
        self.generation_tokens.labels(mode).inc(t.new_tokens)
        self.duration.labels(mode).observe(t.finished - t.started)
        if t.first_token_at is not None:
            self.ttft.labels(mode).observe(t.first_token_at - t.started)
        itl = self.itl.labels(mode)
        for gap, n in itl_gaps(t):
            for _ in range(n):
                itl.observe(gap / n)
        walks = self.walk_tokens.labels(mode)
        for k in t.walk_tokens:
            walks.observe(k)
        for d, n in enumerate(t.accepted_at_depth, 1):
            self.depth.labels(mode, str(d)).inc(n)
        self.drafted.labels(mode).inc(t.draft_tokens)
        for i, busy in enumerate(t.stage_busy_s, 1):
            self.stage_busy.labels(str(i)).inc(busy)
            self.stage_bubble.labels(str(i)).inc(max(0.0, t.window_s - busy))
        self.link_bytes.labels("out").inc(t.sent_bytes)
        self.link_bytes.labels("in").inc(t.returned_bytes)
        for s in t.trips_s:
            self.trips.observe(s)

    async def handle(self, request: web.Request) -> web.Response:
        self.state.known = await cluster_state(self.view)
        return prometheus_response(self.registry)


class _StateCollector:
    """Gauges and counts read from the leader and the control plane at scrape time."""

    def __init__(self, leader: Leader):
        self.leader = leader
        self.known: dict = {}  # the cluster view, refreshed by the handler before each scrape

    def collect(self):
        snap, known = self.leader.snapshot(), self.known
        p = snap["pipeline"] or {}
        epoch = known.get("epoch") or 0
        for name, doc, value in (
            ("flowspec_queue_depth", "Requests waiting for their turn", snap["waiting"]),
            ("flowspec_requests_in_flight", "Requests being decoded", len(snap["in_flight"])),
            ("flowspec_max_requests", "Requests decoded at once (the plan's)", snap["admission"]["max_requests"]),
            ("flowspec_prompt_cache_entries", "Finished requests' KV kept for a later prompt",
             snap["prompt_cache"]["entries"]),
            ("flowspec_pipeline_ready", "1 while a pipeline serves", int(snap["ready"])),
            ("flowspec_pipeline_stages", "Compute stages of the serving pipeline", p.get("stages", 0)),
            ("flowspec_cluster_members", "Agents the leader knows, itself included", len(known.get("members", ()))),
            ("flowspec_plan_epoch", "The serving plan's epoch", epoch),
        ):
            yield GaugeMetricFamily(name, doc, value=value)
        rows = GaugeMetricFamily("flowspec_pipeline_stage_rows_per_forward", "Rows per engine call of each stage "
                                 "(several requests batched, tree nodes)", labels=["stage"])
        for s in known.get("stages") or ():
            c = s.get("counters") or {}
            if c.get("engine_calls"):
                rows.add_metric([str(s["stage"])], c["engine_rows"] / c["engine_calls"])
        yield rows
        yield CounterMetricFamily("flowspec_replans", "Plans put into service after the first",
                                  value=max(0, epoch - 1))
        yield CounterMetricFamily("flowspec_resumes", "Requests continued on a new pipeline", value=snap["resumed"])
        outcomes = CounterMetricFamily("flowspec_leader_requests", "The leader's requests by outcome",
                                       labels=["outcome"])
        for o in LEADER_OUTCOMES:
            outcomes.add_metric([o], snap[o])
        yield outcomes


API_METRICS = web.AppKey("api_metrics", ApiMetrics)


def install_metrics(app: web.Application, leader: Leader, view: View | None) -> ApiMetrics:
    metrics = app[API_METRICS] = ApiMetrics(leader, view)
    app.router.add_get(METRICS_PATH, metrics.handle)
    return metrics
