"""The scaffolder of the resource Component: ``dg scaffold defs`` writes its ``defs.yaml``."""

from dagster_joblease.dagster.components.shared import _TemplateScaffolder


class _ResourceScaffolder(_TemplateScaffolder):
    template = """
        # The joblease resource, declared once per code location; other components name it by key.
        resource_key: joblease
        # The NAME of the variable holding the URL (postgresql+psycopg://... or sqlite:///...), never the
        # URL: it may carry a password. JOBLEASE_DATABASE_URL unset: an SQLite file under $DAGSTER_HOME.
        database_url_env: JOBLEASE_DATABASE_URL
        # The three run-status sensors that rewrite the joblease/* tags a re-execution copied from its
        # parent to not-run when its leased step never ran. Keep them on unless this location's Python
        # code calls build_not_run_sensors() itself (Dagster refuses two sensors of one name).
        not_run_sensors: true
        """
