"""Request bodies of the HTTP API, validated with pydantic (issue 18).

``ChatCompletionRequest`` and ``CompletionRequest`` are OpenAI's chat completions and completions
requests with the extension fields of ``lazyattn_rag/types/wire.py``. Fields OpenAI defines that change the answer and that this
server does not implement (``tools``, ``logit_bias``, ...) are refused with 400
rather than ignored; the rest (``user``, ``metadata``, ``store``...) are
accepted and ignored, as OpenAI-compatible servers do, and named in the server's log (once per
set of names), as vLLM does. Counts and flags take JSON integers and booleans only, as OpenAI's
API does: ``"n": "2"``, ``"max_tokens": true`` or ``"stream": "yes"`` is a 400, not a guess.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from typing import Annotated, Any, ClassVar, Literal

from pydantic import BaseModel, ConfigDict, Field, PrivateAttr, Strict, field_validator, model_validator

from lazyattn_rag.types.sampling_params import MAX_N
from lazyattn_rag.types.structured_output import StructuredOutputParams

NAMESPACE_PATTERN = r"^[A-Za-z0-9_.:@/-]{0,128}$"
Int = Annotated[int, Strict()]  # a JSON integer: not "2", 2.0 or true
Bool = Annotated[bool, Strict()]  # a JSON boolean: not "true" or 1
logger = logging.getLogger("lazyattn_rag.serve")
_LOGGED_IGNORED: OrderedDict[tuple[str, ...], None] = OrderedDict()  # the sets of ignored names logged, newest last
MAX_LOGGED_IGNORED = 256  # name sets remembered (least recently seen forgotten first)
MAX_LOGGED_NAMES, MAX_LOGGED_NAME_CHARS = 8, 64  # what one log line names of a request's ignored fields
MAX_STOPS, MAX_STOP_CHARS, MAX_STOP_TOKEN_IDS = 16, 256, 64
StopString = Annotated[str, Field(max_length=MAX_STOP_CHARS)]
UNSUPPORTED = ("tools", "tool_choice", "functions", "function_call", "logit_bias", "audio", "modalities", "prediction",
               "guided_whitespace_pattern", "echo", "min_tokens", "include_stop_str_in_output")  # vLLM's last two
GUIDED_BACKENDS = ("xgrammar", "auto")


class DocumentIn(BaseModel):
    """A document: a non-empty id and its text."""

    model_config = ConfigDict(extra="forbid")
    id: str = Field(min_length=1, max_length=1024, pattern=r"^[^\x00-\x1f\x7f]+$")  # no control characters:
    # an id must fit a URL path (DELETE /v1/documents/{id}) and a log line
    text: str


class DocumentsRequest(BaseModel):
    """``POST /v1/documents``."""

    model_config = ConfigDict(extra="forbid")
    documents: list[DocumentIn] = Field(min_length=1)
    namespace: str = Field(default="", pattern=NAMESPACE_PATTERN)

    @model_validator(mode="after")
    def _one_text_per_id(self):
        texts: dict[str, str] = {}
        for d in self.documents:
            if texts.setdefault(d.id, d.text) != d.text:
                raise ValueError(f"document id {d.id!r} is given twice with different texts")
        return self


class ContentPart(BaseModel):
    """A part of a message's content: ``{"type": "text", "text"}`` or ``{"type": "document", "id"}``."""

    model_config = ConfigDict(extra="allow")
    type: Literal["text", "document"]
    text: str | None = None
    id: str | None = None

    @model_validator(mode="after")
    def _has_its_field(self):
        if self.type == "text" and self.text is None:
            raise ValueError("a text part needs 'text'")
        if self.type == "document" and not self.id:
            raise ValueError("a document part needs a non-empty 'id'")
        return self


class ChatMessageIn(BaseModel):
    model_config = ConfigDict(extra="allow")  # name, ... (ignored)
    role: Literal["system", "user", "assistant", "developer"]
    content: str | list[ContentPart]

    def as_wire(self) -> dict[str, Any]:
        role = "system" if self.role == "developer" else self.role
        if isinstance(self.content, str):
            return {"role": role, "content": self.content}
        return {"role": role, "content": [p.model_dump(exclude_none=True) for p in self.content]}

    def document_ids(self) -> list[str]:
        return [] if isinstance(self.content, str) else [p.id for p in self.content if p.type == "document"]


