"""`flowspec bench`'s arithmetic and reports on synthetic records (ξ, e2e, tau, utilization from busy intervals,
speedups, greedy equality, the results.json keys, markdown, charts), its CLI, and the leader/API hooks it relies
on (decode window, token ids, the leader's emulated slowdown). The end-to-end run is too slow for the suite."""

import asyncio
import json
import time
from types import SimpleNamespace

import pytest
from aiohttp.test_utils import TestClient, TestServer

from flowspec_p2p.bench import edge as bench
from flowspec_p2p.bench import report as rep
from flowspec_p2p.bench.edge import (
    check_resume,
    conversation,
    default_slowdown,
    make_record,
    plan_requests,
    read_records,
)
from flowspec_p2p.errors import ConfigError
from flowspec_p2p.specbench import Question

MODES = ["ar", "chunk", "flowspec"]


def rec(mode, dataset="gsm8k", line=30, t=0.0, tokens=20, decode=1.0, prefill=0.5, steps=None, busy=None,
        window=None, ok=True, ids=None, turn=0, **stats):
    """A synthetic record as bench.make_record writes it."""
    window = decode if window is None else window
    busy = busy if busy is not None else [0.5 * window] * 4
    return {"dataset": dataset, "line": line, "turn": turn, "mode": mode, "temperature": t, "ok": ok,
            "new_tokens": tokens,
            "decode_s": decode, "prefill_s": prefill, "steps": steps or tokens, "window_s": window,
            "stage_busy_s": busy, "leader_busy_s": 0.1 * window, "token_ids": ids or list(range(tokens)),
            "stats": stats}


# ------------------------------------------------------------------------------------------- arithmetic


def test_busy_time_counts_only_the_part_of_each_interval_inside_the_window():
    iv = [(0.0, 1.0), (1.5, 2.5), (2.8, 4.0), (5.0, 6.0)]
    assert rep.busy_within(iv, 0.5, 3.0) == pytest.approx(0.5 + 1.0 + 0.2)
    assert rep.clip(iv, 0.5, 3.0) == [[0.0, 0.5], [1.0, 2.0], [2.3, 2.5]]
    util, busy = rep.stage_utilization([iv, [(0.5, 3.0)], []], 0.5, 3.0)
    assert busy == pytest.approx([1.7, 2.5, 0.0])
    assert util == pytest.approx((1.7 + 2.5) / (3 * 2.5))
    assert rep.stage_utilization([iv], 1.0, 1.0)[0] == 0.0


def test_metrics_are_ratios_of_sums_decode_only_and_with_prefill():
    rs = [rec("flowspec", tokens=30, decode=1.0, prefill=0.5, steps=11, walks=7, busy=[0.9, 0.8, 0.7, 0.6]),
          rec("flowspec", tokens=10, decode=3.0, prefill=0.5, steps=5, walks=3, busy=[1.5, 1.5, 1.5, 1.5])]
    m = rep.metrics(rs)
    assert m["tokens_per_s"] == pytest.approx(40 / 4.0)  # not the mean of 30/s and 3.3/s
    assert m["e2e_tokens_per_s"] == pytest.approx(40 / 5.0)
    assert m["tau"] == pytest.approx(40 / 16)
    assert m["tokens_per_round"] == pytest.approx((40 - 2) / (7 + 3))
    assert m["utilization"] == pytest.approx((3.0 + 6.0) / (4 * 4.0))
    assert m["stage_utilization"] == pytest.approx([2.4 / 4, 2.3 / 4, 2.2 / 4, 2.1 / 4])
    assert m["leader_utilization"] == pytest.approx(0.1)
    assert m["prompts"] == 2
    chunk = rep.metrics([rec("chunk", tokens=21, steps=6)])  # rounds = steps - 1 without walks
    assert chunk["tokens_per_round"] == pytest.approx(20 / 5)


