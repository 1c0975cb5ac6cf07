"""A one-off analysis hook, never part of the product: how fast would FlowSpec be if parts of the leader's work
cost less?

Loaded into every process of `flowspec bench` by lab/leader_ceiling.sh (through PYTHONPATH). With
FLOWSPEC_HEAD_DISCOUNT set, the CPU time the leader's compute thread spends in the target's LM head (the shard's
``logits``: as if the LM head and the greedy argmax ran on the last stage) is left out of what the emulated leader
device is charged, so that part runs at this host's speed instead of ``--slowdown`` times slower; with
FLOWSPEC_DRAFT_DISCOUNT set, the same for the draft head's forwards and its LM-head rows (HeadDrafter: feed, the
root's and each level's log-probs), as a draft model that cost nothing would. Every decision is still the
target's own (the bench's greedy equality check shows it); only the emulated clock changes.
"""

import os

if os.environ.get("FLOWSPEC_HEAD_DISCOUNT") or os.environ.get("FLOWSPEC_DRAFT_DISCOUNT"):
    import threading
    import time

    import flowspec_p2p.decoding.context as _context
    import flowspec_p2p.model.native_shard as _native
    import flowspec_p2p.model.torch_shard as _shard
    import flowspec_p2p.speculative.drafter as _drafter

    _spent = threading.local()

    def _wrap(cls, name):
        inner = getattr(cls, name)

        def timed_part(self, *args, **kw):
            if getattr(_spent, "depth", 0):  # already inside a discounted part
                return inner(self, *args, **kw)
            c0 = time.thread_time()
            _spent.depth = 1
            try:
                return inner(self, *args, **kw)
            finally:
                _spent.depth = 0
                _spent.s = getattr(_spent, "s", 0.0) + time.thread_time() - c0

        setattr(cls, name, timed_part)

    if os.environ.get("FLOWSPEC_HEAD_DISCOUNT"):
        _wrap(_native.NativeShard, "logits")
        _wrap(_shard.TorchShard, "logits")
    if os.environ.get("FLOWSPEC_DRAFT_DISCOUNT"):
        for part in ("feed", "_root_logprobs", "_expand"):
            _wrap(_drafter.HeadDrafter, part)
    _timed = _context.ThreadCompute.timed

    async def timed(self, fn, *args):
        def call():
            _spent.s = 0.0
            return fn(*args), _spent.s

        (out, head_s), wall_s, cpu_s = await _timed(self, call)
        return out, wall_s, max(0.0, cpu_s - head_s)

    _context.ThreadCompute.timed = timed
