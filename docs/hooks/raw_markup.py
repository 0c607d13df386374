"""MkDocs hook: the build fails if a rendered page still shows raw Sphinx markup (a role such as
``:class:`X``` or a reST literal block's ``Example::``), which ``docs/hooks/sphinx_roles.py`` should have
rendered. It reads each page's HTML as the reader gets it (tags stripped)."""

from __future__ import annotations

import html
import re
from typing import Any

from mkdocs.exceptions import PluginError

#: A role as it shows once Markdown has turned its backticks into code: ``:class:<code>X</code>``.
RAW_ROLE = re.compile(r":(?:py:)?(?:class|func|meth|attr|mod|exc|data|obj|ref):(?:`|<code>)")
RAW_LITERAL = re.compile(r"[A-Za-z)]::\s*</p>")
TAG = re.compile(r"<[^>]+>")


def raw_markup(page_html: str) -> list[str]:
    """Excerpts of ``page_html`` that show raw Sphinx markup (pure: tested in tests/test_docs.py)."""
    found = []
    for pattern in (RAW_ROLE, RAW_LITERAL):
        for match in pattern.finditer(page_html):
            start = max(0, match.start() - 60)
            found.append(html.unescape(TAG.sub("", page_html[start : match.end() + 40])).strip())
    return found


def on_post_page(output: str, page: Any, config: Any) -> str:
    found = raw_markup(output)
    if found:
        shown = "\n  ".join(found[:10])
        raise PluginError(
            f"{page.file.src_uri}: {len(found)} places show raw Sphinx markup (render it in "
            f"docs/hooks/sphinx_roles.py or write Markdown), e.g.:\n  {shown}"
        )
    return output