def test_walk_costs_are_mean_times_to_the_next_walk_by_outcome_over_all_requests():
    rs = [rec("flowspec", walks=5, continue_gap_s=0.3, continue_gaps=3, restart_gap_s=0.5, restart_gaps=1,
              trip_s=1.0, trips=4),
          rec("flowspec", walks=3, continue_gap_s=0.1, continue_gaps=1, continue_unsent_gap_s=0.25,
              continue_unsent_gaps=1)]
    m = rep.metrics(rs)
    assert m["walk_costs_ms"] == {"ms after continue": 100.0, "ms after unsent continue": 250.0,
                                  "ms after restart": 500.0, "live trip ms": 250.0}
    assert rep.metrics([rec("ar")])["walk_costs_ms"] == {}
    md = "\n".join(rep._diagnostics({"ar": rep.metrics([rec("ar")]), "flowspec": m}))
    assert "| walks | ms after continue | ms after unsent continue | ms after restart | live trip ms |" in md
    assert md.splitlines()[-1].endswith("| 8 | 100 | 250 | 500 | 250 |")  # the raw sums are not shown
    assert "continue_gap_s" not in md


def test_only_prompts_every_mode_finished_are_compared():
    rs = [rec(m, line=30) for m in MODES] + [rec("ar", line=31), rec("chunk", line=31)]  # flowspec missing
    rs += [rec("ar", line=32), rec("chunk", line=32), rec("flowspec", line=32, ok=False)]
    assert {(r["line"], r["mode"]) for r in rep.paired(rs, MODES)} == {(30, m) for m in MODES}


def test_speedups_per_mode_and_per_dataset():
    rs = []
    for ds, fs in (("gsm8k", 3.0), ("qa", 1.5)):
        rs += [rec("ar", ds, decode=4.0), rec("chunk", ds, decode=2.0), rec("flowspec", ds, decode=2.0 / fs)]
    table = rep.summarize(rs, MODES, ["gsm8k", "qa"])
    assert table["ar"]["speedup_vs_ar"] == pytest.approx(1.0)
    assert table["chunk"]["speedup_vs_ar"] == pytest.approx(2.0)
    assert table["flowspec"]["per_dataset"]["gsm8k"]["speedup_vs_chunk"] == pytest.approx(3.0)
    assert table["flowspec"]["per_dataset"]["qa"]["speedup_vs_chunk"] == pytest.approx(1.5)
    assert table["flowspec"]["per_dataset"]["qa"]["speedup_vs_ar"] == pytest.approx(3.0)
    overall = (40 / (2 / 3 + 2 / 1.5)) / (40 / 4.0)
    assert table["flowspec"]["speedup_vs_chunk"] == pytest.approx(overall, rel=1e-3)


def test_greedy_equality_counts_matching_prompts_and_locates_the_first_divergence():
    rs = [rec("ar", line=30, ids=[1, 2, 3, 4]), rec("ar", line=31, ids=[5, 6, 7]),
          rec("flowspec", line=30, ids=[1, 2, 3, 4]), rec("flowspec", line=31, ids=[5, 6, 9, 9]),
          rec("chunk", line=30, ids=[1, 2, 3]), rec("chunk", line=31, ids=[5, 6, 7]),
          rec("flowspec", line=32, t=1.0, ids=[0])]  # sampled: not compared
    eq = rep.greedy_equality(rs, MODES)
    assert eq["flowspec"]["matching"] == 1
    assert eq["flowspec"]["compared"] == 2
    assert eq["flowspec"]["first_divergence"] == {"dataset": "gsm8k", "line": 31, "turn": 0, "position": 2,
                                                  "ar": [7], "flowspec": [9, 9], "ar_tokens": 3, "flowspec_tokens": 4}
    assert eq["chunk"]["first_divergence"]["position"] == 3  # a prefix: diverges where the shorter one ends
    assert "ar" not in eq


def test_each_turn_of_a_conversation_is_its_own_request_in_pairing_and_equality():
    rs = [rec("ar", ids=[1, 2]), rec("ar", turn=1, ids=[3, 4]), rec("chunk", ids=[1, 2]),
          rec("chunk", turn=1, ids=[3, 5]), rec("flowspec", ids=[1, 2])]  # flowspec's turn 2 failed
    assert {(r["mode"], r["turn"]) for r in rep.paired(rs, MODES)} == {(m, 0) for m in MODES}
    eq = rep.greedy_equality(rs, MODES)
    assert (eq["chunk"]["matching"], eq["chunk"]["compared"]) == (1, 2)
    assert eq["chunk"]["first_divergence"]["turn"] == 1
    assert rep.record_key(rs[0]) != rep.record_key(rs[1])


