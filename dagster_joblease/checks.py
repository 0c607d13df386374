"""One validator for the public arguments that are counts, durations, limits or labels.

Every check raises the exception its public API documents (``error``: a :class:`Refusal`, by default a
:class:`~dagster_joblease.errors.ConfigurationError`) with one message style::

    <name> must be <what is allowed>, got <the value>[; <why the rule exists>]

The value is shown by :func:`shown`: numbers and None as written, a short str quoted, anything else by
its type only, so a message never echoes a long text (a token, a URL with a password, a payload).

Why a small module and not a typed-settings library (pydantic, attrs validators, msgspec): the checks
guard plain function and constructor arguments (``Dispatcher(claim_ms=...)``, ``Route(timeout_s=...)``,
``admin.list_leases(limit=...)``), not a settings object, so a library would mean building a model per
call or re-declaring each API as one; its errors (``pydantic.ValidationError``) are not the package's
documented exception types and its messages are its own, not one style. pydantic is already installed
with Dagster but the core must not need Dagster's dependencies. Five functions of a few lines each
carry the rule (reject ``bool``, which is an ``int``; reject NaN and infinity; name the range).
"""

from __future__ import annotations

import math
from typing import Protocol

from dagster_joblease import errors

__all__ = [
    "MAX_DURATION_MS",
    "Refusal",
    "admin_argument",
    "configuration",
    "fault",
    "inbox_input",
    "integer",
    "lease_option",
    "milliseconds",
    "number",
    "payload",
    "shown",
    "text",
]


#: The longest time option or window anywhere in the library: 100 years. Database now plus (or minus) this
#: stays far inside what both backends store and Python decodes (years 1-9999); the seed's 2**53-1 ms
#: did not (year 287453 on PostgreSQL, a failed insert on SQLite).
MAX_DURATION_MS = 100 * 365 * 86_400_000


_HUNDRED_YEARS = "the most is 100 years, so that the time stays a date both backends can store"


class Refusal(Protocol):
    """Builds the exception a public API raises for a refused argument: ``name``, the ``value`` given,
    and the ``rule`` (``must be …, got …``); the message is ``f"{name} {rule}"``."""

    def __call__(self, name: str, value: object, rule: str, /) -> Exception: ...


def configuration(name: str, value: object, rule: str, /) -> Exception:
    return errors.ConfigurationError(f"{name} {rule}")


def admin_argument(name: str, value: object, rule: str, /) -> Exception:
    return errors.AdminArgumentError(f"{name} {rule}")


def fault(name: str, value: object, rule: str, /) -> Exception:
    return errors.InvalidFaultError(f"{name} {rule}")


def lease_option(name: str, value: object, rule: str, /) -> Exception:
    return errors.InvalidLeaseOptionsError(name, value, rule, message=f"{name} {rule}")


def payload(name: str, value: object, rule: str, /) -> Exception:
    return errors.InvalidPayloadError(name, rule, message=f"{name} {rule}")


def inbox_input(name: str, value: object, rule: str, /) -> Exception:
    return errors.InvalidInboxInputError(name, rule, message=f"{name} {rule}")


def shown(value: object) -> str:
    """``value`` as a message shows it: None, bools and numbers as written, a str of at most 20
    characters quoted (a longer one by its length), anything else by its type."""
    if value is None or isinstance(value, bool | int | float):
        return repr(value)
    if isinstance(value, str):
        return repr(value) if len(value) <= 20 else f"a str of {len(value)} characters"
    return f"a {type(value).__name__}"


def _num(bound: float) -> str:
    return str(bound) if isinstance(bound, int) else f"{bound:g}"


def _range(minimum: float | None, maximum: float | None, above: float | None) -> str:
    low = f"above {_num(above)}" if above is not None else None
    if low is not None:
        return low if maximum is None else f"{low} and at most {_num(maximum)}"
    if minimum is not None and maximum is not None:
        return f"from {_num(minimum)} to {_num(maximum)}"
    if minimum is not None:
        return f">= {_num(minimum)}"
    return "" if maximum is None else f"<= {_num(maximum)}"


def _refusal(name: str, value: object, allowed: str, why: str, none: str | None, error: Refusal) -> Exception:
    if none is not None:
        allowed = f"None ({none}) or {allowed}"
    rule = f"must be {allowed}, got {shown(value)}" + (f"; {why}" if why else "")
    return error(name, value, rule)


def integer(
    name: str,
    value: object,
    *,
    minimum: int | None = None,
    maximum: int | None = None,
    unit: str = "",
    why: str = "",
    error: Refusal = configuration,
    none: str | None = None,
) -> int:
    """``value`` when it is an int (not a bool) in ``[minimum, maximum]`` (each bound optional); else
    ``error``. ``unit`` names what it counts (``"milliseconds"``); ``none``, when the caller accepts None
    (and handles it before calling), says what None means, for the message."""
    if isinstance(value, int) and not isinstance(value, bool):
        if (minimum is None or value >= minimum) and (maximum is None or value <= maximum):
            return value
    kind = f"an int number of {unit}" if unit else "an int"
    bounds = _range(minimum, maximum, None)
    raise _refusal(name, value, f"{kind} {bounds}".rstrip(), why, none, error)


def milliseconds(
    name: str,
    value: object,
    *,
    minimum: int = 0,
    maximum: int = MAX_DURATION_MS,
    why: str = "",
    error: Refusal = configuration,
) -> int:
    """An int number of milliseconds in ``[minimum, maximum]`` (by default 0 to 100 years)."""
    if maximum == MAX_DURATION_MS:
        why = "; ".join(filter(None, (why, _HUNDRED_YEARS)))
    return integer(name, value, minimum=minimum, maximum=maximum, unit="milliseconds", why=why, error=error)


def number(
    name: str,
    value: object,
    *,
    minimum: float | None = None,
    above: float | None = None,
    maximum: float | None = None,
    unit: str = "seconds",
    why: str = "",
    error: Refusal = configuration,
    none: str | None = None,
) -> float:
    """``value`` as a float when it is a finite int or float (not a bool) ``>= minimum`` (or ``> above``)
    and ``<= maximum``; else ``error``."""
    if isinstance(value, int | float) and not isinstance(value, bool) and math.isfinite(value):
        low_ok = (minimum is None or value >= minimum) and (above is None or value > above)
        if low_ok and (maximum is None or value <= maximum):
            return float(value)
    kind = f"a finite number of {unit}" if unit else "a finite number"
    bounds = _range(minimum, maximum, above)
    raise _refusal(name, value, f"{kind} {bounds}".rstrip(), why, none, error)


def text(name: str, value: object, *, why: str = "", error: Refusal = configuration) -> str:
    """``value`` stripped, when it is a str that is not blank; else ``error``."""
    if isinstance(value, str) and value.strip():
        return value.strip()
    raise _refusal(name, value, "a non-blank str", why, None, error)
