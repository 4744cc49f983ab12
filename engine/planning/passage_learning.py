"""Passages learned from traffic: recurring pieces of plain prompts placed as cached chunks (issue 36).

An application that pastes retrieved texts into its messages names no documents. The learner
(``CacheConfig.learn_passages``) splits the system messages and the last user message of each
chat request into pieces (``engine/planning/passages.py``), records which pieces it has seen
(:class:`~lazyattn_rag.engine.planning.passages.PassageHistory`), and lays out a request whose pieces
recur with those pieces as position-agnostic chunks (ids ``passage:<hash>``), keyed exactly as a
registered document with the same text, so a passage served once is read from the cache at
whatever offset it comes back. The rule, in order:

1. eligible pieces: in a request that places no document by id, in a system message or the last
   user message (never a chat history turn), not a separator or label, not a message's whole
   text (a single chat turn is never cut), not the user's question (what follows a ``Question:``
   label up to the next label, a piece ending with a question mark, or the end of a user message:
   its last piece and the short pieces before it, :func:`_question_tail`, or where its question
   label is followed by a context label, only where it ends short and unlabelled,
   :func:`_question_first_tail`);
2. recurring: earlier requests contained the piece whole at least
   ``CacheConfig.passage_min_sightings`` times; at least ``CacheConfig.passage_min_tokens``
   tokens as a chunk;
3. worth it: a learned layout is taken only when it computes fewer tokens now than the plain
   prompt with its cached head and exact-prefix blocks, counting a passage encoded for the first
   time as free (it costs what computing it in place would, and serves every later request) unless
   the plain prompt reads it from the cache where it is, and a prompt head not cached as what it
   encodes past the blocks it is seeded from (an earlier plain prompt's exact-prefix blocks,
   ``PromptPlan.head_prefix_keys``), and never when the plain prompt computes
   at most one block (an exact repeat keeps its prefix); the same layout without the passages that
   lie where the plain prompt reads cached K/V in place (a template's fixed instruction in a
   cached prompt head) is weighed too, and of equal costs the one with fewer passages is taken.

Text that never recurs costs the split and one XXH3 hash per piece; its tokens are the plain
prompt's, computed as before. Where passages recur, the plain prompt is tokenized whole only when
the weighing needs it (:meth:`PassageLearner.choose`).
"""

from __future__ import annotations

import contextlib
import re
import threading
from collections import OrderedDict
from collections.abc import Callable, Sequence

from lazyattn_rag.engine.kv.chunk_cache import ChunkCache
from lazyattn_rag.engine.planning.passages import (CONTEXT_WORDS, PassageHistory, Piece, PlainPrefixes, is_plain_label,
                                                   passage_key, piece_digests, split_passages)
from lazyattn_rag.engine.planning.planner import PromptPlanner
from lazyattn_rag.engine.planning.prompt_plan import PromptPlan
from lazyattn_rag.engine.planning.registry import RegisteredDocument
from lazyattn_rag.types.config import CacheConfig, RequestRemedies
from lazyattn_rag.types.errors import LazyAttentionError
from lazyattn_rag.types.messages import DocumentRef, Message, MessagePart

PASSAGE_ID_PREFIX = "passage:"
PREPARED_PASSAGES = 2048  # tokenized passages kept (about 7 KB each at 512 tokens)
# Tokens by which the plain prompt's count may differ from the learned layout's per boundary
# between a passage and the text around it (the two are tokenized at different cuts)
BOUNDARY_SLACK_TOKENS = 8


