"""The cluster key, agent identities and the mutual authentication on a bare TLS server (loopback, port 0): a
holder of the key gets a session; a stranger, a replayed or late confirm, a forged signature or an id claimed by
another identity get 401 and learn nothing; a wrong certificate behind a pinned address is refused before a byte of
a request leaves; a restarted server is re-authenticated transparently; adverts' seals bind every field."""

import stat

import aiohttp
import pytest
from aiohttp import web

from flowspec_p2p.cluster import guard as guard_mod
from flowspec_p2p.cluster import keys
from flowspec_p2p.cluster.guard import PEER, REFUSAL, Guard
from flowspec_p2p.cluster.handshake import (
    CHALLENGE_PATH,
    CONFIRM_PATH,
    SESSION_HEADER,
    AdvertSeal,
    AuthChallenge,
    AuthConfirm,
    AuthHello,
    client_proof,
    client_transcript,
    new_nonce,
)
from flowspec_p2p.cluster.identity import Identity, client_context
from flowspec_p2p.cluster.keys import ClusterKey
from flowspec_p2p.cluster.pinning import AuthClient
from flowspec_p2p.config import AgentConfig
from flowspec_p2p.errors import ConfigError, ProtocolError


def test_keys_round_trip_in_text_and_files_readable_by_their_owner_only(tmp_path):
    key = ClusterKey.generate()
    assert ClusterKey.parse(key.text) == key
    assert key.text.startswith("fsk1-")
    assert key.key_id not in key.text
    assert key.text not in repr(key)
    for bad in ("nope", "fsk1-!!!", "fsk1-" + "A" * 10):
        with pytest.raises(ConfigError, match="not a cluster key"):
            ClusterKey.parse(bad)
    assert ClusterKey.from_secret("correct horse battery", "home") == ClusterKey.from_secret("correct horse battery",
                                                                                            "home")
    assert ClusterKey.from_secret("correct horse battery", "home") != ClusterKey.from_secret("wrong horse battery",
                                                                                            "home")
    # salted with the cluster's name: one table of guesses serves no two clusters
    assert ClusterKey.from_secret("correct horse battery", "home") != ClusterKey.from_secret("correct horse battery",
                                                                                            "office")
    path = tmp_path / "k" / "cluster.key"
    keys.write_key(path, key)
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert keys.read_key(path) == key
    with pytest.raises(ConfigError, match="exists"):
        keys.write_key(path, ClusterKey.generate())


def test_keygen_writes_an_owner_only_key_and_prints_the_member_line(tmp_path, capsys):
    from flowspec_p2p.cli import main

    path = tmp_path / "home.key"
    assert main(["keygen", "--out", str(path)]) == 0
    key = keys.read_key(path)
    assert f"export FLOWSPEC_CLUSTER_KEY={key.text}" in capsys.readouterr().out
    assert stat.S_IMODE(path.stat().st_mode) == 0o600
    assert main(["keygen", "--out", str(path)]) == 1  # never replaces a key unasked
    assert keys.read_key(path) == key
    assert main(["keygen", "--out", str(path), "--force"]) == 0
    assert keys.read_key(path) != key
    assert main(["keygen"]) == 0
    assert ClusterKey.parse(capsys.readouterr().out.strip().splitlines()[-1])


def test_a_leader_makes_its_key_on_first_start_and_prints_the_line_members_need_to_its_terminal_only(tmp_path,
                                                                                                      caplog):
    import io

    leader = AgentConfig(leader=True, state_dir=tmp_path / "lead", cluster="home")
    terminal = io.StringIO()
    key = keys.resolve(leader, "f" * 64, terminal=terminal)
    assert f"export FLOWSPEC_CLUSTER_KEY={key.text} FLOWSPEC_LEADER_IDENTITY={'f' * 64}" in terminal.getvalue()
    line = next(r.message for r in caplog.records if "made cluster key" in r.message)
    assert key.text not in caplog.text  # the log (journald, docker logs) gets the file's path, never the key
    assert str(tmp_path / "lead" / keys.KEY_FILE) in line
    assert stat.S_IMODE((tmp_path / "lead" / keys.KEY_FILE).stat().st_mode) == 0o600
    caplog.clear()
    assert keys.resolve(leader) == key  # later starts keep it, and print it no more
    assert not any(key.text in r.message for r in caplog.records)
    with pytest.raises(ConfigError, match="FLOWSPEC_CLUSTER_KEY"):
        keys.resolve(AgentConfig(state_dir=tmp_path / "member"))
    assert keys.resolve(AgentConfig(state_dir=tmp_path / "m", cluster_key=key.text)) == key
    key_file = tmp_path / "lead" / keys.KEY_FILE
    assert keys.resolve(AgentConfig(state_dir=tmp_path / "m", cluster_key_file=key_file)) == key
    assert keys.resolve(AgentConfig(state_dir=tmp_path / "m", insecure=True)) is None


