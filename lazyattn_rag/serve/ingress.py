"""The HTTP API: a FastAPI ingress deployment in front of the engine replicas (issue 18).

Routes (OpenAI's shapes where OpenAI has the route; errors are OpenAI's
``{"error": {"message", "type", "param", "code"}}`` with the HTTP status):

* ``POST /v1/chat/completions``: ``lazyattn_rag/types/wire.py`` lists the extension fields
  (``documents``, ``namespace``...); ``stream: true`` answers with server-sent events, the last
  chunk carrying ``lazyattn`` (stats, replica, timings) and, with ``stream_options.include_usage``, a
  usage chunk; ``usage.prompt_tokens_details.cached_tokens`` counts prompt tokens served from
  cached K/V.
* ``POST /v1/completions``: OpenAI's completions (``CompletionRequest``): the prompt is text in
  the caller's own template (no chat template), or token ids; the same extension fields (the
  ``documents`` field's documents placed before the prompt's text; a text prompt naming none has
  the registered documents found in it) and streaming; its exact prefix is cached.
* ``POST /v1/documents`` ``{"documents": [{"id", "text"}], "namespace"}``: checked and
  registered on a replica, then kept in the registry (``registry.py``: Redis or a SQLite file,
  so a restarted ingress, or a second one, knows them); ``GET /v1/documents`` lists them
  (``?texts=true`` with their texts, ``?id=a&id=b`` only those ids); ``DELETE /v1/documents/{id}`` removes the document from
  the registry, then its K/V from every replica's KV pool and from the host, disk and Redis
  tiers (``EngineReplica.forget`` on each replica), and answers what was removed.
* ``POST /tokenize`` (vLLM's shape: ``prompt`` or ``messages``), ``POST /detokenize``
  (``{"tokens"}`` -> ``{"prompt"}``), ``GET /version``, ``GET /v1/models``,
  ``GET /health`` (503 unless an engine replica answers), ``GET /metrics`` (Prometheus: requests
  by route and status, and each replica's engine stats as of its last finished request).

Every route but ``/health`` passes the gate of ``auth.py`` first: with keys configured, a
request without a valid ``Authorization: Bearer <key>`` is 401, and its namespace is the key's
(the request's ``namespace`` field or parameter may pick another of the key's namespaces; any
other is 403); registering, warming and deleting documents need a key that may manage them.

A chat request that names no document has the registered documents found in its plain text
(``payload.py``); every request carries the texts of the documents it places, so any engine
replica can serve it, and the router sends it where its documents and passages were computed.
A replica that dies before a
request has sent any output is retried once on another (the router no longer offers the dead
one); one that dies mid-stream ends the stream with an ``error`` event. Unknown document ids
are 404 naming the id; bodies over ``ServeConfig.max_body_bytes`` 413; bad JSON, bad fields
and values the engine refuses 400: the server keeps serving.
"""

import asyncio
import json  # no `from __future__ import annotations`: the routes' annotations must be objects, since Ray
# pickles the ingress class by value and FastAPI could not resolve a string such as "Request" there
import logging
import time
from collections import Counter
from collections.abc import AsyncIterator
from typing import Annotated, Any

from fastapi import FastAPI, Query, Request  # at module level: FastAPI resolves the routes' annotations here
from fastapi.responses import PlainTextResponse, StreamingResponse

from lazyattn_rag.serve.answer import Answer, answers_usage
from lazyattn_rag.serve.auth import ANY_NAMESPACE, Authenticator, KeyGrant, load_grants
from lazyattn_rag.serve.config import ServeConfig
from lazyattn_rag.serve.http_errors import ApiError, install_error_handlers, parse, read_json
from lazyattn_rag.serve.ingress_metrics import IngressMetrics
from lazyattn_rag.serve.middleware import install_middlewares
from lazyattn_rag.serve.payload import (chat_payload, check_logprobs, completion_payload, registered_text,
                                        removed_report, routing_keys)
from lazyattn_rag.serve.protocol import (ChatCompletionRequest, CompletionRequest, DetokenizeRequest, DocumentsRequest,
                                         TokenizeRequest)
