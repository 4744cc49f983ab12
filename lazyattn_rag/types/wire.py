"""The HTTP API's JSON to and from this package's value types (issue 18).

The API is OpenAI's chat completions with a few extension fields (as vLLM adds ``top_k`` and
``repetition_penalty`` beside the standard ones). The server (``lazyattn_rag/serve/``) and the
HTTP client (``lazyattn_rag/remote.py``) both translate through this module, so the two sides
cannot drift apart.

Request fields besides OpenAI's (``model``, ``messages``, ``max_tokens`` /
``max_completion_tokens``, ``temperature``, ``top_p``, ``stop``, ``seed``, ``frequency_penalty``,
``presence_penalty``, ``stream``, ``stream_options``, ``n``):

* ``documents``: document ids (registered with ``POST /v1/documents``) or inline
  ``{"id", "text"}`` objects, placed before the last user message's text in the engine's RAG
  prompt (the earlier turns are the chat history before it); a message's content can also
  place documents itself with ``{"type": "document", "id": ...}`` parts.
* ``namespace``: the documents' namespace (tenant); ``""`` is shared.
* ``document_hashes``: ``{id: text_hash(text)}`` of registered documents the client means: a
  document registered since with another text is answered 409 (``document_changed``), so a
  client that sent a text once never gets an answer over someone else's.
* ``top_k``, ``min_p``, ``repetition_penalty``, ``ignore_eos``, ``stop_token_ids``: as in
  :class:`~lazyattn_rag.types.sampling_params.SamplingParams`.
* ``response_format`` (OpenAI's ``json_object`` / ``json_schema``), ``guided_json``,
  ``guided_regex``, ``guided_choice``, ``guided_grammar`` or ``structured_outputs`` (vLLM's):
  structured output (:class:`~lazyattn_rag.types.structured_output.StructuredOutputParams`).
* ``remedies``: this request's answer-fidelity remedies, the fields of
  :class:`~lazyattn_rag.types.config.RequestRemedies` (``recompute_chunk_head_tokens``,
  ``recompute_selective_ratio``, ``chunk_attention_scaling``); the server's ``CacheConfig``
  for those left out.

Response extension: ``lazyattn`` on the last chunk (and the whole response) holds the request's
stats (:class:`~lazyattn_rag.types.outputs.RequestStats` as a dict) and the replica that served it.
"""

from __future__ import annotations

import hashlib
import json
from collections.abc import Iterable, Mapping
from dataclasses import asdict, fields, replace
from typing import Any

from lazyattn_rag.types.config import RequestRemedies
from lazyattn_rag.types.documents import Document
from lazyattn_rag.types.errors import DocumentChanged, ServerError, UnknownDocumentError
from lazyattn_rag.types.messages import DocumentRef, Message
from lazyattn_rag.types.outputs import Completion, RequestStats, StreamDelta
from lazyattn_rag.types.sampling_params import SamplingParams
from lazyattn_rag.types.structured_output import StructuredOutputParams

# SamplingParams fields and the body keys that carry them (OpenAI's names where it has one)
_SAMPLING_KEYS = {"n": "n", "temperature": "temperature", "top_p": "top_p", "top_k": "top_k", "min_p": "min_p", "stop": "stop",
                  "stop_token_ids": "stop_token_ids", "ignore_eos": "ignore_eos", "seed": "seed",
                  "repetition_penalty": "repetition_penalty", "frequency_penalty": "frequency_penalty",
                  "presence_penalty": "presence_penalty", "strict_max_tokens": "strict_max_tokens",
                  "skip_special_tokens": "skip_special_tokens"}


def sampling_to_body(params: SamplingParams) -> dict[str, Any]:
    """The body fields that make the server sample as ``params`` does (every field, so the
    server's defaults play no part).

    Raises:
        ValueError: ``params.logprobs`` is set (this client does not read log-probabilities), or
            ``params.n > 1``.
    """
    if params.logprobs is not None:
        raise ValueError("logprobs are not returned over HTTP (lazyattn serve); use an in-process LazyAttention")
    if params.n != 1:
        raise ValueError(f"n={params.n}: this client asks for one answer per request; the server's OpenAI "
                         "routes take n (the openai package), or use an in-process LazyAttention")
    body = {key: getattr(params, name) for name, key in _SAMPLING_KEYS.items()}
    body["stop"], body["stop_token_ids"] = list(params.stop), list(params.stop_token_ids)
    body["max_tokens"] = params.max_tokens
    if params.structured_output is not None:
        body |= structured_output_to_body(params.structured_output)
    return body


