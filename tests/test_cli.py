"""The command line's error paths and conventions (issue 15, items 4-6), fast: bad input is refused
before the model loads (``LazyAttention.__init__`` is made to fail, so reaching it shows), and the
commands that need an engine run on the tiny random model.

The interactive chat runs :func:`run_chat` with a fake stdin over a tiny ``--docs`` folder (the
offline MiniLM embedder, loaded once) and the tiny engine; Ctrl-C is a ``KeyboardInterrupt``
raised where a real one lands: in the wait for the next token, in the chat's own printing, at
the prompt.
"""

from __future__ import annotations

import functools
import io
import json
import os
import subprocess
import sys
import time
from importlib.metadata import version
from pathlib import Path

import pytest
from typer.testing import CliRunner

from lazyattn_rag import RequestStats, SamplingParams
from lazyattn_rag.cli import NO_DOCUMENTS, app
from lazyattn_rag.integrations.chatbot import ChatOptions, run_chat
from lazyattn_rag.integrations.corpus import JSONL_SUFFIXES, TEXT_SUFFIXES, folder_sources
from lazyattn_rag.llm import LazyAttention, RequestStream
from lazyattn_rag.types.sampling_params import CHAT_LOOP_GUARD_NGRAM
from tests.integrations_kit import CORPUS, tiny_engine
from tests.observe import StepLog
from tests.tiny import words

LATIN1 = "Caf\xe9 au lait is coffee with hot milk.\n".encode("latin-1")  # 0xe9 at offset 3: not UTF-8


def runner() -> CliRunner:
    return CliRunner(env={"COLUMNS": "200", "NO_COLOR": "1"})  # help on one line per option


class ModelLoaded(Exception):
    pass


@pytest.fixture
def no_model(monkeypatch):
    """Loading a model fails the command loudly; ``calls`` records each attempt."""
    calls = []

    def init(self, config=None):
        calls.append(config)
        raise ModelLoaded("the model was loaded before the input was checked")

    monkeypatch.setattr(LazyAttention, "__init__", init)

    def embed(*args, **kwargs):
        calls.append("embedding model")
        raise ModelLoaded("the embedding model was loaded before the input was checked")

    monkeypatch.setattr("lazyattn_rag.integrations.chatbot.llamaindex_embedding", embed)
    return calls


@pytest.fixture
def tiny_model(monkeypatch):
    """``lazyattn ask`` / ``info`` build the tiny random engine (context limit 128 tokens)."""
    monkeypatch.setattr("lazyattn_rag.llm.LazyAttention", lambda config: tiny_engine(max_model_len=128))


# --- conventions -----------------------------------------------------------------------------------
def test_version_comes_from_the_installed_distribution():
    result = runner().invoke(app, ["--version"])
    assert result.exit_code == 0 and result.output.strip() == f"lazyattn-rag {version('lazyattn-rag')}"


@pytest.mark.parametrize("command", [[], ["ask"], ["info"], ["chat"]])
def test_help_shows_boolean_flags_as_flags(command):
    out = runner().invoke(app, [*command, "--help"]).output
    assert "<bool>" not in out and "--help " in out
    flags = {(): ["--version"], ("ask",): ["--json"], ("info",): [],
             ("chat",): ["--follow-up", "--demo", "--rebuild"]}[tuple(command)]
    for flag in flags:
        [line] = [line for line in out.splitlines() if f"{flag} " in line]
        assert line.split(flag, 1)[1].lstrip(" │")[0].isupper(), line  # the help text follows, no type


def test_no_help_shows_a_python_list_type():
    for command in ([], ["ask"], ["info"], ["chat"], ["serve"], ["cache", "info"], ["cache", "clear"],
                    ["cache", "warm"]):
        result = runner().invoke(app, [*command, "--help"])
        assert result.exit_code == 0 and "<list" not in result.output, (command, result.output)


def test_chat_help_lists_every_accepted_docs_suffix():
    """Every suffix is listed, and at 80 columns none is cut to an ellipsis (a slash-joined list
    has no place to wrap)."""
    out = runner().invoke(app, ["chat", "--help"], env={"COLUMNS": "80"}).output
    assert set(TEXT_SUFFIXES) == {".txt", ".md", ".markdown", ".rst"}
    options = out[out.index("Options:"):]
    docs_help = options[options.index("--docs"):options.index("--top-k")]
    words = set(docs_help.replace(",", " ").split())
    assert set(TEXT_SUFFIXES + JSONL_SUFFIXES) <= words, docs_help
    assert "…" not in docs_help and max(map(len, out.splitlines())) <= 80


