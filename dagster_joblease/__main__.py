"""``python -m dagster_joblease`` runs the ``joblease`` operator CLI."""

from __future__ import annotations

from dagster_joblease.cli import main

if __name__ == "__main__":
    main(prog_name="joblease")
