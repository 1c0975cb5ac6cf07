"""``flowspec bench``: every decoding mode side by side on an emulated edge cluster (the paper's evaluation,
flowspec-algorithm.md §8).

    start N stage agents + 1 leader as processes on loopback (cluster/local_cluster.py), the leader holding the
    draft head, embedding and LM head and no layers (the paper's 1 draft + N verification devices), every device
    emulated: links of --link-mbps / --link-latency-ms, compute --slowdown times slower (stages and the leader)
      -> for each temperature, each Spec-Bench prompt (lines [30, 30 + K) of each set), each mode (rotated per
         prompt, so drift and warm caches hit every mode alike): one conversation, seed fixed per prompt: an API
         request per user turn (up to --turns; MT-bench has two, run as a conversation as in the paper), each
         later turn after the mode's own earlier replies
      -> one JSON line per finished (prompt, turn, mode, T) in <out>/records.jsonl (``--resume`` skips those)
      -> results.json / results.md (report.py) and PNG charts (charts.py)

Default slowdown (``default_slowdown``): every emulated device (N stages + the leader) computes on one torch thread
and, slowed down s times, computes at most 1/s of the time; s = ceil(2 (N + 1) / cores) keeps the expected number
of devices computing at once at half the host's cores or less, leaving the rest for event loops, the emulated wire
and other load. Only ratios between modes measured in one run mean anything (docs/TEAM.md).
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import os
import time
import urllib.error
import urllib.request
from pathlib import Path
from typing import Literal

from pydantic import Field

from ..config import FlowSpecOverrides
from ..errors import ConfigError, FlowSpecError
from ..specbench import EVAL_START, PAPER_ORDER, Question, default_dir, load_questions
from ..types import Settings
from . import report
from .setup import check_resume, make_setup

log = logging.getLogger(__name__)

RECORDS = "records.jsonl"
RUN_FILE = "run.json"
WARMUP_TOKENS = 8
RETRIES = 3  # a 503 (busy, re-planning) is retried this often
REQUEST_TIMEOUT_S = 1800.0
HTTP_TIMEOUT_S = 30.0


class BenchConfig(Settings):
    stages: int = Field(4, ge=1)
    link_mbps: float | None = Field(100.0, gt=0)
    link_latency_ms: float = Field(2.0, ge=0)
    slowdown: float | None = Field(None, ge=1)  # None: default_slowdown(stages)
    per_dataset: int = Field(20, ge=1)
    turns: int = Field(2, ge=1)  # user turns per conversation, where a question has them (MT-bench: 2)
    start: int = Field(EVAL_START, ge=0)
    datasets: tuple[str, ...] = PAPER_ORDER
    temperatures: tuple[float, ...] = (0.0, 1.0)
    max_tokens: int = Field(256, ge=1)
    modes: tuple[str, ...] | None = None  # None: every mode the leader offers
    wire_dtype: str = "float32"
    threads: int = Field(1, ge=1)  # torch threads per emulated device
    context: int = Field(2048, ge=16)
    model: Path | None = None
    draft: Path | None = None
    flowspec: FlowSpecOverrides | None = None  # --flowspec-config
    insecure: bool = False  # agents linked over plain http/ws (the open mode) instead of TLS with a cluster key
    engine: Literal["auto", "native", "torch"] | None = None  # every agent's (--engine); None: theirs
    data: Path = Field(default_factory=default_dir)
    out: Path = Path("bench/flowspec")
    resume: bool = False
    progress: bool = True
    request_timeout_s: float = Field(REQUEST_TIMEOUT_S, gt=0)


def cluster_options(cfg: BenchConfig, slowdown: float):
    """The emulated cluster of ``cfg``: N stages and a leader holding no layers (the paper's layout)."""
    from ..cluster.local_cluster import ClusterOptions

    return ClusterOptions(stages=cfg.stages, leader_layers="never", link_mbps=cfg.link_mbps,
                          link_latency_ms=cfg.link_latency_ms or None, slowdown=slowdown, threads=cfg.threads,
                          wire_dtype=cfg.wire_dtype, context=cfg.context, model=cfg.model, draft=cfg.draft,
                          flowspec=cfg.flowspec, insecure=cfg.insecure, engine=cfg.engine)


def default_slowdown(stages: int, cores: int | None = None) -> float:
    """See the module docstring: ceil(2 (stages + 1) / cores), at least 1."""
    cores = cores or os.cpu_count() or 1
    return float(max(1, math.ceil(2 * (stages + 1) / cores)))


def plan_requests(prompts: list[Question], modes: list[str], temperatures: tuple[float, ...]
                  ) -> list[tuple[float, Question, str]]:
    """(T, prompt, mode) in run order: per temperature, per prompt, the modes rotated by the prompt's index."""
    out = []
    for t in temperatures:
        for i, p in enumerate(prompts):
            k = i % len(modes)
            out += [(t, p, m) for m in modes[k:] + modes[:k]]
    return out


# ------------------------------------------------------------------------------------------------ records


def read_records(path: Path) -> list[dict]:
    """The records of an earlier run (a torn last line, from a killed run, is skipped)."""
    out = []
    try:
        text = path.read_text()
    except FileNotFoundError:
        return out
    for line in text.splitlines():
        with contextlib.suppress(ValueError):
            out.append(json.loads(line))
    return out


# ---------------------------------------------------------------------------------------------------- HTTP


def _post(url: str, body: dict, timeout_s: float) -> dict:
    """POST JSON -> the response JSON; a 503 is retried after Retry-After; other errors raise FlowSpecError."""
    data = json.dumps(body).encode()
    for attempt in range(RETRIES + 1):
        req = urllib.request.Request(url, data, {"Content-Type": "application/json"})
        try:
            with urllib.request.urlopen(req, timeout=timeout_s) as r:
                return json.loads(r.read())
        except urllib.error.HTTPError as e:
            try:
                msg = json.loads(e.read())["error"]["message"]
            except (ValueError, KeyError, TypeError):
                msg = e.reason
            if e.code == 503 and attempt < RETRIES:
                log.warning("HTTP 503 (%s); retrying", msg)
                time.sleep(float(e.headers.get("Retry-After") or 2))
                continue
            raise FlowSpecError(f"HTTP {e.code}: {msg}") from None
        except (OSError, urllib.error.URLError) as e:
            raise FlowSpecError(f"request failed: {e}") from e
    raise AssertionError("unreachable")


def _get(url: str) -> dict:
    with urllib.request.urlopen(url, timeout=HTTP_TIMEOUT_S) as r:
        return json.loads(r.read())


def conversation(p: Question, replies: list[str]) -> list[dict]:
    """The messages of the turn after ``replies`` (the mode's own replies to the earlier turns)."""
    msgs = []
    for user, reply in zip(p.turns, replies, strict=False):
        msgs += [{"role": "user", "content": user}, {"role": "assistant", "content": reply}]
    return [*msgs, {"role": "user", "content": p.turns[len(replies)]}]


def request_body(p: Question, mode: str, t: float, max_tokens: int, timeline: bool,
                 replies: list[str] | None = None) -> dict:
    return {"messages": conversation(p, replies or []), "max_tokens": max_tokens, "temperature": t,
            "seed": report.seed_for(p.dataset, p.line), "decoding": mode, "return_token_ids": True,
            "return_leader_timeline": timeline}


def make_record(p: Question, mode: str, t: float, resp: dict, client_s: float, stage_timelines: list[list[dict]],
                keep_timeline: bool, turn: int = 0) -> dict:
    """A finished request -> its record (see report.py's glossary). ``stage_timelines``: per stage (in ring
    order) the worker's busy intervals (dicts with start, end, compute_s)."""
    stats = dict(resp["stats"])
    token_ids = stats.pop("token_ids", [])
    leader_iv = stats.pop("leader_intervals", None)
    start, end = stats.pop("decode_started_at"), stats.pop("decode_finished_at")
    intervals = [[(iv["start"], iv["end"]) for iv in tl] for tl in stage_timelines]
    util, busy = report.stage_utilization(intervals, start, end)
    inside = [[iv for iv in tl if start <= iv["start"] < end] for tl in stage_timelines]
    compute = [sum(iv["compute_s"] for iv in tl) for tl in inside]
    rec = {
        "dataset": p.dataset, "line": p.line, "question_id": p.question_id, "turn": turn, "mode": mode,
        "temperature": t, "seed": report.seed_for(p.dataset, p.line), "ok": True,
        "text": (resp["choices"][0].get("message") or {}).get("content"),
        "prompt_tokens": stats.pop("prompt_tokens"), "new_tokens": stats.pop("new_tokens"),
        "steps": stats.pop("steps"), "tau": stats.pop("tau"), "prefill_s": stats.pop("prefill_s"),
        "decode_s": stats.pop("decode_s"), "client_s": round(client_s, 4), "finish_reason":
        resp["choices"][0].get("finish_reason"), "decode_started_at": start, "decode_finished_at": end,
        "window_s": round(end - start, 6), "utilization": round(util, 4),
        "stage_busy_s": [round(b, 5) for b in busy], "stage_compute_s": [round(c, 5) for c in compute],
        "stage_forwards": [len(tl) for tl in inside],
        "leader_busy_s": stats.pop("leader_busy_s", None), "token_ids": token_ids, "stats": stats,
    }
    if keep_timeline:
        rec["timeline"] = {"stages": [report.clip(iv, start, end) for iv in intervals],
                           "leader": report.clip(leader_iv or [], start, end)}
    return rec


# ------------------------------------------------------------------------------------------------- runner


def _stage_timelines(cluster, since: float) -> list[list[dict]]:
    """Each stage's busy intervals ending after ``since``, in ring order (agents without a stage are left out)."""
    tls = [t for t in cluster.timelines(since=since) if t.get("stage") is not None]
    return [t["intervals"] for t in sorted(tls, key=lambda t: t["stage"])]


def run(cfg: BenchConfig) -> dict:
    """Run the benchmark (see the module docstring) -> results (also written to ``cfg.out``)."""
    from ..cluster.local_cluster import LocalCluster

    prompts = load_questions(cfg.data, cfg.datasets, cfg.start, cfg.per_dataset, cfg.turns)
    if not prompts:
        raise ConfigError(f"no prompts: lines [{cfg.start}, {cfg.start + cfg.per_dataset}) of {cfg.datasets}")
    per_dataset = {d: sum(p.dataset == d for p in prompts) for d in cfg.datasets}
    slowdown = cfg.slowdown if cfg.slowdown is not None else default_slowdown(cfg.stages)
    out = cfg.out
    out.mkdir(parents=True, exist_ok=True)
    records_path = out / RECORDS
    records = [r for r in read_records(records_path) if r.get("ok", True)] if cfg.resume else []
    if cfg.resume:  # failed requests are run again: drop their records (and a torn last line)
        tmp = records_path.with_suffix(".tmp")
        tmp.write_text("".join(json.dumps(r) + "\n" for r in records))
        tmp.replace(records_path)
    elif records_path.exists():
        log.warning("overwriting the records in %s (pass --resume to continue them)", records_path)
        records_path.unlink()
    options = cluster_options(cfg, slowdown)
    log.warning("starting an emulated cluster: %d stages + leader, %s Mbit/s, %g ms, slowdown %g ...", cfg.stages,
                cfg.link_mbps, cfg.link_latency_ms, slowdown)
    cluster = LocalCluster(cfg.stages + 1, options)
    setup: dict = {}
    try:
        cluster.start()
        cluster.wait_standby()  # its background preparation is not part of what is measured
        view = cluster.view()
        offered = list(view["leader"]["modes"])
        wanted = list(cfg.modes) if cfg.modes else report.order_modes(offered)
        missing = [m for m in wanted if m not in offered]
        if missing:
            log.warning("modes not offered by this cluster (skipped): %s; offered: %s", ", ".join(missing),
                        ", ".join(offered))
        modes = report.order_modes(m for m in wanted if m in offered)
        if not modes:
            raise ConfigError(f"none of the modes {wanted} is offered; offered: {offered}")
        setup = make_setup(cfg, slowdown, view, modes, offered, per_dataset)
        if cfg.resume and (out / RUN_FILE).exists():
            check_resume(json.loads((out / RUN_FILE).read_text()), setup)
        (out / RUN_FILE).write_text(json.dumps(setup, indent=2) + "\n")
        _run_requests(cluster, cfg, prompts, modes, records, records_path)
        setup["load_average_end"] = round(os.getloadavg()[0], 2)
    except BaseException:
        cluster.stop()
        if setup:  # an interrupted run still reports what it finished (and --resume continues it)
            with contextlib.suppress(Exception):
                finish(out, setup, records)
        raise
    cluster.stop()
    return finish(out, setup, records)


def _run_requests(cluster, cfg: BenchConfig, prompts: list[Question], modes: list[str], records: list[dict],
                  records_path: Path) -> None:
    from tqdm import tqdm

    url = cluster.api_url + "/v1/chat/completions"
    done = {report.record_key(r): r for r in records if r.get("ok", True)}
    todo = [(t, p, m) for t, p, m in plan_requests(prompts, modes, cfg.temperatures)
            if any(_key(t, p, m, k) not in done for k in range(len(p.turns)))]
    chart = {(report.temp_key(t), prompts[0].dataset, prompts[0].line) for t in cfg.temperatures}
    log.warning("%d conversations to run (%d requests done before)", len(todo), len(done))
    if not todo:
        return
    for m in modes:  # warm-up, not recorded: imports, first allocations, the drafter's caches
        _post(url, request_body(prompts[0], m, 0.0, WARMUP_TOKENS, False), cfg.request_timeout_s)
    bar = tqdm(todo, desc="bench", unit="conv", disable=not cfg.progress, dynamic_ncols=True)
    with open(records_path, "a") as f:
        for t, p, m in bar:
            replies: list[str] = []
            for k in range(len(p.turns)):
                rec = done.get(_key(t, p, m, k))
                if rec is None:
                    rec = _run_turn(cluster, url, cfg, p, m, t, k, replies,
                                    keep=k == 0 and (report.temp_key(t), p.dataset, p.line) in chart, bar=bar)
                    records.append(rec)
                    f.write(json.dumps(rec) + "\n")
                    f.flush()
                if not rec.get("ok", True):
                    break  # the later turns need this reply; --resume runs the conversation again
                replies.append(rec.get("text") or "")


def _key(t: float, p: Question, m: str, turn: int) -> tuple:
    return report.record_key({"temperature": t, "dataset": p.dataset, "line": p.line, "mode": m, "turn": turn})


def _run_turn(cluster, url: str, cfg: BenchConfig, p: Question, m: str, t: float, turn: int, replies: list[str],
              keep: bool, bar) -> dict:
    """One API request (turn ``turn`` of ``p``'s conversation under mode ``m``) -> its record."""
    where = f"T={t:g} {p.dataset}:{p.line}" + (f" turn {turn + 1}" if len(p.turns) > 1 else "") + f" {m}"
    bar.set_postfix_str(where)
    t0 = time.perf_counter()
    try:
        resp = _post(url, request_body(p, m, t, cfg.max_tokens, keep, replies), cfg.request_timeout_s)
    except FlowSpecError as e:
        if not cluster.agents[0].alive:
            raise FlowSpecError(f"the leader died: {cluster.agents[0].log_tail()}") from e
        log.warning("%s failed: %s", where, e)
        return {"dataset": p.dataset, "line": p.line, "turn": turn, "mode": m, "temperature": t, "ok": False,
                "error": str(e)}
    client_s = time.perf_counter() - t0
    since = resp["stats"]["decode_started_at"]
    rec = make_record(p, m, t, resp, client_s, _stage_timelines(cluster, since), keep, turn)
    bar.set_postfix_str(f"{where} {rec['new_tokens']} tok {rec['new_tokens'] / max(rec['decode_s'], 1e-9):.1f} "
                        f"tok/s util {100 * rec['utilization']:.0f}%")
    return rec


def finish(out: Path, setup: dict, records: list[dict]) -> dict:
    """results.json, results.md and the charts from the records."""
    from .charts import write_charts

    res = report.results(setup, records)
    res["charts"] = write_charts(out, res, records)
    report.write_reports(out, res)
    log.warning("wrote %s (%d records)", out / "results.md", len(records))
    return res


def report_only(out: Path) -> dict:
    """Rebuild the reports from ``out``'s records and run.json (e.g. after an interrupted run)."""
    try:
        setup = json.loads((out / RUN_FILE).read_text())
    except (OSError, ValueError) as e:
        raise ConfigError(f"no run setup in {out / RUN_FILE}: {e}") from e
    return finish(out, setup, read_records(out / RECORDS))
