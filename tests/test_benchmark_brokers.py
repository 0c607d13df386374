"""benchmarks/brokers.py measures, small: both transports, both sides, and the latency run (the figures
themselves are never asserted: speed is measured in benchmarks/, not tested)."""

from __future__ import annotations

import re
import subprocess
import sys
from pathlib import Path

import pytest

from tests.brokers import AMQP_URL_ENV, DEFAULT_AMQP_URL, DEFAULT_NATS_URL, NATS_URL_ENV, broker_url

ROOT = Path(__file__).resolve().parent.parent


def test_the_broker_benchmark_measures_both_transports_small() -> None:
    pytest.importorskip("nats")
    pytest.importorskip("aio_pika")
    broker_url(NATS_URL_ENV, DEFAULT_NATS_URL, "NATS (JetStream)")
    broker_url(AMQP_URL_ENV, DEFAULT_AMQP_URL, "RabbitMQ")
    args = ["--rows", "40", "--rounds", "1", "--processes", "1", "--rate", "20", "--latency-seconds", "1"]
    done = subprocess.run(
        [sys.executable, str(ROOT / "benchmarks" / "brokers.py"), *args],
        capture_output=True,
        text=True,
        timeout=280,
        check=False,
    )
    assert done.returncode == 0, done.stderr[-3000:]
    for transport in ("jetstream", "rabbitmq"):
        assert re.search(rf"^{transport}, 1 process\(es\) .* ratio [0-9.]+ ", done.stdout, re.M), done.stdout
        assert re.search(rf"^{transport}: enqueue-to-consumer .* p50 [0-9.]+ ms, p99 ", done.stdout, re.M)
