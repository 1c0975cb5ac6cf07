"""The tree-size tuner for single-device speculative decoding (``flowspec tune-tree``).

Glossary (speculative-decoding-notes §1.3, §4.4):

    forward curve     median time of one target forward of an n-node tree after a fixed context (plus one
                      LM-head row, as a decoding step needs), divided by the one-token forward. On a CPU this
                      grows much faster with n than on a GPU, so the best tree is small.
    draft cost        median ``drafter.draft`` time for a tree shape (it depends on the expansion levels and the
                      width k), plus one ``feed`` per step, divided by the one-token target forward.
    teacher-forced τ  at T=0 the committed text is the autoregressive text whatever the tree, so the accepted
                      length of *every* tree shape at *every* position of the AR reply is known from one draft
                      per position: EAGLE-2 pools are nested (the depth-d pool is the depth-D pool cut at d; the
                      budget-N tree is its N-1 best candidates), so one full pool per width k scores them all.
                      Walking the reply with those lengths gives the exact τ each shape would get.
    estimated speed   τ / (forward(N) + draft(shape)) in units of one-token forwards = speedup over AR.
"""

from __future__ import annotations

import platform
import statistics
import time
from collections.abc import Sequence

import torch

from ..model.engine import Shard
from ..model.generate import ARDecoder, generate_ids, prefill_features
from ..model.sampling import SamplingParams
from ..speculative.decoder import DEFAULT_TREE
from ..speculative.drafter import TreeDrafter, TreeShape
from ..speculative.tree import DraftTree
from .single_device import _bar, _elapsed

TUNE_START = 0  # the tuner calibrates on lines [0, TUNE_COUNT) of each set, disjoint from the benchmark lines
NODE_SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32)
TOP_KS = (1, 2, 3, 4, 6, 8)
MAX_DEPTH = 6
CURVE_CONTEXT = 160  # committed tokens before the timed tree (a typical chat prompt + some reply)


