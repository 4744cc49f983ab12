"""Imports point down only: import-linter's contracts (pyproject.toml) over the installed layout."""

import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def test_import_contracts_hold():
    result = subprocess.run([sys.executable, str(ROOT / ".ci" / "import_tree.py"), "--lint"],
                            capture_output=True, text=True, timeout=300)
    assert result.returncode == 0, result.stdout[-6000:] + result.stderr[-2000:]
    assert "0 broken" in result.stdout


def test_an_upward_import_breaks_a_contract(tmp_path):
    """The check can fail: a kernel module importing the engine is reported by name."""
    sys.path.insert(0, str(ROOT / ".ci"))
    try:
        import import_tree
    finally:
        sys.path.remove(str(ROOT / ".ci"))
    tree = import_tree.build(tmp_path / "tree")
    rope = tree / "lazyattn_rag" / "kernels" / "rope.py"
    text = rope.read_text()
    rope.unlink()  # a copy, not the link: the repository's file stays as it is
    rope.write_text(text + "\nfrom lazyattn_rag.engine import scheduler  # noqa\n")
    assert import_tree.lint(tree) == 1