# --- ask: inputs checked before the model loads -----------------------------------------------------
def test_ask_refuses_a_non_utf8_doc_naming_it_before_the_model_loads(tmp_path, no_model):
    good, bad = tmp_path / "good.txt", tmp_path / "notes.txt"
    good.write_text("Plain text.", encoding="utf-8")
    bad.write_bytes(LATIN1)
    result = runner().invoke(app, ["ask", "What is it?", "--doc", str(good), "--doc", str(bad)])
    assert result.exit_code == 2 and no_model == []
    assert f"error: {bad} is not UTF-8 text (byte 0xe9 at offset 3)" in result.output
    assert f"iconv -f latin1 -t utf-8 {bad} > {tmp_path / 'notes.utf8.txt'}" in result.output  # what to do


@pytest.mark.parametrize("text", ["", " \n\n\t"])
def test_ask_refuses_an_empty_doc_naming_it_before_the_model_loads(tmp_path, no_model, text):
    empty = tmp_path / "empty.md"
    empty.write_text(text, encoding="utf-8")
    result = runner().invoke(app, ["ask", "What is it?", "--doc", str(empty)])
    assert result.exit_code == 2 and no_model == []
    assert f"error: {empty} is empty" in result.output


def test_ask_refuses_an_empty_question_and_a_missing_or_folder_doc_before_the_model_loads(tmp_path, no_model):
    result = runner().invoke(app, ["ask", "   "])
    assert result.exit_code == 2 and "the question is empty" in result.output
    result = runner().invoke(app, ["ask", "q", "--doc", str(tmp_path / "missing.txt")])
    assert result.exit_code == 2 and "missing.txt" in result.output and "does not exist" in result.output
    result = runner().invoke(app, ["ask", "q", "--doc", str(tmp_path)])
    assert result.exit_code == 2 and str(tmp_path.name) in result.output and "is a directory" in result.output
    assert no_model == []


def test_chat_refuses_an_empty_question_and_a_missing_model_before_embedding_anything(tmp_path, no_model):
    for args in (["-q", ""], ["-q", "What is it?", "-q", "  "]):
        result = runner().invoke(app, ["chat", *args])
        assert result.exit_code == 2 and "is empty: ask something" in result.output
    (tmp_path / "notes.md").write_text("# Notes\n\nSome text.", encoding="utf-8")
    result = runner().invoke(app, ["chat", "--docs", str(tmp_path), "-q", "What is it?", "--model", "TYPO"])
    assert result.exit_code == 2 and "--model 'TYPO' is not a .gguf file or a local model directory" in result.output
    assert no_model == []  # neither the corpus embedded nor a model loaded


def test_ask_file_errors_come_before_a_bad_model_path(tmp_path):
    """No patching: with a --model that does not exist, the file's error is the one reported."""
    bad = tmp_path / "latin1.txt"
    bad.write_bytes(LATIN1)
    result = runner().invoke(app, ["ask", "q", "--doc", str(bad), "--model", str(tmp_path / "no-such-model")])
    assert result.exit_code == 2 and f"{bad} is not UTF-8 text" in result.output
    assert "no-such-model" not in result.output


# --- ask and info on the tiny engine ----------------------------------------------------------------
def test_ask_too_long_doc_names_it_and_points_to_chat_docs(tmp_path, tiny_model):
    long = tmp_path / "long.txt"
    long.write_text(words(400), encoding="utf-8")
    result = runner().invoke(app, ["ask", "w1 w2", "--doc", str(long)])
    assert result.exit_code == 2
    assert f"document '{long}' has 400 tokens" in result.output
    assert f"lazyattn chat --docs {long} splits long files into chunks" in result.output


def test_ask_without_docs_says_no_documents_were_used(tiny_model):
    result = runner().invoke(app, ["ask", "w1 w2 w3", "--max-tokens", "3"])
    assert result.exit_code == 0, result.output
    assert "[no documents (answered from the model alone; add some with --doc FILE) | prompt 9 tokens: 0 cached, 9 computed |" in result.output


