"""Acceptance test of issue 8: two real Dagster deployments, one joblease database, every failure at once.

Two deployments (each its own ``DAGSTER_HOME`` on its own dagster-postgres database, QueuedRunCoordinator,
run retries on, a real ``dagster-daemon run``) load the same leased job from
``tests/dagster/acceptance_location.py``; its lease code and outbox live in ONE shared joblease database,
and the reference receiver (its own process, its own database) is the downstream. The test drives:

- the schedule on in both deployments (every minute it requests the last complete daily partition);
- two overlapping backfills: K1-K3 in deployment a (GraphQL, as the UI launches it) and K2-K4 in
  deployment b (``dagster job backfill``);
- a UI-style re-execution (GraphQL ``launchRunReexecution``) of a winning run;
- a run that fails once (K3's first lease attempt raises);
- SIGKILL of the process holding K1's lease (found through the lease row's holder).

It then waits (polling, with timeouts) until both deployments are quiet and asserts: every partition has
exactly one effect per topic downstream; no outbox row is PENDING or DEAD and no lease is RUNNING or FAIL;
K1 recovered with no manual action before the killed holder's lease would have expired (the time it took
is printed); and the run tags tell the truth (one winner per partition, skips name it, the killed run and
the re-execution do not claim to have won).
"""

from __future__ import annotations

import collections
import contextlib
import datetime as dt
import json
import os
import signal
import time
import uuid
from collections.abc import Iterator
from pathlib import Path
from typing import Any

import dagster as dg
import pytest
import sqlalchemy as sa
from dagster._core.scheduler.instigation import InstigatorType, TickStatus

from dagster_joblease.dagster.ops import step_records
from dagster_joblease.receiver import app as receiver_app
from dagster_joblease.storage import create_engine
from dagster_joblease.storage.schema import lease_table, outbox_table
from tests.conftest import _admin_execute, clone_template
from tests.dagster import acceptance_location as loc
from tests.dagster.acceptance_harness import (
    RUN_ID,
    Deployment,
    descendants,
    fresh_database,
    run_line,
    screenshot,
    table_dump,
    wait_for,
)
from tests.receiver_proc import start_receiver

TAG_OUTCOME = "joblease/outcome"
TAG_WINNER = "joblease/winner"
WINNING = ("won", "reclaimed")
SKIPPED = "skipped-succeeded"
UNFINISHED = [
    dg.DagsterRunStatus.QUEUED,
    dg.DagsterRunStatus.NOT_STARTED,
    dg.DagsterRunStatus.STARTING,
    dg.DagsterRunStatus.STARTED,
    dg.DagsterRunStatus.CANCELING,
]
#: Bounds for the waits (generous: the machine is shared). None of them is asserted as a timing.
#: Set to a directory (e.g. docs/img) to save screenshots of deployment a's UI after a passing run.
SCREENSHOTS_ENV = "JOBLEASE_ACCEPT_SCREENSHOTS"
START_TIMEOUT_S = 300.0  # a `dagster` CLI start took over 120 s at load 15 on 2 cores
CONVERGE_TIMEOUT_S = 300.0

BACKFILL = """
mutation($params: LaunchBackfillParams!) {
  launchPartitionBackfill(backfillParams: $params) {
    __typename
    ... on LaunchBackfillSuccess { backfillId }
    ... on PythonError { message stack }
  }
}"""
REEXECUTE = """
mutation($params: ReexecutionParams!) {
  launchRunReexecution(reexecutionParams: $params) {
    __typename
    ... on LaunchRunSuccess { run { runId } }
    ... on PythonError { message stack }
  }
}"""


@contextlib.contextmanager
def cloned_joblease_db(template: str) -> Iterator[str]:
    """A copy of the migrated template: the ONE joblease database both deployments share."""
    name = f"accept_jl_{uuid.uuid4().hex[:10]}"
    try:
        yield clone_template(template, name)
    finally:
        _admin_execute(f'DROP DATABASE IF EXISTS "{name}" WITH (FORCE)')


