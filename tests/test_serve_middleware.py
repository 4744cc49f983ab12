"""The ingress's ASGI middlewares (lazyattn_rag/serve/middleware.py) on a small FastAPI app,
without Ray: the key gate's 401 and grant, the response counts, a streamed answer passed
through chunk by chunk."""

import pytest

pytest.importorskip("fastapi")

from fastapi import FastAPI, Request  # noqa: E402
from fastapi.responses import StreamingResponse  # noqa: E402
from fastapi.testclient import TestClient  # noqa: E402

from lazyattn_rag.serve.auth import Authenticator, load_grants  # noqa: E402
from lazyattn_rag.serve.middleware import RESPONSES, KeyGate, ResponseCounter  # noqa: E402


@pytest.fixture
def client():
    app = FastAPI()
    app.add_middleware(KeyGate, gate=Authenticator(load_grants(("k1",))))
    app.add_middleware(ResponseCounter)

    @app.get("/health")
    async def health():
        return {"status": "ok"}

    @app.get("/whoami")
    async def whoami(request: Request):
        return {"namespace": request.state.grant.namespace("")}

    @app.get("/stream")
    async def stream():
        async def parts():
            for i in range(3):
                yield f"data: {i}\n\n"
        return StreamingResponse(parts(), media_type="text/event-stream")

    @app.get("/boom")
    async def boom():
        raise RuntimeError("a bug")

    RESPONSES.clear()
    return TestClient(app, raise_server_exceptions=False)


def test_the_gate_refuses_a_missing_or_wrong_key_before_any_route_and_counts_it(client):
    missing = client.get("/whoami")
    wrong = client.get("/whoami", headers={"Authorization": "Bearer k2"})
    assert (missing.status_code, wrong.status_code) == (401, 401)
    assert missing.headers["WWW-Authenticate"] == "Bearer"
    assert missing.json()["error"]["message"] == "missing API key: send 'Authorization: Bearer <key>'"
    assert wrong.json()["error"]["message"] == "invalid API key"
    both = client.get("/whoami", headers=[("Authorization", "Bearer bad"), ("Authorization", "Bearer k1")])
    assert both.status_code == 401 and both.json()["error"]["message"] == "more than one Authorization header"
    assert RESPONSES == {("unmatched", "GET", 401): 3}  # refused before the router matched a route


def test_a_valid_key_reaches_the_route_with_its_grant_and_health_needs_none(client):
    assert client.get("/whoami", headers={"Authorization": "Bearer k1"}).json() == {"namespace": ""}
    assert client.get("/health").json() == {"status": "ok"}
    assert client.get("/nowhere", headers={"Authorization": "Bearer k1"}).status_code == 404
    assert RESPONSES == {("/whoami", "GET", 200): 1, ("/health", "GET", 200): 1, ("unmatched", "GET", 404): 1}


def test_a_streamed_answer_passes_whole_and_a_failing_route_counts_as_500(client):
    with client.stream("GET", "/stream", headers={"Authorization": "Bearer k1"}) as response:
        assert list(response.iter_lines()) == ["data: 0", "", "data: 1", "", "data: 2", ""]
    assert client.get("/boom", headers={"Authorization": "Bearer k1"}).status_code == 500
    assert RESPONSES == {("/stream", "GET", 200): 1, ("/boom", "GET", 500): 1}
