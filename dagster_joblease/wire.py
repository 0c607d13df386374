"""The HTTP contract between a sender and a receiving API: header names, the key's two spellings, fencing.

One spelling of each rule for both ends: the dispatcher and ``Lease.headers()`` format what the inbox
parses. The key goes out bare (``Idempotency-Key: v2:…``, what Stripe-style APIs expect) or as an RFC 8941
sf-string (``Idempotency-Key: "v2:…"``, the IETF draft's form); a receiver accepts both. A fencing number
(the lease's ``attempt``) travels as an RFC 8941 integer in :data:`FENCING_TOKEN`.
"""

from __future__ import annotations

import re

from dagster_joblease import errors

__all__ = [
    "FENCING_TOKEN",
    "IDEMPOTENCY_KEY",
    "IDEMPOTENT_REPLAYED",
    "KEY_FORMATS",
    "MAX_FENCE",
    "RETRYABLE_STATUSES",
    "format_key",
    "is_retryable_status",
    "parse_fence",
    "parse_key",
]

#: The request header that carries the idempotency key.
IDEMPOTENCY_KEY = "Idempotency-Key"
#: The request header that carries a fencing number (a lease's ``attempt``); higher means newer.
FENCING_TOKEN = "Fencing-Token"
#: The response header a receiver adds to a replayed (stored) answer.
IDEMPOTENT_REPLAYED = "Idempotent-Replayed"
#: How a key may be spelled in the header.
KEY_FORMATS = ("bare", "sf-string")
#: The largest RFC 8941 integer (15 digits).
MAX_FENCE = 999_999_999_999_999

#: Statuses that mean "not now, retry with the same key" besides 5xx: a sender retries them, and the
#: inbox does not store them as a key's answer (so the retry is applied, not replayed).
RETRYABLE_STATUSES = frozenset({408, 409, 425, 429})

#: RFC 8941 sf-string: printable ASCII in double quotes, with only ``\"`` and ``\\`` escaped.
_SF_STRING = re.compile(r'"((?:[\x20\x21\x23-\x5b\x5d-\x7e]|\\["\\])*)"', re.ASCII)
_SF_ESCAPE = re.compile(r"\\(.)")
_SF_INTEGER = re.compile(r"-?[0-9]{1,15}", re.ASCII)


def is_retryable_status(status: int) -> bool:
    """True for 5xx and :data:`RETRYABLE_STATUSES`: answers a sender retries under the same key."""
    return status >= 500 or status in RETRYABLE_STATUSES


def format_key(key: str, key_format: str = "bare") -> str:
    """The ``Idempotency-Key`` header value for ``key``: as it is, or as an RFC 8941 sf-string."""
    if key_format == "sf-string":
        return '"' + key.replace("\\", "\\\\").replace('"', '\\"') + '"'
    if key_format != "bare":
        raise errors.ConfigurationError(
            f"key_format={key_format!r} is not a key format; use one of {', '.join(KEY_FORMATS)}"
        )
    return key


def parse_key(raw: str) -> str:
    """The key from a header value: an RFC 8941 sf-string (``"abc"``) or a bare value (``abc``).

    Surrounding spaces and tabs are dropped. A value that starts with a double quote must be a whole
    sf-string; the key itself is checked by :func:`dagster_joblease.inbox.validate_idempotency_key`.

    Raises:
        InvalidInboxInputError: a quoted value that is not an sf-string.
    """
    value = raw.strip(" \t")
    if not value.startswith('"'):
        return value
    matched = _SF_STRING.fullmatch(value)
    if matched is None:
        raise errors.InvalidInboxInputError(
            "idempotency_key",
            f"{value[:40]!r} starts with a double quote but is not an RFC 8941 string (printable ASCII "
            'in double quotes, with only \\" and \\\\ escaped); send the key bare or as a valid string',
        )
    return _SF_ESCAPE.sub(r"\1", matched.group(1))


def parse_fence(raw: str) -> int:
    """The fencing number from a :data:`FENCING_TOKEN` header value: an integer from 0 to :data:`MAX_FENCE`.

    Raises:
        InvalidInboxInputError: anything else.
    """
    value = raw.strip(" \t")
    if _SF_INTEGER.fullmatch(value) is None or value.startswith("-"):
        raise errors.InvalidInboxInputError(
            "fencing token",
            f"{value[:40]!r} must be a non-negative integer of at most 15 digits (a lease's attempt)",
        )
    return int(value)
