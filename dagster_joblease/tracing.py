"""OpenTelemetry for the outbox: the create, send and process spans, and the time rows spend in the outbox.

The only module that imports ``opentelemetry`` (the optional dependency ``dagster-joblease[tracing]``,
which is ``opentelemetry-api``); without it every function here is a no-op and rows carry no trace. With
it, spans follow OpenTelemetry's messaging semantic conventions:

* ``create {topic}`` (PRODUCER), one per row, opened by ``enqueue_once`` / ``enqueue_many`` around the
  INSERT, only when a span is active: its W3C ``traceparent`` / ``tracestate`` are written in the same
  INSERT as the row, so a row's trace context commits (or rolls back) with it. A set gets one create span
  per row (the conventions' create span accounts for one message and gives it a unique creation
  context), so each row's send span links to its own row's. A row enqueued outside any span has none.
* ``send {topic}`` (PRODUCER), one per delivery attempt by the dispatcher, *linked* to the row's creation
  context (a link, not a parent: the dispatcher's work is not part of the producer's transaction, and one
  dispatcher pass serves many producers). The creation context itself travels in the message's headers
  (``traceparent`` / ``tracestate``), so the consumer continues the producer's trace.
* ``process {destination}`` (CONSUMER), opened by the inbox around the consumer's effect: its parent is
  the context in the request's headers (and it links to it), so the effect is in the producer's trace.
* ``joblease.outbox.time_in_outbox`` (histogram, seconds): from the row's INSERT to the attempt that sent
  it, on the database clock at claim plus the dispatcher's own elapsed time since.

Spans and the histogram use the global tracer and meter providers (``opentelemetry.trace`` /
``opentelemetry.metrics``): configure an SDK and an exporter in the process, as for any instrumented
library. Trace context is always W3C Trace Context, whatever propagators the process configured: it is
what the columns and the headers hold.
"""

from __future__ import annotations

import contextlib
import functools
import re
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from importlib import metadata
from typing import Any, NamedTuple

from dagster_joblease.storage.schema import TRACEPARENT_LENGTH, TRACESTATE_LENGTH

try:
    from opentelemetry import metrics, trace
    from opentelemetry.trace.propagation.tracecontext import TraceContextTextMapPropagator
except ImportError:  # the optional dependency is absent: every function below is a no-op
    trace = None  # type: ignore[assignment]
    metrics = None  # type: ignore[assignment]
    TraceContextTextMapPropagator = None  # type: ignore[assignment,misc]

__all__ = [
    "MESSAGING_SYSTEMS",
    "TIME_IN_OUTBOX",
    "TRACEPARENT_HEADER",
    "TRACESTATE_HEADER",
    "TraceContext",
    "creating",
    "creating_each",
    "enabled",
    "message_headers",
    "processing",
    "record_time_in_outbox",
    "sending",
]

#: The header names of W3C Trace Context (lowercase, as HTTP/2, NATS and AMQP headers compare them).
TRACEPARENT_HEADER = "traceparent"
TRACESTATE_HEADER = "tracestate"
#: The histogram of seconds from a row's INSERT to the attempt that sent it.
TIME_IN_OUTBOX = "joblease.outbox.time_in_outbox"
#: ``messaging.system`` of every span here (no registered value names a database outbox).
_SYSTEM = "joblease"
#: ``messaging.system`` of a transport's send spans and its consumer's process spans: OpenTelemetry's
#: value for the broker (NATS's conventions: ``nats``, JetStream included; RabbitMQ's: ``rabbitmq``).
MESSAGING_SYSTEMS = {"http": "http", "jetstream": "nats", "rabbitmq": "rabbitmq"}
_SCOPE = "dagster_joblease"
#: W3C Trace Context's traceparent: version, trace id, parent id, flags (lowercase hex; version ff invalid).
_TRACEPARENT = re.compile(r"(?!ff)[0-9a-f]{2}-[0-9a-f]{32}-[0-9a-f]{16}-[0-9a-f]{2}(-[!-~]*)?")
#: A tracestate as a header value carries it: printable ASCII, not blank.
_TRACESTATE = re.compile(r"[!-~]([ -~]*[!-~])?")


@functools.cache
def _tracer() -> Any:
    """The library's tracer (a proxy until the process sets its provider; looked up once: reading the
    package's version costs more than a span)."""
    try:
        version = metadata.version("dagster-joblease")
    except metadata.PackageNotFoundError:  # pragma: no cover - a source tree without an install
        version = "0"
    return trace.get_tracer(_SCOPE, version)


class TraceContext(NamedTuple):
    """A row's W3C trace context: what the columns ``traceparent`` / ``tracestate`` hold (None: none)."""

    traceparent: str | None = None
    tracestate: str | None = None


NO_TRACE = TraceContext()


def enabled() -> bool:
    """Whether ``opentelemetry-api`` is installed (the spans may still go nowhere: no SDK configured)."""
    return trace is not None


