"""A one-off analysis hook, never part of the product: how fast would FlowSpec be with a better draft?

Loaded into every process of `flowspec bench` by lab/draft_ceiling.sh (through PYTHONPATH) when
FLOWSPEC_CEILING_REF names a JSON file {prompt length: the target's greedy reply token ids}, taken from an earlier
autoregressive run of the same prompts. Each FlowSpec tree then also gets, through the prompt-lookup hook
(speculative/ngram.py), a chain of the next FLOWSPEC_CEILING_LEN reply tokens (scored as near-certain), each right with
probability FLOWSPEC_CEILING_Q (fixed per reply position; the first miss ends the chain with a wrong token). That
emulates a draft whose next-token guesses are right that often, on top of the shipped head. The target still
verifies every node, so the output stays the target's own (the bench's greedy equality check shows it).
"""

import json
import os
from pathlib import Path

if os.environ.get("FLOWSPEC_CEILING_REF"):
    import random

    import flowspec_p2p.decoding.leader as _leader
    import flowspec_p2p.speculative.ngram as _ngram

    _REF = {int(k): v for k, v in json.loads(Path(os.environ["FLOWSPEC_CEILING_REF"]).read_text()).items()}
    _LEN = int(os.environ.get("FLOWSPEC_CEILING_LEN", "8"))
    _Q = float(os.environ.get("FLOWSPEC_CEILING_Q", "1"))
    _current = {"prompt_len": None}  # the leader serves one request at a time
    _generate = _leader.Leader.generate

    def _generate_tracked(self, prompt, **kw):
        _current["prompt_len"] = len(prompt)
        return _generate(self, prompt, **kw)

    def _propose(self, root, length):
        p = _current["prompt_len"]
        ref = _REF.get(p)
        seq = [*self.ctx, int(root)]
        if ref is None or len(seq) <= p or seq[p:] != ref[: len(seq) - p]:
            return []
        pos = len(seq) - p
        chain = []
        for i, t in enumerate(ref[pos : pos + _LEN]):
            if random.Random(p * 100003 + pos + i).random() < _Q:
                chain.append(t)
            else:
                chain.append((t + 1) % 49152)  # a wrong guess, and nothing below it
                break
        return chain

    _lookup_init = _ngram.LookupDrafter.__init__

    def _lookup_drafter(self, base, cfg=None):
        _lookup_init(self, base, _ngram.LookupConfig(step_logprob=-0.01, length=_LEN))

    _leader.Leader.generate = _generate_tracked
    _ngram.PromptLookup.propose = _propose
    _ngram.LookupDrafter.__init__ = _lookup_drafter
