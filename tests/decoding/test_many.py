"""Many requests at once through one ring (issue: many users): every mode, eight different prompts alone and then
all at once, over a 3-stage ring that batches the requests' forwards in each stage. Each reply is token for token
the reply it gets alone (greedy: single-device autoregressive decoding), and a seeded sampled reply the same text."""

import asyncio

import pytest
import torch

from flowspec_p2p.decoding.ar import AR
from flowspec_p2p.decoding.chunk import CHUNK
from flowspec_p2p.decoding.flowspec import make_flowspec
from flowspec_p2p.decoding.leader import Leader
from flowspec_p2p.decoding.loopback import LoopbackRing
from flowspec_p2p.decoding.pipedec import make_pipedec
from flowspec_p2p.decoding.settings import LeaderSettings
from flowspec_p2p.ledger import Ledger
from flowspec_p2p.model import native_shard
from flowspec_p2p.model.generate import ARDecoder, generate_ids
from flowspec_p2p.model.load import get_engine
from flowspec_p2p.model.sampling import SamplingParams
from flowspec_p2p.model.weights import open_source
from flowspec_p2p.speculative.drafter import HeadDrafter
from flowspec_p2p.speculative.head import DraftHead
from flowspec_p2p.types import LayerRange

from ..gguf_fixtures import write_random_gguf
from ..ring_fixtures import F64, tiny_parts

MODES = ["ar", "chunk", "pipedec", "flowspec", "auto"]
PROMPTS = [[5 + i, 17, 33 - i, 8, 61, 9 + 2 * i, 12, 40][: 4 + i % 5] for i in range(8)]
TOKENS = 14


@pytest.fixture(scope="module")
def parts(tiny_llama):
    return tiny_parts(tiny_llama)


@pytest.fixture(scope="module")
def drafter(parts):
    torch.manual_seed(0)
    head = DraftHead(parts.whole.cfg).to(F64)
    head.block.reset_parameters(0.1)
    return HeadDrafter(head, parts.head)


def make_leader(parts, drafter):
    return Leader(parts.head, None, drafter=drafter, modes=[AR, CHUNK, make_pipedec(), make_flowspec()],
                  settings=LeaderSettings(max_context=120, prefill_chunk=4, max_requests=8, step_timeout_s=30.0))


async def generate(leader, prompt, mode, params):
    out, stats = [], Ledger(mode="?")
    async for chunk in leader.generate(prompt, params=params, max_tokens=TOKENS, stop_ids=frozenset(), mode=mode,
                                       stats=stats):
        out += chunk
    return out


@pytest.mark.parametrize("mode", MODES)
async def test_eight_requests_at_once_each_get_the_reply_they_get_alone(parts, drafter, mode):
    greedy = SamplingParams()
    leader = make_leader(parts, drafter)
    async with LoopbackRing(parts.stages, leader, hops="memory", wire_dtype=F64) as ring:
        alone = [await generate(leader, p, mode, greedy) for p in PROMPTS]
        b = leader.parts.batcher
        calls, decided = b.calls, b.rows + b.walks
        together = await asyncio.gather(*(generate(leader, p, mode, greedy) for p in PROMPTS))
        batched = sum(w.snapshot().get("batched_forwards", 0) for w in ring.workers)
        assert all(w.snapshot()["errors"] == 0 for w in ring.workers)
        assert b.rows + b.walks - decided > b.calls - calls  # LM-head calls held several requests' tokens or walks
        if mode in ("flowspec", "pipedec"):
            assert b.walks > 0  # greedy walks go through the shared calls
        async with asyncio.timeout(5):  # every request's state freed on every stage (the Releases go in band)
            while any(w.core.requests for w in ring.workers):  # noqa: ASYNC110 - polling the stages' state
                await asyncio.sleep(0.01)
    assert alone == [parts.reference(p, TOKENS) for p in PROMPTS]
    assert list(together) == alone
    assert batched > 0  # the stages ran several requests' forwards in one call


@pytest.mark.parametrize("mode", ["ar", "flowspec", "auto"])
async def test_seeded_sampled_requests_give_the_same_text_alone_and_among_others(parts, drafter, mode):
    params = [SamplingParams(temperature=0.9, top_k=20, seed=100 + i) for i in range(len(PROMPTS))]
    leader = make_leader(parts, drafter)
    async with LoopbackRing(parts.stages, leader, hops="memory", wire_dtype=F64):
        alone = [await generate(leader, p, mode, sp) for p, sp in zip(PROMPTS, params, strict=True)]
        together = await asyncio.gather(*(generate(leader, p, mode, sp)
                                          for p, sp in zip(PROMPTS, params, strict=True)))
    assert list(together) == alone
    assert alone == [parts.reference(p, TOKENS, sp) for p, sp in zip(PROMPTS, params, strict=True)]


