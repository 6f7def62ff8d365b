"""Who a v2 caller is and what it holds, in-process: the token file's rules, bearer tokens, the
anonymous caller's scopes, the one permission check, and the per-caller ledger (requests, buffered
bytes, waiting for room in order).  The doors that use them are attacked through a real server in
``test_v2_identity``."""

from __future__ import annotations

import asyncio
import os

import pytest

from shmserve import config as cfgmod
from shmserve.errors import ErrorCode
from shmserve.v2.auth import (ADMIN, ANONYMOUS_GRANTABLE, CLIENT, SCOPE_OF, Authenticator, Scope, TokenFileError,
                              load_tokens, token_entry)
from shmserve.v2.messages import V2Error
from shmserve.v2.service import Ledger

ME = os.geteuid()


def write(tmp_path, text: str, mode: int = 0o600) -> str:
    path = tmp_path / "tokens.toml"
    path.write_text(text)
    os.chmod(path, mode)
    return str(path)


def authenticator(tokens=(), anonymous=(Scope.METADATA, Scope.INFER), admins=frozenset({ME, 0})):
    return Authenticator(allowed=lambda uid, groups: uid in admins or uid == 1000,
                         is_admin=lambda uid, groups: uid in admins, tokens=tokens, anonymous=anonymous)


def refused(code: ErrorCode, fn, *args) -> str:
    with pytest.raises(V2Error) as info:
        fn(*args)
    assert info.value.code == code, info.value.message
    return info.value.message


# -- the token file --------------------------------------------------------------------------------

def test_a_token_file_round_trips_and_holds_only_digests(tmp_path):
    path = write(tmp_path, token_entry("ingest", "s3cret-A", "client", 1001) + token_entry("ops", "s3cret-B", "admin"))
    tokens = load_tokens(path)
    assert [(t.name, t.role, t.uid) for t in tokens] == [("ingest", "client", 1001), ("ops", "admin", None)]
    assert "s3cret" not in open(path).read()
    auth = authenticator(tokens)
    ingest, ops = auth.bearer("Bearer s3cret-A"), auth.bearer("bearer   s3cret-B ")
    assert (ingest.key, ingest.uid, ingest.scopes) == ("token:ingest", 1001, CLIENT)
    assert (ops.key, ops.uid, ops.scopes) == ("token:ops", None, ADMIN)


@pytest.mark.parametrize("mode", [0o640, 0o604, 0o660, 0o666])
def test_a_token_file_others_can_read_or_write_is_refused_naming_chmod(tmp_path, mode):
    path = write(tmp_path, token_entry("a", "t"), mode)
    with pytest.raises(TokenFileError, match=f"chmod 600 {path}"):
        load_tokens(path)


@pytest.mark.parametrize("text, words", [
    ('[[token]]\nname = "a"\nsha256 = "00"\n', "sha256"),
    ('[[token]]\nname = "a b"\nsha256 = "' + "0" * 64 + '"\n', "name"),
    ('[[token]]\nname = "a"\nsha256 = "' + "0" * 64 + '"\nrole = "root"\n', "role"),
    ('[[token]]\nname = "a"\nsha256 = "' + "0" * 64 + '"\nuid = -1\n', "uid"),
    ('[[token]]\nname = "a"\nsha256 = "' + "0" * 64 + '"\nuid = "1000"\n', "uid"),
    ('[[token]]\nname = "a"\nsha256 = "' + "0" * 64 + '"\nexpires = 1\n', "unknown key 'expires'"),
    ('[[token]]\nname = "a"\nsha256 = "' + "0" * 64 + '"\n[[token]]\nname = "a"\nsha256 = "' + "1" * 64 + '"\n',
     "given twice"),
    ('[[token]]\nname = "a"\nsha256 = "' + "0" * 64 + '"\n[[token]]\nname = "b"\nsha256 = "' + "0" * 64 + '"\n',
     "same token"),
    ("token = 5\n", "array of tables"),
    ("[[token]\n", "not valid TOML"),
    ("users = []\n", "unknown key 'users'"),
])
def test_a_bad_token_file_names_the_entry_and_the_fix(tmp_path, text, words):
    with pytest.raises(TokenFileError, match="server.v2_tokens") as info:
        load_tokens(write(tmp_path, text))
    assert words in str(info.value)


