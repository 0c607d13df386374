"""What the benchmark scripts share: the psycopg DSN of a SQLAlchemy URL and the closing table."""

from __future__ import annotations

import time
from collections.abc import Sequence

from sqlalchemy.engine import URL, make_url


def dsn(url: URL | str) -> str:
    """A libpq connection string for a ``postgresql+psycopg://`` URL (password kept: it is ours)."""
    parsed = make_url(url) if isinstance(url, str) else url
    return parsed.set(drivername="postgresql").render_as_string(hide_password=False)


def print_table(headers: Sequence[str], rows: Sequence[Sequence[str]], started: float) -> None:
    """Print the rows as an aligned table, then the run's total time since ``started`` (perf_counter)."""
    widths = [max(len(h), *(len(r[i]) for r in rows)) for i, h in enumerate(headers)]
    print()
    print(" | ".join(h.ljust(w) for h, w in zip(headers, widths, strict=True)))
    print("-+-".join("-" * w for w in widths))
    for r in rows:
        print(" | ".join(c.ljust(w) for c, w in zip(r, widths, strict=True)))
    print(f"\ntotal runtime {time.perf_counter() - started:.0f} s")