@pytest.mark.skipif(not native_shard.available(), reason="the native engine is unavailable here")
@pytest.mark.parametrize("mode", ["ar", "flowspec"])
async def test_on_the_native_engine_batched_requests_equal_autoregressive_decoding_bit_for_bit(tmp_path, mode):
    """Two native stages that batch the requests' rows in one engine call: each reply is the single-device
    autoregressive reply, token for token (the engine is batch-invariant, so no tolerance)."""
    src = open_source(write_random_gguf(tmp_path / "q4_k.gguf", "Q4_K", seed=3, scale=0.2))
    engine = get_engine("native")
    whole = engine.load(src, LayerRange(start=0, end=2), embed=True, head=True)
    head = engine.load(src, LayerRange(start=0, end=0), embed=True, head=True)
    stages = [engine.load(src, LayerRange(start=0, end=1), embed=True, head=False),
              engine.load(src, LayerRange(start=1, end=2), embed=False, head=True, lm_head=False)]
    torch.manual_seed(0)
    net = DraftHead(whole.cfg).to(torch.float32)
    net.block.reset_parameters(0.05)
    drafter = HeadDrafter(engine.draft_net(whole.cfg, net.state_dict(), whole.max_position), head)
    leader = Leader(head, None, drafter=drafter, modes=[AR, make_flowspec()],
                    settings=LeaderSettings(max_context=120, prefill_chunk=4, max_requests=8))
    greedy = SamplingParams()
    async with LoopbackRing(stages, leader, hops="memory", wire_dtype=torch.float32) as ring:
        together = await asyncio.gather(*(generate(leader, p, mode, greedy) for p in PROMPTS))
        batched = sum(w.snapshot().get("batched_forwards", 0) for w in ring.workers)
    assert list(together) == [generate_ids(ARDecoder(whole), p, greedy, TOKENS)[0] for p in PROMPTS]
    assert batched > 0
    leader.close()


@pytest.mark.parametrize("mode", MODES)
async def test_a_second_turn_reuses_the_first_turns_kv_and_replies_as_a_cold_prefill(parts, drafter, mode):
    """Turn 2's prompt is turn 1's prompt, its reply and a new message: every stage starts from the KV turn 1 left,
    only the rest is prefilled, and the reply equals a cold prefill's (single-device decoding) token for token."""
    greedy = SamplingParams()
    first = [5, 17, 33, 8, 61, 9, 12, 40, 3, 77, 21, 30, 31, 32, 44, 45, 46, 47]
    computed = {}
    for cached in (True, False):
        leader = make_leader(parts, drafter)
        leader.settings = leader.settings.model_copy(update={"prompt_cache": cached})
        async with LoopbackRing(parts.stages, leader, hops="memory", wire_dtype=F64) as ring:
            reply = await generate(leader, first, mode, greedy)
            second = [*first, *reply, 50, 51, 52]
            before = ring.workers[0].snapshot()["tokens"]
            again = await generate(leader, second, mode, greedy)
            computed[cached] = ring.workers[0].snapshot()["tokens"] - before  # rows stage 1 ran for turn 2
            reused = [w.core.counters["reused"] for w in ring.workers]
            cache = leader.snapshot()["prompt_cache"]
        assert again == parts.reference(second, TOKENS)
        assert reused == ([1, 1, 1] if cached else [0, 0, 0])
        assert cache["hits"] == int(cached)
        if cached:
            shared = cache["reused_tokens"]
            assert len(first) <= shared < len(second)
    if mode == "ar":  # no drafts: the rows stage 1 ran are the prefill's and the steps' alone
        assert computed[False] - computed[True] == shared  # the shared prefix was not prefilled again
    assert computed[True] < computed[False]


async def test_a_long_prompt_is_prefilled_among_other_requests_steps_not_ahead_of_them(parts, drafter):
    """A 200-token prompt goes in 4-token chunks that each stage batches with the other request's steps, so a reply
    already decoding keeps streaming while the long prompt is read (it does not wait behind the whole prefill)."""
    leader = Leader(parts.head, None, drafter=drafter, modes=[AR],
                    settings=LeaderSettings(max_context=260, prefill_chunk=4, max_requests=2, step_timeout_s=30.0))
    long_prompt = [(7 * i) % 50 + 3 for i in range(200)]
    loop = asyncio.get_running_loop()
    stamps: list[float] = []  # when each of the short request's tokens came
    under_way = asyncio.Event()
    async with LoopbackRing(parts.stages, leader, hops="memory", wire_dtype=F64, capacity=300):
        async def short():
            out = []
            async for chunk in leader.generate(PROMPTS[0], params=SamplingParams(), max_tokens=80,
                                               stop_ids=frozenset(), mode="ar"):
                out += chunk
                stamps.extend(loop.time() for _ in chunk)
                if len(stamps) >= 3:
                    under_way.set()
            return out

        async def long():
            await under_way.wait()  # the short reply is under way
            started = loop.time()
            gen = leader.generate(long_prompt, params=SamplingParams(), max_tokens=4, stop_ids=frozenset(), mode="ar")
            out = await anext(gen)
            first = loop.time()
            async for chunk in gen:
                out += chunk
            return out, started, first

        short_out, (long_out, started, first) = await asyncio.gather(short(), long())
    assert short_out == parts.reference(PROMPTS[0], 80)
    assert long_out == parts.reference(long_prompt, 4)
    during = sum(started < t < first for t in stamps)
    assert during >= 5, (during, len(stamps))  # 50 chunks: the short reply went on between them


