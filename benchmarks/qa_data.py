"""QA evaluation sets in the shared JSONL format (``../shared/data/qa/README.md``).

One line per question: ``{"id", "question", "answers": [gold, aliases...], "passages":
[{"title", "text", "is_supporting"}], ...}``. Passages keep the source's order.
"""

from __future__ import annotations

import json
import random
from dataclasses import dataclass
from pathlib import Path

# dataset name -> file under <data dir>/qa/
DATASET_FILES = {
    "hotpotqa": "hotpotqa.jsonl",
    "2wikimultihopqa": "2wikimultihopqa.jsonl",
    "2wikimultihopqa_goldonly": "2wikimultihopqa_goldonly.jsonl",
    "musique": "musique.jsonl",
    "nq_open_oracle": "nq_open_oracle.jsonl",
}


@dataclass(frozen=True)
class QAExample:
    """One question with its context passages.

    Attributes:
        id: the dataset's question id.
        question: the question text.
        answers: accepted answers (first is the primary gold answer, the rest aliases).
        passages: ``(title, text)`` pairs in the source's order.
    """

    id: str
    question: str
    answers: tuple[str, ...]
    passages: tuple[tuple[str, str], ...]


def default_data_dir() -> Path | None:
    """The shared data folder: ``<repo>/../shared/data``, else ``<repo>/shared/data``, else ``None``."""
    repo = Path(__file__).resolve().parents[1]
    return next((p for p in (repo.parent / "shared" / "data", repo / "shared" / "data") if p.is_dir()), None)


def passage_text(title: str, text: str) -> str:
    """The text a passage is encoded as: ``"Title: <title>\\n<text>"``.

    No running number ("Document [3]"): the text must not depend on where the passage sits
    in a prompt, or its cached K/V could not be reused at another offset.
    """
    return f"Title: {title}\n{text}" if title else text


def load_qa(data_dir: Path | str, dataset: str, sample_size: int | None = None, seed: int = 0) -> list[QAExample]:
    """Read a dataset and draw a fixed random sample of its questions.

    Args:
        data_dir: the folder holding ``qa/`` (e.g. ``../shared/data``).
        dataset: a key of :data:`DATASET_FILES`.
        sample_size: questions to draw without replacement; ``None``, 0 or more than the file
            holds means all of them.
        seed: seed of the sample (the same seed gives the same questions).
    Returns:
        the sampled questions, in file order. Questions without passages are skipped.
    Raises:
        ValueError: unknown dataset name, or a question id that occurs twice.
        FileNotFoundError: the dataset file is missing.
    """
    if dataset not in DATASET_FILES:
        raise ValueError(f"unknown dataset {dataset!r}; choose from {', '.join(DATASET_FILES)}")
    path = Path(data_dir) / "qa" / DATASET_FILES[dataset]
    examples = []
    with open(path, encoding="utf-8") as f:
        for line in f:
            if not line.strip():
                continue
            row = json.loads(line)
            passages = tuple((p.get("title", ""), p["text"]) for p in row["passages"] if p["text"].strip())
            if not passages:
                continue
            examples.append(QAExample(str(row["id"]), row["question"], tuple(row["answers"]), passages))
    if len({e.id for e in examples}) != len(examples):
        raise ValueError(f"{path} has repeated question ids")
    if sample_size and sample_size < len(examples):
        keep = sorted(random.Random(seed).sample(range(len(examples)), sample_size))
        examples = [examples[i] for i in keep]
    return examples
