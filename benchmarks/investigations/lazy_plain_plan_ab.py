"""A replica's planning of pasted prompts, with the plain prompt tokenized whole before the passage
learner chooses (the tree before commit f7885d3) and with the learner planning it only where its
choice needs it (since), interleaved on one CPU: issue 36, 2026-12-06.

The trace is ``benchmarks/http_reuse.py``'s (Zipf 2.1 over 200 documents of 512 tokens, 5 pasted
per prompt, 400 prompts), the engine its overhead run's (``tiny-32k``, whose word tokenizer knows
every word of the trace, as the GPU arms' 8B shape does); the timings are that benchmark's
``planning_ms`` and ``burst_planning_ms``, two rounds of each setting, medians in ms; and how
many of the prompts, each planned once on a fresh engine, had their plain prompt planned whole.

    python benchmarks/investigations/lazy_plain_plan_ab.py --out http_reuse_lazy_plain_plan_ab_cpu
"""

from __future__ import annotations

import statistics
import sys
from pathlib import Path

import typer

sys.path.insert(0, str(Path(__file__).resolve().parents[2]))

from benchmarks.serving_results import command_line, environment, write  # noqa: E402
from benchmarks.http_reuse import burst_planning_ms, pasted, planning_ms  # noqa: E402
from benchmarks.serving_setup import Bench, make_engine  # noqa: E402
from benchmarks.serving_workload import Workload  # noqa: E402
from lazyattn_rag.engine.engine import LLMEngine  # noqa: E402
from lazyattn_rag.engine.planning.prompt_plan import PrefixKeys  # noqa: E402
from lazyattn_rag.types.messages import as_message  # noqa: E402


def whole_plain_plan(self, messages, namespace, remedies):
    """``LLMEngine._chat_plans`` before f7885d3: the plain prompt planned (tokenized) first."""
    plan = self.planner.plan_messages(messages, namespace, remedies)
    learned = self.passages.choose(messages, plan, namespace, remedies) if self.passages is not None else plan
    for keys in (learned.prefix_block_keys, learned.head_prefix_keys):
        if isinstance(keys, PrefixKeys):
            keys.hash_all()
    return [plan] if learned is plan else [learned, plan]


def count_plain_plans(engine, prompts) -> int:
    """Prompts of ``prompts`` (each planned once, in order) whose plain prompt was planned whole."""
    plan_messages, count = engine.planner.plan_messages, [0]

    def counting(messages, *args, **kwargs):
        count[0] += all(isinstance(p, str) for m in messages for p in m.parts())
        return plan_messages(messages, *args, **kwargs)

    engine.planner.plan_messages = counting
    try:
        for messages in prompts:
            engine.plan_plain_chat(messages)
    finally:
        engine.planner.plan_messages = plan_messages
    return count[0]


def engine():
    """The overhead run's engine: ``tiny-32k`` on the CPU, lazy, 64 MiB of KV."""
    return make_engine(Bench.build("tiny-32k", "cpu", "float32", hash_weights=False), "lazy", 64 << 20, "cpu", 2048, 16)


def main(num_requests: int = 400, rounds: int = 2, out: str = "http_reuse_lazy_plain_plan_ab_cpu") -> None:
    workload = Workload(200, 512, 5, 2.1, 64, 32, num_requests, 0)
    docs = workload.documents()
    prompts = [[as_message({"role": "user", "content": pasted([docs[i] for i in ids], q)})]
               for q, ids in workload.requests()]
    settings = {"whole_plain_plan": whole_plain_plan, "lazy_plain_plan": LLMEngine._chat_plans}
    times: dict[str, dict[str, list[float]]] = {name: {} for name in settings}
    plain_plans: dict[str, int] = {}
    try:
        for _ in range(rounds):
            for name, chat_plans in settings.items():
                LLMEngine._chat_plans = chat_plans
                if name not in plain_plans:  # on an engine of its own: the timings start from a fresh one
                    llm = engine()
                    plain_plans[name] = count_plain_plans(llm.engine, prompts)
                    llm.close()
                llm = engine()
                for key, values in (planning_ms(llm.engine, prompts) | burst_planning_ms(llm.engine, prompts)).items():
                    times[name].setdefault(key, []).extend(values)
                llm.close()
    finally:
        LLMEngine._chat_plans = settings["lazy_plain_plan"]
    summary = {name: {k: statistics.median(v) for k, v in t.items()} for name, t in times.items()}
    print(summary, plain_plans)
    write(out, {"environment": environment(), "command": command_line(), "num_prompts": len(prompts),
                "rounds": rounds, "plain_plans_made": plain_plans, "median_ms": summary})


if __name__ == "__main__":
    typer.run(main)
