"""outboxer.admin's rules without a database: the filter's checks, reading it from JSON,
each operation's own rules, the reports, and copying payloads for a replay."""

from __future__ import annotations

import json
import uuid
from datetime import UTC, datetime, timedelta, timezone
from pathlib import Path
from typing import Any

import pytest

from outboxer.admin import (
    HEADER_REPLAY_OF,
    PURGEABLE,
    AdminResult,
    MessageFilter,
    ReplayCopier,
    check_destination,
    filter_from_json,
    parse_age,
    parse_time,
    purge_filter,
    replay_filter,
    requeue_filter,
)
from outboxer.claimcheck import HEADER_CLAIM_CHECK, ClaimCheck, FileObjectStore, fetch_payload
from outboxer.crypto import (
    FileSubjectKeys,
    KeyRing,
    SubjectKeyDeletedError,
    decrypt,
    encrypt_message,
    generate_key,
)
from outboxer.errors import AdminRequestError, ReplayError
from outboxer.message import Message, encode_payload, uuid7

ID = uuid.UUID("01890a5d-ac96-774b-bcce-b302099a8057")


# ----- the filter ----------------------------------------------------------------------------


def test_a_filter_normalises_what_it_is_given() -> None:
    where = MessageFilter(
        ids=(str(ID), ID),  # type: ignore[arg-type]
        topics=("a", "b", "a"),
        statuses=("ABANDONED",),
        created_after=datetime(2024, 5, 1, 12, 0),
        created_before=datetime(2024, 5, 2, tzinfo=timezone(timedelta(hours=2))),
    )
    assert where.ids == (ID,) and where.topics == ("a", "b")
    assert where.created_after == datetime(2024, 5, 1, 12, 0, tzinfo=UTC), "naive is UTC"
    assert where.created_before == datetime(2024, 5, 1, 22, 0, tzinfo=UTC)
    assert not where.empty and MessageFilter().empty
    assert where.describe() == (
        "created_after 2024-05-01T12:00:00+00:00; created_before 2024-05-01T22:00:00+00:00; "
        "1 id(s); statuses ABANDONED; topics a, b"
    )


@pytest.mark.parametrize(
    ("criteria", "fragment"),
    [
        ({"ids": ("junk",)}, "ids must be message ids (UUIDs); got 'junk'"),
        ({"ids": (7,)}, "ids must be message ids"),
        ({"ids": ()}, "ids must be a non-empty list"),
        ({"topics": "order.placed"}, "topics must be a list, not str"),
        ({"topics": ("",)}, "topics must hold non-empty strings"),
        ({"keys": ("a\x00b",)}, "an item of keys contains a NUL"),
        ({"destinations": ("\ud800",)}, "an item of destinations contains a lone surrogate"),
        ({"statuses": ("LOST",)}, "unknown statuses LOST; use PENDING, PROCESSING"),
        ({"older_than": -1}, "older_than must be a finite number of seconds >= 0"),
        ({"older_than": float("nan")}, "older_than must be a finite number"),
        ({"older_than": True}, "older_than must be a number of seconds"),
        ({"created_after": "2024-05-01"}, "created_after must be a datetime"),
        (
            {
                "created_after": datetime(2024, 5, 2, tzinfo=UTC),
                "created_before": datetime(2024, 5, 1, tzinfo=UTC),
            },
            "created_after (2024-05-02T00:00:00+00:00) must be earlier than created_before",
        ),
        ({"error": ""}, "error must be a non-empty string"),
    ],
)
def test_a_bad_filter_is_refused_naming_the_field(criteria: dict[str, Any], fragment: str) -> None:
    with pytest.raises(AdminRequestError) as refused:
        MessageFilter(**criteria)
    assert fragment in str(refused.value)


def test_times_and_ages_as_operators_write_them() -> None:
    assert parse_time("2024-05-01", "--created-after") == datetime(2024, 5, 1, tzinfo=UTC)
    assert parse_time(" 2024-05-01T12:00:00Z ", "x") == datetime(2024, 5, 1, 12, tzinfo=UTC)
    assert parse_time("2024-05-01T14:00+02:00", "x") == datetime(2024, 5, 1, 12, tzinfo=UTC)
    with pytest.raises(AdminRequestError, match="--created-after must be an ISO 8601 time"):
        parse_time("yesterday", "--created-after")
    with pytest.raises(AdminRequestError, match="must be an ISO 8601 time as a string"):
        parse_time(20240501, "created_after")
    for edge in ("9999-12-31T23:59:59-01:00", "0001-01-01T00:00:00+01:00"):  # past UTC's range
        with pytest.raises(AdminRequestError, match="created_after is out of range in UTC"):
            parse_time(edge, "created_after")
    assert parse_age("7d", "--older-than") == 7 * 86400
    assert parse_age(90, "older_than") == 90
    with pytest.raises(AdminRequestError, match="--older-than must be a duration"):
        parse_age("5x", "--older-than")


