"""The server's registered documents, kept outside the ingress process (issue 36).

``POST /v1/documents`` writes ``(namespace, id) -> text`` to a store that outlives the ingress:
Redis when the engine has a Redis URL (``CacheConfig.redis_url``; every host of the app reaches
it), else a SQLite file under the cache dir (every process on the machine). Each ingress replica
keeps the documents in memory (:class:`DocumentStore`: texts and one
:class:`~lazyattn_rag.engine.planning.prompt_match.DocumentMatcher` per namespace) and catches up with
the others' changes before each request that reads them: a store keeps a change log whose
length is its version, so catching up reads one number and then only the changes since. A
Redis server that lost the log (flushed, restarted without persistence, or evicted it) begins a
new generation of it, and every mirror starts over from what the server holds.

A restarted server, or a second ingress replica, starts from the store's full contents.

A namespace's version (``GET /v1/documents/version``) is where its last change lies in the log,
read in one snapshot with the texts, so every replica and a restarted one give the same number
for the same contents. It counts within the store's generation: a Redis server that lost the log
(or only the log: a new generation is begun then) starts the count over, and the endpoint names
the generation beside it.

A store that cannot be reached (Redis down or not answering within its 5 s socket timeout)
does not fail the requests that read documents: the mirror serves what it last caught up with
(logged once, tried again every :data:`RETRY_S` seconds), and ``GET /health`` names the outage
(still 200: plain prompts and known documents are served). Registering and deleting need the
store: they answer 503 until it is back.
"""

from __future__ import annotations

import functools
import json
import logging
import os
import sqlite3
import threading
import time
import uuid
from collections import Counter
from pathlib import Path
from typing import Protocol

from lazyattn_rag.engine.planning.prompt_match import Candidate, DocumentMatcher
from lazyattn_rag.serve.config import ServeConfig
from lazyattn_rag.types.config import EngineConfig

Change = tuple[str, str, str | None]  # (namespace, id, text; None: deleted)
Version = tuple[str, int]  # (the change log's generation, its length)
Positions = dict[str, int]  # namespace -> where its last change lies in the change log (1-based)
RETRY_S = 30.0  # seconds between tries of a store that could not be reached (a hung one costs its 5 s timeout)
logger = logging.getLogger("lazyattn_rag.serve")


class RegistryUnavailable(Exception):
    """The registry's store cannot be reached (the ingress answers 503 for writes)."""


class RegistryStore(Protocol):
    """Where registered documents persist (the ingress's memory mirrors it)."""

    unreachable: tuple[type[BaseException], ...]  # the errors that mean the store cannot be reached

    def put(self, namespace: str, documents: list[tuple[str, str]]) -> None:
        """Register (or update) documents in ``namespace``, all or none."""

    def delete(self, namespace: str, doc_id: str) -> None:
        """Forget a document (a no-op when unknown)."""

    def version(self) -> Version:
        """The change log's generation (new when the log was lost and begun again) and length."""

    def changes(self, since: Version | None) -> tuple[Version, list[Change], bool, Positions]:
        """``(version, changes, reset, positions)``: every change after ``since``, oldest first (a
        document changed twice appears twice; its text is the latest), or, when ``since`` is of
        another generation or past the log's end (it was lost), every document the store holds and
        ``reset`` true: the mirror starts over from them. ``positions``: for each namespace of the
        changes (every namespace the log names, on a reset), where its last change lies in the log
        (the namespace's version, the same in every ingress and after a restart)."""


