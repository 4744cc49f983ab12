"""The OpenAI routes of a ``lazyattn serve`` server through the ``openai`` package, for
:mod:`lazyattn_rag.remote`: the project's own client answers through the same package its users'
apps do, so the server's compatibility is proven by its own use.

The package brings transport retries with exponential backoff (connection errors, 408, 429 and
5xx; the server marks the conflicts the client resolves itself with ``x-should-retry: false``),
one pooled HTTP client per event loop for the async streams, and typed errors, which
:func:`openai_errors` turns into this package's (``UnknownDocumentError``, ``DocumentChanged``,
``ServerError``...). The server's extension fields (``documents``, ``namespace``, ``top_k``,
``remedies``...) travel in ``extra_body``.
"""

from __future__ import annotations

import asyncio
import weakref
from collections.abc import Iterator
from contextlib import contextmanager
from typing import Any

from lazyattn_rag.types.errors import ServerError
from lazyattn_rag.types.wire import raise_for_status

# chat completions fields the openai package takes as keywords; the rest go in extra_body
OPENAI_FIELDS = frozenset({"max_tokens", "max_completion_tokens", "temperature", "top_p", "stop", "seed",
                           "frequency_penalty", "presence_penalty", "n", "response_format", "stream_options",
                           "logprobs", "top_logprobs"})


@contextmanager
def openai_errors(what: str) -> Iterator[None]:
    """Turn the ``openai`` package's errors raised inside into this package's.

    Raises:
        the error the server's body names (``raise_for_status``) for a status error,
        ServerError: the server cannot be reached, or a stream ended with an error event.
    """
    import openai

    try:
        yield
    except openai.APIStatusError as error:
        raise_for_status(error.status_code, error.response.content)
        raise ServerError(f"{what}: {error}") from error  # a status raise_for_status lets through
    except openai.APIConnectionError as error:
        raise ServerError(f"{what}: {error}") from error
    except openai.APIError as error:  # an error event inside a stream
        raise ServerError(f"the answer failed on the server: {error.message}") from error


class ChatRoutes:
    """``POST /v1/chat/completions`` (streamed) over the ``openai`` package.

    Args:
        base_url: the server, e.g. ``"http://127.0.0.1:8000"``.
        model: the served model's name.
        api_key: the server's key, or ``None`` (no ``--api-key``).
        timeout_s: seconds to wait for a response or the next streamed piece.
        headers: extra HTTP headers.
        max_retries: transport retries (with backoff) before an error is raised.
    """

    def __init__(self, base_url: str, model: str, api_key: str | None, timeout_s: float,
                 headers: dict[str, str] | None, max_retries: int = 2):
        import openai

        self.model, self.what = model, f"POST {base_url}/v1/chat/completions"
        self._options = {"base_url": base_url + "/v1", "api_key": api_key or "none", "timeout": timeout_s,
                         "max_retries": max_retries, "default_headers": headers}
        self.client = openai.OpenAI(**self._options)
        self._async: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()  # event loop -> AsyncOpenAI

    def stream(self, body: dict[str, Any]):
        """An ``openai.Stream`` of ``chat.completion.chunk`` s for ``body`` (the request's JSON).

        Raises:
            as :func:`openai_errors`.
        """
        known, extra = _split(body)
        with openai_errors(self.what):
            return self.client.chat.completions.create(model=self.model, stream=True, extra_body=extra, **known)

    async def astream(self, body: dict[str, Any]):
        """:meth:`stream` on this event loop's pooled ``AsyncOpenAI``."""
        import openai

        loop = asyncio.get_running_loop()
        client = self._async.get(loop)
        if client is None:
            client = self._async[loop] = openai.AsyncOpenAI(**self._options)
        known, extra = _split(body)
        with openai_errors(self.what):
            return await client.chat.completions.create(model=self.model, stream=True, extra_body=extra, **known)

    def close(self) -> None:
        self.client.close()


def _split(body: dict[str, Any]) -> tuple[dict[str, Any], dict[str, Any]]:
    """``(keywords the package takes, extra_body)`` of a chat request's JSON."""
    known = {k: v for k, v in body.items() if k in OPENAI_FIELDS or k == "messages"}
    return known, {k: v for k, v in body.items() if k not in known and k not in ("stream", "model")}
