"""The self-distillation prompt pool: truncated-JSON parsing, filters, and exclusion of every Spec-Bench prompt."""

from __future__ import annotations

import json

from flowspec_p2p.specbench import every_turn
from flowspec_p2p.train.prompts import (
    Exclusion,
    build_pool,
    iter_json_array,
    normalise,
    stdlib_functions,
)


def _sharegpt(convs: list[tuple[str, str]]) -> str:
    objs = [{"id": f"c{i}", "conversations": [{"from": "human", "value": h}, {"from": "gpt", "value": g}]}
            for i, (h, g) in enumerate(convs)]
    return json.dumps(objs, indent=2)


def test_truncated_json_array_is_read_object_by_object_up_to_the_cut(tmp_path):
    text = _sharegpt([("first question here?", "a"), ("second question here?", "b"), ("third one", "c")])
    cut = text.index("third one") + 3  # mid-string, as the packaged ShareGPT file ends
    path = tmp_path / "sg.json"
    path.write_text(text[:cut])
    assert [o["id"] for o in iter_json_array(path)] == ["c0", "c1"]


def test_pool_excludes_every_spec_bench_prompt_exactly_and_normalised(tmp_path):
    bench = every_turn()
    assert len(bench) > 400
    article = "The quick brown fox writes long prose about many things. " * 20
    convs = [(b, article) for b in bench[::7]]  # verbatim
    convs += [("  " + b.upper().replace(" ", "  ") + " !", "ok") for b in bench[3::11]]  # case/space/punct
    convs += [("Please help: " + b, "ok") for b in bench[5::13] if len(normalise(b)) >= 24]  # contained
    convs += [("What is the capital of the country called France, please?", article),
              ("How do I write a binary search in Python?", "ok"),
              ("Write a short story about a lighthouse keeper who befriends a seagull and learns to cook.", "ok")]
    path = tmp_path / "sg.json"
    path.write_text(_sharegpt(convs))
    pool = build_pool(sharegpt=path, math_count=50)
    texts = [p.text for p in pool]
    ex = Exclusion(bench)
    norm_bench = {normalise(b) for b in bench}
    assert not set(texts) & set(bench)
    assert not {normalise(t) for t in texts} & norm_bench
    assert not any(ex.hit(t) for t in texts)
    assert "How do I write a binary search in Python?" in texts
    cats = {p.category for p in pool}
    assert cats == {"chat", "qa", "math", "code", "summary"}
    assert len({p.key for p in pool}) == len(pool)
    assert len({normalise(t) for t in texts}) == len(texts)  # deduplicated


def test_pool_is_deterministic_and_interleaves_categories(tmp_path):
    path = tmp_path / "sg.json"
    path.write_text(_sharegpt([(f"Question number {i}: how does topic {i} work?", "ok") for i in range(40)]))
    a = build_pool(sharegpt=path, math_count=40)
    b = build_pool(sharegpt=path, math_count=40)
    assert a == b
    assert {p.category for p in a[:30]} >= {"math", "code"}


def test_code_stubs_come_from_the_standard_library():
    stubs = stdlib_functions()
    assert len(stubs) > 300
    _name, stub = stubs[0]
    assert stub.startswith("def ")
    assert '"""' in stub