class TokenizeRequest(BaseModel):
    """``POST /tokenize`` (vLLM's shape): ``prompt`` (plain text) or ``messages`` (with
    ``documents`` and ``namespace`` as in chat completions: the prompt the engine would build)."""

    model_config = ConfigDict(extra="allow")  # model, add_generation_prompt, ... (ignored)
    prompt: str | None = None
    add_special_tokens: bool = True
    messages: list[ChatMessageIn] | None = Field(default=None, min_length=1)
    documents: list[str | DocumentIn] = Field(default_factory=list)
    namespace: str = Field(default="", pattern=NAMESPACE_PATTERN)

    @model_validator(mode="after")
    def _one_of(self):
        if (self.prompt is None) == (self.messages is None):
            raise ValueError("give either 'prompt' (text) or 'messages'")
        return self


class DetokenizeRequest(BaseModel):
    """``POST /detokenize`` (vLLM's shape): token ids to text."""

    model_config = ConfigDict(extra="allow")  # model (ignored)
    tokens: list[int] = Field(max_length=1 << 20)


class StreamOptions(BaseModel):
    """``stream_options``: ``include_usage`` (a last chunk with the usage); vLLM's
    ``continuous_usage_stats`` (usage on every chunk) is refused by name, not ignored."""

    model_config = ConfigDict(extra="forbid")
    include_usage: Bool = False
    continuous_usage_stats: bool = False

    @field_validator("continuous_usage_stats")
    @classmethod
    def _last_chunk_only(cls, value: bool) -> bool:
        if value:
            raise ValueError("continuous_usage_stats is not supported: the usage comes once, in the last chunk "
                             "(include_usage)")
        return value


MAX_HEAD_TOKENS = 1 << 20  # chunk-head recompute's k: more than any document's tokens


class RemediesIn(BaseModel):
    """A request's answer-fidelity remedies (``RequestRemedies``; unset: the server's)."""

    model_config = ConfigDict(extra="forbid", strict=True)  # "2", 2.0 or true is not a token count
    recompute_chunk_head_tokens: int | None = Field(default=None, ge=0, le=MAX_HEAD_TOKENS)
    recompute_selective_ratio: float | None = Field(default=None, ge=0, le=1)
    chunk_attention_scaling: bool | None = None


class JsonSchemaFormat(BaseModel):
    """``response_format.json_schema``: OpenAI's (``name``, ``description`` and ``strict`` are
    accepted; the schema is always enforced)."""

    model_config = ConfigDict(extra="forbid", populate_by_name=True)
    name: str | None = None
    description: str | None = None
    json_schema: dict[str, Any] = Field(alias="schema")
    strict: bool | None = None


class ResponseFormat(BaseModel):
    """OpenAI's ``response_format``: ``text`` (no constraint), ``json_object`` or ``json_schema``."""

    model_config = ConfigDict(extra="forbid")
    type: Literal["text", "json_object", "json_schema"]
    json_schema: JsonSchemaFormat | None = None

    @model_validator(mode="after")
    def _schema_given(self):
        if (self.type == "json_schema") != (self.json_schema is not None):
            raise ValueError("response_format: type json_schema goes with a json_schema object (and only it)")
        return self


class StructuredOutputsIn(BaseModel):
    """vLLM's ``structured_outputs`` object: one of ``json``, ``json_object``, ``regex``,
    ``choice``, ``grammar``."""

    model_config = ConfigDict(extra="forbid")
    json_: str | dict[str, Any] | None = Field(default=None, alias="json")
    json_object: Bool | None = None
    regex: str | None = None
    choice: list[str] | None = None
    grammar: str | None = None


