"""A newer family in a cluster: three agents in one process (loopback, TLS, tiny models) serve Gemma 3 and Phi-3 on
the native engine; the members fetch their layers from the leader (Gemma's extra norms, Phi-3's fused matrices as
the row ranges of q, k, v, gate and up) and the reply equals single-device autoregressive decoding of the file."""

from __future__ import annotations

import pytest

from flowspec_p2p.agent import Agent
from flowspec_p2p.model import native_shard
from flowspec_p2p.model.generate import ARDecoder, generate_ids
from flowspec_p2p.model.native_shard import NativeShard
from flowspec_p2p.model.sampling import SamplingParams
from flowspec_p2p.model.weights import open_source
from flowspec_p2p.types import LayerRange

from ..agent_fixtures import complete, make_fixture, quick_timing_fixture, running, serving, until
from ..conftest import build_tiny_checkpoint
from ..ring_fixtures import ByteTokenizer
from .family_gguf import write_family_gguf

__all__ = ["make_fixture", "quick_timing_fixture"]

pytestmark = pytest.mark.skipif(not native_shard.available(), reason="the native engine is unavailable here")


@pytest.mark.parametrize("kind", ["gemma3", "phi3"])
async def test_three_agents_serve_a_newer_family_as_one_device_decodes_it(make, tmp_path, kind):
    import gguf

    layers = {"layer_types": ["sliding_attention", "full_attention", "sliding_attention"]} if kind == "gemma3" else {}
    build_tiny_checkpoint(tmp_path / "hf", kind, seed=31, num_hidden_layers=3, initializer_range=0.3, **layers)
    q8 = {f"blk.{i}.{m}.weight": gguf.GGMLQuantizationType.Q8_0 for i in range(3)
          for m in ("attn_q", "attn_k", "attn_v", "attn_qkv", "attn_output", "ffn_gate", "ffn_up", "ffn_down")}
    model = write_family_gguf(tmp_path / "m.gguf", tmp_path / "hf", qtypes=q8)
    src = open_source(model)
    prompt = ByteTokenizer().encode("abc hello world")
    ref, _ = generate_ids(ARDecoder(NativeShard.from_source(src, LayerRange(start=0, end=3), embed=True, head=True)),
                          prompt, SamplingParams(), 20)
    planning = {"context": 96, "stages": 3, "leader_layers": "always"}
    leader = Agent(make("lead", leader=True, model=model, dtype="float32", wire_dtype="float32", engine="native",
                        planning=planning), tokenizer=ByteTokenizer())
    a = Agent(make("a", dtype="float32", wire_dtype="float32", engine="native"))
    b = Agent(make("b", dtype="float32", wire_dtype="float32", engine="native"))
    async with running(leader, a, b):
        await until(serving(leader, 2))
        assert {s.agent_id for s in leader.coordinator.plan.stages} == {leader.id, a.id, b.id}
        data = await complete(leader, [1, *prompt], n=20)
    assert data["choices"][0]["text"] == ByteTokenizer().decode(ref)
    assert data["stats"]["new_tokens"] == 20
