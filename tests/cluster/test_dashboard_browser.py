"""The dashboard in a real headless Chromium (Debian's ``chromium``, driven over the DevTools protocol: browser.py)
against a live ``flowspec cluster up -n 3`` on the real default model: the page loads with no console errors,
shows the members and the plan, streams a chat reply, and after a member is killed the topology drops it and the
plan changes; ``cluster up`` itself says what its agents do. It saves a screenshot (``FLOWSPEC_SCREENSHOT=path``
copies it there: ``FLOWSPEC_SCREENSHOT=docs/figures/dashboard.png`` makes the README's)."""

import asyncio
import os
import re
import signal
import subprocess
import sys
from pathlib import Path

import pytest

from ..browser import Chromium, find_chromium
from .test_local_cluster import alive, settled, wait_for

pytestmark = pytest.mark.slow

MEMBERS = "document.querySelectorAll('#members tbody tr.member').length"
PLAN = "[...document.querySelectorAll('#plan-bar .plan-seg')].map(e => e.dataset.agent)"
NODES = "[...document.querySelectorAll('#topology g.node')].map(e => e.dataset.id)"


def save(png: bytes, path: Path) -> None:
    path.write_bytes(png)
    if os.environ.get("FLOWSPEC_SCREENSHOT"):
        Path(os.environ["FLOWSPEC_SCREENSHOT"]).write_bytes(png)


@pytest.fixture(name="chromium")
def chromium_fixture():
    exe = find_chromium()
    if exe is None:
        pytest.skip("no chromium on PATH: `apt-get install -y chromium` (.ci/run installs it when it can)")
    return exe


@pytest.fixture(name="cluster_up")
def cluster_up_fixture(tmp_path):
    """(API URL, process) of a running `flowspec cluster up -n 3`; stopped with Ctrl-C after the test."""
    cmd = [sys.executable, "-m", "flowspec_p2p", "cluster", "up", "-n", "3", "--api-port", "0", "--context", "512",
           "--state-dir", str(tmp_path / "cluster")]
    err = open(tmp_path / "cluster-up.log", "w")  # noqa: SIM115 - the process writes to it until it ends
    proc = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=err, text=True)
    pids: list[int] = []
    try:
        line = proc.stdout.readline()  # "cluster '...': 3 agents, serving at http://127.0.0.1:PORT"
        m = re.search(r"serving at (http://\S+)", line)
        assert m, line + (tmp_path / "cluster-up.log").read_text()
        view = wait_for(settled(m.group(1), 2), 60, "the first plan")
        pids[:] = [mem["pid"] for mem in view["members"]]
        yield m.group(1), view
    finally:
        proc.send_signal(signal.SIGINT)
        try:
            proc.wait(30)
        finally:
            err.close()
            for p in pids:
                if alive(p):
                    os.kill(p, signal.SIGKILL)


async def test_the_dashboard_shows_a_live_cluster_streams_a_chat_reply_and_follows_a_replan(chromium, cluster_up,
                                                                                          tmp_path):
    api, view = cluster_up
    ids = {m["id"] for m in view["members"]}
    async with Chromium.start(tmp_path / "chromium") as browser:
        page = await browser.new_page(1400, 900)
        await page.goto(api + "/")
        assert await page.wait_for(f"{MEMBERS} === 3", 20, "three members")
        assert set(await page.eval(PLAN)) == ids  # three equal agents: every one holds layers
        assert set(await page.eval(NODES)) == ids
        assert await page.eval("document.querySelector('#epoch').textContent") == str(view["epoch"])

        await page.eval("document.querySelector('#chat-mode').value = 'flowspec'; "
                        "document.querySelector('#chat-max').value = '24'; "
                        "document.querySelector('#chat-input').value = 'Name three primary colors.'; "
                        "document.querySelector('#chat-form').requestSubmit(); true")
        await page.wait_for("!!document.querySelector('.msg.assistant.done')", 60, "the chat reply")
        reply = await page.eval("(() => { const m = document.querySelector('.msg.assistant'); "
                                "return {text: m.firstChild.textContent, chunks: Number(m.dataset.chunks), "
                                "error: m.classList.contains('error'), "
                                "stats: m.querySelector('.stats') && m.querySelector('.stats').textContent}; })()")
        assert not reply["error"], reply
        assert reply["text"].strip()
        assert reply["chunks"] > 1  # streamed, not delivered at once
        assert re.match(r"flowspec · \d+ tokens · τ \d\.\d\d", reply["stats"]), reply
        await page.wait_for("document.querySelector('#request-title').textContent.includes('completed')", 10,
                            "the request's stats")
        assert await page.eval("document.querySelectorAll('#stage-busy .row').length") == 3
        assert await page.eval("document.querySelectorAll('#depth .row').length === "  # one bar per depth reached
                               "view.state.request.acceptance_by_depth.length")
        await page.wait_for("document.querySelector('#topology .edge') !== null", 5, "the ring's links")
        save(await page.screenshot(), tmp_path / "dashboard.png")

        victim = next(m for m in view["members"] if m["role"] == "member")
        os.kill(victim["pid"], signal.SIGKILL)  # vanishes: no goodbye, no mDNS removal
        await page.wait_for(f"{MEMBERS} === 2", 60, "the topology without the killed member")
        epoch = await page.wait_for(f"Number(document.querySelector('#epoch').textContent) > {view['epoch']} && "
                                    "document.querySelector('#status').textContent === 'serving' && "
                                    "document.querySelector('#epoch').textContent", 60, "the new plan")
        plan = await page.eval(PLAN)
        assert victim["id"] not in plan
        assert victim["id"] not in await page.eval(NODES)
        assert await page.eval("document.querySelectorAll('#plan-history li').length") >= 2
        assert int(epoch) > view["epoch"]
        await asyncio.sleep(1.0)  # a few more pushes after the re-plan
        assert page.errors == []
        assert await page.eval("Number(document.body.dataset.updates)") > 5  # pushed, never reloaded
    said = (tmp_path / "cluster-up.log").read_text()  # what `cluster up` shows of its agents, at the default level
    assert re.search(rf"agent0 \| .* API at {api}/v1, dashboard at {api}/", said), said
    assert re.search(r"agent[12] \| .* joined cluster 'local-", said), said
    assert re.search(r"agent0 \| .* epoch \d+: 3 stage\(s\)", said), said
    assert re.search(r"agent0 \| .* epoch \d+: 2 stage\(s\)", said), said  # the re-plan, and why
    assert re.search(r"agent0 \| .* POST /v1/chat/completions 200 \d+ tokens \(flowspec\)", said), said
