"""Shared test setup. Kernels run under Triton's interpreter when no CUDA device is present; this
must be set before anything imports triton, so it lives at the top of the first conftest."""

import os

import torch

if not torch.cuda.is_available():
    os.environ["TRITON_INTERPRET"] = "1"
    from tests import interpreter_patching

    interpreter_patching.install()  # helpers' calls skip re-patching triton.language (see its docstring)


import pytest  # noqa: E402


@pytest.fixture(scope="session")
def smollm2_dir(tmp_path_factory):
    """The default SmolLM2 converted to safetensors (once per session; uses the user cache dir)."""
    from lazyattn_rag.types.config import EngineConfig
    from lazyattn_rag.engine.model.model_loading import resolve_model

    return resolve_model(None, EngineConfig().resolved_cache_dir()).path


@pytest.fixture(scope="session")
def smollm2(smollm2_dir):
    """One shared LazyAttention over the default model (CPU, float32, torch backend)."""
    from lazyattn_rag.llm import LazyAttention

    from lazyattn_rag import EngineConfig
    from tests.integrations_kit import SMOLLM2_ENGINE_KWARGS

    return LazyAttention.shared(EngineConfig.from_dict(SMOLLM2_ENGINE_KWARGS))


@pytest.fixture(scope="session")
def tiny_model():
    """``(hf, ours)``: the default tiny random Llama (``hf_config()``, seed 0) in transformers and
    as our ``CausalLM``, built once and shared by the tests that only read it (engines over it
    leave its weights alone)."""
    from tests.tiny import hf_and_ours, hf_config

    return hf_and_ours(hf_config())


@pytest.fixture
def make_llm():
    """``make_llm(family="llama", seed=0, model_config=None, model=None, **config) -> (hf, llm)``:
    a tiny random model of ``family`` (``hf_config(family, **model_config)``) and a
    :class:`LazyAttention` over it configured by ``tests/tiny.py: tiny_config(**config)``; with
    ``model=`` (a ``CausalLM``), an engine over that one and ``hf`` is ``None``. Every engine it
    built is shut down after the test. A module narrows the defaults by overriding the fixture,
    e.g. ``functools.partial(make_llm, anchor="none")``."""
    from tests.tiny import hf_and_ours, hf_config, tiny_llm

    built = []

    def make(family: str = "llama", seed: int = 0, model_config: dict | None = None, model=None, **config):
        hf = None
        if model is None:
            hf, model = hf_and_ours(hf_config(family, **(model_config or {})), seed=seed)
        built.append(llm := tiny_llm(model, **config))
        return hf, llm

    yield make
    for llm in built:
        llm.shutdown()


@pytest.fixture
def redis_server(tmp_path):
    """A fresh ``redis-server`` on a free loopback port (``tests/redis_server.py: RedisServer``:
    ``.url``, ``.port``, ``.stop()``, ``.start()`` again on the same port), stopped after the test.
    Without ``redis-server`` on PATH the test fails when ``CI=true`` (CI must run it: ``.ci/run``
    installs it) and is skipped elsewhere."""
    yield from _redis_server(tmp_path / "redis")


@pytest.fixture(scope="module")
def module_redis_server(tmp_path_factory):
    """:func:`redis_server` for a whole module (the ``lazyattn serve`` modules start one app each)."""
    yield from _redis_server(tmp_path_factory.mktemp("redis"))


def _redis_server(directory):
    from tests.redis_server import RedisServer, redis_server_path

    executable = redis_server_path()
    if executable is None:
        message = "redis-server is not on PATH (Debian/Ubuntu: apt-get install redis-server)"
        if os.environ.get("CI", "").lower() == "true":
            pytest.fail(f"{message}; CI must run the Redis tier's tests", pytrace=False)
        pytest.skip(message)
    server = RedisServer(directory, executable=executable)
    server.start()
    try:
        yield server
    finally:
        server.stop()


@pytest.fixture(scope="module")
def serve_cluster():
    """``(base_url, port)``: a local Ray cluster with Serve's proxy on loopback, shared by the
    test modules that use it (``tests/redis_server.py: SharedServe``; started by the first, stopped
    after the last); each module deploys its application under its own name and deletes it at
    its end."""
    from tests.redis_server import SHARED_SERVE

    return SHARED_SERVE.start()


_LAST_SERVE_CLUSTER_TEST: list[str] = []  # node id of the last collected test that uses serve_cluster


def pytest_collection_modifyitems(session, config, items):
    users = [item.nodeid for item in items if "serve_cluster" in getattr(item, "fixturenames", ())]
    _LAST_SERVE_CLUSTER_TEST[:] = users[-1:]


@pytest.hookimpl(trylast=True)
def pytest_runtest_teardown(item, nextitem):
    """After the last test that uses ``serve_cluster`` (and its module's own teardown), or at the
    end: shut the shared cluster down (the modules between its users keep it running)."""
    if nextitem is None or item.nodeid in _LAST_SERVE_CLUSTER_TEST:
        import sys

        shared = sys.modules.get("tests.redis_server")
        if shared is not None:
            shared.SHARED_SERVE.stop()
