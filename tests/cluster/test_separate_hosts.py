"""Three agents on three hosts: network namespaces on a private bridge (cluster/netns.py; needs root and iproute2,
else skipped with the reason), as `flowspec cluster up --netns` runs them. They find each other over mDNS across the
bridge, the members fetch their layers from the leader across it, a greedy reply equals the single-process reply,
and a host unplugged mid-request (its link cut, its agent killed, its namespace deleted) gives a re-plan and the same
reply. A small synthetic model (conftest synth_model), as separate processes."""

import json
import subprocess
import urllib.request

import pytest

from flowspec_p2p.cluster import netns
from flowspec_p2p.cluster.local_cluster import ClusterOptions, LocalCluster
from flowspec_p2p.model.generate import ARDecoder, generate_ids
from flowspec_p2p.model.load import load_model
from flowspec_p2p.model.sampling import SamplingParams

pytestmark = pytest.mark.slow

PROMPT = "The three hosts"
SHORT, LONG = 16, 120
UNPLUG_AFTER_CHUNKS = 6


def _post(url: str, body: dict) -> dict:
    req = urllib.request.Request(url, json.dumps(body).encode(), {"Content-Type": "application/json"})
    with urllib.request.urlopen(req, timeout=120) as r:
        return json.loads(r.read())


def _stream(url: str, body: dict, on_chunk) -> tuple[str, dict]:
    """A streamed completion: its text and the final stats; ``on_chunk(n)`` after the n-th chunk of text."""
    req = urllib.request.Request(url, json.dumps({**body, "stream": True}).encode(),
                                 {"Content-Type": "application/json"})
    text, stats, n = [], {}, 0
    with urllib.request.urlopen(req, timeout=180) as r:
        for raw in r:
            line = raw.decode().strip()
            if not line.startswith("data: ") or line == "data: [DONE]":
                continue
            event = json.loads(line[6:])
            assert "error" not in event, event
            piece = event["choices"][0].get("text") if event.get("choices") else None
            if piece:
                text.append(piece)
                n += 1
                on_chunk(n)
            stats = event.get("stats") or stats
    return "".join(text), stats


@pytest.fixture(name="reference", scope="module")
def reference_fixture(synth_model):
    """Single-process greedy decoding of PROMPT on the same engine: (ids, text) of LONG tokens."""
    lm = load_model(synth_model)
    ids, _ = generate_ids(ARDecoder(lm.shard), lm.tokenizer.encode(PROMPT), SamplingParams(temperature=0.0), LONG)
    return ids, lm.tokenizer.decode(ids)


def test_three_hosts_on_a_bridge_discover_fetch_serve_and_survive_one_unplugged(synth_model, reference, tmp_path):
    why = netns.available()
    if why:
        pytest.skip(why)
    ids, text = reference
    # slow devices by their score (splitting the layers beats one agent), the leader holding only the embedding and
    # LM head (as in FlowSpec), one request's KV, AR decoding: both members hold layers
    opts = ClusterOptions(netns=True, model=synth_model, state_root=tmp_path, decoding="ar", gflops=0.01, threads=1,
                          context=256, max_requests=1, leader_layers="never", ready_timeout_s=150)
    with LocalCluster(3, opts) as c:
        c.start()
        view = c.view()
        leader_url = view["members"][0]["address"]
        assert leader_url.startswith(f"https://{c.net.address(0)}:")  # on the bridge, not loopback
        assert {m["host"] for m in view["members"]} == {c.net.address(i) for i in range(3)}
        assert [s["agent_id"] for s in view["plan"]["stages"]] != [view["plan"]["leader_id"]]
        assert len(view["plan"]["stages"]) == 2  # the two members, the leader in front with its head
        for a in c.agents[1:]:  # each member fetched its layers from the leader across the bridge
            log = a.log_path.read_text()
            assert "MB transferred" in log, log[-2000:]
            assert "(fetched," in log
        completions = c.api_url + "/v1/completions"
        body = {"prompt": PROMPT, "max_tokens": SHORT, "temperature": 0, "return_token_ids": True}
        assert _post(completions, body)["stats"]["token_ids"] == ids[:SHORT]
        epoch = view["epoch"]

        def unplug(n: int) -> None:
            if n == UNPLUG_AFTER_CHUNKS:
                c.unplug(2)

        got, stats = _stream(completions, {**body, "max_tokens": LONG}, unplug)
        assert not c.agents[2].alive
        assert subprocess.run(["ip", "netns", "pids", c.net.namespaces[2]], capture_output=True).returncode != 0
        assert got == text  # resumed on the re-planned pipeline: the same greedy reply
        assert stats["token_ids"] == ids
        assert stats.get("resumed", 0) >= 1
        after = c.wait_ready(members=1, timeout_s=60)
        assert after["epoch"] > epoch
        assert len(after["plan"]["stages"]) == 1
