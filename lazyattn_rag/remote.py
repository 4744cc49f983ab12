"""``RemoteLazyAttention``: the :class:`~lazyattn_rag.llm.LazyAttention` API over a ``lazyattn serve``
server (issue 18), so the same idioms run against one local engine or a cluster.

The framework wrappers take it wherever they take an engine (``LazyAttentionLLM(remote)``,
``ChatLazyAttention(engine=remote)``) or build it from a URL (``server_url=``). Documents are
sent once: the client registers a document's text the first time a call places it (and again
only when its text changes or the server no longer knows it), then places documents by id.

Example::

    llm = RemoteLazyAttention("http://127.0.0.1:8000")
    llm.add_document("eiffel", "The Eiffel Tower ... completed in 1889.")
    print(llm.generate("When was it completed?", doc_ids=["eiffel"]).text)

Answers come through the ``openai`` package (``lazyattn_rag/remote_openai.py``: transport
retries with backoff, one pooled async client per event loop); the document and tokenizer
routes through httpx. Token ids are not sent over HTTP (``Completion.token_ids`` is empty).
Errors the server reports come back as this package's exceptions (``UnknownDocumentError``,
``PromptTooLongError``, ... from the error body's ``code``; other 4xx as ``ValueError``); a
server that cannot be reached or answers 5xx raises :class:`ServerError`.
"""

from __future__ import annotations

from collections.abc import AsyncIterator, Iterable, Iterator
from dataclasses import dataclass
from typing import Any
from urllib.parse import quote

from lazyattn_rag.types.config import PromptConfig, RequestRemedies
from lazyattn_rag.types.documents import Document, RemovedDocument
from lazyattn_rag.types.messages import Message, as_message
from lazyattn_rag.types.outputs import Completion, StreamDelta
from lazyattn_rag.types.sampling_params import SamplingParams
from lazyattn_rag.types.errors import DocumentChanged, ServerError
from lazyattn_rag.remote_openai import ChatRoutes, openai_errors
from lazyattn_rag.types.wire import (chunk_deltas, collect_deltas as _collect, document_to_body, message_to_body,
                                    raise_for_status, remedies_to_body, sampling_to_body, text_hash)

__all__ = ["AsyncRemoteLazyAttention", "DocumentChanged", "PromptCount", "RemoteConfig", "RemoteLazyAttention",
           "RemoteStream", "RemoteTokenizer", "ServerError", "raise_for_status"]


@dataclass(frozen=True)
class RemoteConfig:
    """What a client needs of the server's engine configuration: its prompt settings."""

    prompt: PromptConfig


@dataclass(frozen=True)
class PromptCount:
    num_prompt_tokens: int


class RemoteTokenizer:
    """The server model's tokenizer through ``POST /tokenize`` (one request per call), for
    ``Settings.tokenizer`` and token counting; called like a Hugging Face tokenizer."""

    def __init__(self, client: RemoteLazyAttention):
        self.client = client

    def __call__(self, text: str, add_special_tokens: bool = True, **_: Any) -> dict[str, list[int]]:
        return {"input_ids": self.encode(text, add_special_tokens)}

    def encode(self, text: str, add_special_tokens: bool = True, **_: Any) -> list[int]:
        return self.client._post("/tokenize", {"prompt": text, "add_special_tokens": add_special_tokens})["tokens"]


class _Running:
    """``loop.stopped`` as the wrappers read it of an in-process engine."""

    stopped = False


