"""`flowspec draft train --minutes`: the phases' time shares and their resumption, a fit that stops on time, a
warm start from an exported bundle, the draft vocabulary sized by measurement, held-out-first prompts and the
per-category evaluation."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from flowspec_p2p.speculative.head import DraftBundle, DraftHead
from flowspec_p2p.train import budget
from flowspec_p2p.train.corpus import coverage_table, is_heldout, size_for_coverage
from flowspec_p2p.train.data import DataConfig, _part
from flowspec_p2p.train.evaluate import evaluate
from flowspec_p2p.train.export import export, run_eval
from flowspec_p2p.train.fit import FitConfig, fit, load_target, prepare
from flowspec_p2p.train.prompts import Prompt, save_pool
from flowspec_p2p.train.store import FeatureStore

from .test_fit import _cfg, peaked_llama, run, tiny  # noqa: F401  (fixtures)


def fit_mod_head(model) -> DraftHead:
    """An untrained head for ``model`` (random weights, std 0.5: it drafts badly)."""
    return DraftHead(load_target(str(model)).cfg).reset_parameters(seed=3, std=0.5)


def test_the_draft_vocabulary_is_the_fewest_tokens_that_cover_the_goal():
    counts = torch.zeros(5000, dtype=torch.long)
    counts[:1500] = 10  # 15,000 of 15,000 + 3,500 = 18,500 counted tokens
    counts[1500:] = 1
    assert size_for_coverage(counts, 0.5) == 1024  # 1,024 x 10 = 55% of the tokens
    assert size_for_coverage(counts, 0.8) == 2048  # 1,500 x 10 + 0.5k = 84%; 1,024 tokens = 55%
    assert size_for_coverage(counts, 1.0) == 5000  # never beyond the vocabulary
    measured = torch.zeros(5000, dtype=torch.long)  # held-out answers: half their tokens are rare in training
    measured[:10] = 1
    measured[4990:] = 1
    assert size_for_coverage(counts, 0.5, measured) == 1024
    assert size_for_coverage(counts, 0.9, measured) == 5000
    assert coverage_table(counts, (1024,), measured) == {1024: 0.5, 5000: 1.0}
    table = coverage_table(counts, sizes=(1024, 4096))
    assert table == {1024: round(10240 / 18500, 4), 4096: round((15000 + 2596) / 18500, 4), 5000: 1.0}


def test_held_out_prompts_can_come_first_or_alone(tmp_path):
    pool = [Prompt(f"chat:{i}", "chat", f"q{i}") for i in range(400)]
    held = [p for p in pool if is_heldout(p.key)]
    assert 5 < len(held) < 60
    only = _part(pool, DataConfig(run_dir=tmp_path, prompts=5, heldout_only=True))
    assert only == held[:5]
    first = _part(pool, DataConfig(run_dir=tmp_path, prompts=10, heldout_first=3))
    assert first[:3] == held[:3]
    assert first[3:] == [p for p in pool[:10] if p not in held[:3]]


def test_fit_stops_on_its_time_budget_and_a_rerun_does_not_train_past_it(run, peaked_llama, tmp_path):  # noqa: F811
    mine = tmp_path / "run"
    shutil.copytree(run / "features", mine / "features")
    cfg = _cfg(mine, peaked_llama, steps=10**6, max_seconds=1.5, bf16=True, bf16_block=True)
    fit(cfg, progress=False)
    state = torch.load(mine / "ckpt" / "last.pt", weights_only=False)
    assert 1 <= state["step"] < 10**6
    assert 1.5 <= state["train_seconds"] < 30
    fit(cfg, progress=False)  # the budget is spent: nothing more
    assert torch.load(mine / "ckpt" / "last.pt", weights_only=False)["step"] == state["step"]


def test_warm_start_from_an_exported_bundle_and_evaluate_a_bundle_per_category(run, peaked_llama, tmp_path):  # noqa: F811
    donor_run, mine = tmp_path / "donor", tmp_path / "run"
    for d in (donor_run, mine):
        shutil.copytree(run / "features", d / "features")
    fit(_cfg(donor_run, peaked_llama, steps=8), progress=False)
    stem = export(_cfg(donor_run, peaked_llama, steps=8), tmp_path / "drafts", "donor", evaluation={})
    donor = DraftBundle.load(stem)
    cfg = _cfg(mine, peaked_llama, steps=1, lr=1e-9, warmup=0, init_from=stem.with_suffix(".json"))
    head = fit(cfg, progress=False)
    for name, w in head.state_dict().items():  # float16 weights, one step at lr 1e-9: the donor's
        torch.testing.assert_close(w, donor.head.state_dict()[name], atol=1e-6, rtol=0, msg=name)
    assert torch.load(mine / "ckpt" / "last.pt", weights_only=False)["warm_start"] == {"from": "donor.json",
                                                                                       "steps": 8}

    # every conversation held out, two categories in the pool
    keys = [k for n in FeatureStore(mine / "features").shard_names()
            for k in json.loads((mine / "features" / f"{n}.keys.json").read_text())]
    save_pool([Prompt(k, "math" if i % 2 else "chat", "x") for i, k in enumerate(keys)], mine / "pool.jsonl")
    ecfg = _cfg(mine, peaked_llama, heldout_per_mille=1000)
    got = run_eval(ecfg, depth=3, progress=False, bundle=stem)
    assert (mine / "eval-donor.json").is_file()
    assert set(got["by_group"]) <= {"chat", "math", "other"}
    assert "chat" in got["by_group"]
    assert sum(g["heldout_targets"] for g in got["by_group"].values()) == got["heldout_targets"]
    # the same figures as evaluating the bundle's head directly on its own vocabulary
    corpus, _, held, fz = prepare(ecfg, load_target(ecfg.model))
    assert torch.equal(fz.vocab, donor.draft_vocab)  # the donor run's vocabulary was counted on the same store
    direct = evaluate(donor.head, corpus, held, fz, ecfg, depth=3)
    assert direct["heldout_top1"] == got["heldout_top1"]

    # draft train ships the better of the fine-tune and its donor on the held-out conversations
    fp = DraftBundle.load(stem).meta["target_fingerprint"]
    bad = tmp_path / "other" / "bad"
    DraftBundle(fit_mod_head(peaked_llama), donor.draft_vocab, {"target_fingerprint": fp}).save(bad)
    kept = budget.keep_better(ecfg.model_copy(update={"init_from": stem.with_suffix(".json")}), bad, progress=False)
    assert kept["kept"] == "donor"
    shipped = DraftBundle.load(bad)
    assert shipped.meta["target_fingerprint"] == fp
    assert shipped.meta["kept_donor"]["from"] == "donor.json"
    for name, w in shipped.head.state_dict().items():
        torch.testing.assert_close(w, donor.head.state_dict()[name], msg=name)
    assert budget.keep_better(ecfg.model_copy(update={"init_from": stem.with_suffix(".json")}), stem,
                              progress=False)["kept"] == "trained"  # a tie keeps the trained head

    # draft train's warm start: a head whose target config is the model's, else none
    assert budget.same_architecture_head(str(peaked_llama), [tmp_path / "drafts"]) == stem
    assert budget.same_architecture_head(str(peaked_llama), [tmp_path / "nothing"]) is None


def test_draft_vocab_auto_writes_its_measurement_and_may_keep_a_donors(run, peaked_llama, tmp_path,  # noqa: F811
                                                                        monkeypatch):
    from flowspec_p2p.train import fit as fit_mod

    mine = tmp_path / "run"
    shutil.copytree(run / "features", mine / "features")
    cfg = _cfg(mine, peaked_llama, draft_vocab=0, vocab_coverage=0.9)
    _, _, _, fz = prepare(cfg, load_target(cfg.model))
    table = json.loads((mine / "draft_vocab.json").read_text())
    assert table["size"] == fz.vocab.numel() <= 128  # the tiny model's whole vocabulary, at most
    assert table["coverage_goal"] == 0.9

    # a warm start from a bundle whose vocabulary covers every held-out answer token keeps that vocabulary
    from flowspec_p2p.train import corpus as corpus_mod

    monkeypatch.setattr(fit_mod, "MIN_MEASURED_TOKENS", 1)
    monkeypatch.setattr(corpus_mod, "VOCAB_STEP", 8)  # sizes below the tiny model's 96 tokens
    head = DraftBundle(fit_mod.DraftHead(load_target(cfg.model).cfg), torch.arange(96), {"target_fingerprint": "x"})
    head.save(tmp_path / "donor")
    (mine / "draft_vocab.pt").unlink()
    cfg = _cfg(mine, peaked_llama, draft_vocab=0, vocab_coverage=0.5, heldout_per_mille=300,
               init_from=tmp_path / "donor.json")
    _, _, _, fz = prepare(cfg, load_target(cfg.model))
    table = json.loads((mine / "draft_vocab.json").read_text())
    assert table["donor_heldout"] == 1.0
    assert table["counted_heldout"] < 1.0  # half the held-out tokens were asked for: fewer than all 96 tokens
    assert torch.equal(fz.vocab, torch.arange(96))


def test_train_gives_each_phase_what_is_left_of_its_share(tmp_path, monkeypatch):
    calls = []

    def fake_data(cfg, progress=True):
        calls.append((cfg.source, cfg.heldout_first, round(cfg.max_seconds)))
        store = cfg.run_dir / ("features" if cfg.source == "generate" else "fixed")
        store.mkdir(parents=True, exist_ok=True)
        (store / "manifest.json").write_text(json.dumps({"hidden": 8, "shards": [], "seconds": cfg.max_seconds}))

    monkeypatch.setattr(budget, "generate_data", fake_data)
    monkeypatch.setattr(budget, "fit", lambda cfg, progress=True: calls.append(("fit", round(cfg.max_seconds))))
    monkeypatch.setattr(budget, "sharegpt_available", lambda: True)
    monkeypatch.setattr(budget, "same_architecture_head", lambda model: None)
    data = DataConfig(run_dir=tmp_path)
    fitting = FitConfig(run_dir=tmp_path)
    out = budget.train(data, fitting, minutes=10, progress=False)
    assert out.max_seconds == 180
    assert calls == [("generate", budget.HELDOUT_FIRST, 180), ("sharegpt", 0, 210), ("fit", 180)]
    calls.clear()
    budget.train(data, fitting, minutes=10, progress=False)  # all spent: only the fit (which stops at once)
    assert calls == [("fit", 180)]
    calls.clear()
    budget.train(data, fitting, minutes=20, progress=False)  # a larger budget: each data phase gets the rest
    assert calls == [("generate", budget.HELDOUT_FIRST, 180), ("sharegpt", 0, 210), ("fit", 360)]


def test_draft_train_parses_minutes_and_auto_vocab():
    from flowspec_p2p.cli import build_parser

    args = build_parser().parse_args(["draft", "train", "--model", "/m/other.gguf", "--minutes", "5"])
    assert args.minutes == 5
    assert args.draft_vocab == "auto"
    from flowspec_p2p.commands.draft import _fit_config, _name

    cfg = _fit_config(args)
    assert cfg.vocab_coverage is not None
    assert cfg.warmup == 20
    assert _name(args) == "other-eagle"
    assert not args.no_warm_start
    with pytest.raises(SystemExit):
        build_parser().parse_args(["draft", "fit", "--draft-vocab", "many"])
