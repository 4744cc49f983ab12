"""``with_structured_output`` for :class:`~lazyattn_rag.integrations.langchain.ChatLazyAttention`:
the schema becomes the engine's token mask (``SamplingParams.structured_output``), so the answer
is JSON that parses into it, not a request in the prompt that a small model may ignore.

``method="json_schema"`` (the default) constrains the answer to the schema (a Pydantic class, a
``TypedDict`` or a JSON schema dict); ``"function_calling"`` does the same (there is no tool-call
message: the schema's arguments are the answer, as the caller of that method receives them);
``"json_mode"`` allows any JSON object (the prompt should name the keys). As LangChain's own chat models do,
``include_raw=True`` returns ``{"raw", "parsed", "parsing_error"}`` instead of raising when the
answer does not parse (e.g. cut off by ``max_tokens``).
"""

from __future__ import annotations

from operator import itemgetter
from typing import Any

from langchain_core.language_models import BaseChatModel
from langchain_core.output_parsers import JsonOutputParser, PydanticOutputParser
from langchain_core.runnables import Runnable, RunnableMap, RunnablePassthrough
from langchain_core.utils.function_calling import convert_to_json_schema
from langchain_core.utils.pydantic import is_basemodel_subclass

from lazyattn_rag.types.structured_output import StructuredOutputParams

METHODS = ("json_schema", "function_calling", "json_mode")


def structured_runnable(model: BaseChatModel, schema: Any, method: str = "json_schema", include_raw: bool = False,
                        strict: bool | None = None, call_kwargs: dict[str, Any] | None = None) -> Runnable:
    """``model`` bound to answer in ``schema`` (and to ``call_kwargs``), then parsed (a ``schema``
    instance for a Pydantic class, a dict otherwise).

    Raises:
        ValueError: an unknown ``method``, or no ``schema`` but for ``json_mode``.
    """
    if method not in METHODS:
        raise ValueError(f"unknown method {method!r}; accepted: {', '.join(METHODS)}")
    if schema is None and method != "json_mode":
        raise ValueError(f"method={method!r} needs a schema (a Pydantic class, a TypedDict or a JSON schema dict)")
    json_schema = convert_to_json_schema(schema) if schema is not None else None
    constraint = (StructuredOutputParams(json_object=True) if method == "json_mode"
                  else StructuredOutputParams(json=json_schema))
    bound = model.bind(structured_output=constraint, ls_structured_output_format={
        "kwargs": {"method": method, "strict": strict}, "schema": json_schema}, **(call_kwargs or {}))
    is_pydantic = isinstance(schema, type) and is_basemodel_subclass(schema)
    parser = PydanticOutputParser(pydantic_object=schema) if is_pydantic else JsonOutputParser()
    if not include_raw:
        return bound | parser
    parsed = RunnablePassthrough.assign(parsed=itemgetter("raw") | parser, parsing_error=lambda _: None)
    unparsed = RunnablePassthrough.assign(parsed=lambda _: None)
    return RunnableMap(raw=bound) | parsed.with_fallbacks([unparsed], exception_key="parsing_error")