def structured_output_to_body(params: StructuredOutputParams) -> dict[str, Any]:
    """The OpenAI (``response_format``) or vLLM (``guided_*``) field that asks for ``params``."""
    if params.kind == "json":
        return {"response_format": {"type": "json_schema", "json_schema": {"name": "answer",
                                                                           "schema": json.loads(params.json)}}}
    if params.kind == "json_object":
        return {"response_format": {"type": "json_object"}}
    return {f"guided_{params.kind}": params.to_body()[params.kind]}


def sampling_from_body(body: Mapping[str, Any], default: SamplingParams) -> SamplingParams:
    """The :class:`SamplingParams` a request body asks for; fields it leaves out (or sets to
    ``null``) keep ``default``'s value. ``max_completion_tokens`` (OpenAI's newer name) wins
    over ``max_tokens``.

    Raises:
        ValueError: a value out of range or of the wrong type (the field is named).
    """
    values = {name: body[key] for name, key in _SAMPLING_KEYS.items() if body.get(key) is not None}
    if isinstance(values.get("stop"), list):
        values["stop"] = tuple(values["stop"])
    if isinstance(values.get("stop_token_ids"), list):
        values["stop_token_ids"] = tuple(values["stop_token_ids"])
    max_tokens = body.get("max_completion_tokens", body.get("max_tokens"))
    if max_tokens is not None:
        values["max_tokens"] = max_tokens
    if body.get("logprobs") is not None:  # the server's count (ChatCompletionRequest.num_logprobs)
        values["logprobs"] = body["logprobs"]
    if body.get("structured_output") is not None:  # the server's (GenerationRequest.sampling_body)
        values["structured_output"] = StructuredOutputParams.from_body(body["structured_output"])
    return replace(default, **values)  # validated again by SamplingParams.__post_init__


def remedies_to_body(remedies: RequestRemedies | None) -> dict[str, Any]:
    """``{"remedies": {field: value}}`` of the fields set (``{}``: none set)."""
    chosen = {k: v for k, v in asdict(remedies).items() if v is not None} if remedies is not None else {}
    return {"remedies": chosen} if chosen else {}


def remedies_from_body(body: Mapping[str, Any] | None) -> RequestRemedies:
    """The :class:`RequestRemedies` of a body's ``remedies`` object (``None``: none asked)."""
    return RequestRemedies(**(body or {}))


def message_to_body(message: Message) -> dict[str, Any]:
    """An OpenAI-style message; content with documents becomes a list of text and
    ``{"type": "document", "id": ...}`` parts."""
    if isinstance(message.content, str):
        return {"role": message.role, "content": message.content}
    parts = [({"type": "document", "id": p.id} | ({"matched": True} if p.matched else {}))
             if isinstance(p, DocumentRef) else {"type": "text", "text": p} for p in message.parts()]
    return {"role": message.role, "content": parts}


def document_to_body(document: Document) -> dict[str, str]:
    return {"id": document.id, "text": document.text}


def text_hash(text: str) -> str:
    """A document text's hash for ``document_hashes``: 32 hex digits of its SHA-256."""
    return hashlib.sha256(text.encode()).hexdigest()[:32]


def stats_to_body(stats: RequestStats) -> dict[str, Any]:
    return asdict(stats)


def stats_from_body(body: Mapping[str, Any]) -> RequestStats:
    """A :class:`RequestStats` from :func:`stats_to_body`'s dict (unknown keys ignored: a newer
    server may report more)."""
    names = {f.name for f in fields(RequestStats)}
    return RequestStats(**{k: v for k, v in body.items() if k in names})


def usage(stats: RequestStats) -> dict[str, Any]:
    """OpenAI's ``usage`` object. ``prompt_tokens_details.cached_tokens`` counts every prompt
    token served from cached K/V (as OpenAI's and vLLM's), split beside it into
    ``exact_prefix_tokens`` (reused where they were computed: the prompt's opening, earlier
    turns) and ``shifted_tokens`` (documents and learned passages at new offsets);
    ``recomputed_tokens`` are cached document tokens a fidelity remedy computed again."""
    details = {"cached_tokens": stats.num_cached_tokens, "exact_prefix_tokens": stats.num_exact_prefix_tokens,
               "shifted_tokens": stats.num_shifted_tokens, "recomputed_tokens": stats.num_recomputed_tokens}
    return {"prompt_tokens": stats.num_prompt_tokens, "completion_tokens": stats.num_output_tokens,
            "total_tokens": stats.num_prompt_tokens + stats.num_output_tokens, "prompt_tokens_details": details}