def test_a_filter_from_json() -> None:
    where = filter_from_json(
        {
            "ids": [str(ID)],
            "statuses": ["abandoned", " Failed"],
            "older_than": "1h",
            "created_before": "2024-05-01T00:00:00Z",
            "error": "timeout",
            "topics": None,  # null: left out
            "dry_run": True,  # not a filter field: the caller's
        }
    )
    assert where == MessageFilter(
        ids=(ID,),
        statuses=("ABANDONED", "FAILED"),
        older_than=3600.0,
        created_before=datetime(2024, 5, 1, tzinfo=UTC),
        error="timeout",
    )
    for body, fragment in (
        ({"keys": "k"}, "keys must be a non-empty list of non-empty strings"),
        ({"keys": []}, "keys must be a non-empty list"),
        ({"keys": [1]}, "keys must be a non-empty list"),
        ({"statuses": ["\ud800"]}, "an item of statuses contains a lone surrogate"),
        ({"older_than": [1]}, "older_than must be a duration"),
        ({"error": 5}, "error must be a non-empty string"),
    ):
        with pytest.raises(AdminRequestError, match=fragment):
            filter_from_json(body)


# ----- each operation's rules ----------------------------------------------------------------


def test_purge_needs_a_filter_and_never_asks_for_processing_rows() -> None:
    with pytest.raises(AdminRequestError, match="purge needs a filter"):
        purge_filter(MessageFilter())
    with pytest.raises(AdminRequestError, match="purges every message: give it without a filter"):
        purge_filter(MessageFilter(topics=("t",)), everything=True)
    with pytest.raises(AdminRequestError, match="PROCESSING messages cannot be purged"):
        purge_filter(MessageFilter(statuses=("PROCESSING",)))
    assert purge_filter(MessageFilter(), everything=True).statuses == PURGEABLE
    assert "PROCESSING" not in PURGEABLE
    assert purge_filter(MessageFilter(statuses=("PUBLISHED",))).statuses == ("PUBLISHED",)


def test_replay_copies_published_rows_only() -> None:
    with pytest.raises(AdminRequestError, match="replay needs a filter"):
        replay_filter(MessageFilter())
    with pytest.raises(AdminRequestError, match="replay copies PUBLISHED messages only"):
        replay_filter(MessageFilter(statuses=("ABANDONED",)))
    assert replay_filter(MessageFilter(keys=("k",))).statuses == ("PUBLISHED",)
    assert check_destination("partner", ["default", "partner"]) == "partner"
    assert check_destination("anywhere", None) == "anywhere"
    with pytest.raises(AdminRequestError, match="'parnter' is not configured"):
        check_destination("parnter", ["default", "partner"])
    for bad in ("", 7, "x" * 256):
        with pytest.raises(AdminRequestError, match="the destination to replay to"):
            check_destination(bad, None)


def test_requeue_keeps_its_defaults() -> None:
    where = requeue_filter(MessageFilter(), destinations=["default", "partner"])
    assert (where.statuses, where.destinations) == (("ABANDONED",), ("default", "partner"))
    where = requeue_filter(MessageFilter(destinations=("x",)), destinations=["default"])
    assert where.destinations == ("x",)
    with pytest.raises(
        AdminRequestError, match="unknown statuses PUBLISHED; use ABANDONED, FAILED"
    ):
        requeue_filter(MessageFilter(statuses=("PUBLISHED",)), destinations=["default"])


def test_reports_for_people_and_for_json() -> None:
    dry = AdminResult("purge", True, 3, {"default": {"ABANDONED": 2, "PENDING": 1}}, held=1)
    assert dry.as_json() == {
        "dry_run": True,
        "would_purge": 3,
        "by_destination": {"default": {"ABANDONED": 2, "PENDING": 1}},
        "held": 1,
    }
    assert dry.lines() == [
        "would purge 3 message(s); dry run, nothing changed",
        "  default          ABANDONED           2",
        "  default          PENDING             1",
        "1 PROCESSING message(s) match too: a relay holds them, purge leaves them",
    ]
    assert AdminResult("requeue", False, 2).as_json() == {"requeued": 2}
    replayed = AdminResult("replay", False, 4, to="partner", shredded=1)
    assert replayed.as_json() == {"replayed": 4, "to": "partner", "shredded": 1}
    assert replayed.lines() == [
        "replayed 4 message(s) as new PENDING messages (to destination partner)",
        "1 message(s) not copied: their subject's key was shredded",
    ]


