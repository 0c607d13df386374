"""Logical job identity and its idempotency key (a wire format: other services recompute it).

The key is a pure function of ``{type, code, run_key}``, so it is the same on every node, after a
reclaim, a retry, a backfill or a re-execution. Never use a row id or an owner token as an external key.
"""

from __future__ import annotations

import base64
import dataclasses
import enum
import hashlib
import json
import re
import unicodedata
from json.encoder import encode_basestring  # what json.dumps(..., ensure_ascii=False) quotes a str with

from dagster_joblease import errors

__all__ = [
    "KEY_VERSION",
    "MAX_CODE_LENGTH",
    "MAX_RUN_KEY_LENGTH",
    "JobIdentity",
    "JobType",
    "colon_free_id",
    "effect_key",
    "idempotency_key",
]

KEY_VERSION = "v2"
MAX_CODE_LENGTH = 64
MAX_RUN_KEY_LENGTH = 256
MAX_EFFECT_NAME_LENGTH = 128


class JobType(enum.StrEnum):
    """What a lease identity stands for."""

    #: Run once, forever: a successful row stays locked permanently. Forbids a run_key.
    INITIAL = "INITIAL"
    #: One logical run per run key (a tick, a partition). Requires a run_key.
    SCHEDULE = "SCHEDULE"


def _parse_type(value: object) -> JobType:
    if isinstance(value, JobType):
        return value
    if isinstance(value, str):
        try:
            return JobType(value)
        except ValueError:
            pass
    raise errors.InvalidJobIdentityError("type", value, "unknown type; allowed: 'INITIAL' or 'SCHEDULE'")


def _reject_surrogates(field: str, value: str) -> None:
    """The key hashes UTF-8, which has no encoding for a lone surrogate (a broken UTF-16 decode)."""
    if value.isascii():
        return
    try:
        value.encode("utf-8")
    except UnicodeEncodeError as exc:
        raise errors.InvalidJobIdentityError(
            field,
            value,
            f"contains the lone surrogate U+{ord(value[exc.start]):04X}, which is not valid Unicode text "
            "(UTF-8 cannot encode it); decode the source text correctly",
        ) from None


#: Unicode category Cc, exactly: C0 controls, DEL and C1 controls (a fixed set since Unicode 1.1).
_CONTROL = re.compile("[\x00-\x1f\x7f-\x9f]")


def _normalize_text(field: str, value: object, max_length: int) -> str:
    if not isinstance(value, str):
        raise errors.InvalidJobIdentityError(field, value, f"must be a str, got {type(value).__name__}")
    text = value.strip()
    if not text.isascii():  # ASCII text is already NFC and has no surrogates
        _reject_surrogates(field, value)
        text = unicodedata.normalize("NFC", text)
    if not text:
        raise errors.InvalidJobIdentityError(field, value, "must not be blank")
    if len(text) > max_length:
        raise errors.InvalidJobIdentityError(
            field, value, f"is {len(text)} characters after stripping; at most {max_length} are allowed"
        )
    control = _CONTROL.search(text)
    if control is not None:
        code_point = ord(control.group())
        raise errors.InvalidJobIdentityError(
            field,
            value,
            f"contains the control character U+{code_point:04X}; control characters are not allowed",
        )
    return text


def _canonical(job_type: str, code: str, run_key: str | None) -> str:
    """``json.dumps([KEY_VERSION, type, code, run_key], separators=(",", ":"), ensure_ascii=False)``,
    spelled out: the encoder's own string quoting without building an encoder per key (a third of the
    identity's cost)."""
    tail = "null" if run_key is None else encode_basestring(run_key)
    return f'["{KEY_VERSION}","{job_type}",{encode_basestring(code)},{tail}]'


