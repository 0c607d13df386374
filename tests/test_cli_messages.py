"""Whole messages of the CLI and the Dagster resource: secrets redacted without garbling the advice, one
option form naming a lease on `leases show` and `leases fail`, near-match hints, and an unreachable
database named with its resource and variable."""

from __future__ import annotations

import socket
from pathlib import Path

import dagster as dg
import pytest
from click.testing import CliRunner, Result

from dagster_joblease import JobIdentity, LeaseService, cli, create_engine, identity, migrate
from dagster_joblease.storage import engine as storage_engine
from dagster_joblease.testing import expire_now


def run(url: str | None, *args: str) -> Result:
    prefix = [] if url is None else ["--database-url", url]
    return CliRunner().invoke(cli.main, [*prefix, *args], catch_exceptions=False)


def closed_port() -> int:
    with socket.socket() as sock:
        sock.bind(("127.0.0.1", 0))
        port: int = sock.getsockname()[1]
    return port


def test_an_unencoded_at_in_the_password_leaves_the_advice_readable() -> None:
    result = run("postgresql://app:p@ss@db/app", "leases", "list")
    assert result.exit_code == 2
    assert result.output == (
        "Error: the database URL cannot be split safely into credentials and host: its user name or password "
        "seems to hold an unencoded '@' (with '/', '#' or '?' after it), so part of the password would be "
        "taken for the host or the database. Percent-encode the user name and password, e.g. "
        "urllib.parse.quote(password, safe='') ('@' → %40, '/' → %2F, '#' → %23, '?' → %3F); an '@' in the "
        "database name as %40. Nothing of the URL is shown here.\n"
    )


def test_a_bare_file_name_is_not_a_secret() -> None:
    result = run("joblease.sqlite", "leases", "list")
    assert result.exit_code == 2
    assert result.output == (
        "Error: the database URL could not be parsed; expected e.g. postgresql+psycopg://user@host:5432/db "
        "or sqlite:///path/to/joblease.sqlite (percent-encode special characters in the password)\n"
    )


def test_scrub_secrets_redacts_the_password_and_the_url_not_every_short_string() -> None:
    url = "postgresql+psycopg://app:sekret@db.internal:5432/app"
    text = f"boom at {url}: password authentication failed (password sekret); split safely"
    assert storage_engine.scrub_secrets(text, url) == (
        "boom at postgresql+psycopg://app:***@db.internal:5432/app: password authentication failed "
        "(password ***); split safely"
    )
    # The one-letter fragment a mis-parse of `p@ss@db` yields is redacted only where it stands alone.
    ambiguous = "postgresql://app:p@ss@db/app"
    assert storage_engine.scrub_secrets("host 'ss@db': p is wrong; urllib.parse.quote", ambiguous) == (
        "host '***': *** is wrong; urllib.parse.quote"
    )
    assert storage_engine.scrub_secrets("sqlite:///path/to/joblease.sqlite", "joblease.sqlite") == (
        "sqlite:///path/to/joblease.sqlite"
    )


@pytest.fixture
def url(tmp_path: Path) -> str:
    url = f"sqlite:///{tmp_path / 'j.sqlite'}"
    engine = create_engine(url)
    migrate(engine)
    service = LeaseService(engine)
    for day in ("2024-01-02", "2024-01-03", "2024-01-20"):
        service.run_exclusive(JobIdentity.schedule("daily-billing", day), lambda lease: None)
    service.run_exclusive(JobIdentity.initial("seed-settings"), lambda lease: None)
    # A dead holder's lease: RUNNING and already expired on the database clock.
    stuck = JobIdentity.schedule("daily-billing", "2024-01-04")
    service.acquire(stuck)
    expire_now(service, stuck)
    engine.dispose()
    return url


def _key(code: str, run_key: str | None) -> str:
    return identity.idempotency_key("SCHEDULE" if run_key else "INITIAL", code, run_key)


