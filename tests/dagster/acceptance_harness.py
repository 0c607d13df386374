"""Processes and helpers for the daemon acceptance test: Dagster deployments as real processes.

A :class:`Deployment` is one ``DAGSTER_HOME`` (dagster-postgres storage on its own fresh database,
QueuedRunCoordinator, run retries on) with a ``workspace.yaml`` that loads
``tests/dagster/acceptance_location.py``, a real ``dagster-daemon run`` process and, optionally, a real
``dagster-webserver``. Every process is started here in its own session and stopped here by its id
(SIGTERM, then SIGKILL of its own process group, which holds only its code servers and run workers).
"""

from __future__ import annotations

import base64
import contextlib
import dataclasses
import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import tempfile
import time
import uuid
from collections.abc import Callable, Iterator, Mapping, Sequence
from pathlib import Path
from typing import IO, Any

import dagster as dg
import httpx
import sqlalchemy as sa
from sqlalchemy.engine import make_url

from tests.conftest import _admin_execute, admin_url

REPO = Path(__file__).resolve().parents[2]
BIN = Path(sys.executable).parent
LOCATION_MODULE = "tests.dagster.acceptance_location"
RUN_ID = re.compile(r"[0-9a-f]{8}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{4}-[0-9a-f]{12}")
PID_IN_PROCESS = re.compile(r"\(pid: (\d+)\)")


def free_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        return int(sock.getsockname()[1])


def psycopg2_url(url: str) -> str:
    """Dagster's storage URL: dagster-postgres breaks on psycopg 3, so it must say ``+psycopg2``."""
    return make_url(url).set(drivername="postgresql+psycopg2").render_as_string(hide_password=False)


@contextlib.contextmanager
def fresh_database(prefix: str) -> Iterator[str]:
    """An empty PostgreSQL database (psycopg 3 URL), dropped afterwards."""
    name = f"{prefix}_{uuid.uuid4().hex[:10]}"
    _admin_execute(f'CREATE DATABASE "{name}"')
    try:
        yield admin_url().set(database=name).render_as_string(hide_password=False)
    finally:
        _admin_execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


def wait_for(what: str, predicate: Callable[[], Any], timeout: float, interval: float = 0.5) -> Any:
    """Poll until ``predicate()`` is truthy and return it; fail naming ``what`` after ``timeout`` s."""
    deadline = time.monotonic() + timeout
    while True:
        value = predicate()
        if value:
            return value
        if time.monotonic() > deadline:
            raise AssertionError(f"timed out after {timeout:.0f} s waiting for {what}")
        time.sleep(interval)


class Proc:
    """A process this test started, in its own session; output goes to ``log``."""

    def __init__(self, name: str, args: Sequence[str], env: Mapping[str, str], log: Path) -> None:
        self.name = name
        self.log = log
        self._out: IO[bytes] = log.open("ab")
        self.popen = subprocess.Popen(
            list(args),
            cwd=REPO,
            env=dict(env),
            stdin=subprocess.DEVNULL,
            stdout=self._out,
            stderr=subprocess.STDOUT,
            start_new_session=True,
        )
        self.pid = self.popen.pid

    def alive(self) -> bool:
        return self.popen.poll() is None

    def stop(self, timeout: float = 20.0) -> None:
        """SIGTERM (Dagster shuts down like on Ctrl-C), then SIGKILL what is left of its process group."""
        if self.popen.poll() is None:
            self.popen.send_signal(signal.SIGTERM)
            with contextlib.suppress(subprocess.TimeoutExpired):
                self.popen.wait(timeout)
        # The group (pgid == our pid, new session) holds only its code servers and run workers.
        with contextlib.suppress(ProcessLookupError, PermissionError):
            os.killpg(self.pid, signal.SIGKILL)
        if self.popen.poll() is None:
            self.popen.wait(10)
        self._out.close()

    def tail(self, lines: int = 80) -> str:
        text = self.log.read_text(errors="replace") if self.log.exists() else ""
        return "\n".join(text.splitlines()[-lines:])