class SqliteRegistry:
    """Documents in a SQLite file (WAL journal: ingress processes on one machine share it).

    Args:
        path: the database file (created with its directory).
    """

    unreachable = (sqlite3.OperationalError, OSError)  # a locked or vanished file

    def __init__(self, path: Path | str):
        self.path = Path(path).expanduser()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self.path.touch(mode=0o600, exist_ok=True)  # every tenant's texts: readable by the server's user only
        os.chmod(self.path, 0o600)
        self._file = _file_id(self.path)  # the file this server opened (_db checks it is still the one there)
        self._local = threading.local()  # one connection per thread (sqlite3 objects are not shared)
        with self._db() as db:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("CREATE TABLE IF NOT EXISTS documents (namespace TEXT NOT NULL, id TEXT NOT NULL, "
                       "text TEXT NOT NULL, PRIMARY KEY (namespace, id))")
            db.execute("CREATE TABLE IF NOT EXISTS changes (version INTEGER PRIMARY KEY AUTOINCREMENT, "
                       "namespace TEXT NOT NULL, id TEXT NOT NULL)")
            # the file's own id: a file made anew (deleted, restored from elsewhere) starts a new generation
            db.execute("CREATE TABLE IF NOT EXISTS meta (key TEXT PRIMARY KEY, value TEXT NOT NULL)")
            db.execute("INSERT OR IGNORE INTO meta VALUES ('generation', ?)", (uuid.uuid4().hex,))
            self._generation = db.execute("SELECT value FROM meta WHERE key = 'generation'").fetchone()[0]

    def _db(self) -> sqlite3.Connection:
        """This thread's connection, once the file at ``path`` is checked to be the one opened.

        Raises:
            FileNotFoundError: the file was deleted or replaced while the server ran (its
                connections would go on writing to the unlinked file, which neither a restart nor
                another ingress reads): the registry is unreachable until the server restarts
                (then a new file starts empty, a new generation)."""
        if _file_id(self.path) != self._file:
            raise FileNotFoundError(f"the registry file {self.path} was deleted or replaced while the server ran; "
                                    "restart the server (a missing file starts empty)")
        db = getattr(self._local, "db", None)
        if db is None:
            db = self._local.db = sqlite3.connect(self.path, timeout=30, isolation_level=None)
            db.execute("PRAGMA secure_delete=ON")  # a deleted text is overwritten, not left in free pages
        return db

    def put(self, namespace: str, documents: list[tuple[str, str]]) -> None:
        db = self._db()
        db.execute("BEGIN IMMEDIATE")
        try:
            for doc_id, text in documents:
                row = db.execute("SELECT text FROM documents WHERE namespace = ? AND id = ?",
                                 (namespace, doc_id)).fetchone()
                if row is not None and row[0] == text:
                    continue
                db.execute("INSERT OR REPLACE INTO documents VALUES (?, ?, ?)", (namespace, doc_id, text))
                db.execute("INSERT INTO changes (namespace, id) VALUES (?, ?)", (namespace, doc_id))
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    def delete(self, namespace: str, doc_id: str) -> None:
        db = self._db()
        db.execute("BEGIN IMMEDIATE")
        try:
            if db.execute("DELETE FROM documents WHERE namespace = ? AND id = ?", (namespace, doc_id)).rowcount:
                db.execute("INSERT INTO changes (namespace, id) VALUES (?, ?)", (namespace, doc_id))
            db.execute("COMMIT")
        except BaseException:
            db.execute("ROLLBACK")
            raise

    def version(self) -> Version:
        return self._generation, self._db().execute("SELECT COALESCE(MAX(version), 0) FROM changes").fetchone()[0]

    def changes(self, since: Version | None) -> tuple[Version, list[Change], bool, Positions]:
        db = self._db()
        db.execute("BEGIN")  # one snapshot: the version and the rows agree
        try:
            version = self.version()
            reset = since is None or since[0] != version[0] or since[1] > version[1]
            after = 0 if reset else since[1]
            positions = dict(db.execute("SELECT namespace, MAX(version) FROM changes WHERE version > ? "
                                        "GROUP BY namespace", (after,)).fetchall())
            if reset:
                rows = db.execute("SELECT namespace, id, text FROM documents").fetchall()
            else:
                rows = db.execute("SELECT c.namespace, c.id, d.text FROM changes c LEFT JOIN documents d "
                                  "ON d.namespace = c.namespace AND d.id = c.id WHERE c.version > ? "
                                  "ORDER BY c.version", (since[1],)).fetchall()
        finally:
            db.execute("COMMIT")
        return version, [(ns, i, t) for ns, i, t in rows], reset, positions


def _file_id(path: Path) -> tuple[int, int] | None:
    """``(device, inode)`` of the file at ``path``, ``None`` if there is none."""
    try:
        stat = os.stat(path)
    except FileNotFoundError:
        return None
    return stat.st_dev, stat.st_ino


