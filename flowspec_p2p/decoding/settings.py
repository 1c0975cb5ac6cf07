"""The leader's settings (admission, timeouts, resumption, prefill, the KV margin stages need) and FlowSpec's
(tree budgets, segment sizing): plain data, importable without torch (config.py reads them)."""

from __future__ import annotations

from pydantic import Field

from ..speculative.shape import TreeShape
from ..types import Settings
from .auto import AutoSettings


class LeaderSettings(Settings):
    mode_preference: tuple[str, ...] = ("auto", "flowspec", "chunk", "ar")  # default mode: the first available
    default_mode: str | None = None  # overrides mode_preference
    max_context: int = Field(2048, ge=2)  # prompt + new tokens; the stages' KV capacity must be at least this
    # requests decoded at once (their KV on every stage; the plan's count replaces it, see Pipeline.max_requests)
    max_requests: int = Field(4, ge=1, le=16)
    max_waiting: int = Field(64, ge=0)  # requests queued behind those in flight; more get Busy (503)
    prompt_cache: bool = True  # a chat's next turn reuses the KV its earlier turns left on the stages
    # micro-batches the requests in flight are spread over (leader._group); None: one per compute station of the
    # ring, at most half the requests in flight
    micro_batches: int | None = Field(None, ge=1, le=255)
    queue_timeout_s: float = Field(300.0, gt=0)  # waiting for the turn longer than this: Busy (503)
    ready_timeout_s: float = Field(10.0, ge=0)  # waiting for a pipeline longer than this: NotReady (503)
    step_timeout_s: float = Field(60.0, gt=0)  # no reply from the pipeline for this long: PeerGone
    resume_attempts: int = Field(2, ge=0)  # a request whose pipeline broke continues on the next one this often
    resume_timeout_s: float = Field(20.0, ge=0)  # ... if the next pipeline comes within this (re-plan + load)
    retry_after_s: int = Field(2, ge=1)  # Retry-After for 503s
    prefill_chunk: int = Field(128, ge=1)  # prompt tokens per prefill Forward (chunks are pipelined)
    wire_dtype: str = "float32"  # activations the leader itself sends (when it embeds for stage 1)
    tree_margin: int = Field(256, ge=0)  # KV slots a stage needs beyond max_context for pending draft-tree nodes
    auto: AutoSettings = AutoSettings()  # how ``auto`` picks a mode per request (auto.py)

    @property
    def stage_capacity(self) -> int:
        """KV capacity every stage (StageCore ``capacity``) needs for requests this leader accepts."""
        return self.max_context + self.tree_margin


class FlowSpecConfig(Settings):
    """Tree budgets and segment sizing. Defaults tuned for a CPU pipeline (small trees, short segments)."""

    # Drafting cost grows with depth x top_k (one draft-head forward per level), not with total_tokens: the
    # expansion keeps its whole candidate pool, and the leader sends the best-scored *new* nodes first. The defaults
    # won the A/Bs on an emulated 4-stage CPU ring (docs/experiments.md, "FlowSpec's segment settings").
    init: TreeShape = TreeShape(total_tokens=32, depth=6, top_k=4, order="score")
    expand: TreeShape = TreeShape(total_tokens=32, depth=4, top_k=6, order="score")
    in_flight: int | None = Field(None, ge=1)  # segments in the ring; default: compute stages + 1 (the leader)
    segment_cap: int = Field(4, ge=1)  # nodes per segment at most
    # Adaptive segments: each segment takes the k next nodes (score order) that maximise expected accepted tokens
    # per unit of stage time, sum(p_1..p_k) / cost(k), where cost(k) is a k-node stage forward relative to a
    # one-node one, measured (StageCost), and p_i is the node's draft path
    # probability scaled by the acceptance measured so far in this request (see best_segment). Off: always
    # segment_cap nodes, and always the full expansion depth (expand_min_path is ignored).
    adaptive: bool = True
    # The prior for a stage's forward cost per extra node, relative to a one-node forward, until the stages' own
    # timings (Forward.stage_s) measure it (StageCost), after a few segments: a cautious CPU figure (a GPU's is ~0).
    row_cost: float = Field(0.25, ge=0.0)
    # Adaptive ring depth: a segment beyond the first live one goes out only if it is expected to be worth its
    # stage time, sum(p) / cost(k) >= min_value. A node that dies in flight still delays every
    # segment behind it at every stage, the next root's included; with a weak draft the ring stays shallow, with
    # a strong one it fills up to in_flight. 0 = always fill the ring.
    min_value: float = Field(0.1, ge=0.0)
    max_unsent: int = Field(48, ge=1)  # drafted-but-unsent nodes kept at most (the lowest-scored are dropped)
    # Re-draft from the new root after a walk only when fewer than this many unsent nodes remain below it (0 =
    # after every walk, as the reference does). Drafting is the leader's main cost per step.
    redraft_below: int = Field(6, ge=0)
    # Adaptive expansion depth: draft only as deep as a path is still expected to be accepted with probability
    # >= expand_min_path, from the per-level hit rate h measured in this request (Calibration.hit_rate): depth
    # = floor(log(expand_min_path) / log(h)), between 1 and expand.depth. Each level is one draft-head forward
    # on the leader, so a weak draft costs the leader less time per walk. 0 = always expand.depth.
    expand_min_path: float = Field(0.15, ge=0.0, lt=1.0)
    # Adaptive expansion width (A/B in docs/experiments.md): each expanded node gets as many children as held
    # ``expand_cover`` of the target's choices among the drafted children so far in this request
    # (Calibration.useful_top_k), between 2 and expand.top_k. 0 = always expand.top_k.
    expand_cover: float = Field(0.98, ge=0.0, le=1.0)
    # Send after every drafted level (one draft-head forward), not after the whole draft: a root's children follow
    # it down the ring while the deeper levels are drafted, and a returned segment's walk need not wait for them.
    stream_levels: bool = True
