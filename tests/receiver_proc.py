"""Run the reference receiver as a real subprocess for tests: ``with start_receiver(url) as receiver: ...``.

Fault flags can be given as CLI arguments or as keywords::

    start_receiver(db_url, "--fail-first", "2")
    start_receiver(db_url, fail_first=2, always_status_for_topic={"mail": 400})
"""

from __future__ import annotations

import os
import queue
import signal
import subprocess
import sys
import tempfile
import threading
from collections.abc import Mapping
from types import TracebackType
from typing import IO, Any

READY_PREFIX = "listening on "
READY_TIMEOUT_S = 20.0


def _fault_args(faults: Mapping[str, Any]) -> list[str]:
    args: list[str] = []
    for name, value in faults.items():
        flag = "--" + name.replace("_", "-")
        if isinstance(value, Mapping):
            for topic, status in value.items():
                args += [flag, f"{topic}={status}"]
        elif isinstance(value, list | tuple):
            for item in value:
                args += [flag, str(item)]
        elif isinstance(value, bool):
            args.append(flag if value else "--no-" + name.replace("_", "-"))
        else:
            args += [flag, str(value)]
    return args


class ReceiverProcess:
    """A receiver subprocess on a free port. ``url`` is its base URL (no trailing slash)."""

    def __init__(
        self, database_url: str, *extra_args: str, env: Mapping[str, str] | None = None, **faults: Any
    ) -> None:
        self.database_url = database_url
        self.args = [
            sys.executable,
            "-m",
            "dagster_joblease.receiver",
            "--database-url",
            database_url,
            "--port",
            "0",
            *extra_args,
            *_fault_args(faults),
        ]
        # stderr goes to a file, not a pipe nobody reads (a full pipe would block the receiver).
        self._stderr: IO[bytes] = tempfile.TemporaryFile()
        self.popen = subprocess.Popen(
            self.args,
            stdout=subprocess.PIPE,
            stderr=self._stderr,
            env={**os.environ, **env} if env is not None else None,
            text=True,
        )
        self.pid = self.popen.pid
        try:
            self.url = self._wait_ready()
        except BaseException:
            self.stop()
            raise

    def _wait_ready(self) -> str:
        lines: queue.Queue[str] = queue.Queue()
        stdout = self.popen.stdout
        assert stdout is not None

        def read() -> None:
            lines.put(stdout.readline())

        threading.Thread(target=read, daemon=True).start()
        try:
            line = lines.get(timeout=READY_TIMEOUT_S)
        except queue.Empty:
            line = ""
        if not line.startswith(READY_PREFIX):
            self.stop()
            raise AssertionError(
                f"receiver did not start (exit code {self.popen.returncode}, first stdout line {line!r});"
                f" stderr:\n{self.stderr()}"
            )
        return line[len(READY_PREFIX) :].strip().rstrip("/")

    def stderr(self) -> str:
        """Everything the receiver wrote to stderr so far."""
        self._stderr.seek(0)
        return self._stderr.read().decode("utf-8", "replace")

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, timeout: float = 10.0) -> int:
        """SIGTERM, wait, SIGKILL if it does not stop; returns the exit code."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            try:
                self.popen.wait(timeout)
            except subprocess.TimeoutExpired:
                self.popen.kill()
                self.popen.wait(timeout)
        if self.popen.stdout is not None:
            self.popen.stdout.close()
        return int(self.popen.returncode)

    def kill(self) -> None:
        """SIGKILL: a crash, with no chance to clean up."""
        if self.popen.poll() is None:
            self.popen.kill()
            self.popen.wait(10)

    def __enter__(self) -> ReceiverProcess:
        return self

    def __exit__(
        self, exc_type: type[BaseException] | None, exc: BaseException | None, tb: TracebackType | None
    ) -> None:
        self.stop()
        self._stderr.close()


def start_receiver(
    database_url: str, *extra_args: str, env: Mapping[str, str] | None = None, **faults: Any
) -> ReceiverProcess:
    """Start a receiver and wait until it listens (up to 20 s); use as a context manager or call ``stop()``.

    ``faults`` map to CLI flags: ``fail_first=2`` → ``--fail-first 2``; a mapping for
    ``always_status_for_topic`` → one ``--always-status-for-topic TOPIC=STATUS`` per item.
    """
    return ReceiverProcess(database_url, *extra_args, env=env, **faults)
