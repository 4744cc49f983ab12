"""Documents a framework retrieved, kept per trace until the trace ends.

LlamaIndex (instrumentation spans and events) and LangChain (callback runs) both describe a
query as a tree: a root span or run (``query``, ``chat``, a chain's ``invoke``) with the
retrieval and the LLM call somewhere below it. The adapters (``llamaindex_events``,
``langchain_callbacks``) report each node's parent, every retrieval's documents and every
end; the LLM looks up the documents retrieved under its own root, so it matches the prompt
against exactly the documents of its query, and knows when a query retrieved documents that
its prompt does not contain.

Memory is bounded: a trace is forgotten when its root ends, and at most ``max_nodes`` open
nodes are remembered (the oldest go first; a trace that outlives them is simply not found).
"""

from __future__ import annotations

import threading
from collections import OrderedDict
from collections.abc import Iterable

from lazyattn_rag.engine.planning.prompt_match import Candidate


class RetrievalLog:
    """Retrieved documents per trace root (thread-safe).

    Args:
        max_nodes: most open spans/runs remembered at once.
    """

    def __init__(self, max_nodes: int = 4096):
        self._lock = threading.Lock()
        self._parents: OrderedDict[str, str | None] = OrderedDict()
        self._documents: dict[str, list[Candidate]] = {}
        self.max_nodes = max_nodes

    def start(self, node_id: str, parent_id: str | None) -> None:
        """A span or run began under ``parent_id`` (``None``: a root)."""
        with self._lock:
            self._parents[node_id] = parent_id
            while len(self._parents) > self.max_nodes:
                old, _ = self._parents.popitem(last=False)
                self._documents.pop(old, None)

    def end(self, node_id: str) -> None:
        """A span or run ended; a root takes its documents with it."""
        with self._lock:
            self._parents.pop(node_id, None)
            self._documents.pop(node_id, None)

    def root(self, node_id: str | None) -> str | None:
        """The root of ``node_id``'s trace (itself when its parent is unknown)."""
        with self._lock:
            return self._root(node_id)

    def ancestors(self, node_id: str | None) -> list[str]:
        """``node_id`` and its ancestors that are still open, innermost first (a span can outlive
        its parent: LlamaIndex streams a chat engine's reply from a thread after the chat ended)."""
        with self._lock:
            return self._open_chain(node_id)

    def _open_chain(self, node_id: str | None) -> list[str]:
        out: list[str] = []
        while node_id is not None and node_id in self._parents and node_id not in out:
            out.append(node_id)
            node_id = self._parents[node_id]
        return out

    def _root(self, node_id: str | None) -> str | None:
        chain = self._open_chain(node_id)
        return chain[-1] if chain else node_id

    def add(self, node_id: str | None, documents: Iterable[Candidate]) -> None:
        """Documents retrieved in ``node_id``'s trace."""
        with self._lock:
            root = self._root(node_id)
            if root is not None:
                self._documents.setdefault(root, []).extend(documents)

    def documents(self, node_id: str | None) -> list[Candidate]:
        """Documents retrieved so far in ``node_id``'s trace (first retrieval first)."""
        with self._lock:
            return list(self._documents.get(self._root(node_id), ()))
