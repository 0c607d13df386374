"""Crash a ``run_exclusive`` worker on purpose: SIGKILL a real child process at a chosen point.

A SIGKILL runs no ``finally``, no ``atexit`` and no lease release: the database is left exactly as a
worker killed by the OOM killer or a lost node would leave it. :func:`crash_run_exclusive` returns what
the database then holds, so a test can check the state and run the work again.
"""

from __future__ import annotations

import dataclasses
import enum
import multiprocessing
import os
import pickle
import signal
import threading
from collections.abc import Callable
from multiprocessing.connection import Connection
from typing import Any

import sqlalchemy as sa

from dagster_joblease import admin, checks, errors, identity
from dagster_joblease.lease import Lease, LeaseService
from dagster_joblease.storage import outbox
from dagster_joblease.storage.engine import create_engine, translate_errors

__all__ = ["CrashPoint", "CrashResult", "crash_point", "crash_run_exclusive"]

DEFAULT_TIMEOUT_S = 120.0


class CrashPoint(enum.StrEnum):
    """Where :func:`crash_run_exclusive` kills the worker."""

    BEFORE_CALLBACK = "before-callback"  #: the lease is claimed; the callback has not started
    MARKED = "marked"  #: where the callback calls :func:`crash_point`
    AFTER_CALLBACK = "after-callback"  #: the callback returned (its effect is done); SUCCESS not recorded


@dataclasses.dataclass(frozen=True)
class CrashResult:
    """What the database holds after the kill.

    ``lease`` is the run's lease row (``status``, ``attempt``, ``expired``, ...; ``None`` if the run
    was never claimed); ``outbox`` the outbox rows written while the child ran, oldest first;
    ``exitcode`` the child's (``-9``: killed by SIGKILL).
    """

    point: CrashPoint
    lease: admin.LeaseRow | None
    outbox: tuple[admin.OutboxRow, ...]
    exitcode: int | None


@dataclasses.dataclass
class _Child:
    conn: Connection
    point: CrashPoint


_child: _Child | None = None


def _arrive() -> None:
    """Tell the parent this is the point, then wait for the SIGKILL."""
    assert _child is not None
    _child.conn.send(("arrived", None))
    threading.Event().wait()


def crash_point() -> None:
    """Mark where a callback run by ``crash_run_exclusive(..., at=CrashPoint.MARKED)`` is killed.

    Anywhere else (another crash point, or outside the crash helper) it does nothing.
    """
    if _child is not None and _child.point is CrashPoint.MARKED:
        _arrive()


def _child_main(
    url: str,
    lease_ms: int,
    heartbeat_ms: int,
    job: identity.JobIdentity,
    fn: Callable[[LeaseService, Lease], Any],
    point: CrashPoint,
    conn: Connection,
) -> None:
    global _child
    _child = _Child(conn, point)
    engine = create_engine(url)
    service = LeaseService(engine, lease_ms=lease_ms, heartbeat_ms=heartbeat_ms)

    def body(lease: Lease) -> Any:
        if point is CrashPoint.BEFORE_CALLBACK:
            _arrive()
        result = fn(service, lease)
        if point is CrashPoint.AFTER_CALLBACK:
            _arrive()
        return result

    try:
        outcome = service.run_exclusive(job, body)
    except BaseException as exc:
        conn.send(("finished", f"run_exclusive raised {type(exc).__name__}: {exc}"))
        return
    if outcome.acquired:
        conn.send(("finished", "the callback completed and the run was recorded SUCCESS"))
    else:
        conn.send(("finished", f"the lease was not acquired ({outcome.outcome})"))


def _check_callable(fn: object) -> None:
    if not callable(fn):
        raise errors.ConfigurationError(f"fn must be a callable fn(service, lease), got {type(fn).__name__}")
    try:
        pickle.dumps(fn)
    except (pickle.PicklingError, AttributeError, TypeError) as exc:
        raise errors.ConfigurationError(
            f"crash_run_exclusive runs fn={getattr(fn, '__qualname__', fn)!r} in a fresh (spawned) process, "
            "which must import it by name: define it at module level in an importable module (not a "
            "lambda, a nested function or a method of a local class); bind arguments with "
            f"functools.partial(fn, ...) ({type(exc).__name__}: {exc})"
        ) from None


def _last_outbox_id(engine: sa.Engine) -> int:
    with translate_errors("read the outbox"), engine.connect() as conn:
        return outbox.last_id(conn)


