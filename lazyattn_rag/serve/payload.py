"""What the ingress sends an engine replica for a chat request, and where (issue 36).

A request that names documents (the ``documents`` field, ``{"type": "document"}`` parts) is
sent as it is. A request that names none (an unchanged OpenAI client, LangChain ``ChatOpenAI``,
LlamaIndex ``OpenAILike``: the retrieved texts pasted into the messages) has its messages
matched against the namespace's registered documents (``engine/planning/prompt_match.py``, the matcher
the framework wrappers use in process): every registered text found whole becomes a document
part (``matched``), so the replica places it from its cached K/V and computes the text around
it. The router (``router.py``) hashes each document's namespace and id, and each passage of the
plain text the engine may learn (``engine/planning/passage_learning.py``), so a request goes where its
documents and passages were computed before. Also here: the request checks that need the
server's configuration (``check_logprobs``) and the summary of a delete's replica reports.
"""

import time
from typing import Any

from lazyattn_rag.engine.planning.passage_learning import eligible_pieces
from lazyattn_rag.engine.planning.prompt_match import resolve, split_message
from lazyattn_rag.serve.http_errors import ApiError
from lazyattn_rag.serve.protocol import ChatCompletionRequest, CompletionRequest, GenerationRequest
from lazyattn_rag.serve.registry import DocumentStore
from lazyattn_rag.types.messages import DocumentRef, Message, as_message
from lazyattn_rag.types.wire import DOCUMENT_CHANGED, message_to_body, text_hash


def routing_keys(namespace: str, doc_ids) -> list[str]:
    """What the router hashes: each distinct document's namespace and id."""
    return [f"{namespace}\x00{i}" for i in dict.fromkeys(doc_ids)]


def registered_text(store: DocumentStore, namespace: str, doc_id: str) -> str:
    """A registered document's text. Raises :class:`ApiError` 404 naming an unknown id."""
    text = store.get(namespace, doc_id)
    if text is None:
        where = f" in namespace {namespace!r}" if namespace else ""
        raise ApiError(404, f"unknown document id {doc_id!r}{where}: register it with POST /v1/documents",
                       kind="not_found_error", param="documents", code="document_not_found")
    return text


def match_messages(messages: list[dict[str, Any]], store: DocumentStore, namespace: str
                   ) -> tuple[list[dict[str, Any]], list[str]]:
    """Wire messages with every registered document of ``namespace`` found in their text as a
    ``{"type": "document", "id", "matched": true}`` part, and the ids found (in prompt order,
    repeats kept)."""
    matcher = store.matcher(namespace)
    if not matcher.num_candidates:
        return messages, []
    out, found_ids = [], []
    for wire in messages:
        message = as_message(wire)
        parts = []
        for part in message.parts():
            if isinstance(part, DocumentRef):
                parts.append(part)
                continue
            found = resolve(matcher.occurrences(part)[0])
            parts += split_message(part, found) if found else [part]
        matched = [p.id for p in parts if isinstance(p, DocumentRef) and p.matched]
        found_ids += matched
        out.append(message_to_body(Message(message.role, tuple(parts))) if matched else wire)
    return out, found_ids


def _documents_field(body: GenerationRequest, store: DocumentStore) -> tuple[list[str], dict[str, str], list[str]]:
    """The ``documents`` field as ``(placed ids, {id: text}, transient ids)``: registered ids and
    inline documents (kept for this request only when the registry does not know them)."""
    ns, placed, texts, transient = body.namespace, [], {}, []
    for d in body.documents:
        if isinstance(d, str):
            texts.setdefault(d, registered_text(store, ns, d))
            placed.append(d)
            continue
        registered = store.get(ns, d.id)
        if registered is not None and registered != d.text or texts.get(d.id, d.text) != d.text:
            raise ApiError(400, f"document id {d.id!r} is given with two different texts (inline and registered, or "
                                "twice inline): give the inline text another id, or register it first",
                           param="documents")
        if registered is None and d.id not in transient:
            transient.append(d.id)
        texts[d.id] = d.text
        placed.append(d.id)
    return placed, texts, transient


def _payload(body: GenerationRequest, request: dict[str, Any], texts: dict[str, str], placed: list[str],
             transient: list[str]) -> dict[str, Any]:
    """The replica's payload: ``request`` (the messages or the prompt) with the documents, sampling,
    namespace and remedies. Raises :class:`ApiError` 409 for a ``document_hashes`` entry
    registered since with another text."""
    changed = [i for i, h in body.document_hashes.items() if i in texts and text_hash(texts[i]) != h]
    if changed:
        raise ApiError(409, f"documents registered since with other texts: {', '.join(map(repr, changed))} (register "
                            "yours again)", kind="invalid_request_error", param="document_hashes",
                       code=DOCUMENT_CHANGED)
    payload = request | {"documents": list(texts.items()), "placed": placed, "sampling": body.sampling_body(),
                         "namespace": body.namespace, "transient": transient,
                         "issued_at": time.time()}  # a replica refuses documents deleted after this (EngineReplica)
    if body.remedies is not None:
        payload["remedies"] = body.remedies.model_dump(exclude_none=True)
    if body.num_logprobs is not None:
        payload["logprobs"] = {"num": body.num_logprobs, "token_ids": body.return_tokens_as_token_ids}
    return payload


