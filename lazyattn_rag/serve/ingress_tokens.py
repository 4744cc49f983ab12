"""Plain chat prompts tokenized in the ingress, not beside the replica's engine (issue 36).

The ingress builds the replicas' own prompt template once (their tokenizer and prompt settings,
:meth:`EngineReplica.prompt_tokenizer`) and, for a chat request whose messages place no
document (an unchanged OpenAI client pasting its retrieved texts), sends the token ids of its
long text pieces with the payload (``payload["pretokenized"]``,
``engine/planning/pretokenized.py``). The replica's planning thread then looks the ids up
instead of tokenizing ~17k characters under the GIL its engine loop needs. The template is
fetched in the background at the first chat request; until it is there, requests go as before
and the replica tokenizes. A failed fetch (a replica not ready yet, or gone) is logged and
tried again after a wait that doubles from :data:`RETRY_FIRST_S` up to :data:`RETRY_MAX_S`.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
import time
from typing import Any

from lazyattn_rag.engine.planning.pretokenized import PRETOKENIZE_MIN_CHARS, pretokenize
from lazyattn_rag.types.messages import as_message

logger = logging.getLogger(__name__)
RETRY_FIRST_S = 5.0  # seconds before fetching the template again after a failure (doubling)
RETRY_MAX_S = 600.0
FETCH_TIMEOUT_S = 120.0  # a fetch that takes longer counts as failed


class IngressTokenizer:
    """The ingress's copy of the replicas' prompt template (see the module docstring).

    Args:
        engine: the Ray Serve handle to the engine replicas.
        enabled: :attr:`~lazyattn_rag.serve.config.ServeConfig.tokenize_in_ingress`.
    """

    def __init__(self, engine: Any, enabled: bool = True):
        self.engine, self.enabled = engine, enabled
        self.template: Any = None  # a PromptTemplate once loaded
        self._loading: asyncio.Task | None = None
        self._retry_at, self._retry_wait_s = 0.0, RETRY_FIRST_S

    async def add_to(self, payload: dict[str, Any]) -> None:
        """Put ``payload``'s token ids under ``"pretokenized"`` where its messages are plain text
        long enough to pay (:data:`PRETOKENIZE_MIN_CHARS`), place no document (the ``documents``
        field makes the replica build its own RAG prompt) and the template is loaded; else leave
        it as it is (the replica tokenizes)."""
        messages = payload.get("messages")
        if (not self.enabled or not messages or payload.get("placed")
                or _text_length(messages) < PRETOKENIZE_MIN_CHARS):
            return
        if self.template is None:
            self._start_loading()
            return
        known = await asyncio.to_thread(pretokenize, self.template, [as_message(m) for m in messages])
        if known is not None:
            payload["pretokenized"] = known.as_body()

    def _start_loading(self) -> None:
        if (self._loading is None or self._loading.done()) and time.monotonic() >= self._retry_at:
            self._loading = asyncio.ensure_future(self._load())

    async def _load(self) -> None:
        from lazyattn_rag.engine.planning.prompt import PromptTemplate

        try:
            await asyncio.to_thread(importlib.import_module, "transformers")  # unpickling the tokenizer needs it
            spec = await asyncio.wait_for(self.engine.prompt_tokenizer.remote(), FETCH_TIMEOUT_S)
            template = await asyncio.to_thread(PromptTemplate, spec["tokenizer"], spec["prompt"])
            await asyncio.to_thread(lambda: template.tokenizer_digest)  # megabytes hashed once, off the loop
            self.template = template
        except Exception as error:  # noqa: BLE001 - the replicas tokenize meanwhile
            self._retry_at = time.monotonic() + self._retry_wait_s
            logger.warning("plain prompts are tokenized by the replicas for now: the ingress could not build their "
                           "prompt template (%s: %s); trying again in %.0f s", type(error).__name__, error,
                           self._retry_wait_s)
            self._retry_wait_s = min(2 * self._retry_wait_s, RETRY_MAX_S)


def _text_length(messages: list[dict[str, Any]]) -> int:
    """The characters of wire ``messages``' text (0 where a message places a document: the
    replica plans such a prompt around the document's chunk)."""
    total = 0
    for message in messages:
        content = message.get("content")
        if isinstance(content, str):
            total += len(content)
            continue
        for part in content if isinstance(content, list) else ():
            if not isinstance(part, dict) or part.get("type") != "text":
                return 0
            total += len(part.get("text") or "")
    return total
