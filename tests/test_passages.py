"""Plain prompts (issue 36): the passage splitter, the sightings history, passages learned from
traffic, and exact-prefix caching in lazy mode, on a tiny engine against the transformers oracle."""

import functools
import threading

import pytest
import torch

from lazyattn_rag import DocumentRef, Message, SamplingParams
from lazyattn_rag.engine.planning.passage_learning import PASSAGE_ID_PREFIX, eligible_pieces
from lazyattn_rag.engine.planning.fingerprint import chunk_key
from lazyattn_rag.engine.planning.passages import (PassageHistory, PlainPrefixes, passage_key, piece_digests,
                                                  split_passages)
from lazyattn_rag.engine.planning.prompt_plan import PrefixKeys
from tests.integrations_kit import PlanSpy
from tests.oracle import plan_oracle
from tests.tiny import words

GREEDY = SamplingParams(max_tokens=4, ignore_eos=True)
P = [words(40, start=10 + 11 * i) for i in range(5)]  # passages: 40 distinct word tokens each


@pytest.fixture
def make_llm(make_llm):
    return functools.partial(make_llm, anchor="none")


def texts(pieces):
    return [p.text for p in pieces]


# --- the splitter ---------------------------------------------------------------------------------
def test_langchain_format_docs_and_its_tutorial_prompt_split_into_the_documents():
    context = "\n\n".join(["First doc text.", "Second doc\nspans two lines.", "Third."])
    prompt = ("Use the following pieces of context to answer the question at the end.\nIf you don't know, "
              f"say so.\n\n{context}\n\nQuestion: what is it?\n\nHelpful Answer:")
    pieces = split_passages(prompt)
    assert texts(pieces) == ["Use the following pieces of context to answer the question at the end.\nIf you "
                             "don't know, say so.", "First doc text.", "Second doc\nspans two lines.", "Third.",
                             "Question:", "what is it?", "Helpful Answer:"]
    assert [p.separator for p in pieces] == [False, False, False, False, True, False, True]
    assert all(prompt[p.start:p.end] == p.text for p in pieces)


def test_an_opening_that_introduces_the_context_ends_before_the_first_document():
    """LangChain's LCEL example puts the first document on the line after "...the following
    context:": that document is the same piece there as at any other position, and the opening is a
    separator (it may hold the user's question). A break-it trial's cases stay whole: a retrieved
    text's own lead-in (no instruction named), one after the opening, a line too long or not ending
    with a colon."""
    docs = ["Doc one text.", "Doc two\nover two lines.", "Doc three."]
    for order in (docs, docs[::-1]):
        context = "\n\n".join(order)
        prompt = f"Answer the question based only on the following context:\n{context}\n\nQuestion: why?\n"
        pieces = split_passages(prompt)
        assert texts(pieces) == ["Answer the question based only on the following context:", *order, "Question:",
                                 "why?"]
        assert [p.separator for p in pieces] == [True, False, False, False, True, False]
    opening = "You are helpful.\r\nUse the retrieved documents below to answer:\r\nDoc one text.\r\n"
    assert texts(split_passages(opening)) == ["You are helpful.\r\nUse the retrieved documents below to answer:",
                                              "Doc one text."]
    lead_in = "Before you apply, gather the following documents (originals, not copies):\n- Passport\n- Photos"
    settings = "To configure data sources, add the following to settings.py:\nDATA_SOURCES = ['s3']"
    for kept in (lead_in, settings, "Answer using the context: it matters\nhere.", "Answer from the context.\nfoo",
                 "Answer the question from the following context, " + "x" * 160 + ":\nfoo"):
        assert texts(split_passages(kept)) == [kept]
    cite = "Cite the sources you used to answer in this format:\n[n] short quote"
    assert texts(split_passages(f"{lead_in}\n\n{settings}\n\nWhich papers?\n\n{cite}")) == [
        lead_in, settings, "Which papers?", cite]


def test_a_label_is_cut_from_the_passage_on_its_line():
    prompt = "You are an assistant.\nQuestion: why? \nContext: Doc one.\n\nDoc two. \nAnswer:"
    assert texts(split_passages(prompt)) == ["You are an assistant.", "Question:", "why?", "Context:", "Doc one.",
                                             "Doc two.", "Answer:"]


def test_llamaindex_rules_metadata_headers_and_its_closing_instruction():
    node = "file_path: a.txt\n\nThe text of the node,\nover two lines."
    prompt = (f"Context information is below.\n---------------------\n{node}\n\nAnother node's text.\n"
              "---------------------\nGiven the context information and not prior knowledge, answer the query.\n"
              "Query: q?\nAnswer: ")
    assert texts(split_passages(prompt)) == [
        "Context information is below.", "---------------------", "file_path: a.txt", "The text of the node,\nover "
        "two lines.", "Another node's text.", "---------------------\nGiven the context information and not prior "
        "knowledge, answer the query.", "Query:", "q?", "Answer:"]
    # a rule before a long piece (a retrieved passage) stays apart from it
    long = "A " + "long retrieved passage " * 10
    assert texts(split_passages(f"---\n{long}"))[0] == "---"


