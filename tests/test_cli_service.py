"""`flowspec service`: the unit as text (scope, user, ExecStart, restart policy, limits, sandbox, quoting), install /
status / uninstall of a user unit into temporary XDG folders (no systemd: nothing is started), the cluster key file
a leader's install makes and a member's takes, and `systemd-analyze verify` on the unit where systemd is installed."""

from __future__ import annotations

import shlex
import shutil
import stat
import subprocess
import sys

import pytest

from flowspec_p2p import cli
from flowspec_p2p.cluster.keys import ClusterKey
from flowspec_p2p.commands import service
from flowspec_p2p.commands.service import quote, service_for, unit_text


def _fields(text: str) -> dict[str, list[str]]:
    out: dict[str, list[str]] = {}
    for line in text.splitlines():
        if "=" in line and not line.startswith("#"):
            k, _, v = line.partition("=")
            out.setdefault(k, []).append(v)
    return out


def test_a_system_unit_runs_the_agent_as_its_user_with_its_key_state_restarts_and_limits(tmp_path):
    svc = service_for("home", True, "pi")
    text = unit_text(svc, leader=True, profile=tmp_path / "my profile.toml", python="/opt/fs/bin/python",
                     memory_max="1500M", cpu_quota="150%")
    f = _fields(text)
    argv = shlex.split(f["ExecStart"][0])
    assert argv == ["/opt/fs/bin/python", "-m", "flowspec_p2p", "agent", "--config", str(tmp_path / "my profile.toml"),
                    "--cluster", "home", "--leader", "--state-dir", "/var/lib/flowspec_p2p/home",
                    "--cluster-key-file", "/var/lib/flowspec_p2p/home/cluster.key"]
    assert (f["User"], f["StateDirectory"], f["StateDirectoryMode"]) == (["pi"], ["flowspec_p2p/home"], ["0700"])
    assert (f["Restart"], f["MemoryMax"], f["CPUQuota"]) == (["on-failure"], ["1500M"], ["150%"])
    assert {"StartLimitBurst", "LimitNOFILE", "TasksMax", "NoNewPrivileges", "ProtectSystem", "PrivateTmp"} <= f.keys()
    assert f["EnvironmentFile"] == ["-/etc/flowspec_p2p/home.env"]  # secrets (FLOWSPEC_API_KEY), if any
    assert f["WantedBy"] == ["multi-user.target"]
    assert f["After"] == ["network-online.target"]


def test_a_user_unit_has_no_user_and_no_system_sandbox_and_quotes_what_systemd_would_expand(tmp_path):
    svc = service_for("lab", False)
    text = unit_text(svc, leader=False, profile=tmp_path / "p.toml", python="/home/a b/100%/python",
                     pythonpath="/src/x")
    f = _fields(text)
    assert not {"User", "ProtectSystem", "After"} & f.keys()
    assert f["WantedBy"] == ["default.target"]
    assert f["ExecStart"][0].startswith('"/home/a b/100%%/python" -m flowspec_p2p agent')
    assert "--leader" not in f["ExecStart"][0]
    assert f["Environment"] == ["PYTHONUNBUFFERED=1", "PYTHONPATH=/src/x"]
    assert quote("$HOME") == "$$HOME"
    assert quote('a"b c') == '"a\\"b c"'


@pytest.fixture
def home(tmp_path, monkeypatch):
    """XDG folders in tmp_path; systemd not running; no key in the environment."""
    monkeypatch.setenv("XDG_CONFIG_HOME", str(tmp_path / "config"))
    monkeypatch.setenv("XDG_STATE_HOME", str(tmp_path / "state"))
    monkeypatch.delenv("FLOWSPEC_CLUSTER_KEY", raising=False)
    monkeypatch.setattr(service, "SYSTEMD_RUNNING", tmp_path / "no-systemd")
    return tmp_path


def test_install_status_uninstall_of_a_leader_and_a_member(home, capsys, monkeypatch):
    assert cli.main(["service", "install", "--user", "--leader", "--cluster", "home"]) == 0
    out = capsys.readouterr().out
    unit = home / "config" / "systemd" / "user" / "flowspec-agent-home.service"
    key_file = home / "state" / "flowspec_p2p" / "home" / "cluster.key"
    assert unit.is_file()
    assert stat.S_IMODE(key_file.stat().st_mode) == 0o600
    key = ClusterKey.parse(key_file.read_text())
    assert f"FLOWSPEC_CLUSTER_KEY={key.text}" in out  # what each member's install needs
    assert "systemd is not running here" in out
    profile = home / "config" / "flowspec_p2p" / "home.toml"
    assert 'cluster = "home"' in profile.read_text()
    assert f"--config {profile}" in unit.read_text()

    assert cli.main(["service", "install", "--user", "--leader", "--cluster", "home"]) == 0  # again: key kept
    assert ClusterKey.parse(key_file.read_text()) == key

    assert cli.main(["service", "status", "--user", "--cluster", "home"]) == 3  # written, not running
    assert f"key file: {key_file}" in capsys.readouterr().out

    assert cli.main(["service", "install", "--user", "--cluster", "other"]) == 1  # a member without a key
    monkeypatch.setenv("FLOWSPEC_CLUSTER_KEY", key.text)
    assert cli.main(["service", "install", "--user", "--cluster", "other"]) == 0
    member_key = home / "state" / "flowspec_p2p" / "other" / "cluster.key"
    assert ClusterKey.parse(member_key.read_text()) == key
    assert "--leader" not in (unit.parent / "flowspec-agent-other.service").read_text()

    assert cli.main(["service", "uninstall", "--user", "--cluster", "home"]) == 0
    assert not unit.exists()
    assert key_file.exists()  # the state stays unless --purge
    assert cli.main(["service", "uninstall", "--user", "--cluster", "other", "--purge"]) == 0
    assert not member_key.parent.exists()


def test_install_refuses_bad_limits_and_a_bad_profile(home, tmp_path):
    assert cli.main(["service", "install", "--user", "--leader", "--memory-max", "lots"]) == 1
    bad = tmp_path / "bad.toml"
    bad.write_text('clusterr = "x"\n')
    assert cli.main(["service", "install", "--user", "--leader", "--config", str(bad)]) == 1
    assert not (home / "config" / "systemd").exists()


@pytest.mark.skipif(shutil.which("systemd-analyze") is None, reason="systemd-analyze is not installed here")
def test_systemd_analyze_verifies_the_system_unit(tmp_path):
    svc = service_for("home", True, "root")
    path = tmp_path / svc.unit
    path.write_text(unit_text(svc, leader=True, profile=tmp_path / "home.toml", python=sys.executable))
    r = subprocess.run(["systemd-analyze", "verify", str(path)], capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr
    assert svc.unit not in r.stderr, r.stderr  # no complaint about our unit
