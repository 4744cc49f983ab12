"""Command line: ``lazyattn ask``, ``lazyattn info`` (and ``lazyattn chat`` with the integrations)."""

from __future__ import annotations

import json
import sys
from pathlib import Path
from typing import Optional

import typer

from lazyattn_rag import cli_options as cli_opts

app = typer.Typer(add_completion=False, no_args_is_help=True,
                  help="Retrieval-augmented generation with position-agnostic KV reuse (LazyAttention).")


def _format_stats(stats) -> str:
    ttft = f"{stats.ttft_ms:.0f} ms" if stats.ttft_ms is not None else "n/a"
    return (f"[docs hit {len(stats.docs_hit)}, missed {len(stats.docs_missed)} | prompt tokens "
            f"{stats.num_prompt_tokens}: cached {stats.num_cached_tokens}, computed {stats.num_computed_tokens} | "
            f"TTFT {ttft} | {stats.num_output_tokens} output tokens]")


@app.command()
def ask(
    question: str = typer.Argument(..., help="The question to answer."),
    doc: list[Path] = typer.Option([], "--doc", "-d", exists=True, dir_okay=False, readable=True,
                                   help="A text file to use as a document (repeatable); its path is its id."),
    max_tokens: int = typer.Option(256, help="Most tokens to generate."),
    temperature: float = typer.Option(0.0, help="0 for greedy decoding."),
    seed: Optional[int] = typer.Option(None, help="Sampling seed."),
    model: Optional[str] = cli_opts.MODEL,
    device: str = cli_opts.DEVICE,
    backend: str = cli_opts.BACKEND,
    anchor: str = cli_opts.ANCHOR,
    cache_dir: Optional[Path] = typer.Option(None, help="Where converted models are cached."),
    as_json: bool = typer.Option(False, "--json", help="Print one JSON object instead of streaming text."),
) -> None:
    """Answer QUESTION over the given documents, streaming the answer, then print the cache stats."""
    from lazyattn_rag import LazyAttention, LazyAttentionError, SamplingParams

    try:
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, seed=seed)
        llm = LazyAttention(cli_opts.engine_config(model, device, backend, anchor, cache_dir))
        ids = []
        for path in doc:
            llm.add_document(str(path), path.read_text(encoding="utf-8"))
            ids.append(str(path))
        pieces, final = [], None
        for delta in llm.stream(question, ids, sampling=params):
            pieces.append(delta.text)
            if not as_json:
                sys.stdout.write(delta.text)
                sys.stdout.flush()
            final = delta
    except (LazyAttentionError, ValueError, FileNotFoundError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    if as_json:
        typer.echo(json.dumps({"answer": "".join(pieces), "finish_reason": final.finish_reason,
                               "stats": final.stats.as_dict()}))
    else:
        typer.echo("")
        typer.echo(_format_stats(final.stats), err=True)


@app.command()
def info(
    model: Optional[str] = cli_opts.MODEL,
    device: str = cli_opts.DEVICE,
    backend: str = cli_opts.BACKEND,
    anchor: str = cli_opts.ANCHOR,
    cache_dir: Optional[Path] = typer.Option(None, help="Where converted models are cached."),
) -> None:
    """Print the model, attention backend and cache configuration as JSON."""
    from lazyattn_rag import LazyAttention

    try:
        llm = LazyAttention(cli_opts.engine_config(model, device, backend, anchor, cache_dir))
    except (ValueError, FileNotFoundError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    typer.echo(json.dumps(llm.info(), indent=2))


def _register_chat() -> None:  # the chatbot's options live with it; its extras load only when it runs
    from lazyattn_rag.cli_chat import chat as chat_command

    app.command("chat")(chat_command)


_register_chat()

if __name__ == "__main__":
    app()
