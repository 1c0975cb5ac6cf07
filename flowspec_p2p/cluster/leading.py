"""What an agent needs to lead, loaded off the event loop: the head shard (embedding, final norm, LM head), the
tokenizer, the drafter and the model's sizes for the planner. The leader loads them at start; a standby loads them
ahead of need from its replica (replica.py), so that taking over costs no load."""

from __future__ import annotations

import logging
from collections.abc import Callable
from dataclasses import dataclass
from pathlib import Path

from ..config import AgentConfig
from ..decoding.context import DecodingMode
from ..decoding.flowspec import FlowSpecConfig
from ..decoding.registry import builtin_modes
from ..model.dtypes import TORCH_DTYPES
from ..model.engine import Shard
from ..model.load import load_shard
from ..model.registry import display_name
from ..model.tokenizer import Tokenizer
from ..speculative.decoder import PROBE_TEXT, load_drafter
from ..speculative.drafter import Drafter
from ..speculative.head import find_draft
from ..types import LayerRange
from .plans import ModelSizes, describe_model

log = logging.getLogger(__name__)


@dataclass
class LeaderParts:
    source: object  # weights.WeightSource
    fingerprint: str
    head: Shard
    tokenizer: object
    drafter: Drafter
    model: ModelSizes
    model_id: str
    draft_stem: Path | None  # the draft bundle the drafter came from (a standby's replica carries it)


def load_leader_parts(cfg: AgentConfig, source, fingerprint: str, *, tokenizer=None, draft: Path | None = None,
                      model_name: str | None = None) -> LeaderParts:
    """Blocking: run it in a thread. ``draft``: the draft head (default ``cfg.draft``, else the one found for the
    model); ``model_name``: what the model is served as (default: the name it was started by, else its stem)."""
    # the engine is chosen here, once: the plans name the head's, so every stage runs the same one (auto falls back
    # to the torch engine for a model the native engine cannot run)
    head = load_shard(source, LayerRange(start=0, end=0), embed=True, head=True, engine=cfg.engine,
                      dtype=TORCH_DTYPES[cfg.dtype])
    tokenizer = tokenizer or Tokenizer.load(source.path, source.config.eos_token_ids)
    probe = tokenizer.encode(PROBE_TEXT)

    def whole_model() -> Shard:  # the tolerance test of a head trained for another build of the model
        return head.engine.load(source, LayerRange(start=0, end=source.config.num_layers), embed=True, head=True)

    stem = draft or cfg.draft
    drafter = _drafter(fingerprint, head, stem, probe, whole_model)
    if stem is None:
        stem = find_draft(fingerprint)
    base = getattr(drafter, "base", drafter)  # LookupDrafter wraps the head drafter
    model = describe_model(source, head.engine, context=cfg.planning.context, fingerprint=fingerprint,
                           draft_bytes=getattr(base, "nbytes", 0))
    model_id = model_name or display_name(cfg.model, source.path)
    bundle = Path(stem) if stem is not None and Path(stem).with_suffix(".json").is_file() else None
    return LeaderParts(source, fingerprint, head, tokenizer, drafter, model, model_id, bundle)


def modes(flowspec: FlowSpecConfig) -> list[DecodingMode]:
    """The decoding modes this build offers (the leader picks what its drafter allows), FlowSpec with ``flowspec``
    (AgentConfig.flowspec)."""
    return builtin_modes(None if flowspec == FlowSpecConfig() else flowspec)


def _drafter(model_fp: str, head: Shard, stem: Path | None = None, probe: list[int] | None = None,
             whole_model: Callable[[], Shard] | None = None) -> Drafter:
    """The leader's drafter: the head at ``stem``, else one trained for this model (or another build of it that
    passes the tolerance test), else prompt lookup alone (spec.decoder.load_drafter)."""
    drafter, meta = load_drafter(head, model_fp, stem, probe, whole_model)
    if meta["match"] != "none":
        log.info("draft head for %s (+ prompt-lookup candidates; matched by %s)", model_fp[:12], meta["match"])
    return drafter