class RedisRegistry:
    """Documents in Redis (redis-py): a hash of texts and a change log, written together in one
    transaction, so every ingress replica of every host sees the same registry.

    Args:
        url: the Redis server (``redis://host:port/db``).
        prefix: key prefix (the app's name keeps two apps on one server apart).
    """

    def __init__(self, url: str, prefix: str = "lazyattn:registry"):
        import redis

        self.unreachable = (redis.exceptions.ConnectionError, redis.exceptions.TimeoutError, OSError)
        self.client = redis.Redis.from_url(url, socket_timeout=5)
        self.texts, self.log, self.generation = f"{prefix}:texts", f"{prefix}:changes", f"{prefix}:generation"
        self.positions = f"{prefix}:positions"  # namespace -> its last change's place in the log

    def put(self, namespace: str, documents: list[tuple[str, str]]) -> None:
        fields = [json.dumps([namespace, doc_id]) for doc_id, _ in documents]
        current = self.client.hmget(self.texts, fields) if fields else []
        changed = {f: text for f, (_, text), old in zip(fields, documents, current)
                   if old is None or old.decode() != text}
        if changed:
            self._log(namespace, list(changed), lambda pipe: pipe.hset(self.texts, mapping=changed))

    def delete(self, namespace: str, doc_id: str) -> None:
        field = json.dumps([namespace, doc_id])  # an unknown id: nothing logged, as SQLite's
        self._log(namespace, [field], lambda pipe: pipe.hdel(self.texts, field), only_if_present=field)

    def _log(self, namespace: str, fields: list[str], write, only_if_present: str | None = None) -> None:
        """``write(pipe)`` and the log's new ``fields`` in one transaction, with the namespace's
        position (optimistic: begun again if another writer changed the log or the texts
        meanwhile); nothing when ``only_if_present`` is not a registered document's field."""

        def transaction(pipe) -> None:
            if only_if_present is not None and not pipe.hexists(self.texts, only_if_present):
                return
            length = pipe.llen(self.log)
            pipe.multi()
            pipe.set(self.generation, uuid.uuid4().hex, nx=True)  # begun again if the server lost it
            write(pipe)
            pipe.rpush(self.log, *fields)
            pipe.hset(self.positions, namespace, length + len(fields))

        self.client.transaction(transaction, self.log, self.texts)

    def version(self) -> Version:
        with self.client.pipeline(transaction=True) as pipe:
            generation, length = pipe.get(self.generation).llen(self.log).execute()
        return (generation or b"").decode(), int(length)

    def changes(self, since: Version | None) -> tuple[Version, list[Change], bool, Positions]:
        version, texts, positions, fields = self._snapshot(since)
        if since is not None and since[0] == version[0] and since[1] > version[1]:
            # the log lost entries but not its generation (evicted): begin a new generation, so
            # every mirror starts over and no version names two contents
            self.client.set(self.generation, uuid.uuid4().hex)
            version, texts, positions, fields = self._snapshot(since)
        if fields is None:  # the log was lost: all of it
            changes = [(*json.loads(f), t.decode()) for f, t in texts.items()]
            known = {ns.decode(): int(p) for ns, p in positions.items()}
            # a namespace registered before positions were kept: the log's length names it
            known.update({ns: version[1] for ns, _, _ in changes if ns not in known})
            return version, changes, True, known
        by_field = dict(zip(dict.fromkeys(fields), texts))
        out, positions = [], {}
        for position, f in enumerate(fields, start=since[1] + 1):
            namespace, doc_id = json.loads(f)
            text = by_field[f]
            out.append((namespace, doc_id, None if text is None else text.decode()))
            positions[namespace] = position
        return version, out, False, positions

    def _snapshot(self, since: Version | None):
        return self.client.transaction(  # one snapshot: begun again on a change
            functools.partial(self._read, since), self.generation, self.log, self.texts, self.positions,
            value_from_callable=True)

    def _read(self, since: Version | None, pipe):
        """Inside a WATCH of every key: ``(version, texts, positions, fields)`` of the changes
        after ``since`` (``fields`` ``None``: all of the store, with its positions)."""
        generation, length = pipe.get(self.generation), pipe.llen(self.log)
        version = ((generation or b"").decode(), int(length))
        if since is None or since[0] != version[0] or since[1] > version[1]:
            texts, positions, fields = pipe.hgetall(self.texts), pipe.hgetall(self.positions), None
        else:
            fields = pipe.lrange(self.log, since[1], version[1] - 1)
            texts, positions = (pipe.hmget(self.texts, list(dict.fromkeys(fields))) if fields else []), None
        pipe.multi()
        pipe.llen(self.log)  # EXEC fails, and the read is begun again, if a watched key changed
        return version, texts, positions, fields


def open_registry(config: ServeConfig, engine_config: EngineConfig | None = None) -> "RegistryStore | None":
    """The store ``config.registry`` names (``None`` for ``"memory"``); see :class:`ServeConfig`."""
    where = config.registry
    engine_config = engine_config or EngineConfig()
    if where == "memory":
        return None
    if where == "auto":
        url = engine_config.cache.redis_url
        if url is not None:
            return RedisRegistry(url, prefix=f"lazyattn:registry:{config.app_name}")
        return SqliteRegistry(engine_config.resolved_cache_dir() / "registry" / f"{config.app_name}.sqlite3")
    if where.startswith(("redis://", "rediss://", "unix://")):
        return RedisRegistry(where, prefix=f"lazyattn:registry:{config.app_name}")
    return SqliteRegistry(where)


