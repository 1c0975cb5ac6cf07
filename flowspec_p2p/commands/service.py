"""``flowspec service install|status|uninstall``: an agent as a systemd service, started at boot and restarted after a
crash.

One unit per cluster on a device, ``flowspec-agent-<cluster>.service``, in one of two scopes:

    --system (the default as root)   /etc/systemd/system/<unit>; runs as the user who ran sudo (--run-as USER);
                                     profile /etc/flowspec_p2p/<cluster>.toml, secrets /etc/flowspec_p2p/<cluster>.env,
                                     state /var/lib/flowspec_p2p/<cluster>; logs: journalctl -u <unit>
    --user   (the default otherwise) ~/.config/systemd/user/<unit>; profile ~/.config/flowspec_p2p/<cluster>.toml
                                     (and .env), state ~/.local/state/flowspec_p2p/<cluster>; logs: journalctl --user
                                     -u <unit>; at boot only with `loginctl enable-linger`

The unit runs ``<this python> -m flowspec_p2p agent --config <profile> --cluster <cluster> [--leader] --state-dir
<state> --cluster-key-file <state>/cluster.key``: the profile is an agents/*.toml file (``--config`` names one, read
where it lies; else a minimal one is written), read at every start. The key file is written at install (0600): from
--key-file or $FLOWSPEC_CLUSTER_KEY, else kept from an earlier install, else (a leader) a new key, whose member line is
printed. Restart=on-failure (at most 10 starts in 10 minutes), MemoryMax (default 90% of RAM), LimitNOFILE, TasksMax;
a system unit is also sandboxed (NoNewPrivileges, ProtectSystem=full, PrivateTmp, ...).
"""

from __future__ import annotations

import argparse
import os
import pwd
import re
import shutil
import subprocess
import sys
from dataclasses import dataclass
from pathlib import Path

from .. import config, env
from ..errors import ConfigError

UNIT_PREFIX = "flowspec-agent-"
PACKAGE_DIR = "flowspec_p2p"
SYSTEM_UNITS = Path("/etc/systemd/system")
SYSTEM_CONFIG = Path("/etc") / PACKAGE_DIR
SYSTEM_STATE = Path("/var/lib")
SYSTEMD_RUNNING = Path("/run/systemd/system")  # sd_booted(): systemd is this machine's init
DEFAULT_MEMORY_MAX = "90%"
START_LIMIT = (10, 600)  # at most 10 starts in 600 s, then systemd gives up (a broken profile does not spin)
SIZE = re.compile(r"^(\d+(\.\d+)?[KMGT]?|\d{1,3}%|infinity)$")


@dataclass(frozen=True)
class Service:
    """Where one cluster's service lives, and how it runs."""

    cluster: str
    system: bool
    unit_dir: Path
    config_dir: Path
    state_dir: Path  # the agent's state folder
    user: str | None = None  # (system) whom it runs as

    @property
    def unit(self) -> str:
        return f"{UNIT_PREFIX}{self.cluster}.service"

    @property
    def unit_path(self) -> Path:
        return self.unit_dir / self.unit

    @property
    def profile(self) -> Path:
        return self.config_dir / f"{self.cluster}.toml"

    @property
    def env_file(self) -> Path:
        return self.config_dir / f"{self.cluster}.env"

    @property
    def key_file(self) -> Path:
        return self.state_dir / env.KEY_FILE

    def systemctl(self, *args: str) -> list[str]:
        return ["systemctl", *([] if self.system else ["--user"]), *args]

    def logs_command(self) -> str:
        return f"journalctl {'' if self.system else '--user '}-u {self.unit} -f"


def service_for(cluster: str, system: bool, user: str | None = None) -> Service:
    if system:
        return Service(cluster, True, SYSTEM_UNITS, SYSTEM_CONFIG, SYSTEM_STATE / PACKAGE_DIR / cluster, user)
    return Service(cluster, False, env.config_home() / "systemd" / "user", env.config_home() / PACKAGE_DIR,
                   env.state_home() / PACKAGE_DIR / cluster)


# ------------------------------------------------------------------------------------------------ the unit's text


def quote(arg: str) -> str:
    """One ExecStart argument as systemd reads it: % and $ escaped, quoted where it holds spaces or quotes."""
    arg = arg.replace("%", "%%").replace("$", "$$")
    if re.search(r"[\s\"'\\;]", arg) or not arg:
        return '"' + arg.replace("\\", "\\\\").replace('"', '\\"') + '"'
    return arg


