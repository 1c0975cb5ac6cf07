"""Frozen, validated configuration of an agent.

Sources, lowest precedence first: defaults < an agent profile (TOML, e.g. ``agents/leader.toml``) < command-line
flags < nothing else. Environment variables (env.py) only fill in what is still unset: ``FLOWSPEC_CLUSTER_KEY`` (the
cluster key, cluster/keys.py; unless a key file, a secret or ``--insecure`` is given), ``FLOWSPEC_SECRET`` (a
passphrase the key is derived from, the older way), ``FLOWSPEC_API_KEY``, ``FLOWSPEC_STATE_DIR`` and
``FLOWSPEC_ENGINE``. Keys are best given in the environment or a file: other users can read flags from the process
list.
"""

from __future__ import annotations

import ipaddress
import json
import re
import tomllib
from collections.abc import Mapping
from pathlib import Path
from typing import Annotated, Any, Literal

from pydantic import AfterValidator, Field, SecretStr, ValidationError, field_validator, model_validator

from .decoding.settings import FlowSpecConfig
from .env import (
    API_KEY,
    CLUSTER_KEY,
    DEFAULT_API_PORT,
    DEFAULT_STATE_DIR,
    ENGINE,
    LEADER_IDENTITY,
    SECRET,
    STATE_DIR,
    environ,
)
from .errors import ConfigError
from .model.registry import is_model_name
from .types import Settings

CLUSTER_NAME = re.compile(r"^[A-Za-z0-9][A-Za-z0-9_-]{0,31}$")


class Emulation(Settings):
    """An emulated edge device, for benchmarks on one host; off by default (pipeline/emulation.py)."""

    link_mbps: float | None = Field(default=None, gt=0)
    link_latency_ms: float = Field(default=0.0, ge=0)
    slowdown: float = Field(default=1.0, ge=1.0)

    @property
    def enabled(self) -> bool:
        return self.link_mbps is not None or self.link_latency_ms > 0 or self.slowdown > 1.0


class ProfileOverrides(Settings):
    """Values that replace measurements (the ``[profile]`` table of an agent profile): for planning previews,
    for a device that should offer less than it has, and for emulated clusters on one host."""

    memory_mb: float | None = Field(default=None, gt=0)
    gflops: float | None = Field(default=None, gt=0)
    link_mbps: float | None = Field(default=None, gt=0)
    latency_ms: float | None = Field(default=None, ge=0)


class PlanningConfig(Settings):
    """How the leader plans (ignored on members)."""

    context: int = Field(default=2048, ge=16)  # KV capacity per request on every stage
    tokens_per_step: int = Field(default=16, ge=1)
    stages: int | None = Field(default=None, ge=1)  # force exactly this many layer-holding stages
    leader_layers: Literal["auto", "always", "never"] = "auto"


def _valid_flowspec(v: dict[str, Any]) -> dict[str, Any]:
    FlowSpecConfig.model_validate(v)  # a ValidationError names the field
    return v


# FlowSpecConfig fields that differ from the defaults, to pass to agents as --flowspec-config (the local cluster's
# and the bench's options), checked as a FlowSpecConfig when read, before any agent starts
FlowSpecOverrides = Annotated[dict[str, Any], AfterValidator(_valid_flowspec)]