class Scenario:
    """The running system and what the test recorded while driving it."""

    def __init__(
        self, a: Deployment, b: Deployment, engine: sa.Engine, receiver_engine: sa.Engine, keys: list[str]
    ) -> None:
        self.a, self.b = a, b
        self.deployments = (a, b)
        self.engine = engine
        self.receiver_engine = receiver_engine
        self.keys = keys
        self.killed: dict[str, Any] = {}
        self.reexecution: dict[str, str] = {}
        self.backfills: dict[str, str] = {}

    # -- reading the state ---------------------------------------------------------------------------

    def job_runs(self) -> list[tuple[Deployment, dg.DagsterRun]]:
        return [(d, r) for d in self.deployments for r in d.runs(loc.JOB_NAME)]

    def unfinished(self) -> list[dg.DagsterRun]:
        return [r for d in self.deployments for r in d.instance.get_runs(dg.RunsFilter(statuses=UNFINISHED))]

    def leases(self) -> dict[str, Any]:
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(lease_table).where(lease_table.c.code == loc.CODE)).all()
        return {r.run_key: r for r in rows}

    def outbox_statuses(self) -> collections.Counter[str]:
        with self.engine.connect() as conn:
            rows = conn.execute(sa.select(outbox_table.c.status)).scalars().all()
        return collections.Counter(rows)

    def effects(self) -> dict[str, collections.Counter[str]]:
        """Per topic: how many effects the receiver applied for each partition."""
        per_topic: dict[str, collections.Counter[str]] = collections.defaultdict(collections.Counter)
        for _key, topic, payload in receiver_app.effects(self.receiver_engine):
            per_topic[topic][json.loads(payload)["partition"]] += 1
        return per_topic

    def expected_partitions(self) -> set[str]:
        """K1-K4, plus whatever partition a schedule tick asked for (a later day if midnight passed)."""
        tagged = {r.tags.get("dagster/partition") for _d, r in self.job_runs()}
        return set(self.keys) | {p for p in tagged if p}

    def db_now(self) -> dt.datetime:
        with self.engine.connect() as conn:
            now: dt.datetime = conn.execute(sa.select(sa.func.now())).scalar_one()
        return now

    # -- driving it -----------------------------------------------------------------------------------

    def holder_pid(self, holder: str) -> tuple[Deployment, int]:
        """The process holding a lease: via the Dagster run named in the holder, else its ``host:pid``."""
        match = RUN_ID.search(holder)
        if match:
            for deployment in self.deployments:
                if deployment.instance.get_run_by_id(match.group(0)) is not None:
                    pid = deployment.run_pid(match.group(0))
                    if pid is not None:
                        return deployment, pid
        _host, _, pid_text = holder.rpartition(":")
        if pid_text.isdigit():
            for deployment in self.deployments:
                assert deployment.daemon is not None
                if int(pid_text) in descendants(deployment.daemon.pid):
                    return deployment, int(pid_text)
        raise AssertionError(f"cannot find the process of lease holder {holder!r}")

    def kill_slow_holder(self) -> None:
        """SIGKILL the process holding K1's lease (its first attempt blocks until then)."""
        key = self.keys[0]  # ACCEPT_SLOW_KEY

        def held() -> Any:
            row = self.leases().get(key)
            return row if row is not None and row.status == "RUNNING" and row.attempt == 1 else None

        row = wait_for(f"partition {key}'s first attempt to hold its lease", held, START_TIMEOUT_S)
        deployment, pid = wait_for(
            f"the process of lease holder {row.holder!r}", lambda: self._try_holder(row.holder), 60
        )
        assert deployment.daemon is not None
        assert pid in descendants(deployment.daemon.pid), f"pid {pid} is not a run worker of this test"
        run_ids = {r.run_id for r in deployment.runs(loc.JOB_NAME) if deployment.run_pid(r.run_id) == pid}
        killed_at = self.db_now()
        os.kill(pid, signal.SIGKILL)
        self.killed = {
            "deployment": deployment.label,
            "pid": pid,
            "holder": row.holder,
            "run_ids": run_ids,
            "attempt": row.attempt,
            "expires_at": row.expires_at,
            "killed_at": killed_at,
        }
        print(
            f"SIGKILLed pid {pid} (deployment {deployment.label}, run(s) {sorted(run_ids)}), holder "
            f"{row.holder!r} of {key}; its lease would expire at {row.expires_at} (db now {killed_at})"
        )

    def _try_holder(self, holder: str) -> tuple[Deployment, int] | None:
        try:
            return self.holder_pid(holder)
        except AssertionError:
            return None

    def launch_backfill_a(self, keys: list[str]) -> None:
        data = self.a.graphql(
            BACKFILL,
            {
                "params": {
                    "selector": {
                        "partitionSetName": f"{loc.JOB_NAME}_partition_set",
                        "repositorySelector": {
                            "repositoryLocationName": self.a.location,
                            "repositoryName": "__repository__",
                        },
                    },
                    "partitionNames": keys,
                }
            },
        )["launchPartitionBackfill"]
        assert data["__typename"] == "LaunchBackfillSuccess", data
        self.backfills["a"] = data["backfillId"]

    def reexecute_in_a(self) -> None:
        """Re-execute, as the UI's "Re-execute all" does, a finished run of deployment a (a winner if any).

        Dagster copies the parent's tags, ``joblease/outcome`` included; the re-execution must end up
        saying what it did itself (a skip: the partition is done).
        """

        def finished() -> list[dg.DagsterRun]:
            return [r for r in self.a.runs(loc.JOB_NAME) if r.status == dg.DagsterRunStatus.SUCCESS]

        done = wait_for("a successful run in deployment a", finished, START_TIMEOUT_S)
        winners = [r for r in done if r.tags.get(TAG_OUTCOME) in WINNING]
        parent = (winners or done)[0]
        data = self.a.graphql(REEXECUTE, {"params": {"parentRunId": parent.run_id, "strategy": "ALL_STEPS"}})[
            "launchRunReexecution"
        ]
        assert data["__typename"] == "LaunchRunSuccess", data
        self.reexecution = {"parent": parent.run_id, "run": data["run"]["runId"]}
        print(
            f"re-executed {parent.run_id} ({parent.tags.get('dagster/partition')}, outcome "
            f"{parent.tags.get(TAG_OUTCOME)}) as {self.reexecution['run']}"
        )

    def converged(self) -> bool:
        statuses = self.outbox_statuses()
        if statuses.get("DEAD"):
            raise AssertionError(f"outbox rows were dead-lettered: {dict(statuses)}")
        if self.unfinished() or statuses.get("PENDING"):
            return False
        leases = self.leases()
        expected = self.expected_partitions()
        if any(k not in leases or leases[k].status != "SUCCESS" for k in expected):
            return False
        effects = self.effects()
        return all(effects[t][k] >= 1 for t in (loc.EFFECT_TOPIC, loc.AUDIT_TOPIC) for k in expected)

    # -- diagnostics ------------------------------------------------------------------------------------

    def diagnostics(self) -> str:
        parts = []
        for d in self.deployments:
            parts.append(f"===== deployment {d.label}: runs")
            for run in d.runs():
                parts.append(run_line(run))
                if run.status == dg.DagsterRunStatus.FAILURE:
                    parts += [f"      {line}" for line in failure_messages(d, run.run_id)]
            for proc in (d.daemon, d.webserver):
                if proc is not None:
                    parts.append(f"===== {proc.name} log (last lines)\n{proc.tail(150)}")
        parts.append("===== joblease_lease")
        parts.append(
            table_dump(
                self.engine,
                lease_table,
                [
                    "run_key",
                    "status",
                    "attempt",
                    "holder",
                    "heartbeat_at",
                    "expires_at",
                    "finished_at",
                    "last_error",
                ],
            )
        )
        parts.append("===== joblease_outbox")
        parts.append(
            table_dump(
                self.engine,
                outbox_table,
                ["id", "topic", "status", "attempts", "last_status", "last_error", "payload"],
            )
        )
        parts.append(f"===== receiver effects: {dict(self.effects())}")
        parts.append(f"===== killed: {self.killed}; re-execution: {self.reexecution}")
        return "\n".join(parts)