def test_a_fence_closes_only_on_its_own_marker():
    assert texts(split_passages("```python\na\n~~~\nb\n```\n\nc")) == ["```python\na\n~~~\nb\n```", "c"]
    assert texts(split_passages("````\ncode\n```\nin\n````\n\nafter")) == ["````\ncode\n```\nin\n````", "after"]
    assert texts(split_passages("```x``` is inline\n\nnext")) == ["```x``` is inline", "next"]


def test_fenced_code_and_tags_are_never_cut_and_tags_are_separators():
    code = "```python\ndef f():\n\n    return 1\n\n\n# end\n```"
    prompt = f"<context>\nDoc one.\n</context>\n\nHere:\n\n{code}\n\nWhy?"
    pieces = split_passages(prompt)
    assert texts(pieces) == ["<context>", "Doc one.", "</context>", "Here:", code, "Why?"]
    assert [p.separator for p in pieces] == [True, False, True, True, False, False]


def test_the_history_counts_a_passage_once_per_request_and_forgets_the_oldest():
    history = PassageHistory(max_entries=2)
    a, b, c = (passage_key("", t) for t in ("a", "b", "c"))
    assert history.observe([a, a, b]) == {a: 0, b: 0}
    assert history.observe([a, c]) == {a: 1, c: 0}
    assert history.observe([a, b]) == {a: 2, b: 0}  # b was forgotten (least recently seen), then seen anew
    assert len(history) == 2 and passage_key("ns", "a") != passage_key("", "a")


def test_plain_prefixes_know_each_content_prefix_that_ends_at_a_piece():
    def seen(namespace, contents, message, part, end):  # the digest of the content up to that piece's end
        return any((m, p, piece.end) == (message, part, end) and digest in prefixes
                   for (m, p, piece), digest in piece_digests(namespace, contents))

    prefixes = PlainPrefixes(max_entries=3)
    contents = [("system", ["Be brief."]), ("user", ["Docs:\n\nalpha text\n\nbeta text", "tail"])]
    prefixes.record("", contents)  # pieces end after "Be brief.", "alpha text", "beta text", "tail": 4 > 3
    assert len(prefixes) == 3
    assert not seen("", contents, 0, 0, len("Be brief."))  # the oldest, forgotten
    user = contents[1][1][0]
    assert seen("", contents, 1, 0, user.index("alpha text") + len("alpha text"))
    assert seen("", contents, 1, 1, 4)
    assert not seen("", contents, 1, 0, user.index("alpha text") + 5)  # not a piece's end
    assert not seen("ns", contents, 1, 1, 4)  # another namespace
    other = [("system", ["Be brief!"]), contents[1]]
    assert not seen("", other, 1, 1, 4)  # an earlier message differs
    assert not seen("", [("assistant", contents[0][1]), contents[1]], 1, 1, 4)  # or its role


# --- passages learned from plain prompts --------------------------------------------------------
def rag_prompt(order, question="w5 w6"):
    return "documents :\n\n" + "\n\n".join(P[i] for i in order) + "\n\nQuestion : " + question


def ask(llm, order, question="w5 w6", namespace="", system=None):
    messages = ([Message("system", system)] if system else []) + [Message("user", rag_prompt(order, question))]
    return llm.chat(messages, sampling=GREEDY, namespace=namespace)


def passage_id(llm, i, namespace=""):
    return PASSAGE_ID_PREFIX + llm.engine.planner.prepare_passage(P[i], namespace).key[:16]


def test_a_passage_seen_before_is_served_from_its_chunk_at_a_new_offset_as_the_oracle_computes_it(make_llm):
    hf, llm = make_llm()
    spy = PlanSpy(llm)
    first = ask(llm, [0, 1, 2])  # seen once: computed as it is today
    assert first.stats.docs_hit == first.stats.docs_missed == [] and first.stats.num_cached_tokens == 0
    second = ask(llm, [2, 0, 1], "w7")  # recurring: encoded as chunks now
    ids = [passage_id(llm, i) for i in (2, 0, 1)]
    assert second.stats.docs_missed == ids and second.stats.doc_sources == dict.fromkeys(ids, "learned")
    third = ask(llm, [1, 2, 0], "w8 w9")  # served from the chunks, each at a new offset
    stats = third.stats
    assert stats.docs_hit == [ids[2], ids[0], ids[1]] and stats.docs_missed == []
    assert stats.num_shifted_tokens == 3 * 40 and stats.num_computed_tokens == stats.num_prompt_tokens - 3 * 40 - \
        stats.num_exact_prefix_tokens
    plan = spy.calls[-1]["plan"]
    assert [c.doc_id for c in plan.chunks] == [None, ids[2], ids[0], ids[1]]
    before = {c.doc_id: c.delta for c in spy.calls[-2]["plan"].chunks}
    assert all(c.delta != before[c.doc_id] for c in plan.chunks[1:])  # every one moved
    tokens, _ = plan_oracle(hf, plan, [], GREEDY.max_tokens)  # each passage encoded alone, rotated to its offset
    assert third.token_ids == tokens
    llm.client.call(lambda engine: engine.cache.check_integrity())


