"""Print pip constraints that pin the framework dependencies to the floors pyproject.toml declares.

    python3 .ci/floors.py > build/floors.txt      # then: pip install -c build/floors.txt -e ".[dev]"

``make test-lowest`` installs the project with them and runs the integration tests, so a floor
in pyproject.toml is a version that was tested. Only the pure-Python framework packages are
pinned (torch, transformers and the rest come from the machine's usual resolution).
"""

import re
import sys
import tomllib
from pathlib import Path

PINNED = ("llama-index-core", "llama-index-embeddings-huggingface", "langchain-core", "langchain-huggingface",
          "langchain-tests", "pytest-asyncio")


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
