"""The OpenAI objects of one answer (``chat.completion`` and its chunks, or ``text_completion`` for
``/v1/completions``), with the ``lazyattn`` extension: the engine's stats, the replica and the
request's stage timings. Each is checked against the ``openai`` package's own type of it where
it is made (:func:`checked`), so the server cannot drift from the schema its clients parse."""

import time
import uuid

from openai.types import Completion
from openai.types.chat import ChatCompletion, ChatCompletionChunk

from lazyattn_rag.types.wire import stats_from_body, usage

_TYPES = {"chat.completion": ChatCompletion, "chat.completion.chunk": ChatCompletionChunk, "text_completion": Completion}


class Answer:
    """The OpenAI objects of one answer."""

    def __init__(self, model: str, timings: dict[str, float], text: bool = False, echo: str = ""):
        prefix = "cmpl" if text else "chatcmpl"
        self.id, self.created, self.model = f"{prefix}-{uuid.uuid4().hex}", int(time.time()), model
        self.timings = timings  # wall-clock seconds of the request's stages (see extension())
        self.text = text  # a text completion (/v1/completions) rather than a chat one
        self.echo = echo  # a text completion's prompt, before each answer (echo: true)
        self.text_offsets: dict[int, int] = {}  # per answer index: a text completion's characters so far

    def extension(self, last: dict) -> dict:
        """The ``lazyattn`` field of the answer's last chunk (or of the completion): the engine's
        ``stats``, the ``replica`` and ``timings``, the wall-clock seconds (``time.time()``) at
        which the ingress received the request, sent it to a replica, and got its first event
        back, and at which the replica received it and gave out its first event: with the
        engine's ``ttft_ms`` they say where a request's time to first token went."""
        return {"stats": last["stats"], "replica": last["replica"],
                "timings": self.timings | last.get("timings", {})}

    def chunk(self, delta: dict, finish_reason: str | None = None, extension: dict | None = None,
              logprobs: dict | None = None, index: int = 0) -> dict:
        """A streamed chunk of answer ``index``: ``delta`` is the chat delta (``{"content"}``,
        ``{"role", "content"}`` first); a text completion's chunk carries its ``content`` as ``text``."""
        if self.text:
            choice = {"index": index, "text": delta.get("content", ""), "finish_reason": finish_reason,
                      "logprobs": self.legacy_logprobs([logprobs], index) if logprobs else None}
        else:
            choice = {"index": index, "delta": delta, "finish_reason": finish_reason,
                      "logprobs": {"content": [logprobs]} if logprobs else None}
        kind = "text_completion" if self.text else "chat.completion.chunk"
        out = {"id": self.id, "object": kind, "created": self.created, "model": self.model, "choices": [choice]}
        return checked(out | ({"lazyattn": extension} if extension else {}))

    def completion(self, events: list[dict]) -> dict:
        """The whole answer: one choice per answer index (``n``), usage over all of them."""
        finals = sorted((e for e in events if "finish_reason" in e), key=lambda e: e.get("index", 0))
        choices = [self._choice(index, [e for e in events if e.get("index", 0) == index], final["finish_reason"])
                   for index, final in ((f.get("index", 0), f) for f in finals)]
        kind = "text_completion" if self.text else "chat.completion"
        return checked({"id": self.id, "object": kind, "created": self.created, "model": self.model,
                        "choices": choices, "usage": answers_usage(finals), "lazyattn": self.extension(finals[0])})

    def _choice(self, index: int, events: list[dict], finish_reason: str) -> dict:
        text = "".join(e.get("text", "") for e in events)
        entries = [e["logprobs"] for e in events if e.get("logprobs")]
        if self.text:
            legacy = self.legacy_logprobs(entries, index) if entries else None
            return {"index": index, "text": self.echo + text, "logprobs": legacy, "finish_reason": finish_reason}
        return {"index": index, "message": {"role": "assistant", "content": text}, "finish_reason": finish_reason,
                "logprobs": {"content": entries} if entries else None}

    def legacy_logprobs(self, entries: list[dict], index: int = 0) -> dict:
        """The completions API's ``logprobs`` of ``entries`` (chat's per-token entries of answer
        ``index``, in order): ``tokens``, ``token_logprobs``, ``top_logprobs`` (token text ->
        logprob) and ``text_offset`` (each token's first character in that answer, counted
        across chunks)."""
        offsets = []
        for entry in entries:
            offsets.append(self.text_offsets.get(index, 0))
            self.text_offsets[index] = offsets[-1] + len(entry["token"])
        return {"tokens": [e["token"] for e in entries], "token_logprobs": [e["logprob"] for e in entries],
                "top_logprobs": [{t["token"]: t["logprob"] for t in e["top_logprobs"]} for e in entries],
                "text_offset": offsets}


def answers_usage(finals: list[dict]) -> dict:
    """OpenAI's ``usage`` of a request's answers (their final events): the prompt once (index
    0's, the one that computed it), the completion tokens of all."""
    out = usage(stats_from_body(finals[0]["stats"]))
    out["completion_tokens"] = sum(stats_from_body(f["stats"]).num_output_tokens for f in finals)
    out["total_tokens"] = out["prompt_tokens"] + out["completion_tokens"]
    return out


def checked(body: dict) -> dict:
    """``body``, validated as the ``openai`` package's type of its ``object`` (extension fields are
    allowed, as the package allows them). A streamed text completion's chunk before its last is
    left out: the package's ``Completion`` types ``finish_reason`` without the ``null`` the API
    streams.

    Raises:
        pydantic.ValidationError: the body does not match (a bug of this server).
    """
    kind = _TYPES[body["object"]]
    if kind is Completion and any(c["finish_reason"] is None for c in body["choices"]):
        return body
    kind.model_validate(body)
    return body
