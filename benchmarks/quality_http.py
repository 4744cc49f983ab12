"""The quality harness's questions sent over HTTP to a ``lazyattn serve`` app (issue 36).

``benchmarks/quality.py --modes full,http-by-id,http-learned`` starts one Serve application on this
machine (one replica of the harness's model, dtype, device, prompt and anchor; the first-token
distribution returned whole: ``ServeConfig.max_logprobs = -1``) and asks every question twice
more through its OpenAI-compatible API:

* ``http-by-id``: the passages registered (``POST /v1/documents``) and named in the
  ``documents`` field, in the source's order: the engine's own RAG prompt;
* ``http-learned``: nothing registered; the prompt sent as plain text, the passages pasted between
  the instruction and the question exactly as the engine's RAG prompt lays them out, so the
  tokens are the by-id request's. Each question is first asked twice with its passages in other
  orders (so they have been seen, and the exact-prefix cache does not serve the measured
  request), then in the source's order: its passages come from the chunks the server learned.

Per request two calls: the first answer token's whole distribution (``max_tokens=1``,
``top_logprobs=-1``, token ids as ``token_id:<id>``), compared with ``full``'s of the same run
(KL, top-1 agreement), and the answer (greedy). The server's stats say how each passage was
placed; ``learned_placements`` counts the passages served as learned chunks.
"""

from __future__ import annotations

import random
from concurrent.futures import ThreadPoolExecutor
from dataclasses import replace

import numpy as np
from tqdm import tqdm

from benchmarks.qa_data import QAExample, passage_text

HTTP_MODES = ("http-by-id", "http-learned")
APP = "quality-http"


class QualityServer:
    """A Serve app of ``engine_config`` on a free loopback port (``with`` starts and stops it)."""

    def __init__(self, engine_config, concurrency: int):
        self.engine_config, self.concurrency = engine_config, concurrency

    def __enter__(self) -> "QualityServer":
        import ray
        from ray import serve

        from lazyattn_rag.serve import ServeConfig, build_app
        from tests.redis_server import free_port

        port = free_port()
        ray.init(include_dashboard=False, logging_level="ERROR", log_to_driver=False)
        serve.start(http_options={"host": "127.0.0.1", "port": port})
        gpus = 1.0 if str(self.engine_config.device).startswith("cuda") else 0.0
        config = ServeConfig(num_replicas=1, num_gpus_per_replica=gpus, num_cpus_per_replica=0, port=port,
                             max_ongoing_requests=self.concurrency, max_logprobs=-1, registry="memory",
                             max_body_bytes=64 << 20)
        serve.run(build_app(self.engine_config, config), name=APP, route_prefix="/")
        self.url = f"http://127.0.0.1:{port}"
        return self

    def __exit__(self, *exc) -> None:
        import ray
        from ray import serve

        serve.shutdown()
        ray.shutdown()


def plain_prompt(prompt, ex: QAExample, order: list[int]) -> str:
    """The user message a RAG app would paste: the engine's RAG prompt's text with the passages
    in ``order`` (``prompt``: the harness's ``PromptConfig``)."""
    docs = "".join(passage_text(*ex.passages[i]).strip() + prompt.document_separator for i in order)
    return prompt.instruction + docs + prompt.question_prefix + ex.question.strip()


def first_token_distribution(response: dict, vocab_size: int) -> np.ndarray:
    """The first generated token's log-probabilities over the vocabulary, from OpenAI's logprobs
    with every token (``token_id:<id>``)."""
    out = np.full(vocab_size, -np.inf, dtype=np.float32)
    for entry in response["choices"][0]["logprobs"]["content"][0]["top_logprobs"]:
        out[int(entry["token"].removeprefix("token_id:"))] = entry["logprob"]
    return out


def ask(http, body: dict) -> dict:
    response = http.post("/v1/chat/completions", json={"temperature": 0, **body})
    if response.status_code != 200:
        raise RuntimeError(f"HTTP {response.status_code}: {response.text[:300]}")
    return response.json()


def answer_over_http(http, mode: str, dataset: str, ex: QAExample, prompt, max_answer_tokens: int, seed: int,
                     vocab_size: int) -> tuple[str, np.ndarray, int, int]:
    """One question in an HTTP mode: ``(answer, first-token log-probabilities, passages placed,
    passages placed as learned chunks)``."""
    source_order = list(range(len(ex.passages)))
    if mode == "http-by-id":
        namespace, ids = f"by-id.{dataset}", [f"{ex.id}/{i}" for i in source_order]
        http.post("/v1/documents", json={"documents": [{"id": d, "text": passage_text(*p)} for d, p in
                                                       zip(ids, ex.passages)], "namespace": namespace})
        body = {"messages": [{"role": "user", "content": ex.question}], "documents": ids, "namespace": namespace}
    else:
        namespace = f"learned.{dataset}"
        for k in (1, 2):  # seen twice before, in other orders (not an exact prefix of the measured prompt)
            order = list(source_order)
            random.Random(f"{seed}:{ex.id}:{k}").shuffle(order)
            if order == source_order:
                order = order[1:] + order[:1]
            ask(http, {"messages": [{"role": "user", "content": plain_prompt(prompt, ex, order)}], "max_tokens": 1,
                       "namespace": namespace})
        body = {"messages": [{"role": "user", "content": plain_prompt(prompt, ex, source_order)}],
                "namespace": namespace}
    first = ask(http, {**body, "max_tokens": 1, "logprobs": True, "top_logprobs": -1,
                       "return_tokens_as_token_ids": True})
    answer = ask(http, {**body, "max_tokens": max_answer_tokens})
    stats = first["lazyattn"]["stats"]
    placed = stats["docs_hit"] + stats["docs_missed"]
    learned = sum(stats["doc_sources"].get(d) == "learned" for d in placed)
    return (answer["choices"][0]["message"]["content"], first_token_distribution(first, vocab_size), len(placed),
            learned)


def run_http_mode(server: QualityServer, mode: str, dataset: str, examples: list[QAExample], prompt, args,
                  vocab_size: int) -> tuple[dict[str, str], dict[str, np.ndarray], dict]:
    """Every question of ``dataset`` in ``mode``: answers, first-token log-probabilities, and how
    the passages were placed."""
    import httpx

    out, first, counts = {}, {}, {"placed": 0, "learned": 0}

    def one(ex):
        with httpx.Client(base_url=server.url, timeout=600) as http:
            return ex.id, answer_over_http(http, mode, dataset, ex, prompt, args.max_answer_tokens, args.seed,
                                           vocab_size)

    with ThreadPoolExecutor(max_workers=args.concurrency) as pool, \
            tqdm(total=len(examples), desc=f"{dataset:>24} {mode}", leave=True) as bar:
        for qid, (text, logprobs, placed, learned) in pool.map(one, examples):
            out[qid], first[qid] = text, logprobs
            counts["placed"] += placed
            counts["learned"] += learned
            bar.update()
    return out, first, counts


def server_engine_config(engine_config, budget_bytes: int):
    """The harness's engine settings for the server (its anchor ``bos``: the by-id path's default),
    with a KV budget of its own."""
    return replace(engine_config, cache=replace(engine_config.cache, kv_cache_bytes=budget_bytes,
                                                kv_cache_fraction=None))

