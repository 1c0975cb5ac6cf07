"""The official `ollama` client against a real cluster: `flowspec cluster up -n 2 --model smollm2-135m` (the model
by name) starts a leader and a member that find each other over mDNS on loopback and split the layers; chat,
generate and streaming give the single-device greedy text, tags and /v1/models list the model by its name, and an
option we cannot honour gets a 400 naming it."""

import json
import os
import re
import signal
import subprocess
import sys
import urllib.request

import ollama
import pytest

from flowspec_p2p.ledger import Ledger
from flowspec_p2p.model.generate import ARDecoder, stream_text
from flowspec_p2p.model.sampling import SamplingParams

from .test_local_cluster import alive, settled, wait_for

pytestmark = pytest.mark.slow

QUESTION = "Name three primary colors."
MESSAGES = [{"role": "user", "content": QUESTION}]
GREEDY = {"temperature": 0, "num_predict": 24}


def test_the_ollama_client_against_a_cluster_started_by_model_name(default_model, tmp_path):
    tok = default_model.tokenizer
    chunks = ARDecoder(default_model.shard)(tok.chat(MESSAGES), SamplingParams(), 24, tok.stop_ids, Ledger(mode="ar"))
    expected = "".join(d.text for d in stream_text(chunks, tok))

    env = {**os.environ, "FLOWSPEC_CACHE_DIR": str(tmp_path / "cache"), "OMP_NUM_THREADS": "1"}
    cmd = [sys.executable, "-m", "flowspec_p2p", "cluster", "up", "-n", "2", "--model", "smollm2-135m",
           "--api-port", "0", "--context", "512", "--wire-dtype", "float32", "--state-dir", str(tmp_path / "state")]
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=subprocess.PIPE, text=True, env=env)
    pids: list[int] = []
    try:
        line = proc.stdout.readline()
        m = re.search(r"serving at (http://\S+)", line)
        assert m, line + proc.stderr.read()
        api = m.group(1)
        view = wait_for(settled(api, 1), 90, "the first plan")
        pids = [mem["pid"] for mem in view["members"]]
        assert len(view["plan"]["stages"]) == 2  # the layers are split over both agents

        client = ollama.Client(host=api, timeout=120)
        assert "smollm2-135m:latest" in [mod.model for mod in client.list().models]
        with urllib.request.urlopen(api + "/v1/models", timeout=30) as r:
            assert json.loads(r.read())["data"][0]["id"] == "smollm2-135m"
        # "ar" names the mode: plain autoregressive decoding through the pipeline
        r = client.chat(model="ar", messages=MESSAGES, options=GREEDY)
        assert r.message.content == expected
        streamed = "".join(c.message.content for c in client.chat(model="smollm2-135m", messages=MESSAGES,
                                                                   options=GREEDY, stream=True))
        assert streamed == expected  # the default mode (auto) gives the same text
        g = client.generate(model="smollm2-135m:latest", prompt=QUESTION, options=GREEDY)
        assert g.response == expected
        assert client.show("smollm2-135m").details.quantization_level == "Q4_1"
        with pytest.raises(ollama.ResponseError) as e:
            client.chat(model="smollm2-135m", messages=MESSAGES, options={"repeat_penalty": 1.2})
        assert e.value.status_code == 400
        assert "options.repeat_penalty" in e.value.error
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        except subprocess.TimeoutExpired:
            proc.kill()
            raise
        finally:
            for p in pids:
                if alive(p):
                    os.kill(p, signal.SIGKILL)
    assert proc.returncode == 0
