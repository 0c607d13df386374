"""The jobs of the Components location (the same definitions as the plain-Python location's)."""

from tests.dagster import jobs

not_run_after_job = jobs.not_run_after_job()
not_run_before_job = jobs.not_run_before_job()