# ----------------------------------------------------------------------------------------------- reports


SETUP = {"stages": 4, "link_mbps": 100.0, "link_latency_ms": 2.0, "slowdown": 5.0, "emulation": "emulated ...",
         "model_fingerprint": "abc", "draft_fingerprint": "def", "prompts_per_dataset": {"gsm8k": 1, "qa": 1},
         "temperatures": [0.0, 1.0], "max_tokens": 256, "host_cores": 2, "date": "2025-01-01", "git_commit": "x",
         "datasets": ["gsm8k", "qa"], "modes": MODES}


def synthetic_run():
    rs = []
    for t in (0.0, 1.0):
        for ds in ("gsm8k", "qa"):
            rs += [rec("ar", ds, t=t, decode=4.0), rec("chunk", ds, t=t, decode=2.0),
                   rec("flowspec", ds, t=t, decode=1.0 + t, walks=8)]
    return rs


def test_results_json_has_the_contract_keys():
    res = json.loads(json.dumps(rep.results(SETUP, synthetic_run())))
    assert {"setup", "modes", "by_temperature", "greedy_equality"} <= set(res)
    assert set(res["by_temperature"]) == {"0", "1"}
    assert res["modes"] == res["by_temperature"]["0"]["modes"]
    assert list(res["modes"]) == MODES
    keys = {"tokens_per_s", "e2e_tokens_per_s", "tau", "utilization", "speedup_vs_chunk", "speedup_vs_ar"}
    for block in res["by_temperature"].values():
        for m in block["modes"].values():
            assert keys | {"per_dataset"} <= set(m)
            assert set(m["per_dataset"]) == {"gsm8k", "qa"}
            for d in m["per_dataset"].values():
                assert keys <= set(d)
    assert res["modes"]["flowspec"]["speedup_vs_chunk"] == pytest.approx(2.0)
    assert res["by_temperature"]["1"]["modes"]["flowspec"]["speedup_vs_chunk"] == pytest.approx(1.0)
    assert res["greedy_equality"]["flowspec"]["matching"] == 2
    for k in ("stages", "link_mbps", "link_latency_ms", "slowdown", "emulation", "model_fingerprint",
              "draft_fingerprint", "prompts_per_dataset", "temperatures", "max_tokens", "host_cores", "date",
              "git_commit"):
        assert k in res["setup"]


def test_markdown_has_a_table_per_temperature_with_speedups_and_the_setup():
    md = rep.markdown(rep.results(SETUP, synthetic_run()))
    assert "## T = 0" in md
    assert "## T = 1" in md
    assert "emulated" in md
    assert "| flowspec | 20.00 | 13.33 |" in md  # ξ = 20 tokens / 1 s; e2e = 20 / 1.5 s
    assert "| 2.00x | 4.00x |" in md  # flowspec vs chunk, vs ar at T=0
    assert "| GSM8K |" in md
    assert "flowspec vs chunk" in md
    assert "2/2" in md  # greedy equality
    assert "| flowspec | – | 0.50 | 16 |" in md  # diagnostics: forward ms unknown, prefill per prompt, walks
    assert "Warning" not in md
    assert "Warning" in rep.markdown(rep.results({**SETUP, "load_average": 3.5}, synthetic_run()))


def test_charts_are_written(tmp_path):
    from flowspec_p2p.bench.charts import write_charts

    rs = synthetic_run()
    for r in rs[:3]:
        r["timeline"] = {"stages": [[[0.0, 0.2], [0.4, 0.9]]] * 4, "leader": [[0.2, 0.4]]}
        r["utilization"] = 0.7
    res = rep.results(SETUP, rs)
    written = write_charts(tmp_path, res, rs)
    assert written == ["speedup.png", "timeline_T0.png", "timeline_T0_zoom.png"]
    assert all((tmp_path / f).stat().st_size > 1000 for f in written)


# ------------------------------------------------------------------------------------------------ runner


def test_default_slowdown_keeps_the_devices_within_half_the_cores():
    assert default_slowdown(4, cores=2) == 5.0
    assert default_slowdown(4, cores=16) == 1.0
    assert default_slowdown(3, cores=4) == 2.0