def descendants(root: int) -> set[int]:
    """Pids below ``root`` in the process tree (from /proc): used to check a kill target is ours."""
    children: dict[int, list[int]] = {}
    for entry in Path("/proc").iterdir():
        if not entry.name.isdigit():
            continue
        try:
            fields = (entry / "stat").read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        children.setdefault(int(fields[1]), []).append(int(entry.name))
    found: set[int] = set()
    stack = [root]
    while stack:
        for child in children.get(stack.pop(), []):
            if child not in found:
                found.add(child)
                stack.append(child)
    return found


@dataclasses.dataclass
class Deployment:
    """One Dagster deployment: its home, instance, daemon and (optionally) webserver."""

    label: str
    location: str
    home: Path
    env: dict[str, str]
    instance: dg.DagsterInstance
    daemon: Proc | None = None
    webserver: Proc | None = None
    webserver_url: str | None = None

    @property
    def workspace(self) -> Path:
        return self.home / "workspace.yaml"

    @classmethod
    def create(
        cls,
        label: str,
        home: Path,
        storage_url: str,
        env: Mapping[str, str],
        *,
        max_concurrent_runs: int = 4,
        max_retries: int = 2,
    ) -> Deployment:
        home.mkdir(parents=True, exist_ok=True)
        location = f"accept_{label}"
        (home / "dagster.yaml").write_text(
            f"""storage:
  postgres:
    postgres_url: {psycopg2_url(storage_url)}
run_coordinator:
  module: dagster._core.run_coordinator
  class: QueuedRunCoordinator
  config:
    max_concurrent_runs: {max_concurrent_runs}
    dequeue_interval_seconds: 1
run_retries:
  enabled: true
  max_retries: {max_retries}
run_monitoring:
  enabled: true
  poll_interval_seconds: 5
telemetry:
  enabled: false
nux:
  enabled: false
"""
        )
        (home / "workspace.yaml").write_text(
            f"""load_from:
  - python_module:
      module_name: {LOCATION_MODULE}
      location_name: {location}
      working_directory: {REPO}
"""
        )
        full_env = {**env, "DAGSTER_HOME": str(home), "ACCEPT_DEPLOYMENT": label}
        # Create Dagster's schema once, here, before any of the deployment's processes races to do it.
        instance = dg.DagsterInstance.from_config(str(home))
        return cls(label=label, location=location, home=home, env=full_env, instance=instance)

    def start_daemon(self) -> Proc:
        self.daemon = Proc(
            f"daemon-{self.label}",
            [str(BIN / "dagster-daemon"), "run", "-w", str(self.workspace)],
            self.env,
            self.home / "daemon.log",
        )
        return self.daemon

    def start_webserver(self) -> Proc:
        port = free_port()
        self.webserver = Proc(
            f"webserver-{self.label}",
            [str(BIN / "dagster-webserver"), "-h", "127.0.0.1", "-p", str(port), "-w", str(self.workspace)],
            self.env,
            self.home / "webserver.log",
        )
        self.webserver_url = f"http://127.0.0.1:{port}"
        return self.webserver

    def webserver_ready(self) -> bool:
        """True once the webserver answers and has loaded the code location."""
        assert self.webserver is not None and self.webserver_url is not None
        if not self.webserver.alive():
            raise AssertionError(f"webserver {self.label} exited:\n{self.webserver.tail()}")
        try:
            data = self.graphql(
                "query { workspaceOrError { ... on Workspace { locationEntries { name "
                "locationOrLoadError { __typename } } } } }"
            )
        except (httpx.HTTPError, AssertionError):
            return False
        entries = data["workspaceOrError"]["locationEntries"]
        return any(
            e["name"] == self.location and e["locationOrLoadError"]["__typename"] == "RepositoryLocation"
            for e in entries
        )

    def daemons_alive(self) -> bool:
        assert self.daemon is not None
        if not self.daemon.alive():
            raise AssertionError(f"dagster-daemon {self.label} exited:\n{self.daemon.tail()}")
        return len(self.instance.get_daemon_heartbeats()) > 0

    def cli(self, *args: str, timeout: float = 180.0) -> subprocess.Popen[str]:
        """Start a ``dagster`` CLI command against this deployment (the caller waits for it)."""
        return subprocess.Popen(
            [str(BIN / "dagster"), *args, "-w", str(self.workspace), "-l", self.location],
            cwd=REPO,
            env=self.env,
            stdin=subprocess.DEVNULL,
            stdout=subprocess.PIPE,
            stderr=subprocess.STDOUT,
            text=True,
        )

    def graphql(self, query: str, variables: Mapping[str, Any] | None = None) -> dict[str, Any]:
        """POST to the webserver's /graphql, as the UI does."""
        assert self.webserver_url is not None
        response = httpx.post(
            f"{self.webserver_url}/graphql",
            json={"query": query, "variables": dict(variables or {})},
            timeout=120,
        )
        response.raise_for_status()
        body = response.json()
        if body.get("errors"):
            raise AssertionError(f"GraphQL errors: {body['errors']}")
        data: dict[str, Any] = body["data"]
        return data

    def runs(self, job_name: str | None = None) -> list[dg.DagsterRun]:
        return list(self.instance.get_runs(dg.RunsFilter(job_name=job_name) if job_name else None))

    def run_pid(self, run_id: str) -> int | None:
        """The pid that executes the run's steps (in-process executor), from the run's engine events."""
        records = self.instance.get_records_for_run(
            run_id, of_type=dg.DagsterEventType.ENGINE_EVENT, limit=200
        ).records
        pids = [
            int(match.group(1))
            for record in records
            if (match := PID_IN_PROCESS.search(record.event_log_entry.user_message or ""))
        ]
        return pids[-1] if pids else None

    def stop(self) -> None:
        for proc in (self.webserver, self.daemon):
            if proc is not None:
                proc.stop()
        self.instance.dispose()