def exec_start(svc: Service, leader: bool, profile: Path, python: str) -> list[str]:
    return [python, "-m", "flowspec_p2p", "agent", "--config", str(profile), "--cluster", svc.cluster,
            *(["--leader"] if leader else []), "--state-dir", str(svc.state_dir), "--cluster-key-file",
            str(svc.key_file)]


def unit_text(svc: Service, *, leader: bool, profile: Path, python: str, memory_max: str = DEFAULT_MEMORY_MAX,
              cpu_quota: str | None = None, pythonpath: str | None = None) -> str:
    """The unit file: pure text, tested as such (and by `systemd-analyze verify` where systemd is present)."""
    role = "leader" if leader else "member"
    state = f"{PACKAGE_DIR}/{svc.cluster}"
    lines = [
        f"# Written by `flowspec service install{' --leader' if leader else ''} --cluster {svc.cluster}`; "
        f"`flowspec service uninstall --cluster {svc.cluster}` removes it.",
        f"# The agent's profile (agents/*.toml format), read at every start: {profile}",
        f"# Its state (agent id, fetched weights, the cluster key): {svc.state_dir}. Logs: {svc.logs_command()}",
        "[Unit]",
        f"Description=flowspec_p2p agent ({role}) of cluster {svc.cluster}",
        *(["Wants=network-online.target", "After=network-online.target"] if svc.system else []),
        f"StartLimitBurst={START_LIMIT[0]}",
        f"StartLimitIntervalSec={START_LIMIT[1]}",
        "",
        "[Service]",
        "Type=simple",
        *([f"User={svc.user}"] if svc.system and svc.user else []),
        "ExecStart=" + " ".join(quote(a) for a in exec_start(svc, leader, profile, python)),
        f"EnvironmentFile=-{svc.env_file}",
        "Environment=PYTHONUNBUFFERED=1",
        *([f"Environment={quote('PYTHONPATH=' + pythonpath)}"] if pythonpath else []),
        f"StateDirectory={state}",
        "StateDirectoryMode=0700",
        f"WorkingDirectory={svc.state_dir}",
        "Restart=on-failure",
        "RestartSec=5",
        "TimeoutStopSec=30",
        f"MemoryMax={memory_max}",
        *([f"CPUQuota={cpu_quota}"] if cpu_quota else []),
        "LimitNOFILE=65536",
        "TasksMax=512",
        "NoNewPrivileges=yes",
        *(["PrivateTmp=yes", "ProtectSystem=full", "ProtectKernelTunables=yes", "ProtectKernelModules=yes",
           "ProtectControlGroups=yes", "RestrictSUIDSGID=yes", "LockPersonality=yes"] if svc.system else []),
        "",
        "[Install]",
        f"WantedBy={'multi-user.target' if svc.system else 'default.target'}",
    ]
    return "\n".join(lines) + "\n"


def profile_text(cluster: str, leader: bool) -> str:
    return "\n".join([
        f"# The profile of this device's agent of cluster {cluster!r}, written by `flowspec service install`: the same",
        "# format as agents/*.toml (README: Run an agent as a service). The service reads it at every start; after an",
        "# edit: systemctl [--user] restart the unit. The unit's flags (--cluster, --leader, --state-dir,",
        "# --cluster-key-file) take precedence. Secrets (FLOWSPEC_API_KEY=...) go in the .env file beside this one.",
        f'cluster = "{cluster}"',
        *(["leader = true", "# api_host = \"0.0.0.0\"  # serve the API on the LAN (then give it FLOWSPEC_API_KEY)",
           "# api_port = 8000", "# model = \"smollm2-135m\"  # a model name or a GGUF path"] if leader else []),
        "",
        "# [profile]  # values that replace the agent's own measurements",
        "# memory_mb = 1536",
        "",
    ])


# ------------------------------------------------------------------------------------------------ the command