def test_ask_json_stats_carry_the_cached_head_tokens(tmp_path, tiny_model):
    doc = tmp_path / "a.txt"
    doc.write_text(words(20), encoding="utf-8")
    result = runner().invoke(app, ["ask", "w1 w2", "--doc", str(doc), "--max-tokens", "2", "--json"])
    assert result.exit_code == 0, result.output
    stats = json.loads(result.stdout)["stats"]
    assert stats["docs_missed"] == [str(doc)] and stats["num_exact_prefix_tokens"] == 0  # first request: computed


def test_info_labels_the_anchor_and_the_prompt_head(tiny_model):
    result = runner().invoke(app, ["info"])
    assert result.exit_code == 0, result.output
    info = json.loads(result.stdout)
    assert info["anchor"] == "bos" and info["anchor_tokens"] == 1
    assert info["prompt_head_tokens"] == 3  # the tiny PromptConfig's instruction "w190 w191 w192"
    assert info["num_cached_chunks"] == 1 and info["cached_chunks"] == {"anchor": 1, "prompt_head": 0, "documents": 0}
    keys = list(info)
    assert keys.index("anchor_tokens") == keys.index("anchor") + 1


def test_stats_line_labels_the_cached_prompt_head_and_plurals():
    def line(**kw):
        return RequestStats("r", ttft_ms=5.0, **kw).summary(NO_DOCUMENTS)

    head_only = line(num_prompt_tokens=50, num_cached_tokens=33, num_exact_prefix_tokens=33, num_computed_tokens=17,
                     num_output_tokens=1, docs_missed=["a"])
    assert "prompt 50 tokens: 33 cached (exact prefix), 17 computed" in head_only and "| 1 output token]" in head_only
    both = line(num_prompt_tokens=600, num_cached_tokens=533, num_exact_prefix_tokens=33, num_computed_tokens=67,
                num_output_tokens=2, docs_hit=["a"], docs_missed=["b"])
    assert "docs hit 1, missed 1" in both and "533 cached (500 shifted, 33 exact prefix), 67 computed" in both
    assert "2 output tokens" in both
    learned = line(num_prompt_tokens=600, num_cached_tokens=533, num_exact_prefix_tokens=33, num_computed_tokens=67,
                   num_recomputed_tokens=16, docs_hit=["a", "passage:1"], docs_missed=["passage:2"],
                   doc_sources={"a": "matched", "passage:1": "learned", "passage:2": "learned"})
    assert "[docs hit 1, missed 0; passages hit 1, missed 1 | " in learned
    assert "67 computed (16 recomputed) |" in learned  # no remedy named: none given
    heads = line(num_prompt_tokens=90, num_computed_tokens=30, num_recomputed_tokens=16, remedy="chunk_head_recompute")
    assert "30 computed (16 recomputed: chunk heads) |" in heads
    scaled = line(num_prompt_tokens=90, num_computed_tokens=30, remedy="chunk_attention_scaling")
    assert "30 computed (documents' attention scaled) |" in scaled
    assert "prompt 9 tokens: 0 cached, 9 computed" in line(num_prompt_tokens=9, num_computed_tokens=9, docs_missed=["a"])
    assert line(num_prompt_tokens=9, num_computed_tokens=9).startswith(f"[{NO_DOCUMENTS} | prompt 9 tokens")


def test_request_stats_count_the_cached_prompt_head():
    """A question whose documents all miss still reads the prompt head from the cache: that is the
    "33 cached" of issue 15, now counted on its own."""
    llm = tiny_engine()
    head = len(llm.engine.planner.head_ids)
    llm.add_documents([("a", words(20)), ("b", words(24, 50))])
    sampling = SamplingParams(max_tokens=2, ignore_eos=True)
    first = llm.generate("w1 w2", ["a"], sampling=sampling).stats
    second = llm.generate("w1 w2", ["b"], sampling=sampling).stats
    third = llm.generate("w1 w2", ["a", "b"], sampling=sampling).stats
    assert head == 3 and first.num_cached_tokens == first.num_exact_prefix_tokens == 0  # all computed
    assert second.docs_hit == [] and second.num_cached_tokens == second.num_exact_prefix_tokens == head
    assert third.docs_hit == ["a", "b"] and third.num_exact_prefix_tokens == head
    assert third.num_cached_tokens == head + 20 + 24