def _checked(traceparent: str | None, tracestate: str | None) -> TraceContext:
    """What a row stores of a propagated context: a well-formed traceparent that fits the column, and the
    tracestate only beside it and when it fits (W3C lets any hop drop a tracestate over 512 characters)."""
    if (
        traceparent is None
        or len(traceparent) > TRACEPARENT_LENGTH
        or not _TRACEPARENT.fullmatch(traceparent)
    ):
        return NO_TRACE
    if tracestate is not None and (
        len(tracestate) > TRACESTATE_LENGTH or not _TRACESTATE.fullmatch(tracestate)
    ):
        tracestate = None
    return TraceContext(traceparent, tracestate)


def _context_of(span: Any) -> TraceContext:
    carrier: dict[str, str] = {}
    TraceContextTextMapPropagator().inject(carrier, context=trace.set_span_in_context(span))
    return _checked(carrier.get(TRACEPARENT_HEADER), carrier.get(TRACESTATE_HEADER))


def _span_context_of(traced: TraceContext) -> Any:
    """The remote SpanContext a row's trace context names (None: no valid one)."""
    if traced.traceparent is None:
        return None
    carrier = {TRACEPARENT_HEADER: traced.traceparent}
    if traced.tracestate is not None:
        carrier[TRACESTATE_HEADER] = traced.tracestate
    span_context = trace.get_current_span(TraceContextTextMapPropagator().extract(carrier)).get_span_context()
    return span_context if span_context.is_valid else None


def _attributes(
    operation: str,
    destination: str,
    system: str,
    message_id: str | None,
    extra: Mapping[str, str] | None = None,
) -> dict[str, Any]:
    """A span's messaging attributes (OpenTelemetry's messaging semantic conventions); ``extra``: the
    system's own (a RabbitMQ routing key, a templated subject's filled name), over the common ones."""
    attributes: dict[str, Any] = {
        "messaging.system": system,
        "messaging.operation.type": operation,
        "messaging.operation.name": operation,
        "messaging.destination.name": destination,
    }
    if message_id is not None:
        attributes["messaging.message.id"] = message_id
    if extra:
        attributes.update(extra)
    return attributes


@contextlib.contextmanager
def creating(topic: str, *, idempotency_key: str | None = None) -> Iterator[TraceContext]:
    """Around an enqueue's INSERT: the ``create {topic}`` span of one message, yielding the trace context
    to write with its row (a set: :func:`creating_each`). Only when a span is active, so that an enqueue
    outside any trace neither starts one nor stores one; otherwise (or without OpenTelemetry) it yields
    ``TraceContext()``, and the row's columns stay NULL."""
    if trace is None or not trace.get_current_span().get_span_context().is_valid:
        yield NO_TRACE
        return
    attributes = _attributes("create", topic, _SYSTEM, idempotency_key)
    parent = trace.get_current_span()
    tracer = _tracer()
    with tracer.start_as_current_span(
        f"create {topic}", kind=trace.SpanKind.PRODUCER, attributes=attributes
    ) as span:
        # No SDK (the API's no-op tracer makes an invalid span): the enqueuing span's own context.
        yield _context_of(span) if span.get_span_context().is_valid else _context_of(parent)


@contextlib.contextmanager
def creating_each(messages: Sequence[tuple[str, str]]) -> Iterator[list[TraceContext] | None]:
    """Around one INSERT of a set's rows: one ``create {topic}`` span per message (``(topic,
    idempotency_key)``), each a child of the active span, yielding each message's own context in the given
    order, to write with its row; a statement that raises marks them all as errors. OpenTelemetry's
    messaging conventions: a create span accounts for one message and gives it a unique creation context,
    which the send span of that message links to. Only when a span is active; otherwise (or without
    OpenTelemetry) it yields None and the rows' columns stay NULL. Without an SDK (the API's no-op tracer)
    every row stores the active span's context, as :func:`creating` does."""
    if trace is None or not trace.get_current_span().get_span_context().is_valid or not messages:
        yield None
        return
    parent = trace.get_current_span()
    tracer = _tracer()
    spans = [
        tracer.start_span(
            f"create {topic}",
            kind=trace.SpanKind.PRODUCER,
            attributes=_attributes("create", topic, _SYSTEM, key),
        )
        for topic, key in messages
    ]
    try:
        if spans[0].get_span_context().is_valid:
            yield [_context_of(span) for span in spans]
        else:
            yield [_context_of(parent)] * len(spans)
    except BaseException as exc:
        for span in spans:  # the set was refused or rolled back: none of its rows was created
            span.set_status(trace.Status(trace.StatusCode.ERROR, f"{type(exc).__name__}: {exc}"))
        raise
    finally:
        for span in spans:
            span.end()


def message_headers(traced: TraceContext) -> dict[str, str]:
    """The headers that carry a row's creation context to the consumer (none for a row without one).
    Built from the row's columns alone: a dispatcher without OpenTelemetry still propagates the context."""
    checked = _checked(traced.traceparent, traced.tracestate)
    if checked.traceparent is None:
        return {}
    headers = {TRACEPARENT_HEADER: checked.traceparent}
    if checked.tracestate is not None:
        headers[TRACESTATE_HEADER] = checked.tracestate
    return headers