class RemoteLazyAttention:
    """A ``lazyattn serve`` server as an engine (see the module docstring).

    Args:
        base_url: the server, e.g. ``"http://127.0.0.1:8000"``.
        timeout_s: seconds to wait for a response (or the next streamed piece).
        headers: extra HTTP headers (e.g. an ``Authorization`` for a proxy in front).
        api_key: the server's API key (``lazyattn serve --api-key``), sent as
            ``Authorization: Bearer <key>``; it also decides the namespace (see
            ``lazyattn_rag/serve/auth.py``).
        max_retries: transport retries of an answer's request (connection errors, 408, 429,
            5xx), with exponential backoff (the ``openai`` package's).
    Raises:
        ServerError: the server does not answer ``GET /v1/models``.
    """

    is_remote = True

    def __init__(self, base_url: str, timeout_s: float = 600.0, headers: dict[str, str] | None = None,
                 api_key: str | None = None, max_retries: int = 2):
        import httpx

        headers = {**(headers or {}), **({"Authorization": f"Bearer {api_key}"} if api_key else {})} or None
        self.base_url = base_url.rstrip("/")
        self.http = httpx.Client(base_url=self.base_url, timeout=timeout_s, headers=headers)
        info = self._get("/v1/models")
        self.model_name, self.max_model_len = info["data"][0]["id"], info["lazyattn"]["max_model_len"]
        self.chat_routes = ChatRoutes(self.base_url, self.model_name, api_key, timeout_s, headers, max_retries)
        self.config = RemoteConfig(PromptConfig(**info["lazyattn"]["prompt"]))
        self.tokenizer = RemoteTokenizer(self)
        self.default_sampling: SamplingParams | None = None  # None: the server model's own
        self.loop = _Running()
        self._sent: dict[tuple[str, str], str] = {}  # (namespace, id) -> the text this client registered

    # --- documents -----------------------------------------------------------------------
    def add_document(self, doc_id: str, text: str, namespace: str = "") -> bool:
        return self.add_documents([Document(doc_id, text)], namespace) == 1

    def add_documents(self, documents: Iterable[Document | tuple[str, str]], namespace: str = "") -> int:
        """Register documents on the server (all or none); returns how many were sent."""
        docs = [d if isinstance(d, Document) else Document(*d) for d in documents]
        if not docs:
            return 0
        self._post("/v1/documents", {"documents": [document_to_body(d) for d in docs], "namespace": namespace})
        for d in docs:
            self._sent[(namespace, d.id)] = d.text
        return len(docs)

    def remove_document(self, doc_id: str, namespace: str = "") -> RemovedDocument:
        """Delete a document on the server, from every replica and storage tier; what was
        removed, summed over the replicas."""
        path = quote(doc_id, safe="").replace(".", "%2E")  # "." and ".." are path segments an HTTP client folds
        body = self._request("DELETE", f"/v1/documents/{path}", params={"namespace": namespace})
        self._sent.pop((namespace, doc_id), None)
        removed = body.get("removed", {})
        return RemovedDocument(doc_id, body.get("namespace", namespace), removed.get("num_kv_blocks", 0),
                               removed.get("num_in_use", 0), tuple(removed.get("tiers", ())),
                               removed.get("shared", False))

    def document_ids(self, namespace: str = "") -> list[str]:
        return [d["id"] for d in self._get("/v1/documents", namespace=namespace)["data"]]

    def has_document(self, doc_id: str, namespace: str = "") -> bool:
        return doc_id in self.document_ids(namespace)

    def document_texts(self, doc_ids: Iterable[str] | None = None, namespace: str = "") -> dict[str, str]:
        params = {"namespace": namespace, "texts": "true"}
        if doc_ids is not None:  # only those (GET /v1/documents?id=a&id=b), not the namespace's every text
            params["id"] = list(doc_ids)
            if not params["id"]:
                return {}
        return {d["id"]: d["text"] for d in self._get("/v1/documents", **params)["data"]}

    @property
    def documents_version(self) -> int:
        """Changes whenever the server's documents do (the prompt matcher re-reads them then)."""
        return self._get("/v1/documents/version")["version"]

    def warm(self, doc_ids: Iterable[str], namespace: str = "") -> list[str]:
        return self._post("/v1/documents/warm", {"ids": list(doc_ids), "namespace": namespace})["computed"]

    def plan_chat(self, messages: Iterable[Message | dict | tuple], namespace: str = "") -> PromptCount:
        """The prompt length the server's engine would build for ``messages`` (``num_prompt_tokens``)."""
        body = {"messages": [message_to_body(as_message(m)) for m in messages], "namespace": namespace}
        return PromptCount(self._post("/tokenize", body)["count"])

    # --- generation ----------------------------------------------------------------------
    def stream(self, question: str, doc_ids: Iterable[str] = (), documents: Iterable[Document] = (),
               sampling: SamplingParams | None = None, namespace: str = "", *,
               remedies: RequestRemedies | None = None) -> RemoteStream:
        """As :meth:`LazyAttention.stream`: the answer to ``question`` over the documents, in order
        (``remedies`` go to the server, which checks them: a bad one is ``ValueError``)."""
        documents = list(documents)
        return RemoteStream(self, self._question_body(question, doc_ids, documents, sampling, namespace, remedies),
                            lambda: self.add_documents(documents, namespace))

    def generate(self, question: str, doc_ids: Iterable[str] = (), documents: Iterable[Document] = (),
                 sampling: SamplingParams | None = None, namespace: str = "", *,
                 remedies: RequestRemedies | None = None) -> Completion:
        return _collect(self.stream(question, doc_ids, documents, sampling, namespace, remedies=remedies))

    def stream_chat(self, messages: Iterable[Message | dict | tuple], documents: Iterable[Document] = (),
                    sampling: SamplingParams | None = None, namespace: str = "", *,
                    remedies: RequestRemedies | None = None) -> RemoteStream:
        """As :meth:`LazyAttention.stream_chat`: messages whose content places documents by id."""
        documents = list(documents)
        return RemoteStream(self, self._chat_body(messages, documents, sampling, namespace, remedies),
                            lambda: self.add_documents(documents, namespace))

    def chat(self, messages: Iterable[Message | dict | tuple], documents: Iterable[Document] = (),
             sampling: SamplingParams | None = None, namespace: str = "", *,
             remedies: RequestRemedies | None = None) -> Completion:
        return _collect(self.stream_chat(messages, documents, sampling, namespace, remedies=remedies))

    def aio(self) -> AsyncRemoteLazyAttention:
        """The asyncio twin of :meth:`stream` and :meth:`stream_chat` (the wrappers' async paths)."""
        return AsyncRemoteLazyAttention(self)

    def close(self) -> None:
        self.http.close()
        self.chat_routes.close()

    def __enter__(self):
        return self

    def __exit__(self, *exc):
        self.close()

    # --- bodies and HTTP -----------------------------------------------------------------
    def _question_body(self, question, doc_ids, documents, sampling, namespace, remedies=None) -> dict[str, Any]:
        inline = list(documents)
        self._send(inline, namespace)
        return {"messages": [{"role": "user", "content": question}], "documents": [*doc_ids, *(d.id for d in inline)],
                **self._sampling(sampling), "namespace": namespace, "stream": True, **_hashes(inline),
                **remedies_to_body(remedies)}

    def _chat_body(self, messages, documents, sampling, namespace, remedies=None) -> dict[str, Any]:
        inline = list(documents)
        self._send(inline, namespace)
        return {"messages": [message_to_body(as_message(m)) for m in messages], **self._sampling(sampling),
                "namespace": namespace, "stream": True, **_hashes(inline), **remedies_to_body(remedies)}

    def _sampling(self, sampling: SamplingParams | None) -> dict[str, Any]:
        sampling = sampling or self.default_sampling
        return sampling_to_body(sampling) if sampling is not None else {}

    def _send(self, documents: list[Document], namespace: str) -> None:
        """Register the documents the server does not have with this text yet."""
        new = [d for d in documents if self._sent.get((namespace, d.id)) != d.text]
        if new:
            self.add_documents(new, namespace)

    def _resend(self, namespace: str) -> bool:
        """Register again every document this client sent in ``namespace`` (after the server
        answered 404 for one); ``False`` when there is none to send."""
        documents = [Document(i, t) for (ns, i), t in self._sent.items() if ns == namespace]
        return bool(documents) and self.add_documents(documents, namespace) > 0

    def _get(self, path: str, **params: Any) -> dict[str, Any]:
        return self._request("GET", path, params=params or None)

    def _post(self, path: str, body: dict[str, Any]) -> dict[str, Any]:
        return self._request("POST", path, json=body)

    def _request(self, method: str, path: str, **kwargs: Any) -> dict[str, Any]:
        import httpx

        try:
            response = self.http.request(method, path, **kwargs)
        except httpx.HTTPError as error:
            raise ServerError(f"{method} {self.base_url}{path}: {error}") from error
        raise_for_status(response.status_code, response.content)
        return response.json()