# --- chat: input checked before anything loads -------------------------------------------------------
def test_run_chat_refuses_closed_or_empty_stdin_before_loading(no_model, monkeypatch):
    closed = io.StringIO()
    closed.close()
    with pytest.raises(ValueError, match="standard input is closed: pass questions with -q/--question"):
        run_chat(ChatOptions(), stdin=closed)
    monkeypatch.setattr(sys, "stdin", None)  # what Python sets when the process starts with fd 0 closed
    with pytest.raises(ValueError, match="standard input is closed"):
        run_chat(ChatOptions())
    for empty in ("", "\n  \n\n"):
        with pytest.raises(ValueError, match=r"not a terminal and holds no question .*-q/--question"):
            run_chat(ChatOptions(), stdin=io.StringIO(empty))
    assert no_model == []


def test_cli_chat_with_empty_stdin_says_what_to_do_before_loading(no_model):
    result = runner().invoke(app, ["chat"], input="")
    assert result.exit_code == 2 and no_model == []
    assert "error: standard input is not a terminal and holds no question" in result.output
    assert "Traceback" not in result.output


@pytest.mark.parametrize("stdin", ["/dev/null", "closed"])
def test_chat_process_with_devnull_or_closed_stdin_fails_fast(stdin):
    """The real process (no patching): exits 2 with the reason within the import time, where it
    used to load the embedder and the model first (14 s), or crash on ``None.readline``."""
    cmd = [sys.executable, "-m", "lazyattn_rag.cli", "chat"]
    t0 = time.perf_counter()
    if stdin == "closed":
        proc = subprocess.run(cmd, stdin=None, capture_output=True, text=True, timeout=120,
                              preexec_fn=lambda: os.close(0))
    else:
        with open(os.devnull) as null:
            proc = subprocess.run(cmd, stdin=null, capture_output=True, text=True, timeout=120)
    wall = time.perf_counter() - t0
    expected = "standard input is closed" if stdin == "closed" else "holds no question"
    assert proc.returncode == 2 and expected in proc.stderr and "Traceback" not in proc.stderr, proc.stderr
    assert "Loaded" not in proc.stderr and "Corpus" not in proc.stderr
    assert wall < 60


def test_chat_docs_skips_a_non_utf8_file_with_a_warning_and_a_count(tmp_path, no_model):
    (tmp_path / "good.md").write_text("# Good\n\nReadable text.", encoding="utf-8")
    (tmp_path / "old.txt").write_bytes(LATIN1)
    result = runner().invoke(app, ["chat", "--docs", str(tmp_path), "-q", "What is it?"])
    assert isinstance(result.exception, ModelLoaded)  # the corpus was read, then loading began
    assert no_model == ["embedding model"]
    out = result.output
    assert f"warning: skipped {tmp_path / 'old.txt'}: not UTF-8 text (byte 0xe9 at offset 3)" in out
    assert "warning: 1 file skipped (not UTF-8 text); to include it, convert it to UTF-8" in out
    assert f"Corpus: {tmp_path}, 1 text\n" in out


def test_chat_docs_with_only_non_utf8_files_names_them_before_loading(tmp_path, no_model):
    (tmp_path / "a.txt").write_bytes(LATIN1)
    result = runner().invoke(app, ["chat", "--docs", str(tmp_path), "-q", "What is it?"])
    assert result.exit_code == 2 and no_model == []
    assert f"no text under {str(tmp_path)!r}: 1 of 1 files are not UTF-8 text ({tmp_path / 'a.txt'})" in result.output
    result = runner().invoke(app, ["chat", "--docs", str(tmp_path / "a.txt"), "-q", "What is it?"])
    assert result.exit_code == 2 and str(tmp_path / "a.txt") in result.output and no_model == []


def test_folder_sources_warns_for_each_skipped_file(tmp_path):
    (tmp_path / "a.rst").write_text("Title\n=====\n\nBody.", encoding="utf-8")
    (tmp_path / "b.markdown").write_bytes(LATIN1)
    with pytest.warns(UserWarning, match="skipped .*b.markdown: not UTF-8 text"):
        sources = folder_sources(tmp_path)
    assert [s.id for s in sources] == ["a.rst"]


