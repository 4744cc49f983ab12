"""Plain chat prompts tokenized in the ingress, not beside the replica's engine (issue 36).

The ingress builds the replicas' own prompt template once (their tokenizer and prompt settings,
:meth:`EngineReplica.prompt_tokenizer`) and, for a chat request whose messages place no
document (an unchanged OpenAI client pasting its retrieved texts), sends the token ids of its
long text pieces with the payload (``payload["pretokenized"]``,
``engine/planning/pretokenized.py``). The replica's planning thread then looks the ids up
instead of tokenizing ~17k characters under the GIL its engine loop needs. The template is
fetched in the background at the first chat request; until it is there, or if fetching it
fails (logged once), requests go as before and the replica tokenizes.
"""

from __future__ import annotations

import asyncio
import importlib
import logging
from typing import Any

from lazyattn_rag.engine.planning.pretokenized import PRETOKENIZE_MIN_CHARS, pretokenize
from lazyattn_rag.types.messages import as_message

logger = logging.getLogger(__name__)


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

    async def add_to(self, payload: dict[str, Any]) -> None:
        """Put ``payload``'s token ids under ``"pretokenized"`` where its messages are plain text
        long enough to pay (:data:`PRETOKENIZE_MIN_CHARS`) and the template is loaded; else
        leave it as it is (the replica tokenizes)."""
        messages = payload.get("messages")
        if not self.enabled or not messages or _text_length(messages) < PRETOKENIZE_MIN_CHARS:
            return
        if self.template is None:
            if self._loading is None:
                self._loading = asyncio.ensure_future(self._load())
            return
        known = await asyncio.to_thread(pretokenize, self.template, [as_message(m) for m in messages])
        if known is not None:
            payload["pretokenized"] = known.as_body()

    async def _load(self) -> None:
        from lazyattn_rag.engine.planning.prompt import PromptTemplate

        try:
            await asyncio.to_thread(importlib.import_module, "transformers")  # unpickling the tokenizer needs it
            spec = await self.engine.prompt_tokenizer.remote()
            template = await asyncio.to_thread(PromptTemplate, spec["tokenizer"], spec["prompt"])
            await asyncio.to_thread(lambda: template.tokenizer_digest)  # megabytes hashed once, off the loop
            self.template = template
        except Exception as error:  # noqa: BLE001 - the replicas tokenize as before
            self.enabled = False
            logger.warning("plain prompts are tokenized by the replicas: the ingress could not build their prompt "
                           "template (%s: %s)", type(error).__name__, error)


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
