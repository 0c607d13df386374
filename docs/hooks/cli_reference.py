"""MkDocs hook: the command line reference page is generated from the ``joblease`` click group itself, so
it cannot drift from the code (``mkdocs.yml`` loads it under ``hooks:``)."""

from __future__ import annotations

from typing import Any

import click

MARKER = "<!-- joblease-cli -->"


def _sections(command: click.Command, path: list[str], level: int) -> list[str]:
    ctx = click.Context(command, info_name=" ".join(path), terminal_width=100, max_content_width=100)
    title = "#" * level + " `" + " ".join(path) + "`"
    out = [title, "", "```text", command.get_help(ctx), "```", ""]
    if isinstance(command, click.Group):
        for name in command.list_commands(ctx):
            sub = command.get_command(ctx, name)
            if sub is not None and not sub.hidden:
                out += _sections(sub, [*path, name], min(level + 1, 4))
    return out


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    if MARKER not in markdown:
        return markdown
    from dagster_joblease.cli import main

    return markdown.replace(MARKER, "\n".join(_sections(main, ["joblease"], 2)))