def failure_messages(deployment: Deployment, run_id: str) -> list[str]:
    records = deployment.instance.get_records_for_run(run_id, limit=500).records
    wanted = {"STEP_FAILURE", "RUN_FAILURE", "ENGINE_EVENT"}
    lines = []
    for record in records:
        entry = record.event_log_entry
        if entry.dagster_event is None or entry.dagster_event.event_type_value not in wanted:
            continue
        text = entry.dagster_event.message or entry.user_message or ""
        message = text.splitlines()[0][:200] if text else ""
        error = getattr(entry.dagster_event.event_specific_data, "error", None)
        if error is not None:
            message += f" | {str(error.message).splitlines()[0][:200]}"
        lines.append(f"{entry.dagster_event.event_type_value}: {message}")
    return lines[-6:]


def finish(procs: dict[str, Any]) -> None:
    for what, proc in procs.items():
        out, _ = proc.communicate(timeout=START_TIMEOUT_S)
        assert proc.returncode == 0, f"{what} failed (exit {proc.returncode}):\n{out}"


@pytest.mark.chaos
@pytest.mark.timeout(1500)
def test_two_deployments_every_partition_one_effect(pg_template: str, tmp_path: Path) -> None:
    started = time.monotonic()
    today = dt.datetime.now(dt.UTC).date()
    keys = [(today - dt.timedelta(days=n)).isoformat() for n in (4, 3, 2, 1)]
    k1, k2, k3, k4 = keys
    with contextlib.ExitStack() as stack:
        joblease_url = stack.enter_context(cloned_joblease_db(pg_template))
        receiver_url = stack.enter_context(fresh_database("accept_recv"))
        storage_a = stack.enter_context(fresh_database("accept_dg_a"))
        storage_b = stack.enter_context(fresh_database("accept_dg_b"))
        receiver = stack.enter_context(start_receiver(receiver_url))
        env = {
            **os.environ,
            "JOBLEASE_DATABASE_URL": joblease_url,
            "ACCEPT_START_DATE": k1,
            "ACCEPT_SLOW_KEY": k1,
            "ACCEPT_FAIL_KEY": k3,
            "ACCEPT_RECEIVER_URL": receiver.url,
            "PYTHONWARNINGS": "ignore",
            "DAGSTER_DISABLE_TELEMETRY": "1",
        }
        a = Deployment.create("a", tmp_path / "home_a", storage_a, env)
        stack.callback(a.stop)
        b = Deployment.create("b", tmp_path / "home_b", storage_b, env)
        stack.callback(b.stop)
        engine = create_engine(joblease_url)
        stack.callback(engine.dispose)
        receiver_engine = create_engine(receiver_url)
        stack.callback(receiver_engine.dispose)
        s = Scenario(a, b, engine, receiver_engine, keys)
        try:
            a.start_daemon()
            b.start_daemon()
            a.start_webserver()
            # The schedule on in both deployments; b's backfill (K2-K4) from the CLI, queued at once.
            finish(
                {
                    "schedule start a": a.cli("schedule", "start", loc.SCHEDULE_NAME),
                    "schedule start b": b.cli("schedule", "start", loc.SCHEDULE_NAME),
                    "backfill b": b.cli(
                        "job", "backfill", "-j", loc.JOB_NAME, "--partitions", f"{k2},{k3},{k4}", "--noprompt"
                    ),
                }
            )
            wait_for("both daemons to heartbeat", lambda: a.daemons_alive() and b.daemons_alive(), 120)
            wait_for("webserver a to load its code location", a.webserver_ready, START_TIMEOUT_S, 1.0)
            s.launch_backfill_a([k1, k2, k3])  # overlaps b's on K2 and K3, as the UI launches it
            s.kill_slow_holder()
            s.reexecute_in_a()

            def ticked(d: Deployment) -> bool:
                """A run the schedule launched, or a tick that launched nothing because a run of this
                deployment had already done its day (it skips naming that run, issue 31 item 5)."""
                if any("dagster/schedule_name" in r.tags for r in d.runs(loc.JOB_NAME)):
                    return True
                for state in d.instance.all_instigator_state(instigator_type=InstigatorType.SCHEDULE):
                    ticks = d.instance.get_ticks(
                        state.instigator_origin_id, state.selector_id, limit=50, statuses=[TickStatus.SKIPPED]
                    )
                    if any((t.skip_reason or "").startswith("skipped: ") for t in ticks):
                        return True
                return False

            wait_for("a schedule tick in both deployments", lambda: ticked(a) and ticked(b), 150, 1.0)
            finish(
                {
                    "schedule stop a": a.cli("schedule", "stop", loc.SCHEDULE_NAME),
                    "schedule stop b": b.cli("schedule", "stop", loc.SCHEDULE_NAME),
                }
            )
            wait_for("both deployments to converge", s.converged, CONVERGE_TIMEOUT_S, 1.0)
            shots = os.environ.get(SCREENSHOTS_ENV)
            if shots:
                take_screenshots(s, Path(shots))
            check_outcome(s)
        except BaseException:
            print(s.diagnostics())
            raise
        print(f"acceptance scenario took {time.monotonic() - started:.0f} s in total")


