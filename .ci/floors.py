"""Print pip constraints that pin dependencies to the floors pyproject.toml declares.

    python3 .ci/floors.py > build/floors.txt      # then: pip install -c build/floors.txt -e ".[floor-tests]"

``make test-lowest`` installs the project with them and runs the model, tokenizer and integration
tests, so a floor in pyproject.toml is a version that was tested. Pinned: the framework packages,
and transformers with the packages it loads our models and tokenizers through (tokenizers; gguf,
accelerate and safetensors for the default model's conversion; sentence-transformers and faiss-cpu
for the vector stores; redis (redis-py) for the Redis storage tier, whose tests run against a real
redis-server; xgrammar for structured output, installed there with --no-deps since its wheel
requires triton, which its CPU path never imports). Each floor is the lowest that installs next to the other floors: transformers
5.0.0 requires tokenizers >= 0.22 and huggingface-hub >= 1.3, and tokenizers 0.22.0 requires
huggingface-hub < 1.0, so tokenizers' floor is 0.22.1.

Not installed there: the ``serve`` extra (ray[serve] and httpx: their floors are the versions that
``tests/test_serve.py`` runs with in ``make test``; the floor run leaves that module out) and triton
(its interpreter runs the kernel tests, which the floor run leaves out too). Not pinned: openai
(a test client), torch (this machine's CPU wheel, ``TORCH_SPEC``), numpy (1.26 cannot install with the
test extra: langchain-tests needs >= 1.26.2) and the small utilities
(tqdm, typer, platformdirs, prometheus-client, matplotlib, hypothesis, psutil, and pytest with its plugins
other than pytest-asyncio).
"""

import re
import sys
import tomllib
from pathlib import Path

PINNED = ("llama-index-core", "llama-index-embeddings-huggingface", "llama-index-retrievers-bm25", "langchain-core",
          "langchain-huggingface",
          "langchain-tests", "pytest-asyncio",
          "transformers", "tokenizers", "safetensors", "gguf", "accelerate", "sentence-transformers", "faiss-cpu",
          "redis", "xgrammar")


def floors(pyproject: Path) -> dict[str, str]:
    project = tomllib.loads(pyproject.read_text())["project"]
    requirements = list(project["dependencies"])
    for extra in project["optional-dependencies"].values():
        requirements += extra
    out = {}
    for req in requirements:
        m = re.fullmatch(r"([A-Za-z0-9_.-]+)\s*>=\s*([0-9][0-9A-Za-z.]*)", req.strip())
        if m and m.group(1).lower() in PINNED:
            out[m.group(1).lower()] = m.group(2)
    missing = sorted(set(PINNED) - set(out))
    if missing:
        sys.exit(f"pyproject.toml declares no '>=' floor for {missing}")
    return out


if __name__ == "__main__":
    for name, version in sorted(floors(Path(__file__).resolve().parents[1] / "pyproject.toml").items()):
        print(f"{name}=={version}")