def test_an_identity_is_kept_in_the_state_folder_with_an_owner_only_key(tmp_path):
    a = Identity.load_or_create(tmp_path)
    assert Identity.load_or_create(tmp_path).fingerprint == a.fingerprint
    assert stat.S_IMODE((tmp_path / "identity.key").stat().st_mode) == 0o600
    assert len(a.fingerprint) == 64
    assert Identity.generate().fingerprint != a.fingerprint


def test_an_advert_seal_binds_every_field_the_port_and_the_time():
    seal = AdvertSeal(ClusterKey.generate())
    props = seal.seal({"id": "a", "r": "member", "st": "1.5", "fp": "f" * 64}, 4000, now=1000.0)
    seal.check(props, 4000, now=1100.0)
    for changed in ({"r": "leader"}, {"st": "0.0"}, {"fp": "e" * 64}, {"id": "b"}, {"ts": "1001"}):
        with pytest.raises(ProtocolError, match="does not match"):
            seal.check({**props, **changed}, 4000, now=1100.0)
    with pytest.raises(ProtocolError, match="does not match"):
        seal.check(props, 4001, now=1100.0)
    with pytest.raises(ProtocolError, match="ago"):
        seal.check(props, 4000, now=1000.0 + seal.max_age_s + 1)
    with pytest.raises(ProtocolError, match="does not match"):
        AdvertSeal(ClusterKey.generate()).check(props, 4000, now=1100.0)


# ----------------------------------------------------------------------------------------------- a TLS server


class Server:
    def __init__(self, key: ClusterKey, identity: Identity, agent_id: str = "server"):
        self.guard = Guard(key, identity, agent_id)
        self.identity = identity
        self.served = 0
        self.runner: web.AppRunner | None = None
        self.port = 0

    async def start(self, port: int = 0) -> None:
        app = web.Application(middlewares=[self.guard.middleware])
        self.guard.install(app)
        app.router.add_get("/who", self._who)
        self.runner = web.AppRunner(app, access_log=None)
        await self.runner.setup()
        await web.TCPSite(self.runner, "127.0.0.1", port, ssl_context=self.identity.server_context()).start()
        self.port = self.runner.addresses[0][1]

    async def _who(self, request: web.Request) -> web.Response:
        self.served += 1
        return web.json_response({"agent_id": request[PEER].agent_id})

    @property
    def url(self) -> str:
        return f"https://127.0.0.1:{self.port}"

    async def stop(self) -> None:
        if self.runner is not None:
            await self.runner.cleanup()
            self.runner = None


@pytest.fixture
def key():
    return ClusterKey.generate()


@pytest.fixture
def server_identity(tmp_path):
    return Identity.load_or_create(tmp_path / "server")


@pytest.fixture
async def server(key, server_identity):
    s = Server(key, server_identity)
    await s.start()
    yield s
    await s.stop()


def raw_session() -> aiohttp.ClientSession:
    """A TLS client that authenticates nothing (a stranger's, or a replaying attacker's)."""
    return aiohttp.ClientSession(connector=aiohttp.TCPConnector(ssl=client_context()))


async def raw_handshake(http, url: str, key: ClusterKey, me: Identity, agent_id: str, signer: Identity | None = None):
    """Both steps by hand -> (status of the confirm, the confirm's body)."""
    nonce = new_nonce()
    async with http.post(url + CHALLENGE_PATH, data=AuthHello(cert=me.cert_pem.decode(), nonce=nonce)
                         .model_dump_json()) as r:
        assert r.status == 200
        ch = AuthChallenge.model_validate_json(await r.read())
    theirs = Identity(me.key, ch.cert.encode()).fingerprint
    sig = (signer or me).sign(client_transcript(me.fingerprint, theirs, ch.nonce, nonce, agent_id))
    body = AuthConfirm(nonce=ch.nonce, agent_id=agent_id, signature=sig.hex(),
                       proof=client_proof(key, me.fingerprint, theirs, ch.nonce, nonce, agent_id)).model_dump_json()
    async with http.post(url + CONFIRM_PATH, data=body) as r:
        return r.status, body


