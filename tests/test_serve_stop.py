"""`lazyattn serve` as a process: SIGTERM (what systemd, Docker and Kubernetes send) stops it as
Ctrl-C does, with exit status 0, without Ray's stack dump, and with every process it started gone."""

import os
import signal
import socket
import subprocess
import sys
import time

import pytest

pytest.importorskip("ray.serve")
psutil = pytest.importorskip("psutil")

from tests.tiny import save_model_dir  # noqa: E402


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def test_sigterm_stops_the_server_and_everything_it_started(tmp_path):
    model = save_model_dir(tmp_path / "model", eos=2)
    command = [sys.executable, "-m", "lazyattn_rag.cli", "serve", "--model", str(model), "--device", "cpu",
               "--port", str(_free_port()), "--cache-dir", str(tmp_path / "cache"), "--no-disk-cache"]
    env = dict(os.environ, PYTHONUNBUFFERED="1")
    log = tmp_path / "stderr.txt"
    with log.open("w") as err:
        server = subprocess.Popen(command, stdout=subprocess.DEVNULL, stderr=err, env=env)
        try:
            deadline = time.monotonic() + 240
            while "ready: http://" not in log.read_text():
                assert server.poll() is None and time.monotonic() < deadline, log.read_text()[-3000:]
                time.sleep(0.5)
            started = psutil.Process(server.pid).children(recursive=True)
            assert started  # Ray's processes
            server.send_signal(signal.SIGTERM)
            assert server.wait(timeout=120) == 0, log.read_text()[-3000:]
        finally:
            if server.poll() is None:
                server.kill()
    text = log.read_text()
    assert text.rstrip().endswith("stopped"), text[-3000:]
    assert "SIGTERM received" not in text
    _, alive = psutil.wait_procs(started, timeout=30)
    assert not alive, [p.info for p in alive] if hasattr(alive[0], "info") else alive