# --- the interactive loop on the tiny engine ----------------------------------------------------------
@functools.cache
def _embed_model():
    from lazyattn_rag.integrations.embeddings import llamaindex_embedding

    return llamaindex_embedding()


@pytest.fixture(scope="module")
def docs_dir(tmp_path_factory) -> Path:
    root = tmp_path_factory.mktemp("docs")
    for name, text in CORPUS.items():
        (root / f"{name}.txt").write_text(text, encoding="utf-8")
    return root


@pytest.fixture
def chat(docs_dir, tmp_path_factory, monkeypatch):
    """``chat(stdin, out=None) -> (results, out text, log text, engine)`` on a fresh tiny engine; answers
    are long (up to the 400-token context limit) so a Ctrl-C lands while the request still runs."""
    monkeypatch.setattr("lazyattn_rag.integrations.chatbot.llamaindex_embedding", _embed_model)
    index_dir = tmp_path_factory.getbasetemp() / "chat-index"  # built by the first test, reloaded after
    options = ChatOptions(docs=docs_dir, top_k=2, index_dir=index_dir,
                          sampling=SamplingParams(max_tokens=1000, ignore_eos=True))

    def run(stdin, out=None):
        engine = tiny_engine(num_blocks=128, max_model_len=400)
        out, log = out or _Out(), io.StringIO()
        out.engine = engine
        results = run_chat(options, out=out, log=log, stdin=stdin, engine=engine)
        return results, out.getvalue(), log.getvalue(), engine

    return run


def test_interactive_chat_ignores_empty_lines_and_leaves_on_exit(chat, docs_dir):
    results, out, log, engine = chat(io.StringIO("\n   \nWhy do cats purr?\n\n\nexit\nnever asked\n"))
    assert len(results) == 1 and out.count("\nQ: ") == 1 and "never asked" not in out
    assert f"Ask about the documents in {docs_dir}" in log and "Ask about Python" not in log
    assert f"Corpus: {docs_dir}, 4 texts" in log
    assert engine.stats()["num_requests_running"] == 0


def test_interactive_chat_leaves_at_end_of_input_and_on_quit(chat):
    results, out, _, _ = chat(io.StringIO("Why do cats purr?\nWhy do dogs bark?"))  # no newline, then EOF
    assert len(results) == 2
    results, _, _, _ = chat(io.StringIO("QUIT\nWhy do cats purr?\n"))
    assert results == []


def test_ctrl_c_while_waiting_for_a_token_aborts_that_answer_and_asks_again(chat, monkeypatch):
    """Ctrl-C lands in the wait for the next token (``RequestStream.__next__``): the request is
    aborted, so the engine stops computing it, and the next question is answered."""
    real_next, calls = RequestStream.__next__, []

    def next_or_ctrl_c(self):
        calls.append(self.request_id)
        if len(set(calls)) == 1 and len(calls) == 3:  # the first answer's third token
            raise KeyboardInterrupt
        return real_next(self)

    monkeypatch.setattr(RequestStream, "__next__", next_or_ctrl_c)
    out_stream = _Out()
    results, out, _, engine = chat(io.StringIO("Why do cats purr?\nWhy do dogs bark?\nexit\n"), out=out_stream)
    assert out_stream.running_when_stopped == 0  # aborted before the chat said so and asked again
    stats = engine.stats()
    assert stats["num_requests_aborted"] == 1 and stats["num_requests_running"] == 0
    assert stats["num_requests_finished"] == 1 and len(results) == 1  # the second question, answered in full
    assert "[stopped: the answer was cancelled" in out and out.index("[stopped") < out.index("Q: Why do dogs bark?")
    assert results[0]["num_output_tokens"] > 2


class _Out(io.StringIO):
    """``out`` that records the engine's running requests when the chat says an answer stopped."""

    engine = None
    running_when_stopped = None

    def write(self, s):
        if "[stopped" in s:
            self.running_when_stopped = self.engine.stats()["num_requests_running"]
        return super().write(s)