def bushy_tree(n: int) -> DraftTree:
    """An n-node tree of the kind EAGLE-2 builds (a few children per node, breadth first)."""
    return DraftTree.from_lists([7] * n, [-1] + [(i - 1) // 3 for i in range(1, n)])


@torch.inference_mode()
def forward_curve(
    shard: Shard,
    sizes: Sequence[int] = NODE_SIZES,
    context: int = CURVE_CONTEXT,
    repeats: int = 7,
    progress: bool = False,
) -> dict[int, float]:
    """Median seconds of one n-node tree forward + one LM-head row, interleaved over sizes. -> {n: seconds}"""
    cache = shard.new_cache(context + max(sizes))
    shard(torch.randint(0, shard.cfg.vocab_size, (1, context)), cache)
    cache.commit(context)
    samples: dict[int, list[float]] = {n: [] for n in sizes}
    for _ in _bar(range(repeats), progress, "forward curve"):
        for n in sizes:
            tree = bushy_tree(n)
            ids, pos = tree.tokens[None], tree.positions(context)[None]
            mask = None if n == 1 else tree.attention_mask(context)[None]
            t = time.perf_counter()
            shard.logits(shard(ids, cache, positions=pos, mask=mask)[0, 0])
            samples[n].append(time.perf_counter() - t)
            cache.keep([])
    return {n: statistics.median(v) for n, v in samples.items()}


@torch.inference_mode()
def head_row_time(shard: Shard, repeats: int = 15) -> float:
    """Median seconds of one LM-head row: verification computes one per accepted node beyond the first."""
    f = torch.randn(shard.cfg.hidden_size, dtype=shard.dtype)
    samples = [_elapsed(lambda: shard.logits(f)) for _ in range(repeats)]
    return statistics.median(samples)


@torch.inference_mode()
def draft_costs(
    drafter: TreeDrafter, shard: Shard, prompt: Sequence[int], shapes: Sequence[TreeShape], repeats: int = 3
) -> tuple[dict[TreeShape, float], float]:
    """Median draft() seconds of each shape (frontier pruning makes it depend on the budget too, not only on
    depth and width), and of one feed of two committed tokens."""
    cache = shard.new_cache(len(prompt) + 8 * repeats + 8)
    feats = prefill_features(shard, cache, prompt)
    drafter.reset(len(prompt) + 8 * repeats + 1 + max(s.top_k for s in shapes) * MAX_DEPTH)
    drafter.feed(prompt, feats, int(prompt[-1]))
    for s in shapes[:: max(1, len(shapes) // 8)]:  # warm-up: first calls pay for allocations
        drafter.draft(s)
    out: dict[TreeShape, list[float]] = {s: [] for s in shapes}
    feed: list[float] = []
    for _ in range(repeats):
        for s in shapes:
            out[s].append(_elapsed(lambda s=s: drafter.draft(s)))
        two = feats[-2:]
        feed.append(_elapsed(lambda f=two: drafter.feed(prompt[-2:], f, int(prompt[-1]))))
    return {s: statistics.median(v) for s, v in out.items()}, statistics.median(feed)


def _ranks(pool: DraftTree, depth: int) -> dict[int, int]:
    """Rank of each candidate of a whole EAGLE-2 pool (creation order) in the rerank of a depth-``depth`` tree:
    the budget-N tree keeps exactly the candidates ranked < N - 1 (and the root)."""
    d, s = pool.depth.tolist(), pool.scores.tolist()
    cands = sorted((i for i in range(1, len(pool)) if d[i] <= depth), key=lambda i: (-s[i], i))
    return {node: r for r, node in enumerate(cands)}


@torch.inference_mode()
def teacher_forced_lengths(
    shard: Shard, drafter: TreeDrafter, prompt: Sequence[int], reply: Sequence[int], shapes: Sequence[TreeShape]
) -> dict[TreeShape, list[int]]:
    """Accepted draft length of each shape at each position of the greedy ``reply`` (its root there)."""
    feats = shard(torch.tensor([list(prompt) + list(reply)]), None)[0]  # [P + R, hidden]
    p = len(prompt)
    by_k: dict[int, list[TreeShape]] = {}
    for s in shapes:
        by_k.setdefault(s.top_k, []).append(s)
    drafter.reset(p + len(reply) + 1 + max(by_k) * MAX_DEPTH)
    drafter.feed(prompt, feats[:p], reply[0])
    out: dict[TreeShape, list[int]] = {s: [] for s in shapes}
    for i in range(len(reply) - 1):
        for k, group in by_k.items():
            dmax = max(s.depth for s in group)
            pool = drafter.draft(TreeShape(total_tokens=10**6, depth=dmax, top_k=k))
            path, node = [], 0  # the reply's continuation as a path in the pool (selected or not)
            for tok in reply[i + 1 : i + 1 + dmax]:
                node = pool.child_with_token(node, tok)
                if node is None:
                    break
                path.append(node)
            ranks = {d: _ranks(pool, d) for d in {s.depth for s in group}} if path else {}
            for s in group:  # ranks grow along a path (parents first), so the accepted part is a prefix
                out[s].append(sum(1 for n in path[: s.depth] if ranks[s.depth][n] < s.total_tokens - 1))
        drafter.feed([reply[i]], feats[p + i : p + i + 1], reply[i + 1])
    return out


def simulate_tau(lengths: Sequence[int], n_tokens: int) -> tuple[float, int]:
    """Walk a reply of ``n_tokens`` with per-position accepted lengths. -> (tau, target forwards incl. prefill)"""
    steps, produced = 1, 1
    while produced < n_tokens:
        emit = min(lengths[produced - 1] + 1, n_tokens - produced)
        produced += emit
        steps += 1
    return n_tokens / steps, steps


def candidate_shapes(
    sizes: Sequence[int] = NODE_SIZES, top_ks: Sequence[int] = TOP_KS, max_depth: int = MAX_DEPTH
) -> list[TreeShape]:
    """Distinct trees only: a width k >= N - 1 builds the same tree as the smallest such k (no node can keep
    more than N - 1 children, and every node that could be selected stays in a frontier that wide)."""
    out = []
    for n in sizes:
        wide = [k for k in top_ks if k >= n - 1]
        for k in [k for k in top_ks if k < n - 1] + wide[:1]:
            for d in range(1, min(max_depth, n - 1) + 1):
                if k == 1 and n - 1 != d:  # a chain: only its full length makes sense
                    continue
                out.append(TreeShape(total_tokens=n, depth=d, top_k=k))
    return out


def rank_shapes(
    curve: dict[int, float],
    drafts: dict[TreeShape, float],
    feed_s: float,
    head_row_s: float,
    taus: dict[TreeShape, float],
) -> list[dict]:
    """Estimated speedup over AR of each shape, best first. A step costs the tree forward, one LM-head row per
    accepted node (the first one is in the curve), the draft and one feed."""
    t1 = curve[1]
    rows = []
    for shape, tau in taus.items():
        cost = curve[shape.total_tokens] + (tau - 1) * head_row_s + drafts[shape] + feed_s
        rows.append(
            {
                "shape": shape.model_dump(),
                "tau": round(tau, 4),
                "step_cost": round(cost / t1, 4),
                "est_speedup": round(tau * t1 / cost, 4),
            }
        )
    rows.sort(key=lambda r: -r["est_speedup"])
    return rows


def tune(
    shard: Shard, drafter: TreeDrafter | None, prompts: Sequence[list[int]], max_new_tokens: int, progress: bool = True
) -> dict:
    """Measure the curve (and, with a drafter, draft costs and teacher-forced τ); pick the fastest tree."""
    result: dict = {
        "device": {
            "machine": platform.machine(),
            "processor": platform.processor() or None,
            "torch_threads": torch.get_num_threads(),
            "dtype": str(shard.dtype),
        }
    }
    curve = forward_curve(shard, progress=progress)
    result["forward_curve"] = {str(n): round(t / curve[1], 4) for n, t in curve.items()}
    result["one_token_forward_s"] = round(curve[1], 5)
    if drafter is None:
        return result
    shapes = candidate_shapes()
    head_s = head_row_time(shard)
    drafts, feed_s = draft_costs(drafter, shard, prompts[0], shapes)
    result["head_row_cost"] = round(head_s / curve[1], 4)
    result["feed_cost"] = round(feed_s / curve[1], 4)
    lengths: dict[TreeShape, list[int]] = {s: [] for s in shapes}
    steps = dict.fromkeys(shapes, 0)
    tokens = 0
    for prompt in _bar(prompts, progress, "teacher-forced acceptance"):
        reply, _ = generate_ids(ARDecoder(shard), prompt, SamplingParams(), max_new_tokens)
        if len(reply) < 2:
            continue
        per = teacher_forced_lengths(shard, drafter, prompt, reply, shapes)
        tokens += len(reply)
        for s in shapes:
            lengths[s] += per[s]
            steps[s] += simulate_tau(per[s], len(reply))[1]
    taus = {s: tokens / steps[s] for s in shapes}
    result["calibration"] = {"prompts": len(prompts), "tokens": tokens}
    result["candidates"] = rank_shapes(curve, drafts, feed_s, head_s, taus)
    for row in result["candidates"]:
        row["draft_cost"] = round(drafts[TreeShape(**row["shape"])] / curve[1], 4)
    # the estimates leave prompt lookup out (teacher-forced head drafts only): the tuned tree keeps the default's chain
    result["best"] = {**result["candidates"][0]["shape"], "lookup": DEFAULT_TREE.lookup}
    return result


# -- the Spec-Bench figures ------------------------------------------------------------------------------------


def tune_markdown(result: dict, top: int = 12) -> str:
    lines = [
        "# Tree-size tuning",
        "",
        f"Device: {result['device']}; one-token forward {result['one_token_forward_s'] * 1000:.1f} ms.",
        "",
        "| tree nodes | " + " | ".join(result["forward_curve"]) + " |",
        "|---|" + "---|" * len(result["forward_curve"]),
        "| forward / 1-token forward | " + " | ".join(str(v) for v in result["forward_curve"].values()) + " |",
    ]
    if "candidates" in result:
        lines += [
            "",
            f"Teacher-forced τ at T=0 on {result['calibration']}; per step also one feed "
            f"({result['feed_cost']}×) and one LM-head row per accepted token ({result['head_row_cost']}×).",
            "",
            "| tokens | depth | top-k | τ | draft (× forward) | step cost (× forward) | est. speedup |",
            "|---|---|---|---|---|---|---|",
        ]
        for r in result["candidates"][:top]:
            sh = r["shape"]
            lines.append(
                f"| {sh['total_tokens']} | {sh['depth']} | {sh['top_k']} | {r['tau']} | {r['draft_cost']} "
                f"| {r['step_cost']} | {r['est_speedup']} |"
            )
        best = result["candidates"][0]["est_speedup"]
        verdict = "" if best >= 1 else " (below 1: on this device speculation does not pay; keep --mode ar)"
        lines += ["", f"Best: {result['best']}, estimated {best}x autoregressive{verdict}"]
    return "\n".join(lines) + "\n"
