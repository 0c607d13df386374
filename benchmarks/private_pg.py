"""A throwaway PostgreSQL cluster of its own: ``initdb`` in a temporary directory, a free port, the server
settings a caller needs (``benchmarks/dagster_range.py --private-server``: ``pg_stat_statements`` preloaded;
tests/test_cdc.py: ``wal_level=logical``), stopped and removed whichever way the caller ends (short of a
SIGKILL). As root, initdb and pg_ctl run as ``postgres`` through ``runuser``.

    with private_server(settings=("wal_level=logical",)) as url:
        ...  # postgresql+psycopg://postgres@127.0.0.1:<port>/postgres

    with private_cluster() as cluster:  # tests/test_dispatch_chaos.py: a server it may restart
        cluster.restart()
"""

from __future__ import annotations

import contextlib
import dataclasses
import glob
import os
import pwd
import shutil
import signal
import socket
import subprocess
import tempfile
from collections.abc import Iterator, Sequence
from pathlib import Path

__all__ = ["PrivateCluster", "private_cluster", "private_server"]

INITDB = ("-E", "UTF8", "--no-locale", "--no-sync")  # --no-sync: the cluster is thrown away


def _pg_bin() -> Path:
    """The newest installed PostgreSQL's bin directory (``/usr/lib/postgresql/<major>/bin``)."""
    found = [Path(p) for p in glob.glob("/usr/lib/postgresql/*/bin") if Path(p, "initdb").exists()]
    if not found:
        raise SystemExit("private server: no initdb under /usr/lib/postgresql/*/bin")
    return max(found, key=lambda p: int(p.parent.name) if p.parent.name.isdigit() else 0)


def _as_cluster_user(argv: list[str]) -> list[str]:
    """initdb and pg_ctl refuse to run as root: as root, run them as ``postgres``."""
    if os.geteuid() != 0:
        return argv
    try:
        pwd.getpwnam("postgres")
    except KeyError:
        raise SystemExit(
            "a private server as root needs a 'postgres' user to run initdb and pg_ctl"
        ) from None
    return ["runuser", "-u", "postgres", "--", *argv]


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port: int = s.getsockname()[1]
        return port


def _on_signal(signum: int, _frame: object) -> None:
    raise SystemExit(128 + signum)  # unwinds through the finally blocks: the cluster is stopped


@dataclasses.dataclass(frozen=True)
class PrivateCluster:
    """A running private cluster: its URL, and a restart that keeps its data, port and settings."""

    url: str
    restart_argv: tuple[str, ...]

    def restart(self) -> None:
        """Restart the server (``pg_ctl restart``, waiting until it accepts connections again)."""
        subprocess.run(list(self.restart_argv), check=True, timeout=120, capture_output=True)


@contextlib.contextmanager
def private_server(settings: Sequence[str] = ()) -> Iterator[str]:
    """:func:`private_cluster`, yielding its URL."""
    with private_cluster(settings) as cluster:
        yield cluster.url


@contextlib.contextmanager
def private_cluster(settings: Sequence[str] = ()) -> Iterator[PrivateCluster]:
    """Start a cluster in a temporary directory with the server ``settings`` (``name=value``, each given
    as ``-c``); yield it; stop it and remove the directory on the way out (an exception, Ctrl-C, SIGTERM or
    SIGHUP included)."""
    bindir = _pg_bin()
    home = Path(tempfile.mkdtemp(prefix="joblease-bench-pg-"))
    if os.geteuid() == 0:
        user = pwd.getpwnam("postgres")
        os.chown(home, user.pw_uid, user.pw_gid)
    data, log, port = home / "data", home / "server.log", _free_port()
    previous = {s: signal.signal(s, _on_signal) for s in (signal.SIGTERM, signal.SIGHUP)}
    started = False
    try:
        subprocess.run(
            _as_cluster_user(
                [str(bindir / "initdb"), "-D", str(data), "-U", "postgres", "--auth=trust", *INITDB]
            ),
            check=True,
            stdout=subprocess.DEVNULL,
        )
        options = " ".join(
            [f"-p {port} -c listen_addresses=127.0.0.1 -c unix_socket_directories={home}"]
            + [f"-c {setting}" for setting in settings]
        )
        started = True
        got = subprocess.run(
            _as_cluster_user(
                [str(bindir / "pg_ctl"), "-D", str(data), "-l", str(log), "-o", options, "start"]
            ),
            stdout=subprocess.DEVNULL,
        )
        if got.returncode:
            raise SystemExit(f"private server: pg_ctl start failed:\n{log.read_text(errors='replace')}")
        print(f"private server: PostgreSQL {bindir.parent.name} on 127.0.0.1:{port} in {home}", flush=True)
        restart = _as_cluster_user(
            [
                str(bindir / "pg_ctl"),
                "-D",
                str(data),
                "-l",
                str(log),
                "-o",
                options,
                "-m",
                "fast",
                "-w",
                "restart",
            ]
        )
        yield PrivateCluster(f"postgresql+psycopg://postgres@127.0.0.1:{port}/postgres", tuple(restart))
    finally:
        if started:
            subprocess.run(
                _as_cluster_user([str(bindir / "pg_ctl"), "-D", str(data), "-m", "fast", "-w", "stop"]),
                stdout=subprocess.DEVNULL,
                stderr=subprocess.DEVNULL,
            )
        shutil.rmtree(home, ignore_errors=True)
        for s, handler in previous.items():
            signal.signal(s, handler)
        print("private server: stopped and removed", flush=True)