def test_modes_are_interleaved_per_prompt_and_rotated():
    prompts = [Question("gsm8k", i, i, ("q",)) for i in (30, 31, 32)]
    plan = plan_requests(prompts, MODES, (0.0, 1.0))
    assert len(plan) == 18
    assert [m for _, _, m in plan[:9]] == ["ar", "chunk", "flowspec", "chunk", "flowspec", "ar", "flowspec", "ar",
                                           "chunk"]
    assert [t for t, _, _ in plan] == [0.0] * 9 + [1.0] * 9


def test_a_later_turn_carries_the_modes_own_earlier_replies():
    p = Question("mt_bench", 30, 111, ("first?", "second?"))
    assert conversation(p, []) == [{"role": "user", "content": "first?"}]
    assert conversation(p, ["one"]) == [{"role": "user", "content": "first?"},
                                        {"role": "assistant", "content": "one"},
                                        {"role": "user", "content": "second?"}]


def test_conversations_run_turn_by_turn_and_resume_skips_finished_turns(tmp_path, monkeypatch):
    sent = []

    def fake_post(url, body, timeout_s):
        sent.append(body)
        n = len(sent)
        stats = {"prompt_tokens": 5, "new_tokens": 2, "steps": 2, "tau": 1.0, "prefill_s": 0.1, "decode_s": 0.2,
                 "decode_started_at": 10.0 + n, "decode_finished_at": 10.2 + n, "token_ids": [n, n]}
        return {"choices": [{"finish_reason": "length", "message": {"content": f"reply{n}"}}], "stats": stats}

    cluster = SimpleNamespace(api_url="http://x", timelines=lambda since: [], agents=[SimpleNamespace(alive=True)])
    monkeypatch.setattr(bench, "_post", fake_post)
    cfg = bench.BenchConfig(out=tmp_path, temperatures=(0.0,), progress=False, max_tokens=2)
    prompts = [Question("mt_bench", 30, 111, ("first?", "second?"))]
    path = tmp_path / "records.jsonl"
    # an earlier run finished the first turn under ar only
    old = {"dataset": "mt_bench", "line": 30, "turn": 0, "mode": "ar", "temperature": 0.0, "ok": True,
           "text": "earlier reply"}
    records = [old]
    bench._run_requests(cluster, cfg, prompts, ["ar", "flowspec"], records, path)
    convs = [b for b in sent if b["max_tokens"] == 2]  # not the warm-up requests
    by_mode = {}
    for b in convs:
        by_mode.setdefault(b["decoding"], []).append(b["messages"])
    assert by_mode["ar"] == [[{"role": "user", "content": "first?"}, {"role": "assistant", "content": "earlier reply"},
                              {"role": "user", "content": "second?"}]]  # only the unfinished turn, after the old reply
    fs = by_mode["flowspec"]
    assert [len(m) for m in fs] == [1, 3]
    reply = next(r["text"] for r in records if r["mode"] == "flowspec" and r["turn"] == 0)
    assert fs[1][1] == {"role": "assistant", "content": reply}
    assert sorted((r["mode"], r["turn"]) for r in records) == [("ar", 0), ("ar", 1), ("flowspec", 0), ("flowspec", 1)]
    assert len(read_records(path)) == 3  # the new ones, appended


def test_record_from_a_response_and_stage_timelines():
    stats = {"mode": "flowspec", "prompt_tokens": 9, "new_tokens": 5, "steps": 3, "tau": 1.67, "prefill_s": 0.2,
             "decode_s": 2.0, "decode_started_at": 100.0, "decode_finished_at": 102.0, "leader_busy_s": 0.3,
             "walks": 2, "token_ids": [1, 2, 3, 4, 5], "leader_intervals": [[99.9, 100.1]]}
    resp = {"choices": [{"finish_reason": "length"}], "stats": stats}
    tls = [[{"start": 99.0, "end": 100.5, "compute_s": 0.1}, {"start": 101.0, "end": 101.5, "compute_s": 0.1}],
           [{"start": 100.0, "end": 102.0, "compute_s": 0.4}]]
    r = make_record(Question("qa", 30, 351, ("q",)), "flowspec", 0.0, resp, 2.3, tls, keep_timeline=True)
    assert r["stage_busy_s"] == pytest.approx([1.0, 2.0])
    assert r["utilization"] == pytest.approx(0.75)
    assert r["stage_compute_s"] == pytest.approx([0.1, 0.4])  # forwards that start inside the window
    assert r["stage_forwards"] == [1, 1]
    assert r["token_ids"] == [1, 2, 3, 4, 5]
    assert r["stats"] == {"mode": "flowspec", "walks": 2}
    assert r["timeline"] == {"stages": [[[0.0, 0.5], [1.0, 1.5]], [[0.0, 2.0]]], "leader": [[0.0, 0.1]]}
    assert r["seed"] == rep.seed_for("qa", 30)
    m = rep.metrics([r])
    assert m["tokens_per_round"] == pytest.approx(2.0)
    assert m["stage_forward_ms"] == pytest.approx(250.0)
    assert m["extras"] == {"walks": 2}


