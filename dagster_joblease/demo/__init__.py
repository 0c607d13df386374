"""``joblease demo``: the end-to-end demo and its packaged Dagster code location.

:mod:`~dagster_joblease.demo.runner` drives Dagster's own daemon through a backfill, a schedule tick and a
killed run; :mod:`~dagster_joblease.demo.location` is the code location it loads. They ship in the wheel (the
README's first command runs them) but live outside the library's layers: only ``joblease demo`` and
``joblease demo-ui`` import them, and nothing in the library imports this package.
"""
