"""Which PostgreSQL the restart chaos test restarts.

By default none the machine runs: the test starts a throwaway cluster of its own
(:func:`benchmarks.private_pg.private_cluster`) and restarts that, so running the suite never stops a
server other work depends on (another suite, a Dagster instance, a colleague's session on the same
machine). ``JOBLEASE_TEST_PG_RESTART_CMD`` opts in to restarting the test server itself (the one
``JOBLEASE_TEST_PG_URL`` names) with that command, split like a shell line and run without a shell: ``ssh
db sudo systemctl restart postgresql``, ``pg_ctlcluster --skip-systemctl-redirect 16 main restart``, ...
"""

from __future__ import annotations

import os
import shlex
import shutil
from collections.abc import Callable, Mapping

RESTART_CMD_ENV = "JOBLEASE_TEST_PG_RESTART_CMD"


def restart_command(
    environ: Mapping[str, str] = os.environ, *, which: Callable[[str], str | None] = shutil.which
) -> tuple[list[str] | None, str]:
    """``(command, "")`` when ``$JOBLEASE_TEST_PG_RESTART_CMD`` asks to restart the test server;
    ``(None, "")`` when it is unset (a private cluster is restarted instead); ``(None, reason)`` when it
    names no executable on this machine (the test fails with the reason)."""
    override = environ.get(RESTART_CMD_ENV, "").strip()
    if not override:
        return None, ""
    argv = shlex.split(override)
    if which(argv[0]) is None:
        return None, f"${RESTART_CMD_ENV}: {argv[0]!r} is not an executable on this machine"
    return argv, ""