def register(sub: argparse._SubParsersAction) -> None:
    p = sub.add_parser("service", help="run an agent as a systemd service (started at boot, restarted on failure)",
                       description="An agent as a systemd service: started at boot, restarted after a crash, with a "
                       "state folder, its cluster key file and resource limits. One unit per cluster on a device, "
                       "flowspec-agent-<cluster>.service: a system unit as root, else a user unit. See README: Run an "
                       "agent as a service.")
    verbs = p.add_subparsers(dest="verb", metavar="VERB", required=True)
    install = verbs.add_parser("install", help="write the unit (and its profile and key file), enable and start it",
                               description="Write flowspec-agent-<cluster>.service, its profile and its cluster key "
                               "file, then enable and start it (where systemd runs).")
    status = verbs.add_parser("status", help="the service's paths and systemctl status")
    uninstall = verbs.add_parser("uninstall", help="stop, disable and remove the unit (state and profile are kept)")
    for q in (install, status, uninstall):
        q.add_argument("--cluster", default="default", help="the cluster's name (default 'default')")
        scope = q.add_mutually_exclusive_group()
        scope.add_argument("--system", action="store_true", default=None,
                           help="a system unit (the default when run as root)")
        scope.add_argument("--user", action="store_false", dest="system", default=None,
                           help="a user unit (the default otherwise)")
    install.add_argument("--leader", action="store_true", help="this device's agent plans and serves the API")
    install.add_argument("--config", type=Path, default=None,
                         help="the agent's profile (an agents/*.toml file), read where it lies (default: a minimal "
                         "one written beside the unit's other files)")
    install.add_argument("--key-file", type=Path, default=None,
                         help=f"the cluster key to install (default ${env.CLUSTER_KEY}, else the one installed before, "
                         "else a new one for a leader)")
    install.add_argument("--run-as", default=None, metavar="USER",
                         help="(system) the user the agent runs as (default: who ran sudo, else root)")
    install.add_argument("--memory-max", default=DEFAULT_MEMORY_MAX, metavar="SIZE",
                         help=f"the agent's memory limit, e.g. 1500M, 2G or 80%% (default {DEFAULT_MEMORY_MAX}%)")
    install.add_argument("--cpu-quota", default=None, metavar="PCT", help="a CPU limit, e.g. 150%% (1.5 cores)")
    install.add_argument("--print", action="store_true", dest="print_only", help="print the unit; write nothing")
    install.add_argument("--no-start", action="store_true", help="write and enable, do not start now")
    uninstall.add_argument("--purge", action="store_true", help="also delete the state folder and the profile")
    for q in (install, status, uninstall):
        q.set_defaults(func=run)


def _scope(args: argparse.Namespace) -> bool:
    return os.geteuid() == 0 if args.system is None else args.system


def _systemd_runs() -> bool:
    return SYSTEMD_RUNNING.is_dir() and shutil.which("systemctl") is not None


def _systemctl(svc: Service, *args: str, check: bool = True) -> int:
    r = subprocess.run(svc.systemctl(*args), check=False)
    if check and r.returncode != 0:
        raise ConfigError(f"`{' '.join(svc.systemctl(*args))}` failed ({r.returncode})")
    return r.returncode


def _pythonpath() -> str | None:
    """Where this package is importable from, when this python finds it only through $PYTHONPATH (a checkout)."""
    clean = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    r = subprocess.run([sys.executable, "-c", "import flowspec_p2p"], env=clean, cwd="/", capture_output=True,
                       check=False)
    return None if r.returncode == 0 else str(Path(__file__).resolve().parents[2])


def _install_key(svc: Service, args: argparse.Namespace, owner: str | None) -> str:
    """Writes the key file -> what to tell the user."""
    from ..cluster.keys import ClusterKey, member_line, read_key, write_key

    if args.key_file is not None:
        key, said = read_key(args.key_file.expanduser()), f"from {args.key_file}"
    elif env.get(env.CLUSTER_KEY):
        key, said = ClusterKey.parse(env.get(env.CLUSTER_KEY) or "", f"${env.CLUSTER_KEY}"), f"from ${env.CLUSTER_KEY}"
    elif svc.key_file.exists():
        key = read_key(svc.key_file)
        return f"cluster key {key.key_id}: kept in {svc.key_file}" + (
            f"; members need:\n    {member_line(key)}" if args.leader else "")
    elif args.leader:
        key, said = ClusterKey.generate(), "new"
    else:
        raise ConfigError(f"a member needs its cluster's key: --key-file PATH (a copy of the leader's {env.KEY_FILE}) "
                          f"or ${env.CLUSTER_KEY} (the line the leader's install printed)")
    svc.state_dir.mkdir(parents=True, exist_ok=True, mode=0o700)
    write_key(svc.key_file, key, overwrite=True)
    if owner is not None and os.geteuid() == 0:
        pw = pwd.getpwnam(owner)
        for path in (svc.state_dir, svc.key_file):
            os.chown(path, pw.pw_uid, pw.pw_gid)
    note = f"cluster key {key.key_id} ({said}) in {svc.key_file}"
    return note + (f"; on every member, install with:\n    {member_line(key)}\n    flowspec service install "
                   f"--cluster {svc.cluster}" if args.leader else "")


