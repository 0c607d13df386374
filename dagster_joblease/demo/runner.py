"""``joblease demo``: the whole story end to end on the embedded SQLite default, with Dagster's own daemon.

1. start the reference receiver (a real HTTP server in its own process) and ``dagster-daemon run`` on the
   packaged code location :mod:`dagster_joblease.demo.location` (run monitoring on, the queued run
   coordinator, the sensors RUNNING);
2. launch a real asset backfill of ``daily_invoice`` over the last N complete days, through Dagster's
   GraphQL API as the UI does (``launchPartitionBackfill``); the daemon's backfill loop submits its runs;
3. evaluate ``daily_billing_schedule`` at today's 02:00 UTC tick (``scheduleDryRun``, the UI's "Test
   schedule") and launch the run it requests (``launchRun``): yesterday again, which the backfill also
   runs, so one of the two wins and the other succeeds as a recorded skip;
4. SIGKILL the run worker of one backfilled partition in the middle of its leased body; Dagster marks the
   run failed, and ``daily_invoice_reconcile`` sees a lease whose holder's run is finished and relaunches
   the partition, which reclaims the lease;
5. ``outbox_dispatch_sensor`` requests ``outbox_dispatch_job`` runs that deliver each partition's POST;
6. print the table and exit non-zero unless every partition has exactly one winner, one outbox row and
   one effect at the receiver.

The waits share one budget scaled to the machine's load (``--timeout`` sets it), and the demo prints
where its time went. The work directory stays (``--no-keep`` removes it), and the demo ends with the one
command that shows the same runs, backfill, ticks and the killed run in the Dagster UI: ``joblease
demo-ui DIR`` (a receiver, and ``dg dev``). Nothing here needs the source checkout.
"""

from __future__ import annotations

import asyncio
import contextlib
import dataclasses
import datetime as dt
import json
import os
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Iterable, Iterator, Mapping, Sequence
from contextlib import contextmanager
from pathlib import Path
from typing import IO, Any

import click
import sqlalchemy as sa

from dagster_joblease import identity
from dagster_joblease.storage import create_engine, leases, migrate
from dagster_joblease.storage import outbox as outbox_rows

__all__ = ["DemoReport", "run_demo"]

LOCATION = "dagster_joblease.demo.location"
REPOSITORY = "__repository__"
ASSET = "daily_invoice"
JOB_NAME = "daily_billing_job"
SCHEDULE = "daily_billing_schedule"
DISPATCH_JOB = "outbox_dispatch_job"
TOPIC = "billing.daily"
BILLING_CODE = "daily-billing"
#: The demo's Dagster instance: run monitoring on (a dead run worker is failed by Dagster, not left
#: STARTED), the queued coordinator dequeuing every second, sensors evaluated in threads.
DAGSTER_YAML = """\
telemetry:
  enabled: false
run_monitoring:
  enabled: true
  poll_interval_seconds: 5
  max_resume_run_attempts: 0
run_coordinator:
  module: dagster.core.run_coordinator
  class: QueuedRunCoordinator
  config:
    max_concurrent_runs: 4
    dequeue_interval_seconds: 1
    dequeue_use_threads: true
    dequeue_num_workers: 4
sensors:
  use_threads: true
  num_workers: 4
"""
BACKFILL_MUTATION = """
mutation($params: LaunchBackfillParams!) {
  launchPartitionBackfill(backfillParams: $params) {
    __typename
    ... on LaunchBackfillSuccess { backfillId }
    ... on PythonError { message }
  }
}
"""
DRY_RUN_MUTATION = """
mutation($selector: ScheduleSelector!, $timestamp: Float!) {
  scheduleDryRun(selectorData: $selector, timestamp: $timestamp) {
    __typename
    ... on DryRunInstigationTick {
      evaluationResult {
        runRequests { runKey runConfigYaml tags { key value } }
        skipReason
        error { message }
      }
    }
    ... on PythonError { message }
  }
}
"""
LAUNCH_MUTATION = """
mutation($params: ExecutionParams!) {
  launchRun(executionParams: $params) {
    __typename
    ... on LaunchRunSuccess { run { runId } }
    ... on PythonError { message }
  }
}
"""


