"""The scaffolder of the delivery Component: ``dg scaffold defs`` writes its ``defs.yaml``."""

from dagster_joblease.dagster.components.shared import _TemplateScaffolder


class _DeliveryScaffolder(_TemplateScaffolder):
    template = """
        resource_key: joblease
        routes:
          billing.daily:
            # Read when a run or tick starts; `url` is the default when the variable is unset.
            url_env: BILLING_API_URL
            url: http://127.0.0.1:8765/billing.daily
            # header -> NAME of the environment variable holding its value (never the value)
            secret_headers: {}
            timeout_s: 10
        dispatcher:
          name: outbox_dispatch_job
        sensor:
          name: outbox_dispatch_sensor
          # Stopped: turn it on (UI > Automation, or `running` here) once the route's URL answers, e.g.
          # after `joblease receiver` (the reference receiver on 127.0.0.1:8765) or your own API is up.
          default_status: stopped
        checks:
          stale_due_ms: 300000
        """