# ----- copying payloads ------------------------------------------------------------------------


def published(payload: object, **headers: str) -> Message:
    body, kind = encode_payload(payload)
    return Message(id=uuid7(), topic="t", payload=body, key="k", headers=headers, content_type=kind)


def test_a_plain_copy_has_a_new_id_the_destination_and_replay_of() -> None:
    original = published({"n": 1}, trace="abc", **{HEADER_REPLAY_OF: "older"})
    copier = ReplayCopier()
    copier.to = "partner"
    [copy] = copier([original])
    assert copy.id != original.id and copy.id.version == 7
    assert (copy.destination, copy.topic, copy.key, copy.payload, copy.content_type) == (
        "partner",
        "t",
        "k",
        original.payload,
        original.content_type,
    )
    assert copy.headers == {"trace": "abc", HEADER_REPLAY_OF: str(original.id)}


def test_an_encrypted_copy_is_sealed_for_its_own_id(tmp_path: Path) -> None:
    old, new = generate_key(), generate_key()
    ring = KeyRing({"old": old, "new": new}, "new", subjects=FileSubjectKeys(tmp_path))
    stored = encrypt_message(
        published({"n": 1}, secret="s", shown="v"),
        KeyRing({"old": old}, subjects=ring.subjects),
        subject="bob",
        seal_headers=("secret",),
    )
    [copy] = ReplayCopier(ring)([stored])
    assert copy.headers["outboxer-key-id"] == "new", "under the current key"
    assert copy.headers["outboxer-subject"] == "bob" and "secret" not in copy.headers
    plain = decrypt(copy, ring)
    assert json.loads(plain.payload) == {"n": 1}
    assert plain.headers == {"secret": "s", "shown": "v", HEADER_REPLAY_OF: str(stored.id)}
    with pytest.raises(ReplayError, match="configure the encryption keys"):
        ReplayCopier()([stored])
    ring.shred("bob")
    shredding = ReplayCopier(ring)
    assert shredding([stored]) == [] and shredding.shredded == 1
    with pytest.raises(SubjectKeyDeletedError):
        shredding.copy(stored)


def test_a_claim_checked_copy_gets_an_object_of_its_own(tmp_path: Path) -> None:
    objects = FileObjectStore(tmp_path)
    stored = ClaimCheck(objects, threshold=0).offload(published({"blob": "x" * 50}))
    copier = ReplayCopier(object_store=objects)
    copier.to = "partner"
    [copy] = copier([stored])
    assert copy.headers[HEADER_CLAIM_CHECK] != stored.headers[HEADER_CLAIM_CHECK]
    assert copy.headers[HEADER_CLAIM_CHECK].startswith(f"{copy.id}.partner.")
    assert copier.objects == [copy.headers[HEADER_CLAIM_CHECK]]
    assert fetch_payload(copy, objects).payload == fetch_payload(stored, objects).payload
    objects.delete(stored.headers[HEADER_CLAIM_CHECK])  # retention of the original
    assert json.loads(fetch_payload(copy, objects).payload) == {"blob": "x" * 50}
    copier.discard_objects()
    assert list(objects.list_objects()) == [], "an uncommitted copy's object is deleted"
    with pytest.raises(ReplayError, match=r"cannot be replayed: claim-check object .* is not in"):
        ReplayCopier(object_store=objects)([stored])
    with pytest.raises(ReplayError, match="configure claim_check_store"):
        ReplayCopier()([stored])


def test_a_replay_never_recreates_the_key_of_a_subject_shredded_meanwhile(
    tmp_path: Path,
) -> None:
    """``keys shred`` landing between the copy's decrypt and its encrypt: a new secret for the
    subject would make its data readable again; the copy is counted as shredded instead."""

    from tests.subjects import ShredDuringRead

    subjects = ShredDuringRead(tmp_path)
    ring = KeyRing({"k": generate_key()}, subjects=subjects)
    stored = encrypt_message(published({"email": "ann@example.com"}), ring, subject="ann")
    subjects.shred_after_read = True
    copier = ReplayCopier(ring)
    assert copier([stored]) == [] and copier.shredded == 1
    subjects.shred_after_read = False
    assert subjects.get("ann") is None, "no new secret was made"