@dataclasses.dataclass
class DemoReport:
    """What the demo counted; ``ok`` is the invariant (one winner, one outbox row, one effect each)."""

    partitions: int
    runs: int
    won: int
    reclaimed: int
    skipped: int
    killed: int
    other: int
    outbox_rows: int
    posts: int
    effects: int
    partitions_with_one_effect: int
    dispatcher_runs: int
    backfill_id: str
    overlap_day: str
    killed_day: str
    seconds: float
    workdir: str
    #: Where the time went: (phase, seconds), in order.
    phases: list[tuple[str, float]] = dataclasses.field(default_factory=list)

    @property
    def ok(self) -> bool:
        n = self.partitions
        return (
            self.won + self.reclaimed == n
            and self.runs == self.won + self.reclaimed + self.skipped + self.killed + self.other
            and self.other == 0
            and self.killed == 1
            and self.reclaimed >= 1
            and self.outbox_rows == n
            and self.effects == n
            and self.partitions_with_one_effect == n
        )

    def table(self) -> str:
        headers = ["partitions", "runs", "won", "reclaimed", "skipped", "killed", "outbox rows", "POSTs"]
        headers.append("effects applied")
        values = [
            self.partitions,
            self.runs,
            self.won,
            self.reclaimed,
            self.skipped,
            self.killed,
            self.outbox_rows,
            self.posts,
            self.effects,
        ]
        widths = [max(len(h), len(str(v))) for h, v in zip(headers, values, strict=True)]
        line = "+" + "+".join("-" * (w + 2) for w in widths) + "+"
        head = "|" + "|".join(f" {h:>{w}} " for h, w in zip(headers, widths, strict=True)) + "|"
        row = "|" + "|".join(f" {v!s:>{w}} " for v, w in zip(values, widths, strict=True)) + "|"
        return "\n".join([line, head, line, row, line])


class _StatusLine:
    """One status line: rewritten in place on a terminal, printed on change otherwise."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.last = ""
        self.lock = threading.Lock()
        self.started = time.monotonic()

    def update(self, text: str) -> None:
        with self.lock:
            if text == self.last:
                return
            self.last = text
            text = f"{time.monotonic() - self.started:5.1f} s  {text}"
            if self.tty:
                self.stream.write("\r\033[K" + text)
            else:
                self.stream.write(text + "\n")
            self.stream.flush()

    def done(self, text: str) -> None:
        with self.lock:
            self.last = text
            self.stream.write(("\r\033[K" if self.tty else "") + text + "\n")
            self.stream.flush()


def demo_days(count: int, today: dt.date | None = None) -> list[str]:
    """The last ``count`` complete days (UTC), oldest first: the backfill's partitions; the last one is
    what the schedule's 02:00 tick today asks for."""
    end = today or dt.datetime.now(dt.UTC).date()
    return [(end - dt.timedelta(days=count - i)).isoformat() for i in range(count)]


#: The demo's waits on an idle 2-core machine take about a minute; its budget is this many seconds times
#: the machine's load per CPU (at least 1), unless ``--timeout`` says otherwise.
BASE_TIMEOUT_S = 300.0


def default_timeout_s(load: float | None = None, cpus: int | None = None) -> float:
    """The demo's budget for its waits, scaled to how busy the machine is now (load average per CPU)."""
    load = os.getloadavg()[0] if load is None else load
    cpus = cpus or os.cpu_count() or 1
    return BASE_TIMEOUT_S * max(1.0, load / cpus)


