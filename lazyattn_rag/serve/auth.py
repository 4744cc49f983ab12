"""Who may call ``lazyattn serve``, and in which namespaces (issue 37).

Keys come from ``--api-key`` (one or more; also ``LAZYATTN_API_KEY``, comma-separated) and from a
key file (``--api-key-file``), JSON::

    {"keys": [
      {"key": "sk-team-a-...", "namespaces": ["team-a"], "manage_documents": true},
      {"key_sha256": "<hex digest of the key>", "namespaces": ["team-b", "shared"], "name": "team-b reader"}
    ]}

* ``namespaces``: the namespaces the key may use, its default first (the one a request that
  names none is served in); ``"*"`` allows every namespace (then a request names its own,
  ``""`` by default). An ``--api-key`` key allows every namespace, as vLLM's ``--api-key``
  guards a single-tenant server.
* ``manage_documents``: whether the key may register, warm and delete documents (default
  false: it may list them and place them).
* ``key_sha256`` instead of ``key`` keeps the key itself out of the file.

A request carries its key as ``Authorization: Bearer <key>`` (what the ``openai`` package,
LangChain and LlamaIndex send); a missing or unknown key is 401, a namespace outside the key's
is 403. The presented key is hashed (SHA-256) and compared with every configured key's digest
with :func:`hmac.compare_digest`, always all of them, so the time taken says nothing about
which key, or how much of one, matched.

With no key configured the server is open, as it always was, but only to loopback clients;
``ServeConfig`` refuses to listen on another interface without keys unless
``allow_unauthenticated`` is set, and a request from another address is 401 unless it is.
"""

from __future__ import annotations

import hashlib
import hmac
import ipaddress
import json
import re
from dataclasses import dataclass
from pathlib import Path

from lazyattn_rag.serve.http_errors import ApiError
from lazyattn_rag.serve.protocol import NAMESPACE_PATTERN

ANY_NAMESPACE = "*"


@dataclass(frozen=True)
class KeyGrant:
    """What one API key may do.

    Attributes:
        digest: SHA-256 of the key (32 bytes).
        namespaces: the namespaces it may use, its default first; ``("*",)``: any.
        manage_documents: whether it may register, warm and delete documents.
        name: how logs and errors name it (never the key).
    """

    digest: bytes
    namespaces: tuple[str, ...]
    manage_documents: bool
    name: str

    def namespace(self, requested: str | None) -> str:
        """The namespace a request of this key is served in: ``requested`` when the key allows
        it, the key's default when the request names none (``None`` or ``""`` for a key bound
        to namespaces).

        Raises:
            ApiError: 400 for a namespace that is not ``""`` or 1-128 letters, digits and ``_.:@/-``
                (a query parameter's, unchecked by the body models); 403 naming the namespace the
                key may not use.
        """
        if requested and not re.fullmatch(NAMESPACE_PATTERN, requested):
            raise ApiError(400, f"namespace must be 1-128 letters, digits and _.:@/- characters, got {requested!r}",
                           param="namespace")
        if ANY_NAMESPACE in self.namespaces:
            return requested or ""
        if not requested:
            return self.namespaces[0]
        if requested not in self.namespaces:
            raise ApiError(403, f"this API key ({self.name}) may not use namespace {requested!r}",
                           kind="permission_denied", param="namespace", code="namespace_forbidden")
        return requested

    def check_manage(self) -> None:
        """Raises :class:`ApiError` 403 unless the key may register, warm and delete documents."""
        if not self.manage_documents:
            raise ApiError(403, f"this API key ({self.name}) may not register, warm or delete documents",
                           kind="permission_denied", code="documents_read_only")


OPEN = KeyGrant(b"", (ANY_NAMESPACE,), True, "no key")  # a server without keys: anyone it lets in


def key_digest(key: str) -> bytes:
    return hashlib.sha256(key.encode("utf-8")).digest()


def load_grants(api_keys: tuple[str, ...] = (), api_key_file: str | Path | None = None) -> tuple[KeyGrant, ...]:
    """The grants of ``api_keys`` (every namespace, may manage documents) and of the key file.

    Raises:
        ValueError: an empty key, a duplicate key, or a key file that is not as the module
            docstring shows (the entry and field named).
        FileNotFoundError: the key file is missing.
    """
    grants = []
    for i, key in enumerate(api_keys):
        if not isinstance(key, str) or not key.strip():
            raise ValueError(f"API key {i + 1} is empty")
        grants.append(KeyGrant(key_digest(key), (ANY_NAMESPACE,), True, f"--api-key {i + 1}"))
    if api_key_file is not None:
        grants += _file_grants(Path(api_key_file).expanduser())
    digests = [g.digest for g in grants]
    if len(set(digests)) != len(digests):
        dup = next(g.name for g in grants if digests.count(g.digest) > 1)
        raise ValueError(f"an API key is configured twice ({dup})")
    return tuple(grants)


