"""EAGLE data alignment, the unrolled (training-time-test) forward, and a short fit that learns."""

from __future__ import annotations

import shutil

import pytest
import torch

from flowspec_p2p.errors import ConfigError
from flowspec_p2p.model.torch_shard import TorchShard
from flowspec_p2p.model.weights import model_fingerprint, open_source
from flowspec_p2p.speculative.head import DraftBundle, DraftHead, find_draft
from flowspec_p2p.train.batchgen import BatchGenerator, Request
from flowspec_p2p.train.corpus import load_corpus, make_example
from flowspec_p2p.train.evaluate import evaluate
from flowspec_p2p.train.export import eval_indices, export, load_checkpoint
from flowspec_p2p.train.fit import FitConfig, checkpoint_vocab, example_loss, fit, load_target, prepare
from flowspec_p2p.train.store import FeatureStore
from flowspec_p2p.train.unroll import unrolled
from flowspec_p2p.types import LayerRange


def test_example_pairs_feature_t_with_token_t_plus_1():
    t, p, h = 20, 6, 4
    tokens = torch.arange(100, 100 + t)  # x_j = 100 + j
    feats = torch.arange(t - 1).float()[:, None].expand(t - 1, h)  # f_j = j
    ex = make_example(tokens, feats, p, None, max_prompt_context=2, max_len=100)
    c = ex.offset
    assert c == p - 1 - 2
    n = ex.features.shape[0]
    assert n == t - 2 - c  # pairs c..T-3
    for i in range(n):
        assert ex.features[i, 0] == c + i  # f_{c+i}
        assert ex.tokens[i + 1] == 100 + c + i + 1  # paired with x_{c+i+1}
        assert ex.targets[i, 0] == c + i + 1  # predicts f_{c+i+1} ...
        assert ex.tokens[i + 2] == 100 + c + i + 2  # ... whose greedy token is x_{c+i+2}
        assert bool(ex.valid[i]) == (c + i + 1 >= p)  # only features that predict answer tokens
    in_vocab = torch.ones(200, dtype=torch.bool)
    in_vocab[100 + p + 3] = False  # target f_{p+2} predicts x_{p+3}: not draftable
    ex2 = make_example(tokens, feats, p, in_vocab, 2, 100)
    assert not ex2.valid[p + 2 - c - 1]
    assert ex2.valid[p + 1 - c - 1]


@pytest.fixture(scope="module")
def peaked_llama(tmp_path_factory):
    """A tiny llama with larger weights than the shared fixture: its next-token distributions are peaked, so a
    head has something to learn (near-uniform targets leave the soft cross-entropy at its entropy floor)."""
    from tests.conftest import build_tiny_checkpoint

    folder = tmp_path_factory.mktemp("peaked") / "llama"
    build_tiny_checkpoint(folder, "llama", seed=5, initializer_range=0.4)
    return folder


@pytest.fixture(scope="module")
def tiny(peaked_llama):
    src = open_source(peaked_llama)
    shard = TorchShard.from_source(src, LayerRange(start=0, end=src.config.num_layers), embed=True, head=True,
                              dtype=torch.float64).eval()
    return src, shard


def test_unrolled_steps_equal_chain_drafting_with_a_kv_cache(tiny):
    src, _ = tiny
    head = DraftHead(src.config).reset_parameters(seed=3, std=0.2).double()
    g = torch.Generator().manual_seed(0)
    n, steps, h = 7, 3, src.config.hidden_size
    feats = torch.randn(n, h, generator=g, dtype=torch.float64)
    embeds = torch.randn(n + steps - 1, h, generator=g, dtype=torch.float64)
    outs = unrolled(head, feats, embeds, offset=5, steps=steps)
    for i in range(n):  # chain from start i: context pairs 0..i, then the head's own features
        cache = head.new_cache(32)
        x = head(feats[None, : i + 1], embeds[None, : i + 1], torch.arange(5, 6 + i)[None], cache)[0, -1]
        torch.testing.assert_close(outs[0][i], x)
        for k in range(1, steps):
            x = head(x[None, None], embeds[None, i + k : i + k + 1], torch.tensor([[5 + i + k]]), cache)[0, 0]
            torch.testing.assert_close(outs[k][i], x)