@dataclasses.dataclass
class _Deadline:
    """One budget for all the demo's waits (``--timeout``); a dead daemon ends a wait at once."""

    timeout_s: float
    work: Path
    started: float = dataclasses.field(default_factory=time.monotonic)
    daemon: subprocess.Popen[Any] | None = None

    def wait_for(self, predicate: Callable[[], bool], what: str) -> None:
        while not predicate():
            if self.daemon is not None and self.daemon.poll() is not None:
                raise click.ClickException(
                    f"demo: the Dagster daemon exited ({self.daemon.returncode}) while waiting for {what}; "
                    f"its log: {self.work / 'daemon.log'}"
                )
            if time.monotonic() - self.started > self.timeout_s:
                raise click.ClickException(
                    f"demo: still waiting for {what} after {self.timeout_s:.0f} s, the demo's budget on this "
                    f"machine (load average {os.getloadavg()[0]:.1f} on {os.cpu_count()} CPUs); give it "
                    f"more with `joblease demo --timeout SECONDS`. Logs: {self.work / 'daemon.log'}"
                )
            time.sleep(0.2)


class _Clock:
    """Where the demo's time goes: the seconds between one phase mark and the next."""

    def __init__(self) -> None:
        self.phases: list[tuple[str, float]] = []
        self.name = ""
        self.at = time.monotonic()

    def mark(self, name: str) -> None:
        now = time.monotonic()
        if self.name:
            self.phases.append((self.name, now - self.at))
        self.name, self.at = name, now


def time_summary(phases: Sequence[tuple[str, float]]) -> str:
    """``Where the time went: ...`` as one line per phase, with the total and the machine's load."""
    width = max((len(name) for name, _ in phases), default=0)
    lines = [f"  {name.ljust(width)}  {seconds:6.1f} s" for name, seconds in phases]
    total = sum(seconds for _, seconds in phases)
    load = os.getloadavg()[0]
    return "\n".join(
        [
            f"Where the time went ({total:.1f} s; load average {load:.1f} on {os.cpu_count()} CPUs):",
            *lines,
        ]
    )


def start_receiver(database_url: str, log: Path) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [sys.executable, "-m", "dagster_joblease.receiver", "--database-url", database_url, "--port", "0"],
        stdout=subprocess.PIPE,
        stderr=log.open("w"),
        text=True,
    )
    assert proc.stdout is not None
    line = proc.stdout.readline().strip()
    if not line.startswith("listening on "):
        proc.kill()
        raise click.ClickException(f"demo: the receiver did not start (see {log})")
    return proc, line.removeprefix("listening on ")


def stop_process(proc: subprocess.Popen[Any], *, group: bool) -> None:
    """Stop a process (and, for the daemon, its code server and run workers: its process group)."""
    if proc.poll() is not None:
        return
    try:
        if group:
            os.killpg(proc.pid, signal.SIGTERM)
        else:
            proc.terminate()
        proc.wait(timeout=20)
    except (subprocess.TimeoutExpired, ProcessLookupError):
        pass
    if proc.poll() is None or group:
        try:
            if group:
                os.killpg(proc.pid, signal.SIGKILL)
            else:
                proc.kill()
        except ProcessLookupError:
            pass
        proc.wait(timeout=10)


@contextmanager
def _stderr_to(path: Path) -> Iterator[None]:
    """Send this process's stderr (fd 2, which child processes inherit) to ``path`` for a while."""
    sys.stderr.flush()
    saved = os.dup(2)
    with path.open("a") as log:
        os.dup2(log.fileno(), 2)
        try:
            yield
        finally:
            sys.stderr.flush()
            os.dup2(saved, 2)
            os.close(saved)