async def test_a_holder_of_the_key_gets_a_session_and_is_known_by_the_id_its_identity_proves(key, server):
    me = Identity.generate()
    client = AuthClient(key, me)
    async with client.open() as http, http.get(server.url + "/who") as r:
        assert r.status == 200
        assert (await r.json()) == {"agent_id": me.agent_id}
    assert me.agent_id == me.fingerprint[:24]
    assert client.identity_at("127.0.0.1", server.port) == server.identity.fingerprint
    async with AuthClient(key, Identity.generate()).open() as http:
        with pytest.raises(ProtocolError, match="plain http"):  # a keyed agent sends nothing in the clear
            await http.get(f"http://127.0.0.1:{server.port}/who")


async def test_strangers_and_forged_tokens_get_401_and_learn_nothing(key, server):
    async with raw_session() as http:
        for headers in ({}, {SESSION_HEADER: "0" * 64}, {SESSION_HEADER: "not a token"}):
            async with http.get(server.url + "/who", headers=headers) as r:
                assert r.status == 401
                assert await r.text() == REFUSAL
        for path in ("/auth/../who", "/auth/%2e%2e/who", "/auth/challenge/../../who", "/auth/x"):
            async with http.get(server.url + path) as r:
                assert r.status in (401, 404, 405), path
    with pytest.raises(ProtocolError, match="does not hold this cluster's key"):  # the stranger's own client
        async with AuthClient(ClusterKey.generate(), Identity.generate()).open() as http:
            await http.get(server.url + "/who")
    async with raw_session() as http:  # a stranger that sends a proof anyway
        status, _ = await raw_handshake(http, server.url, ClusterKey.generate(), Identity.generate(), "x")
        assert status == 401
    with pytest.raises(aiohttp.ClientError):  # the port speaks TLS only
        async with aiohttp.ClientSession() as http:
            await http.get(f"http://127.0.0.1:{server.port}/who")
    assert server.served == 0


async def test_a_replayed_or_late_confirm_a_forged_signature_and_another_agents_id_are_refused(key, server,
                                                                                                monkeypatch, caplog):
    me = Identity.generate()
    async with raw_session() as http:
        status, body = await raw_handshake(http, server.url, key, me, me.agent_id)
        assert status == 200
        async with http.post(server.url + CONFIRM_PATH, data=body) as r:  # the same confirm again
            assert r.status == 401
            assert await r.text() == REFUSAL
        status, _ = await raw_handshake(http, server.url, key, me, me.agent_id, signer=Identity.generate())
        assert status == 401  # the right key, but not the certificate's owner
        other = Identity.generate()  # a holder of the key claiming me's id, before or after me: never first-come
        status, _ = await raw_handshake(http, server.url, key, other, me.agent_id)
        assert status == 401
        assert f"claims agent id {me.agent_id}" in caplog.text
        status, _ = await raw_handshake(http, server.url, key, me, "member-1")  # any id but its own
        assert status == 401
        monkeypatch.setattr(guard_mod, "CHALLENGE_TTL_S", -1.0)
        status, _ = await raw_handshake(http, server.url, key, me, me.agent_id)
        assert status == 401  # too late


async def test_a_wrong_certificate_behind_a_pinned_address_is_refused_before_any_request(key, server, tmp_path):
    client = AuthClient(key, Identity.generate())
    client.pins.expect("127.0.0.1", server.port, Identity.generate().fingerprint)
    async with client.open() as http:
        with pytest.raises(ProtocolError, match="presents certificate"):
            await http.get(server.url + "/who")
    assert server.guard.refused == 0  # nothing reached it: not even the handshake
    assert server.served == 0


