"""The disk tier: one file per chunk under a directory, shared by the processes that open it
(``engine/tiers/chunk_store.py`` describes every tier and the writes' atomicity)."""

from __future__ import annotations

import os
import tempfile
from pathlib import Path

from lazyattn_rag.engine.kv.eviction import EvictionPolicy
from lazyattn_rag.engine.tiers.chunk_store import SUFFIX, ChunkStore


class DiskStore(ChunkStore):
    """Chunks as files ``<directory>/<key>.lakv`` (see the module docstring).

    Args:
        directory: created if missing; files already there are indexed, oldest first.
        capacity_bytes, policy: as :class:`ChunkStore`; entries beyond the capacity at opening
            are evicted, oldest first.
    """

    name = "disk"

    def __init__(self, directory: Path, capacity_bytes: int, policy: EvictionPolicy | None = None):
        super().__init__(capacity_bytes, policy)
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        found = sorted((f for f in self.directory.glob(f"*{SUFFIX}") if f.is_file()), key=lambda f: f.stat().st_mtime)
        for f in found:
            self._record(f.name[: -len(SUFFIX)], f.stat().st_size)
        self._make_room(0)

    def _adopt(self, key: str) -> bool:
        try:
            size = self._path(key).stat().st_size
        except (OSError, ValueError):
            return False
        self._record(key, size)
        return True

    def _refresh(self) -> None:
        """Index the files other processes wrote since (as the most recent), forget the ones
        they deleted (a listing of the directory: about a millisecond per thousand chunks)."""
        present = {}
        for entry in os.scandir(self.directory):
            if entry.name.endswith(SUFFIX) and entry.is_file():
                present[entry.name[: -len(SUFFIX)]] = entry
        for key in [k for k in self._sizes if k not in present]:
            self._forget(key, evicted=False)
        new = sorted((e for k, e in present.items() if k not in self._sizes), key=lambda e: e.stat().st_mtime)
        for entry in new:
            self._record(entry.name[: -len(SUFFIX)], entry.stat().st_size)

    def _path(self, key: str) -> Path:
        if not key or not all(c.isalnum() or c in "-_" for c in key):
            raise ValueError(f"not a chunk key: {key!r} (content keys are hex digests)")
        return self.directory / f"{key}{SUFFIX}"

    def _read(self, key: str) -> bytes:
        return self._path(key).read_bytes()

    def _stage(self, key: str, data: bytes) -> str:
        """Write and fsync a temporary file in the directory; its name."""
        self._path(key)  # a bad key fails before anything is written
        fd, tmp = tempfile.mkstemp(prefix=".", suffix=".tmp", dir=self.directory)
        try:
            with os.fdopen(fd, "wb") as f:
                f.write(data)
                f.flush()
                os.fsync(f.fileno())
        except BaseException:
            Path(tmp).unlink(missing_ok=True)
            raise
        return tmp

    def _commit(self, key: str, staged: str) -> None:
        try:
            os.replace(staged, self._path(key))  # atomic: readers see the old file or the new one
        except BaseException:
            Path(staged).unlink(missing_ok=True)
            raise

    def _remove(self, key: str) -> None:
        self._path(key).unlink(missing_ok=True)
