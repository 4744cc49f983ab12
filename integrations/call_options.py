"""What the framework wrappers share: their settings fields, per-call options, the engine they run on.

Both :class:`~lazyattn_rag.integrations.llamaindex.LazyAttentionLLM` and
:class:`~lazyattn_rag.integrations.langchain.ChatLazyAttention` are constructible from plain
settings, as the frameworks' own LLM classes are (``model``, ``temperature``, ``max_tokens``,
``top_p``, ``stop``, ``context_window``; ``sampling_kwargs`` and ``engine_kwargs`` for the rest):
the engine is :meth:`LazyAttention.shared` for that configuration, built on first use. A call
may override any :class:`~lazyattn_rag.types.sampling_params.SamplingParams` field by keyword (or pass a
whole ``sampling=``); any other keyword is an error naming the accepted ones.
"""

from __future__ import annotations

import dataclasses
from typing import TYPE_CHECKING, Any

from pydantic import BaseModel, Field, PrivateAttr, SecretStr

from lazyattn_rag.types.config import EngineConfig, RequestRemedies
from lazyattn_rag.types.sampling_params import SamplingParams

if TYPE_CHECKING:
    from lazyattn_rag.llm import LazyAttention

# logprobs and n: the wrappers hand the frameworks neither log-probabilities nor several answers
# (use LazyAttention directly).
SAMPLING_FIELDS = tuple(f.name for f in dataclasses.fields(SamplingParams) if f.name not in ("logprobs", "n"))
FIRST_CLASS = ("temperature", "max_tokens", "top_p", "stop")  # wrapper fields; the rest go in sampling_kwargs


def split_sampling(sampling: SamplingParams) -> dict[str, Any]:
    """A :class:`SamplingParams` as wrapper fields: the first-class ones and ``sampling_kwargs``
    (only the fields that differ from the defaults)."""
    default = SamplingParams()
    values = {f: getattr(sampling, f) for f in SAMPLING_FIELDS}
    out = {f: (list(values[f]) if f == "stop" else values[f]) for f in FIRST_CLASS}
    out["sampling_kwargs"] = {f: (list(v) if isinstance(v, tuple) else v) for f, v in values.items()
                              if f not in FIRST_CLASS and v != getattr(default, f)}
    return out


def with_sampling(sampling: SamplingParams | None, kwargs: dict[str, Any]) -> dict[str, Any]:
    """A wrapper's constructor keywords with a whole ``sampling=`` spread into its fields (the
    keywords given win)."""
    return kwargs if sampling is None else {**split_sampling(sampling), **kwargs}


def default_sampling(temperature: float, max_tokens: int, top_p: float, stop: list[str] | tuple[str, ...],
                     sampling_kwargs: dict[str, Any]) -> SamplingParams:
    """The wrapper's default sampling.

    Raises:
        ValueError: an unknown ``sampling_kwargs`` key (accepted ones named) or a value out of range.
    """
    unknown = sorted(set(sampling_kwargs) - set(SAMPLING_FIELDS) | set(sampling_kwargs) & set(FIRST_CLASS))
    if unknown:
        raise ValueError(f"unknown sampling_kwargs {unknown}; accepted: "
                         f"{[f for f in SAMPLING_FIELDS if f not in FIRST_CLASS]}")
    return SamplingParams(temperature=temperature, max_tokens=max_tokens, top_p=top_p, stop=tuple(stop),
                          **sampling_kwargs)


