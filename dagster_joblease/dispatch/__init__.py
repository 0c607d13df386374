"""Delivery of outbox rows: routes (where, and over which transport: HTTP, NATS JetStream or RabbitMQ), policy
(how a result is judged), the transports (how a row is sent), the dispatcher."""

from __future__ import annotations

from dagster_joblease.dispatch.dispatcher import Dispatcher, DispatchReport, RowOutcome
from dagster_joblease.dispatch.policy import Outcome
from dagster_joblease.dispatch.routes import Route, load_routes

__all__ = ["DispatchReport", "Dispatcher", "Outcome", "Route", "RowOutcome", "load_routes"]
