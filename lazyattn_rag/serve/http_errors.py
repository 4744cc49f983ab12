"""HTTP input of ``lazyattn serve``: OpenAI-shaped errors and checked request bodies (issue 18).

Errors are OpenAI's ``{"error": {"message", "type", "param", "code"}}`` with the HTTP status;
bodies are read up to ``ServeConfig.max_body_bytes`` (413 past it), parsed as JSON (400 naming
what is wrong) and validated with the pydantic models of ``protocol.py`` (400 naming the field).
"""

import json
import logging
from typing import Any

from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import BaseModel, ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

logger = logging.getLogger("lazyattn_rag.serve")


class ApiError(Exception):
    """An HTTP error with OpenAI's error body."""

    def __init__(self, status: int, message: str, kind: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.kind, self.param, self.code = status, message, kind, param, code

    def body(self) -> dict[str, Any]:
        return {"error": {"message": self.message, "type": self.kind, "param": self.param, "code": self.code}}


def parse(model: type[BaseModel], data: Any) -> BaseModel:
    """``data`` validated as ``model``; a :class:`ApiError` (400) naming the first bad field."""
    try:
        return model.model_validate(data)
    except ValidationError as error:
        errors = error.errors()
        # of a union's branches, the one of the value's own type says what is wrong with it
        first = next((e for e in errors if not e["type"].endswith("_type")), errors[0])
        where = ".".join(str(p) for p in first["loc"] if not str(p).startswith(("constrained-", "list[")))
        where = where or "body"
        raise ApiError(400, f"{where}: {first['msg']}", param=where) from None


async def read_json(request, limit: int) -> Any:
    """The request's JSON body, read up to ``limit`` bytes (413 past it, 400 if not JSON)."""
    length = request.headers.get("content-length")
    if length is not None and length.isdigit() and int(length) > limit:
        raise ApiError(413, f"the request body has {length} bytes; the limit is {limit}", code="body_too_large")
    body = bytearray()
    async for piece in request.stream():
        body += piece
        if len(body) > limit:
            raise ApiError(413, f"the request body exceeds the limit of {limit} bytes", code="body_too_large")
    try:
        data = json.loads(body)
    except ValueError as error:
        raise ApiError(400, f"the request body is not valid JSON: {error}") from None
    except RecursionError:
        raise ApiError(400, "the request body is nested too deeply") from None
    _check_text(data)
    return data


def _check_text(value: Any, where: str = "body") -> None:
    """Every string in ``value`` must be Unicode text (JSON's ``\\ud800`` escapes can make lone
    surrogates, which no tokenizer takes): 400 naming where one is."""
    stack = [(value, where)]
    while stack:
        item, path = stack.pop()
        if isinstance(item, str):
            try:
                item.encode("utf-8")
            except UnicodeEncodeError:
                raise ApiError(400, f"{path}: not valid Unicode text (a lone surrogate)", param=path) from None
        elif isinstance(item, dict):
            stack.extend((v, f"{path}.{k}") for k, v in item.items())
            stack.extend((k, f"{path} key") for k in item)
        elif isinstance(item, list):
            stack.extend((v, f"{path}[{i}]") for i, v in enumerate(item))


def install_error_handlers(app) -> None:
    """Every error of the FastAPI ``app`` answered in OpenAI's shape: an :class:`ApiError` as it
    is, no such route (404) or method (405), a query parameter of the wrong type (400), and any
    other exception (500, its last line: a bug or a replica's failure)."""
    @app.exception_handler(ApiError)
    async def _api_error(request, error: ApiError):  # a 409 (a document's text changed) is the client's to
        # resolve, not to repeat: the openai package retries a 409 unless told not to
        return JSONResponse(error.body(), status_code=error.status,
                            headers={"x-should-retry": "false"} if error.status == 409 else None)

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, error: StarletteHTTPException):  # no such route (404), method (405)
        kind = "not_found_error" if error.status_code == 404 else "invalid_request_error"
        message = {404: f"no route {request.url.path!r} (see GET /v1/models, POST /v1/chat/completions)",
                   405: f"{request.method} is not allowed on {request.url.path!r}"}.get(error.status_code,
                                                                                       str(error.detail))
        return JSONResponse(ApiError(error.status_code, message, kind=kind).body(), status_code=error.status_code,
                            headers=getattr(error, "headers", None))

    @app.exception_handler(RequestValidationError)
    async def _bad_parameter(request, error: RequestValidationError):  # a query parameter of the wrong type
        first = error.errors()[0]
        where = ".".join(str(p) for p in first["loc"])
        return JSONResponse(ApiError(400, f"{where}: {first['msg']}", param=where).body(), status_code=400)

    @app.exception_handler(Exception)
    async def _unexpected(request, error: Exception):  # a bug or a replica's failure: still OpenAI's shape
        logger.exception("request failed: %s %s", request.method, request.url.path)
        last = (str(error).strip().splitlines() or [""])[-1][:500]  # a replica's error: its last line, not its traceback
        body = ApiError(500, f"the server failed: {type(error).__name__}: {last}", kind="server_error").body()
        return JSONResponse(body, status_code=500)