def test_a_plain_clients_second_ask_keeps_its_system_prompt_from_the_first_asks_blocks(make_llm):
    """The second ask, documents shuffled, is laid out with learned passages: its prompt head
    (system prompt and the text before the first passage) is not cached as a chunk yet, but the
    first ask left its full blocks as exact-prefix blocks: the head is seeded from them (copied
    as they are) and only its last block is encoded. Its K/V equal the head encoded whole, and
    every ask answers as the oracle."""
    hf, llm = make_llm()
    system = words(45, start=150)
    spy = PlanSpy(llm)
    ask(llm, [0, 1, 2], system=system)
    second = ask(llm, [2, 0, 1], "w7", system=system)
    plan = spy.calls[-1]["plan"]
    head = plan.chunks[0]
    assert head.doc_id is None and [c.doc_id for c in plan.chunks[1:]] == [passage_id(llm, i) for i in (2, 0, 1)]
    seeded = len(head.token_ids) // 16 * 16
    assert seeded >= 32 and second.stats.num_exact_prefix_tokens == seeded
    assert second.stats.num_computed_tokens == second.stats.num_prompt_tokens - seeded
    assert second.token_ids == plan_oracle(hf, plan, [], GREEDY.max_tokens)[0]
    entry = llm.client.call(lambda engine: engine.cache.lookup(head.key, touch=False))
    keys, values = llm.loop.call(llm.engine.runner.kv_pool.read, entry.block_ids, entry.num_tokens)
    _, fresh = make_llm()
    fresh.add_document("d", P[2])  # the same head before a document placed by id: encoded whole
    fresh.chat([Message("system", system), Message("user", ("documents :\n\n", DocumentRef("d"), "Question : w7"))],
               sampling=GREEDY)
    fresh_entry = fresh.client.call(lambda engine: engine.cache.lookup(head.key, touch=False))
    fresh_keys, fresh_values = fresh.loop.call(fresh.engine.runner.kv_pool.read, fresh_entry.block_ids, len(head.token_ids))
    assert torch.allclose(keys, fresh_keys, atol=1e-5) and torch.allclose(values, fresh_values, atol=1e-5)
    third = ask(llm, [1, 2, 0], "w8", system=system)
    assert third.stats.num_exact_prefix_tokens == len(head.token_ids) and third.stats.docs_missed == []
    assert third.token_ids == plan_oracle(hf, spy.calls[-1]["plan"], [], GREEDY.max_tokens)[0]
    assert llm.client.call(lambda engine: sum(e.pin_count for e in engine.cache.entries())) == 0
    llm.client.call(lambda engine: engine.cache.check_integrity())


@pytest.mark.parametrize("num_blocks", [14, 16])
def test_a_tight_cache_still_serves_the_second_ask(make_llm, num_blocks):
    """Found by an adversarial review: room that exists only by evicting the first ask's blocks
    must not be spent on seeding from them (the ask failed with NoFreeBlocksError)."""
    hf, llm = make_llm(num_blocks=num_blocks, max_model_len=200)
    system = words(45, start=150)
    ask(llm, [0, 1, 2], system=system)
    spy = PlanSpy(llm)
    second = ask(llm, [2, 0, 1], "w7", system=system)
    assert second.token_ids == plan_oracle(hf, spy.calls[-1]["plan"], [], GREEDY.max_tokens)[0]
    llm.client.call(lambda engine: engine.cache.check_integrity())


def test_a_head_seeded_whole_reaches_the_disk_tier(make_llm, tmp_path):
    """A 48-token head (three whole cached blocks) is copied, not encoded, and stored below
    like every computed chunk (found by an adversarial review)."""
    _, llm = make_llm(disk_dir=str(tmp_path / "tier"))
    system = words(44, start=150)
    spy = PlanSpy(llm)
    ask(llm, [0, 1, 2], system=system)
    second = ask(llm, [2, 0, 1], "w7", system=system)
    plan = spy.calls[-1]["plan"]
    assert len(plan.chunks[0].token_ids) == 48 and second.stats.num_exact_prefix_tokens == 48

    def stored(engine):
        engine.tiers.flush()
        return [c.key in tier for c in plan.chunks for tier in engine.tiers.persistent]

    assert llm.client.call(stored) == [True] * 4