class AgentConfig(Settings):
    cluster: str = "default"
    name: str = ""  # a human label shown in /cluster; defaults to the host name
    leader: bool = False
    model: Path | None = None  # this device's own model copy; the leader defaults to the packaged model
    draft: Path | None = None  # (leader) draft head bundle stem; default: the one trained for the model (find_draft)
    interfaces: tuple[str, ...] = ()  # IPs or interface names zeroconf (and the agent server) use
    peers: tuple[str, ...] = ()  # static HOST:PORT peers, where multicast is blocked
    mdns: bool = True
    port: int = Field(default=0, ge=0, le=65535)  # agent server (control, weights, ring); 0 = any
    api_host: str = "127.0.0.1"
    api_port: int = Field(default=DEFAULT_API_PORT, ge=0, le=65535)
    state_dir: Path = DEFAULT_STATE_DIR
    threads: int | None = Field(default=None, ge=1)
    # fetched weights kept in the state folder at most (GB; least recently used dropped first); None: no bound
    cache_max_gb: float | None = Field(default=None, gt=0, allow_inf_nan=False)
    dtype: Literal["float32", "bfloat16", "float64"] = "float32"  # compute dtype of every stage (set by the leader)
    # the model engine (model/engine.py): auto (the native engine where it runs this model, else torch), native or
    # torch; the leader's is named in every plan, so every stage runs the same one. Unset: FLOWSPEC_ENGINE, else auto
    engine: Literal["auto", "native", "torch"] = "auto"
    # (leader) requests decoded at once (the planner counts KV for this many on every stage); None: as many as the
    # devices' memory holds, at most planner.DEFAULT_MAX_REQUESTS
    max_requests: int | None = Field(default=None, ge=1, le=16)
    # activations between stages: float32 keeps every mode exactly equal to single-device decoding (lossless);
    # float16 / bfloat16 halve the bytes on slow links but round the hidden states (greedy output may drift)
    wire_dtype: Literal["float16", "bfloat16", "float32", "float64"] = "float32"
    # (leader) the API's decoding mode when a request names none; default: auto (per request, the mode measured
    # fastest on this pipeline: decoding/auto.py)
    decoding: Literal["auto", "ar", "chunk", "pipedec", "flowspec"] | None = None
    # (leader) FlowSpec settings that differ from the tuned defaults: flowspec.FlowSpecConfig fields, e.g.
    # {"segment_cap": 1} (a [flowspec] table in a profile, or --flowspec-config JSON); for other hardware
    flowspec: FlowSpecConfig = FlowSpecConfig()
    secret: SecretStr | None = None  # a passphrase the cluster key is derived from (keys.ClusterKey.from_secret)
    cluster_key: SecretStr | None = None  # the cluster key's text form (fsk1-...; cluster/keys.py)
    cluster_key_file: Path | None = None  # a file holding it
    insecure: bool = False  # no key: the open cluster of a lab (plain http, anyone may join)
    # (member) the identity fingerprint of the leader it may join (and the successors that leader's plans name);
    # None: the first leader it joins (cluster/member.py)
    leader_identity: str | None = Field(default=None, pattern=r"^[0-9a-f]{64}$")
    api_key: SecretStr | None = None  # (leader) Bearer token the API asks of every route but /health
    api_insecure: bool = False  # (leader) serve the API beyond loopback without a key
    api_cors: tuple[str, ...] = ()  # (leader) browser origins the API answers cross-origin ("*": any)
    emulation: Emulation = Emulation()
    profile: ProfileOverrides = ProfileOverrides()
    planning: PlanningConfig = PlanningConfig()

    @field_validator("cluster")
    @classmethod
    def _cluster_name(cls, v: str) -> str:
        if not CLUSTER_NAME.match(v):
            raise ValueError("a cluster name is 1-32 letters, digits, '-' or '_'")
        return v

    @field_validator("peers")
    @classmethod
    def _peers(cls, v: tuple[str, ...]) -> tuple[str, ...]:
        for p in v:
            split_host_port(p)
        return v

    @model_validator(mode="after")
    def _keys(self) -> AgentConfig:
        if self.secret is not None and len(self.secret.get_secret_value()) < 8:
            raise ValueError("the shared secret must have at least 8 characters")
        given = [n for n in ("cluster_key_file", "cluster_key", "secret") if getattr(self, n) is not None]
        if len(given) > 1 or (given and self.insecure):
            raise ValueError(f"give one of a cluster key file, a cluster key, a secret or --insecure, not "
                             f"{' and '.join(given + ['insecure'] * self.insecure)}")
        if self.api_key is not None and len(self.api_key.get_secret_value()) < 8:
            raise ValueError("the API key must have at least 8 characters")
        if self.leader and self.api_key is None and not self.api_insecure and not is_loopback(self.api_host):
            raise ValueError(f"the API would listen on {self.api_host} without a key: give --api-key (better: "
                             f"${API_KEY}), or --api-insecure to serve it open")
        return self

    @property
    def api_key_text(self) -> str | None:
        return None if self.api_key is None else self.api_key.get_secret_value()

    @property
    def state_path(self) -> Path:
        return self.state_dir.expanduser()