@contextmanager
def _graphql(
    instance: Any, location: str = LOCATION
) -> Iterator[Callable[[str, Mapping[str, Any]], dict[str, Any]]]:
    """Dagster's GraphQL API on this instance and a location (the demo's), in this process (what the UI
    uses)."""
    from dagster_graphql.schema import create_schema

    from dagster_joblease.dagster.internals import module_workspace

    schema = create_schema()
    with module_workspace(instance, location) as process_context:

        def execute(query: str, variables: Mapping[str, Any]) -> dict[str, Any]:
            context = process_context.create_request_context()
            result = asyncio.run(
                schema.execute_async(query, context_value=context, variable_values=dict(variables))
            )
            if result.errors:
                raise click.ClickException(f"demo: GraphQL error: {result.errors[0]}")
            assert result.data is not None
            return dict(result.data)

        yield execute


def _launch_backfill(execute: Callable[[str, Mapping[str, Any]], dict[str, Any]], days: list[str]) -> str:
    params = {
        "assetSelection": [{"path": [ASSET]}],
        "partitionNames": days,
        "title": "joblease demo: backfill the last days",
    }
    answer = execute(BACKFILL_MUTATION, {"params": params})["launchPartitionBackfill"]
    if answer["__typename"] != "LaunchBackfillSuccess":
        raise click.ClickException(f"demo: the backfill was refused: {answer}")
    return str(answer["backfillId"])


def _launch_schedule_tick(
    execute: Callable[[str, Mapping[str, Any]], dict[str, Any]], tick: dt.datetime
) -> list[str]:
    """Evaluate the schedule at ``tick`` and launch every run it requests, as the UI's "Test schedule"."""
    repo = {"repositoryLocationName": LOCATION, "repositoryName": REPOSITORY}
    answer = execute(
        DRY_RUN_MUTATION, {"selector": {**repo, "scheduleName": SCHEDULE}, "timestamp": tick.timestamp()}
    )["scheduleDryRun"]
    result = answer.get("evaluationResult") or {}
    requests = result.get("runRequests") or []
    if answer["__typename"] != "DryRunInstigationTick" or not requests:
        raise click.ClickException(f"demo: the schedule requested no run: {answer}")
    launched = []
    for request in requests:
        params = {
            "selector": {**repo, "jobName": JOB_NAME},
            "runConfigData": request["runConfigYaml"] or "{}",
            "executionMetadata": {"tags": request["tags"]},
        }
        run = execute(LAUNCH_MUTATION, {"params": params})["launchRun"]
        if run["__typename"] != "LaunchRunSuccess":
            raise click.ClickException(f"demo: the schedule's run was refused: {run}")
        launched.append(str(run["run"]["runId"]))
    return launched


def _outbox_rows(engine: sa.Engine) -> int:
    with engine.connect() as conn:
        return outbox_rows.topic_count(conn, TOPIC)


def _lease_states(engine: sa.Engine, days: Sequence[str]) -> dict[str, str]:
    """Each day's lease status (days without a row are absent)."""
    lock_keys = {identity.JobIdentity.schedule(BILLING_CODE, day).idempotency_key: day for day in days}
    with engine.connect() as conn:
        return {day: state.status for day, state in leases.states_of(conn, lock_keys).items()}


#: The environment variables the demo sets for itself and its processes (put back when it ends).
DEMO_ENV = ("DAGSTER_HOME", "BILLING_API_URL", "JOBLEASE_DATABASE_URL")


@dataclasses.dataclass(frozen=True)
class DemoPlan:
    """Where the demo works and what it runs: the backfill's days, the one killed in its body (the
    second to last), the one the schedule's tick asks for again (the last), and that tick."""

    work: Path
    days: tuple[str, ...]
    tick: dt.datetime

    @property
    def home(self) -> Path:
        return self.work / "dagster_home"

    @property
    def kill_dir(self) -> Path:
        return self.work / "kill"

    @property
    def joblease_url(self) -> str:
        return f"sqlite:///{self.work / 'joblease.sqlite'}"

    @property
    def receiver_url(self) -> str:
        return f"sqlite:///{self.work / 'receiver.sqlite'}"

    @property
    def overlap_day(self) -> str:
        return self.days[-1]

    @property
    def killed_day(self) -> str:
        return self.days[-2]