def test_a_learned_passage_answers_as_the_same_document_placed_by_id(make_llm):
    _, llm = make_llm()
    for order, q in (([0, 1], "w5"), ([1, 0], "w6")):
        ask(llm, order, q, namespace="plain")
    learned = ask(llm, [1, 0], "w7", namespace="plain")
    assert [learned.stats.doc_sources[d] for d in learned.stats.docs_hit] == ["learned", "learned"]
    llm.add_documents([("p0", P[0]), ("p1", P[1])], namespace="ids")  # another namespace: its own chunks
    by_id = llm.chat([Message("user", ("documents :\n\n", DocumentRef("p1"), DocumentRef("p0"), "Question : w7"))],
                     sampling=GREEDY, namespace="ids")
    assert by_id.stats.docs_missed == ["p1", "p0"] and by_id.stats.num_prompt_tokens == learned.stats.num_prompt_tokens
    assert by_id.token_ids == learned.token_ids
    # what the prompt would reuse by its exact prefix instead (an earlier request's opening) wins
    repeat = ask(llm, [0, 1], "w8", namespace="plain")
    assert repeat.stats.docs_hit == [] and repeat.stats.num_computed_tokens <= 16


def test_plain_prompts_are_planned_in_the_planning_thread_and_every_sighting_counts(make_llm, monkeypatch):
    """A pasted prompt is tokenized and laid out in the client's planning thread (the engine
    thread keeps stepping meanwhile), for concurrent callers too, without losing a sighting. A
    prompt naming documents is planned on the engine thread (the registry lives there)."""
    _, llm = make_llm()
    planner, calls = llm.engine.planner, []  # (kind, thread): plain, learned (passages placed) or named
    original = planner.plan_messages

    def spy(messages, *args, **kwargs):
        refs = [p for m in messages for p in m.parts() if isinstance(p, DocumentRef)]
        kind = "plain" if not refs else "learned" if refs[0].id.startswith(PASSAGE_ID_PREFIX) else "named"
        calls.append((kind, llm.client.loop.on_engine_thread() or threading.current_thread().name))
        return original(messages, *args, **kwargs)

    monkeypatch.setattr(planner, "plan_messages", spy)
    orders = [[0, 1, 2], [2, 0, 1], [1, 2, 0], [0, 2, 1], [2, 1, 0], [1, 0, 2]]
    answers: list = [None] * len(orders)

    def caller(i):
        answers[i] = ask(llm, orders[i], f"w{5 + i}")

    callers = [threading.Thread(target=caller, args=(i,)) for i in range(len(orders))]
    for t in callers:
        t.start()
    for t in callers:
        t.join()
    assert all(str(thread).startswith("lazyattn-plan") for _, thread in calls)
    kinds = [kind for kind, _ in calls]
    # the first prompt seen is planned plain; the others lay their passages out (their plain plan
    # only where the learner needs it to choose)
    assert kinds.count("learned") >= len(orders) - 1 and 1 <= kinds.count("plain") <= len(orders)
    assert all(len(a.token_ids) == GREEDY.max_tokens for a in answers)
    keys = [passage_key("", P[i]) for i in range(3)]
    assert llm.engine.passages.history.observe(keys) == dict.fromkeys(keys, len(orders))
    last = ask(llm, [1, 0, 2], "w20")  # every passage recurs and was encoded by one of the callers
    ids = [passage_id(llm, i) for i in (1, 0, 2)]
    assert last.stats.docs_hit == ids and last.stats.num_shifted_tokens == 3 * 40
    llm.add_documents([("p0", P[0])])
    llm.chat([Message("user", ("documents :\n\n", DocumentRef("p0"), "Question : w7"))], sampling=GREEDY)
    assert calls[-1] == ("named", True)
    llm.client.call(lambda engine: engine.cache.check_integrity())


@pytest.mark.parametrize("order", [[2, 0, 1], [0, 2, 1]], ids=["first-piece-new", "first-piece-in-place"])
def test_the_learner_chooses_as_the_full_weighing_without_tokenizing_the_whole_plain_prompt(make_llm, order):
    """After a plain prompt, a second one whose passages recur is laid out without planning its
    plain prompt: its first piece new (no plain layout had the same content up to its end: its
    prefix tokenized as far as that piece, only the template's blocks read in place), or its
    first piece where the first prompt's is (its prefix tokenized as far as the second piece:
    the first prompt's blocks are read in place, the first passage kept there). Either way the
    layout is the one the learner takes weighing the plain plan itself, on an engine in the same
    state."""
    _, llm = make_llm()
    _, exact = make_llm()
    for engine in (llm, exact):
        ask(engine, [0, 1, 2])  # seen once: computed plain, its blocks cached
    messages = [Message("user", rag_prompt(order, "w7"))]
    planned = []

    def plain():
        planned.append(True)
        return llm.engine.planner.plan_messages(messages)

    lazy = llm.engine.passages.choose(messages, plain)
    full = exact.engine.passages.choose(messages, exact.engine.planner.plan_messages(messages))
    assert planned == []
    assert [(c.key, c.global_start) for c in lazy.chunks] == [(c.key, c.global_start) for c in full.chunks]
    assert lazy.token_ids() == full.token_ids() and lazy.query_token_ids == full.query_token_ids
    learned = [c.doc_id for c in lazy.chunks if c.learned]
    ids = [passage_id(llm, i) for i in order]
    assert learned == (ids if order[0] == 2 else ids[1:])  # P0 is read in place after the first prompt


