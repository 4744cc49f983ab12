"""The ingress's two middlewares, as plain ASGI callables (issue 36).

FastAPI's ``@app.middleware("http")`` (Starlette's ``BaseHTTPMiddleware``) runs the route in a
task of its own and passes every chunk of a streamed answer through a memory stream: per
token of every answer, work on the ingress's event loop that delays the other requests'
first tokens. These two see only the request's scope and the response's start message.

* :class:`KeyGate`: the caller's grant (``auth.py``) into ``scope["state"]["grant"]``
  (``request.state.grant`` in a route), or a 401 before any route runs;
* :class:`ResponseCounter`: responses by route, method and status into :data:`RESPONSES` (``/metrics``).
  A module-level counter: Ray pickles the ingress's app by value, and both the middleware and
  ``/metrics`` must find this process's one by reference.
"""

from collections import Counter
from typing import Any

from starlette.datastructures import Headers
from starlette.responses import JSONResponse

from lazyattn_rag.serve.auth import Authenticator
from lazyattn_rag.serve.http_errors import ApiError

Scope = dict[str, Any]
# (route, method, status) -> responses of this (single) ingress process
RESPONSES: Counter[tuple[str, str, int]] = Counter()


class KeyGate:
    """ASGI middleware: every HTTP route but ``open_paths`` needs a grant from ``gate``."""

    def __init__(self, app, gate: Authenticator, open_paths: tuple[str, ...] = ("/health",)):
        self.app, self.gate, self.open_paths = app, gate, open_paths

    async def __call__(self, scope: Scope, receive, send) -> None:
        if scope["type"] != "http" or scope["path"] in self.open_paths:
            await self.app(scope, receive, send)
            return
        client, given = scope.get("client"), Headers(scope=scope).getlist("authorization")
        try:
            if len(given) > 1:  # which one counts would be the server's guess
                raise ApiError(401, "more than one Authorization header", kind="authentication_error",
                               code="invalid_api_key")
            grant = self.gate.caller(given[0] if given else None, client[0] if client else None)
        except ApiError as error:
            response = JSONResponse(error.body(), status_code=error.status, headers={"WWW-Authenticate": "Bearer"})
            await response(scope, receive, send)
            return
        scope.setdefault("state", {})["grant"] = grant
        await self.app(scope, receive, send)


class ResponseCounter:
    """ASGI middleware: ``RESPONSES[(route path or "unmatched", method, status)] += 1`` per HTTP
    response (an exception that escapes the app counts as 500)."""

    def __init__(self, app):
        self.app = app

    async def __call__(self, scope: Scope, receive, send) -> None:
        if scope["type"] != "http":
            await self.app(scope, receive, send)
            return
        status = 500

        async def send_and_note(message) -> None:
            nonlocal status
            if message["type"] == "http.response.start":
                status = message["status"]
            await send(message)

        try:
            await self.app(scope, receive, send_and_note)
        finally:
            route = getattr(scope.get("route"), "path", None)  # set by the router; None: no route matched
            RESPONSES[(route or "unmatched", scope.get("method", ""), status)] += 1


def install_middlewares(app, gate: Authenticator, config) -> None:
    """The key gate and the response counter on ``app``, and CORS where ``config``
    (``ServeConfig``) allows origins."""
    from fastapi.middleware.cors import CORSMiddleware

    # plain ASGI middlewares (middleware.py): FastAPI's @app.middleware would pass every streamed
    # chunk through a task and a memory stream; the counter is added last, the outer one, so it
    # counts the gate's 401s too
    app.add_middleware(KeyGate, gate=gate)
    app.add_middleware(ResponseCounter)
    if config.allowed_origins:  # outermost: a browser's preflight carries no key
        app.add_middleware(CORSMiddleware, allow_origins=list(config.allowed_origins),
                           allow_methods=list(config.allowed_methods), allow_headers=list(config.allowed_headers))
