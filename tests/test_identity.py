"""The idempotency key is a wire format: every vector in the shared spec must reproduce exactly."""

from __future__ import annotations

import dataclasses
import json
import os
import pickle
import re
from pathlib import Path
from typing import Any

import pytest

from dagster_joblease import errors
from dagster_joblease.identity import JobIdentity, JobType, colon_free_id, effect_key, idempotency_key

SPEC_DIR_ENV = "JOBLEASE_SPEC_DIR"
#: The vectors are the wire format's spec, so the repository keeps its own copy: the tests run anywhere.
SPEC_PATH = Path(__file__).resolve().parent / "spec" / "idempotency_keys.json"


def _shared_spec_path() -> Path:
    """The shared spec this copy must equal: $JOBLEASE_SPEC_DIR, else ../shared/spec beside the repo."""
    override = os.environ.get(SPEC_DIR_ENV)
    if override:
        return Path(override) / "idempotency_keys.json"
    return Path(__file__).resolve().parents[2] / "shared" / "spec" / "idempotency_keys.json"


def _load(path: Path) -> dict[str, Any]:
    spec: dict[str, Any] = json.loads(path.read_text(encoding="utf-8"))
    return spec


SPEC = _load(SPEC_PATH)


def test_spec_file_is_present_and_non_empty() -> None:
    assert len(SPEC["valid"]) >= 5
    assert len(SPEC["invalid"]) >= 5


def test_the_copy_equals_the_shared_spec() -> None:
    shared = _shared_spec_path()
    if not shared.is_file():
        pytest.skip(
            f"no shared spec at {shared} (a clone without ../shared beside it); the in-repository copy "
            f"{SPEC_PATH.relative_to(SPEC_PATH.parents[2])} is tested instead. Set {SPEC_DIR_ENV} to compare."
        )
    assert _load(shared) == SPEC, f"{SPEC_PATH} differs from {shared}: copy the shared spec over it"


@pytest.mark.parametrize("vector", SPEC["valid"], ids=lambda v: repr(v["code"])[:30])
def test_valid_vectors_reproduce_exactly(vector: dict[str, Any]) -> None:
    job = JobIdentity(vector["type"], vector["code"], vector["run_key"])
    assert job.canonical == vector["canonical"]
    assert job.idempotency_key == vector["idempotency_key"]
    assert idempotency_key(vector["type"], vector["code"], vector["run_key"]) == vector["idempotency_key"]


@pytest.mark.parametrize("vector", SPEC["invalid"], ids=lambda v: v["why"])
def test_invalid_vectors_are_rejected(vector: dict[str, Any]) -> None:
    with pytest.raises(errors.InvalidJobIdentityError):
        JobIdentity(vector["type"], vector["code"], vector["run_key"])
    with pytest.raises(errors.InvalidJobIdentityError):
        idempotency_key(vector["type"], vector["code"], vector["run_key"])


def test_key_shape_and_normalization() -> None:
    decomposed = "rapport-e\u0301te\u0301"
    composed = "rapport-\u00e9t\u00e9"
    assert decomposed != composed
    a = JobIdentity.schedule(decomposed, " 2026-11-29 ")
    b = JobIdentity.schedule(composed, "2026-11-29")
    assert a == b
    assert a.code == composed
    assert a.run_key == "2026-11-29"
    assert re.fullmatch(r"v2:[0-9a-f]{64}", a.idempotency_key)
    assert JobIdentity.initial("seed").run_key is None
    assert JobIdentity("INITIAL", "seed").type is JobType.INITIAL


def test_colon_and_concatenation_ambiguity_is_removed() -> None:
    assert idempotency_key("SCHEDULE", "a:b", "c") != idempotency_key("SCHEDULE", "a", "b:c")


