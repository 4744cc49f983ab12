"""The prompt matcher: documents found in formatted prompts however frameworks reformat them."""

import hypothesis.strategies as st
import pytest
from hypothesis import assume, given, settings

from lazyattn_rag.engine.planning.prompt_match import (
    MIN_CHARS,
    Candidate,
    DocumentMatcher,
    resolve,
    split_message,
)
from lazyattn_rag.types.messages import DocumentRef

A = "file: a.txt\n\nAlpha line one is here.\nAlpha line two follows it."
B = "Beta paragraph with words.\n\nBeta more text here, it's \"quoted\" \\ too."


def parts(prompt, *candidates):
    m = DocumentMatcher(candidates)
    found, partial = m.occurrences(prompt)
    taken = resolve(found)
    return split_message(prompt, taken), partial, taken


def test_longest_match_wins_overlaps_and_short_texts_are_ignored():
    a, b = "alpha " * 8, "beta " * 8
    prompt = "ctx: " + b + " mid " + a + b + " end"
    out, partial, taken = parts(prompt, Candidate("a", a), Candidate("b", b), Candidate("ab", a + b),
                                Candidate("short", "alpha"))
    assert out == ["ctx: ", DocumentRef("b"), "  mid ", DocumentRef("ab"), "  end"]  # the stripped texts match
    assert [prompt[s:e] for s, e, *_ in taken] == [b.strip(), (a + b).strip()]
    assert partial == set() and len("alpha") < MIN_CHARS


def test_whitespace_is_compared_as_single_spaces_and_the_separator_between_documents_dropped():
    prompt = "Context:\n  " + A.replace("\n\n", "\n") + "\n\n\n" + B.replace("\n\n", " ") + "\n\nQuery: q"
    out, _, _ = parts(prompt, Candidate("a", A), Candidate("b", B))
    assert out == ["Context:\n  ", DocumentRef("a"), DocumentRef("b"), "\n\nQuery: q"]


def test_python_repr_of_a_text_list_is_decoded():
    """LlamaIndex's simple_summarize formats ``context_str`` with the repr of a one-string list."""
    prompt = "Context information is below.\n-----\n" + repr(["\n".join([A, B])]) + "\n-----\nQuery: q"
    out, _, taken = parts(prompt, Candidate("a", A), Candidate("b", B))
    assert out[1:3] == [DocumentRef("a"), DocumentRef("b")]  # the escaped "\n" between them is dropped
    assert out[0].endswith("['") and out[3].startswith("']") and all(t[3] for t in taken)


def test_every_occurrence_is_placed_and_a_truncated_document_is_reported_not_matched():
    prompt = A + "\n\n" + B + "\n\n" + A + "\n\n" + B[:45]
    out, partial, _ = parts(prompt, Candidate("a", A), Candidate("b", B))
    assert out == [DocumentRef("a"), DocumentRef("b"), DocumentRef("a"), "\n\n" + B[:45]]
    assert partial == set()  # "b" matched whole elsewhere
    long = A + " " + B  # 139 characters
    out, partial, _ = parts("x " + long[:100] + " y", Candidate("a", long))
    assert out == ["x " + long[:100] + " y"] and partial == {"a"}  # most of it: cut, reported
    out, partial, _ = parts("x " + long[:40] + " y", Candidate("a", long))
    assert partial == set()  # an opening alone (a shared header, a chunk overlap) is not a cut document


def test_a_document_never_matches_inside_a_longer_word():
    doc = "cat sat on the mat and looked at the door for a while"
    out, _, _ = parts("concat sat on the mat and looked at the door for a while.", Candidate("d", doc))
    assert out == ["concat sat on the mat and looked at the door for a while."]
    out, _, _ = parts("A " + doc + "s later.", Candidate("d", doc))
    assert not [p for p in out if isinstance(p, DocumentRef)]
    out, _, _ = parts("A " + doc + ". Later.", Candidate("d", doc))
    assert out == ["A ", DocumentRef("d"), ". Later."]


@pytest.mark.parametrize("doc,text", [
    ("the measured boiling point of the brine sample is 104.", "the measured boiling point of the brine sample is 104.7 C."),
    ("the shipment of looms to Arvel totalled 3", "the shipment of looms to Arvel totalled 3,500 units."),
    ("the firmware that fixed the boiler valve was version 2", "the firmware that fixed the boiler valve was version 2.7, in May."),
    ("500 units were shipped to Arvel by the looms company", "about 3,500 units were shipped to Arvel by the looms company"),
])
def test_a_document_never_matches_inside_a_longer_number(doc, text):
    """A break-it trial placed "... is 104." inside "104.7" (and the same for "3,500", "2.7"): the
    document's K/V was read where the prompt said something else."""
    out, _, _ = parts(text, Candidate("d", doc))
    assert out == [text]
    out, _, _ = parts("See: " + doc + " and more.", Candidate("d", doc))
    assert DocumentRef("d") in out  # a number that ends where the document does is still its end


def test_escapes_outside_unicode_are_left_as_text():
    prompt = r"open C:\U12345678\notes.txt and \UFFFFFFFF then " + A
    out, _, _ = parts(prompt, Candidate("a", A))
    assert out[-1] == DocumentRef("a")


words = st.text(alphabet="abcdefghij", min_size=1, max_size=6)
docs_strategy = st.lists(st.lists(words, min_size=8, max_size=20).map(" ".join), min_size=1, max_size=4,
                         unique=True)


@settings(max_examples=60, deadline=None)
@given(docs_strategy, st.lists(st.integers(0, 3), min_size=1, max_size=6), st.sampled_from(["\n\n", "\n", "  "]))
def test_a_prompt_built_from_documents_and_text_splits_back_into_them(docs, order, sep):
    """Documents pasted between marker text (with any whitespace separator) come back in order."""
    assume(all(len(d) >= MIN_CHARS for d in docs) and not any(a != b and a in b for a in docs for b in docs))
    chosen = [i % len(docs) for i in order]
    prompt = "HEAD:" + sep + sep.join(docs[i] for i in chosen) + sep + "TAIL"
    candidates = [Candidate(f"d{i}", d) for i, d in enumerate(docs)]
    out, _, _ = parts(prompt, *candidates)
    refs = [p.id for p in out if isinstance(p, DocumentRef)]
    texts = [p for p in out if isinstance(p, str)]
    assert refs == [f"d{i}" for i in chosen]
    assert texts[0].startswith("HEAD:") and texts[-1].endswith("TAIL")
