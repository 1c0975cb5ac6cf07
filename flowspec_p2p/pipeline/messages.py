"""Data-plane messages of the stage pipeline (leader -> stage 1 -> ... -> stage N -> leader).

Every message travels *in band*, in order, around the whole ring, and every stage applies it exactly once, in
the order it arrives. Because a link is FIFO, a stage has always processed every node a later ``Prune`` names,
and every stage sees the same sequence of tree operations: this replaces the reference implementation's global
per-step barrier (flowspec-algorithm.md §3.2, §10.3). The last stage passes non-forward messages back to the leader
as acknowledgements, so the leader knows which tree indexing each returned segment uses.

Tree encoding (compact, §10.2): a stage keeps, per request, the parent index of each *pending* node (draft-tree
nodes it has processed but that are not committed). A ``Forward`` carries, per new node, its parent's tree index
(-1: the node hangs directly off the committed prefix) and its absolute position (= committed + depth, checked).
Each stage derives the attention mask from the parents: a node sees the committed prefix, its ancestors, itself.

Look-ahead (early cancellation): a stage that finds a ``Prune`` queued behind a ``Forward`` of the same request
skips the rows that prune will discard (marked in ``Forward.dead``; their tensors are zeros and they take no KV
slot). The first prune after a forward is the same at every stage (FIFO), so every stage agrees on the dead rows.

Tensors travel beside the header (see codec.py), named:
    tokens    int64 [m]            to a stage that holds the embedding
    hidden    float16/bfloat16/float32 [m, hidden]   between stages
    features  same dtype [m, hidden]                 last stage -> leader (final-normed)
"""

from __future__ import annotations

from typing import Annotated, Literal

from pydantic import Field

from ..types import FrozenModel

PROTOCOL_VERSION = 1
MAX_STAGES = 256  # stage_s entries a Forward may carry
MAX_REQUEST_ID = 64  # characters of a request id (the leader's are 16)
MAX_NODES = 4096  # nodes one Forward carries, and entries of a Prune's keep (a prefill chunk or a tree segment)
MAX_POSITION = 1 << 20  # absolute positions (every stage also checks them against its KV capacity)
MAX_SEQ = 1 << 40  # sequence numbers and tags
MAX_ERROR_TEXT = 1000  # characters of a StageError's message
MAX_GROUP = 255  # micro-batch labels
WIRE_DTYPES = ("float16", "bfloat16", "float32", "float64", "int64", "int32")
TENSOR_NAMES = ("tokens", "hidden", "features")

# every field a peer controls is bounded here, so a frame is refused before anything is allocated for it
RequestId = Annotated[str, Field(max_length=MAX_REQUEST_ID)]
Seq = Annotated[int, Field(ge=0, le=MAX_SEQ)]
NodeIndex = Annotated[int, Field(ge=0, lt=MAX_NODES)]


class TensorSpec(FrozenModel):
    name: Literal["tokens", "hidden", "features"]
    dtype: Literal["float16", "bfloat16", "float32", "float64", "int64", "int32"]
    shape: tuple[int, ...] = Field(max_length=4)


class Forward(FrozenModel):
    """Run ``len(parents)`` new nodes through the stage. They take tree indices ``first, first + 1, ...``."""

    kind: Literal["forward"] = "forward"
    request_id: RequestId
    seq: Seq
    first: NodeIndex  # tree index of the first node; must equal the stage's pending count
    # per node: parent tree index (< own index), or -1 (hangs off the committed prefix)
    parents: list[Annotated[int, Field(ge=-1, lt=MAX_NODES)]] = Field(max_length=MAX_NODES)
    # per node: absolute position = committed + depth
    positions: list[Annotated[int, Field(ge=0, lt=MAX_POSITION)]] = Field(max_length=MAX_NODES)
    commit: bool = False  # commit the nodes right after the forward (prefill chunks, autoregressive steps)
    tag: Annotated[int, Field(ge=-MAX_SEQ, le=MAX_SEQ)] = 0  # the leader's segment id, echoed back unchanged
    # rows a queued Prune already discards: not computed, zeros
    dead: list[NodeIndex] = Field(default_factory=list, max_length=MAX_NODES)
    # each stage appends its busy seconds for this forward (compute + any emulated slowdown): the leader sizes
    # FlowSpec's segments from what the stages really cost (flowstate.StageCost)
    stage_s: list[Annotated[float, Field(ge=0.0, le=86_400.0, allow_inf_nan=False)]] = Field(
        default_factory=list, max_length=MAX_STAGES)
    tensors: list[TensorSpec] = Field(default_factory=list, max_length=len(TENSOR_NAMES))
    # the prompt cache: a request's first forward may start from the KV that a finished request of the same link
    # left retained (Release.retain), its first ``positions[0]`` committed positions (the shared token prefix)
    reuse: RequestId | None = None
    # the request's micro-batch: a stage runs forwards of one group together, so the leader's groups travel the ring
    # as separate micro-batches, each at another stage (pipeline parallelism across requests)
    group: Annotated[int, Field(ge=0, le=MAX_GROUP)] = 0

    @property
    def computed_rows(self) -> int:
        """Nodes a stage actually runs: the dead rows take no compute."""
        return len(self.parents) - len(self.dead)


class Prune(FrozenModel):
    """Causal-consistent prune (flowspec-algorithm.md §5.3): keep the pending nodes ``keep`` (strictly increasing
    tree indices), compacted in order; the first ``accept`` of them become committed prefix. Kept nodes are
    re-indexed 0, 1, ... in order; the parent of a node whose parent became committed becomes -1."""

    kind: Literal["prune"] = "prune"
    request_id: RequestId
    seq: Seq
    accept: Annotated[int, Field(ge=0, le=MAX_NODES)]
    keep: list[NodeIndex] = Field(max_length=MAX_NODES)


class Release(FrozenModel):
    """The request is over: free its state on every stage, or, with ``retain``, keep its first ``retain``
    committed positions' KV for a later request of the same conversation (Forward.reuse; the prompt cache). A
    Release of a retained request frees it."""

    kind: Literal["release"] = "release"
    request_id: RequestId
    seq: Seq
    retain: Annotated[int, Field(ge=1, lt=MAX_POSITION)] | None = None


class StageError(FrozenModel):
    """A stage could not apply a message of this request; passed on to the leader, which fails the request."""

    kind: Literal["error"] = "error"
    request_id: RequestId
    seq: Seq
    stage: Annotated[int, Field(ge=0, le=MAX_STAGES)]
    message: str = Field(max_length=MAX_ERROR_TEXT)
    # "link_lost": the stage lost its inbound link (the leader resumes the request on the next pipeline)
    reason: Literal["failed", "link_lost"] = "failed"


DataMessage = Annotated[Forward | Prune | Release | StageError, Field(discriminator="kind")]
