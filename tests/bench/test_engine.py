"""``flowspec bench-engine``: llama-bench's JSON parsed and its runs' arithmetic (a fake llama-bench in the real
binary's output shape), a child's own peak RSS, the report's medians, paired ratios, n-row costs and targets, our
side's measurements on a tiny model, and the command end to end on the packaged model with the fake binary."""

from __future__ import annotations

import json
import os
import stat
import sys
from pathlib import Path
from types import SimpleNamespace

import pytest
import torch

from flowspec_p2p import cli
from flowspec_p2p.bench import engine, llamacpp
from flowspec_p2p.bench import engine_report as rep
from flowspec_p2p.bench.paths import portable_path
from flowspec_p2p.errors import ConfigError
from flowspec_p2p.model.generate import ARDecoder
from flowspec_p2p.speculative.decoder import SpecDecoder
from flowspec_p2p.speculative.drafter import HeadDrafter, TreeShape

from ..speculative.test_drafter import random_head, tiny_target
from . import fake_llama_bench as fake

FAKE = Path(fake.__file__)


def _script(path: Path, body: str) -> Path:
    path.write_text(f"#!{sys.executable}\n{body}")
    path.chmod(path.stat().st_mode | stat.S_IXUSR)
    return path


@pytest.fixture
def llama_bin(tmp_path) -> Path:
    """A folder with a fake llama-bench (and a llama-cli that only exits) in it."""
    folder = tmp_path / "bin"
    folder.mkdir()
    _script(folder / "llama-bench", f"import runpy\nrunpy.run_path({str(FAKE)!r}, run_name='__main__')\n")
    _script(folder / "llama-cli", "import sys\nsys.exit(0)\n")
    return folder


@pytest.fixture(autouse=True)
def one_thread():
    n = torch.get_num_threads()
    yield
    torch.set_num_threads(n)


# ------------------------------------------------------------------------------------------------ llama.cpp


def test_llama_bench_json_keeps_each_tests_sizes_and_speed():
    args = SimpleNamespace(m="m.gguf", t=2, d=65, r=3)
    text = "some log line\n" + json.dumps([fake.test(args, 8, 0), fake.test(args, 0, 128)])
    tests = llamacpp.parse_bench_json(text)
    assert [(t["n_prompt"], t["n_gen"], t["n_depth"], t["n_threads"]) for t in tests] == [(8, 0, 65, 2),
                                                                                         (0, 128, 65, 2)]
    assert llamacpp.decode_tokens_per_s(tests) == pytest.approx(1 / fake.TG_S)
    assert llamacpp.batch_seconds(tests) == pytest.approx({8: fake.PP_S * (1 + 7 * fake.PP_GROWTH)})


@pytest.mark.parametrize("text", ["", "not json", "[{\"n_prompt\": 1}]", "{\"a\": 1}"])
def test_unreadable_llama_bench_output_is_a_config_error(text):
    with pytest.raises(ConfigError):
        llamacpp.parse_bench_json(text)


def test_runs_of_the_fake_binary_give_tg_speed_and_pp_batch_costs(llama_bin, tmp_path, monkeypatch):
    monkeypatch.setenv("FAKE_LLAMA_LOG", str(tmp_path / "calls"))
    exe = llama_bin / "llama-bench"
    tests, peak = llamacpp.run_bench(exe, Path("m.gguf"), threads=1, prompt=(1, 2, 16), depth=40, repeats=3)
    costs = llamacpp.batch_seconds(tests)
    assert {n: c / costs[1] for n, c in costs.items()} == pytest.approx({1: 1.0, 2: 1.25, 16: 4.75})
    tests, _ = llamacpp.run_bench(exe, Path("m.gguf"), threads=2, gen=128, depth=40)
    assert llamacpp.decode_tokens_per_s(tests) == pytest.approx(50.0)
    assert peak > 0
    calls = [json.loads(line) for line in (tmp_path / "calls").read_text().splitlines()]
    assert calls[0] == ["-m", "m.gguf", "-t", "1", "-p", "1,2,16", "-n", "0", "-d", "40", "-r", "3", "-o", "json"]
    assert calls[1][calls[1].index("-p") + 1] == "0"
    assert calls[1][calls[1].index("-n") + 1] == "128"
    assert llamacpp.version(exe).startswith("version: 0.0.0-fake")