class DocumentStore:
    """The ingress's documents: a memory mirror of a :class:`RegistryStore` with one matcher per
    namespace, caught up with the store (:meth:`sync`) before each read.

    Args:
        store: where the documents persist; ``None``: memory only (tests).
    """

    def __init__(self, store: RegistryStore | None = None):
        self.store = store
        self.unavailable: str | None = None  # the store's last error while it cannot be reached
        self._retry_at = 0.0
        self.texts: dict[tuple[str, str], str] = {}
        self.matchers: dict[str, DocumentMatcher] = {}
        self._store_version: Version | None = None
        self.version = 0  # grows with every change this mirror applies
        # per namespace (GET /v1/documents/version: a tenant sees its own): where its last change
        # lies in the store's log, so every ingress and a restarted one agree (memory only: the
        # mirror's own count of changes)
        self.versions: Counter[str] = Counter()
        self.sync()

    def sync(self) -> None:
        """Apply the store's changes since the last sync (one version read when there are none);
        start over from the store's contents when it lost its change log. A store that cannot be
        reached leaves the mirror as it is (see the module docstring)."""
        if self.store is None or (self.unavailable is not None and time.monotonic() < self._retry_at):
            return
        try:
            self._catch_up()
        except self.store.unreachable as exc:
            self._unreachable(exc)
            return
        if self.unavailable is not None:
            logger.warning("document registry reachable again; caught up with its changes")
            self.unavailable = None

    def _unreachable(self, exc: BaseException) -> None:
        if self.unavailable is None:
            logger.warning("document registry unreachable (%s: %s): serving the %d documents last read, "
                           "trying again every %g s", type(exc).__name__, exc, len(self.texts), RETRY_S)
        self.unavailable = f"{type(exc).__name__}: {exc}"
        self._retry_at = time.monotonic() + RETRY_S

    def _catch_up(self) -> None:
        if self._store_version is not None and self.store.version() == self._store_version:
            return
        self._store_version, changes, reset, positions = self.store.changes(self._store_version)
        if reset:
            keep = {(ns, i) for ns, i, _ in changes}
            for namespace, doc_id in [k for k in self.texts if k not in keep]:
                self._apply(namespace, doc_id, None)
        for namespace, doc_id, text in changes:
            self._apply(namespace, doc_id, text)
        if reset:  # a new generation (or the first read): what the store names, nothing older
            self.versions.clear()
        for namespace, position in positions.items():
            self.versions[namespace] = position

    def _apply(self, namespace: str, doc_id: str, text: str | None) -> None:
        matcher = self.matchers.setdefault(namespace, DocumentMatcher())
        if text is None:
            if self.texts.pop((namespace, doc_id), None) is not None:
                self._changed(namespace)
            matcher.remove(doc_id)
        elif self.texts.get((namespace, doc_id)) != text:
            self.texts[(namespace, doc_id)] = text
            matcher.add(Candidate(doc_id, text))
            self._changed(namespace)

    def _changed(self, namespace: str) -> None:
        self.version += 1
        if self.store is None:
            self.versions[namespace] = self.version

    def _write(self, change) -> None:
        try:
            change()
        except self.store.unreachable as exc:
            self._unreachable(exc)
            raise RegistryUnavailable(f"the document registry cannot be reached ({self.unavailable}); "
                                      f"try again once it is back") from exc
        self._retry_at = 0.0  # it answered: catch up now
        self.sync()

    @property
    def generation(self) -> str:
        """The store's generation (``""`` without a store): a namespace's version counts within it.
        A store that lost its contents (Redis flushed) begins a new one, and versions start over."""
        return self._store_version[0] if self._store_version is not None else ""

    def get(self, namespace: str, doc_id: str) -> str | None:
        return self.texts.get((namespace, doc_id))

    def put(self, namespace: str, documents: list[tuple[str, str]]) -> None:
        """Register ``documents`` in the store, then catch up.

        Raises:
            RegistryUnavailable: the store cannot be reached (one transaction: applied whole or
                not at all; a timeout cannot say which)."""
        if self.store is not None:
            self._write(lambda: self.store.put(namespace, documents))
            return
        for doc_id, text in documents:
            self._apply(namespace, doc_id, text)

    def delete(self, namespace: str, doc_id: str) -> None:
        """Unregister ``doc_id``, then catch up.

        Raises:
            RegistryUnavailable: the store cannot be reached (applied whole or not at all)."""
        if self.store is not None:
            self._write(lambda: self.store.delete(namespace, doc_id))
            return
        self._apply(namespace, doc_id, None)

    def ids(self, namespace: str) -> list[str]:
        return [i for ns, i in self.texts if ns == namespace]

    def matcher(self, namespace: str) -> DocumentMatcher:
        """The matcher over ``namespace``'s documents (empty when it has none)."""
        return self.matchers.get(namespace) or DocumentMatcher()
