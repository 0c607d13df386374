"""MkDocs hook: what a user configures, generated from the models themselves so it cannot drift.

- ``<!-- joblease-config: package.module.Class -->`` becomes a table of a Dagster ``ConfigurableResource``'s
  config fields: name, type, default and the field's own ``description``.
- ``<!-- joblease-components: package.module -->`` becomes, for every ``Component`` the module exports
  (imported by name, so it follows the class wherever it is defined), a table of the YAML attributes of its
  ``defs.yaml``, nested specs flattened (``routes.<topic>.url``): type and default from the component's
  dataclass, the names Dagster's own model of it accepts, and each attribute's description from the
  ``Attributes:`` section of its class docstring.

The build fails (strict) if a field or attribute has no description, or a docstring describes one the
model does not have.
"""

from __future__ import annotations

import dataclasses
import importlib
import re
import types
import typing
from typing import Any

import griffe
from mkdocs.exceptions import PluginError

MARKER = re.compile(r"<!-- joblease-(?P<kind>config|components): (?P<path>[\w.]+) -->")
MISSING = dataclasses.MISSING


def _import(path: str) -> Any:
    try:
        return importlib.import_module(path)
    except ModuleNotFoundError:
        module, _, name = path.rpartition(".")
        return getattr(importlib.import_module(module), name)


def type_name(annotation: Any) -> str:
    """A type as a YAML author reads it (pure)."""
    origin = typing.get_origin(annotation)
    args = typing.get_args(annotation)
    if origin in (typing.Union, types.UnionType):
        return " or ".join(type_name(a) for a in args)
    if origin is typing.Literal:
        return " | ".join(f"`{a}`" for a in args)
    if origin is dict:
        return f"map of {type_name(args[0])} to {type_name(args[1])}" if args else "map"
    if origin is list:
        return f"list of {type_name(args[0])}"
    if annotation is type(None):
        return "null"
    if annotation is typing.Any:
        return "any"
    if dataclasses.is_dataclass(annotation):
        return "mapping (below)"
    return {str: "string", int: "int", float: "number", bool: "bool"}.get(annotation, str(annotation))


def shown_default(value: Any) -> str:
    """A default as YAML writes it (pure)."""
    if value is None:
        return "`null`"
    if isinstance(value, bool):
        return f"`{str(value).lower()}`"
    return f"`{value!r}`".replace("'", '"')


def _default(field: dataclasses.Field[Any]) -> str:
    if field.default is not MISSING:
        return shown_default(field.default)
    if field.default_factory is not MISSING:
        made = field.default_factory()
        return "`{}`" if made == {} else "as below"
    return "**required**"


def attribute_docs(cls: type) -> dict[str, str]:
    """The ``Attributes:`` section of ``cls``'s docstring, by name (Google style, as the site renders)."""
    sections = griffe.Docstring(cls.__doc__ or "").parse("google", warn_unknown_params=False)
    return {
        item.name: " ".join(item.description.split())
        for section in sections
        if section.kind is griffe.DocstringSectionKind.attributes
        for item in section.value
    }


def _spec_of(annotation: Any) -> type | None:
    """The nested spec class a field holds (directly, optionally, or as a map's values)."""
    for candidate in (annotation, *typing.get_args(annotation)):
        if dataclasses.is_dataclass(candidate) and isinstance(candidate, type):
            return candidate
    if typing.get_origin(annotation) is dict:
        return _spec_of(typing.get_args(annotation)[1])
    return None


def component_rows(cls: type, prefix: str = "") -> list[tuple[str, str, str, str]]:
    """(attribute, type, default, description) for every attribute of ``cls``, nested specs after their
    parent; ``PluginError`` when the docstring and the fields disagree."""
    hints = typing.get_type_hints(cls)
    fields = [f for f in dataclasses.fields(cls) if f.init]  # type: ignore[arg-type]
    docs = attribute_docs(cls)
    names = {f.name for f in fields}
    model = getattr(cls, "model", None)
    if model is not None:
        names_in_model = set(model().model_fields)
        if names_in_model != names:
            raise PluginError(
                f"{cls.__name__}: its model's fields {sorted(names_in_model)} != {sorted(names)}"
            )
    undocumented = sorted(names - docs.keys())
    unknown = sorted(docs.keys() - names)
    if undocumented or unknown:
        raise PluginError(
            f"{cls.__module__}.{cls.__name__}: describe every attribute in its docstring's Attributes: "
            f"section (missing: {undocumented}; not attributes: {unknown})"
        )
    rows = []
    nested = []
    for field in fields:
        annotation = hints[field.name]
        path = f"{prefix}{field.name}"
        rows.append((path, type_name(annotation), _default(field), docs[field.name]))
        spec = _spec_of(annotation)
        if spec is not None:
            inner = f"{path}.<key>." if typing.get_origin(annotation) is dict else f"{path}."
            nested += component_rows(spec, inner)
    return rows + nested


def _cell(text: str) -> str:
    """Docstring text as a table cell: ``<`` outside code spans is not HTML, ``|`` not a column."""
    parts = text.split("`")
    return "`".join(p if i % 2 else p.replace("<", "&lt;") for i, p in enumerate(parts)).replace("|", "\\|")


def _table(rows: list[tuple[str, str, str, str]], headers: tuple[str, str, str, str]) -> list[str]:
    out = ["| " + " | ".join(headers) + " |", "|---|---|---|---|"]
    for name, kind, default, text in rows:
        cells = (f"`{name}`", kind, default, _cell(text))
        out.append("| " + " | ".join(cells) + " |")
    return [*out, ""]


def config_table(path: str) -> str:
    cls = _import(path)
    rows = []
    for name, field in cls.model_fields.items():
        if not field.description:
            raise PluginError(f"{path}.{name}: a config field needs a description (Field(description=...))")
        default = shown_default(field.default)
        rows.append((name, type_name(field.annotation), default, " ".join(field.description.split())))
    return "\n".join(_table(rows, ("field", "type", "default", "what it sets")))


def components_tables(path: str) -> str:
    from dagster.components import Component

    module = importlib.import_module(path)
    out: list[str] = []
    for name in module.__all__:
        cls = getattr(module, name)
        if isinstance(cls, type) and issubclass(cls, Component):
            out += [
                f"### `{name}` attributes",
                "",
                f"`type: {path}.{name}` in `defs.yaml`, under `attributes:`",
                "",
            ]
            out += _table(component_rows(cls), ("attribute", "type", "default", "what it sets"))
    return "\n".join(out)


def on_page_markdown(markdown: str, page: Any, config: Any, files: Any) -> str:
    def expand(match: re.Match[str]) -> str:
        if match["kind"] == "config":
            return config_table(match["path"])
        return components_tables(match["path"])

    return MARKER.sub(expand, markdown)