def _snapshot(
    service: LeaseService, job: identity.JobIdentity, after_id: int, point: CrashPoint, exitcode: int | None
) -> CrashResult:
    try:
        lease_row: admin.LeaseRow | None = admin.show_lease(service.engine, job.idempotency_key)
    except errors.NotFoundError:
        lease_row = None
    rows = [r for r in admin.list_outbox(service.engine, limit=admin.MAX_LIMIT) if r.id > after_id]
    return CrashResult(point=point, lease=lease_row, outbox=tuple(reversed(rows)), exitcode=exitcode)


def crash_run_exclusive(
    service: LeaseService,
    job: identity.JobIdentity,
    fn: Callable[[LeaseService, Lease], Any],
    *,
    at: CrashPoint = CrashPoint.AFTER_CALLBACK,
    timeout_s: float = DEFAULT_TIMEOUT_S,
) -> CrashResult:
    """Run ``fn(service, lease)`` under ``run_exclusive(job)`` in a child process; SIGKILL it at ``at``.

    The child is started with multiprocessing's *spawn* method, with its own engine on ``service``'s
    database and ``service``'s lease timing; ``fn`` gets the child's :class:`LeaseService` (for
    ``fenced_transaction``) and the lease. Spawn imports ``fn`` by name, so ``fn`` must be defined at
    module level in an importable module (a test module is fine); bind arguments with
    ``functools.partial``. Otherwise :class:`ConfigurationError` says so before anything starts.

    After the kill the run's lease is still ``RUNNING`` until it expires; call
    :func:`expire_now` to let the next ``run_exclusive`` reclaim it at once.

    Example::

        def bill(service, lease):  # module level
            with service.fenced_transaction(lease) as conn:
                enqueue_once(conn, idempotency_key=lease.idempotency_key, topic="billing", payload={"v": 1})

        crashed = crash_run_exclusive(service, job, bill, at=CrashPoint.AFTER_CALLBACK)
        assert crashed.lease.status == "RUNNING" and len(crashed.outbox) == 1

    Raises:
        ConfigurationError: ``fn`` cannot be imported by a spawned process, or an argument is invalid.
        AssertionError: the child ended (or timed out) without reaching ``at``; the message says how.
    """
    point = _check_crash(service, job, fn, at, timeout_s)
    url = service.engine.url.render_as_string(hide_password=False)
    after_id = _last_outbox_id(service.engine)
    ctx = multiprocessing.get_context("spawn")
    receive, send = ctx.Pipe(duplex=False)
    process = ctx.Process(
        target=_child_main,
        args=(url, service.timing.lease_ms, service.timing.heartbeat_ms, job, fn, point, send),
        name=f"joblease-crash-{point.value}",
        daemon=True,
    )
    process.start()
    send.close()
    try:
        _await_arrival(process, receive, point, timeout_s)
        assert process.pid is not None
        os.kill(process.pid, signal.SIGKILL)
        process.join(timeout_s)
    finally:
        receive.close()
        if process.is_alive():
            process.kill()
            process.join()
    return _snapshot(service, job, after_id, point, process.exitcode)


def _check_crash(service: object, job: object, fn: object, at: CrashPoint, timeout_s: object) -> CrashPoint:
    """The crash point of valid arguments; a specific error naming the first invalid one."""
    if not isinstance(service, LeaseService):
        raise errors.ConfigurationError(f"service must be a LeaseService, got {type(service).__name__}")
    if not isinstance(job, identity.JobIdentity):
        raise errors.InvalidJobIdentityError("identity", job, "must be a JobIdentity")
    try:
        point = CrashPoint(at)
    except ValueError:
        raise errors.ConfigurationError(
            f"at={at!r} is not a crash point; use one of {', '.join(p.value for p in CrashPoint)}"
        ) from None
    checks.number("timeout_s", timeout_s, above=0)
    _check_callable(fn)
    return point


def _await_arrival(process: Any, receive: Connection, point: CrashPoint, timeout_s: float) -> None:
    """Wait for the child's word that it reached ``point``; an AssertionError saying how it did not
    (it timed out: killed; it failed or died first: joined)."""
    if not receive.poll(timeout_s):
        process.kill()
        process.join()
        raise AssertionError(f"the crash child did not reach {point.value!r} within {timeout_s} s")
    try:
        message: tuple[str, str | None] | None = receive.recv()
    except EOFError:
        message = None
    if message is None or message[0] != "arrived":
        process.join(timeout_s)
        raise AssertionError(
            f"the crash child never reached {point.value!r}: {not_arrived(message, process.exitcode)}"
        )


def not_arrived(message: tuple[str, str | None] | None, exitcode: int | None) -> str:
    """Why the crash child did not arrive: what it said, or how it died (``message`` None: the pipe closed
    without a word)."""
    if message is not None:
        return str(message[1])
    return f"it died first (exit code {exitcode})"