def demo_plan(partitions: int, work: Path, now: dt.datetime) -> DemoPlan:
    """The demo's plan for ``partitions`` days before ``now`` (UTC): the tick is today's 02:00."""
    tick = dt.datetime.combine(now.date(), dt.time(2, 0), tzinfo=dt.UTC)
    return DemoPlan(work=work, days=tuple(demo_days(partitions, now.date())), tick=tick)


def settle_status(
    states: Mapping[str, str], delivered: int, unfinished: int, partitions: int
) -> tuple[str, bool]:
    """The progress line while the demo waits, and whether it is done: every partition's lease
    ``SUCCESS``, every partition delivered, and no run left unfinished."""
    done = sum(1 for s in states.values() if s == "SUCCESS")
    line = (
        f"[5/6] {done}/{partitions} partitions done, "
        f"{delivered}/{partitions} delivered, {unfinished} run(s) not finished"
    )
    return line, (
        len(states) == partitions and done == partitions and delivered == partitions and not unfinished
    )


@dataclasses.dataclass(frozen=True)
class RunTally:
    """The partitions' runs by how they ended: ``other`` is none of the four (a demo failure)."""

    won: int = 0
    reclaimed: int = 0
    skipped: int = 0
    killed: int = 0
    other: int = 0


def tally_runs(runs: Iterable[tuple[str, bool, bool]]) -> RunTally:
    """Count ``(joblease/outcome tag, failed, succeeded)`` per run: a failed run was killed; a succeeded
    one won, reclaimed or skipped by its tag; anything else is ``other``."""
    counts = dict.fromkeys(("won", "reclaimed", "skipped", "killed", "other"), 0)
    for outcome, failed, succeeded in runs:
        counts[_run_kind(outcome, failed=failed, succeeded=succeeded)] += 1
    return RunTally(**counts)


def _run_kind(outcome: str, *, failed: bool, succeeded: bool) -> str:
    if failed:
        return "killed"
    if not succeeded:
        return "other"
    if outcome in ("won", "reclaimed"):
        return outcome
    return "skipped" if outcome.startswith("skipped") else "other"


def one_effect_count(applied: Mapping[str, Any], days: Iterable[str]) -> int:
    """How many of ``days`` have exactly their own effect at the receiver (``applied``: the payload per
    idempotency key of the demo's topic)."""
    return sum(
        1
        for day in days
        if applied.get(identity.idempotency_key("SCHEDULE", BILLING_CODE, day)) == {"billingDate": day}
    )


def run_demo(
    *,
    partitions: int = 3,
    workdir: Path | None = None,
    stream: IO[str] | None = None,
    timeout_s: float | None = None,
) -> DemoReport:
    """Run the demo in ``workdir`` (created if needed) and return what it counted. ``timeout_s`` bounds
    its waits together (default: :func:`default_timeout_s`, scaled to the machine's load)."""
    if partitions < 2:
        raise click.BadParameter("the demo needs at least 2 partitions (one is killed, one overlaps)")
    progress = _StatusLine(stream or sys.stdout)
    started = time.monotonic()
    work = workdir or Path(tempfile.mkdtemp(prefix="joblease-demo-"))
    plan = demo_plan(partitions, work, dt.datetime.now(dt.UTC))
    _prepare_workdir(plan)
    clock = _Clock()
    deadline = _Deadline(default_timeout_s() if timeout_s is None else timeout_s, work)
    with contextlib.ExitStack() as stack:
        stack.enter_context(_restored_env(DEMO_ENV))
        engine = create_engine(plan.joblease_url)
        receiver_engine = create_engine(plan.receiver_url)
        stack.callback(receiver_engine.dispose)
        stack.callback(engine.dispose)  # disposed first, after the processes are stopped

        clock.mark("preparing the databases, importing Dagster")
        progress.update("[1/6] preparing the joblease database and the Dagster home")
        instance = _prepare_instance(plan, engine)

        clock.mark("starting the receiver and the daemon")
        progress.update("[2/6] starting the reference receiver and the Dagster daemon")
        daemon = _start_processes(plan, stack)
        deadline.daemon = daemon

        clock.mark("launching the backfill and the schedule's tick (GraphQL)")
        backfill_id = _launch(plan, instance, progress)

        clock.mark("the daemon submitting runs, until one is inside its body")
        _kill_in_body(plan, deadline, progress)

        clock.mark("runs, the killed day's reconciliation, delivery")
        deadline.wait_for(
            lambda: _settled(plan, instance, engine, receiver_engine, progress),
            "every partition to be done and delivered",
        )
        clock.mark("stopping the daemon, counting")
        progress.update("[6/6] stopping the daemon")
        stop_process(daemon, group=True)

        report = _count(plan, instance, engine, receiver_engine, backfill_id, started=started)
        clock.mark("")
        report.phases = clock.phases
        progress.done(f"done in {report.seconds:.1f} s")
        return report


