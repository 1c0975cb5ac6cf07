"""A raw-text prompt on the API starts with the BOS token where the model's tokenizer metadata says (as ``flowspec
generate --raw`` does: Tokenizer.encode_raw), once even if the client wrote it, on /v1/completions and Ollama's
/api/generate (``raw``, or a model without a chat template); token-id prompts and an earlier reply's ``context`` are
continued exactly as given."""

import pytest
from aiohttp.test_utils import TestClient, TestServer

from flowspec_p2p.api.app import create_app
from flowspec_p2p.decoding.ar import AR
from flowspec_p2p.decoding.leader import Leader
from flowspec_p2p.decoding.loopback import LoopbackRing
from flowspec_p2p.decoding.settings import LeaderSettings
from flowspec_p2p.speculative.drafter import OracleDrafter

from ..ring_fixtures import F64, tiny_parts, word_tokenizer

TOK = word_tokenizer(add_bos=True)  # a base model (no chat template) whose tokenizer wants <bos> (id 1), as Gemma 3's
N = 5


@pytest.fixture(scope="module")
def parts(tiny_llama):
    return tiny_parts(tiny_llama)


@pytest.fixture
async def client(parts):
    leader = Leader(parts.head, TOK, drafter=OracleDrafter(parts.whole), modes=[AR], model_id="tiny",
                    settings=LeaderSettings(max_context=200, ready_timeout_s=0.05))
    app = create_app(leader, lambda: {}, run_leader=False)
    async with (LoopbackRing(parts.stages, leader, hops="memory", wire_dtype=F64, capacity=200),
                TestClient(TestServer(app)) as c):
        yield c


def _text(parts, prompt) -> str:
    return TOK.decode(parts.reference(prompt, N, stop_ids=TOK.stop_ids))


@pytest.mark.parametrize(("prompt", "ids"), [
    ("w7 w9 w11", [1, 7, 9, 11]),  # the tokenizer's BOS first
    ("<bos> w7 w9 w11", [1, 7, 9, 11]),  # the client's own, not doubled
    ([7, 9, 11], [7, 9, 11]),  # token ids: exactly as given
    ([1, 1, 7], [1, 1, 7]),
])
async def test_completions_follow_the_tokenizers_bos_for_text_and_take_ids_as_given(client, parts, prompt, ids):
    r = await client.post("/v1/completions", json={"prompt": prompt, "max_tokens": N, "temperature": 0})
    body = await r.json()
    assert r.status == 200, body
    assert body["usage"]["prompt_tokens"] == len(ids)
    assert body["choices"][0]["text"] == _text(parts, ids)


async def test_ollama_generate_prompts_a_base_model_raw_with_bos_and_continues_a_context_without_one(client, parts):
    replies = []
    for extra in ({"raw": True}, {}, {"prompt": "<bos> w7 w9 w11", "raw": True}):
        r = await client.post("/api/generate", json={"model": "tiny", "prompt": "w7 w9 w11", "stream": False,
                                                     "options": {"temperature": 0, "num_predict": N}, **extra})
        replies.append(await r.json())
        assert r.status == 200, replies[-1]
    for reply in replies:  # raw, or a model without a chat template: the same raw prompt, one BOS
        assert reply["context"][:4] == [1, 7, 9, 11]
        assert reply["response"] == _text(parts, [1, 7, 9, 11])
    context = replies[0]["context"]
    r = await client.post("/api/generate", json={"model": "tiny", "prompt": "w13", "raw": True, "context": context,
                                                 "stream": False, "options": {"temperature": 0, "num_predict": N}})
    body = await r.json()
    assert body["context"][:len(context) + 1] == [*context, 13]  # a continuation: no BOS in the middle
    assert body["response"] == _text(parts, [*context, 13])
