"""``joblease demo``: the whole story end to end, on the embedded SQLite default, in well under a minute.

1. start the reference receiver (a real HTTP server in its own process);
2. run ``daily_billing_job`` for N daily partitions twice at once, from two processes (as an overlapping
   backfill and schedule would): every partition gets two Dagster runs, the lease lets one of them win;
3. start a dispatcher process and SIGKILL it mid-delivery (effects applied, not yet recorded as sent);
4. dispatch the rest with ``outbox_dispatch_job`` once the dead dispatcher's claims expire;
5. print the table and exit non-zero unless every partition has exactly one winner, one outbox row and
   one effect at the receiver (POSTs may exceed effects: redelivery is deduplicated by the inbox).

The runs belong to the packaged code location :mod:`dagster_joblease.dagster.demo_location` (they carry
its repository origin, so the job's Partitions tab lists them). With ``--keep`` the work directory stays,
and the demo prints the two commands that show the same runs in the Dagster UI: a receiver to keep up,
and ``dagster dev -m dagster_joblease.dagster.demo_location``. Nothing here needs the source checkout.
"""

from __future__ import annotations

import dataclasses
import datetime as dt
import json
import os
import shutil
import signal
import subprocess
import sys
import tempfile
import threading
import time
import warnings
from collections.abc import Callable, Sequence
from pathlib import Path
from typing import IO, Any

import click
import sqlalchemy as sa

from dagster_joblease import dispatch, identity, outbox
from dagster_joblease.storage import create_engine, migrate
from dagster_joblease.storage.schema import outbox_table

__all__ = ["DemoReport", "demo_command", "run_demo"]

JOB_NAME = "daily_billing_job"
TOPIC = "billing.daily"
BILLING_CODE = "daily-billing"
FIRST_DAY = dt.date(2024, 1, 1)
KILLED_CLAIM_MS = 1_500  # the killed dispatcher's claims expire this fast, so the rest can go out soon
RECEIVER_DELAY_MS = 120  # the receiver applies, commits, then answers this late: a window to kill in
QUIET = {"loggers": {"console": {"config": {"log_level": "ERROR"}}}}
DAGSTER_YAML = "telemetry:\n  enabled: false\n"


@dataclasses.dataclass
class DemoReport:
    """What the demo counted; ``ok`` is the invariant (one winner, one outbox row, one effect each)."""

    partitions: int
    runs: int
    winners: int
    skips: int
    outbox_rows: int
    sent: int
    posts: int
    effects: int
    killed_after_posts: int
    partitions_with_one_effect: int
    seconds: float
    workdir: str

    @property
    def ok(self) -> bool:
        n = self.partitions
        return (
            self.runs == 2 * n
            and self.winners == n
            and self.skips == n
            and self.outbox_rows == n
            and self.sent == n
            and self.effects == n
            and self.partitions_with_one_effect == n
        )

    def table(self) -> str:
        headers = ["partitions", "runs", "winners", "skips", "outbox rows", "POSTs", "effects applied"]
        values = [
            self.partitions,
            self.runs,
            self.winners,
            self.skips,
            self.outbox_rows,
            self.posts,
            self.effects,
        ]
        widths = [max(len(h), len(str(v))) for h, v in zip(headers, values, strict=True)]
        line = "+" + "+".join("-" * (w + 2) for w in widths) + "+"
        head = "|" + "|".join(f" {h:>{w}} " for h, w in zip(headers, widths, strict=True)) + "|"
        row = "|" + "|".join(f" {v!s:>{w}} " for v, w in zip(values, widths, strict=True)) + "|"
        return "\n".join([line, head, line, row, line])


class _Progress:
    """One status line: rewritten in place on a terminal, printed on change otherwise."""

    def __init__(self, stream: IO[str]) -> None:
        self.stream = stream
        self.tty = stream.isatty()
        self.last = ""
        self.lock = threading.Lock()

    def update(self, text: str) -> None:
        with self.lock:
            if text == self.last:
                return
            self.last = text
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


