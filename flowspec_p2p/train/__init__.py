"""Training the EAGLE-style draft head (``spec.head.DraftHead``) for a target, on CPU, from prompts to a shipped bundle.

    prompts.py   prompt pool: ShareGPT first turns + synthetic math/code/summary prompts, Spec-Bench excluded
    batchgen.py  continuous-batching KV-cached generation on a ``Shard`` that records the target's features
    data.py      the data step: self-distillation (``features/``) and teacher-forced ShareGPT (``fixed/``)
    store.py     append-only float16 feature shards + manifest (resumable)
    corpus.py    the stores in memory, held-out split, draft vocabulary, EAGLE alignment of one example
    unroll.py    the head unrolled over its own features (EAGLE-3 training-time test) via its public forward
    fit.py       EAGLE loss, AdamW, checkpoints
    evaluate.py  held-out top-1 per depth, chain acceptance and tau
    export.py    ``DraftBundle`` with metadata, where ``spec.head.find_draft`` looks
    budget.py    ``flowspec draft train --minutes``: the steps above within a time budget, resumable

The command is ``flowspec draft`` (commands/draft.py). Nothing here runs during inference.

A leaf: no product module imports it (only commands/ does). May import model, spec and the base modules.
"""