@pytest.mark.parametrize(
    ("args", "field"),
    [
        (("SCHEDULE", 42, "x"), "code"),
        (("SCHEDULE", "code", 7), "run_key"),
        (("schedule", "code", "x"), "type"),
        ((None, "code", "x"), "type"),
        (("SCHEDULE", "c" * 65, "x"), "code"),
        (("SCHEDULE", "code", "r" * 257), "run_key"),
        (("SCHEDULE", "code", "a\u0085b"), "run_key"),
    ],
)
def test_invalid_identity_names_the_field(args: tuple[Any, Any, Any], field: str) -> None:
    with pytest.raises(errors.InvalidJobIdentityError) as info:
        JobIdentity(*args)
    assert info.value.field == field
    assert field in str(info.value)


def test_length_limits_are_inclusive_after_stripping() -> None:
    job = JobIdentity.schedule("  " + "c" * 64 + "  ", "r" * 256)
    assert len(job.code) == 64
    assert job.run_key is not None and len(job.run_key) == 256


def test_colon_free_id_is_deterministic_and_colon_free() -> None:
    key = idempotency_key("SCHEDULE", "daily-billing", "2026-11-29")
    other = idempotency_key("SCHEDULE", "daily-billing", "2026-11-30")
    hex_id = colon_free_id(key)
    assert hex_id == colon_free_id(key, encoding="hex")
    assert re.fullmatch(r"[0-9a-f]{64}", hex_id)
    b64 = colon_free_id(key, encoding="base64url")
    assert re.fullmatch(r"[A-Za-z0-9_-]{43}", b64)
    assert b64 == colon_free_id(key, encoding="base64url")
    for value in (hex_id, b64):
        assert ":" not in value
    assert colon_free_id(other) != hex_id
    assert colon_free_id(other, encoding="base64url") != b64
    with pytest.raises(errors.InvalidJobIdentityError):
        colon_free_id(key, encoding="base32")
    with pytest.raises(errors.InvalidJobIdentityError):
        colon_free_id("  ")


def test_effect_key_is_deterministic_and_distinct() -> None:
    key = idempotency_key("SCHEDULE", "daily-billing", "2026-11-29")
    invoice = effect_key(key, "send-invoice")
    assert invoice == effect_key(key, "send-invoice")
    assert invoice == effect_key(key, " send-invoice ")
    assert re.fullmatch(r"v2:[0-9a-f]{64}", invoice)
    assert invoice != key
    assert invoice != effect_key(key, "notify-crm")
    assert invoice != effect_key(idempotency_key("SCHEDULE", "daily-billing", "2026-11-30"), "send-invoice")
    with pytest.raises(errors.InvalidJobIdentityError):
        effect_key(key, "")
    with pytest.raises(errors.InvalidJobIdentityError):
        effect_key("", "send-invoice")


def test_identity_survives_pickle_and_replace() -> None:
    job = JobIdentity.schedule("daily-billing", "2026-11-29")
    copy = pickle.loads(pickle.dumps(job))
    assert copy == job and hash(copy) == hash(job) and copy.idempotency_key == job.idempotency_key
    moved = dataclasses.replace(job, run_key=" 2026-11-30 ")
    assert moved.run_key == "2026-11-30"
    assert moved.idempotency_key == idempotency_key("SCHEDULE", "daily-billing", "2026-11-30")


@pytest.mark.parametrize("bad", ["\ud800", "a\udfffb", "x\udc80"], ids=repr)
def test_lone_surrogates_are_invalid_identity_not_unicode_errors(bad: str) -> None:
    key = idempotency_key("SCHEDULE", "daily-billing", "2026-11-29")
    cases = [
        (lambda: JobIdentity.schedule(bad, "2026-11-29"), "code"),
        (lambda: JobIdentity.schedule("daily-billing", bad), "run_key"),
        (lambda: JobIdentity.initial(bad), "code"),
        (lambda: idempotency_key("SCHEDULE", "c", bad), "run_key"),
        (lambda: effect_key(key, bad), "effect_name"),
        (lambda: effect_key(key + bad, "mail"), "idempotency_key"),
        (lambda: colon_free_id(bad), "idempotency_key"),
        (lambda: colon_free_id(key + bad, encoding="base64url"), "idempotency_key"),
    ]
    for call, field in cases:
        with pytest.raises(errors.InvalidJobIdentityError) as info:
            call()
        assert info.value.field == field
        assert "surrogate" in str(info.value)
