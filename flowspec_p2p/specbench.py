"""The Spec-Bench question sets (the six sets the FlowSpec paper evaluates on): where they are, and the one loader
every benchmark, the tree tuner and the draft trainer's exclusion list use.

Each ``<set>.jsonl`` line is a question: ``{"question_id": ..., "turns": ["first user turn", ...], ...}``. Lines
[30, 50) (0-based) of each set are the evaluation prompts (``EVAL_START``, ``EVAL_COUNT``); the tree tuner
calibrates on lines [0, ...); no Spec-Bench prompt is used for training.
"""

from __future__ import annotations

import json
from collections.abc import Iterable, Sequence
from dataclasses import dataclass
from pathlib import Path

from . import env
from .errors import ConfigError

DATASETS = ("mt_bench", "alpaca", "gsm8k", "humaneval", "qa", "sum")
PAPER_ORDER = ("mt_bench", "humaneval", "gsm8k", "alpaca", "sum", "qa")  # the paper's column order
EVAL_START = 30
EVAL_COUNT = 20


@dataclass(frozen=True)
class Question:
    dataset: str
    line: int  # 0-based line in <dataset>.jsonl
    question_id: int | str | None
    turns: tuple[str, ...]  # the user turns (a later turn is asked after the model's own earlier replies)

    @property
    def text(self) -> str:
        """The first user turn."""
        return self.turns[0]


def default_dir() -> Path:
    return env.spec_bench_dir()


def _lines(folder: Path | None, name: str) -> list[str]:
    path = Path(folder or default_dir()) / f"{name}.jsonl"
    try:
        return path.read_text().splitlines()
    except OSError as e:
        raise ConfigError(f"cannot read Spec-Bench set {path}: {e} (pass --data, or set {env.SPEC_BENCH})") from e


def load_questions(folder: Path | None, datasets: Iterable[str], start: int = EVAL_START, count: int = EVAL_COUNT,
                   turns: int | None = 1) -> list[Question]:
    """Lines [start, start + count) of each set, in set order, with up to ``turns`` user turns each (None: all)."""
    out = []
    for name in datasets:
        lines = _lines(folder, name)
        for i in range(start, min(start + count, len(lines))):
            q = json.loads(lines[i])
            out.append(Question(name, i, q.get("question_id"), tuple(q["turns"][:turns])))
    return out


def round_robin(folder: Path | None, datasets: Sequence[str], start: int = EVAL_START,
                count: int = EVAL_COUNT) -> list[Question]:
    """``count`` first-turn questions from lines [start, ...) of ``datasets``, taken one per set in turn."""
    per_set = [load_questions(folder, [name], start, 10**9) for name in datasets]
    out: list[Question] = []
    for i in range(max((len(v) for v in per_set), default=0)):
        out += [v[i] for v in per_set if i < len(v)]
    return out[:count]


def every_turn(folder: Path | None = None) -> list[str]:
    """Every turn of every question in every set under ``folder`` (the draft trainer keeps them all out)."""
    folder = Path(folder or default_dir())
    if not folder.is_dir():
        raise ConfigError(f"Spec-Bench folder {folder} not found (needed to keep its prompts out of training): "
                          f"set {env.SPEC_BENCH} to the folder holding its six <set>.jsonl files")
    out = []
    for path in sorted(folder.glob("*.jsonl")):
        for line in path.read_text().splitlines():
            if line.strip():
                out.extend(json.loads(line)["turns"])
    return out
