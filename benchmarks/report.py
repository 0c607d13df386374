"""What the benchmark scripts share: the psycopg DSN of a SQLAlchemy URL and the closing table."""

from __future__ import annotations

import sys
import time
from collections.abc import Sequence

import psycopg
from sqlalchemy.engine import URL, make_url

#: Set once CHECKPOINT was refused (the benchmark's role lacks the right): later windows skip it.
_checkpoint_refused: list[str] = []


def dsn(url: URL | str) -> str:
    """A libpq connection string for a ``postgresql+psycopg://`` URL (password kept: it is ours)."""
    parsed = make_url(url) if isinstance(url, str) else url
    return parsed.set(drivername="postgresql").render_as_string(hide_password=False)


def checkpoint(url: URL | str) -> bool:
    """Run ``CHECKPOINT`` on the server now: the windows of a paired comparison each start on empty tables
    right after one, in the same phase of the server's checkpoint cycle.

    Left alone, the benchmark's own WAL brings a checkpoint every minute or so (``max_wal_size``) and one
    every ``checkpoint_timeout``: the windows just after one pay for full-page images and share the disk
    with its writes, whichever side they belong to, and the paired ratio of that round moves with it.
    Needs a superuser or the ``pg_checkpoint`` role; without it, says so once and returns False.
    """
    if _checkpoint_refused:
        return False
    try:
        with psycopg.connect(dsn(url), autocommit=True) as conn:
            conn.execute("CHECKPOINT")
    except psycopg.errors.InsufficientPrivilege as exc:
        _checkpoint_refused.append(str(exc))
        print(
            f"note: CHECKPOINT refused ({str(exc).strip()}); windows start wherever the server's checkpoint "
            "cycle is (grant pg_checkpoint to the benchmark's role for steadier ratios)",
            file=sys.stderr,
        )
        return False
    return True


def print_table(headers: Sequence[str], rows: Sequence[Sequence[str]], started: float) -> None:
    """Print the rows as an aligned table, then the run's total time since ``started`` (perf_counter)."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    print()
    print(" | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)))
    print("-+-".join("-" * w for w in widths))
    for r in rows:
        print(" | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
    print(f"\ntotal runtime {time.perf_counter() - started:.0f} s")