class GenerationRequest(BaseModel):
    """The fields chat completions and completions share: sampling, streaming and the extensions."""

    model_config = ConfigDict(extra="allow")
    model: str | None = None
    max_tokens: Int | None = Field(default=None, ge=1)
    temperature: float | None = Field(default=None, ge=0, le=2)
    top_p: float | None = Field(default=None, gt=0, le=1)
    stop: StopString | Annotated[list[StopString], Field(max_length=MAX_STOPS)] | None = None  # checked every token
    seed: Int | None = Field(default=None, ge=0, lt=2**63)
    frequency_penalty: float | None = Field(default=None, ge=-2, le=2)
    presence_penalty: float | None = Field(default=None, ge=-2, le=2)
    n: Int = 1
    stream: Bool = False
    stream_options: StreamOptions | None = None
    # extensions (lazyattn_rag/types/wire.py)
    documents: list[str | DocumentIn] = Field(default_factory=list)
    namespace: str = Field(default="", pattern=NAMESPACE_PATTERN)
    document_hashes: dict[str, str] = Field(default_factory=dict)
    top_k: Int | None = Field(default=None, ge=-1)
    min_p: float | None = Field(default=None, ge=0, le=1)
    repetition_penalty: float | None = Field(default=None, gt=0)
    ignore_eos: Bool | None = None
    remedies: RemediesIn | None = None
    stop_token_ids: list[Int] | None = Field(default=None, max_length=MAX_STOP_TOKEN_IDS)
    strict_max_tokens: Bool | None = None  # unset: refuse prompt + max_tokens past the context when max_tokens is given
    return_tokens_as_token_ids: Bool = False  # vLLM's: logprob tokens as "token_id:<id>"
    skip_special_tokens: Bool | None = None  # vLLM's: unset or true leaves special tokens out of the text
    # structured output: OpenAI's response_format, vLLM's guided_* fields and structured_outputs (one of them)
    response_format: ResponseFormat | None = None
    guided_json: str | dict[str, Any] | None = None
    guided_regex: str | None = None
    guided_choice: list[str] | None = None
    guided_grammar: str | None = None
    structured_outputs: StructuredOutputsIn | None = None
    guided_decoding_backend: str | None = None
    unsupported: ClassVar[tuple[str, ...]] = UNSUPPORTED  # body fields refused by name
    _structured_output: StructuredOutputParams | None = PrivateAttr(default=None)

    @field_validator("n")
    @classmethod
    def _choices(cls, n: int) -> int:
        if not 1 <= n <= MAX_N:
            raise ValueError(f"n must be in [1, {MAX_N}], got {n}")
        return n

    @model_validator(mode="after")
    def _nothing_unsupported(self):
        extra = self.model_extra or {}
        asked = [k for k in self.unsupported if _asks(k, extra.get(k))]
        if asked:
            raise ValueError(f"not supported by this server: {', '.join(asked)}")
        _log_ignored(type(self).__name__, tuple(sorted(k for k in extra if k not in self.unsupported)))
        return self

    @model_validator(mode="after")
    def _stream_options_with_stream(self):
        if self.stream_options is not None and not self.stream:
            raise ValueError("stream_options needs stream: true")
        return self

    @model_validator(mode="after")
    def _one_structure(self):
        asked = {k: v for k, v in _structure_fields(self).items() if v is not None}
        if len(asked) > 1:
            raise ValueError(f"give one structured output field, got {', '.join(asked)}")
        if self.guided_decoding_backend not in (None, *GUIDED_BACKENDS):
            raise ValueError(f"guided_decoding_backend: only {' or '.join(GUIDED_BACKENDS)} is supported, "
                             f"got {self.guided_decoding_backend!r}")
        self._structured_output = StructuredOutputParams(**next(iter(asked.values()))) if asked else None
        return self

    @property
    def structured_output(self) -> StructuredOutputParams | None:
        """The constraint the body asks for (any of its spellings), or ``None``."""
        return self._structured_output

    @property
    def num_logprobs(self) -> int | None:
        return None

    def sampling_body(self) -> dict[str, Any]:
        """The fields :func:`~lazyattn_rag.types.wire.sampling_from_body` reads."""
        keys = ("n", "max_tokens", "max_completion_tokens", "temperature", "top_p", "min_p", "stop", "seed",
                "frequency_penalty", "presence_penalty", "top_k", "repetition_penalty", "ignore_eos", "stop_token_ids", "skip_special_tokens")
        body = {k: getattr(self, k, None) for k in keys if getattr(self, k, None) is not None}
        given = self.max_tokens is not None or getattr(self, "max_completion_tokens", None) is not None  # null: left out
        body["strict_max_tokens"] = self.strict_max_tokens if self.strict_max_tokens is not None else given
        if self.structured_output is not None:
            body["structured_output"] = self.structured_output.to_body()
        return body | ({"logprobs": self.num_logprobs} if self.num_logprobs is not None else {})


def _structure_fields(body: GenerationRequest) -> dict[str, dict[str, Any] | None]:
    """Each structured output field of ``body`` -> the :class:`StructuredOutputParams` keywords
    it asks for (``None``: not asked; ``response_format: text`` asks for nothing)."""
    fmt, so = body.response_format, body.structured_outputs
    from_format = None
    if fmt is not None and fmt.type == "json_object":
        from_format = {"json_object": True}
    elif fmt is not None and fmt.type == "json_schema":
        from_format = {"json": fmt.json_schema.json_schema}
    guided = (("guided_json", "json"), ("guided_regex", "regex"), ("guided_choice", "choice"),
              ("guided_grammar", "grammar"))
    fields = {"response_format": from_format} | {
        name: ({key: getattr(body, name)} if getattr(body, name) is not None else None) for name, key in guided}
    if so is not None:
        chosen = {k.rstrip("_"): v for k, v in so.model_dump().items() if v not in (None, False)}
        fields["structured_outputs"] = chosen or {}  # {}: the constructor names what is missing
    return fields


