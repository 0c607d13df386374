"""The reference downstream receiver (a Starlette app on the inbox middleware, served by uvicorn) and
helpers to inspect what it did. Needs the ``receiver`` extra (Starlette, uvicorn, psycopg-pool)."""

from __future__ import annotations

from dagster_joblease.receiver.app import (
    build_app,
    effect_count,
    effects,
    ensure_tables,
    request_count,
    request_log,
)
from dagster_joblease.receiver.server import ReceiverOptions, ReceiverServer, serve
from dagster_joblease.testing.faults import Faults

__all__ = [
    "Faults",
    "ReceiverOptions",
    "ReceiverServer",
    "build_app",
    "effect_count",
    "effects",
    "ensure_tables",
    "request_count",
    "request_log",
    "serve",
]