async def test_a_restarted_server_is_authenticated_again_and_a_replaced_one_only_where_not_pinned(key, server,
                                                                                                 server_identity,
                                                                                                 tmp_path):
    client = AuthClient(key, Identity.generate())
    async with client.open() as http:
        assert (await http.get(server.url + "/who")).status == 200
        await server.stop()
        again = Server(key, server_identity)  # same identity, sessions forgotten
        await again.start(server.port)
        assert (await http.get(server.url + "/who")).status == 200
        await again.stop()
        other = Server(key, Identity.load_or_create(tmp_path / "other"))  # where this identity was only learned
        await other.start(server.port)
        assert (await http.get(server.url + "/who")).status == 200
        assert client.identity_at("127.0.0.1", server.port) == other.identity.fingerprint
        client.pins.expect("127.0.0.1", server.port, server_identity.fingerprint)  # said by a plan, say
        with pytest.raises(ProtocolError):
            await http.get(server.url + "/who")
        await other.stop()


def _ed25519_cert() -> str:
    import datetime

    from cryptography import x509
    from cryptography.hazmat.primitives import serialization
    from cryptography.hazmat.primitives.asymmetric import ed25519
    from cryptography.x509.oid import NameOID

    key = ed25519.Ed25519PrivateKey.generate()
    name = x509.Name([x509.NameAttribute(NameOID.COMMON_NAME, "x")])
    now = datetime.datetime.now(datetime.UTC)
    cert = (x509.CertificateBuilder().subject_name(name).issuer_name(name).public_key(key.public_key())
            .serial_number(1).not_valid_before(now).not_valid_after(now + datetime.timedelta(days=1))
            .sign(key, None))
    return cert.public_bytes(serialization.Encoding.PEM).decode()


async def test_garbage_handshakes_get_400_with_a_logged_reason_and_the_server_keeps_serving(key, server, caplog):
    nonce = new_nonce()
    garbage = [(CHALLENGE_PATH, b"not json"), (CHALLENGE_PATH, b"{}"), (CONFIRM_PATH, b"[1, 2]"),
               (CHALLENGE_PATH, AuthHello(cert="-----BEGIN CERTIFICATE-----\nAAAA\n-----END CERTIFICATE-----\n",
                                          nonce=nonce).model_dump_json().encode()),
               (CHALLENGE_PATH, AuthHello(cert=_ed25519_cert(), nonce=nonce).model_dump_json().encode()),
               (CONFIRM_PATH, AuthConfirm(nonce=nonce, agent_id="x", proof=nonce, signature="ab" * 40)
                .model_dump_json().encode()),
               (CHALLENGE_PATH, b"x" * (64 * 1024))]
    async with raw_session() as http:
        for path, body in garbage:
            async with http.post(server.url + path, data=body) as r:
                assert r.status in (400, 401, 413), (path, body[:40])
    assert "malformed handshake message" in caplog.text
    client = AuthClient(key, Identity.generate())
    async with client.open() as http, http.get(server.url + "/who") as r:
        assert r.status == 200


async def test_a_peer_that_authenticates_again_and_again_holds_few_sessions(key, server):
    me = Identity.generate()
    async with raw_session() as http:
        for _ in range(10):
            status, _ = await raw_handshake(http, server.url, key, me, me.agent_id)
            assert status == 200
    assert len(server.guard._sessions) == guard_mod.SESSIONS_PER_PEER


async def test_a_challenge_flood_from_one_address_evicts_only_its_own_challenges(key, server_identity):
    """Pending challenges are bounded per remote address: a flood keeps PENDING_PER_ADDRESS of its own, and a
    challenge another address holds survives it."""
    from types import SimpleNamespace

    guard = guard_mod.Guard(key, server_identity, server_identity.agent_id)

    def request(remote: str):
        hello = AuthHello(cert=Identity.generate().cert_pem.decode(), nonce=new_nonce()).model_dump_json().encode()

        class Content:
            async def read(self, n):
                return hello

        return SimpleNamespace(remote=remote, content_length=len(hello), content=Content(), method="POST",
                               path=CHALLENGE_PATH)

    await guard._challenge(request("10.0.0.2"))
    honest = next(iter(guard._pending))
    for _ in range(guard_mod.MAX_PENDING + 50):
        await guard._challenge(request("10.0.0.9"))
    assert honest in guard._pending
    assert len(guard._pending_by["10.0.0.9"]) == guard_mod.PENDING_PER_ADDRESS
    assert len(guard._pending) == guard_mod.PENDING_PER_ADDRESS + 1