def test_a_prompt_like_an_earlier_plain_one_to_its_end_is_weighed_with_its_plain_plan(make_llm):
    _, llm = make_llm()
    ask(llm, [0, 1, 2])
    messages = [Message("user", rag_prompt([0, 1, 2], "w7"))]  # every piece as the first prompt's
    planned = []

    def plain():
        planned.append(True)
        return llm.engine.planner.plan_messages(messages)

    llm.engine.passages.choose(messages, plain)
    assert planned == [True]


def test_a_repeat_of_a_plain_prompt_the_learner_forgot_still_reads_its_blocks(make_llm):
    """Blocks a plain prompt left that the learner has no record of (forgotten, or written by a
    raw completion) are found by tokenizing as far as the first piece: a byte-identical repeat
    computes one block, as without learning, not its recurring passages as chunks."""
    _, llm = make_llm()
    messages = [Message("user", rag_prompt([0, 1, 2]))]
    first = llm.chat(messages, sampling=GREEDY)  # seen once: plain, its blocks cached
    llm.engine.passages.plain_prefixes = PlainPrefixes(max_entries=100)  # nothing recorded
    again = llm.chat(messages, sampling=GREEDY)
    assert again.stats.doc_sources == {} and again.stats.num_computed_tokens <= 16
    assert again.token_ids == first.token_ids


def test_text_seen_once_is_planned_exactly_as_without_learning(make_llm):
    _, llm = make_llm()
    _, plain = make_llm(learn_passages=False, prefix_caching=False)
    essay = "\n\n".join(words(30, start=7 * i) for i in range(4)) + "\n\nQuestion : w1"
    code = "```\n" + words(20, 3) + "\n\n" + words(20, 60) + "\n```\n\n" + words(25, 100) + "\n\nw1 ?"
    for text in (essay, code):
        messages = [Message("user", text)]
        out, expected = llm.chat(messages, sampling=GREEDY), plain.chat(messages, sampling=GREEDY)
        assert out.stats.docs_hit == out.stats.docs_missed == []
        assert out.stats.num_prompt_tokens == expected.stats.num_prompt_tokens
        assert out.token_ids == expected.token_ids
        assert llm.plan_chat(messages).token_ids() == plain.plan_chat(messages).token_ids()


def test_history_turns_single_turns_and_short_pieces_are_never_learned(make_llm):
    _, llm = make_llm(passage_min_sightings=0)  # every eligible piece at first sight
    spy = PlanSpy(llm)
    history = [Message("user", rag_prompt([0, 1])), Message("assistant", P[2] + "\n\n" + P[3]), Message("user", "w1")]
    llm.chat(history, sampling=GREEDY)
    llm.chat([Message("user", P[4])], sampling=GREEDY)  # one piece: the whole turn
    llm.chat([Message("user", "w1 w2 w3\n\nw4 w5\n\nQuestion : w6")], sampling=GREEDY)  # pieces under 16 tokens
    assert all(c["doc_ids"] == [] for c in spy.calls)
    out = llm.chat([Message("system", "w180 w181\n\n" + P[3]), Message("user", rag_prompt([0, 1]))],
                   sampling=GREEDY)
    assert out.stats.docs_missed == [passage_id(llm, 3), passage_id(llm, 0), passage_id(llm, 1)]


def test_the_users_question_is_never_learned_even_asked_again_in_the_same_words(make_llm):
    _, llm = make_llm(passage_min_sightings=0)
    question = words(20, start=170)  # long enough to be a passage
    out = None
    for _ in range(2):  # after a question label
        out = llm.chat([Message("user", rag_prompt([0, 1], question))], sampling=GREEDY)
    assert out.stats.docs_hit == [passage_id(llm, 0), passage_id(llm, 1)]  # the documents only
    # no label: the last piece (documents over 300 characters: a shorter one before the question
    # would be read as part of it, see the test below)
    long_docs = [P[0] + " " + P[2], P[1] + " " + P[3]]
    for _ in range(2):
        out = llm.chat([Message("user", "documents :\n\n" + "\n\n".join(long_docs) + "\n\n" + question)],
                       sampling=GREEDY)
    assert out.stats.docs_hit == [PASSAGE_ID_PREFIX + llm.engine.planner.prepare_passage(d).key[:16]
                                  for d in long_docs]


def test_a_question_with_a_closing_line_after_it_is_not_learned_either(make_llm):
    _, llm = make_llm(passage_min_sightings=0)
    question, closing = words(20, start=170) + " ?", words(18, start=120)
    for order in ([0, 1], [2, 3], [0, 2]):
        out = llm.chat([Message("user", "\n\n".join(P[i] for i in order) + "\n\n" + question + "\n\n" + closing)],
                       sampling=GREEDY)
    question_id = PASSAGE_ID_PREFIX + llm.engine.planner.prepare_passage(question).key[:16]
    assert question_id not in out.stats.doc_sources and passage_id(llm, 0) in out.stats.docs_hit