def call_sampling(base: SamplingParams, kwargs: dict[str, Any], who: str, ignored: tuple[str, ...] = (),
                  extra_stop: list[str] | None = None) -> SamplingParams:
    """The sampling of one call: ``base`` with the call's keyword overrides.

    Args:
        base: the wrapper's default.
        kwargs: the call's keyword arguments: ``sampling`` (a whole :class:`SamplingParams`) and/or
            any of its fields; ``stop`` strings are added to the default's.
        who: the caller's name for messages.
        ignored: framework keywords accepted and handled elsewhere (e.g. ``documents``).
        extra_stop: stop strings the framework passes separately (LangChain's ``stop``).
    Raises:
        TypeError: an unknown keyword (named, with the accepted ones).
        ValueError: a value out of range (from :class:`SamplingParams`).
    """
    unknown = sorted(k for k in kwargs if k not in SAMPLING_FIELDS and k != "sampling" and k not in ignored)
    if unknown:
        raise TypeError(f"{who} got unsupported keyword argument(s) {unknown}; accepted: "
                        f"{sorted(('sampling', *SAMPLING_FIELDS, *ignored))}")
    sampling = kwargs.get("sampling") or base
    if sampling.logprobs is not None:
        raise ValueError(f"{who}: logprobs are not returned through the framework wrappers; "
                         "use lazyattn_rag.LazyAttention directly")
    overrides = {k: v for k, v in kwargs.items() if k in SAMPLING_FIELDS and v is not None}
    stop = list(sampling.stop) + _strings(overrides.pop("stop", ())) + _strings(extra_stop or ())
    return dataclasses.replace(sampling, **overrides, stop=tuple(dict.fromkeys(stop)))


def _strings(value: Any) -> list[str]:
    return [value] if isinstance(value, str) else list(value)


def engine_config(model: str | None, context_window: int | None, engine_kwargs: dict[str, Any]) -> EngineConfig:
    """The :class:`EngineConfig` of a wrapper's settings (``engine_kwargs`` as :meth:`EngineConfig.from_dict`).

    Raises:
        ValueError: ``engine_kwargs`` names ``model`` or ``max_model_len`` (use the wrapper's
            fields), or an unknown field.
    """
    clash = sorted({"model", "max_model_len"} & set(engine_kwargs))
    if clash:
        raise ValueError(f"set {clash} through the wrapper's model / context_window fields, not engine_kwargs")
    return EngineConfig.from_dict({**engine_kwargs, "model": model, "max_model_len": context_window})