def _prepare_workdir(plan: DemoPlan) -> None:
    """The work directory, the Dagster home with the demo's dagster.yaml, and the killed day's kill file."""
    plan.work.mkdir(parents=True, exist_ok=True)
    plan.home.mkdir(exist_ok=True)
    (plan.home / "dagster.yaml").write_text(DAGSTER_YAML)
    plan.kill_dir.mkdir(exist_ok=True)
    (plan.kill_dir / f"{plan.killed_day}.kill").write_text("")


@contextmanager
def _restored_env(names: Sequence[str]) -> Iterator[None]:
    """Put ``names`` of ``os.environ`` back as they were (unset when they were unset) on the way out."""
    saved = {k: os.environ.get(k) for k in names}
    try:
        yield
    finally:
        for key, value in saved.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def _prepare_instance(plan: DemoPlan, engine: sa.Engine) -> Any:
    """Migrate the joblease database, point this process at the demo's Dagster home and database, and
    return the Dagster instance (its SQLite storage initialised before other processes open it)."""
    migrate(engine)
    os.environ["DAGSTER_HOME"] = str(plan.home)
    os.environ["JOBLEASE_DATABASE_URL"] = plan.joblease_url
    warnings.simplefilter("ignore")
    import dagster as dg

    instance = dg.DagsterInstance.get()
    instance.get_runs(limit=1)  # initialise the SQLite home once, before other processes open it
    return instance


#: Runs Dagster's ``dagster-daemon`` console script by its entry point (public package metadata), so the
#: demo needs only an importable dagster, not its scripts on PATH or beside this interpreter.
_DAGSTER_DAEMON = (
    "import sys; from importlib.metadata import entry_points; "
    "(script,) = entry_points(group='console_scripts', name='dagster-daemon'); sys.exit(script.load()())"
)


def _start_processes(
    plan: DemoPlan, stack: contextlib.ExitStack, location: str = LOCATION
) -> subprocess.Popen[Any]:
    """Start the reference receiver, then the Dagster daemon (its own process group) on a location (the
    demo's); each is stopped when ``stack`` closes. Returns the daemon."""
    receiver, base = start_receiver(plan.receiver_url, plan.work / "receiver.log")
    stack.callback(stop_process, receiver, group=False)
    os.environ["BILLING_API_URL"] = f"{base}/{TOPIC}"
    daemon = subprocess.Popen(
        [sys.executable, "-c", _DAGSTER_DAEMON, "run", "-m", location],
        stdout=(plan.work / "daemon.log").open("w"),
        stderr=subprocess.STDOUT,
        env={
            **os.environ,
            "JOBLEASE_DEMO_KILL_DIR": str(plan.kill_dir),
            "PYTHONWARNINGS": "ignore",
        },
        cwd=plan.work,
        start_new_session=True,
    )
    stack.callback(stop_process, daemon, group=True)
    return daemon


