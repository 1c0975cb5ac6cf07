"""bench-scale's parsing of the agents' logs and its report (the run itself is a benchmark: `flowspec bench-scale`)."""

from flowspec_p2p.bench.scale_parts import fetch_records, load_records, status_mb
from flowspec_p2p.bench.scale_report import markdown

LOG = """\
08:23:35 I flowspec_p2p.cluster.weight_server: fetching layers [21, 32): 264 of 1463 MB (18%), 52.5 MB/s, 23 s left
08:24:03 I flowspec_p2p.cluster.weight_server: range [21, 32): 101 tensors, 1463.4 MB, 1463.1 MB transferred in \
32.56 s (44.9 MB/s)
08:24:24 I flowspec_p2p.cluster.stage_host: epoch 1: layers [21, 32) ready to serve (fetched, 53.65 s, 1463.1 MB \
fetched)
"""


def test_fetches_and_loads_are_read_from_an_agents_log(tmp_path):
    log = tmp_path / "agent2.log"
    log.write_text(LOG)
    assert fetch_records(log) == [{"at": "08:24:03", "layers": [21, 32], "tensors": 101, "range_mb": 1463.4,
                                   "mb": 1463.1, "s": 32.56, "mb_s": 44.9}]
    assert load_records(log) == [{"at": "08:24:24", "epoch": 1, "layers": [21, 32], "source": "fetched",
                                  "load_s": 53.65, "fetched_mb": 1463.1}]
    assert status_mb("no plan: short by 509 MB: ...") == 509
    assert status_mb(None) is None


REPORT = {"setup": {"command": "flowspec bench-scale --model m.gguf", "agents": 3, "memory_mb": 2560, "context": 2048,
                    "max_tokens": 64, "runs": 3, "cpus": 2, "ram_gb": 23.5, "load1_start": 2.0, "load1_end": 3.0},
          "model": {"path": "m.gguf", "name": "synthetic", "bytes": 4.47e9, "layers": 32,
                    "largest_tensor_bytes": 50 << 20},
          "decode": {"sides": ["ours-ar", "llama.cpp-rpc"], "together": True,
                     "decode_tokens_per_s": {"ours-ar": 4.0, "llama.cpp-rpc": 2.0}, "vs_llama": {"ours-ar": 2.0},
                     "memory": {"ours": {"processes": [1, 2, 3], "rss_mb": 8000, "peak_mb": 8100}},
                     "equals_reference": True, "llama": None},
          "resume": {"range_mb": 1400, "held_at_kill_share": 0.51, "fetched_after_restart_mb": 690,
                     "fetched_after_restart_share": 0.49, "within_55pct": True, "others_alone": None},
          "no_plan": {"offered_mb_each": 1000, "status": 503, "no_plan": "no plan: short by 900 MB: ...",
                      "seconds": 20.0, "agents_that_loaded": []}}


def test_the_report_states_each_target_with_its_figure():
    md = markdown(REPORT)
    assert "| ours-ar | 4.00 | 2.00× |" in md
    assert "Target ≥ 1.5× llama.cpp: yes" in md
    assert "target ≤ 55%: yes" in md
    assert "`no plan: short by 900 MB: ...`" in md


def test_the_fetch_part_splits_layers_as_a_plan_of_this_host_and_reports_its_target():
    from flowspec_p2p.bench.scale_fetch import stage_ranges

    assert stage_ranges(32, 3) == [(0, 10), (10, 21), (21, 32)]
    assert stage_ranges(4, 4) == [(0, 1), (1, 2), (2, 3), (3, 4)]
    run = {"members": [{"mb_s": 150.0}, {"mb_s": 160.0}], "mb_s": 305.0, "member_cpu_s_per_gb": 1.9,
           "server_cpu_s_per_gb": 1.1, "load1": 4.2}
    md = markdown({**{k: REPORT[k] for k in ("setup", "model")},
                   "fetch": {"agents": 3, "ranges": [[10, 21], [21, 32]], "samples": [run], "median_mb_s": 305.0,
                             "median_member_cpu_s_per_gb": 1.9, "median_server_cpu_s_per_gb": 1.1,
                             "median_load1": 4.2}})
    assert "| 1 | 305 | 150 + 160 | 1.90 | 1.10 | 4.2 |" in md
    assert "target ≥ 300 MB/s: yes" in md