class _DevTools:
    """A minimal Chrome DevTools Protocol client over one page's websocket."""

    def __init__(self, ws: Any) -> None:
        self.ws = ws
        self.next_id = 0

    def __call__(self, method: str, **params: Any) -> dict[str, Any]:
        self.next_id += 1
        self.ws.send(json.dumps({"id": self.next_id, "method": method, "params": params}))
        while True:
            message = json.loads(self.ws.recv(timeout=60))
            if message.get("id") == self.next_id:
                if "error" in message:
                    raise AssertionError(f"DevTools {method}: {message['error']}")
                result: dict[str, Any] = message.get("result", {})
                return result

    def evaluate(self, expression: str) -> Any:
        return self("Runtime.evaluate", expression=expression, returnByValue=True)["result"].get("value")


def screenshot(
    url: str,
    path: Path,
    *,
    shows: Sequence[str],
    local_storage: Mapping[str, Any] | None = None,
    width: int = 1600,
    height: int = 1700,
) -> None:
    """A PNG of ``url`` from real headless Chromium, taken once the page shows every text in ``shows``.

    ``local_storage`` is written on the page's origin first: UI preferences a person sets by clicking
    (e.g. the Dagster runs table's "Hide tag").
    """
    chromium = next((c for c in ("chromium", "chromium-browser", "google-chrome") if shutil.which(c)), None)
    if chromium is None:
        raise AssertionError("no chromium on PATH (apt-get install chromium) for the screenshots")
    from websockets.sync.client import connect

    path.parent.mkdir(parents=True, exist_ok=True)
    port = free_port()
    with tempfile.TemporaryDirectory(ignore_cleanup_errors=True) as profile:  # chromium may still write
        proc = subprocess.Popen(
            [
                chromium,
                "--headless",
                "--no-sandbox",
                "--disable-gpu",
                "--hide-scrollbars",
                f"--user-data-dir={profile}",
                f"--window-size={width},{height}",
                f"--remote-debugging-port={port}",
                "about:blank",
            ],
            stdout=subprocess.DEVNULL,
            stderr=subprocess.DEVNULL,
        )
        try:

            def page_socket() -> str | None:
                try:
                    targets = httpx.get(f"http://127.0.0.1:{port}/json/list", timeout=5).json()
                except (httpx.HTTPError, ValueError):
                    return None
                return next((t["webSocketDebuggerUrl"] for t in targets if t.get("type") == "page"), None)

            with connect(wait_for("chromium's DevTools", page_socket, 60), max_size=None) as ws:
                tools = _DevTools(ws)
                tools(
                    "Emulation.setDeviceMetricsOverride",
                    width=width,
                    height=height,
                    deviceScaleFactor=1,
                    mobile=False,
                )
                origin = "/".join(url.split("/", 3)[:3])
                tools("Page.navigate", url=f"{origin}/runs")
                wait_for(
                    "the UI's origin to load", lambda: tools.evaluate("document.readyState") == "complete", 60
                )
                for key, value in (local_storage or {}).items():
                    tools.evaluate(
                        f"localStorage.setItem({json.dumps(key)}, {json.dumps(json.dumps(value))})"
                    )
                tools("Page.navigate", url=url)
                probe = " && ".join(f"document.body.innerText.includes({json.dumps(t)})" for t in shows)
                wait_for(f"{url} to show {list(shows)}", lambda: tools.evaluate(probe), 90)
                last: list[str] = [""]

                def settled() -> bool:
                    # The table's rows and links, not its text: clocks and countdowns on the page tick.
                    text = str(
                        tools.evaluate(
                            "Array.from(document.querySelectorAll('table tr, table a'))"
                            ".map(e => e.tagName + (e.tagName === 'A' ? e.textContent : '')).join('|')"
                        )
                    )
                    same, last[0] = text == last[0], text
                    return same

                wait_for("the page to stop changing", settled, 30, 1.0)

                def painted() -> bool:
                    # Icons arrive after the rows: wait (best effort) until the table's pixels hold still.
                    box = tools.evaluate(
                        "(() => { const r = (document.querySelector('table') || document.body)"
                        ".getBoundingClientRect(); return [r.x, r.y, r.width, r.height]; })()"
                    )
                    clip = dict(zip(("x", "y", "width", "height"), box, strict=True)) | {"scale": 1}
                    pixels = str(tools("Page.captureScreenshot", format="png", clip=clip)["data"])
                    same, last[0] = pixels == last[0], pixels
                    return same

                with contextlib.suppress(AssertionError):
                    wait_for("the table's icons to paint", painted, 10, 1.0)
                png = tools("Page.captureScreenshot", format="png")["data"]
            path.write_bytes(base64.b64decode(png))
        finally:
            proc.terminate()
            with contextlib.suppress(subprocess.TimeoutExpired):
                proc.wait(10)
            if proc.poll() is None:
                proc.kill()
                proc.wait(10)


def run_line(run: dg.DagsterRun) -> str:
    tags = {k: v for k, v in sorted(run.tags.items()) if k.startswith(("joblease/", "dagster/"))}
    return f"  {run.run_id[:8]} {run.job_name:<20} {run.status.value:<9} {json.dumps(tags)}"


def table_dump(engine: sa.Engine, table: sa.Table, columns: Sequence[str]) -> str:
    with engine.connect() as conn:
        rows = conn.execute(sa.select(*(table.c[c] for c in columns)).order_by(table.c[columns[0]])).all()
    return "\n".join(["  " + " | ".join(columns)] + ["  " + " | ".join(map(str, r)) for r in rows])