class PassageLearner:
    """Chooses, for each plain chat request, its plain plan or the one with learned passages.

    Args:
        planner: the engine's planner (tokenizes passages, plans both layouts).
        cache: the chunk cache (read only: which chunks and prefix blocks are cached now).
        config: the ``CacheConfig`` (``passage_*`` fields).
    """

    def __init__(self, planner: PromptPlanner, cache: ChunkCache, config: CacheConfig):
        self.planner, self.cache = planner, cache
        self.min_tokens, self.min_sightings = config.passage_min_tokens, config.passage_min_sightings
        self.history = PassageHistory(config.passage_history)
        self.plain_prefixes = PlainPrefixes(config.passage_history)  # where plain layouts have been
        # recurring passages tokenized once (as registered documents are), the most recent kept
        self._prepared: OrderedDict[tuple[str, str], RegisteredDocument] = OrderedDict()
        # choose() runs in the callers' threads (LLMEngine.plan_plain_chat): it holds this lock,
        # released while it tokenizes a plain prompt or a prefix of one (_released). One hold per
        # request: a lock taken and given back many times a request convoys its threads behind the
        # GIL (a burst of 16 took 0.5-0.7 s at Python's 5 ms switch interval)
        self._lock = threading.Lock()

    def choose(self, messages: Sequence[Message], plain: PromptPlan | Callable[[], PromptPlan], namespace: str = "",
               remedies: RequestRemedies = RequestRemedies()) -> PromptPlan:
        """``plain`` (the plan of ``messages`` as they are) or a plan with recurring passages
        placed as chunks (see the module docstring); records the request's pieces.

        Two layouts are weighed against ``plain``: every recurring passage a chunk, and the same
        without the passages that lie where ``plain`` already reads cached K/V in place (its
        cached prompt head, or its exact-prefix blocks): those are served exactly as they are.

        ``plain`` may be given as a function that plans it, called only where it is needed. For
        messages that place nothing (the prompt computed whole) the plain prompt reads in place
        only its exact-prefix blocks, and those only as far as an earlier plain layout had the
        same content: up to the end of its first piece that no plain layout of this learner had
        the same content up to (:class:`~lazyattn_rag.engine.planning.passages.PlainPrefixes`).
        So only that prefix is tokenized to count the blocks read in place (if they reach its
        end, written by a plain prompt not recorded here, the full weighing runs), the layouts
        with passages are weighed against it as above, and the best is taken without planning
        the plain prompt when it computes fewer tokens than the plain prompt's rest, less
        :data:`BOUNDARY_SLACK_TOKENS` per cut and one block; else (and when every piece was seen:
        a repeat) the plain prompt is planned and weighed as above.
        Tokenizing the whole pasted prompt was most of a replica's planning of it (681 of 870
        py-spy samples on the CPU for the HTTP trace's prompts). A plain layout chosen is
        recorded.

        Thread-safe: the history, the prepared passages and the plain prefixes change under a
        lock, given up while a plain prompt or a prefix of one is tokenized; the cache is only
        read, entry by entry (a layout chosen on a stale view is still correct).
        """
        with self._lock:
            chosen = self._choose(messages, plain, namespace, remedies)
            if _whole(messages) and not any(c.learned for c in chosen.chunks):
                self.plain_prefixes.record(namespace, _contents(messages))
            return chosen

    @contextlib.contextmanager
    def _released(self):
        """The lock given up while the block runs (tokenizing: the planner is thread-safe)."""
        self._lock.release()
        try:
            yield
        finally:
            self._lock.acquire()

    def _choose(self, messages: Sequence[Message], plain: PromptPlan | Callable[[], PromptPlan], namespace: str,
                remedies: RequestRemedies) -> PromptPlan:
        recurring = self._recurring(messages, namespace)
        if recurring and not isinstance(plain, PromptPlan) and _whole(messages):
            quick = self._learned_without_plain(messages, recurring, namespace, remedies)
            if quick is not None:
                return quick
        if not isinstance(plain, PromptPlan):
            with self._released():
                plain = plain()
        if not recurring:
            return plain
        plain_cost = self.num_to_compute(plain)
        if plain_cost <= self.cache.block_size:
            return plain
        best = self._best_learned(messages, recurring, namespace, remedies, self._cached_in_place(plain))
        return plain if best is None or (plain_cost, 0) <= _rank(best) else best[0]

    def _best_learned(self, messages: Sequence[Message], recurring: dict[tuple[int, int], list[Piece]], namespace: str,
                      remedies: RequestRemedies, in_place: int) -> tuple[PromptPlan, int] | None:
        """Of every recurring passage a chunk, and the same without the passages that start where
        the plain prompt reads ``in_place`` tokens from the cache, the layout computing the fewest
        tokens (of equals, the fewer passages: the least attention changed), with that count."""
        learned = self._learned(messages, recurring, namespace, remedies, in_place)
        if learned is None:
            return None
        inside = {c.doc_id for c in learned[0].chunks if c.learned and c.global_start < in_place}
        rest = self._learned(messages, recurring, namespace, remedies, in_place, skip=inside) if inside else None
        return min([learned] + ([rest] if rest is not None else []), key=_rank)

    def _learned_without_plain(self, messages: Sequence[Message], recurring: dict[tuple[int, int], list[Piece]],
                               namespace: str, remedies: RequestRemedies) -> PromptPlan | None:
        """The layout :meth:`_choose` would take, when it is sure not to be the plain prompt,
        judged without planning that (see :meth:`choose`); ``None`` when it cannot be sure."""
        in_place = self._plain_in_place(messages, namespace)
        best = None if in_place is None else self._best_learned(messages, recurring, namespace, remedies, in_place)
        if best is None:
            return None
        plan, cost = best
        # what the plain prompt computes, at the least: its tokens (this plan's, give or take a few
        # at each cut) past what it reads in place
        slack = BOUNDARY_SLACK_TOKENS * (sum(c.learned for c in plan.chunks) + 1)
        if plan.num_prompt_tokens + slack >= self.planner.max_model_len:
            return None  # the plain prompt may be too long: planning it says (and refuses it as before)
        plain_cost = plan.num_prompt_tokens - in_place - slack
        return plan if cost < plain_cost - self.cache.block_size else None

    def _plain_in_place(self, messages: Sequence[Message], namespace: str) -> int | None:
        """Tokens the plain prompt of text-only ``messages`` would read from the cache in place
        (its cached exact-prefix blocks), found by tokenizing it only as far as the end of its
        first piece no plain layout of this learner had the same content up to
        (:class:`PlainPrefixes`): its cached blocks end before there, or else (they reach the
        cut, whatever wrote them) ``None``, as when every piece was seen (a repeat): the full
        weighing decides then."""
        texts = []
        for (_, _, piece), digest in piece_digests(namespace, _contents(messages)):
            texts.append(piece.text)
            if digest in self.plain_prefixes:
                continue
            if not self.planner.caches_prefixes:
                return 0
            # tokenized as far as this piece even when it is the first: blocks cached by a plain
            # prompt not recorded here (a raw completion, the fallback of a learned layout that did
            # not fit) are counted, or make the full weighing run
            with self._released():
                keys = self.planner.plain_prefix_keys(list(messages), texts, namespace)
            if keys is None:  # the pieces were not found in the rendered prompt
                return None
            hits = self._prefix_hits(keys)
            return hits * self.cache.block_size if hits < len(keys) else None
        return None

    def _learned(self, messages: Sequence[Message], recurring: dict[tuple[int, int], list[Piece]], namespace: str,
                 remedies: RequestRemedies, in_place: int, skip: set[str] = frozenset()
                 ) -> tuple[PromptPlan, int] | None:
        """The plan with the recurring passages (but ``skip``) as chunks and what it computes now:
        a passage not cached yet counts as free, unless it starts within the first ``in_place``
        tokens, which the plain prompt reads from the cache where they are (there, learning it
        would compute it again); ``None`` when none is placed or it does not plan."""
        learned_messages, passages = self._substitute(messages, recurring, namespace, skip)
        if not passages:
            return None
        try:
            plan = self.planner.plan_messages(learned_messages, namespace, remedies, passages)
        except (LazyAttentionError, ValueError):  # e.g. longer than the context once split: keep it plain
            return None
        new = {c.key for c in plan.chunks if c.learned and c.global_start >= in_place
               and self.cache.lookup(c.key, touch=False, include_dead=True) is None}
        return plan, self.num_to_compute(plan, free=new)

    def _cached_in_place(self, plan: PromptPlan) -> int:
        """Tokens at the start of ``plan`` it reads from the cache where they were computed: its
        prompt head when cached, or its cached exact-prefix blocks (a prompt with nothing placed)."""
        if plan.chunks:
            head = plan.chunks[0]
            cached = head.doc_id is None and self.cache.lookup(head.key, touch=False) is not None
            return len(head.token_ids) if cached else 0
        if plan.texts:
            return 0
        return self._prefix_hits(plan.prefix_block_keys) * self.cache.block_size

    def num_to_compute(self, plan: PromptPlan, free: set[str] = frozenset()) -> int:
        """Prompt tokens ``plan`` would compute if it were admitted now: chunks not cached (but
        those in ``free``; a head not cached less the blocks it is seeded from,
        ``PromptPlan.head_prefix_keys``), its text segments, and its tail past the cached prefix
        blocks."""
        total, seen, bs = plan.num_text_tokens, set(), self.cache.block_size
        for i, c in enumerate(plan.chunks):
            if c.key in seen or c.key in free:
                continue
            seen.add(c.key)
            if self.cache.lookup(c.key, touch=False, include_dead=True) is None:
                seeded = 0
                if i == 0 and c.doc_id is None:  # as admission seeds it
                    seeded = min(self._prefix_hits(plan.head_prefix_keys), len(c.token_ids) // bs) * bs
                total += len(c.token_ids) - seeded
        tail = len(plan.query_token_ids)
        return total + max(tail - self._prefix_hits(plan.prefix_block_keys) * bs, min(tail, 1))

    def _prefix_hits(self, keys: Sequence[str]) -> int:
        """The leading blocks of the chain ``keys`` that are cached now."""
        hits = 0
        for key in keys:
            entry = self.cache.lookup(key, touch=False)
            if entry is None or not entry.ready:
                break
            hits += 1
        return hits

    # --- pieces -------------------------------------------------------------------------------
    def _recurring(self, messages: Sequence[Message], namespace: str) -> dict[tuple[int, int], list[Piece]]:
        """Record the eligible pieces; those recurring enough, by ``(message, part)`` index."""
        found: dict[tuple[int, int], list[tuple[Piece, str]]] = {}
        for where, piece, key in eligible_pieces(messages, namespace, self.min_tokens):
            found.setdefault(where, []).append((piece, key))
        if not found:
            return {}
        before = self.history.observe(k for pieces in found.values() for _, k in pieces)
        out: dict[tuple[int, int], list[Piece]] = {}
        for where, pieces in found.items():
            chosen = [p for p, k in pieces if before[k] >= self.min_sightings]
            if chosen:
                out[where] = chosen
        return out

    def _prepare(self, text: str, namespace: str) -> RegisteredDocument:
        """The passage of ``text`` (:meth:`PromptPlanner.prepare_passage`), tokenized once while
        it keeps recurring."""
        key = (namespace, text)
        passage = self._prepared.pop(key, None) or self.planner.prepare_passage(text, namespace)
        self._prepared[key] = passage
        if len(self._prepared) > PREPARED_PASSAGES:
            self._prepared.popitem(last=False)
        return passage

    def _substitute(self, messages: Sequence[Message], recurring: dict[tuple[int, int], list[Piece]],
                    namespace: str, skip: set[str] = frozenset()) -> tuple[list[Message], dict[str, RegisteredDocument]]:
        """``messages`` with each recurring piece long enough in tokens (and whose passage id is
        not in ``skip``) replaced by a reference to its passage, and the passages by id."""
        passages: dict[str, RegisteredDocument] = {}
        out = []
        for m_index, message in enumerate(messages):
            parts: list[MessagePart] = []
            for p_index, part in enumerate(message.parts()):
                pieces = recurring.get((m_index, p_index), ())
                if not pieces:
                    parts.append(part)
                    continue
                pos = 0
                for piece in pieces:
                    passage = self._prepare(piece.text, namespace)
                    passage_id = PASSAGE_ID_PREFIX + passage.key[:16]
                    if len(passage.token_ids) < self.min_tokens or passage_id in skip:
                        continue
                    passages[passage_id] = passage
                    gap = part[pos:piece.start]
                    if gap and not (parts and isinstance(parts[-1], DocumentRef) and not gap.strip()):
                        parts.append(gap)
                    parts.append(DocumentRef(passage_id))
                    pos = piece.end
                if part[pos:]:
                    parts.append(part[pos:])
            out.append(Message(message.role, tuple(parts)) if parts != list(message.parts()) else message)
        return out, passages


def _rank(option: tuple[PromptPlan, int]) -> tuple[int, int]:
    """A layout's order of preference: the fewest tokens to compute; of equals, the fewest
    passages (the least attention changed)."""
    plan, cost = option
    return cost, sum(c.learned for c in plan.chunks)


def _whole(messages: Sequence[Message]) -> bool:
    """Whether ``messages`` place nothing (text only): their plain plan computes them whole."""
    return all(isinstance(part, str) for m in messages for part in m.parts())


def _contents(messages: Sequence[Message]) -> list[tuple[str, list[str]]]:
    """``(role, text parts)`` of text-only ``messages``, as :class:`PlainPrefixes` reads them."""
    return [(m.role, list(m.parts())) for m in messages]


def eligible_pieces(messages: Sequence[Message], namespace: str, min_chars: int):
    """``((message index, part index), piece, key)`` of every piece a passage may be learned from
    (rule 1 of the module docstring; at least ``min_chars`` characters), with its sightings key
    (:func:`~lazyattn_rag.engine.planning.passages.passage_key`): what ``lazyattn serve``'s router hashes
    to send a request where its passages were seen.

    The user's question is never one: what follows a question label (``Question:``, ``Query:``,
    ``Input:``, ``Q:``) up to the next label, a piece that ends with a question mark (``?``, ``？``,
    ``؟``), and the end of a user message (:func:`_question_tail`); where the label right after its
    last question label is a context label (a question-first template such as ``Question: ...
    Context: ...``), only where it ends short and unlabelled (:func:`_question_first_tail`). The
    question has to read the documents before it, and a question asked again in the same words
    would otherwise come back as a chunk that reads none of them."""
    for m_index, message, parts in _eligible_messages(messages):
        pieces = [(p_index, piece) for p_index, part in parts for piece in split_passages(part)]
        tail = set() if message.role != "user" else _question_first_tail(pieces) if _question_first(pieces) \
            else _question_tail(pieces)
        whole = len(message.parts()) == 1 and len(pieces) == 1
        labelled = False  # inside a question label's text (up to the next separator or label)
        for i, (p_index, piece) in enumerate(pieces):
            if piece.separator:
                labelled = bool(_QUESTION_LABEL.match(piece.text))
                continue
            question = labelled or piece.text.endswith(QUESTION_MARKS) or i in tail
            if len(piece.text) < min_chars or whole or question:
                continue
            yield (m_index, p_index), piece, passage_key(namespace, piece.text)


_QUESTION_LABEL = re.compile(r"(?:question|query|input|q)\s*:", re.IGNORECASE)
QUESTION_MARKS = ("?", "\uff1f", "\u061f", "\u037e")  # ?, fullwidth (CJK), Arabic, Greek
_CONTEXT_LABEL = re.compile(rf"[ \t]*(?:{CONTEXT_WORDS})\b[^:\n]{{0,38}}:", re.IGNORECASE)  # also "Document 2:"
# The end of a user message read as its question (_question_tail): a question and its closing
# instructions ("Think step by step.", in any language) are short pieces; retrieved texts are longer
QUESTION_MAX_CHARS, QUESTION_TAIL_PIECES = 300, 3


def _question_first(pieces: Sequence[tuple[int, Piece]]) -> bool:
    """Whether the label right after the message's last question label is a context label (a
    question-first template, ``Question: ... Context: ...``: the message ends with a document).
    A retrieved FAQ's ``Question:``/``Answer:`` pair is not one (an answer label follows it)."""
    labels = [piece.text for _, piece in pieces if piece.separator]
    last_question = max((i for i, text in enumerate(labels) if _QUESTION_LABEL.match(text)), default=None)
    return (last_question is not None and last_question + 1 < len(labels)
            and bool(_CONTEXT_LABEL.match(labels[last_question + 1])))


def _question_first_tail(pieces: Sequence[tuple[int, Piece]]) -> set[int]:
    """The end of a question-first message read as a question of its own: :func:`_question_tail`
    where its last piece is at most ``QUESTION_MAX_CHARS`` long and no label but a closing one
    follows it (the user's question after a retrieved text's own ``Input:`` line and a
    ``References:`` label also reads as a question-first template); none where it is longer (the
    last document) or an answer label follows it (``rlm/rag-prompt``'s ``Answer:``)."""
    last = max((i for i, (_, piece) in enumerate(pieces) if not piece.separator), default=None)
    if last is None or len(pieces[last][1].text) > QUESTION_MAX_CHARS:
        return set()
    if any(not _closing_label(piece.text) for _, piece in pieces[last + 1:]):
        return set()
    return _question_tail(pieces)


def _closing_label(text: str) -> bool:
    """A label of the closing instructions (``Return JSON:``, ``Output format:``), not one that
    opens the question or a context section (the tail reads across it)."""
    return is_plain_label(text) and not _QUESTION_LABEL.match(text) and not _CONTEXT_LABEL.match(text)


def _question_tail(pieces: Sequence[tuple[int, Piece]]) -> set[int]:
    """Indices of the pieces that end a user message as its question: its last piece that is not
    a separator, and back from it, up to a separator or label, the piece before each piece of at
    most ``QUESTION_MAX_CHARS`` characters where it is that short too, ``QUESTION_TAIL_PIECES`` at
    most: the question a closing instruction follows. A retrieved document that short, last in a
    message with no label before the question, is computed in place (reuse lost, never a
    question read as a context-blind chunk)."""
    tail: list[int] = []
    for i in range(len(pieces) - 1, -1, -1):
        piece = pieces[i][1]
        if piece.separator:
            if tail and not _closing_label(piece.text):
                break
            continue
        if tail and (len(pieces[tail[-1]][1].text) > QUESTION_MAX_CHARS or len(piece.text) > QUESTION_MAX_CHARS
                     or len(tail) == QUESTION_TAIL_PIECES):
            break
        tail.append(i)
    return set(tail)


def _eligible_messages(messages: Sequence[Message]):
    """``(message index, message, [(part index, text)])`` of the messages passages may come from:
    system messages and the last user message, of a request that places no document by id (a
    caller that names its documents has said what its documents are; one found by a matcher in
    plain text is no such statement)."""
    if any(isinstance(p, DocumentRef) and not p.matched for m in messages for p in m.parts()):
        return
    last_user = max((i for i, m in enumerate(messages) if m.role == "user"), default=None)
    for m_index, message in enumerate(messages):
        if message.role != "system" and m_index != last_user:
            continue
        parts = [(p_index, part) for p_index, part in enumerate(message.parts()) if isinstance(part, str) and part.strip()]
        if parts:
            yield m_index, message, parts