def eligible(text, role="user"):
    return [piece.text for _, piece, _ in eligible_pieces([Message(role, text)], "", 16)]


DOC_A = ("The Zorblax engine was invented by Mira Tenhaven in 1931 in the town of Keldor; it ran on peat. "
         "Its first model pumped water from the Keldor mines, and by 1933 forty of them worked the valley, "
         "each tended by a crew of three that fed it peat cut from the high moors above the old town every cold morning.")
DOC_B = ("Keldor's mayor in 1935 was Ostrik Vane, who banned the Zorblax engine after a boiler explosion. "
         "The ban lasted until 1941, when the council allowed engines with a relief valve of Tenhaven's own "
         "design; the explosion had killed two miners and destroyed the old brick pump house at the lower shaft of the mine.")


def test_an_unmarked_question_before_a_closing_instruction_is_not_a_passage():
    """A break-it trial's cases: the question was learnable where an instruction followed it, or
    where a retrieved FAQ passage carried a ``Question:`` label of its own."""
    question = "Tell me which person banned the Zorblax engine and in which year"
    closing = "Keep the answer short and use only the context above."
    assert eligible(f"Context:\n{DOC_A}\n\n{DOC_B}\n\n{question}\n\n{closing}") == [DOC_A, DOC_B]
    faq = "Question: How do I reset my Keldor account password?\nAnswer: Open Settings and press Reset."
    query = "how to change the email address on my Keldor account please"
    assert eligible(f"{faq}\n\n{DOC_B}\n\n{query}") == ["Open Settings and press Reset.", DOC_B]
    # with document headers after the FAQ's labels (a context label follows its answer, not its question)
    headed = f"Document 1:\n{faq}\n\nDocument 2:\n{DOC_A}\n\nDocument 3:\n{DOC_B}\n\n{query}"
    assert eligible(headed) == ["Open Settings and press Reset.", DOC_A, DOC_B]
    # documents over 300 characters end the tail: they stay passages, whatever the question says
    assert eligible(f"{DOC_A}\n\n{DOC_B}\n\nBased on the context above, {question}") == [DOC_A, DOC_B]
    # closing instructions in other words and languages, and a format label
    for closing in ("Let's think step by step.", "If you don't know, say you don't know.",
                    "Réponds brièvement en utilisant uniquement le contexte ci-dessus.", "Return JSON:\n{\"year\": 0}"):
        assert eligible(f"{DOC_A}\n\n{DOC_B}\n\n{question}\n\n{closing}") == [DOC_A, DOC_B]
    # a question of two paragraphs after its label, and a fullwidth question mark
    assert eligible(f"Question: I read about Keldor.\n\n{question}\nContext: {DOC_A}\n\n{DOC_B}") == [DOC_A, DOC_B]
    assert eligible(f"{DOC_A}\n\n{DOC_B}\n\n誰がエンジンを禁止しましたか？\n\n{closing}") == [DOC_A, DOC_B]
    # a labelled question ends it too, whatever it says (LlamaIndex's closing lines before it)
    closing_rule = "---------------------\nGiven the context information, answer the query."
    llama_index = f"{DOC_A}\n\n{DOC_B}\n{closing_rule}\nQuery: give a short answer\nAnswer: "
    assert eligible(llama_index) == [DOC_A, DOC_B, closing_rule]


def test_a_question_first_template_ends_with_a_document_that_is_a_passage():
    """The question before a context label (LangChain's ``rlm/rag-prompt``): the message's last
    piece is a retrieved document; a system message has no question at its end."""
    prompt = f"Answer from the context.\nQuestion: who banned it?\nContext: {DOC_A}\n\n{DOC_B}\nAnswer:"
    assert eligible(prompt) == ["Answer from the context.", DOC_A, DOC_B]
    # no context label after it: what follows the label up to the next one is the question
    assert eligible(f"Question: who banned it\n\n{DOC_A}\n\n{DOC_B}") == []
    assert eligible(f"{DOC_A}\n\n{DOC_B}", role="system") == [DOC_A, DOC_B]


def test_a_question_first_message_that_ends_short_and_unlabelled_keeps_that_end():
    """A retrieved text with an ``Input:`` line and a ``References:`` label after it reads as a
    question-first template; the user's short question at the end, and a closing line after it,
    are still never learned. A last document before an answer label is one (``rlm/rag-prompt``)."""
    doc = f"Input: a sample of peat from the Keldor moors.\nReferences: {DOC_A}"
    question = "Summarize what the documents say about the mayor"
    assert eligible(f"{doc}\n\n{DOC_B}\n\n{question}") == [DOC_A, DOC_B]
    assert eligible(f"{doc}\n\n{DOC_B}\n\n{question}\n\nKeep it under 50 words.") == [DOC_A, DOC_B]
    assert eligible(f"Question: who banned it\nContext: {DOC_A}\n\n{DOC_B}") == [DOC_A, DOC_B]
    short = "Peat from Keldor is still sold in small amounts under a special licence."
    for order in ((DOC_A, short), (short, DOC_A)):
        prompt = "Question: who sells it \nContext: " + "\n\n".join(order) + " \nAnswer:"
        assert eligible(prompt) == list(order)


