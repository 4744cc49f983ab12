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


@pytest.mark.parametrize("module, bad_import", [
    ("kernels/rope.py", "from lazyattn_rag.engine import scheduler"),  # a kernel importing the engine
    ("engine/scheduler.py", "from lazyattn_rag.engine import runner"),  # the scheduler touching the model
    ("engine/cuda_graphs.py", "from lazyattn_rag.engine.attention import triton_backend"),  # a generic part naming a backend
])
def test_a_forbidden_import_breaks_a_contract(tmp_path, module, bad_import):
    """The check can fail: each kind of forbidden import is reported."""
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
    assert import_tree.lint(tree) == 1
