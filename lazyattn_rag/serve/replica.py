"""One engine per Ray Serve replica (issue 18).

:class:`EngineReplica` is the deployment class the app wraps (``lazyattn_rag/serve/app.py``
sets its replicas, resources and router). It holds a :class:`~lazyattn_rag.llm.LazyAttention`
built from an :class:`~lazyattn_rag.types.config.EngineConfig` and answers the ingress:

* :meth:`generate`: one chat request, streamed back as events (dicts): ``{"text", "index"}``
  per delta, then per answer (``n`` of them) ``{"text", "index", "finish_reason", "stats",
  "replica", "timings"}``
  (``timings``: wall-clock seconds when the replica received the request, handed it to the
  engine's client to be planned and queued, and gave out its first event); a request the
  engine refuses (unknown document, prompt too long, bad sampling values) yields one
  ``{"error": {"message", "type", "status"}}`` event instead and touches nothing;
* :meth:`register`: check and register documents (what ``POST /v1/documents`` does first on
  the replica that will own them);
* :meth:`info`: the model's name, context limit and prompt settings; :meth:`stats`: this
  replica's engine stats now (called on every replica at each ``/metrics`` scrape);
* :meth:`forget` (called on every replica: ``DeploymentHandle.broadcast``): delete a document's
  K/V from this replica's KV pool and from the storage tiers; :meth:`holds`: where this
  replica holds a text's chunk.

The ingress sends every document a request places with its text, so any replica can serve any
request; a replica registers the ones it has not seen (or whose text changed) with the request.
A request queued before a delete must not bring the document back: the ingress stamps every
call with the time it sent it (``issued_at``), each replica remembers when it was told to forget
each document (the last ``MAX_DELETED`` of them), and a call sent before that delete is refused
for that document (404) instead of registering and computing it again.
"""

from __future__ import annotations

import asyncio
import dataclasses
import functools
import sys
import time
from collections import OrderedDict
from collections.abc import AsyncIterator, Callable
from typing import Any

from lazyattn_rag.metrics import ENGINE_STAT_KEYS
from lazyattn_rag.types.config import EngineConfig
from lazyattn_rag.types.documents import Document, RemovedDocument
from lazyattn_rag.types.errors import LazyAttentionError, UnknownDocumentError
from lazyattn_rag.types.messages import Message, as_message, rag_messages
from lazyattn_rag.types.wire import (ERROR_CODES, logprob_entry, remedies_from_body, sampling_from_body,
                                     stats_to_body)

MAX_DELETED = 100_000  # deletes a replica remembers (to refuse calls sent before them)


def _refused() -> tuple[type[BaseException], ...]:
    """What a bad request raises (answered 400, or 404 for an unknown document): the engine's
    errors, bad values, and a chat template's own refusal (jinja2's ``TemplateError``, e.g. "roles
    must alternate"), which is the request's fault, not the server's."""
    try:
        from jinja2 import TemplateError
    except ImportError:  # transformers renders templates with jinja2; without it there are none
        return LazyAttentionError, ValueError, TypeError
    return LazyAttentionError, ValueError, TypeError, TemplateError


REFUSED = _refused()


def error_event(error: BaseException) -> dict[str, Any]:
    """The event for a request the engine refused: 404 for an unknown document, 400 otherwise."""
    status = 404 if isinstance(error, UnknownDocumentError) else 400
    message = error.args[0] if isinstance(error, KeyError) and error.args else str(error)
    code = next((c for name, c in ERROR_CODES.items() if name in {k.__name__ for k in type(error).__mro__}), None)
    return {"error": {"message": str(message), "type": type(error).__name__, "status": status, "code": code}}


