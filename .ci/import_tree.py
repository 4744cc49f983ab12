"""The installed package's layout as a tree of links, for import-graph tools; ``--lint`` checks the layers.

pyproject.toml maps the folders kernels/, engine/ and integrations/ to ``lazyattn_rag.kernels``,
``lazyattn_rag.engine`` and ``lazyattn_rag.integrations`` (setuptools package-dir). An editable
install resolves those names with an import hook, so tools that walk a package's folder (grimp,
import-linter, pydeps) see only lazyattn_rag/. This script lays out the same names as folders of
symbolic links, as a wheel would install them:

    python .ci/import_tree.py build/import-tree          # then e.g.
    PYTHONPATH=build/import-tree pydeps lazyattn_rag --max-bacon 2
    python .ci/import_tree.py --lint                     # import-linter's contracts in pyproject.toml

``--lint`` exits with lint-imports' status: non-zero when an import breaks a contract (a lower
layer importing a higher one, see docs/architecture.md).
"""

from __future__ import annotations

import argparse
import os
import subprocess
import sys
import tempfile
import tomllib
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def package_dirs(pyproject: Path = ROOT / "pyproject.toml") -> dict[str, Path]:
    """``{import name: source folder}`` for every package pyproject.toml declares."""
    setuptools = tomllib.loads(pyproject.read_text())["tool"]["setuptools"]
    mapping = setuptools.get("package-dir", {})
    return {name: ROOT / mapping.get(name, name.replace(".", "/")) for name in setuptools["packages"]}


def build(tree: Path) -> Path:
    """Link every package's ``.py`` files under ``tree`` at their import path; returns ``tree``."""
    for name, folder in package_dirs().items():
        target = tree.joinpath(*name.split("."))
        target.mkdir(parents=True, exist_ok=True)
        for source in folder.glob("*.py"):
            link = target / source.name
            if not link.exists():
                link.symlink_to(source)
    return tree


def lint(tree: Path, capture: bool = False) -> int | subprocess.CompletedProcess:
    """Run import-linter over ``tree`` with pyproject.toml's contracts; returns its exit status
    (``capture``: the finished process, its report in ``stdout``)."""
    env = dict(os.environ, PYTHONPATH=str(tree))
    command = [sys.executable, "-c", "import sys; from importlinter.cli import lint_imports_command; "
               "sys.exit(lint_imports_command())", str(ROOT / "pyproject.toml"), "--no-cache"]
    result = subprocess.run(command, env=env, cwd=tree, capture_output=capture, text=capture)
    return result if capture else result.returncode


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("tree", nargs="?", type=Path, help="where to lay out the links (default: a temporary folder)")
    parser.add_argument("--lint", action="store_true", help="check pyproject.toml's import-linter contracts")
    args = parser.parse_args()
    if args.tree is None:
        with tempfile.TemporaryDirectory() as tmp:
            return lint(build(Path(tmp))) if args.lint else 0
    build(args.tree)
    print(f"PYTHONPATH={args.tree}")
    return lint(args.tree) if args.lint else 0


if __name__ == "__main__":
    sys.exit(main())