def is_loopback(host: str) -> bool:
    if host == "localhost":
        return True
    try:
        return ipaddress.ip_address(host).is_loopback
    except ValueError:
        return False


def split_host_port(value: str) -> tuple[str, int]:
    """``host:port`` or ``[v6]:port`` -> (host, port)."""
    m = re.match(r"^\[([0-9A-Fa-f:.]+)\]:(\d+)$", value) or re.match(r"^([^:\s]+):(\d+)$", value)
    if not m or not 0 < int(m.group(2)) < 65536:
        raise ValueError(f"peer {value!r} is not HOST:PORT")
    return m.group(1), int(m.group(2))


def _merge(base: dict, over: Mapping[str, Any]) -> dict:
    out = dict(base)
    for k, v in over.items():
        if v is None:
            continue
        if isinstance(v, Mapping):
            out[k] = _merge(out.get(k) or {}, v)
        else:
            out[k] = v
    return out


def json_object(text: str | None, what: str) -> dict[str, Any] | None:
    """A JSON object given on the command line (``what`` names the option in errors); None stays None."""
    if text is None:
        return None
    example = "e.g. '{\"segment_cap\": 1}'"
    try:
        value = json.loads(text)
    except json.JSONDecodeError as e:
        raise ConfigError(f"{what}: not JSON ({e.msg} at character {e.pos}); give an object, {example}") from None
    if not isinstance(value, dict):
        raise ConfigError(f"{what}: give a JSON object, {example}, not a {type(value).__name__}")
    return value


def load(path: str | Path | None = None, overrides: Mapping[str, Any] | None = None,
         env: Mapping[str, str] | None = None) -> AgentConfig:
    """Build an AgentConfig: profile TOML < ``overrides`` (None values ignored; nested dicts merge) < env fill-ins."""
    env = environ() if env is None else env
    data: dict[str, Any] = {}
    if path is not None:
        p = Path(path).expanduser()
        try:
            data = tomllib.loads(p.read_text())
        except (OSError, tomllib.TOMLDecodeError) as e:
            raise ConfigError(f"cannot read agent profile {p}: {e}") from e
        model = data.get("model")
        if isinstance(model, str) and not Path(model).is_absolute() and not is_model_name(model):
            data["model"] = str(p.parent / model)  # a path beside the profile (a model's name stays a name)
    data = _merge(data, overrides or {})
    keyed = any(data.get(k) is not None for k in ("cluster_key", "cluster_key_file", "secret"))
    if not keyed and not data.get("insecure"):
        if env.get(CLUSTER_KEY):
            data["cluster_key"] = env[CLUSTER_KEY]
        elif env.get(SECRET):
            data["secret"] = env[SECRET]
    if data.get("leader_identity") is None and env.get(LEADER_IDENTITY):
        data["leader_identity"] = env[LEADER_IDENTITY].strip().lower()
    if data.get("api_key") is None and env.get(API_KEY):
        data["api_key"] = env[API_KEY]
    if data.get("state_dir") is None and env.get(STATE_DIR):
        data["state_dir"] = env[STATE_DIR]
    if data.get("engine") is None and env.get(ENGINE):
        data["engine"] = env[ENGINE]
    for key in ("interfaces", "peers", "api_cors"):
        if key in data:
            data[key] = tuple(data[key])
    try:
        return AgentConfig.model_validate(data)
    except ValidationError as e:
        raise ConfigError(f"invalid agent configuration: {e}") from None
