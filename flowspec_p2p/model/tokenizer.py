"""Tokenizer and chat template from the model's own source, and incremental detokenisation with stop strings.

The tokenizer runs on the ``tokenizers`` library (transformers' own wrapper keeps tens of MB of Python-side
vocabulary we never use); the chat template renders with jinja2 in a sandbox set up as transformers sets up its
own. transformers converts a GGUF file's tokenizer once (slowly: ~6 s); the converted files are cached under
the cache folder's ``tokenizers/`` (BPE merges in their compact form, half the memory to load) so later starts take
well under a second. A checkpoint folder without a
``tokenizer.json`` falls back to transformers' tokenizer. ``tokenizers`` and jinja2 are imported when a tokenizer
is loaded (5 MB of a member stage's resident set otherwise: members never tokenize).
"""

from __future__ import annotations

import datetime
import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path
from typing import TYPE_CHECKING

from .. import env
from ..errors import ConfigError

if TYPE_CHECKING:
    import jinja2
    import tokenizers

log = logging.getLogger(__name__)

SPECIAL_TOKENS = ("bos_token", "eos_token", "unk_token", "pad_token")


CACHE_FORMAT = 2  # of the converted tokenizers' folder (2: compact BPE merges); a change rebuilds the cache


def _source_key(path: Path) -> str:
    st = path.stat()
    key = f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}|{CACHE_FORMAT}"
    return hashlib.sha256(key.encode()).hexdigest()[:16]


def compact_merges(tokenizer_json: Path) -> bool:
    """Rewrite a BPE tokenizer.json's merges from [a, b] pairs to "a b" strings (tokenizers reads both; no token of
    the merges may hold a space): loading it then takes half the memory (Gemma 3's 515k merges: 200 MB at peak, 150
    MB held, instead of 380 and 300). -> whether it was rewritten."""
    data = json.loads(tokenizer_json.read_text(encoding="utf-8"))
    merges = (data.get("model") or {}).get("merges")
    if not merges or not isinstance(merges[0], list) or any(" " in a or " " in b for a, b in merges):
        return False
    data["model"]["merges"] = [f"{a} {b}" for a, b in merges]
    tmp = tokenizer_json.with_suffix(".tmp")
    tmp.write_text(json.dumps(data, ensure_ascii=False), encoding="utf-8")
    tmp.replace(tokenizer_json)
    return True


def _raise(message: str):
    import jinja2

    raise jinja2.exceptions.TemplateError(message)


def _tojson(x, ensure_ascii=False, indent=None, separators=None, sort_keys=False) -> str:
    return json.dumps(x, ensure_ascii=ensure_ascii, indent=indent, separators=separators, sort_keys=sort_keys)


def compile_chat_template(source: str) -> jinja2.Template:
    """A chat template in the environment transformers renders them in (sandboxed, trimmed blocks, loop controls,
    tojson, raise_exception, strftime_now)."""
    from jinja2.sandbox import ImmutableSandboxedEnvironment

    jenv = ImmutableSandboxedEnvironment(trim_blocks=True, lstrip_blocks=True, extensions=["jinja2.ext.loopcontrols"])
    jenv.filters["tojson"] = _tojson
    jenv.globals["raise_exception"] = _raise
    jenv.globals["strftime_now"] = lambda fmt: datetime.datetime.now().strftime(fmt)
    return jenv.from_string(source)


def _special(value) -> str | None:
    """A special token as tokenizer_config.json writes it (a string, or an AddedToken-like dict)."""
    return value.get("content") if isinstance(value, dict) else value