@dataclasses.dataclass(frozen=True, slots=True, init=False)
class JobIdentity:
    """A validated, normalized logical run: ``{type, code, run_key}``.

    ``code`` and ``run_key`` are stripped and NFC-normalized; ``INITIAL`` forbids a run key and
    ``SCHEDULE`` requires one. Invalid input raises :class:`InvalidJobIdentityError`.
    """

    type: JobType
    code: str
    run_key: str | None
    # The key, computed once: lease calls read it several times per claim.
    _key: str = dataclasses.field(init=False, repr=False, compare=False)

    def __init__(self, type: JobType | str, code: str, run_key: str | None = None) -> None:
        job_type = _parse_type(type)
        norm_code = _normalize_text("code", code, MAX_CODE_LENGTH)
        norm_run_key: str | None
        if job_type is JobType.INITIAL:
            if run_key is not None:
                raise errors.InvalidJobIdentityError(
                    "run_key",
                    run_key,
                    "INITIAL forbids a run_key (an INITIAL job runs once, forever); pass None",
                )
            norm_run_key = None
        else:
            if run_key is None:
                raise errors.InvalidJobIdentityError(
                    "run_key", run_key, "SCHEDULE requires a run_key (for example a partition key)"
                )
            norm_run_key = _normalize_text("run_key", run_key, MAX_RUN_KEY_LENGTH)
        object.__setattr__(self, "type", job_type)
        object.__setattr__(self, "code", norm_code)
        object.__setattr__(self, "run_key", norm_run_key)
        canonical = _canonical(job_type.value, norm_code, norm_run_key)
        digest = hashlib.sha256(canonical.encode("utf-8")).hexdigest()
        object.__setattr__(self, "_key", f"{KEY_VERSION}:{digest}")

    @classmethod
    def initial(cls, code: str) -> JobIdentity:
        return cls(JobType.INITIAL, code)

    @classmethod
    def schedule(cls, code: str, run_key: str) -> JobIdentity:
        return cls(JobType.SCHEDULE, code, run_key)

    @property
    def canonical(self) -> str:
        """The compact JSON array the key hashes."""
        return _canonical(self.type.value, self.code, self.run_key)

    @property
    def idempotency_key(self) -> str:
        return self._key

    def __str__(self) -> str:
        return self.code if self.run_key is None else f"{self.code}@{self.run_key}"


def idempotency_key(type: JobType | str, code: str, run_key: str | None = None) -> str:
    """``"v2:" + sha256_hex(["v2", type, code, run_key])`` after validation and normalization."""
    return JobIdentity(type, code, run_key).idempotency_key


def _check_key(key: object) -> str:
    if not isinstance(key, str) or not key.strip():
        raise errors.InvalidJobIdentityError("idempotency_key", key, "must be a non-blank str")
    _reject_surrogates("idempotency_key", key)
    return key


def colon_free_id(key: str, *, encoding: str = "hex") -> str:
    """A deterministic id without ``:`` for queues that reject it in job ids.

    ``hex`` gives 64 lowercase hex characters, ``base64url`` 43 characters (no padding); both are the
    SHA-256 of the key, so the same key always maps to the same id.
    """
    digest = hashlib.sha256(_check_key(key).encode("utf-8")).digest()
    if encoding == "hex":
        return digest.hex()
    if encoding == "base64url":
        return base64.urlsafe_b64encode(digest).rstrip(b"=").decode("ascii")
    raise errors.InvalidJobIdentityError("encoding", encoding, "allowed: 'hex' or 'base64url'")


def effect_key(run_idempotency_key: str, effect_name: str) -> str:
    """A per-effect key derived from a run's key and an effect name, for runs with several effects.

    Same inputs, same key; it keeps the ``v2:`` prefix and is distinct from the run key itself.
    """
    base = _check_key(run_idempotency_key)
    name = _normalize_text("effect_name", effect_name, MAX_EFFECT_NAME_LENGTH)
    canonical = json.dumps([KEY_VERSION, "EFFECT", base, name], separators=(",", ":"), ensure_ascii=False)
    return f"{KEY_VERSION}:{hashlib.sha256(canonical.encode('utf-8')).hexdigest()}"