def _file_grants(path: Path) -> list[KeyGrant]:
    try:
        data = json.loads(path.read_text())
    except json.JSONDecodeError as error:
        raise ValueError(f"API key file {path}: not JSON ({error})") from None
    entries = data.get("keys") if isinstance(data, dict) else None
    if not isinstance(entries, list) or not entries:
        raise ValueError(f"API key file {path}: expected {{\"keys\": [{{\"key\", \"namespaces\"}}, ...]}}")
    return [_entry_grant(path, i, entry) for i, entry in enumerate(entries)]


def _entry_grant(path: Path, i: int, entry) -> KeyGrant:
    from lazyattn_rag.engine.planning.registry import check_namespace

    where = f"API key file {path}, keys[{i}]"
    if not isinstance(entry, dict):
        raise ValueError(f"{where}: expected an object")
    unknown = set(entry) - {"key", "key_sha256", "namespaces", "manage_documents", "name"}
    if unknown:
        raise ValueError(f"{where}: unknown field(s) {', '.join(sorted(unknown))}")
    key, digest = entry.get("key"), entry.get("key_sha256")
    if (key is None) == (digest is None):
        raise ValueError(f"{where}: give exactly one of 'key' and 'key_sha256'")
    if key is not None and (not isinstance(key, str) or not key.strip()):
        raise ValueError(f"{where}: 'key' must be a non-empty string")
    if digest is not None:
        try:
            raw = bytes.fromhex(digest) if isinstance(digest, str) else b""
        except ValueError:
            raw = b""
        if len(raw) != 32:
            raise ValueError(f"{where}: 'key_sha256' must be 64 hex digits (hashlib.sha256(key).hexdigest())")
    namespaces = entry.get("namespaces")
    if not isinstance(namespaces, list) or not namespaces or not all(isinstance(n, str) for n in namespaces):
        raise ValueError(f"{where}: 'namespaces' must be a non-empty list of namespaces (or [\"*\"])")
    for n in namespaces:
        if n != ANY_NAMESPACE:
            try:
                check_namespace(n)
            except ValueError as error:
                raise ValueError(f"{where}: {error}") from None
    manage = entry.get("manage_documents", False)
    if not isinstance(manage, bool):
        raise ValueError(f"{where}: 'manage_documents' must be true or false")
    name = entry.get("name", f"keys[{i}]")
    return KeyGrant(key_digest(key) if key is not None else raw, tuple(dict.fromkeys(namespaces)), manage, str(name))


def is_loopback(host: str | None) -> bool:
    """Whether ``host`` (an address or ``localhost``) is a loopback address."""
    if host in ("localhost",):
        return True
    try:
        address = ipaddress.ip_address(host or "")
    except ValueError:
        return False
    mapped = getattr(address, "ipv4_mapped", None)
    return (mapped or address).is_loopback


class Authenticator:
    """The ingress's gate (see the module docstring).

    Args:
        grants: the configured keys (:func:`load_grants`); empty: an open server.
        allow_unauthenticated: with no keys, let clients that are not on loopback in too.
    """

    def __init__(self, grants: tuple[KeyGrant, ...], allow_unauthenticated: bool = False):
        self.grants, self.allow_unauthenticated = grants, allow_unauthenticated

    def caller(self, authorization: str | None, client_host: str | None) -> KeyGrant:
        """The grant of a request with this ``Authorization`` header from ``client_host``.

        Raises:
            ApiError: 401 for a missing or unknown key (or, on a server without keys, a client
                that is not on loopback).
        """
        if not self.grants:
            if self.allow_unauthenticated or is_loopback(client_host):
                return OPEN
            raise ApiError(401, "this server takes requests without an API key from loopback only",
                           kind="authentication_error", code="invalid_api_key")
        scheme, _, token = (authorization or "").partition(" ")
        if scheme.lower() != "bearer" or not token.strip():
            raise ApiError(401, "missing API key: send 'Authorization: Bearer <key>'", kind="authentication_error",
                           code="invalid_api_key")
        grant = self.match(token.strip())
        if grant is None:
            raise ApiError(401, "invalid API key", kind="authentication_error", code="invalid_api_key")
        return grant

    def match(self, key: str) -> KeyGrant | None:
        """The grant whose key is ``key``: every digest is compared, in constant time."""
        digest, found = key_digest(key), None
        for grant in self.grants:
            if hmac.compare_digest(digest, grant.digest):
                found = grant
        return found
