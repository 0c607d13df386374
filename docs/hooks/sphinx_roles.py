"""Griffe extension: the package's docstrings are written with Sphinx roles (``:class:`X```,
``:func:`~a.b.c```, ``:meth:``, ``:attr:``, ``:mod:``, ``:exc:``, ``:data:``, ``:obj:``) and reST literal
blocks (``Example::`` and an indented block). mkdocstrings renders Markdown, so they would show raw; this
rewrites them when the docs are built (``mkdocs.yml`` loads it under the handler's ``extensions``), leaving
the sources alone:

- a role becomes an optional autorefs link to the object, its name resolved in the docstring's own scope
  (``~`` shows the last part only): a link where the object is documented, plain code where it is not;
- ``text::`` and its indented block become ``text:`` and a fenced block (``python`` when it parses as
  Python, else ``text``).

``docs/hooks/raw_markup.py`` fails the build if any role is left in a rendered page.
"""

from __future__ import annotations

import ast
import html
import re
import textwrap
from typing import Any

import griffe

ROLE = re.compile(r":(?:py:)?(?P<role>class|func|meth|attr|mod|exc|data|obj):`(?P<target>[^`]+)`")


def _resolve(obj: griffe.Object, target: str) -> str:
    """The full path of ``target`` as the docstring of ``obj`` means it (best effort)."""
    head = target.split(".", 1)[0]
    for scope in (obj, *_parents(obj)):
        try:
            resolved = scope.resolve(head)
        except Exception:  # griffe.NameResolutionError and friends: try the next scope
            continue
        return resolved + target[len(head) :]
    if isinstance(obj, griffe.Class) or obj.parent is not None:
        owner = obj if isinstance(obj, griffe.Class) else obj.parent
        if owner is not None and head in owner.members:
            return f"{owner.path}.{target}"
    return target


def _parents(obj: griffe.Object) -> list[griffe.Object]:
    out: list[griffe.Object] = []
    parent = obj.parent
    while parent is not None:
        out.append(parent)
        parent = parent.parent
    return out


def render_roles(text: str, obj: griffe.Object) -> str:
    def link(match: re.Match[str]) -> str:
        target = match["target"].strip()
        short = target.startswith("~")
        target = target.lstrip("~.")
        shown = target.rsplit(".", 1)[-1] if short else target
        if match["role"] in ("func", "meth") and not shown.endswith(")"):
            shown += "()"
        identifier = html.escape(_resolve(obj, target), quote=True)
        return f'<autoref identifier="{identifier}" optional><code>{html.escape(shown)}</code></autoref>'

    return ROLE.sub(link, text)


def _language(code: str) -> str:
    try:
        ast.parse(code)
    except SyntaxError:
        return "text"
    return "python"


def render_literal_blocks(text: str) -> str:
    """``para::`` + blank line + indented block → ``para:`` + a fenced block (reST's literal block)."""
    lines = text.split("\n")
    out: list[str] = []
    i = 0
    while i < len(lines):
        line = lines[i]
        if line.rstrip().endswith("::") and not line.rstrip().endswith(":::"):
            indent = len(line) - len(line.lstrip())
            j = i + 1
            while j < len(lines) and not lines[j].strip():
                j += 1
            block_end = j
            while block_end < len(lines) and (
                not lines[block_end].strip()
                or len(lines[block_end]) - len(lines[block_end].lstrip()) > indent
            ):
                block_end += 1
            if j < len(lines) and block_end > j:
                while block_end > j and not lines[block_end - 1].strip():
                    block_end -= 1
                code = textwrap.dedent("\n".join(lines[j:block_end]))
                stem = line.rstrip()[:-2].rstrip()
                pad = " " * indent
                if stem.strip():
                    out += [stem + ":", ""]
                out += [f"{pad}```{_language(code)}", *(pad + c if c else c for c in code.split("\n"))]
                out += [f"{pad}```"]
                i = block_end
                continue
        out.append(line)
        i += 1
    return "\n".join(out)


class SphinxRoles(griffe.Extension):
    """Rewrite every docstring of the loaded package once it is loaded."""

    def on_package(self, *, pkg: griffe.Module, **kwargs: Any) -> None:
        seen: set[int] = set()
        self._walk(pkg, seen)

    def _walk(self, obj: griffe.Object, seen: set[int]) -> None:
        if id(obj) in seen:
            return
        seen.add(id(obj))
        if obj.docstring is not None:
            value = render_literal_blocks(obj.docstring.value)
            obj.docstring.value = render_roles(value, obj)
            obj.docstring.__dict__.pop("parsed", None)  # a cached parse of the old text, if any
        for member in obj.members.values():
            if not member.is_alias:
                self._walk(member, seen)  # type: ignore[arg-type]
