"""``python -m dagster_joblease.receiver``: run the reference receiver."""

from __future__ import annotations

from dagster_joblease.cli.receiver import receiver_command

if __name__ == "__main__":
    receiver_command(prog_name="python -m dagster_joblease.receiver")