@pytest.fixture(scope="module")
def run(tiny, tmp_path_factory):
    """A self-distilled store from the tiny model, as `flowspec draft data` writes it."""
    src, shard = tiny
    root = tmp_path_factory.mktemp("run")
    store = FeatureStore(root / "features", hidden=src.config.hidden_size, target_fingerprint=model_fingerprint(src))
    g = torch.Generator().manual_seed(1)
    reqs = [Request(f"k{i}", torch.randint(3, 96, (int(torch.randint(2, 10, (1,), generator=g)),), generator=g)
                    .tolist(), temperature=0.0 if i % 4 else 1.0, seed=i) for i in range(40)]
    gen = BatchGenerator(shard, batch=8, max_new_tokens=20, stop_ids=frozenset(), max_prompt=16, stop_loops=False)
    for item in gen.run(reqs):
        store.add(item)
        if store.pending_tokens > 300:
            store.flush()
    store.flush()
    return root


def _cfg(root, model, **kw) -> FitConfig:
    base = dict(run_dir=root, model=str(model), steps=30, tokens_per_step=96, lr=1e-2, warmup=3, draft_vocab=64,
                max_prompt_context=4, ckpt_every=10, feature_weight=0.1, noise=0.0)
    return FitConfig(**{**base, **kw})


def _mean_loss(head, corpus, fz, cfg) -> tuple[float, float]:
    """-> (loss per target, step-0 top-1) over the whole corpus"""
    tot, n, hits = 0.0, 0, 0
    with torch.no_grad():
        for i in range(len(corpus)):
            ex = make_example(*corpus.conversation(i), fz.in_vocab, cfg.max_prompt_context, cfg.max_len)
            loss, s = example_loss(head, ex, fz, cfg, train=False)
            tot, n, hits = tot + float(loss), n + s.targets[0], hits + s.top1[0]
    return tot / n, hits / n


def test_fit_reduces_the_loss_resumes_and_exports(run, peaked_llama, tiny, tmp_path):
    src, _ = tiny
    cfg = _cfg(run, peaked_llama, steps=15)
    corpus, _, _, fz = prepare(cfg, load_target(cfg.model))
    assert fz.vocab is not None
    assert fz.vocab.numel() == 64
    before = _mean_loss(DraftHead(src.config).reset_parameters(cfg.seed), corpus, fz, cfg)
    fit(cfg, progress=False)
    cfg = _cfg(run, peaked_llama, steps=30)  # continues from the step-15 checkpoint
    head = fit(cfg, progress=False)
    assert torch.load(run / "ckpt" / "last.pt", weights_only=False)["step"] == 30
    after = _mean_loss(head, corpus, fz, cfg)
    assert after[0] < 0.9 * before[0], (before, after)  # loss per target
    assert after[1] > before[1] + 0.2, (before, after)  # step-0 top-1

    result = evaluate(head, corpus, list(range(8)), fz, cfg, depth=3)
    assert len(result["heldout_top1"]) == 3
    assert len(result["chain_accept"]) == 3
    assert 1.0 <= result["chain_tau"][3] <= 4.0

    stem = export(cfg, tmp_path / "drafts", "tiny-head", evaluation=result)
    assert find_draft(model_fingerprint(src), [tmp_path / "drafts"]) == stem
    assert find_draft("someone-else", [tmp_path / "drafts"]) is None
    bundle = DraftBundle.load(stem)
    assert bundle.meta["training"]["steps"] == 30
    assert bundle.meta["heldout_top1"] == result["heldout_top1"]
    assert bundle.meta["data"]["conversations"] == len(corpus.split(cfg.heldout_per_mille)[0])
    assert torch.equal(bundle.draft_vocab, fz.vocab)
    trained, _ = load_checkpoint(cfg, src.config)
    for (name, a), b in zip(trained.state_dict().items(), bundle.head.state_dict().values(), strict=True):
        assert b.dtype == torch.float32
        torch.testing.assert_close(b, a.half().float(), msg=name)

    # a different --draft-vocab at export (or resume) keeps the vocabulary the head was trained on, even with the
    # run's draft_vocab.pt gone or overwritten: the checkpoint records it
    (run / "draft_vocab.pt").unlink()
    other = export(_cfg(run, peaked_llama, steps=30, draft_vocab=32), tmp_path / "drafts", "tiny-head-2",
                   evaluation=result)
    assert torch.equal(DraftBundle.load(other).draft_vocab, fz.vocab)
    assert torch.equal(checkpoint_vocab(_cfg(run, peaked_llama, draft_vocab=32)), fz.vocab)
    state = torch.load(run / "ckpt" / "last.pt", weights_only=False)
    del state["draft_vocab"]  # a checkpoint from before the vocabulary was recorded, whose vocab file no longer fits
    torch.save(state, run / "ckpt" / "last.pt")
    torch.save(fz.vocab[:32], run / "draft_vocab.pt")
    with pytest.raises(ConfigError, match="no longer"):
        checkpoint_vocab(cfg)