from lazyattn_rag.serve.registry import DocumentStore, RegistryUnavailable, open_registry
from lazyattn_rag.types.config import EngineConfig

logger = logging.getLogger("lazyattn_rag.serve")
METRICS_TIMEOUT_S = 5.0  # GET /metrics: how long the replicas have to report (those that do not are left out)


def _replica_gone_errors() -> tuple[type[BaseException], ...]:
    from ray.exceptions import ActorUnavailableError, RayActorError

    return RayActorError, ActorUnavailableError


def make_ingress(config: ServeConfig, engine_config: EngineConfig | None = None):
    """The ingress deployment class (undecorated by ``serve.deployment``) over a FastAPI app;
    ``engine_config`` (the replicas', when known) locates the registry and says whether
    passages are learned (their keys then route requests)."""
    cache = (engine_config or EngineConfig()).cache
    passage_min_chars = cache.passage_min_tokens if cache.learn_passages and cache.mode == "lazy" else None
    from ray import serve

    import lazyattn_rag

    app = FastAPI(title="lazyattn-rag", version=lazyattn_rag.__version__)
    gate = Authenticator(load_grants(config.api_keys, config.api_key_file), config.allow_unauthenticated)

    install_error_handlers(app)
    install_middlewares(app, gate, config)

    @serve.ingress(app)
    class Ingress:
        """Routes of the module docstring over ``engine``, a handle to the engine replicas."""

        def __init__(self, engine):
            from lazyattn_rag.serve.loopback import bind_replica_server_to_loopback

            bind_replica_server_to_loopback()
            self.engine = engine
            self.documents = DocumentStore(open_registry(config, engine_config))
            self.replica_stats: dict[str, dict] = {}
            self.replica_requests: Counter[str] = Counter()
            self.num_retries = 0
            self._info: dict[str, Any] | None = None
            self.created = int(time.time())  # the models' "created": when this server started

        @app.get("/version")
        async def version(self) -> dict:
            return {"version": lazyattn_rag.__version__}

        @app.post("/detokenize")
        async def detokenize(self, request: Request):
            body = parse(DetokenizeRequest, await read_json(request, config.max_body_bytes))
            result = await self.engine.detokenize.remote(body.tokens)
            _raise_for(result)
            return result

        async def info(self) -> dict[str, Any]:
            """The replicas' model facts, ``model`` the served name (``ServeConfig.served_model_name``)."""
            if self._info is None:
                info = await self.engine.info.remote()
                self._info = info | {"model": config.served_model_name or info["model"]}
            return self._info

        @app.api_route("/health", methods=["GET", "HEAD"])  # HEAD: what some health checkers send
        async def health(self) -> dict:
            """200 when an engine replica answers within ``ServeConfig.health_timeout_s``, else 503;
            a document registry that cannot be reached is named (``registry``), still 200 (its
            last contents are served; registering and deleting answer 503 meanwhile)."""
            try:
                await asyncio.wait_for(self.engine.info.remote(), config.health_timeout_s)
            except Exception as error:  # noqa: BLE001 - none answers (dead, starting, or the call failed)
                raise ApiError(503, f"no engine replica answered within {config.health_timeout_s:g} s "
                                    f"({type(error).__name__})", kind="server_error", code="replica_unavailable") from None
            self.documents.sync()  # on the event loop as every route's (the mirror is not thread-safe)
            if self.documents.unavailable is not None:
                return {"status": "degraded", "registry": f"unreachable: {self.documents.unavailable}"}
            return {"status": "ok"}

        @app.get("/v1/models")
        async def models(self) -> dict:
            info = await self.info()
            return {"object": "list", "data": [{"id": info["model"], "object": "model", "created": self.created,
                                                "owned_by": "lazyattn-rag", "max_model_len": info["max_model_len"]}],
                    "lazyattn": {"max_model_len": info["max_model_len"], "prompt": info["prompt"]}}

        @app.post("/v1/documents")
        async def add_documents(self, request: Request):
            grant = _grant(request)
            grant.check_manage()
            body = parse(DocumentsRequest, await read_json(request, config.max_body_bytes))
            namespace = grant.namespace(body.namespace)
            documents = [(d.id, d.text) for d in body.documents]
            # checked on any replica (no routing keys: registering computes nothing, so it must
            # not teach the router that this replica holds the documents' K/V)
            result = await self.engine.register.remote(documents, namespace, issued_at=time.time())
            _raise_for(result)
            _registry_write(lambda: self.documents.put(namespace, documents))
            return {"object": "list", "namespace": namespace, "version": self.documents.versions[namespace],
                    "data": [{"id": d, "object": "document"} for d, _ in documents]}

        @app.post("/v1/documents/warm")
        async def warm_documents(self, request: Request):
            """``{"ids": [...], "namespace"}``: compute the documents' K/V now, on their owner
            replica (those already cached are left alone); answers the ids it computed."""
            grant = _grant(request)
            grant.check_manage()
            data = await read_json(request, config.max_body_bytes)
            ids, namespace = (data.get("ids"), data.get("namespace", "")) if isinstance(data, dict) else (None, "")
            if not isinstance(ids, list) or not all(isinstance(i, str) for i in ids) or not isinstance(namespace, str):
                raise ApiError(400, "give 'ids', a list of registered document ids, and optionally 'namespace'")
            namespace = grant.namespace(namespace)
            self.documents.sync()
            documents = [(i, registered_text(self.documents, namespace, i)) for i in dict.fromkeys(ids)]
            result = await self.engine.warm.remote(documents, namespace, routing_keys=routing_keys(namespace, ids),
                                                   issued_at=time.time())
            _raise_for(result)
            return result

        @app.get("/v1/documents/version")
        async def documents_version(self, request: Request, namespace: str = ""):
            """The namespace's registry version: where its last change lies in the registry's change
            log, the same in every ingress replica and after a restart; it grows with each change
            of its documents within the registry's ``generation`` (new when the store lost its
            contents: compare both)."""
            namespace = _grant(request).namespace(namespace)
            self.documents.sync()
            return {"version": self.documents.versions[namespace], "namespace": namespace,
                    "generation": self.documents.generation}

        @app.get("/v1/documents")
        async def list_documents(self, request: Request, namespace: str = "", texts: bool = False,
                                 id: Annotated[list[str], Query()] = []):  # noqa: A002, B006 - the query's name; FastAPI copies it
            namespace = _grant(request).namespace(namespace)
            self.documents.sync()
            if id:  # ?id=a&id=b: only those of them that are registered, in the order asked
                ids = [i for i in dict.fromkeys(id) if self.documents.get(namespace, i) is not None]
            else:
                ids = self.documents.ids(namespace)
            data = [{"id": i, "object": "document", **({"text": self.documents.get(namespace, i)} if texts else {})}
                    for i in ids]
            return {"object": "list", "namespace": namespace, "version": self.documents.versions[namespace],
                    "data": data}

        @app.delete("/v1/documents/{doc_id:path}")
        async def delete_document(self, request: Request, doc_id: str, namespace: str = ""):
            """Unregister, then purge the K/V on every replica and in every tier (requests running
            over it finish first, up to ``wait_s`` seconds each); the answer's ``removed`` sums
            what went (``RemovedDocument``) and ``replicas`` has each replica's report."""
            grant = _grant(request)
            grant.check_manage()
            namespace = grant.namespace(namespace)
            self.documents.sync()
            text = registered_text(self.documents, namespace, doc_id)  # 404 when unknown
            _registry_write(lambda: self.documents.delete(namespace, doc_id))  # from here no request can name it
            keep = any(self.documents.get(namespace, i) == text for i in self.documents.ids(namespace))
            results = await self.engine.broadcast("forget", doc_id, text, namespace, keep).results_async(
                return_exceptions=True)
            reports = [r if isinstance(r, dict) else {"error": f"{type(r).__name__}: {r}"} for r in results]
            return {"id": doc_id, "object": "document", "deleted": True, "namespace": namespace,
                    "version": self.documents.versions[namespace], "removed": removed_report(reports, keep),
                    "replicas": reports}

        @app.post("/tokenize")
        async def tokenize(self, request: Request):
            namespace_of = _grant(request).namespace
            body = parse(TokenizeRequest, await read_json(request, config.max_body_bytes))
            if body.prompt is not None:
                result = await self.engine.tokenize.remote({"prompt": body.prompt,
                                                            "add_special_tokens": body.add_special_tokens})
            else:
                chat = ChatCompletionRequest(messages=body.messages, documents=body.documents,
                                             namespace=namespace_of(body.namespace))
                payload, keys = chat_payload(chat, self.documents, passage_min_chars)
                result = await self.engine.tokenize.remote({"payload": payload}, routing_keys=keys)
            _raise_for(result)
            return result

        @app.post("/v1/chat/completions")
        async def chat_completions(self, request: Request):
            received = time.time()
            body, model = await self._body(request, ChatCompletionRequest)
            check_logprobs(body, config.max_logprobs)
            payload, keys = chat_payload(body, self.documents, passage_min_chars)
            return await self._answer(body, payload, keys, Answer(model, {"ingress_received": received}))

        @app.post("/v1/completions")
        async def completions(self, request: Request):
            received = time.time()
            body, model = await self._body(request, CompletionRequest)
            check_logprobs(body, config.max_logprobs, "logprobs")
            payload, keys = completion_payload(body, self.documents)
            answer = Answer(model, {"ingress_received": received}, text=True, echo=await self._echo(body))
            return await self._answer(body, payload, keys, answer)

        async def _echo(self, body: CompletionRequest) -> str:
            """What ``echo`` puts before a completion's text: the prompt as sent (token ids decoded)."""
            if not body.echo or isinstance(body.prompt_value, str):
                return body.prompt_value if body.echo else ""
            result = await self.engine.detokenize.remote(body.prompt_value)
            _raise_for(result)
            return result["prompt"]

        async def _body(self, request: Request, kind):
            """The request's body as ``kind``, its namespace the key's, and the served model's name
            (404 for another model)."""
            namespace_of = _grant(request).namespace
            body = parse(kind, await read_json(request, config.max_body_bytes))
            body.namespace = namespace_of(body.namespace)
            info = await self.info()
            if body.model not in (None, "", info["model"]):
                raise ApiError(404, f"the model {body.model!r} does not exist; this server serves {info['model']!r}",
                               kind="not_found_error", param="model", code="model_not_found")
            return body, info["model"]

        async def _answer(self, body, payload: dict, keys: list[str], answer: "Answer"):
            """The answer to ``payload``: one object, or server-sent events with ``body.stream``."""
            answer.timings["ingress_sent"] = time.time()
            if not body.stream:
                return answer.completion(await self._collect(payload, keys, answer.timings))
            events = self._events(payload, keys, retry_after_output=False)
            first = await anext(events)
            answer.timings["ingress_first_event"] = time.time()
            _raise_for(first)
            include_usage = body.stream_options is not None and body.stream_options.include_usage
            return StreamingResponse(self._sse(answer, first, events, include_usage, body.n),
                                     media_type="text/event-stream")

        async def _events(self, payload, keys, retry_after_output: bool) -> AsyncIterator[dict]:
            """The replica's events; a replica that dies is retried once on another when no event
            was given out yet (or at any point, with ``retry_after_output``)."""
            gone = _replica_gone_errors()
            for attempt in (1, 2):
                given = False
                try:
                    async for event in self.engine.options(stream=True).generate.remote(payload, routing_keys=keys):
                        self._note(event)
                        given = True
                        yield event
                    return
                except gone as error:
                    if attempt == 2 or (given and not retry_after_output):
                        raise ApiError(503, f"the replica serving this request stopped ({type(error).__name__})",
                                       kind="server_error", code="replica_unavailable") from None
                    logger.warning("replica gone before the request finished (%s); retrying once", error)
                    self.num_retries += 1
                    if given:
                        yield {"restart": True}

        async def _collect(self, payload, keys, timings: dict[str, float]) -> list[dict]:
            events = []  # a retried request starts over: the caller sees one whole answer
            async for event in self._events(payload, keys, retry_after_output=True):
                if "ingress_first_event" not in timings:  # once, not a clock read per token
                    timings["ingress_first_event"] = time.time()
                _raise_for(event)
                if event.get("restart"):
                    events = []
                    continue
                events.append(event)
            return events

        def _note(self, event: dict) -> None:
            if "replica" in event:
                self.replica_requests[event["replica"]] += 1

        async def _sse(self, answer: "Answer", first: dict, events, include_usage: bool,
                       num_answers: int) -> AsyncIterator[str]:
            for index in range(num_answers):  # a chat stream opens each answer with the assistant's role
                if not answer.text:
                    yield _sse(answer.chunk({"role": "assistant", "content": ""}, index=index))
                elif answer.echo:
                    yield _sse(answer.chunk({"content": answer.echo}, index=index))
            event, finals = first, []
            try:
                while True:
                    _raise_for(event)
                    index = event.get("index", 0)
                    if event.get("text") or event.get("logprobs"):
                        yield _sse(answer.chunk({"content": event.get("text", "")}, logprobs=event.get("logprobs"),
                                                index=index))
                    if "finish_reason" in event:
                        finals.append(event)
                        yield _sse(answer.chunk({}, event["finish_reason"], answer.extension(event), index=index))
                    if len(finals) == num_answers:
                        if include_usage:
                            yield _sse({**answer.chunk({}), "choices": [], "usage": answers_usage(finals)})
                        break
                    event = await anext(events)
            except ApiError as error:
                yield _sse(error.body())
            except StopAsyncIteration:
                yield _sse(ApiError(503, "the answer ended early", kind="server_error").body())
            except Exception as error:  # noqa: BLE001 - the stream ends with an error event, never silently
                logger.exception("a streamed answer failed")
                yield _sse(ApiError(500, f"the answer failed: {type(error).__name__}: {error}",
                                    kind="server_error").body())
            yield "data: [DONE]\n\n"

        @app.get("/metrics")
        async def metrics(self, request: Request):
            if ANY_NAMESPACE not in _grant(request).namespaces:  # counts of every tenant's traffic: operators only
                raise ApiError(403, "/metrics needs a key allowed every namespace (an --api-key key, or \"*\")",
                               kind="permission_denied", code="metrics_forbidden")
            from prometheus_client import CONTENT_TYPE_LATEST, CollectorRegistry, generate_latest

            try:  # every replica's engine now: gauges of running requests and blocks are current
                reports = await self.engine.broadcast("stats").results_async(timeout_s=METRICS_TIMEOUT_S,
                                                                             return_exceptions=True)
            except TimeoutError:
                reports = []
            self.replica_stats = {r["replica"]: r for r in reports if isinstance(r, dict)}
            registry = CollectorRegistry()
            registry.register(IngressMetrics(self, (await self.info())["model"]))
            return PlainTextResponse(generate_latest(registry), media_type=CONTENT_TYPE_LATEST)

    return Ingress


def _grant(request: Request) -> KeyGrant:
    """The caller's grant, set by the ingress's gate."""
    return request.state.grant


def _registry_write(change) -> None:
    """Run a registry write; a registry that cannot be reached is a 503 naming it."""
    try:
        change()
    except RegistryUnavailable as error:
        raise ApiError(503, str(error), kind="server_error", code="registry_unavailable") from None


def _raise_for(event: dict) -> None:
    """Raise the :class:`ApiError` of a replica's error event (see ``EngineReplica.generate``)."""
    if "error" in event:
        error = event["error"]
        kind = {404: "not_found_error", 500: "server_error"}.get(error["status"], "invalid_request_error")
        raise ApiError(error["status"], error["message"], kind=kind, code=error.get("code"))


def _sse(data: dict) -> str:
    return f"data: {json.dumps(data)}\n\n"
