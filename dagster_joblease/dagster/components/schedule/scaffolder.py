"""The scaffolder of the schedule Component: ``dg scaffold defs`` writes its ``defs.yaml``."""

from dagster_joblease.dagster.components.shared import _TemplateScaffolder


class _ScheduleScaffolder(_TemplateScaffolder):
    template = """
        # The job (or leased asset) this schedule launches: a path relative to the defs folder, and its name.
        target:
          defs_path: billing.py
          job: daily_billing_job
        code: daily-billing          # the lease code of the job's @leased_op
        cron_schedule: "0 2 * * *"   # default: the partitions' own cadence
        default_status: stopped
        """
