"""The scaffolder of the reconciliation Component: ``dg scaffold defs`` writes its ``defs.yaml``."""

from dagster_joblease.dagster.components.shared import _TemplateScaffolder


class _ReconcileScaffolder(_TemplateScaffolder):
    template = """
        target:
          defs_path: billing.py
          job: daily_billing_job       # or `asset: billing_day` for a @leased_asset
        code: daily-billing
        resource_key: joblease
        lookback_seconds: 604800       # 7 days
        max_relaunches: 5
        default_status: running
        """