def test_a_template_opening_stays_in_the_cached_head_where_that_computes_less(make_llm):
    """The instruction that opens every prompt recurs too; it becomes a passage only where that
    computes less than the prompt head it is part of (question after the documents: it stays in
    the cached head, exact; question before them: the head varies, the instruction is learned)."""
    _, llm = make_llm()
    llm.add_documents([(f"d{i}", P[i]) for i in range(3)])
    instruction = words(30, start=150)

    def chat(order, question, question_first=False):
        refs = tuple(DocumentRef(f"d{i}", matched=True) for i in order)  # as the server's matcher places them
        content = ((instruction + "\nQuestion : " + question + "\ndocuments : ", *refs, "Answer :")
                   if question_first else (instruction + "\n\ndocuments : ", *refs, "Question : " + question))
        return llm.chat([Message("user", content)], sampling=GREEDY)

    for order, q in (([0, 1], "w1"), ([1, 2], "w2"), ([2, 0], "w3")):
        out = chat(order, q)
    assert out.stats.doc_sources == {"d2": "matched", "d0": "matched"}  # no passage: the head serves it
    assert out.stats.num_exact_prefix_tokens >= 30
    for order, q in (([0, 1], "w4"), ([1, 2], "w5"), ([2, 0], "w6")):
        out = chat(order, q, question_first=True)
    learned = [d for d, source in out.stats.doc_sources.items() if source == "learned"]
    assert len(learned) == 1 and out.stats.docs_hit[0] == learned[0]  # the instruction, from its chunk
    assert out.stats.num_computed_tokens < 30


def test_a_tenant_never_reads_another_tenants_prompt_head(make_llm):
    """The head of a prompt with placed documents is keyed by its namespace too (else one tenant
    could tell from its cached tokens that another used the same system prompt)."""
    _, llm = make_llm()
    secret = words(30, start=150)
    for namespace in ("a", "a", "b"):
        llm.add_document("d", P[0], namespace=namespace)
        out = llm.chat([Message("system", secret), Message("user", ("w1 ", DocumentRef("d"), "Question : w2"))],
                       sampling=GREEDY, namespace=namespace)
    assert out.stats.num_exact_prefix_tokens == 0 and out.stats.num_cached_tokens == 0


def test_namespaces_learn_apart(make_llm):
    _, llm = make_llm()
    for order in ([0, 1], [1, 0]):
        ask(llm, order, namespace="a")
    in_b = ask(llm, [0, 1], namespace="b")  # b has seen them once, and shares no prefix block with a
    assert in_b.stats.docs_missed == [] and in_b.stats.num_cached_tokens == 0
    assert ask(llm, [1, 0], "w9", namespace="a").stats.docs_hit == [passage_id(llm, 1, "a"), passage_id(llm, 0, "a")]


# --- exact-prefix caching in lazy mode -------------------------------------------------------------
def cache_entries(llm):
    return llm.client.call(lambda engine: {e.key: list(e.block_ids) for e in engine.cache.entries()})


def test_prefix_keys_are_the_chain_of_block_hashes_hashed_when_read():
    tokens = list(range(100, 150))  # 3 full blocks of 16, 2 tokens over
    keys = PrefixKeys(tokens, "seed", 16)
    assert len(keys) == 3 and repr(keys) == "PrefixKeys(3 blocks, 0 hashed)"
    assert keys[0] == chunk_key("seed", "prefix", tokens[:16]) and repr(keys) == "PrefixKeys(3 blocks, 1 hashed)"
    chain = [chunk_key("seed", "prefix", tokens[:16])]
    chain.append(chunk_key(chain[0], "prefix", tokens[16:32]))
    chain.append(chunk_key(chain[1], "prefix", tokens[32:48]))
    assert PrefixKeys(tokens, "seed", 16)[::-1] == tuple(reversed(chain))  # a reversed slice hashes what it reads
    assert keys[-1] == chain[2] and keys[:2] == tuple(chain[:2]) and list(keys) == chain
    assert keys == tuple(chain) and keys == PrefixKeys(tokens, "seed", 16) and keys != PrefixKeys(tokens, "other", 16)
    with pytest.raises(IndexError):
        keys[3]
    assert not PrefixKeys(tokens[:15], "seed", 16)
    fresh = PrefixKeys(tokens, "seed", 16)
    fresh.hash_all()
    assert repr(fresh) == "PrefixKeys(3 blocks, 3 hashed)" and fresh == keys


def test_the_plan_queued_first_has_its_prefix_blocks_hashed_off_the_engine_thread(make_llm):
    _, llm = make_llm()
    plans = llm.engine.plan_plain_chat([Message("user", rag_prompt([0, 1, 2]))])  # any thread may plan it
    keys = plans[0].prefix_block_keys
    assert len(plans) == 1 and len(keys) >= 7 and repr(keys) == f"PrefixKeys({len(keys)} blocks, {len(keys)} hashed)"