def _hashes(documents: list[Document]) -> dict[str, Any]:
    return {"document_hashes": {d.id: text_hash(d.text) for d in documents}} if documents else {}


class RemoteStream:
    """The deltas of one streamed answer (a sync iterator of :class:`StreamDelta`); the request
    is sent, and refused with an exception, at construction. ``close()`` cancels it.

    A 404 for a document this client registered (the server restarted) or a 409 for one
    registered since with another text sends the documents again (``resend``) and retries once."""

    def __init__(self, client: RemoteLazyAttention, body: dict[str, Any], resend=None):
        from lazyattn_rag.types.errors import UnknownDocumentError

        self._client = client
        try:
            self._stream = client.chat_routes.stream(body)
        except UnknownDocumentError:  # a restarted server lost what this client registered
            if not (client._resend(body.get("namespace", "")) or (resend is not None and resend())):
                raise
            self._stream = client.chat_routes.stream(body)
        except DocumentChanged:  # registered since with another text: this call's texts again
            if resend is None or not resend():
                raise
            self._stream = client.chat_routes.stream(body)
        self._deltas = self._iterate()

    def _iterate(self) -> Iterator[StreamDelta]:
        with openai_errors(self._client.chat_routes.what):
            for chunk in self._stream:
                yield from chunk_deltas(chunk.model_dump())

    def __iter__(self) -> Iterator[StreamDelta]:
        return self

    def __next__(self) -> StreamDelta:
        try:
            return next(self._deltas)
        except StopIteration:
            self.close()
            raise

    def close(self) -> None:
        self._stream.close()