class EngineReplica:
    """A replica's engine (see the module docstring).

    Args:
        config: the engine's configuration (model, device, cache and its tiers...).
        build: instead, a function that builds the replica's engine (run in the replica, e.g. a
            benchmark's random-weight model); picklable by Ray.
        switch_interval_ms: this process's thread switch interval
            (:attr:`~lazyattn_rag.serve.config.ServeConfig.switch_interval_ms`); ``None``: unchanged.
    """

    def __init__(self, config: EngineConfig | None = None, build: Callable[[], Any] | None = None,
                 switch_interval_ms: float | None = None):
        from lazyattn_rag.async_llm import AsyncLazyAttention
        from lazyattn_rag.llm import LazyAttention
        from lazyattn_rag.serve.loopback import bind_replica_server_to_loopback

        bind_replica_server_to_loopback()
        if switch_interval_ms is not None:  # the replica's process is ours: its threads share one GIL
            sys.setswitchinterval(switch_interval_ms / 1e3)
        self.llm = build() if build is not None else LazyAttention(config)
        self.allm = AsyncLazyAttention(self.llm)
        self.replica_id = _replica_id()
        self.deleted: OrderedDict[tuple[str, str], float] = OrderedDict()  # (namespace, id) -> when forgotten

    def _check_not_deleted(self, doc_ids, namespace: str, issued_at: float | None) -> None:
        """Raises ``UnknownDocumentError`` for a document deleted after the call was sent (a call
        without ``issued_at`` is not checked: the ingress stamps every one)."""
        if issued_at is None:
            return
        for doc_id in doc_ids:
            deleted_at = self.deleted.get((namespace, doc_id))
            if deleted_at is not None and deleted_at > issued_at:
                where = f" in namespace {namespace!r}" if namespace else ""
                raise UnknownDocumentError(f"document {doc_id!r}{where} was deleted while this request waited")

    async def info(self) -> dict[str, Any]:
        """``{"model", "max_model_len", "prompt": PromptConfig as a dict, "replica"}``."""
        return {"model": self.llm.model_name, "max_model_len": self.llm.max_model_len,
                "prompt": dataclasses.asdict(self.llm.config.prompt), "replica": self.replica_id}

    async def register(self, documents: list[tuple[str, str]], namespace: str = "",
                       routing_keys: list[str] = (), issued_at: float | None = None) -> dict[str, Any]:
        """Register ``documents`` (``(id, text)``), all or none: ``{"registered": n}`` or an error event."""
        try:
            self._check_not_deleted([i for i, _ in documents], namespace, issued_at)
            count = await _to_thread(self.llm.add_documents, [Document(i, t) for i, t in documents], namespace)
        except REFUSED as error:
            return error_event(error)
        return {"registered": count, "replica": self.replica_id}

    async def warm(self, documents: list[tuple[str, str]], namespace: str = "",
                   routing_keys: list[str] = (), issued_at: float | None = None) -> dict[str, Any]:
        """Register ``documents`` and compute their K/V now: ``{"computed": [ids]}`` (the ones
        that were not cached yet) or an error event."""
        try:
            self._check_not_deleted([i for i, _ in documents], namespace, issued_at)
            await _to_thread(self.llm.add_documents, [Document(i, t) for i, t in documents], namespace)
            computed = await _to_thread(self.llm.warm, [i for i, _ in documents], namespace)
        except REFUSED as error:
            return error_event(error)
        return {"computed": computed, "replica": self.replica_id}

    async def forget(self, doc_id: str, text: str, namespace: str = "", keep_kv: bool = False,
                     wait_s: float = 30.0) -> dict[str, Any]:
        """Delete document ``doc_id`` (whose text was ``text``) here: unregister it and, unless
        ``keep_kv`` (another document of the namespace has the same text), drop its chunk from
        the KV pool and the storage tiers (``engine/document_removal.py``), whether or not this
        replica registered it. Chunks that running requests read are freed when they finish;
        this waits up to ``wait_s`` seconds for that.

        Returns:
            ``RemovedDocument.as_dict()`` with ``"replica"``, ``"cached"`` (whether the KV pool
            still holds the chunk when this returns) and ``"kv_blocks_at_finish"`` (blocks freed
            while waiting).
        """
        from lazyattn_rag.engine.document_removal import holds_text, purge_text

        self.deleted[(namespace, doc_id)] = time.time()  # calls sent before now may not bring it back
        self.deleted.move_to_end((namespace, doc_id))
        while len(self.deleted) > MAX_DELETED:
            self.deleted.popitem(last=False)

        def run(engine):
            if keep_kv:
                if engine.documents.contains(doc_id, namespace):
                    engine.documents.remove(doc_id, namespace)
                return RemovedDocument(doc_id, namespace, shared=True)
            return purge_text(engine, doc_id, text, namespace)

        removed = await _to_thread(self.llm.client.call, run)
        cached = removed.num_in_use > 0
        deadline = time.monotonic() + wait_s
        while cached and time.monotonic() < deadline:
            await asyncio.sleep(0.05)
            cached = "kv" in await _to_thread(self.llm.client.call, lambda engine: holds_text(engine, text, namespace))
        return removed.as_dict() | {"replica": self.replica_id, "cached": cached}

    async def stats(self) -> dict[str, Any]:
        """This replica's engine stats now (the keys ``/metrics`` exports, ``num_requests_running``
        among them) and ``"replica"``."""
        return await self._engine_stats() | {"replica": self.replica_id}

    async def holds(self, text: str, namespace: str = "") -> dict[str, Any]:
        """``{"replica", "where": ["kv", tier names...]}``: where this replica holds the chunk
        of a document with ``text`` in ``namespace`` (``[]``: nowhere)."""
        from lazyattn_rag.engine.document_removal import holds_text

        where = await _to_thread(self.llm.client.call, lambda engine: holds_text(engine, text, namespace))
        return {"replica": self.replica_id, "where": where}

    async def tokenize(self, body: dict[str, Any], routing_keys: list[str] = ()) -> dict[str, Any]:
        """vLLM's ``/tokenize``: ``{"prompt", "add_special_tokens"}`` -> ``{"count", "tokens",
        "max_model_len"}``; ``{"messages", "namespace"}`` -> the prompt the engine would build
        for those chat messages (``count`` only), or an error event."""
        try:
            if "payload" in body:  # messages: the prompt generate() would build for this payload
                try:
                    count = await _to_thread(self._count, body["payload"])
                finally:
                    await self._forget_transient(body["payload"])
                return {"count": count, "max_model_len": self.llm.max_model_len}
            if not isinstance(body.get("prompt"), str):
                raise ValueError("'prompt' must be a string")
            ids = self.llm.tokenizer(body["prompt"], add_special_tokens=bool(body.get("add_special_tokens", True)))
            tokens = list(ids["input_ids"])
            return {"count": len(tokens), "tokens": tokens, "max_model_len": self.llm.max_model_len}
        except REFUSED as error:
            return error_event(error)

    async def detokenize(self, tokens: Any) -> dict[str, Any]:
        """vLLM's ``/detokenize``: token ids -> ``{"prompt": text}``, or an error event naming
        the first id outside the vocabulary."""
        vocab_size = len(self.llm.tokenizer)
        if not isinstance(tokens, list) or not all(isinstance(t, int) and not isinstance(t, bool) for t in tokens):
            return error_event(ValueError("'tokens' must be a list of token ids (integers)"))
        bad = next((t for t in tokens if not 0 <= t < vocab_size), None)
        if bad is not None:
            return error_event(ValueError(f"token id {bad} is outside the vocabulary [0, {vocab_size})"))
        return {"prompt": self.llm.tokenizer.decode(tokens)}

    async def generate(self, payload: dict[str, Any], routing_keys: list[str] = ()) -> AsyncIterator[dict[str, Any]]:
        """Stream one request's events (see the module docstring).

        Args:
            payload: ``{"messages": OpenAI-style messages`` (or ``"prompt"``: ``/v1/completions``' text,
                token ids, or text and document parts), ``"documents": [[id, text], ...]`` (every
                document the request places), ``"placed": [ids]`` (the ``documents`` field: placed
                before the last user message's text, in the engine's RAG prompt; ``[]``: the
                messages place documents themselves), ``"sampling": body fields``,
                ``"namespace"``, ``"transient": [ids]`` (inline documents the ingress does not
                keep: removed here when the request ends), ``"remedies"`` (optional: the body's),
                ``"logprobs": {"num", "token_ids"}`` (optional: each token's event carries
                OpenAI's logprobs entry)}``.
            routing_keys: for the router only (``lazyattn_rag/serve/router.py``).
        """
        timings = {"replica_received": time.time()}  # wall-clock seconds: where a request's TTFT goes
        try:
            async for event in self._events(payload, timings):
                if "replica_first_event" not in timings:  # once, not a clock read per token
                    timings["replica_first_event"] = time.time()
                if "finish_reason" in event:
                    event["timings"] = timings
                yield event
        finally:
            await self._forget_transient(payload)

    async def _events(self, payload: dict[str, Any], timings: dict[str, float]) -> AsyncIterator[dict[str, Any]]:
        try:
            deltas = self._start(payload)
            timings["replica_submitting"] = time.time()  # parsed; planning and the engine's acceptance follow
            delta = await anext(deltas)  # the engine's checks raise here, before any output
        except REFUSED as error:  # TypeError: what a tokenizer refuses; TemplateError: what a chat template does
            yield error_event(error)
            return
        num_open = payload.get("sampling", {}).get("n", 1)  # answers not finished yet
        try:
            while True:
                if delta.finished:
                    yield {"text": delta.text, "index": delta.index, "finish_reason": delta.finish_reason,
                           "stats": stats_to_body(delta.stats), "replica": self.replica_id}
                    num_open -= 1
                    if num_open == 0:
                        return
                logprobs = self._logprobs(delta, payload.get("logprobs"))
                if not delta.finished and (delta.text or logprobs):
                    yield {"text": delta.text, "index": delta.index} | ({"logprobs": logprobs} if logprobs else {})
                delta = await anext(deltas)
        except Exception as error:  # noqa: BLE001 - a failed step: the caller gets an error event, not a cut
            yield {"error": {"message": f"the answer failed: {type(error).__name__}: {error}",
                             "type": type(error).__name__, "status": 500, "code": None}}

    def _logprobs(self, delta, spec: dict | None) -> dict | None:
        """OpenAI's logprobs entry of ``delta``'s token (``spec``: ``{"num", "token_ids"}`` of the
        request; ``None``: none asked)."""
        if spec is None or delta.logprobs is None or delta.token_id is None:
            return None
        if spec.get("token_ids"):  # vLLM's return_tokens_as_token_ids: "token_id:<id>", no bytes
            return logprob_entry(delta.token_id, delta.logprobs, spec["num"], "token_id:{}".format, with_bytes=False)
        return logprob_entry(delta.token_id, delta.logprobs, spec["num"], self._token_text)

    @functools.lru_cache(maxsize=65536)  # noqa: B019 - one replica object per process, kept for its life
    def _token_text(self, token_id: int) -> str:
        return self.llm.tokenizer.decode([token_id])

    def _request(self, payload: dict[str, Any]) -> tuple[list[Message], list[Document], str | None]:
        """A payload as ``(messages, documents, question)``: the documents (registered with the
        request) and either chat messages that place them, or, for the ``documents`` field
        with no earlier turn, the question of the engine's own RAG prompt (``None`` otherwise).

        Raises:
            ValueError: ``documents`` with a last message that is not the user's plain text, or
                with earlier turns that place documents themselves.
        """
        messages = [as_message(m) for m in payload["messages"]]
        documents = [Document(i, t) for i, t in payload.get("documents", ())]
        self._check_not_deleted([d.id for d in documents], payload.get("namespace", ""), payload.get("issued_at"))
        placed = payload.get("placed", [])
        if not placed:
            return messages, documents, None
        *history, last = messages
        if last.role != "user" or not isinstance(last.content, str):
            raise ValueError("with 'documents', the last message must be the user's question, as plain text")
        if any(not isinstance(m.content, str) for m in history):
            raise ValueError("with 'documents', earlier messages must be plain text (place documents in one way)")
        by_id = {d.id: d for d in documents}
        kept = [by_id[i] for i in placed if by_id[i].text.strip()]  # an empty retrieved text carries nothing
        if not history:
            return [], kept, last.content
        turns = rag_messages(last.content, [d.id for d in kept], [(m.role, m.content) for m in history],
                             self.llm.config.prompt)
        return turns, documents, None

    def _start(self, payload: dict[str, Any]) -> AsyncIterator:
        sampling = sampling_from_body(payload.get("sampling", {}), self.llm.default_sampling)
        namespace, remedies = payload.get("namespace", ""), remedies_from_body(payload.get("remedies"))
        if "prompt" in payload:  # /v1/completions: text, token ids, or text and document parts
            documents = [Document(i, t) for i, t in payload.get("documents", ())]
            self._check_not_deleted([d.id for d in documents], namespace, payload.get("issued_at"))
            prompt = payload["prompt"]
            if isinstance(prompt, list) and prompt and isinstance(prompt[0], dict):
                prompt = list(as_message({"role": "user", "content": prompt}).parts())
            return self.allm.stream_prompt(prompt, sampling, documents, namespace, remedies=remedies)
        messages, documents, question = self._request(payload)
        if question is not None:
            return self.allm.stream(question, documents=documents, sampling=sampling, namespace=namespace,
                                    remedies=remedies)
        return self.allm.stream_chat(messages, documents, sampling, namespace, remedies=remedies)

    def _count(self, payload: dict[str, Any]) -> int:
        """The prompt tokens of ``payload``'s request (its documents registered first)."""
        messages, documents, question = self._request(payload)
        namespace = payload.get("namespace", "")
        self.llm.add_documents(documents, namespace)
        if question is None:
            return self.llm.plan_chat(messages, namespace).num_prompt_tokens
        return self.llm.plan(question, [d.id for d in documents], namespace).num_prompt_tokens

    async def _forget_transient(self, payload: dict[str, Any]) -> None:
        """Drop the request's inline documents the ingress does not keep (``payload["transient"]``):
        a replica's registry holds what the ingress's does, not every document a request carried."""
        namespace = payload.get("namespace", "")

        def unregister(engine, doc_id):  # the id only: its chunk stays in the tiers for the next request carrying it
            if engine.documents.contains(doc_id, namespace):  # else never registered (the request was refused first)
                engine.documents.remove(doc_id, namespace)

        for doc_id in payload.get("transient", ()):
            await _to_thread(self.llm.client.call, unregister, doc_id)

    async def _engine_stats(self) -> dict[str, Any]:
        stats = await self.allm.stats()
        # what the ingress's /metrics shows of each replica (lazyattn_rag/metrics.py's engine stats)
        return {k: stats[k] for k in ENGINE_STAT_KEYS if k in stats}

    def __del__(self):
        llm = getattr(self, "llm", None)
        if llm is not None:
            llm.close()


async def _to_thread(fn, *args):
    return await asyncio.to_thread(fn, *args)


def _replica_id() -> str:
    """This replica's Ray Serve id (``"local"`` outside Ray Serve, e.g. in a unit test)."""
    try:
        from ray import serve

        return serve.get_replica_context().replica_id.unique_id
    except Exception:  # noqa: BLE001 - not inside a replica
        return "local"
