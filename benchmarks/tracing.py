"""What a set's per-row create spans cost: ``enqueue_many`` inside a span vs the same call outside any span.

    .venv/bin/python benchmarks/tracing.py [--rows 10000] [--rounds 5]

Not part of ``python -m benchmarks``. The PostgreSQL server comes from ``JOBLEASE_BENCH_PG_URL`` (default
``postgresql+psycopg://postgres@127.0.0.1:5432/postgres``); the script creates a scratch database and drops
it at the end, and uses a scratch SQLite file beside it. The OpenTelemetry SDK is set up as in production
(a ``BatchSpanProcessor``, its queue raised to hold a whole set) with an exporter that drops what it gets,
so the figure is the library's and the SDK's work in the enqueuing process, not an exporter's.

Each round runs both sides in alternating order, each one ``enqueue_many`` of ``--rows`` rows in one
transaction (``with engine.begin()``): ``untraced`` outside any span (no span is made, the rows' trace
columns stay NULL), ``traced`` inside a span (one ``create {topic}`` span per row, each row storing its
own context). Printed per database: the median ms per call, µs per row, and the ratio of the medians
(traced / untraced). The machine may be shared: quote the figures with their load.
"""

from __future__ import annotations

import argparse
import os
import statistics
import sys
import tempfile
import time
from collections.abc import Sequence
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))

from opentelemetry import trace
from opentelemetry.sdk.trace import ReadableSpan, TracerProvider
from opentelemetry.sdk.trace.export import BatchSpanProcessor, SpanExporter, SpanExportResult

from benchmarks.lease import databases, server_url
from dagster_joblease import outbox
from dagster_joblease.storage import create_engine, migrate

SIDES = ("untraced", "traced")


class _Drop(SpanExporter):
    def export(self, spans: Sequence[ReadableSpan]) -> SpanExportResult:
        return SpanExportResult.SUCCESS


def measure(url: str, rows: int, rounds: int, tracer: trace.Tracer) -> dict[str, list[float]]:
    """Seconds per call of each side, ``rounds`` alternating rounds."""
    engine = create_engine(url)
    migrate(engine)
    seconds: dict[str, list[float]] = {side: [] for side in SIDES}
    try:
        for r in range(rounds):
            for side in SIDES if r % 2 == 0 else reversed(SIDES):
                items = [
                    outbox.OutboxItem(f"v2:{side}-{r}-{i}", "bench", {"v": 1, "n": i}) for i in range(rows)
                ]
                started = time.perf_counter()
                if side == "traced":
                    with tracer.start_as_current_span("enqueue set"), engine.begin() as conn:
                        outbox.enqueue_many(conn, items)
                else:
                    with engine.begin() as conn:
                        outbox.enqueue_many(conn, items)
                seconds[side].append(time.perf_counter() - started)
    finally:
        engine.dispose()
    return seconds


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter
    )
    parser.add_argument("--rows", type=int, default=10_000, help="rows per enqueue_many (default 10000)")
    parser.add_argument("--rounds", type=int, default=5, help="alternating rounds (default 5)")
    args = parser.parse_args(argv)
    provider = TracerProvider()
    provider.add_span_processor(BatchSpanProcessor(_Drop(), max_queue_size=max(2_048, 2 * args.rows)))
    tracer = provider.get_tracer("benchmarks.tracing")
    trace.set_tracer_provider(provider)  # the global provider, which the library's create spans use
    (pg_url,), drop = databases(server_url(), 1)
    try:
        with tempfile.TemporaryDirectory() as scratch:
            urls = {"SQLite": f"sqlite:///{scratch}/bench.sqlite", "PostgreSQL": pg_url}
            for name, url in urls.items():
                got = measure(url, args.rows, args.rounds, tracer)
                medians = {side: statistics.median(got[side]) for side in SIDES}
                for side in SIDES:
                    print(
                        f"{name:10} {side:8} {medians[side] * 1000:8,.0f} ms/call "
                        f"{medians[side] / args.rows * 1e6:6.1f} us/row "
                        f"(min {min(got[side]) * 1000:,.0f}, max {max(got[side]) * 1000:,.0f} ms)"
                    )
                print(f"{name:10} traced / untraced {medians['traced'] / medians['untraced']:.2f}")
    finally:
        drop()
        provider.shutdown()
    print(f"{args.rows:,} rows per call, {args.rounds} rounds, load {os.getloadavg()[0]:.1f}")
    return 0


if __name__ == "__main__":
    sys.exit(main())
