"""Command line: ``lazyattn ask``, ``lazyattn info``, ``lazyattn chat`` (with the integrations),
``lazyattn serve`` (with the ``serve`` extra) and ``lazyattn cache``."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from lazyattn_rag import cli_options as cli_opts
from lazyattn_rag import cli_runtime  # noqa: F401  (process settings, set before torch loads)
from lazyattn_rag.types.documents import NotUTF8Error, read_text_file

app = typer.Typer(add_completion=False, no_args_is_help=True, cls=cli_opts.Group, rich_markup_mode=cli_opts.HELP_MARKUP,
                  help="Retrieval-augmented generation with position-agnostic KV reuse (LazyAttention).")
LONG_FILE_HINT = "lazyattn chat --docs {path} splits long files into chunks and retrieves the relevant ones"


def _version(value: bool) -> None:
    if value:
        from importlib.metadata import PackageNotFoundError, version

        try:
            typer.echo(f"lazyattn-rag {version('lazyattn-rag')}")
        except PackageNotFoundError:  # run from a source tree that was never installed
            typer.echo("lazyattn-rag (not installed: no distribution metadata; pip install -e .)")
        raise typer.Exit()


@app.callback()
def main(
    version: bool = typer.Option(False, "--version", metavar=cli_opts.FLAG, is_eager=True, callback=_version,
                                 help="Print the installed version and exit."),
) -> None:
    """Retrieval-augmented generation with position-agnostic KV reuse (LazyAttention)."""


def _fail(message: str, code: int = 2) -> typer.Exit:
    typer.echo(f"error: {message}", err=True)
    return typer.Exit(code)


def _read_documents(paths: list[Path]) -> list[tuple[str, str]]:
    """``(id, text)`` of every ``--doc`` file, read and checked before the model loads.

    Raises:
        ValueError: a file that is not UTF-8 text or holds no text; the message names it and
            says what to do.
    """
    docs = []
    for path in paths:
        try:
            text = read_text_file(path)
        except NotUTF8Error as e:
            converted = path.with_name(f"{path.stem}.utf8{path.suffix}")
            raise ValueError(f"{e}: convert it first, e.g. iconv -f latin1 -t utf-8 {path} > {converted}") from e
        if not text.strip():
            raise ValueError(f"{path} is empty: a document needs some text (drop this --doc, or fill the file)")
        docs.append((str(path), text))
    return docs


NO_DOCUMENTS = "no documents (answered from the model alone; add some with --doc FILE)"


@app.command(cls=cli_opts.Command)
@cli_opts.with_engine_options(after=("as_json",))
def ask(
    question: str = typer.Argument(..., metavar="QUESTION", help="The question to answer."),
    doc: list[Path] = typer.Option([], "--doc", "-d", exists=True, dir_okay=False, readable=True, metavar="FILE",
                                   help="A UTF-8 text file to use as a document (repeatable); its path is its id. "
                                        "Without one the model answers alone."),
    max_tokens: int = typer.Option(256, help="Most tokens to generate."),
    temperature: Optional[float] = cli_opts.TEMPERATURE,
    top_p: Optional[float] = cli_opts.TOP_P,
    repetition_penalty: Optional[float] = cli_opts.REPETITION_PENALTY,
    loop_guard: int = cli_opts.LOOP_GUARD,
    seed: Optional[int] = typer.Option(None, help="Sampling seed."),
    as_json: bool = typer.Option(False, "--json", metavar=cli_opts.FLAG,
                                 help="Print one JSON object instead of streaming text."),
    engine: cli_opts.EngineOptions = cli_opts.EngineOptions(),
) -> None:
    """Answer QUESTION over the given documents, streaming the answer, then print the cache stats."""
    try:  # every input is checked before the model loads
        if not question.strip():
            raise ValueError("the question is empty")
        overrides = cli_opts.sampling_overrides(temperature, top_p, repetition_penalty, max_tokens=max_tokens,
                                                seed=seed, loop_guard_ngram=loop_guard or None)
        documents = _read_documents(doc)
        config = engine.config()
    except (ValueError, OSError) as e:
        raise _fail(str(e)) from e
    from lazyattn_rag import DocumentTooLongError, LazyAttention, LazyAttentionError, PromptTooLongError

    try:
        llm = LazyAttention(config)
        params = cli_opts.with_overrides(llm.default_sampling, overrides)
        ids = []
        for doc_id, text in documents:
            try:
                llm.add_document(doc_id, text)
            except DocumentTooLongError as e:
                raise DocumentTooLongError(f"{e}; {LONG_FILE_HINT.format(path=doc_id)}") from e
            ids.append(doc_id)
        try:
            stream = llm.stream(question, ids, sampling=params)
        except PromptTooLongError as e:
            raise PromptTooLongError(f"{e}; pass fewer --doc files, or {LONG_FILE_HINT.format(path='FOLDER')}") from e
        pieces, final = [], None
        for delta in stream:
            pieces.append(delta.text)
            if not as_json:
                sys.stdout.write(delta.text)
                sys.stdout.flush()
            final = delta
    except (LazyAttentionError, ValueError, FileNotFoundError) as e:
        raise _fail(str(e)) from e
    except KeyboardInterrupt as e:
        raise _fail("interrupted", 130) from e
    if as_json:
        typer.echo(json.dumps({"answer": "".join(pieces), "finish_reason": final.finish_reason,
                               "stats": final.stats.as_dict()}))
    else:
        typer.echo("")
        typer.echo(final.stats.summary(NO_DOCUMENTS), err=True)


@app.command(cls=cli_opts.Command)
@cli_opts.with_engine_options()
def info(engine: cli_opts.EngineOptions = cli_opts.EngineOptions()) -> None:
    """Print the model, attention backend and cache configuration as JSON.

    anchor_tokens: what every document is encoded after; prompt_head_tokens: the text before them.

    cached_chunks: what the KV cache holds, by kind (a fresh engine: only the anchor).
    """
    from lazyattn_rag import LazyAttention

    try:
        llm = LazyAttention(engine.config())
    except (ValueError, FileNotFoundError) as e:
        raise _fail(str(e)) from e
    except KeyboardInterrupt as e:
        raise _fail("interrupted", 130) from e
    typer.echo(json.dumps(llm.info(), indent=2))


def _register_chat() -> None:  # the chatbot's options live with it; its extras load only when it runs
    from lazyattn_rag.cli_chat import chat as chat_command

    app.command("chat", cls=cli_opts.Command)(chat_command)


_register_chat()


def _register_serve() -> None:  # Ray loads only when the server starts
    from lazyattn_rag.cli_serve import serve as serve_command

    app.command("serve", cls=cli_opts.Command)(serve_command)


_register_serve()


def _register_cache() -> None:
    from lazyattn_rag.cli_cache import app as cache_app

    app.add_typer(cache_app, name="cache")


_register_cache()

if __name__ == "__main__":
    app()