def test_a_token_file_that_is_a_link_or_missing_is_refused(tmp_path):
    real = write(tmp_path, token_entry("a", "t"))
    link = tmp_path / "link.toml"
    link.symlink_to(real)
    with pytest.raises(TokenFileError, match="cannot open"):
        load_tokens(str(link))
    with pytest.raises(TokenFileError, match="cannot open"):
        load_tokens(str(tmp_path / "absent.toml"))


@pytest.mark.skipif(ME != 0, reason="needs root to give the file to another uid")
def test_a_token_file_of_another_uid_is_refused(tmp_path):
    path = write(tmp_path, token_entry("a", "t"))
    os.chown(path, 54321, -1)
    with pytest.raises(TokenFileError, match="chown"):
        load_tokens(path, server_uid=1234)


# -- bearer tokens and the anonymous caller --------------------------------------------------------------

@pytest.mark.parametrize("header", ["Basic dTpw", "Bearer", "Bearer ", "Bearer a b", "Token abc", "Bearer " + "A" * 600,
                                    "Bearer s3cret-", "Bearer s3cret-AA", "Bearer ä", "Bearer s3cret-A, Bearer s3cret-A"])
def test_anything_but_a_known_bearer_token_is_unauthenticated_never_anonymous(header):
    auth = authenticator((load_tokens_from("a", "s3cret-A")))
    message = refused(ErrorCode.UNAUTHENTICATED, auth.bearer, header)
    assert "s3cret" not in message


def load_tokens_from(name: str, token: str):
    from shmserve.v2.auth import Token, digest

    return (Token(name, digest(token), "client", None),)


def test_no_header_is_the_anonymous_caller_with_health_and_what_configuration_grants():
    auth = authenticator(anonymous=())
    who = auth.bearer(None)
    assert who.anonymous and who.uid is None and who.scopes == {Scope.HEALTH}
    auth.configure((), [Scope.INFER, Scope.STATISTICS])
    assert auth.bearer(None).scopes == {Scope.HEALTH, Scope.INFER, Scope.STATISTICS}
    for never in (Scope.SHARED_MEMORY, Scope.REPOSITORY):
        with pytest.raises(ValueError):
            auth.configure((), [never])


def test_the_config_grants_anonymous_callers_only_what_auth_allows(tmp_path):
    assert {Scope(s) for s in cfgmod.V2_ANONYMOUS_SCOPES} == ANONYMOUS_GRANTABLE
    base = {"server": {"http": "127.0.0.1:0"}, "models": [{"name": "m", "backend": "python", "path": "shmserve.models:identity"}]}
    assert cfgmod.parse(base, base_dir=tmp_path).v2_anonymous == ("metadata", "infer")
    for scope in ("shared_memory", "repository"):
        with pytest.raises(cfgmod.ConfigError, match="never granted to anonymous callers"):
            cfgmod.parse({**base, "server": {"v2_anonymous": [scope]}}, base_dir=tmp_path)
    with pytest.raises(cfgmod.ConfigError, match="expected one of metadata, infer, statistics"):
        cfgmod.parse({**base, "server": {"v2_anonymous": ["everything"]}}, base_dir=tmp_path)
    parsed = cfgmod.parse({**base, "server": {"v2_anonymous": [], "v2_tokens": "t.toml"}}, base_dir=tmp_path)
    assert parsed.v2_anonymous == () and parsed.v2_tokens == str(tmp_path / "t.toml")