def test_a_byte_identical_repeat_reads_the_first_requests_blocks_and_computes_one_block(make_llm):
    hf, llm = make_llm()
    messages = [Message("system", words(20, 100)), Message("user", words(37, 3) + " w5")]
    first = llm.chat(messages, sampling=GREEDY)
    plan = llm.plan_chat(messages)
    entries = cache_entries(llm)
    assert [entries[k] for k in plan.prefix_block_keys[:3]] and len(plan.prefix_block_keys) == 3  # 3 full blocks
    spy = PlanSpy(llm)
    contexts = []
    remove = llm.add_step_listener(lambda step: contexts.extend(
        [e.block_id for e in job.request.context_entries] for job in step.output.computes))
    again = llm.chat(messages, sampling=GREEDY)
    remove()
    assert again.token_ids == first.token_ids
    assert again.stats.num_exact_prefix_tokens == 48 and again.stats.num_computed_tokens == plan.num_prompt_tokens - 48
    assert contexts[0] == [entries[k][0] for k in plan.prefix_block_keys]  # the first request's own blocks
    assert spy.calls[0]["plan"].prefix_block_keys == plan.prefix_block_keys
    llm.client.call(lambda engine: engine.cache.check_integrity())


def test_a_chats_next_turn_reuses_the_first_turns_blocks(make_llm):
    _, llm = make_llm()
    turn = [Message("system", words(20, 100)), Message("user", words(30, 3))]
    first = llm.chat(turn, sampling=GREEDY)
    second = llm.chat(turn + [Message("assistant", first.text), Message("user", "w9 w8")], sampling=GREEDY)
    assert second.stats.num_exact_prefix_tokens == first.stats.num_prompt_tokens // 16 * 16 > 0


def test_a_tail_after_documents_and_text_is_reused_only_after_the_same_context(make_llm):
    """The tail's blocks follow the text segments' among the request's own blocks: the cached one
    is the tail's, and it answers as the oracle does; another document order is another context."""
    hf, llm = make_llm()
    llm.add_documents([("a", words(17, start=3)), ("b", words(33, start=40))])
    question = words(40, start=120)

    def messages(first, second):
        return [Message("user", ("w150 ", DocumentRef(first), "w152 w153 ", DocumentRef(second), question))]

    spy = PlanSpy(llm)
    llm.chat(messages("a", "b"), sampling=GREEDY)
    again = llm.chat(messages("a", "b"), sampling=GREEDY)
    assert again.stats.num_exact_prefix_tokens - len(spy.calls[1]["plan"].chunks[0].token_ids) == 32
    tokens, _ = plan_oracle(hf, spy.calls[1]["plan"], [], GREEDY.max_tokens)
    assert again.token_ids == tokens
    swapped = llm.chat(messages("b", "a"), sampling=GREEDY)
    assert swapped.stats.num_exact_prefix_tokens == len(spy.calls[2]["plan"].chunks[0].token_ids)  # head only
    llm.client.call(lambda engine: engine.cache.check_integrity())


def test_exact_prefix_blocks_stay_out_of_the_storage_tiers(make_llm):
    """Only the KV pool looks them up, so the host tier never receives them when evicted."""
    _, llm = make_llm(num_blocks=24, host_memory_bytes=4 << 20)
    for i in range(20):
        llm.chat([Message("user", words(60, start=7 * i))], sampling=GREEDY)
    stats = llm.stats()
    assert stats["num_evictions"] > 0 and stats["tiers"]["host"]["num_puts"] == 0


def test_a_preempted_requests_accounting_is_its_prompts(make_llm):
    """Preempted and recomputed, a request still reports what its prompt reused and computed."""
    import concurrent.futures

    _, llm = make_llm(num_blocks=20, max_num_batched_tokens=16)
    llm.add_documents([(f"d{i}", words(30, start=20 * i)) for i in range(4)])
    sampling = SamplingParams(max_tokens=40, ignore_eos=True)
    with concurrent.futures.ThreadPoolExecutor(8) as pool:
        outs = list(pool.map(lambda i: llm.generate("w1 w2", [f"d{i % 4}"], sampling=sampling), range(16)))
    assert llm.stats()["num_preemptions"] > 0
    for out in outs:
        s = out.stats
        assert s.num_computed_tokens <= s.num_prompt_tokens and s.num_cached_tokens + s.num_computed_tokens == \
            s.num_prompt_tokens
    llm.client.call(lambda engine: engine.cache.check_integrity())


def test_prefix_caching_off_caches_nothing_for_a_plain_prompt(make_llm):
    _, llm = make_llm(prefix_caching=False, learn_passages=False)
    prompt = [Message("user", words(40, 3))]
    llm.chat(prompt, sampling=GREEDY)
    assert llm.chat(prompt, sampling=GREEDY).stats.num_cached_tokens == 0
    assert llm.plan_chat(prompt).prefix_block_keys == ()
