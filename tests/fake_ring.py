"""A synchronous ring for fast tests of decoding modes: every message runs through all StageCores the moment it
is sent. Links are FIFO and stages apply messages in order, so this yields exactly the results of a real ring
(only the timing differs); no threads, no sockets."""

from __future__ import annotations

import itertools
import time

from flowspec_p2p.decoding.context import Pipeline
from flowspec_p2p.decoding.leader import Leader
from flowspec_p2p.pipeline.stage import StageCore
from flowspec_p2p.pipeline.transport import Frame

_ids = itertools.count(10_000)


class SyncRingSender:
    def __init__(self, cores: list[StageCore], leader: Leader):
        self.cores, self.leader = cores, leader
        self.peer, self.id, self.closed = "sync-ring", next(_ids), False

    async def send(self, msg, tensors=None) -> None:
        tensors = tensors or {}
        for core in self.cores:
            msg, tensors = core.handle(msg, tensors)
        self.leader.inbox.put_nowait(Frame(msg, tensors, self.peer, self.id, time.time()))

    async def close(self) -> None:
        self.closed = True


def sync_pipeline(shards, leader: Leader, wire_dtype) -> tuple[Pipeline, list[StageCore]]:
    cores = [StageCore(s, index=i + 1, capacity=leader.settings.max_context, wire_dtype=wire_dtype)
             for i, s in enumerate(shards)]
    takes = "tokens" if shards[0].has_embed else "hidden"
    return Pipeline(SyncRingSender(cores, leader), takes=takes, stages=len(cores)), cores
