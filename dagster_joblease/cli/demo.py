"""``joblease demo`` and ``joblease demo-ui``: the end-to-end demo's command line (what it prints and what
its options mean). The demo itself, which drives Dagster, is :mod:`dagster_joblease.demo.runner`; this
module is loaded only when one of these commands runs, so ``joblease --help`` never imports it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from pathlib import Path

import click

from dagster_joblease.demo import runner as demo

__all__ = ["demo_command", "demo_ui_command", "ui_command"]


def _default_sigint() -> None:
    signal.signal(signal.SIGINT, signal.SIG_DFL)


RUNS_VIEW = "/runs?view=runs"  # the Runs page with "Show runs within backfills" ticked


def ui_command(work: Path) -> str:
    """The one command that serves the Dagster UI on a kept demo's runs (``joblease demo-ui``: a
    receiver for the location's dispatcher, and ``dg dev``), with this environment's executable."""
    return f"{Path(sys.executable).parent / 'joblease'} demo-ui {work}"


def _demo_env(work: Path) -> dict[str, str]:
    return {
        "DAGSTER_HOME": str(work / "dagster_home"),
        "JOBLEASE_DATABASE_URL": f"sqlite:///{work / 'joblease.sqlite'}",
    }


@click.command("demo-ui")
@click.argument("workdir", type=click.Path(file_okay=False, exists=True, path_type=Path))
@click.option("--port", "-p", type=int, default=3000, show_default=True, help="The Dagster UI's port.")
@click.option("--host", "-h", default="127.0.0.1", show_default=True, help="The Dagster UI's interface.")
def demo_ui_command(workdir: Path, port: int, host: str) -> None:
    """Serve the Dagster UI on a kept demo's runs: `dg dev` on the demo location, with a receiver for its
    dispatcher (on a free port). Ctrl-C stops both."""
    work = workdir.resolve()
    if not (work / "dagster_home" / "dagster.yaml").is_file() or not (work / "joblease.sqlite").is_file():
        raise click.ClickException(
            f"{work} is not a demo's work directory (no dagster_home/dagster.yaml or joblease.sqlite); "
            "run `joblease demo` first: it keeps its work directory and prints this command"
        )
    dg_exe = Path(sys.executable).parent / "dg"
    if not dg_exe.exists():
        raise click.ClickException(
            f"{dg_exe} not found: the UI needs dagster-dg-cli and dagster-webserver, the [ui] extra "
            "(pip install 'dagster-joblease[ui]')"
        )
    receiver, base = demo.start_receiver(f"sqlite:///{work / 'receiver.sqlite'}", work / "receiver-ui.log")
    env = {**os.environ, **_demo_env(work), "BILLING_API_URL": f"{base}/{demo.TOPIC}"}
    click.echo(f"receiver: {base} (log {work / 'receiver-ui.log'})")
    click.echo(f"Dagster UI: http://{host}:{port}{RUNS_VIEW} (runs within backfills shown); Ctrl-C stops")
    # `dg dev` stops cleanly on SIGINT (Ctrl-C); started from a script it would inherit SIGINT ignored.
    dev = subprocess.Popen(
        [str(dg_exe), "dev", "-m", demo.LOCATION, "-p", str(port), "-h", host],
        env=env,
        cwd=work,
        preexec_fn=_default_sigint,
    )
    stopping: list[float] = []

    def interrupt(_signum: int, _frame: object) -> None:
        """SIGINT or SIGTERM here: stop dg dev as Ctrl-C does (it stops its webserver and daemon)."""
        stopping.append(time.monotonic())
        if dev.poll() is None:
            dev.send_signal(signal.SIGINT)

    previous = {sig: signal.signal(sig, interrupt) for sig in (signal.SIGINT, signal.SIGTERM)}
    try:
        while dev.poll() is None:
            if stopping and time.monotonic() - stopping[0] > 60:
                dev.kill()
            time.sleep(0.5)
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
        demo.stop_process(receiver, group=False)


def explain(report: demo.DemoReport) -> str:
    """What the table's counts mean, and that they add up."""
    return (
        f"A backfill ({report.backfill_id}) ran {demo.ASSET} for {report.partitions} days, one run each; the "
        f"schedule's 02:00 tick asked for {report.overlap_day} again, so one of those two runs won and the "
        f"other succeeded as a recorded skip. The run of {report.killed_day} was SIGKILLed inside its leased "
        f"body; Dagster failed it and daily_invoice_reconcile relaunched the partition, which reclaimed the "
        f"lease. Runs: {report.runs} = {report.won} won + {report.reclaimed} reclaimed + {report.skipped} "
        f"skipped + {report.killed} killed; partitions done: {report.won} + {report.reclaimed} = "
        f"{report.won + report.reclaimed}. outbox_dispatch_sensor requested {report.dispatcher_runs} "
        f"dispatcher run(s): {report.outbox_rows} outbox rows, {report.posts} POSTs, {report.effects} "
        "effects applied"
        + (
            " (a POST retried after a timeout carries the same Idempotency-Key: the receiver applied it once)"
            if report.posts > report.effects
            else ""
        )
        + f"; each partition's effect carries its own key and payload: "
        f"{report.partitions_with_one_effect}/{report.partitions}."
    )


@click.command("demo")
@click.option(
    "--partitions",
    type=click.IntRange(2, 31),
    default=3,
    show_default=True,
    help="Days to backfill (the last complete ones).",
)
@click.option(
    "--workdir",
    type=click.Path(file_okay=False, path_type=Path),
    default=None,
    help="Where the databases and the Dagster home go (default: a new temporary directory).",
)
@click.option(
    "--keep/--no-keep",
    default=True,
    show_default=True,
    help="Keep the work directory, to see its runs in the Dagster UI (`joblease demo-ui DIR`).",
)
@click.option(
    "--timeout",
    "timeout_s",
    type=click.FloatRange(min=1),
    default=None,
    metavar="SECONDS",
    help=f"Budget for the demo's waits (default: {demo.BASE_TIMEOUT_S:.0f} s times the load average per CPU, "
    "at least 1).",
)
def demo_command(partitions: int, workdir: Path | None, keep: bool, timeout_s: float | None) -> None:
    """End-to-end demo with Dagster's daemon: a backfill, a schedule tick, a killed run, one effect each."""
    work = (workdir or Path(tempfile.mkdtemp(prefix="joblease-demo-"))).resolve()
    try:
        report = demo.run_demo(partitions=partitions, workdir=work, timeout_s=timeout_s)
        click.echo()
        click.echo(report.table())
        click.echo("\n" + explain(report))
        click.echo("\n" + demo.time_summary(report.phases))
        if report.ok:
            click.echo(f"OK: one effect per partition ({report.effects}/{report.partitions}).")
        else:
            raise click.ClickException(
                f"invariant FAILED: expected {partitions} partitions done (won + reclaimed), one killed run "
                f"redone, {partitions} outbox rows and {partitions} effects; see {work}"
            )
        if keep:
            click.echo(
                f"\nKept {work}. To see these runs in the Dagster UI (a receiver included), run:\n"
                f"  {ui_command(work)}\n"
                f"and open http://127.0.0.1:3000{RUNS_VIEW} (the Runs page, runs within backfills shown)."
            )
    finally:
        if not keep:
            shutil.rmtree(work, ignore_errors=True)


if __name__ == "__main__":
    demo_command.main(prog_name="joblease demo")