def _log_ignored(request: str, names: tuple[str, ...]) -> None:
    """Name the body fields a request of type ``request`` ignored, once per set of names while it
    is among the :data:`MAX_LOGGED_IGNORED` sets seen last (a client that sends ``user`` with every
    request logs it once). Names are shown escaped (``repr``: no forged log lines) and cut to
    :data:`MAX_LOGGED_NAME_CHARS` characters, at most :data:`MAX_LOGGED_NAMES` of them, so neither
    the log nor this memory grows with what a body holds."""
    if not names:
        return
    shown = tuple(repr(n[:MAX_LOGGED_NAME_CHARS]) + ("..." if len(n) > MAX_LOGGED_NAME_CHARS else "")
                  for n in names[:MAX_LOGGED_NAMES])
    key = (request, *shown, len(names))
    if key in _LOGGED_IGNORED:
        _LOGGED_IGNORED.move_to_end(key)
        return
    _LOGGED_IGNORED[key] = None
    if len(_LOGGED_IGNORED) > MAX_LOGGED_IGNORED:
        _LOGGED_IGNORED.popitem(last=False)
    more = f" and {len(names) - len(shown)} more" if len(names) > len(shown) else ""
    logger.warning("%s: fields present in the request but ignored: %s%s", request, ", ".join(shown), more)


def _asks(field: str, value: Any) -> bool:
    """Whether a body value of an unsupported field asks for something (``null``, ``best_of: 1``,
    ``echo: false``, empty lists and maps ask for nothing)."""
    if field == "logprobs":  # logprobs: 0 asks for the chosen token's
        return value is not None
    if value in (None, [], {}, False, ""):
        return False
    return not (field == "best_of" and value == 1)


class ChatCompletionRequest(GenerationRequest):
    """``POST /v1/chat/completions``."""

    messages: list[ChatMessageIn] = Field(min_length=1)
    max_completion_tokens: Int | None = Field(default=None, ge=1)
    logprobs: Bool | None = None
    top_logprobs: Int | None = Field(default=None, ge=-1)  # -1: the whole vocabulary (ServeConfig.max_logprobs)

    @model_validator(mode="after")
    def _logprobs_asked(self):
        if self.top_logprobs is not None and not self.logprobs:
            raise ValueError("top_logprobs needs logprobs: true")
        return self

    @property
    def num_logprobs(self) -> int | None:
        """The engine's ``SamplingParams.logprobs`` for this request (``None``: none asked)."""
        return (self.top_logprobs or 0) if self.logprobs else None


COMPLETION_UNSUPPORTED = (*(f for f in UNSUPPORTED if f != "echo"), "suffix", "best_of")
COMPLETION_MAX_TOKENS = 16  # /v1/completions' max_tokens when the body gives none (OpenAI's and vLLM's)


class CompletionRequest(GenerationRequest):
    """``POST /v1/completions``: ``prompt`` is text in the caller's own template (no chat template
    is applied), a list of one such text, or token ids; ``max_tokens`` defaults to 16, as OpenAI's
    and vLLM's do. ``documents`` are placed before the prompt's text; a text prompt that names
    none has the registered documents found in it."""

    prompt: str | Annotated[list[str], Field(min_length=1, max_length=1)] | Annotated[list[int], Field(min_length=1)]
    max_tokens: Int | None = Field(default=None, ge=1)  # None (left out or null): 16, OpenAI's and vLLM's default
    logprobs: Int | None = Field(default=None, ge=0)  # the legacy API's: the most likely tokens per position
    echo: Bool = False  # the prompt (as sent: text, or token ids decoded) before each answer's text
    unsupported: ClassVar[tuple[str, ...]] = COMPLETION_UNSUPPORTED

    @model_validator(mode="after")
    def _echo_without_logprobs(self):
        if self.echo and self.logprobs is not None:
            raise ValueError("echo with logprobs needs the prompt's log-probabilities, which this server does not "
                             "compute; ask for one or the other")
        return self

    @property
    def num_logprobs(self) -> int | None:
        return self.logprobs

    def sampling_body(self) -> dict[str, Any]:
        return {"max_tokens": COMPLETION_MAX_TOKENS} | super().sampling_body()

    @property
    def prompt_value(self) -> str | list[int]:
        """The prompt: text, or token ids."""
        if isinstance(self.prompt, list) and isinstance(self.prompt[0], str):
            return self.prompt[0]
        return self.prompt