def test_leases_fail_takes_the_options_leases_show_takes(url: str) -> None:
    shown = run(url, "leases", "show", "--code", "daily-billing", "--run-key", "2024-01-04")
    assert shown.exit_code == 0 and "status        RUNNING" in shown.output
    failed = run(url, "leases", "fail", "--code", "daily-billing", "--run-key", "2024-01-04")
    assert failed.exit_code == 0, failed.output
    assert failed.output == (
        "lease 5 (daily-billing / 2024-01-04) is now FAIL: the next claim retries it as attempt 2 with key "
        f"{_key('daily-billing', '2024-01-04')}\n"
    )
    again = run(url, "leases", "fail", "--id", "5")
    assert again.output.startswith("lease 5 (daily-billing / 2024-01-04) was already FAIL")


def test_leases_fail_takes_code_and_run_key_positionally_as_leases_show_does(url: str) -> None:
    # `leases show daily-billing 2024-01-04` worked and `leases fail daily-billing 2024-01-04` was refused:
    # the two commands now take the same positional form (issue 31, finding 8).
    shown = run(url, "leases", "show", "daily-billing", "2024-01-04")
    assert shown.exit_code == 0 and "status        RUNNING" in shown.output
    result = run(url, "leases", "fail", "daily-billing", "2024-01-04")
    assert result.exit_code == 0, result.output
    assert result.output == (
        "lease 5 (daily-billing / 2024-01-04) is now FAIL: the next claim retries it as attempt 2 with key "
        f"{_key('daily-billing', '2024-01-04')}\n"
    )
    initial = run(url, "leases", "fail", "seed-settings")
    assert initial.exit_code == 1  # found, and refused as show would find it: a SUCCESS row
    assert "seed-settings" in initial.output and "SUCCESS" in initial.output, initial.output
    near = run(url, "leases", "fail", "daily-biling", "2024-01-04")
    assert near.exit_code == 1
    assert near.output.endswith("close matches: --code daily-billing --run-key 2024-01-04\n")
    for command in ("show", "fail"):
        lone = run(url, "leases", command, "2024-01-04")
        assert lone.exit_code == 2
        assert lone.output.endswith(
            "Error: '2024-01-04' looks like a run key (a date, a time or a number), not a job code. Give "
            f"its code too: `joblease leases {command} --code CODE --run-key 2024-01-04`; for an INITIAL job "
            "whose code really is '2024-01-04', `--code 2024-01-04`; for a lease id, `--id 2024-01-04`.\n"
        )
    mixed = run(url, "leases", "fail", "5", "daily-billing")
    assert mixed.exit_code == 2
    assert mixed.output.endswith(
        "Error: 'daily-billing' is neither a v2: key nor a numeric lease id: several positional arguments of "
        "`leases fail` are keys or ids; a run by its code is CODE [RUN_KEY] alone, or "
        "`--code CODE --run-key RUN_KEY`.\n"
    )
    both = run(url, "leases", "fail", "--id", "5", "--code", "daily-billing")
    assert both.exit_code == 2
    assert both.output.endswith(
        "Error: name the lease in exactly one way: --code CODE [--run-key RUN_KEY], --key KEY, --id N, "
        "KEY_OR_ID... or CODE [RUN_KEY] (got --code, --id)\n"
    )


def test_a_postgres_url_without_a_database_says_what_is_missing_and_the_form() -> None:
    port = closed_port()
    result = run(f"postgres://127.0.0.1:{port}", "leases", "list")
    assert result.exit_code == 2
    # It said "cannot connect to postgresql database None" and no more than "Check --database-url".
    assert result.output.startswith(
        f"Error: cannot connect to the PostgreSQL server 127.0.0.1:{port} (postgresql+psycopg; the URL names "
        "no database): "
    )
    assert result.output.endswith(
        "Name the database in --database-url / $JOBLEASE_DATABASE_URL: "
        "postgresql+psycopg://USER[:PASSWORD]@HOST[:PORT]/DATABASE.\n"
    )
    named = run(f"postgresql+psycopg://app:sekret@127.0.0.1:{port}/app", "leases", "list")
    assert named.exit_code == 2 and "sekret" not in named.output
    assert named.output.startswith(
        f"Error: cannot connect to the PostgreSQL database 'app' on 127.0.0.1:{port} (postgresql+psycopg): "
    )
    assert named.output.endswith(
        "Check that the server is up and that the host, port, user and database in --database-url / "
        "$JOBLEASE_DATABASE_URL are right (postgresql+psycopg://USER[:PASSWORD]@HOST[:PORT]/DATABASE).\n"
    )


