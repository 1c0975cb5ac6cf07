"""The one Spec-Bench loader: the chosen lines of each set, their turns, round-robin order, clear errors."""

import json

import pytest

from flowspec_p2p.errors import ConfigError
from flowspec_p2p.specbench import Question, every_turn, load_questions, round_robin


def _write(folder, name, n):
    lines = [json.dumps({"question_id": 100 + i, "turns": [f"{name}{i}", "second"]}) for i in range(n)]
    (folder / f"{name}.jsonl").write_text("\n".join(lines) + "\n")


def test_questions_are_the_chosen_lines_with_up_to_the_asked_turns(tmp_path):
    _write(tmp_path, "qa", 40)
    got = load_questions(tmp_path, ("qa",), 30, 20)
    assert [(q.line, q.question_id, q.text, q.turns) for q in got] == [
        (i, 100 + i, f"qa{i}", (f"qa{i}",)) for i in range(30, 40)]
    assert load_questions(tmp_path, ("qa",), 30, 1, turns=2)[0].turns == ("qa30", "second")
    assert load_questions(tmp_path, ("qa",), 30, 1, turns=5)[0].turns == ("qa30", "second")  # as many as it has
    assert load_questions(tmp_path, ("qa",), 30, 1, turns=None)[0] == Question("qa", 30, 130, ("qa30", "second"))


def test_a_missing_set_says_how_to_point_at_the_folder(tmp_path):
    with pytest.raises(ConfigError, match="FLOWSPEC_SPEC_BENCH"):
        load_questions(tmp_path, ("gsm8k",), 30, 1)


def test_round_robin_takes_one_question_per_set_in_turn(tmp_path):
    _write(tmp_path, "qa", 33)
    _write(tmp_path, "sum", 31)
    got = round_robin(tmp_path, ("qa", "sum"), 30, 4)
    assert [q.text for q in got] == ["qa30", "sum30", "qa31", "qa32"]


def test_every_turn_of_every_set_is_listed(tmp_path):
    _write(tmp_path, "qa", 2)
    assert sorted(every_turn(tmp_path)) == ["qa0", "qa1", "second", "second"]
    with pytest.raises(ConfigError):
        every_turn(tmp_path / "missing")
