"""``lazyattn serve``: an OpenAI-compatible HTTP API over engine replicas on Ray Serve, with
document-affinity routing (issue 18). Needs the ``serve`` extra (``pip install lazyattn-rag[serve]``)."""

from lazyattn_rag.serve.config import ServeConfig

__all__ = ["ServeConfig", "build_app", "run"]


def __getattr__(name: str):  # Ray loads only when the app is built
    if name in ("build_app", "run"):
        from lazyattn_rag.serve import app

        return getattr(app, name)
    raise AttributeError(name)
