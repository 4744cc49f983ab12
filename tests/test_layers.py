"""Imports point down only: import-linter's contracts (pyproject.toml) over the installed layout."""

import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parent.parent


def test_import_contracts_hold():
    result = subprocess.run([sys.executable, str(ROOT / ".ci" / "import_tree.py"), "--lint"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


@pytest.mark.parametrize("module, bad_import, contract", [
    ("kernels/rope.py", "from lazyattn_rag.engine.scheduling import scheduler", "Layers point down"),
    ("engine/scheduling/scheduler.py", "from lazyattn_rag.engine.worker import runner", "Scheduling (engine.scheduling)"),
    ("engine/worker/cuda_graphs.py", "from lazyattn_rag.engine.worker.attention import triton_backend",
     "Generic model code"),
    ("engine/kv/chunk_cache.py", "from lazyattn_rag.engine.scheduling import request", "The KV cache (engine.kv)"),
    ("engine/tiers/chunk_store.py", "from lazyattn_rag.engine.worker import runner", "The storage tiers"),
    ("engine/planning/planner.py", "from lazyattn_rag.engine.scheduling import request", "Planning (engine.planning)"),
    ("integrations/langchain.py", "from lazyattn_rag.engine import engine", "The framework adapters use"),
    ("serve/payload.py", "from lazyattn_rag.integrations import requests",
     "The server never imports"),
])
def test_a_forbidden_import_breaks_its_contract(tmp_path, module, bad_import, contract):
    """The check can fail: each contract reports an import that breaks it."""
    sys.path.insert(0, str(ROOT / ".ci"))
    try:
        import import_tree
    finally:
        sys.path.remove(str(ROOT / ".ci"))
    tree = import_tree.build(tmp_path / "tree")
    path = tree / "lazyattn_rag" / module
    text = path.read_text()
    path.unlink()  # a copy, not the link: the repository's file stays as it is
    path.write_text(text + f"\n{bad_import}  # noqa\n")
    result = import_tree.lint(tree, capture=True)
    report = " ".join(result.stdout.split())  # import-linter wraps long contract names
    assert result.returncode == 1, report[-3000:]
    assert contract in report.split("Broken contracts")[1], report[-3000:]  # (with indirect imports forbidden,
    # one import can break more than one contract)


def imports_of_test_modules(paths=None) -> list[str]:
    """``"file: module"`` for each import of a ``test_*`` module by a test module (``paths``:
    default every tests/test_*.py). Shared test code lives in helper modules (tests/tiny.py,
    tests/oracle.py...), never in a ``test_*`` module another one imports (a helper moved with
    its tests would break the importer)."""
    import ast

    offenders = []
    for path in paths or sorted((ROOT / "tests").glob("test_*.py")):
        for node in ast.walk(ast.parse(path.read_text())):
            if isinstance(node, ast.ImportFrom):  # from tests.test_x import y / from tests import test_x
                names = [node.module or ""] + [f"{node.module}.{a.name}" for a in node.names]
            else:
                names = [a.name for a in node.names] if isinstance(node, ast.Import) else []
            offenders += [f"{path.name}: {n}" for n in names if n.split(".")[-1].startswith("test_")]
    return offenders


def test_no_test_module_imports_another(tmp_path):
    assert imports_of_test_modules() == []
    bad = tmp_path / "test_bad.py"
    bad.write_text("from tests.test_model_vs_hf import MODEL_CASES\nimport tests.test_layers\nfrom tests import test_cli\n")
    assert imports_of_test_modules([bad]) == ["test_bad.py: tests.test_model_vs_hf", "test_bad.py: tests.test_layers",
                                              "test_bad.py: tests.test_cli"]