def test_llama_bench_is_the_given_binary_or_the_one_on_path(llama_bin, tmp_path, monkeypatch):
    with pytest.raises(ConfigError, match="not an executable file"):
        llamacpp.find_llama_bench(tmp_path / "missing")
    monkeypatch.setenv("PATH", str(tmp_path))
    assert llamacpp.find_llama_bench(None) is None
    monkeypatch.setenv("PATH", str(llama_bin))
    assert llamacpp.find_llama_bench(None) == llama_bin / "llama-bench"
    assert llamacpp.find_llama_cli(llama_bin / "llama-bench") == llama_bin / "llama-cli"


def test_a_childs_peak_rss_is_its_own_not_the_parents():
    held = torch.ones(256 * 2**20 // 4)  # 256 MiB this process holds while the child runs
    small = llamacpp.run_peak([sys.executable, "-S", "-c", "pass"])
    big = llamacpp.run_peak([sys.executable, "-S", "-c", "b = bytearray(96 * 2**20)"])
    del held
    assert small.returncode == big.returncode == 0
    assert small.peak_mb < 60
    assert 96 < big.peak_mb < 96 + 60
    failed = llamacpp.run_peak(["/nonexistent/binary"])
    assert failed.returncode == 127
    assert "No such file" in failed.stderr


# ------------------------------------------------------------------------------------------------- report


def _decode(engine, threads, repeat, tps, tau=1.0):
    return {"part": "decode", "engine": engine, "threads": threads, "repeat": repeat, "tokens_per_s": tps,
            "tau": tau, "decoded": 128}


def test_decode_ratios_are_medians_of_the_ratios_paired_within_a_repeat():
    samples = [_decode("ours-ar", 1, 0, 100), _decode("llama.cpp", 1, 0, 50),  # 2.0
               _decode("ours-ar", 1, 1, 90), _decode("llama.cpp", 1, 1, 60),  # 1.5
               _decode("ours-ar", 1, 2, 200), _decode("llama.cpp", 1, 2, 40),  # 5.0 (a noisy repeat)
               {**_decode("ours-spec", 1, 0, 120, 2.0), "draft_share": 0.2},
               {**_decode("ours-spec", 1, 1, 110, 2.4), "draft_share": 0.4}]
    d = rep.decode_summary(samples)["1"]
    assert d["tokens_per_s"] == {"ours-ar": 100, "llama.cpp": 50, "ours-spec": 115}
    assert d["vs_llama"]["ours-ar"] == pytest.approx(2.0)
    assert d["vs_llama"]["ours-spec"] == pytest.approx((2.4 + 110 / 60) / 2)  # repeats 0 and 1 only
    assert d["spec_vs_ar"] == pytest.approx((1.2 + 110 / 90) / 2)
    assert d["tau"]["ours-spec"] == pytest.approx(2.2)
    assert d["vs_llama_range"]["ours-ar"] == pytest.approx([1.5, 5.0])
    assert d["draft_share"] == {"ours-spec": pytest.approx(0.3)}
    assert d["repeats"] == 3
    alone = rep.decode_summary([_decode("ours-ar", 2, 0, 10)])["2"]
    assert alone["vs_llama"] == {}
    assert alone["spec_vs_ar"] is None


def test_row_costs_are_relative_to_the_median_one_row_forward():
    samples = [{"part": "rows", "engine": e, "threads": 1, "repeat": r, "n": n, "seconds": s * f}
               for r, f in enumerate((1.0, 1.1, 0.9)) for e, k in (("ours-head-last", 1.2), ("llama.cpp", 3.0))
               for n, s in ((1, 0.01), (8, 0.01 * k))]
    rows = rep.rows_summary(samples)["1"]
    assert rows["ours-head-last"]["1"] == {"ms": pytest.approx(10.0), "relative": pytest.approx(1.0)}
    assert rows["ours-head-last"]["8"]["relative"] == pytest.approx(1.2)
    assert rows["llama.cpp"]["8"]["relative"] == pytest.approx(3.0)


def test_memory_is_measured_above_the_baseline_in_multiples_of_the_file():
    mem = [{"name": "baseline", "threads": None, "peak_mb": 240.0, "returncode": 0},
           {"name": "ours-ar", "threads": 1, "peak_mb": 390.0, "returncode": 0},
           {"name": "llama-bench", "threads": 1, "peak_mb": 130.0, "returncode": 0}]
    m = rep.memory_summary(mem, 100.0)
    assert m["baseline_mb"] == 240.0
    ours, llama = m["rows"]
    assert ours["over_baseline_mb"] == 150.0
    assert ours["over_baseline_x_file"] == pytest.approx(1.5)
    assert "over_baseline_mb" not in llama
    assert llama["x_file"] == pytest.approx(1.3)


def test_markdown_has_the_tables_and_the_targets(tmp_path):
    samples = [_decode("ours-ar", 1, 0, 120), _decode("llama.cpp", 1, 0, 60)]
    samples += [{"part": "rows", "engine": "ours-head-last", "threads": 1, "repeat": 0, "n": n, "seconds": s}
                for n, s in ((1, 0.01), (8, 0.0125), (16, 0.02))]
    mem = [{"name": "baseline", "threads": None, "peak_mb": 240.0, "returncode": 0},
           {"name": "ours-ar", "threads": 1, "peak_mb": 500.0, "returncode": 0}]
    setup = {"command": "flowspec bench-engine", "model_name": "m.gguf", "file_mb": 100.0, "engine": "native",
             "prompt_label": "--prompt", "prompt_tokens": 20, "tokens": 128, "tree": None, "repeats": 1,
             "llama_bench": "/x/llama-bench", "llama_build": "v", "num_layers": 30, "tree_fanout": 4}
    samples[0]["load1"] = 1.5
    res = rep.summarize(setup, {"samples": samples, "memory": mem, "load": {"start": 1.0, "end": 2.0}})
    md = rep.markdown(res)
    assert "1.0 at the start, 2.0 at the end, 1.5 median over the decode runs" in md
    assert "| 1 | 120.0 | 60.0 | **2.00×** |" in md
    assert "Per-repeat ratios to llama.cpp, lowest–highest: 1 thread(s): ours-ar 2.00–2.00×." in md
    assert "| 8 | 12.50 (1.25×) |" in md
    assert "decode, 1 thread(s): ours-ar ÷ llama.cpp 2.00× (target ≥ 1.0×): met" in md
    assert "n = 8 rows, 1 thread(s): 1.25× one row (target ≤ 1.3×): met" in md
    assert "n = 16 rows, 1 thread(s): 2.00× one row (target ≤ 1.6×): not met" in md
    assert "baseline + 2.60× the file (target ≤ 1.5×): not met" in md
    j, m = rep.write_outputs(tmp_path, res)
    assert json.loads(j.read_text())["summary"]["decode"]["1"]["vs_llama"]["ours-ar"] == pytest.approx(2.0)
    assert m.read_text().startswith("# bench-engine")


# ------------------------------------------------------------------------------------------- our side


@pytest.fixture(scope="module")
def tiny_ours(tiny_llama):
    target = tiny_target(tiny_llama, torch.float32)
    drafter = HeadDrafter(random_head(target).float(), target)
    shape = TreeShape(total_tokens=6, depth=4, top_k=4)
    decoders = {"ours-ar": ARDecoder(target), "ours-spec": SpecDecoder(target, drafter, shape)}
    return engine.Ours(SimpleNamespace(shard=target), [5, 17, 33, 8, 41], decoders, shape)


@pytest.mark.parametrize("name", ["ours-ar", "ours-spec"])
def test_a_decode_sample_decodes_exactly_the_asked_tokens(tiny_ours, name):
    s = engine.decode_sample(tiny_ours.decoders[name], tiny_ours.prompt_ids, 12)
    assert s["decoded"] == 12
    assert s["tokens_per_s"] > 0
    assert s["tau"] >= 1.0
    assert ("draft_share" in s) == (name == "ours-spec")


def test_row_samples_time_every_size_over_the_same_context(tiny_ours):
    got = engine.row_samples(tiny_ours, (1, 3, 8), passes=2)
    assert set(got) == {"ours-layers", "ours-head-last", "ours-head-all"}
    for per in got.values():
        assert set(per) == {1, 3, 8}
        assert min(per.values()) > 0
    pos, mask = engine.tree_inputs(6, 10)
    assert pos.tolist() == [[10, 11, 11, 11, 11, 12]]  # node 5's parent is node 1
    assert mask.shape == (1, 6, 16)
    assert mask[0, :, :10].all()
    assert mask[0, 5, 10:].tolist() == [1, 1, 0, 0, 0, 1]


def test_memory_jobs_run_generate_in_each_mode_and_llama_cpp_at_each_thread_count(tiny_ours, llama_bin):
    cfg = engine.EngineBenchConfig(model=Path("m.gguf"), threads=(1, 2), repeats=1, tokens=16, prompt="Hi",
                                   prompt_label="--prompt", rows=(1,), llama_bench=llama_bin / "llama-bench")
    jobs = engine.memory_jobs(cfg, tiny_ours)
    assert [(j.name, j.threads) for j in jobs] == [("baseline", None)] + [
        (n, t) for t in (1, 2) for n in ("ours-ar", "ours-spec", "ours-auto", "llama-bench", "llama-cli")]
    for job, mode in ((jobs[2], "spec"), (jobs[3], "auto")):  # both with the decode part's tree
        assert job.argv[job.argv.index("--mode") + 1] == mode
        assert job.argv[job.argv.index("--tree-tokens") + 1] == "6"
    assert jobs[1].argv[jobs[1].argv.index("--max-tokens") + 1] == "17"  # the prefill's token + 16 decoded
    cli_run = jobs[5].run()
    assert cli_run["name"] == "llama-cli"
    assert cli_run["returncode"] == 0
    assert cli_run["peak_mb"] > 0


# ------------------------------------------------------------------------------------------------ command


def test_bench_engine_help_lists_its_flags(capsys):
    with pytest.raises(SystemExit):
        cli.main(["bench-engine", "--help"])
    out = capsys.readouterr().out
    for flag in ("--model", "--threads", "--llama-bench", "--repeats", "--tokens", "--prompt", "--rows", "--out",
                 "--no-progress"):
        assert flag in out


@pytest.mark.parametrize(("argv", "message"), [(["nope"], "unknown part"), (["--threads", "1,x"], "--threads"),
                                           (["--rows", "0,2"], "--rows"), (["--llama-bench", "/nope"], "executable")])
def test_bad_options_fail_with_the_reason(argv, message, caplog, tmp_path):
    assert cli.main(["bench-engine", *argv, "--prompt", "Hi", "--out", str(tmp_path)]) == 1
    assert message in caplog.text


@pytest.mark.slow
def test_the_command_measures_ours_and_the_fake_llama_bench_and_writes_both_files(llama_bin, tmp_path,
                                                                                  monkeypatch):
    monkeypatch.setenv("PATH", f"{llama_bin}{os.pathsep}{os.environ['PATH']}")
    out = tmp_path / "out"
    rc = cli.main(["-q", "bench-engine", "decode", "rows", "--threads", "1", "--repeats", "2", "--tokens", "4",
                   "--rows", "1,2", "--prompt", "Name a colour.", "--out", str(out), "--no-progress"])
    assert rc == 0
    res = json.loads((out / "results.json").read_text())
    assert res["setup"]["llama_bench"] == portable_path(llama_bin / "llama-bench")  # relative to the repository
    d = res["summary"]["decode"]["1"]
    assert set(d["tokens_per_s"]) == {"ours-ar", "ours-spec", "llama.cpp"}
    assert d["tokens_per_s"]["llama.cpp"] == pytest.approx(1 / fake.TG_S)
    assert d["vs_llama"]["ours-ar"] > 0
    rows = res["summary"]["rows"]["1"]
    assert rows["llama.cpp"]["2"]["relative"] == pytest.approx(1 + fake.PP_GROWTH)
    assert set(rows) == {"ours-layers", "ours-head-last", "ours-head-all", "llama.cpp"}
    assert len([s for s in res["samples"] if s["part"] == "decode"]) == 2 * 3
    assert "## Decode tokens/s" in (out / "results.md").read_text()