class _InterruptingOut(_Out):
    """``out`` whose first write of answer text raises ``KeyboardInterrupt`` (Ctrl-C while the chat
    prints: the response generators are suspended, not unwinding)."""

    armed = False

    def write(self, s):
        if self.armed and s.strip():
            self.armed = None
            raise KeyboardInterrupt
        if s.endswith("A: ") and self.armed is False:
            self.armed = True
        return super().write(s)


def test_ctrl_c_while_printing_an_answer_aborts_it(chat):
    out_stream = _InterruptingOut()
    results, out, _, engine = chat(io.StringIO("Why do cats purr?\nWhy do dogs bark?\n"), out=out_stream)
    assert out_stream.running_when_stopped == 0  # the chat closed the response: not left to garbage collection
    stats = engine.stats()
    assert stats["num_requests_aborted"] == 1 and stats["num_requests_running"] == 0
    assert len(results) == 1 and "[stopped" in out


class _CtrlCAtPrompt(io.StringIO):
    """stdin that gives its lines, then raises ``KeyboardInterrupt`` (Ctrl-C at the prompt)."""

    def readline(self, *args):
        line = super().readline(*args)
        if not line:
            raise KeyboardInterrupt
        return line


def test_ctrl_c_at_the_prompt_leaves_cleanly(chat):
    results, out, _, engine = chat(_CtrlCAtPrompt("Why do cats purr?\n"))
    assert len(results) == 1 and out.endswith("\n> \n")
    assert engine.stats()["num_requests_running"] == 0


# --- sampling: the model's recommended settings unless set on the command line ------------------
@pytest.fixture
def recorded_sampling(monkeypatch):
    """The tiny engine recommends temperature 0.5 / top_p 0.7; ``recorded_sampling()`` lists the
    sampling of each request the commands ran (seen by a step listener on each engine built)."""
    logs = []

    def make(config):
        llm = tiny_engine(max_model_len=128)
        llm.default_sampling = SamplingParams(temperature=0.5, top_p=0.7, repetition_penalty=1.05)
        logs.append(StepLog(llm))
        return llm

    monkeypatch.setattr("lazyattn_rag.llm.LazyAttention", make)
    return lambda: [r.params for log in logs for r in log.requests]


def test_ask_uses_the_models_sampling_unless_overridden(recorded_sampling):
    assert runner().invoke(app, ["ask", "w1 w2", "--max-tokens", "2", "--seed", "3"]).exit_code == 0
    assert recorded_sampling()[-1] == SamplingParams(max_tokens=2, temperature=0.5, top_p=0.7, repetition_penalty=1.05,
                                                     seed=3, loop_guard_ngram=CHAT_LOOP_GUARD_NGRAM)  # the command's guard
    result = runner().invoke(app, ["ask", "w1 w2", "--max-tokens", "2", "--temperature", "0", "--top-p", "0.9",
                                   "--repetition-penalty", "1.2", "--loop-guard", "0"])
    assert result.exit_code == 0, result.output
    assert recorded_sampling()[-1] == SamplingParams(max_tokens=2, temperature=0.0, top_p=0.9, repetition_penalty=1.2)


def test_ask_refuses_bad_sampling_values_before_the_model_loads(no_model):
    for option, value in (("--top-p", "1.5"), ("--temperature", "-1"), ("--repetition-penalty", "0")):
        result = runner().invoke(app, ["ask", "w1", option, value])
        assert result.exit_code == 2 and option.strip("-").replace("-", "_") in result.output, result.output
    assert no_model == []


def test_chat_answers_with_the_models_sampling_and_no_blank_line_stop(docs_dir, tmp_path, monkeypatch):
    from lazyattn_rag.integrations import chatbot

    monkeypatch.setattr(chatbot, "llamaindex_embedding", _embed_model)
    engine = tiny_engine(num_blocks=128, max_model_len=400)
    engine.default_sampling = SamplingParams(temperature=0.5, top_p=0.7)
    steps = StepLog(engine)
    run_chat(ChatOptions(questions=("w1 w2",), docs=docs_dir, top_k=1, index_dir=tmp_path / "index",
                         sampling_overrides={"max_tokens": 3, "top_p": 0.8}), out=io.StringIO(), log=io.StringIO(),
             engine=engine)
    used = [r.params for r in steps.requests]  # the sampling each request ran with
    assert used == [SamplingParams(max_tokens=3, temperature=0.5, top_p=0.8)]  # no stop at a blank line