def test_a_lease_repr_never_shows_its_owner_token(tmp_path: Path) -> None:
    engine = create_engine(f"sqlite:///{tmp_path / 'j.sqlite'}")
    migrate(engine)
    lease = LeaseService(engine).acquire(JobIdentity.schedule("daily-billing", "2024-01-02"))
    assert lease.owner_token and lease.owner_token not in repr(lease)
    assert "owner_token" not in repr(lease) and f"id={lease.id}" in repr(lease)


def test_no_lease_suggests_close_run_keys_and_codes(url: str) -> None:
    near_key = run(url, "leases", "show", "--code", "daily-billing", "--run-key", "2024-01-2")
    assert near_key.exit_code == 1
    assert near_key.output == (
        "Error: no lease for SCHEDULE run 'daily-billing' / '2024-01-2' (key "
        f"{_key('daily-billing', '2024-01-2')}); close matches: --code daily-billing --run-key 2024-01-20, "
        "--code daily-billing --run-key 2024-01-02, --code daily-billing --run-key 2024-01-04\n"
    )
    near_code = run(url, "leases", "fail", "--code", "daily-biling", "--run-key", "2024-01-04")
    assert near_code.exit_code == 1
    assert near_code.output == (
        "Error: no lease for SCHEDULE run 'daily-biling' / '2024-01-04' (key "
        f"{_key('daily-biling', '2024-01-04')}); close matches: --code daily-billing --run-key 2024-01-04\n"
    )
    near_initial = run(url, "leases", "show", "--code", "seed-setting")
    assert near_initial.output == (
        f"Error: no lease for INITIAL run 'seed-setting' (key {_key('seed-setting', None)}); close matches: "
        "--code seed-settings\n"
    )
    nothing = run(url, "leases", "show", "--code", "zzz", "--run-key", "1999")
    assert nothing.output == (
        f"Error: no lease for SCHEDULE run 'zzz' / '1999' (key {_key('zzz', '1999')}); list them with "
        "`joblease leases list --code CODE`\n"
    )


def test_an_unreachable_database_in_dagster_names_the_resource_and_the_variable(
    monkeypatch: pytest.MonkeyPatch,
) -> None:
    from dagster_joblease.dagster import JobLeaseResource, LeasedRun, leased_op

    @leased_op(code="x")
    def body(run: LeasedRun) -> None:
        raise AssertionError("the body must not run without a database")

    @dg.job
    def job() -> None:
        body()

    port = closed_port()
    monkeypatch.setenv("JOBLEASE_DATABASE_URL", f"postgresql+psycopg://app:sekret@127.0.0.1:{port}/app")
    with pytest.raises(Exception) as raised:
        job.execute_in_process(resources={"joblease": JobLeaseResource()})
    chain: list[BaseException] = []
    exc: BaseException | None = raised.value
    while exc is not None:
        chain.append(exc)
        exc = exc.__cause__ or exc.__context__
    messages = [str(e) for e in chain]
    assert any("resource_fn on ResourceDefinition joblease" in m for m in messages), messages
    (ours,) = [m for m in messages if m.startswith("JobLeaseResource")]
    prefix = (
        "JobLeaseResource cannot use the joblease database "
        f"(the PostgreSQL database 'app' on 127.0.0.1:{port} (postgresql+psycopg), "
        "the URL in $JOBLEASE_DATABASE_URL): database error while trying to read the joblease schema "
        "revision: connection failed: "
    )
    suffix = (
        ". Check $JOBLEASE_DATABASE_URL (or the resource's database_url) and that the database is reachable "
        "from here."
    )
    assert ours.startswith(prefix) and ours.endswith(suffix), ours
    assert "sekret" not in ours
    driver = ours[len(prefix) : -len(suffix)]
    assert f'connection to server at "127.0.0.1", port {port} failed: Connection refused' in driver
