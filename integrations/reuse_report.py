"""Reuse reports: what one LLM call reused, and the sum over a query's calls.

Every call of :class:`~lazyattn_rag.integrations.llamaindex.LazyAttentionLLM` or
:class:`~lazyattn_rag.integrations.langchain.ChatLazyAttention` makes a :class:`CallReport`
(``doc_ids`` placed, the matcher's ``prompt_match`` for formatted text, and ``stats`` /
``finish_reason`` once the request finishes). A query that made several calls (LlamaIndex's
refine and tree_summarize modes, a chat engine that condenses the question first) gets a
:class:`ReuseSummary` in its response's metadata, kept up to date as streamed calls finish.
"""

from __future__ import annotations

from lazyattn_rag.types.outputs import StreamDelta

_SUMMED = ("num_prompt_tokens", "num_cached_tokens", "num_computed_tokens", "num_output_tokens")


class CallReport(dict):
    """One call: ``{"doc_ids", "prompt_match"?, "stats"?, "finish_reason"?}`` (JSON-able)."""

    def __init__(self, doc_ids: list[str], prompt_match: dict | None = None):
        super().__init__(doc_ids=list(doc_ids))
        if prompt_match is not None:
            self["prompt_match"] = prompt_match
        self._summaries: list[ReuseSummary] = []

    def finish(self, delta: StreamDelta) -> None:
        """The request finished: record its stats and refresh the summaries it belongs to."""
        self.update(stats=delta.stats.as_dict(), finish_reason=delta.finish_reason)
        for summary in self._summaries:
            summary.refresh()


class ReuseSummary(dict):
    """The calls of one query and what they reused (JSON-able).

    Keys: ``doc_ids`` (every document placed, in call order), ``stats`` (one call: its
    :class:`~lazyattn_rag.types.outputs.RequestStats` as a dict; several: the summed token counts
    ``num_prompt_tokens`` / ``num_cached_tokens`` / ``num_computed_tokens`` /
    ``num_output_tokens``, ``docs_hit`` and ``docs_missed`` of all, and the first call's
    ``ttft_ms``), ``finish_reason`` (the last call's), ``num_llm_calls``, ``num_finished`` and
    ``calls`` (each :class:`CallReport`). Calls still streaming count once they finish: a
    streamed response's ``stats`` are zeros (``finish_reason`` ``None``) until it is read.
    """

    def __init__(self, calls: list[CallReport] = ()):
        super().__init__()
        self.calls: list[CallReport] = []
        self.add(calls)

    def add(self, calls: list[CallReport]) -> None:
        """Count more calls (each once)."""
        for call in calls:
            if not any(call is c for c in self.calls):
                self.calls.append(call)
                call._summaries.append(self)
        self.refresh()

    def refresh(self) -> None:
        finished = [c for c in self.calls if "stats" in c]
        self.update(num_llm_calls=len(self.calls), num_finished=len(finished),
                    doc_ids=[d for c in self.calls for d in c["doc_ids"]], calls=list(self.calls))
        if len(self.calls) == 1 and finished:
            self.update(stats=finished[0]["stats"], finish_reason=finished[0]["finish_reason"])
            return
        stats = [c["stats"] for c in finished]  # none yet: a stream not read, zeros until its calls finish
        total = {key: sum(s[key] for s in stats) for key in _SUMMED}
        total.update(docs_hit=[d for s in stats for d in s["docs_hit"]],
                     docs_missed=[d for s in stats for d in s["docs_missed"]],
                     ttft_ms=stats[0]["ttft_ms"] if stats else None)
        self.update(stats=total, finish_reason=finished[-1]["finish_reason"] if finished else None)
