"""A throwaway ``redis-server`` for tests: a free loopback port, no persistence, a private directory.

``tests/conftest.py``'s ``redis_server`` fixture starts one per test and stops it at teardown; a
test may :meth:`RedisServer.stop` it (an outage) and :meth:`RedisServer.start` it again on the
same port (a restart, empty: nothing is saved).
"""

from __future__ import annotations

import shutil
import socket
import subprocess
import time
from pathlib import Path

START_TIMEOUT_S = 10.0  # the longest a start may take to answer PING


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nobody listens on now (the OS's pick)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def redis_server_path() -> str | None:
    """Where ``redis-server`` is on PATH, or ``None``."""
    return shutil.which("redis-server")


def ping(port: int, timeout_s: float = 0.2) -> bool:
    """Whether a server on ``port`` answers ``PING`` with ``+PONG`` (raw RESP, no client library)."""
    try:
        with socket.create_connection(("127.0.0.1", port), timeout=timeout_s) as s:
            s.sendall(b"PING\r\n")
            return s.recv(16).startswith(b"+PONG")
    except OSError:
        return False


class RedisServer:
    """One ``redis-server`` process on ``127.0.0.1:port`` (``--save "" --appendonly no``), its log in
    ``directory/redis.log``."""

    def __init__(self, directory: Path, port: int | None = None, executable: str = "redis-server"):
        self.directory = Path(directory)
        self.directory.mkdir(parents=True, exist_ok=True)
        self.port = port or free_port()
        self.executable = executable
        self.log_path = self.directory / "redis.log"
        self._process: subprocess.Popen | None = None

    @property
    def url(self) -> str:
        return f"redis://127.0.0.1:{self.port}/0"

    def start(self) -> None:
        """Start the server (again, on the same port) and wait until it answers PING.

        Raises:
            RuntimeError: it exited or did not answer within ``START_TIMEOUT_S`` (the log's tail
                says why).
        """
        if self._process is not None:
            raise RuntimeError("redis-server is already running")
        with open(self.log_path, "ab") as log:
            self._process = subprocess.Popen(
                [self.executable, "--port", str(self.port), "--bind", "127.0.0.1", "--save", "",
                 "--appendonly", "no", "--dir", str(self.directory)],
                stdout=log, stderr=subprocess.STDOUT, stdin=subprocess.DEVNULL)
        deadline = time.monotonic() + START_TIMEOUT_S
        while not ping(self.port):
            if self._process.poll() is not None or time.monotonic() > deadline:
                self.stop()
                tail = self.log_path.read_text(errors="replace")[-2000:]
                raise RuntimeError(f"redis-server on port {self.port} did not start:\n{tail}")
            time.sleep(0.01)

    def stop(self) -> None:
        """Stop the server (SIGTERM, then SIGKILL after 5 s) and wait for it; idempotent."""
        process, self._process = self._process, None
        if process is None or process.poll() is not None:
            return
        process.terminate()
        try:
            process.wait(5)
        except subprocess.TimeoutExpired:
            process.kill()
            process.wait(5)


class SharedServe:
    """A private local Ray cluster (2 CPUs, every process on loopback: ``start_ray``) with Serve's
    HTTP proxy on a free ``127.0.0.1`` port, shared by the test modules that use it: :meth:`start`
    starts it once (later calls return the running one), :meth:`stop` shuts Serve and Ray down
    (idempotent). ``tests/conftest.py`` stops it after the last test that uses it, so it does not
    idle beside the rest of the suite. Each module deploys its own application and deletes it
    when done."""

    def __init__(self):
        self._running: tuple[str, int] | None = None

    def start(self) -> tuple[str, int]:
        """``(base_url, port)`` of the running cluster's proxy, starting it first if needed."""
        if self._running is None:
            import ray
            from ray import serve

            from lazyattn_rag.serve.app import start_ray

            port = free_port()
            start_ray(num_cpus=2, logging_level="ERROR", log_to_driver=False)
            try:
                serve.start(http_options={"host": "127.0.0.1", "port": port})
            except BaseException:
                ray.shutdown()
                raise
            self._running = (f"http://127.0.0.1:{port}", port)
        return self._running

    def stop(self) -> None:
        if self._running is None:
            return
        import ray
        from ray import serve

        self._running = None
        try:
            serve.shutdown()
        finally:
            ray.shutdown()


SHARED_SERVE = SharedServe()