def chat_payload(body: ChatCompletionRequest, store: DocumentStore,
                 passage_min_chars: int | None = None) -> tuple[dict[str, Any], list[str]]:
    """The replica's payload for ``body`` (``EngineReplica.generate``) and its routing keys.

    Args:
        body: the request.
        store: the registered documents (caught up with the registry first).
        passage_min_chars: with passage learning on, the shortest piece of plain text whose key
            routes the request (``None``: passages do not route).
    Raises:
        ApiError: 404 for a document id neither registered nor given inline; 400 for an id given
            with two texts; 409 for a ``document_hashes`` entry registered since with another text.
    """
    store.sync()
    placed, texts, transient = _documents_field(body, store)
    ns = body.namespace
    messages = [m.as_wire() for m in body.messages]
    if not body.documents and not any(m.document_ids() for m in body.messages):
        messages, _ = match_messages(messages, store, ns)
    _add_part_texts(messages, texts, store, ns)
    payload = _payload(body, {"messages": messages}, texts, placed, transient)
    keys = routing_keys(ns, texts)
    if passage_min_chars is not None and not placed:
        pieces = eligible_pieces([as_message(m) for m in messages], ns, passage_min_chars)
        keys += [f"passage\x00{key}" for key in dict.fromkeys(p[2] for p in pieces)]
    return payload, keys


def completion_payload(body: CompletionRequest, store: DocumentStore) -> tuple[dict[str, Any], list[str]]:
    """The replica's payload for a ``/v1/completions`` request and its routing keys: the prompt
    as text and ``{"type": "document"}`` parts (the ``documents`` field's before its text; a text
    prompt that names none has the registered documents found in it), or as token ids.

    Raises:
        ApiError: as :func:`chat_payload`.
    """
    store.sync()
    placed, texts, transient = _documents_field(body, store)
    prompt = body.prompt_value
    if isinstance(prompt, str):  # as one user message's content: the chat route's matching and parts
        wire = [message_to_body(Message("user", (*[DocumentRef(i) for i in placed], prompt)))] if placed \
            else match_messages([{"role": "user", "content": prompt}], store, body.namespace)[0]
        _add_part_texts(wire, texts, store, body.namespace)
        prompt = wire[0]["content"]
    elif placed:
        raise ApiError(400, "'documents' needs a text prompt (token ids cannot place documents)", param="documents")
    payload = _payload(body, {"prompt": prompt}, texts, placed, transient)
    return payload, routing_keys(body.namespace, texts)


def _add_part_texts(messages: list[dict[str, Any]], texts: dict[str, str], store: DocumentStore, ns: str) -> None:
    """Every document part's text into ``texts`` (a registered id's; 404 naming an unknown one)."""
    for message in messages:
        for part in message["content"] if isinstance(message["content"], list) else ():
            if part.get("type") == "document":
                texts.setdefault(part["id"], texts.get(part["id"]) or registered_text(store, ns, part["id"]))


def removed_report(reports: list[dict], kept: bool) -> dict:
    """What a delete removed, over every replica's ``EngineReplica.forget`` report: blocks freed
    (now and once running requests finished), the tiers cleaned, whether any replica still
    caches it (requests still running past the wait), and whether the K/V was kept for another
    document with the same text."""
    return {"num_kv_blocks": sum(r.get("num_kv_blocks", 0) for r in reports),
            "num_in_use": sum(r.get("num_in_use", 0) for r in reports),
            "tiers": sorted({t for r in reports for t in r.get("tiers", ())}),
            "cached_on": [r["replica"] for r in reports if r.get("cached")],
            "num_failed_replicas": sum("error" in r for r in reports),
            "shared": kept or any(r.get("shared") for r in reports)}


def check_logprobs(body, max_logprobs: int, field: str = "top_logprobs") -> None:
    """400 for ``field`` (chat's ``top_logprobs``, completions' ``logprobs``) past
    ``ServeConfig.max_logprobs`` (``-1`` only where it is ``-1``)."""
    asked = body.num_logprobs
    if asked is None or max_logprobs == -1:
        return
    if asked == -1 or asked > max_logprobs:
        raise ApiError(400, f"{field}={asked} is more than this server returns (at most {max_logprobs}; "
                            "lazyattn serve --max-logprobs)", param=field)
