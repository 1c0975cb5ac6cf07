"""The leader's settings: admission, timeouts, resumption, prefill and the KV margin stages need."""

from __future__ import annotations

from pydantic import Field

from ..types import Settings


class LeaderSettings(Settings):
    mode_preference: tuple[str, ...] = ("flowspec", "chunk", "ar")  # default mode: the first one available
    default_mode: str | None = None  # overrides mode_preference
    max_context: int = Field(2048, ge=2)  # prompt + new tokens; the stages' KV capacity must be at least this
    max_waiting: int = Field(8, ge=0)  # requests queued behind the one in flight; more get Busy (503)
    queue_timeout_s: float = Field(300.0, gt=0)  # waiting for the turn longer than this: Busy (503)
    ready_timeout_s: float = Field(10.0, ge=0)  # waiting for a pipeline longer than this: NotReady (503)
    step_timeout_s: float = Field(60.0, gt=0)  # no reply from the pipeline for this long: PeerGone
    resume_attempts: int = Field(2, ge=0)  # a request whose pipeline broke continues on the next one this often
    resume_timeout_s: float = Field(20.0, ge=0)  # ... if the next pipeline comes within this (re-plan + load)
    retry_after_s: int = Field(2, ge=1)  # Retry-After for 503s
    prefill_chunk: int = Field(128, ge=1)  # prompt tokens per prefill Forward (chunks are pipelined)
    wire_dtype: str = "float32"  # activations the leader itself sends (when it embeds for stage 1)
    tree_margin: int = Field(256, ge=0)  # KV slots a stage needs beyond max_context for pending draft-tree nodes

    @property
    def stage_capacity(self) -> int:
        """KV capacity every stage (StageCore ``capacity``) needs for requests this leader accepts."""
        return self.max_context + self.tree_margin