class Tokenizer:
    """encode, chat template, decode and stop ids over a ``tokenizers.Tokenizer``. ``add_bos``: whether a raw prompt
    starts with the BOS token (the model's tokenizer metadata: GGUF ``tokenizer.ggml.add_bos_token``, HF
    ``add_bos_token``; None: whether the tokenizer's own post-processor adds it)."""

    def __init__(self, backend: tokenizers.Tokenizer, *, chat_template: str | None = None,
                 special: dict[str, str | None] | None = None, eos_token_ids: Sequence[int] = (),
                 add_bos: bool | None = None):
        self.backend = backend
        self.special = {k: v for k, v in (special or {}).items() if v is not None}
        self.template_source = chat_template
        bos = self.special.get("bos_token")
        self.bos_id: int | None = backend.token_to_id(bos) if bos is not None else None
        if add_bos is None and self.bos_id is not None:  # the post-processor's choice
            add_bos = backend.encode("a", add_special_tokens=True).ids[:1] == [self.bos_id]
        self.add_bos = bool(add_bos) and self.bos_id is not None
        self._template = compile_chat_template(chat_template) if chat_template else None
        stop = set(eos_token_ids)
        eos = self.special.get("eos_token")
        if eos is not None and backend.token_to_id(eos) is not None:
            stop.add(backend.token_to_id(eos))
        self.stop_ids: frozenset[int] = frozenset(stop)

    @classmethod
    def from_folder(cls, folder: Path, eos_token_ids: Sequence[int] = (), add_bos: bool | None = None) -> Tokenizer:
        """From a folder holding tokenizer.json and tokenizer_config.json (and chat_template.jinja, if the template
        is not in the config)."""
        config = json.loads((folder / "tokenizer_config.json").read_text()) \
            if (folder / "tokenizer_config.json").is_file() else {}
        template = config.get("chat_template")
        if template is None and (folder / "chat_template.jinja").is_file():
            template = (folder / "chat_template.jinja").read_text()
        import tokenizers

        backend = tokenizers.Tokenizer.from_file(str(folder / "tokenizer.json"))
        if add_bos is None and isinstance(config.get("add_bos_token"), bool):
            add_bos = config["add_bos_token"]
        return cls(backend, chat_template=template, special={k: _special(config.get(k)) for k in SPECIAL_TOKENS},
                   eos_token_ids=eos_token_ids, add_bos=add_bos)

    @classmethod
    def load(cls, model_path: str | Path, eos_token_ids: Sequence[int] = ()) -> Tokenizer:
        p = Path(model_path)
        if p.is_dir():
            gen_cfg = p / "generation_config.json"
            if gen_cfg.is_file():
                eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
                if eos is not None:
                    eos_token_ids = (*eos_token_ids, *([eos] if isinstance(eos, int) else eos))
            if (p / "tokenizer.json").is_file():
                return cls.from_folder(p, eos_token_ids)
            return _converted(p, env.cache_dir() / "tokenizers" / _source_key(p), eos_token_ids)
        cached = env.cache_dir() / "tokenizers" / _source_key(p)
        add_bos = _gguf_add_bos(p)
        if (cached / "tokenizer.json").is_file():
            try:
                return cls.from_folder(cached, eos_token_ids, add_bos)
            except Exception:  # a stale or partial cache (any reader error): rebuild it
                log.warning("tokenizer cache %s unreadable; rebuilding", cached, exc_info=True)
        log.info("converting the tokenizer from %s (cached afterwards)", p.name)
        return _converted(p, cached, eos_token_ids, add_bos)

    def encode(self, text: str) -> list[int]:
        return list(self.backend.encode(text, add_special_tokens=False).ids)

    def encode_raw(self, text: str) -> list[int]:
        """A raw (untemplated) prompt: ``text``'s ids after the BOS token where the model's tokenizer adds one."""
        ids = self.encode(text)
        return [self.bos_id, *ids] if self.add_bos and ids[:1] != [self.bos_id] else ids

    def render(self, messages: list[dict[str, str]], add_generation_prompt: bool = True) -> str:
        """``messages`` rendered by the model's chat template (as text)."""
        if self._template is None:
            raise ConfigError("this model has no chat template; use a raw completion prompt instead")
        return self._template.render(messages=messages, add_generation_prompt=add_generation_prompt, tools=None,
                                     documents=None, **self.special)

    def chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of ``messages`` rendered by the model's chat template, ready for the assistant's reply."""
        return self.encode(self.render(messages))

    def decode(self, ids: Sequence[int]) -> str:
        return self.backend.decode(list(ids), skip_special_tokens=True)


def is_base(tokenizer) -> bool:
    """Whether a tokenizer has no chat template (a base model's: prompted raw). Any object with ``chat``, e.g. a test's
    byte tokenizer, counts as having one unless it says ``template_source = None``."""
    return getattr(tokenizer, "template_source", "") is None


def user_prompt(tokenizer, text: str) -> list[int]:
    """``text`` as a user's message in the chat template, or, for a base model without one, as a raw prompt (BOS as
    its tokenizer says)."""
    return tokenizer.encode_raw(text) if is_base(tokenizer) else tokenizer.chat([{"role": "user", "content": text}])


def _gguf_add_bos(path: Path) -> bool | None:
    """A GGUF file's ``tokenizer.ggml.add_bos_token`` (None when it does not say, or the header can't be read)."""
    import mmap

    from ..errors import WeightsError
    from .gguf_file import parse_gguf

    try:
        with open(path, "rb") as fh, mmap.mmap(fh.fileno(), 0, access=mmap.ACCESS_READ) as mm:
            meta, _ = parse_gguf(mm, path)
    except (OSError, ValueError, WeightsError):
        return None
    value = meta.get("tokenizer.ggml.add_bos_token")
    return value if isinstance(value, bool) else None


def _converted(source: Path, folder: Path, eos_token_ids: Sequence[int], add_bos: bool | None = None) -> Tokenizer:
    """transformers' tokenizer of ``source`` (a GGUF file, or a folder without tokenizer.json), saved to ``folder``
    and read back from there."""
    from transformers import AutoTokenizer  # only to convert, once per model file

    tok = AutoTokenizer.from_pretrained(source.parent, gguf_file=source.name) if source.is_file() \
        else AutoTokenizer.from_pretrained(source)
    try:
        folder.mkdir(parents=True, exist_ok=True)
        tok.save_pretrained(folder)
    except OSError:
        log.warning("could not cache the tokenizer at %s", folder, exc_info=True)
    if not (folder / "tokenizer.json").is_file():
        raise ConfigError(f"{source}: its tokenizer has no fast (tokenizer.json) form")
    del tok
    compact_merges(folder / "tokenizer.json")
    return Tokenizer.from_folder(folder, eos_token_ids, add_bos)


@dataclass
class Detokenizer:
    """Turns a growing list of token ids into text deltas, holding back incomplete UTF-8 and any tail that
    could still become a stop string. ``finished`` is set once a stop string appears (text is cut before it)."""

    tokenizer: Tokenizer
    stop_strings: Sequence[str] = ()
    ids: list[int] = field(default_factory=list)
    emitted: str = ""
    finished: bool = False

    def push(self, new_ids: Sequence[int]) -> str:
        if self.finished:
            return ""
        self.ids.extend(new_ids)
        text = self.tokenizer.decode(self.ids)
        hits = [text.find(s, max(0, len(self.emitted) - len(s))) for s in self.stop_strings if s]
        hits = [at for at in hits if at != -1]
        if hits:
            self.finished = True
            text = text[: min(hits)]
        if not self.finished:
            if text.endswith("\ufffd"):
                text = text.rstrip("\ufffd")
            hold = 0
            for s in self.stop_strings:
                for k in range(min(len(s) - 1, len(text)), 0, -1):
                    if text.endswith(s[:k]):
                        hold = max(hold, k)
                        break
            text = text[: len(text) - hold]
        if len(text) < len(self.emitted):  # a later token re-rendered the tail (rare): never retract
            return ""
        delta = text[len(self.emitted) :]
        self.emitted = text
        return delta

    def flush(self) -> str:
        """Emit whatever was held back for a stop string that never came."""
        if self.finished:
            return ""
        text = self.tokenizer.decode(self.ids)
        delta = text[len(self.emitted) :] if text.startswith(self.emitted) else ""
        self.emitted += delta
        return delta