class AsyncRemoteLazyAttention:
    """``stream`` / ``stream_chat`` of a :class:`RemoteLazyAttention` as async iterators (and
    ``generate`` / ``chat`` collecting them); leaving a stream early closes its connection, which
    cancels the request on the server."""

    def __init__(self, client: RemoteLazyAttention):
        self.client = client

    def stream(self, question: str, doc_ids: Iterable[str] = (), documents: Iterable[Document] = (),
               sampling: SamplingParams | None = None, namespace: str = "", *,
               remedies: RequestRemedies | None = None) -> AsyncIterator[StreamDelta]:
        docs = list(documents)
        return self._stream(lambda: self.client._question_body(question, doc_ids, docs, sampling, namespace,
                                                               remedies), docs, namespace)

    def stream_chat(self, messages: Iterable[Message | dict | tuple], documents: Iterable[Document] = (),
                    sampling: SamplingParams | None = None, namespace: str = "", *,
                    remedies: RequestRemedies | None = None) -> AsyncIterator[StreamDelta]:
        docs = list(documents)
        return self._stream(lambda: self.client._chat_body(list(messages), docs, sampling, namespace, remedies),
                            docs, namespace)

    async def generate(self, question: str, doc_ids: Iterable[str] = (), documents: Iterable[Document] = (),
                       sampling: SamplingParams | None = None, namespace: str = "", *,
                       remedies: RequestRemedies | None = None) -> Completion:
        return await _acollect(self.stream(question, doc_ids, documents, sampling, namespace, remedies=remedies))

    async def chat(self, messages: Iterable[Message | dict | tuple], documents: Iterable[Document] = (),
                   sampling: SamplingParams | None = None, namespace: str = "", *,
                   remedies: RequestRemedies | None = None) -> Completion:
        return await _acollect(self.stream_chat(messages, documents, sampling, namespace, remedies=remedies))

    async def _stream(self, make_body, documents: list[Document], namespace: str) -> AsyncIterator[StreamDelta]:
        import asyncio

        from lazyattn_rag.types.errors import UnknownDocumentError

        body = await asyncio.to_thread(make_body)  # registering documents is a (sync) request
        routes = self.client.chat_routes
        for attempt in (1, 2):  # a 404 or 409 for documents this client sent: send them again, once
            try:
                stream = await routes.astream(body)
            except (UnknownDocumentError, DocumentChanged) as error:
                lost = isinstance(error, UnknownDocumentError)
                sent = attempt == 1 and await asyncio.to_thread(
                    lambda: (lost and self.client._resend(namespace)) or self.client.add_documents(documents, namespace))
                if not sent:
                    raise
                continue
            try:
                with openai_errors(routes.what):
                    async for chunk in stream:
                        for delta in chunk_deltas(chunk.model_dump()):
                            yield delta
                return
            finally:  # also when the caller leaves early: the server cancels the request
                await stream.close()


async def _acollect(deltas: AsyncIterator[StreamDelta]) -> Completion:
    return _collect([delta async for delta in deltas])