def test_a_call_of_greedy_requests_takes_the_argmax_alone_and_any_other_the_logits(parts, drafter):
    """The batched next-token call: greedy requests without logprobs get the engine's argmax (no [n, vocab] logits);
    a call holding one that asks for logprobs scores logits for all. The same tokens either way, each request's
    position one further."""
    import dataclasses

    from flowspec_p2p.decoding.batcher import _decide
    from flowspec_p2p.decoding.context import ModeContext, Pipeline
    from flowspec_p2p.pipeline.transport import QueueSender

    calls = []

    class Spy:  # the head shard, its LM-head calls counted
        def logits(self, f):
            calls.append("logits")
            return parts.head.logits(f)

        def greedy_tokens(self, f):
            calls.append("argmax")
            return parts.head.greedy_tokens(f)

    lparts = dataclasses.replace(make_leader(parts, drafter).parts, head=Spy())
    torch.manual_seed(1)
    feats = torch.randn(3, parts.whole.cfg.hidden_size, dtype=F64)  # [3, hidden]
    want = parts.head.logits(feats).argmax(-1).tolist()

    def batch(logprobs_of: int | None) -> list:
        ring = Pipeline(QueueSender(asyncio.Queue(), "s1"), epoch=0, stages=1)
        ctxs = [ModeContext(lparts, ring, f"r{i}", [1, 2], SamplingParams(), 4, frozenset(),
                            Ledger(mode="ar", top_logprobs=2 if i == logprobs_of else None)) for i in range(3)]
        return [(c, feats[i], None) for i, c in enumerate(ctxs)]

    greedy = batch(None)
    assert _decide(greedy, [])[0] == want
    assert calls == ["argmax"]
    assert [c.next_position for c, _, _ in greedy] == [3, 3, 3]  # the prompt's 2, the token decided, one on
    mixed = batch(2)
    assert _decide(mixed, [])[0] == want
    assert calls == ["argmax", "logits"]
    assert len(mixed[2][0].pending_logprobs) == 1


def test_greedy_walks_share_one_lm_head_call_with_next_tokens_and_give_the_verdicts_they_give_alone(parts, drafter):
    """Two requests' walks and a third's next token: the walks' first rows and the next token's row go in one
    argmax call; a walk that goes further than its first rows computes the rest itself; each verdict is
    verify_walk's for that walk alone."""
    import dataclasses

    from flowspec_p2p.decoding.batcher import _decide, _Walk
    from flowspec_p2p.decoding.context import ModeContext, Pipeline
    from flowspec_p2p.pipeline.transport import QueueSender
    from flowspec_p2p.speculative.tree import DraftTree
    from flowspec_p2p.speculative.verify import ROW_BATCH, verify_walk

    rows_per_call = []

    class Spy:
        def greedy_tokens(self, f):
            rows_per_call.append(len(f))
            return parts.head.greedy_tokens(f)

    lparts = dataclasses.replace(make_leader(parts, drafter).parts, head=Spy())
    torch.manual_seed(2)
    hidden = parts.whole.cfg.hidden_size
    feats = torch.randn(8, hidden, dtype=F64)  # [8, hidden]: node i's features
    best = parts.head.greedy_tokens(feats).tolist()  # the target's token after each node
    # walk A: a chain the target accepts 6 deep (0 -> 1 -> ... -> 6), past its first ROW_BATCH rows, and a sibling
    chain = DraftTree.from_lists([5, *best[:6], best[0] + 1], [-1, 0, 1, 2, 3, 4, 5, 0])
    # walk B: the root's only child is not the target's token
    wrong = DraftTree.from_lists([5, best[0] + 1], [-1, 0])
    ring = Pipeline(QueueSender(asyncio.Queue(), "s1"), epoch=0, stages=1)
    ctxs = [ModeContext(lparts, ring, f"r{i}", [1, 2], SamplingParams(), 8, frozenset(), Ledger(mode="flowspec"))
            for i in range(3)]
    walks = [_Walk(ctxs[0], chain, len(chain), lambda idx: feats[idx], None),
             _Walk(ctxs[1], wrong, len(wrong), lambda idx: feats[idx], None)]
    tokens, verdicts = _decide([(ctxs[2], feats[7], None)], walks)
    assert tokens == [best[7]]
    assert rows_per_call[0] == 1 + ROW_BATCH + 2  # the next token, walk A's first rows, walk B's root and child
    assert rows_per_call[1:] == [3]  # walk A's deeper rows (4, 5, 6), its own call
    for w, v in zip(walks, verdicts, strict=True):
        alone, _ = verify_walk(w.tree, w.n, SamplingParams(), None, logits=None,
                               tokens=lambda idx: parts.head.greedy_tokens(feats[idx]))
        assert v == alone
    assert (verdicts[0].accepted, verdicts[0].token) == ([0, 1, 2, 3, 4, 5, 6], best[6])
    assert (verdicts[1].accepted, verdicts[1].token) == ([0], best[0])
