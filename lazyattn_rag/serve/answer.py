"""The OpenAI objects of one chat answer (``chat.completion`` and its chunks), with the
``lazyattn`` extension: the engine's stats, the replica and the request's stage timings."""

import time
import uuid

from lazyattn_rag.types.wire import stats_from_body, usage


class Answer:
    """The OpenAI objects of one answer."""

    def __init__(self, model: str, timings: dict[str, float]):
        self.id, self.created, self.model = f"chatcmpl-{uuid.uuid4().hex}", int(time.time()), model
        self.timings = timings  # wall-clock seconds of the request's stages (see extension())

    def extension(self, last: dict) -> dict:
        """The ``lazyattn`` field of the answer's last chunk (or of the completion): the engine's
        ``stats``, the ``replica`` and ``timings``, the wall-clock seconds (``time.time()``) at
        which the ingress received the request, sent it to a replica, and got its first event
        back, and at which the replica received it and gave out its first event: with the
        engine's ``ttft_ms`` they say where a request's time to first token went."""
        return {"stats": last["stats"], "replica": last["replica"],
                "timings": self.timings | last.get("timings", {})}

    def chunk(self, delta: dict, finish_reason: str | None = None, extension: dict | None = None,
              logprobs: dict | None = None) -> dict:
        choice = {"index": 0, "delta": delta, "finish_reason": finish_reason,
                  "logprobs": {"content": [logprobs]} if logprobs else None}
        out = {"id": self.id, "object": "chat.completion.chunk", "created": self.created, "model": self.model,
               "choices": [choice]}
        return out | ({"lazyattn": extension} if extension else {})

    def completion(self, events: list[dict]) -> dict:
        last = events[-1]
        stats = stats_from_body(last["stats"])
        text = "".join(e.get("text", "") for e in events)
        entries = [e["logprobs"] for e in events if e.get("logprobs")]
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "finish_reason": last["finish_reason"],
                             "logprobs": {"content": entries} if entries else None}],
                "usage": usage(stats), "lazyattn": self.extension(last)}