def check_outcome(s: Scenario) -> None:
    expected = s.expected_partitions()
    leases = s.leases()

    # Every partition: exactly one effect per topic downstream.
    effects = s.effects()
    for topic in (loc.EFFECT_TOPIC, loc.AUDIT_TOPIC):
        assert dict(effects[topic]) == dict.fromkeys(sorted(expected), 1), (topic, dict(effects[topic]))

    # Nothing left PENDING, DEAD or RUNNING (nor FAIL: every partition's lease finished successfully).
    assert set(s.outbox_statuses()) == {"SENT"}, s.outbox_statuses()
    assert {k: r.status for k, r in leases.items()} == dict.fromkeys(expected, "SUCCESS")
    assert not s.unfinished()

    # K1 recovered by itself, before the dead holder's lease would have expired.
    slow_key = s.keys[0]
    recovered = leases[slow_key]
    assert recovered.attempt > s.killed["attempt"]
    assert recovered.finished_at < s.killed["expires_at"], (recovered.finished_at, s.killed)
    took = (recovered.finished_at - s.killed["killed_at"]).total_seconds()
    lease_len = (s.killed["expires_at"] - s.killed["killed_at"]).total_seconds()
    print(
        f"RECOVERY: partition {slow_key} was done {took:.1f} s after its holder was SIGKILLed "
        f"(attempt {recovered.attempt}, holder {recovered.holder!r}); the dead lease had {lease_len:.0f} s "
        "left"
    )

    # The run tags tell the truth, across both deployments.
    runs = s.job_runs()
    by_id = {r.run_id: r for _d, r in runs}
    winners: dict[str, list[str]] = collections.defaultdict(list)
    for _d, run in runs:
        if run.status == dg.DagsterRunStatus.SUCCESS and run.tags.get(TAG_OUTCOME) in WINNING:
            winners[run.tags["dagster/partition"]].append(run.run_id)
    assert {k: len(v) for k, v in winners.items()} == dict.fromkeys(expected, 1), dict(winners)
    for d, run in runs:
        outcome = run.tags.get(TAG_OUTCOME)
        partition = run.tags.get("dagster/partition")
        if run.status == dg.DagsterRunStatus.SUCCESS and outcome not in WINNING:
            assert outcome == SKIPPED, (d.label, run.run_id, run.tags)
            assert run.tags.get(TAG_WINNER) == winners[partition][0], (d.label, run.run_id, run.tags)
        if run.status != dg.DagsterRunStatus.SUCCESS:
            assert outcome not in (*WINNING, SKIPPED), (d.label, run.run_id, run.status, run.tags)
    reexecuted = by_id[s.reexecution["run"]]
    assert reexecuted.status == dg.DagsterRunStatus.SUCCESS
    assert reexecuted.tags.get(TAG_OUTCOME) == SKIPPED, reexecuted.tags

    counts = collections.Counter((d.label, r.status.value, r.tags.get(TAG_OUTCOME, "-")) for d, r in runs)
    print("runs of", loc.JOB_NAME, "by (deployment, status, outcome):")
    for key, n in sorted(counts.items()):
        print("  ", key, n)

    # The killed run failed, and (issue 8, item 5) says which attempt it was and why it did not finish.
    by_deployment = {r.run_id: d for d, r in runs}
    for run_id in s.killed["run_ids"]:
        killed = by_id[run_id]
        assert killed.status == dg.DagsterRunStatus.FAILURE, killed
        assert killed.tags.get(TAG_OUTCOME) in ("lost", "failed"), killed.tags
        (record,) = step_records(by_deployment[run_id].instance, run_id).values()
        assert record.get("joblease/attempt") == s.killed["attempt"], record
        assert record.get("joblease/error", "none") != "none", record


def take_screenshots(s: Scenario, directory: Path) -> None:
    """The runs page and backfill a's page once everything converged, with the outcome tags in view.

    The runs table shows every pinned tag; like a person clicking "Hide tag", the screenshots hide the
    other ``joblease/*`` tags so each row shows its partition, outcome and winner.
    """
    url = s.a.webserver_url
    assert url is not None
    keep = {TAG_OUTCOME, TAG_WINNER}
    noisy = sorted({k for _d, r in s.job_runs() for k in r.tags if k.startswith("joblease/")} - keep)
    prefs = {"unpinned-tags": noisy}
    shows = ["skipped-succeeded", "joblease/outcome: "]
    screenshot(
        f"{url}/runs?view=runs&q%5B0%5D=job%3A{loc.JOB_NAME}",
        directory / "dagster-runs.png",
        shows=shows,
        local_storage=prefs,
    )
    screenshot(
        f"{url}/runs/b/{s.backfills['a']}?tab=runs",
        directory / "dagster-backfill.png",
        shows=shows,
        local_storage=prefs,
    )
    print(f"screenshots saved under {directory}")
