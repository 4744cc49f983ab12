"""The server's registered documents, kept outside the ingress process (issue 36).

``POST /v1/documents`` writes ``(namespace, id) -> text`` to a store that outlives the ingress:
Redis when the engine has a Redis URL (``CacheConfig.redis_url``; every host of the app reaches
it), else a SQLite file under the cache dir (every process on the machine). Each ingress replica
keeps the documents in memory (:class:`DocumentStore`: texts and one
:class:`~lazyattn_rag.engine.prompt_match.DocumentMatcher` per namespace) and catches up with
the others' changes before each request that reads them: a store keeps a change log whose
length is its version, so catching up reads one number and then only the changes since.

A restarted server, or a second ingress replica, starts from the store's full contents.
"""

from __future__ import annotations

import json
import sqlite3
import threading
from pathlib import Path
from typing import Protocol

from lazyattn_rag.engine.prompt_match import Candidate, DocumentMatcher
from lazyattn_rag.serve.config import ServeConfig
from lazyattn_rag.types.config import EngineConfig

Change = tuple[str, str, str | None]  # (namespace, id, text; None: deleted)


class RegistryStore(Protocol):
    """Where registered documents persist (the ingress's memory mirrors it)."""

    def put(self, namespace: str, documents: list[tuple[str, str]]) -> None:
        """Register (or update) documents in ``namespace``, all or none."""

    def delete(self, namespace: str, doc_id: str) -> None:
        """Forget a document (a no-op when unknown)."""

    def version(self) -> int:
        """The number of changes made so far."""

    def changes(self, since: int) -> tuple[int, list[Change]]:
        """The version and every change after version ``since``, oldest first (a document
        changed twice appears twice; its text is the latest)."""


class SqliteRegistry:
    """Documents in a SQLite file (WAL journal: ingress processes on one machine share it).

    Args:
        path: the database file (created with its directory).
    """

    def __init__(self, path: Path | str):
        self.path = Path(path).expanduser()
        self.path.parent.mkdir(parents=True, exist_ok=True)
        self._local = threading.local()  # one connection per thread (sqlite3 objects are not shared)
        with self._db() as db:
            db.execute("PRAGMA journal_mode=WAL")
            db.execute("CREATE TABLE IF NOT EXISTS documents (namespace TEXT NOT NULL, id TEXT NOT NULL, "
                       "text TEXT NOT NULL, PRIMARY KEY (namespace, id))")
            db.execute("CREATE TABLE IF NOT EXISTS changes (version INTEGER PRIMARY KEY AUTOINCREMENT, "
                       "namespace TEXT NOT NULL, id TEXT NOT NULL)")

    def _db(self) -> sqlite3.Connection:
        db = getattr(self._local, "db", None)
        if db is None:
            db = self._local.db = sqlite3.connect(self.path, timeout=30, isolation_level=None)
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

    def version(self) -> int:
        return self._db().execute("SELECT COALESCE(MAX(version), 0) FROM changes").fetchone()[0]

    def changes(self, since: int) -> tuple[int, list[Change]]:
        db = self._db()
        db.execute("BEGIN")  # one snapshot: the version and the rows agree
        try:
            version = db.execute("SELECT COALESCE(MAX(version), 0) FROM changes").fetchone()[0]
            rows = db.execute("SELECT c.namespace, c.id, d.text FROM changes c LEFT JOIN documents d "
                              "ON d.namespace = c.namespace AND d.id = c.id WHERE c.version > ? "
                              "ORDER BY c.version", (since,)).fetchall()
        finally:
            db.execute("COMMIT")
        return version, [(ns, i, t) for ns, i, t in rows]


class RedisRegistry:
    """Documents in Redis (redis-py): a hash of texts and a change log, written together in one
    transaction, so every ingress replica of every host sees the same registry.

    Args:
        url: the Redis server (``redis://host:port/db``).
        prefix: key prefix (the app's name keeps two apps on one server apart).
    """

    def __init__(self, url: str, prefix: str = "lazyattn:registry"):
        import redis

        self.client = redis.Redis.from_url(url, socket_timeout=5)
        self.texts, self.log = f"{prefix}:texts", f"{prefix}:changes"

    def put(self, namespace: str, documents: list[tuple[str, str]]) -> None:
        fields = [json.dumps([namespace, doc_id]) for doc_id, _ in documents]
        current = self.client.hmget(self.texts, fields) if fields else []
        changed = {f: text for f, (_, text), old in zip(fields, documents, current)
                   if old is None or old.decode() != text}
        if changed:
            with self.client.pipeline(transaction=True) as pipe:
                pipe.hset(self.texts, mapping=changed)
                pipe.rpush(self.log, *changed)
                pipe.execute()

    def delete(self, namespace: str, doc_id: str) -> None:
        field = json.dumps([namespace, doc_id])
        with self.client.pipeline(transaction=True) as pipe:  # a delete of an unknown id logs a no-op
            pipe.hdel(self.texts, field)
            pipe.rpush(self.log, field)
            pipe.execute()

    def version(self) -> int:
        return int(self.client.llen(self.log))

    def changes(self, since: int) -> tuple[int, list[Change]]:
        fields = self.client.lrange(self.log, since, -1)
        version = since + len(fields)
        if not fields:
            return version, []
        texts = self.client.hmget(self.texts, list(dict.fromkeys(fields)))
        by_field = dict(zip(dict.fromkeys(fields), texts))
        out = []
        for f in fields:
            namespace, doc_id = json.loads(f)
            text = by_field[f]
            out.append((namespace, doc_id, None if text is None else text.decode()))
        return version, out


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
        self.texts: dict[tuple[str, str], str] = {}
        self.matchers: dict[str, DocumentMatcher] = {}
        self.version = 0
        self.sync()

    def sync(self) -> None:
        """Apply the store's changes since the last sync (one version read when there are none)."""
        if self.store is None or self.store.version() == self.version:
            return
        self.version, changes = self.store.changes(self.version)
        for namespace, doc_id, text in changes:
            self._apply(namespace, doc_id, text)

    def _apply(self, namespace: str, doc_id: str, text: str | None) -> None:
        matcher = self.matchers.setdefault(namespace, DocumentMatcher())
        if text is None:
            self.texts.pop((namespace, doc_id), None)
            matcher.remove(doc_id)
        elif self.texts.get((namespace, doc_id)) != text:
            self.texts[(namespace, doc_id)] = text
            matcher.add(Candidate(doc_id, text))

    def get(self, namespace: str, doc_id: str) -> str | None:
        return self.texts.get((namespace, doc_id))

    def put(self, namespace: str, documents: list[tuple[str, str]]) -> None:
        if self.store is not None:
            self.store.put(namespace, documents)
            self.sync()
            return
        for doc_id, text in documents:
            if self.texts.get((namespace, doc_id)) != text:
                self._apply(namespace, doc_id, text)
                self.version += 1

    def delete(self, namespace: str, doc_id: str) -> None:
        if self.store is not None:
            self.store.delete(namespace, doc_id)
            self.sync()
            return
        self._apply(namespace, doc_id, None)
        self.version += 1

    def ids(self, namespace: str) -> list[str]:
        return [i for ns, i in self.texts if ns == namespace]

    def matcher(self, namespace: str) -> DocumentMatcher:
        """The matcher over ``namespace``'s documents (empty when it has none)."""
        return self.matchers.get(namespace) or DocumentMatcher()
