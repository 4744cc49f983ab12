"""Progress lines of the one-time steps (lazyattn_rag/utils/progress.py)."""

import io
import re

import pytest

from lazyattn_rag.utils.progress import directory_bytes, format_bytes, stage


class _Terminal(io.StringIO):
    def isatty(self):
        return True


def test_stage_reports_the_step_and_its_time_on_a_log_file():
    out = io.StringIO()
    with stage("reading", file=out):
        pass
    assert re.fullmatch(r"reading \.\.\. done in \d+\.\d s\n", out.getvalue())
    out = io.StringIO()
    with pytest.raises(RuntimeError), stage("writing", file=out):
        raise RuntimeError("disk full")
    assert re.fullmatch(r"writing \.\.\. failed after \d+\.\d s\n", out.getvalue())


def test_stage_ticks_on_a_terminal_and_leaves_bars_alone():
    import time

    out = _Terminal()
    with stage("embedding", file=out, tick_s=0.01):
        time.sleep(0.1)
    text = out.getvalue()
    assert text.count("\rembedding ... ") >= 3  # ticks, then the final line over them
    assert re.search(r"\rembedding \.\.\. done in \d+\.\d s\n$", text)
    out = _Terminal()
    with stage("dequantizing", file=out, tick_s=0.01, has_own_bar=True):
        time.sleep(0.05)
    assert re.fullmatch(r"dequantizing \.\.\.\ndequantizing: done in \d+\.\d s\n", out.getvalue())


def test_sizes(tmp_path):
    (tmp_path / "a").write_bytes(b"x" * 1500)
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "b").write_bytes(b"y" * 500)
    assert directory_bytes(tmp_path) == 2000
    assert directory_bytes(tmp_path / "missing") == 0
    assert [format_bytes(n) for n in (999, 2000, 517_000_000, 12_300_000_000)] == ["999 B", "2.0 kB", "517 MB",
                                                                                    "12 GB"]