def _env(workdir: Path, joblease_url: str, billing_url: str | None = None) -> dict[str, str]:
    env = dict(os.environ)
    env["JOBLEASE_DATABASE_URL"] = joblease_url
    env["DAGSTER_HOME"] = str(workdir / "dagster_home")
    if billing_url is not None:
        env["BILLING_API_URL"] = billing_url
    return env


def _days(count: int) -> list[str]:
    return [(FIRST_DAY + dt.timedelta(days=i)).isoformat() for i in range(count)]


def _wait_for(predicate: Callable[[], bool], timeout_s: float, what: str) -> None:
    deadline = time.monotonic() + timeout_s
    while not predicate():
        if time.monotonic() > deadline:
            raise click.ClickException(f"demo: timed out after {timeout_s:g} s waiting for {what}")
        time.sleep(0.05)


def _start_receiver(database_url: str, log: Path) -> tuple[subprocess.Popen[str], str]:
    proc = subprocess.Popen(
        [
            sys.executable,
            "-m",
            "dagster_joblease.receiver",
            "--database-url",
            database_url,
            "--port",
            "0",
            "--delay-after-apply-ms",
            str(RECEIVER_DELAY_MS),
        ],
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


def _worker_main(argv: Sequence[str]) -> int:
    """A launcher process: run the job for each partition, one Dagster run each, and say what happened."""
    label, *days = argv
    warnings.simplefilter("ignore")
    import dagster as dg

    from dagster_joblease.dagster import demo_location

    job = demo_location.defs.resolve_job_def(JOB_NAME)
    instance = dg.DagsterInstance.get()
    tags = {"joblease/demo_launcher": label, **demo_location.origin_tags(JOB_NAME)}
    for day in days:
        result = job.execute_in_process(
            partition_key=day, instance=instance, run_config=QUIET, tags=tags, raise_on_error=False
        )
        run = instance.get_run_by_id(result.run_id)
        outcome = run.tags.get("joblease/outcome", "failed") if run is not None else "failed"
        print(json.dumps({"day": day, "success": result.success, "outcome": outcome}), flush=True)
    return 0


def _dispatcher_main(argv: Sequence[str]) -> int:
    """A plain dispatcher process (no Dagster), killed mid-delivery by the demo."""
    url, billing_url = argv
    with dispatch.Dispatcher(
        create_engine(url), {TOPIC: dispatch.Route(billing_url, timeout_s=1.0)}, claim_ms=KILLED_CLAIM_MS
    ) as dispatcher:
        dispatcher.dispatch(limit=1_000)
    return 0


def _outbox_counts(engine: sa.Engine) -> tuple[int, int, int]:
    t = outbox_table
    with engine.connect() as conn:
        rows = conn.execute(
            sa.select(t.c.status, sa.func.count()).where(t.c.topic == TOPIC).group_by(t.c.status)
        ).all()
    counts = {status: int(n) for status, n in rows}
    return sum(counts.values()), counts.get("SENT", 0), counts.get("PENDING", 0)


def run_demo(
    *, partitions: int = 10, workdir: Path | None = None, stream: IO[str] | None = None
) -> DemoReport:
    """Run the demo in ``workdir`` (created if needed) and return what it counted."""
    from dagster_joblease.receiver import effect_count, effects, request_count

    out = stream or sys.stdout
    progress = _Progress(out)
    started = time.monotonic()
    work = workdir or Path(tempfile.mkdtemp(prefix="joblease-demo-"))
    work.mkdir(parents=True, exist_ok=True)
    home = work / "dagster_home"
    home.mkdir(exist_ok=True)
    (home / "dagster.yaml").write_text(DAGSTER_YAML)
    joblease_url = f"sqlite:///{work / 'joblease.sqlite'}"
    receiver_url = f"sqlite:///{work / 'receiver.sqlite'}"
    days = _days(partitions)
    engine = create_engine(joblease_url)
    receiver_engine = create_engine(receiver_url)
    procs: list[subprocess.Popen[Any]] = []
    saved_env = {k: os.environ.get(k) for k in ("DAGSTER_HOME", "BILLING_API_URL", "JOBLEASE_DATABASE_URL")}
    try:
        progress.update("[1/5] preparing the joblease database and the Dagster home")
        migrate(engine)
        # Initialise the SQLite Dagster home once, before two processes open it (concurrent first use
        # corrupts it: "alembic_version has more than one head").
        os.environ["DAGSTER_HOME"] = str(home)
        warnings.simplefilter("ignore")
        import dagster as dg

        instance = dg.DagsterInstance.get()
        instance.get_runs(limit=1)

        progress.update("[2/5] starting the reference receiver")
        receiver, base = _start_receiver(receiver_url, work / "receiver.log")
        procs.append(receiver)
        billing_url = f"{base}/{TOPIC}"
        env = _env(work, joblease_url, billing_url)

        lines: list[dict[str, Any]] = []
        lock = threading.Lock()

        def launch(label: str) -> tuple[subprocess.Popen[str], threading.Thread]:
            proc = subprocess.Popen(
                [sys.executable, "-m", "dagster_joblease.dagster.demo", "_worker", label, *days],
                stdout=subprocess.PIPE,
                stderr=(work / f"{label}.log").open("w"),
                env=env,
                text=True,
            )

            def read() -> None:
                assert proc.stdout is not None
                for raw in proc.stdout:
                    with lock:
                        lines.append(json.loads(raw))
                        done = len(lines)
                        won = sum(1 for x in lines if x["outcome"] in ("won", "reclaimed"))
                    progress.update(
                        f"[3/5] daily_billing_job x{partitions} partitions, twice at once (backfill + "
                        f"schedule): {done}/{2 * partitions} runs, {won} won, {done - won} skipped"
                    )

            thread = threading.Thread(target=read, daemon=True)
            thread.start()
            return proc, thread

        progress.update("[3/5] launching daily_billing_job twice at once (two processes)")
        launched = [launch("backfill"), launch("schedule")]
        procs += [p for p, _ in launched]
        for proc, thread in launched:
            if proc.wait(timeout=120) != 0:
                raise click.ClickException(f"demo: a launcher process failed (see {work})")
            thread.join(timeout=10)

        progress.update("[4/5] dispatching; killing the dispatcher mid-delivery (SIGKILL)")
        killed_at = max(1, partitions // 3)
        dispatcher = subprocess.Popen(
            [sys.executable, "-m", "dagster_joblease.dagster.demo", "_dispatch", joblease_url, billing_url],
            stderr=(work / "dispatcher.log").open("w"),
            env=env,
        )
        procs.append(dispatcher)
        _wait_for(lambda: request_count(receiver_engine) >= killed_at, 30, "the first deliveries")
        dispatcher.send_signal(signal.SIGKILL)
        dispatcher.wait()
        killed_after = request_count(receiver_engine)
        progress.update(
            f"[4/5] dispatcher killed after {killed_after} POSTs; waiting for its claims to expire"
        )
        _wait_for(
            lambda: outbox.due_summary(engine).due == _outbox_counts(engine)[2], 30, "the claims to expire"
        )

        progress.update("[5/5] outbox_dispatch_job delivers the rest")
        from dagster_joblease.dagster import demo_location

        os.environ["BILLING_API_URL"] = billing_url
        os.environ["JOBLEASE_DATABASE_URL"] = joblease_url
        result = demo_location.defs.resolve_job_def("outbox_dispatch_job").execute_in_process(
            instance=instance, run_config=QUIET, tags=demo_location.origin_tags("outbox_dispatch_job")
        )
        if not result.success:
            raise click.ClickException("demo: outbox_dispatch_job failed")

        runs = instance.get_runs(dg.RunsFilter(job_name=JOB_NAME))
        outcomes = [r.tags.get("joblease/outcome", "") for r in runs]
        rows, sent, _ = _outbox_counts(engine)
        applied = {
            key: json.loads(payload) for key, topic, payload in effects(receiver_engine) if topic == TOPIC
        }
        expected = {identity.idempotency_key("SCHEDULE", BILLING_CODE, day): day for day in days}
        one_effect = sum(1 for key, day in expected.items() if applied.get(key) == {"billingDate": day})
        report = DemoReport(
            partitions=partitions,
            runs=len(runs),
            winners=sum(1 for o in outcomes if o in ("won", "reclaimed")),
            skips=sum(1 for o in outcomes if o.startswith("skipped")),
            outbox_rows=rows,
            sent=sent,
            posts=request_count(receiver_engine),
            effects=effect_count(receiver_engine),
            killed_after_posts=killed_after,
            partitions_with_one_effect=one_effect,
            seconds=time.monotonic() - started,
            workdir=str(work),
        )
        progress.done(f"done in {report.seconds:.1f} s")
        return report
    finally:
        for proc in procs:
            if proc.poll() is None:
                proc.terminate()
                try:
                    proc.wait(timeout=5)
                except subprocess.TimeoutExpired:
                    proc.kill()
        engine.dispose()
        receiver_engine.dispose()
        for key, value in saved_env.items():
            if value is None:
                os.environ.pop(key, None)
            else:
                os.environ[key] = value


def ui_commands(work: Path) -> str:
    """The two commands that show a kept demo in the UI: a receiver kept up (the location's dispatcher and
    sensors deliver to it) and ``dagster dev`` on the packaged demo location, with this environment's
    executables."""
    bin_dir = Path(sys.executable).parent
    receiver_db = f"sqlite:///{work / 'receiver.sqlite'}"
    return (
        f"  {bin_dir / 'joblease'} receiver --database-url {receiver_db} --port 8765 &\n"
        f"  DAGSTER_HOME={work / 'dagster_home'} JOBLEASE_DATABASE_URL=sqlite:///{work / 'joblease.sqlite'} "
        f"{bin_dir / 'dagster'} dev -m dagster_joblease.dagster.demo_location"
    )


@click.command("demo")
@click.option(
    "--partitions",
    type=click.IntRange(1, 366),
    default=10,
    show_default=True,
    help="Daily partitions to bill.",
)
@click.option(
    "--workdir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where the databases and the Dagster home go (default: a new temporary directory).",
)
@click.option(
    "--keep/--no-keep", default=False, help="Keep the work directory (to open it in `dagster dev`)."
)
def demo_command(partitions: int, workdir: Path | None, keep: bool) -> None:
    """End-to-end demo: duplicate runs, a killed dispatcher, and still one effect per partition."""
    work = (workdir or Path(tempfile.mkdtemp(prefix="joblease-demo-"))).resolve()
    try:
        report = run_demo(partitions=partitions, workdir=work)
        click.echo()
        click.echo(report.table())
        click.echo(
            f"\nEvery partition ran twice (two launchers at once); the lease let one run win, the other "
            "succeeded as a recorded skip. The dispatcher was SIGKILLed mid-delivery (the receiver had "
            f"{report.killed_after_posts} POSTs by then) and its rows were redelivered: {report.posts} "
            f"POSTs, {report.effects} effects applied "
            "(the receiver deduplicated by Idempotency-Key). Each partition's effect carries its own key "
            f"and payload: {report.partitions_with_one_effect}/{report.partitions}."
        )
        if report.ok:
            click.echo(f"OK: one effect per partition ({report.effects}/{report.partitions}).")
        else:
            raise click.ClickException(
                f"invariant FAILED: expected {partitions} winners, outbox rows, sent rows and effects "
                f"and {2 * partitions} runs; see {work}"
            )
        if keep:
            click.echo(f"\nKept {work}. To see the same runs in the Dagster UI, run:\n{ui_commands(work)}")
        else:
            click.echo(
                "\nTo see these runs in the Dagster UI, run `joblease demo --keep --workdir DIR`: it prints "
                "the receiver and `dagster dev` commands."
            )
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


def _main(argv: Sequence[str]) -> int:
    if argv and argv[0] == "_worker":
        return _worker_main(argv[1:])
    if argv and argv[0] == "_dispatch":
        return _dispatcher_main(argv[1:])
    demo_command.main(args=list(argv), prog_name="joblease demo")
    return 0


if __name__ == "__main__":
    sys.exit(_main(sys.argv[1:]))