class WrapperSettings(BaseModel):
    """The settings fields both framework wrappers share, and the engine they give (a pydantic
    mixin; see the module).

    Attributes:
        model: local Hugging Face directory, or ``None`` for the offline default SmolLM2.
        context_window: context limit in tokens (``None``: the model's).
        temperature, max_tokens, top_p, stop: default sampling.
        sampling_kwargs: other :class:`SamplingParams` fields (``top_k``, ``seed``, ...).
        engine_kwargs: other :class:`~lazyattn_rag.types.config.EngineConfig` fields as a dict
            (``device``, ``dtype``, ``cache``: {``anchor``, ...}, ...).
        namespace: the tenant namespace of every document this wrapper registers and places
            (``""``: shared). Ids resolve within it and its chunks are keyed apart, so a tenant is
            never served another tenant's document or cached K/V (``LazyAttention.add_document``).
        server_url: a ``lazyattn serve`` server (``http://host:port``): calls go there through
            :class:`~lazyattn_rag.remote.RemoteLazyAttention` instead of an in-process engine
            (``model`` and ``engine_kwargs`` are then the server's business).
        api_key: the server's key (``lazyattn serve --api-key``/``--api-key-file``), sent as
            ``Authorization: Bearer``; a key bound to namespaces decides the namespace.
        recompute_chunk_head_tokens, recompute_selective_ratio, chunk_attention_scaling: this
            wrapper's answer-fidelity remedy, asked per request of the engine (``None``: the
            engine's ``CacheConfig``), so wrappers with different remedies share one engine
            (:class:`~lazyattn_rag.types.config.RequestRemedies`; docs/quality.md). Checked at the
            first call (e.g. two remedies at once, or a remedy on an engine not in ``lazy`` mode).
    """

    model: str | None = Field(default=None, description="Local HF model directory; None: the offline SmolLM2.")
    context_window: int | None = Field(default=None, description="Context limit in tokens; None: the model's.")
    temperature: float = Field(default=0.0, ge=0.0, description="0 is greedy.")
    max_tokens: int = Field(default=256, ge=1, description="Most tokens to generate.")
    top_p: float = Field(default=1.0, gt=0.0, le=1.0, description="Nucleus mass.")
    stop: list[str] = Field(default_factory=list, description="Stop strings.")
    sampling_kwargs: dict[str, Any] = Field(default_factory=dict, description="Other SamplingParams fields.")
    engine_kwargs: dict[str, Any] = Field(default_factory=dict, description="Other EngineConfig fields.")
    namespace: str = Field(default="", pattern=r"^[A-Za-z0-9_.:@/-]{0,128}$",
                           description="Tenant namespace of the documents; '' is shared.")
    server_url: str | None = Field(default=None, pattern=r"^https?://",
                                   description="A `lazyattn serve` server to use instead of an in-process engine.")
    api_key: SecretStr | None = Field(default=None, description="The `lazyattn serve` server's API key.")
    recompute_chunk_head_tokens: int | None = Field(
        default=None, ge=0, description="Chunk-head recompute: the first K tokens of each document computed; "
                                        "None: the engine's.")
    recompute_selective_ratio: float | None = Field(
        default=None, ge=0.0, le=1.0, description="Selective recompute's share of document tokens; None: the engine's.")
    chunk_attention_scaling: bool | None = Field(
        default=None, description="Chunk attention scaling on or off; None: the engine's.")

    _engine: Any = PrivateAttr(default=None)  # the LazyAttention in use
    _from_settings: bool = PrivateAttr(default=False)

    def _use_settings(self, engine: Any) -> None:
        """After construction: validate the settings now, and take ``engine`` if one was given."""
        self.check_settings()
        self._engine = engine

    @property
    def engine(self) -> "LazyAttention":
        """The engine: the one given, or the process's shared one for the settings (built on
        first use, and again after it was shut down)."""
        from lazyattn_rag.llm import LazyAttention

        if self._engine is None and self.server_url:
            self._engine = remote_engine(self.server_url,
                                         None if self.api_key is None else self.api_key.get_secret_value())
        if self._engine is None or (self._from_settings and self._engine.loop.stopped):
            self._engine, self._from_settings = LazyAttention.shared(self.engine_settings()), True
        return self._engine

    @property
    def remedies(self) -> RequestRemedies:
        """The :class:`RequestRemedies` every call of this wrapper asks for."""
        return RequestRemedies(self.recompute_chunk_head_tokens, self.recompute_selective_ratio,
                               self.chunk_attention_scaling)

    @property
    def sampling(self) -> SamplingParams:
        """The default :class:`SamplingParams` of calls."""
        return default_sampling(self.temperature, self.max_tokens, self.top_p, self.stop, self.sampling_kwargs)

    def engine_settings(self, model: str | None = None) -> EngineConfig:
        """The :class:`EngineConfig` of these settings (``model`` overrides the field)."""
        return engine_config(model or self.model, self.context_window, self.engine_kwargs)

    def check_settings(self) -> None:
        """Raise now for settings that would fail at the first call (see :func:`default_sampling`,
        :func:`engine_config`)."""
        self.sampling  # noqa: B018 - builds and validates the SamplingParams
        self.engine_settings()


_REMOTES: dict[tuple[str, str | None], Any] = {}


def remote_engine(url: str, api_key: str | None = None):
    """The process's :class:`~lazyattn_rag.remote.RemoteLazyAttention` for ``url`` and ``api_key``
    (one per server and key)."""
    from lazyattn_rag.remote import RemoteLazyAttention

    key = (url.rstrip("/"), api_key)
    if key not in _REMOTES:
        _REMOTES[key] = RemoteLazyAttention(key[0], api_key=api_key)
    return _REMOTES[key]
