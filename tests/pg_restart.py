"""How the PostgreSQL-restart chaos test restarts the server, or why it cannot (then it skips).

``JOBLEASE_TEST_PG_RESTART_CMD`` is the restart command (split like a shell line, run without a shell), for
any server: ``ssh db sudo systemctl restart postgresql``, ``pg_ctl -D /data restart``, ... Without it, the
default restarts the *local* Debian/Ubuntu cluster the tests use: ``pg_ctlcluster
--skip-systemctl-redirect <version> <cluster> restart``, with the version asked of the server and the
cluster found by ``pg_lsclusters`` on the test URL's port. A server elsewhere, or a machine without those
tools, gets a skip with the reason, never a failure or a restart of the wrong server.
"""

from __future__ import annotations

import os
import shlex
import shutil
import subprocess
from collections.abc import Callable, Mapping

import sqlalchemy as sa
from sqlalchemy.engine import URL, make_url

RESTART_CMD_ENV = "JOBLEASE_TEST_PG_RESTART_CMD"
LOCAL_HOSTS = {"", "127.0.0.1", "localhost", "::1"}


def _server_major(url: URL) -> int:
    engine = sa.create_engine(url, poolclass=sa.pool.NullPool)
    try:
        with engine.connect() as conn:
            return int(conn.exec_driver_sql("SHOW server_version_num").scalar_one()) // 10_000
    finally:
        engine.dispose()


def _clusters() -> str:
    return subprocess.run(
        ["pg_lsclusters", "--no-header"], capture_output=True, text=True, check=True, timeout=30
    ).stdout


def restart_command(
    url: URL,
    environ: Mapping[str, str] = os.environ,
    *,
    which: Callable[[str], str | None] = shutil.which,
    server_major: Callable[[URL], int] = _server_major,
    clusters: Callable[[], str] = _clusters,
) -> tuple[list[str] | None, str]:
    """``(command, "")`` to restart the server at ``url``, or ``(None, reason)`` to skip with."""
    override = environ.get(RESTART_CMD_ENV, "").strip()
    if override:
        argv = shlex.split(override)
        if which(argv[0]) is None:
            return None, f"${RESTART_CMD_ENV}: {argv[0]!r} is not an executable on this machine"
        return argv, ""
    host = url.host or ""
    if host not in LOCAL_HOSTS and not host.startswith("/"):
        return None, (
            f"the test server {host}:{url.port or 5432} is not on this machine, so the default "
            f"(pg_ctlcluster) cannot restart it; set ${RESTART_CMD_ENV} to a command that does"
        )
    if which("pg_ctlcluster") is None or which("pg_lsclusters") is None:
        return None, (
            f"pg_ctlcluster/pg_lsclusters are not installed (not a Debian/Ubuntu PostgreSQL); set "
            f"${RESTART_CMD_ENV} to this server's restart command"
        )
    try:
        version = server_major(url)
        listing = clusters()
    except Exception as exc:
        return (
            None,
            f"cannot find the local cluster to restart ({type(exc).__name__}); set ${RESTART_CMD_ENV}",
        )
    port = str(url.port or 5432)
    for line in listing.splitlines():
        fields = line.split()
        if len(fields) >= 3 and fields[0] == str(version) and fields[2] == port:
            return ["pg_ctlcluster", "--skip-systemctl-redirect", str(version), fields[1], "restart"], ""
    return None, (
        f"no local PostgreSQL {version} cluster listens on port {port} (pg_lsclusters); set "
        f"${RESTART_CMD_ENV} to this server's restart command"
    )


def server_url(environ: Mapping[str, str] = os.environ) -> URL:
    """The URL the tests use (as in conftest): ``JOBLEASE_TEST_PG_URL`` or the local default."""
    from tests.conftest import DEFAULT_PG_URL, PG_URL_ENV

    return make_url(environ.get(PG_URL_ENV, DEFAULT_PG_URL)).set(drivername="postgresql+psycopg")
