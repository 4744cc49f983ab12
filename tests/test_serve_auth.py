"""The gate of ``lazyattn serve`` (issue 37): keys, their namespaces, the key file, loopback-only
use without keys, and the constant-time comparison. No Ray here; tests/test_serve_security.py
runs the same rules through a server."""

from __future__ import annotations

import hashlib
import json

import pytest

from lazyattn_rag.serve import auth
from lazyattn_rag.serve.auth import Authenticator, is_loopback, load_grants
from lazyattn_rag.serve.config import ServeConfig
from lazyattn_rag.serve.http_errors import ApiError


def key_file(tmp_path, entries) -> str:
    path = tmp_path / "keys.json"
    path.write_text(json.dumps({"keys": entries}))
    return str(path)


@pytest.fixture
def gate(tmp_path):
    path = key_file(tmp_path, [
        {"key": "key-a", "namespaces": ["team-a"], "manage_documents": True},
        {"key_sha256": hashlib.sha256(b"key-b").hexdigest(), "namespaces": ["team-b", "shared"], "name": "b"},
    ])
    return Authenticator(load_grants(("admin",), path))


def status(call) -> int:
    with pytest.raises(ApiError) as error:
        call()
    return error.value.status


def test_a_key_decides_the_namespace_and_what_it_may_do(gate):
    a, b, admin = (gate.caller(f"Bearer {k}", "127.0.0.1") for k in ("key-a", "key-b", "admin"))
    assert (a.namespace(""), a.namespace(None), a.namespace("team-a")) == ("team-a", "team-a", "team-a")
    assert (b.namespace(""), b.namespace("shared")) == ("team-b", "shared")
    assert (admin.namespace(""), admin.namespace("team-b")) == ("", "team-b")
    assert status(lambda: a.namespace("team-b")) == 403
    assert status(lambda: b.namespace("team-a")) == 403
    with pytest.raises(ApiError, match="'team-b'"):
        a.namespace("team-b")
    a.check_manage()
    admin.check_manage()
    assert status(b.check_manage) == 403


@pytest.mark.parametrize("header", [None, "", "Bearer", "Bearer ", "Basic key-a", "Bearer key-c", "key-a",
                                    "Bearer key-a2", "Bearer KEY-A"])
def test_a_missing_or_wrong_key_is_401_from_anywhere(gate, header):
    for host in ("127.0.0.1", "10.1.2.3"):
        assert status(lambda: gate.caller(header, host)) == 401


def test_without_keys_only_loopback_clients_get_in_unless_allowed():
    open_gate = Authenticator(())
    for host in ("127.0.0.1", "::1", "::ffff:127.0.0.1", "localhost", "127.0.0.2"):
        assert open_gate.caller(None, host).namespace("team-x") == "team-x"
    for host in ("10.1.2.3", "192.0.2.7", "::ffff:10.0.0.1", "2001:db8::1", None, "testclient"):
        assert status(lambda: open_gate.caller(None, host)) == 401
    assert Authenticator((), allow_unauthenticated=True).caller(None, "10.1.2.3").namespace("") == ""


def test_every_key_is_compared_in_constant_time(gate, monkeypatch):
    """The presented key's digest is compared with every configured digest through
    ``hmac.compare_digest``, whichever key matches (or none): no early exit, no ``==``."""
    calls = []
    real = auth.hmac.compare_digest

    def counting(x, y):
        calls.append((x, y))
        return real(x, y)

    monkeypatch.setattr(auth.hmac, "compare_digest", counting)
    for key in ("admin", "key-a", "key-b", "nobody"):
        calls.clear()
        gate.match(key)
        assert [y for _, y in calls] == [g.digest for g in gate.grants]
        assert {x for x, _ in calls} == {hashlib.sha256(key.encode()).digest()}


@pytest.mark.parametrize("entries, words", [
    ([{"namespaces": ["a"]}], "exactly one of 'key' and 'key_sha256'"),
    ([{"key": "k", "key_sha256": "00" * 32, "namespaces": ["a"]}], "exactly one"),
    ([{"key": "", "namespaces": ["a"]}], "'key' must be a non-empty string"),
    ([{"key_sha256": "abc", "namespaces": ["a"]}], "64 hex digits"),
    ([{"key": "k", "namespaces": []}], "'namespaces' must be a non-empty list"),
    ([{"key": "k", "namespaces": ["bad namespace"]}], "keys[0]: namespace must be"),
    ([{"key": "k", "namespaces": ["a"], "manage_documents": "yes"}], "'manage_documents' must be true or false"),
    ([{"key": "k", "namespaces": ["a"], "admin": True}], "unknown field(s) admin"),
    ([{"key": "k", "namespaces": ["a"]}, {"key": "k", "namespaces": ["b"]}], "configured twice"),
    ([], "expected {\"keys\""),
])
def test_a_bad_key_file_is_refused_naming_the_entry(tmp_path, entries, words):
    with pytest.raises(ValueError) as error:
        load_grants((), key_file(tmp_path, entries))
    assert words in str(error.value)


def test_a_key_file_that_is_not_json_or_missing_is_named(tmp_path):
    path = tmp_path / "keys.json"
    path.write_text("{not json")
    with pytest.raises(ValueError, match="keys.json: not JSON"):
        load_grants((), path)
    with pytest.raises(FileNotFoundError):
        load_grants((), tmp_path / "missing.json")
    with pytest.raises(ValueError, match="API key 2 is empty"):
        load_grants(("k", " "))


def test_a_server_beyond_loopback_needs_keys_or_an_explicit_open_door(tmp_path):
    with pytest.raises(ValueError, match="'0.0.0.0' is not loopback"):
        ServeConfig(host="0.0.0.0")
    ServeConfig(host="0.0.0.0", api_keys=("k",))
    ServeConfig(host="0.0.0.0", api_key_file=key_file(tmp_path, [{"key": "k", "namespaces": ["a"]}]))
    ServeConfig(host="0.0.0.0", allow_unauthenticated=True)
    ServeConfig(host="::1")
    assert "secret" not in repr(ServeConfig(api_keys=["secret"]))
    assert is_loopback("127.0.0.1") and not is_loopback("0.0.0.0") and not is_loopback("::")