class _Sending:
    """The send span of one attempt (a no-op without OpenTelemetry or without a span)."""

    def __init__(self, span: Any) -> None:
        self._span = span

    def outcome(self, outcome: str, reason: str | None) -> None:
        """Record the attempt's outcome (``sent``, ``retry``, ``dead``); an error status unless sent."""
        if self._span is None:
            return
        self._span.set_attribute("joblease.outcome", outcome)
        if outcome != "sent":
            self._span.set_status(trace.Status(trace.StatusCode.ERROR, reason))


#: The send "span" when spans go nowhere: entered once per attempt, it records nothing.
_NOT_SENDING = contextlib.nullcontext(_Sending(None))


def _spans_recorded() -> bool:
    """Whether a span started now can be recorded: OpenTelemetry is installed and the process has set a
    tracer provider. Until then the API's proxy hands out no-op spans, which record nothing yet cost a
    few µs each (the dispatcher starts one per attempt)."""
    return trace is not None and not isinstance(
        trace.get_tracer_provider(), (trace.ProxyTracerProvider, trace.NoOpTracerProvider)
    )


def sending(
    topic: str,
    idempotency_key: str,
    traced: TraceContext,
    *,
    system: str = _SYSTEM,
    destination: Callable[[], tuple[str, Mapping[str, str]]] | None = None,
) -> contextlib.AbstractContextManager[_Sending]:
    """Around one delivery attempt: the ``send {destination}`` span, linked to the row's creation context
    (when it has one). ``system``: the transport that sends (its ``messaging.system`` is
    :data:`MESSAGING_SYSTEMS`'s; any other text is taken as it is). ``destination``: gives the broker's
    name for where the row goes and its own attributes (``Route.span_destination``), called only when a
    span is started; None: the topic. Without OpenTelemetry or a tracer provider, no span is started."""
    if not _spans_recorded():
        return _NOT_SENDING
    return _send_span(topic, idempotency_key, traced, system, destination)


@contextlib.contextmanager
def _send_span(
    topic: str,
    idempotency_key: str,
    traced: TraceContext,
    system: str,
    destination: Callable[[], tuple[str, Mapping[str, str]]] | None,
) -> Iterator[_Sending]:
    creation = _span_context_of(traced)
    name, extra = destination() if destination is not None else (topic, None)
    attributes = _attributes("send", name, MESSAGING_SYSTEMS.get(system, system), idempotency_key, extra)
    tracer = _tracer()
    with tracer.start_as_current_span(
        f"send {name}",
        kind=trace.SpanKind.PRODUCER,
        attributes=attributes,
        links=[trace.Link(creation)] if creation is not None else None,
    ) as span:
        yield _Sending(span)


def _header_items(headers: Mapping[str, str] | Iterable[tuple[bytes, bytes]]) -> dict[str, str]:
    """The trace headers among ``headers`` (a mapping, or ASGI's list of lowercase byte pairs)."""
    items: Iterable[tuple[Any, Any]] = headers.items() if isinstance(headers, Mapping) else headers
    found: dict[str, str] = {}
    for name, value in items:
        text = (name.decode("latin-1") if isinstance(name, bytes) else str(name)).lower()
        if text in (TRACEPARENT_HEADER, TRACESTATE_HEADER) and text not in found:
            found[text] = value.decode("latin-1") if isinstance(value, bytes) else str(value)
    return found


@contextlib.contextmanager
def processing(
    destination: str,
    headers: Mapping[str, str] | Iterable[tuple[bytes, bytes]],
    *,
    idempotency_key: str | None = None,
    system: str = _SYSTEM,
    attributes: Mapping[str, str] | None = None,
) -> Iterator[None]:
    """Around a consumer's effect: the ``process {destination}`` span, continuing the trace named by the
    message's ``traceparent`` / ``tracestate`` headers (its parent, and a link to it). A message without
    them starts no trace of its own here unless a span is already active (then the span is its child)."""
    if trace is None:
        yield
        return
    found = _header_items(headers)
    creation = _span_context_of(_checked(found.get(TRACEPARENT_HEADER), found.get(TRACESTATE_HEADER)))
    if creation is None and not trace.get_current_span().get_span_context().is_valid:
        yield
        return
    span_attributes = _attributes("process", destination, system, idempotency_key, attributes)
    parent = trace.set_span_in_context(trace.NonRecordingSpan(creation)) if creation is not None else None
    tracer = _tracer()
    with tracer.start_as_current_span(
        f"process {destination}",
        context=parent,
        kind=trace.SpanKind.CONSUMER,
        attributes=span_attributes,
        links=[trace.Link(creation)] if creation is not None else None,
    ):
        yield


_histogram: Any = None


def record_time_in_outbox(seconds: float, topic: str) -> None:
    """Record one sent row's time in the outbox (seconds from its INSERT to the attempt that sent it)."""
    global _histogram
    if metrics is None:
        return
    if _histogram is None:
        _histogram = metrics.get_meter(_SCOPE).create_histogram(
            TIME_IN_OUTBOX,
            unit="s",
            description="Time from an outbox row's INSERT to the attempt that sent it",
        )
    _histogram.record(max(0.0, seconds), {"messaging.destination.name": topic})