def install(args: argparse.Namespace) -> int:
    system = _scope(args)
    if system and os.geteuid() != 0 and not args.print_only:
        raise ConfigError("a system service is installed as root: sudo flowspec service install --system ...")
    if args.memory_max and not SIZE.match(args.memory_max):
        raise ConfigError(f"--memory-max {args.memory_max!r}: a size (1500M, 2G), a percentage (80%) or infinity")
    if args.cpu_quota and not re.match(r"^\d+%$", args.cpu_quota):
        raise ConfigError(f"--cpu-quota {args.cpu_quota!r}: a percentage of one core, e.g. 150%")
    user = (args.run_as or env.sudo_user() or "root") if system else None
    if user is not None:
        try:
            pwd.getpwnam(user)
        except KeyError:
            raise ConfigError(f"--run-as {user!r}: no such user here") from None
    if not config.CLUSTER_NAME.match(args.cluster):
        raise ConfigError(f"--cluster {args.cluster!r}: 1-32 letters, digits, '-' or '_'")
    svc = service_for(args.cluster, system, user)
    profile = args.config.expanduser().resolve() if args.config is not None else svc.profile
    if args.config is not None:  # a profile the agent would refuse is refused now (its secrets may come at start)
        config.load(profile, {"cluster": args.cluster, "leader": args.leader, "api_insecure": True}, env={})
    text = unit_text(svc, leader=args.leader, profile=profile, python=sys.executable, memory_max=args.memory_max,
                     cpu_quota=args.cpu_quota, pythonpath=_pythonpath())
    if args.print_only:
        sys.stdout.write(text)
        return 0
    if args.config is None and not svc.profile.exists():
        svc.config_dir.mkdir(parents=True, exist_ok=True)
        svc.profile.write_text(profile_text(args.cluster, args.leader))
    key_note = _install_key(svc, args, user)
    svc.unit_dir.mkdir(parents=True, exist_ok=True)
    svc.unit_path.write_text(text)
    out = sys.stdout
    out.write(f"wrote {svc.unit_path}\nprofile: {profile}\nstate: {svc.state_dir}\n{key_note}\n")
    if not _systemd_runs():
        reload, enable = " ".join(svc.systemctl("daemon-reload")), " ".join(svc.systemctl("enable", "--now", svc.unit))
        out.write(f"systemd is not running here: on a machine where it does, `{reload} && {enable}`\n")
        return 0
    _systemctl(svc, "daemon-reload")
    _systemctl(svc, "enable", *([] if args.no_start else ["--now"]), svc.unit)
    out.write(f"{'enabled' if args.no_start else 'started'} {svc.unit}; logs: {svc.logs_command()}\n")
    if not system:
        out.write(f"to start it at boot without a login: loginctl enable-linger {pwd.getpwuid(os.getuid()).pw_name}\n")
    return 0


def status(args: argparse.Namespace) -> int:
    svc = service_for(args.cluster, _scope(args))
    if not svc.unit_path.exists():
        sys.stdout.write(f"no service for cluster {args.cluster!r} here ({svc.unit_path} is missing); install one "
                         f"with `flowspec service install --cluster {args.cluster}`\n")
        return 3  # systemctl status's "not running"
    sys.stdout.write(f"unit: {svc.unit_path}\nstate: {svc.state_dir}\nkey file: {svc.key_file}\n"
                     f"logs: {svc.logs_command()}\n")
    sys.stdout.flush()
    if not _systemd_runs():
        sys.stdout.write("systemd is not running here\n")
        return 3
    return _systemctl(svc, "status", "--no-pager", svc.unit, check=False)


def uninstall(args: argparse.Namespace) -> int:
    svc = service_for(args.cluster, _scope(args))
    if _systemd_runs() and svc.unit_path.exists():
        _systemctl(svc, "disable", "--now", svc.unit, check=False)
    removed = [svc.unit_path] if svc.unit_path.exists() else []
    svc.unit_path.unlink(missing_ok=True)
    if args.purge:
        for path in (svc.profile, svc.env_file):
            if path.exists():
                path.unlink()
                removed.append(path)
        if svc.state_dir.exists():
            shutil.rmtree(svc.state_dir)
            removed.append(svc.state_dir)
    if _systemd_runs():
        _systemctl(svc, "daemon-reload", check=False)
    kept = "" if args.purge else f" (kept: {svc.state_dir}; --purge deletes it and the profile)"
    sys.stdout.write(f"removed {', '.join(map(str, removed)) or 'nothing'}{kept}\n")
    return 0


def run(args: argparse.Namespace) -> int:
    return {"install": install, "status": status, "uninstall": uninstall}[args.verb](args)