def test_every_operation_has_a_scope_and_the_check_names_the_way_in():
    auth = authenticator()
    ops = {"live", "ready", "server_metadata", "model_metadata", "model_ready", "model_config", "infer", "statistics",
           "shm_status", "shm_register", "shm_unregister", "cuda_shm_status", "cuda_shm_register",
           "cuda_shm_unregister", "repository_index", "repository_load", "repository_unload"}
    assert set(SCOPE_OF) == ops
    anonymous = auth.bearer(None)
    for op in ("live", "ready", "model_metadata", "infer"):
        auth.check(anonymous, op)
    message = refused(ErrorCode.PERMISSION_DENIED, auth.check, anonymous, "statistics")
    assert "Authorization: Bearer" in message and 'v2_anonymous = [..., "statistics"]' in message
    message = refused(ErrorCode.PERMISSION_DENIED, auth.check, anonymous, "shm_register")
    assert "Unix socket" in message and "v2_anonymous" not in message
    client = auth.peer(1000, frozenset())
    assert client.key == "uid:1000" and client.scopes == CLIENT
    assert "admin_uids" in refused(ErrorCode.PERMISSION_DENIED, auth.check, client, "repository_unload")
    assert auth.peer(ME, frozenset()).scopes == ADMIN
    assert "not allowed" in refused(ErrorCode.PERMISSION_DENIED, auth.peer, 4242, frozenset())
    refused(ErrorCode.PERMISSION_DENIED, auth.check, anonymous, "trace_setting")  # unlisted: admins only


# -- the ledger ----------------------------------------------------------------------------------------

def test_the_ledger_counts_each_caller_apart_and_names_the_key_it_hit():
    auth = authenticator()
    a, b = auth.peer(1000, frozenset()), auth.bearer(None)
    ledger = Ledger(lambda: 2, lambda: 100)
    ledger.take_request(a)
    ledger.take_request(a)
    assert "max_inflight_per_uid" in refused(ErrorCode.OVERLOADED, ledger.take_request, a)
    ledger.take_request(b)  # another caller's count
    ledger.give_request(a)
    ledger.take_request(a)
    ledger.take_bytes(a, 500)  # one body at a time always fits, whatever its size
    assert "max_buffered_bytes_per_uid" in refused(ErrorCode.OVERLOADED, ledger.take_bytes, a, 1)
    ledger.take_bytes(b, 60)
    refused(ErrorCode.OVERLOADED, ledger.take_bytes, b, 41)
    ledger.give_bytes(a, 500)
    ledger.take_bytes(a, 100)
    for who in (a, b):
        ledger.give_request(who)
    ledger.give_request(a)
    ledger.give_bytes(a, 100)
    ledger.give_bytes(b, 60)
    assert not ledger.requests and not ledger.bytes


def test_waiting_for_room_is_granted_in_order_and_a_timeout_or_cancel_takes_nothing():
    who = authenticator().bearer(None)

    async def scenario():
        ledger = Ledger(lambda: 10, lambda: 100)
        await ledger.reserve_bytes(who, 80, 1)
        first = asyncio.ensure_future(ledger.reserve_bytes(who, 50, 5))
        second = asyncio.ensure_future(ledger.reserve_bytes(who, 10, 5))  # fits now, but waits its turn
        await asyncio.sleep(0.01)
        assert not first.done() and not second.done()
        ledger.give_bytes(who, 80)
        await asyncio.wait_for(asyncio.gather(first, second), 5)
        assert ledger.bytes[who.key] == 60
        with pytest.raises(V2Error) as info:
            await ledger.reserve_bytes(who, 60, 0.05)  # does not fit before its deadline
        assert info.value.code == ErrorCode.OVERLOADED and ledger.bytes[who.key] == 60
        waiting = asyncio.ensure_future(ledger.reserve_bytes(who, 60, 5))
        behind = asyncio.ensure_future(ledger.reserve_bytes(who, 30, 5))
        await asyncio.sleep(0.01)
        waiting.cancel()  # its caller left: nothing taken, and the one behind it moves up
        await asyncio.wait_for(behind, 5)
        assert ledger.bytes[who.key] == 90 and not ledger.waiting
        ledger.give_bytes(who, 90)
        assert not ledger.bytes

    asyncio.run(scenario())