def test_resume_reads_finished_records_and_refuses_another_setup(tmp_path):
    path = tmp_path / "records.jsonl"
    path.write_text(json.dumps(rec("ar")) + "\n" + '{"dataset": "gsm8k", "li')  # a torn last line
    assert [r["mode"] for r in read_records(path)] == ["ar"]
    check_resume(SETUP, dict(SETUP))
    with pytest.raises(ConfigError, match="slowdown"):
        check_resume(SETUP, {**SETUP, "slowdown": 2.0})
    with pytest.raises(ConfigError, match="flowspec_config"):  # an A/B of FlowSpec settings is another setup
        check_resume(SETUP, {**SETUP, "flowspec_config": {"segment_cap": 1}})


def test_bench_help_and_defaults(capsys):
    from flowspec_p2p.cli import build_parser

    parser = build_parser()
    with pytest.raises(SystemExit):
        parser.parse_args(["bench", "--help"])
    text = capsys.readouterr().out
    for flag in ("--stages", "--link-mbps", "--link-latency-ms", "--slowdown", "--per-dataset", "--temperature",
                 "--max-tokens", "--out", "--modes", "--resume", "--flowspec-config"):
        assert flag in text
    a = parser.parse_args(["bench"])
    assert (a.stages, a.link_mbps, a.link_latency_ms, a.per_dataset, a.max_tokens) == (4, 100.0, 2.0, 20, 256)
    from flowspec_p2p.commands.bench import _floats

    assert _floats(a.temperature, (0.0, 1.0)) == (0.0, 1.0)
    assert _floats(["0,1", "0.7"], ()) == (0.0, 1.0, 0.7)


@pytest.mark.parametrize(("flag", "message"), [
    (["--flowspec-config", '{"segment_cap": 0}'], "flowspec.segment_cap"),
    (["--flowspec-config", '{"no_such_setting": 1}'], "no_such_setting"),
    (["--flowspec-config", "segment_cap=1"], "not JSON"),
    (["--flowspec-config", "[1]"], "JSON object"),
    (["--stages", "0"], "stages"),
])
def test_bad_bench_options_fail_with_the_reason_before_any_agent_starts(tmp_path, caplog, flag, message):
    from flowspec_p2p.cli import main

    assert main(["bench", "--out", str(tmp_path / "out"), *flag]) == 1
    assert message in caplog.text
    assert not (tmp_path / "out").exists()


# ------------------------------------------------------------------------------ leader and API hooks


def _emulated_context(**kw):
    from flowspec_p2p.decoding.context import LeaderParts, ModeContext, ThreadCompute
    from flowspec_p2p.decoding.settings import LeaderSettings
    from flowspec_p2p.ledger import Ledger
    from flowspec_p2p.model.sampling import SamplingParams
    from flowspec_p2p.pipeline.emulation import EmulatedCompute

    compute = EmulatedCompute(ThreadCompute(), **kw)
    parts = LeaderParts(head=None, drafter=None, settings=LeaderSettings(), compute=compute)
    return ModeContext(parts, None, "r", [1], SamplingParams(), 4, frozenset(), Ledger("x")), compute