def test_a_full_vocabulary_checkpoint_keeps_the_full_vocabulary_on_resume(run, peaked_llama, tmp_path):
    mine = tmp_path / "run"
    shutil.copytree(run / "features", mine / "features")
    (mine / "ckpt").mkdir()
    torch.save({"step": 3, "draft_vocab": None, "config": {"draft_vocab": 0}}, mine / "ckpt" / "last.pt")
    cfg = _cfg(mine, peaked_llama, draft_vocab=32)
    _, _, _, fz = prepare(cfg, load_target(cfg.model))
    assert fz.vocab is None  # not a fresh 32-token vocabulary under a head trained on every token
    assert not (mine / "draft_vocab.pt").exists()


def test_corpus_split_is_stable_and_disjoint(run):
    corpus = load_corpus(FeatureStore(run / "features"))
    train, held = corpus.split(heldout_per_mille=200)
    assert not set(train) & set(held)
    assert len(train) + len(held) == len(corpus)
    assert held
    assert corpus.split(heldout_per_mille=200) == (train, held)


def test_warm_start_takes_the_head_weights_and_a_fresh_vocabulary(run, peaked_llama, tmp_path):
    """--init-from: a new run starts from another run's trained head (its weights, not its optimiser, step or
    draft vocabulary), and a run that already has a checkpoint resumes from its own instead."""
    theirs, mine = tmp_path / "donor", tmp_path / "run"
    for d in (theirs, mine):
        shutil.copytree(run / "features", d / "features")
    fit(_cfg(theirs, peaked_llama, steps=10), progress=False)
    donor = theirs / "ckpt" / "last.pt"
    trained = torch.load(donor, weights_only=False)["head"]
    cfg = _cfg(mine, peaked_llama, steps=1, lr=1e-9, warmup=0, draft_vocab=32, init_from=donor)
    head = fit(cfg, progress=False)
    state = torch.load(mine / "ckpt" / "last.pt", weights_only=False)
    assert state["step"] == 1
    assert state["draft_vocab"].numel() == 32
    for name, w in head.state_dict().items():  # one step at lr 1e-9: still the donor's weights
        torch.testing.assert_close(w, trained[name], atol=1e-6, rtol=0, msg=name)
    meta = DraftBundle.load(export(cfg, tmp_path / "drafts", "warm", evaluation={})).meta
    assert meta["training"]["warm_start"] == {"from": "last.pt", "steps": 10}
    assert "teacher-forced" not in meta["data"]["source"]  # this run has no teacher-forced store
    with pytest.raises(ConfigError, match="no such checkpoint"):
        fit(_cfg(tmp_path / "other", peaked_llama, init_from=tmp_path / "missing.pt"), progress=False)


def test_also_features_trains_on_another_runs_store_too(run, peaked_llama, tmp_path):
    """--also-features DIR: a second self-distillation process's store joins the corpus (its conversations are
    trained on and held out like the run's own); a folder without a store is an error that names it."""
    mine, other = tmp_path / "mine", tmp_path / "other"
    shutil.copytree(run / "features", mine / "features")
    shutil.copytree(run / "features", other / "features")
    target = load_target(str(peaked_llama))
    alone = prepare(_cfg(mine, peaked_llama), target)[0]
    both, train, held, _ = prepare(_cfg(mine, peaked_llama, also_features=[other / "features"]), target)
    assert len(both) == 2 * len(alone)
    assert len(train) + len(held) == len(both)
    with pytest.raises(ConfigError, match="no feature store"):
        prepare(_cfg(mine, peaked_llama, also_features=[tmp_path / "nothing"]), target)


def test_evaluation_adds_only_the_conversations_the_fit_never_saw():
    """Held-out plus self-distilled conversations unseen by the fit, by key: listing the stores in another order
    (or another --also-features) at evaluation must not pull trained conversations in."""
    keys = ["a", "b", "x", "y", "new", "forced"]
    temps = [0.0, 1.0, 0.0, 0.0, 0.0, -1.0]  # -1: teacher-forced
    state = {"self_distilled_keys": ["a", "b", "x", "y"], "data": {"self_distilled_seen": 4}}
    assert eval_indices(keys, temps, [1], state) == [1, 4]
    reordered = ["new", "a", "b", "x", "y", "forced"]  # another store first: the count would pick "y" (trained)
    assert eval_indices(reordered, [0.0, 0.0, 1.0, 0.0, 0.0, -1.0], [2], state) == [0, 2]
    old = {"data": {"self_distilled_seen": 4}}  # a checkpoint from before keys were recorded: the count
    assert eval_indices(keys, temps, [1], old) == [1, 4]
    assert eval_indices(keys, temps, [1], {}) == [1]