# The engine's refusals as OpenAI-style error codes (``error.code`` of a 4xx body), and back.
ERROR_CODES = {"UnknownDocumentError": "document_not_found", "PromptTooLongError": "context_length_exceeded",
               "DocumentTooLongError": "document_too_long", "EmptyInputError": "empty_input",
               "CacheCapacityError": "cache_capacity_exceeded"}
DOCUMENT_CHANGED = "document_changed"  # 409: a document_hashes entry no longer matches


def error_class(code: str | None) -> type[ValueError]:
    """The exception class the client raises for an error body's ``code`` (``ValueError`` for
    any other 4xx)."""
    from lazyattn_rag.types import errors

    name = {v: k for k, v in ERROR_CODES.items()}.get(code or "")
    return getattr(errors, name) if name else ValueError


def logprob_entry(token_id: int, logprobs: Mapping[int, float], num: int, token_text,
                  with_bytes: bool = True) -> dict[str, Any]:
    """OpenAI's ``logprobs.content`` entry of one generated token: ``{"token", "logprob",
    "bytes", "top_logprobs": [{"token", "logprob", "bytes"}]}`` with the ``num`` most likely
    tokens (``-1``: all, most likely first). ``logprobs`` is the engine's
    (:attr:`~lazyattn_rag.types.outputs.StreamDelta.logprobs`: a dict, or the whole vocabulary's
    ``VocabLogprobs``, sorted as a tensor); ``token_text(id)`` names a token; ``with_bytes=False``
    gives ``"bytes": null`` (tokens named by id carry no text)."""
    if isinstance(logprobs, dict):
        top = sorted(logprobs.items(), key=lambda kv: -kv[1])
        top = top if num == -1 else top[:num]
        ids, values, chosen = [i for i, _ in top], [v for _, v in top], logprobs[token_id]
    else:
        values_t, order = logprobs.tensor.sort(descending=True)
        keep = len(order) if num == -1 else num
        ids, values, chosen = order[:keep].tolist(), values_t[:keep].tolist(), float(logprobs.tensor[token_id])
    names = [token_text(i) for i in ids]
    encode = (lambda t: list(t.encode("utf-8", errors="replace"))) if with_bytes else (lambda t: None)
    chosen_text = token_text(token_id)
    return {"token": chosen_text, "logprob": float(chosen), "bytes": encode(chosen_text),
            "top_logprobs": [{"token": t, "logprob": v, "bytes": encode(t)} for t, v in zip(names, values)]}


# --- the client side: a response's status and streamed answer back to value types -----------------
def raise_for_status(status: int, content: bytes) -> None:
    """Raise for a non-2xx response: ``PermissionError`` for 401/403 (no key, a wrong key, a
    namespace or an action the key does not allow), this package's exception for the body's
    ``code`` (other 4xx) or :class:`ServerError` (5xx)."""
    if status < 300:
        return
    try:
        error = json.loads(content)["error"]
        message, code = error.get("message", ""), error.get("code")
    except (ValueError, KeyError, TypeError):
        message, code = content.decode(errors="replace")[:500], None
    if status >= 500:
        raise ServerError(f"server error {status}: {message}", status)
    if status in (401, 403):
        raise PermissionError(f"{status}: {message}")
    if code == "document_not_found":
        raise UnknownDocumentError(message)
    if code == DOCUMENT_CHANGED:
        raise DocumentChanged(message)
    raise error_class(code)(message)


def chunk_deltas(chunk: Mapping[str, Any]) -> list[StreamDelta]:
    """The deltas of one streamed ``chat.completion.chunk`` (as JSON; the usage chunk has none).

    Raises:
        ServerError: the chunk is an error event.
    """
    if chunk.get("error"):
        raise ServerError(f"the answer failed on the server: {chunk['error'].get('message')}")
    if not chunk.get("choices"):
        return []  # the usage chunk
    choice = chunk["choices"][0]
    text, reason = choice.get("delta", {}).get("content") or "", choice.get("finish_reason")
    if reason is None:
        return [StreamDelta(text)] if text else []
    stats = stats_from_body(chunk["lazyattn"]["stats"])
    return [StreamDelta(text, finished=True, finish_reason=reason, stats=stats)]


def collect_deltas(deltas: Iterable[StreamDelta]) -> Completion:
    """One answer's deltas joined (raises :class:`ServerError` if they end before it finished)."""
    parts, last = [], None
    for delta in deltas:
        parts.append(delta.text)
        last = delta
    if last is None or not last.finished:
        raise ServerError("the answer ended before it finished")
    return Completion("".join(parts), [], last.finish_reason, last.stats)