async def test_leader_compute_is_slowed_down_like_a_stage():
    ctx, compute = _emulated_context(slowdown=3.0, basis="measured")
    t0 = time.perf_counter()
    assert await ctx.compute(time.sleep, 0.05) is None
    assert time.perf_counter() - t0 >= 0.15 - 0.01  # 0.05 s of compute + 2 x 0.05 s emulated wait
    (a, b), = ctx.busy
    assert b - a >= 0.14
    ctx.ledger.decoded(0.1)  # the decode window: 0.1 s, ending when the leader ends the attempt
    ctx.ledger.attempt_ended(time.time())
    e = ctx.ledger.extra
    assert e["decode_finished_at"] - e["decode_started_at"] == pytest.approx(0.1)
    assert 0.0 < e["leader_busy_s"] <= 0.1
    compute.close()


async def test_the_emulated_leader_is_one_device_for_every_request():
    """Two requests' calls at once take the sum of their emulated times: a call's emulated wait holds the device
    (it does not overlap the other call's compute)."""
    ctx, compute = _emulated_context(slowdown=4.0, basis="measured")
    t0 = time.perf_counter()
    await asyncio.gather(ctx.compute(time.sleep, 0.03), ctx.compute(time.sleep, 0.03))
    assert time.perf_counter() - t0 >= 2 * 4 * 0.03 - 0.01  # overlapped, it would be 0.03 + 4 x 0.03
    compute.close()


async def test_leader_slowdown_counts_the_cpu_time_it_used_not_host_contention(monkeypatch):
    import torch

    def spin(seconds: float) -> None:  # compute: uses the CPU the whole time
        c0 = time.thread_time()
        while time.thread_time() - c0 < seconds:
            pass

    monkeypatch.setattr(torch, "get_num_threads", lambda: 1)
    ctx, compute = _emulated_context(slowdown=3.0)
    await ctx.compute(spin, 0.05)
    await ctx.compute(time.sleep, 0.05)  # descheduled, as when other devices hold the host's cores: no CPU used
    (a, b), (c, d) = ctx.busy
    assert b - a >= 3 * 0.05 - 0.01
    assert d - c < 0.05 + 0.04  # not 3 x 0.05: waiting for a core is the host's contention, not the device's work
    compute.close()


async def test_api_returns_token_ids_decode_window_and_leader_timeline_on_request(tiny_llama):
    from flowspec_p2p.api.app import create_app
    from flowspec_p2p.decoding.ar import AR
    from flowspec_p2p.decoding.chunk import CHUNK
    from flowspec_p2p.decoding.leader import Leader
    from flowspec_p2p.decoding.loopback import LoopbackRing
    from flowspec_p2p.decoding.settings import LeaderSettings
    from flowspec_p2p.speculative.drafter import OracleDrafter

    from ..ring_fixtures import F64, ByteTokenizer, tiny_parts

    parts = tiny_parts(tiny_llama)
    leader = Leader(parts.head, ByteTokenizer(), drafter=OracleDrafter(parts.whole), modes=[AR, CHUNK],
                    settings=LeaderSettings(max_context=200))
    app = create_app(leader, lambda: {}, run_leader=False)
    body = {"messages": [{"role": "user", "content": "Hello there"}], "temperature": 0, "max_tokens": 10}
    async with (LoopbackRing(parts.stages, leader, hops="memory", wire_dtype=F64, capacity=200),
                TestClient(TestServer(app)) as client):
        plain = (await (await client.post("/v1/chat/completions", json={**body, "decoding": "ar"})).json())["stats"]
        assert "token_ids" not in plain
        assert "leader_intervals" not in plain
        assert plain["decode_started_at"] <= plain["decode_finished_at"] <= time.time()
        got = {}
        for mode in ("ar", "chunk"):
            r = await client.post("/v1/chat/completions", json={**body, "decoding": mode, "return_token_ids": True,
                                                                 "return_leader_timeline": True})
            got[mode] = (await r.json())["stats"]
        await asyncio.sleep(0)
    assert got["ar"]["token_ids"] == got["chunk"]["token_ids"]
    assert len(got["ar"]["token_ids"]) == got["ar"]["new_tokens"]
    s = got["chunk"]
    assert s["decode_finished_at"] - s["decode_started_at"] == pytest.approx(s["decode_s"], abs=1e-3)
    assert s["leader_intervals"]
    assert all(a <= b for a, b in s["leader_intervals"])
    assert s["leader_busy_s"] >= 0.0
