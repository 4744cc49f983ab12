"""A script that uses the engine and simply ends exits cleanly (no shutdown() call needed).

The engine thread once outlived the interpreter's teardown and the process aborted after all
its output ("terminate called without an active exception", exit code 134) in about half the
runs; ``engine/loop.py`` now stops every engine thread at exit.
"""

import subprocess
import sys
from pathlib import Path

SCRIPT = """
import sys
sys.path.insert(0, {root!r})
from lazyattn_rag import SamplingParams
from tests.tiny import tiny_llm, words
llm = tiny_llm(num_blocks=64)  # never shut down
llm.add_document("a", words(20))
print(len(llm.generate("w1", ["a"], sampling=SamplingParams(max_tokens=4, ignore_eos=True)).token_ids))
"""


def test_a_script_that_never_calls_shutdown_exits_cleanly(tmp_path):
    script = tmp_path / "uses_engine.py"
    script.write_text(SCRIPT.format(root=str(Path(__file__).resolve().parents[1])))
    for _ in range(3):  # the abort was intermittent
        done = subprocess.run([sys.executable, str(script)], capture_output=True, text=True, timeout=300)
        assert done.returncode == 0, done.stderr[-2000:]
        assert done.stdout.strip().splitlines()[-1] == "4"
