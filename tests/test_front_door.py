"""The four front doors keep one interface (lazyattn_rag/types/front_door.py): every method of
the protocol exists on each class with the protocol's parameters (names, kinds, defaults), and
an engine and its ``aio()`` satisfy the runtime-checkable protocols."""

import inspect

import pytest

from lazyattn_rag.async_llm import AsyncLazyAttention
from lazyattn_rag.llm import LazyAttention
from lazyattn_rag.remote import AsyncRemoteLazyAttention, RemoteLazyAttention
from lazyattn_rag.types.front_door import AsyncFrontDoor, FrontDoor


def _methods(protocol) -> list[str]:
    return [name for name, value in vars(protocol).items() if callable(value) and not name.startswith("_")]


def _shape(function) -> list[tuple]:
    return [(p.name, p.kind, p.default) for p in list(inspect.signature(function).parameters.values())[1:]]


@pytest.mark.parametrize("protocol, cls", [(FrontDoor, LazyAttention), (FrontDoor, RemoteLazyAttention),
                                           (AsyncFrontDoor, AsyncLazyAttention),
                                           (AsyncFrontDoor, AsyncRemoteLazyAttention)])
def test_each_front_door_has_the_protocols_methods_with_its_parameters(protocol, cls):
    methods = _methods(protocol)
    assert {"stream", "stream_chat", "generate", "chat"} <= set(methods)
    for name in methods:
        assert hasattr(cls, name), f"{cls.__name__} lacks {name}"
        assert _shape(getattr(cls, name)) == _shape(getattr(protocol, name)), f"{cls.__name__}.{name}"
        wants_async = inspect.iscoroutinefunction(getattr(protocol, name))
        assert inspect.iscoroutinefunction(getattr(cls, name)) == wants_async, f"{cls.__name__}.{name}"


def test_an_engine_and_its_aio_satisfy_the_protocols(make_llm):
    _, llm = make_llm()
    assert isinstance(llm, FrontDoor) and isinstance(llm.aio(), AsyncFrontDoor)
    assert isinstance(llm.aio(), AsyncLazyAttention) and llm.aio().llm is llm
