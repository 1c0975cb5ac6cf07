"""Tokenizer and chat template from the model's own source, and incremental detokenisation with stop strings.

transformers reads both from a GGUF file (slowly: ~6 s); the converted tokenizer is cached under
``~/.cache/flowspec_p2p/tokenizers`` so later starts take well under a second.
"""

from __future__ import annotations

import hashlib
import json
import logging
from collections.abc import Sequence
from dataclasses import dataclass, field
from pathlib import Path

from .. import env
from ..errors import ConfigError

log = logging.getLogger(__name__)


def _source_key(path: Path) -> str:
    st = path.stat()
    return hashlib.sha256(f"{path.resolve()}|{st.st_size}|{st.st_mtime_ns}".encode()).hexdigest()[:16]


class Tokenizer:
    """Thin wrapper over a transformers tokenizer: encode, chat template, decode, stop ids."""

    def __init__(self, hf_tokenizer, eos_token_ids: Sequence[int] = ()):
        self.hf = hf_tokenizer
        stop = set(eos_token_ids)
        if hf_tokenizer.eos_token_id is not None:
            stop.add(int(hf_tokenizer.eos_token_id))
        self.stop_ids: frozenset[int] = frozenset(stop)

    @classmethod
    def load(cls, model_path: str | Path, eos_token_ids: Sequence[int] = ()) -> Tokenizer:
        from transformers import AutoTokenizer

        p = Path(model_path)
        if p.is_dir():
            tok = AutoTokenizer.from_pretrained(p)
            gen_cfg = p / "generation_config.json"
            if gen_cfg.is_file():
                eos = json.loads(gen_cfg.read_text()).get("eos_token_id")
                if eos is not None:
                    eos_token_ids = (*eos_token_ids, *([eos] if isinstance(eos, int) else eos))
            return cls(tok, eos_token_ids)
        cached = env.cache_dir() / "tokenizers" / _source_key(p)
        if (cached / "tokenizer_config.json").is_file():
            try:
                return cls(AutoTokenizer.from_pretrained(cached), eos_token_ids)
            except Exception:  # a stale or partial cache: rebuild it
                log.warning("tokenizer cache %s unreadable; rebuilding", cached, exc_info=True)
        log.info("converting the tokenizer from %s (cached afterwards)", p.name)
        tok = AutoTokenizer.from_pretrained(p.parent, gguf_file=p.name)
        try:
            cached.mkdir(parents=True, exist_ok=True)
            tok.save_pretrained(cached)
        except OSError:
            log.warning("could not cache the tokenizer at %s", cached, exc_info=True)
        return cls(tok, eos_token_ids)

    def encode(self, text: str) -> list[int]:
        return list(self.hf.encode(text, add_special_tokens=False))

    def chat(self, messages: list[dict[str, str]]) -> list[int]:
        """Token ids of ``messages`` rendered by the model's chat template, ready for the assistant's reply."""
        if not self.hf.chat_template:
            raise ConfigError("this model has no chat template; use a raw completion prompt instead")
        text = self.hf.apply_chat_template(messages, add_generation_prompt=True, tokenize=False)
        return self.encode(text)

    def decode(self, ids: Sequence[int]) -> str:
        return self.hf.decode(list(ids), skip_special_tokens=True)


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