def _launch(plan: DemoPlan, instance: Any, progress: _StatusLine) -> str:
    """Launch the backfill of the plan's days and the schedule's tick through GraphQL; the backfill's id."""
    days = plan.days
    with _stderr_to(plan.work / "graphql.log"), _graphql(instance) as execute:
        progress.update(f"[3/6] launching a backfill of {ASSET} for {days[0]}..{days[-1]}")
        backfill_id = _launch_backfill(execute, list(days))
        progress.update(f"[3/6] backfill {backfill_id} launched; the schedule's 02:00 tick asks too")
        _launch_schedule_tick(execute, plan.tick)
    return backfill_id


def _kill_in_body(plan: DemoPlan, deadline: _Deadline, progress: _StatusLine) -> None:
    """Wait for the killed day's run to be inside its leased body, then SIGKILL its run worker."""
    killed_day = plan.killed_day
    pid_file = plan.kill_dir / f"{killed_day}.pid"
    progress.update(f"[4/6] waiting for the run of {killed_day} to be inside its leased body")
    deadline.wait_for(pid_file.exists, f"the run of {killed_day} to start its leased body")
    time.sleep(0.2)  # the file is written before the body waits; the lease is held by then
    os.kill(int(pid_file.read_text()), signal.SIGKILL)
    progress.update(f"[4/6] SIGKILLed the run worker of {killed_day}; reconciliation will redo it")


def _applied(receiver_engine: sa.Engine) -> dict[str, Any]:
    """The receiver's effects of the demo's topic: the payload per idempotency key."""
    from dagster_joblease.receiver import effects

    return {key: json.loads(payload) for key, topic, payload in effects(receiver_engine) if topic == TOPIC}


def _settled(
    plan: DemoPlan, instance: Any, engine: sa.Engine, receiver_engine: sa.Engine, progress: _StatusLine
) -> bool:
    """Whether every partition is done and delivered with no run left unfinished; shows how far it is."""
    import dagster as dg

    from dagster_joblease.dagster.sensors import NOT_FINISHED_STATUSES
    from dagster_joblease.receiver import effects

    states = _lease_states(engine, plan.days)
    delivered = sum(1 for _key, topic, _ in effects(receiver_engine) if topic == TOPIC)
    unfinished = instance.get_runs(dg.RunsFilter(statuses=list(NOT_FINISHED_STATUSES)))
    line, done = settle_status(states, delivered, len(unfinished), len(plan.days))
    progress.update(line)
    return done


def _count(
    plan: DemoPlan,
    instance: Any,
    engine: sa.Engine,
    receiver_engine: sa.Engine,
    backfill_id: str,
    *,
    started: float,
) -> DemoReport:
    """What the demo counts once everything settled: the partitions' runs, rows, POSTs and effects."""
    import dagster as dg

    from dagster_joblease.receiver import effect_count, request_count

    runs = [
        r
        for r in instance.get_runs()
        if r.job_name != DISPATCH_JOB and r.tags.get("dagster/partition") in plan.days
    ]
    tally = tally_runs(
        (r.tags.get("joblease/outcome", ""), r.status == dg.DagsterRunStatus.FAILURE, r.is_success)
        for r in runs
    )
    return DemoReport(
        partitions=len(plan.days),
        runs=len(runs),
        won=tally.won,
        reclaimed=tally.reclaimed,
        skipped=tally.skipped,
        killed=tally.killed,
        other=tally.other,
        outbox_rows=_outbox_rows(engine),
        posts=request_count(receiver_engine),
        effects=effect_count(receiver_engine),
        partitions_with_one_effect=one_effect_count(_applied(receiver_engine), plan.days),
        dispatcher_runs=len(instance.get_runs(dg.RunsFilter(job_name=DISPATCH_JOB))),
        backfill_id=backfill_id,
        overlap_day=plan.overlap_day,
        killed_day=plan.killed_day,
        seconds=time.monotonic() - started,
        workdir=str(plan.work),
    )
