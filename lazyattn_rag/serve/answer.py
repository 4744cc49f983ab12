"""The OpenAI objects of one answer (``chat.completion`` and its chunks, or ``text_completion`` for
``/v1/completions``), with the ``lazyattn`` extension: the engine's stats, the replica and the
request's stage timings."""

import time
import uuid

from lazyattn_rag.types.wire import stats_from_body, usage


class Answer:
    """The OpenAI objects of one answer."""

    def __init__(self, model: str, timings: dict[str, float], text: bool = False):
        prefix = "cmpl" if text else "chatcmpl"
        self.id, self.created, self.model = f"{prefix}-{uuid.uuid4().hex}", int(time.time()), model
        self.timings = timings  # wall-clock seconds of the request's stages (see extension())
        self.text = text  # a text completion (/v1/completions) rather than a chat one
        self.text_offset = 0  # a text completion's characters so far (its logprobs' text_offset)

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
        """A streamed chunk: ``delta`` is the chat delta (``{"content"}``, ``{"role", "content"}``
        first); a text completion's chunk carries its ``content`` as ``text``."""
        if self.text:
            choice = {"index": 0, "text": delta.get("content", ""),
                      "logprobs": self.legacy_logprobs([logprobs]) if logprobs else None, "finish_reason": finish_reason}
        else:
            choice = {"index": 0, "delta": delta, "finish_reason": finish_reason,
                      "logprobs": {"content": [logprobs]} if logprobs else None}
        kind = "text_completion" if self.text else "chat.completion.chunk"
        out = {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": [choice]}
        return out | ({"lazyattn": extension} if extension else {})

    def completion(self, events: list[dict]) -> dict:
        last = events[-1]
        stats = stats_from_body(last["stats"])
        text = "".join(e.get("text", "") for e in events)
        entries = [e["logprobs"] for e in events if e.get("logprobs")]
        if self.text:
            legacy = self.legacy_logprobs(entries) if entries else None
            return {"id": self.id, "object": "text_completion", "created": self.created, "model": self.model,
                    "choices": [{"index": 0, "text": text, "logprobs": legacy, "finish_reason": last["finish_reason"]}],
                    "usage": usage(stats), "lazyattn": self.extension(last)}
        return {"id": self.id, "object": "chat.completion", "created": self.created, "model": self.model,
                "choices": [{"index": 0, "message": {"role": "assistant", "content": text},
                             "finish_reason": last["finish_reason"],
                             "logprobs": {"content": entries} if entries else None}],
                "usage": usage(stats), "lazyattn": self.extension(last)}

    def legacy_logprobs(self, entries: list[dict]) -> dict:
        """The completions API's ``logprobs`` of ``entries`` (chat's per-token entries, in order):
        ``tokens``, ``token_logprobs``, ``top_logprobs`` (token text -> logprob) and ``text_offset``
        (each token's first character in the whole completion, counted across chunks)."""
        offsets = []
        for entry in entries:
            offsets.append(self.text_offset)
            self.text_offset += len(entry["token"])
        return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
                "text_offset": offsets}
