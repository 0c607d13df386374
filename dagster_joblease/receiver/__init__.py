"""The reference downstream receiver (an HTTP server on the inbox) and helpers to inspect what it did."""

from __future__ import annotations

from dagster_joblease.receiver.app import (
    APPLY_FUNCTION,
    Faults,
    ReceiverServer,
    effect_count,
    effects,
    ensure_tables,
    request_count,
    request_log,
    serve,
)
from dagster_joblease.receiver.command import receiver_command

__all__ = [
    "APPLY_FUNCTION",
    "Faults",
    "ReceiverServer",
    "effect_count",
    "effects",
    "ensure_tables",
    "receiver_command",
    "request_count",
    "request_log",
    "serve",
]
