"""The Django admin's Purge of dead letters of several consumer groups against a claim-check
store that stops answering (a dead NFS mount): the request waits one
``claim_check_read_timeout`` for the holds' release and leaves one thread. Before (e8bb723),
each group's release was bounded on its own and the store's close after them: a purge of 3
groups waited 4 timeouts and left 4 hung threads, the process's every sweep slot (its
sweeps, closes and deletes then failed at once until the store answered).

Django runs in a subprocess (tests/contrib/django_project): its settings are process-wide.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from outboxer.claimcheck import HEADER_CLAIM_CHECK, FileObjectStore, object_name
from tests.integration.test_audit9_o_django_admin import run_django

TIMEOUT = 0.3

SCRIPT = """
    import json
    import os
    import threading
    import time

    import django
    django.setup()
    from django.conf import settings
    from django.contrib import admin
    from django.contrib.messages.storage.cookie import CookieStorage
    from django.db import connection, transaction
    from django.test import RequestFactory, override_settings

    from outboxer import payload_admin
    from outboxer.claimcheck import FileObjectStore
    from outboxer.contrib.django import conf
    from outboxer.contrib.django.models import DeadLetter

    DIRECTORY = os.environ["REVIEW_STORE"]
    LETTERS = json.loads(os.environ["REVIEW_LETTERS"])
    ATOMIC = os.environ["REVIEW_ATOMIC"] == "1"
    never = threading.Event()

    class Hangs(FileObjectStore):  # a dead NFS mount: releases and the close never answer
        def delete_hold(self, name, holder):
            never.wait()

        def close(self):
            never.wait()

    payload_admin.create_object_store = lambda url: Hangs(DIRECTORY)
    dead_letters = conf.schema_table(connection.alias, "dead_letters")
    with connection.cursor() as cursor:
        cursor.executemany(
            f"INSERT INTO {dead_letters} (consumer, message_id, topic, headers, content_type, "
            "payload, error, attempts) VALUES (%s, %s, 'order.placed', %s, "
            "'application/octet-stream', %s, 'boom', 3)",
            [(group, message_id, json.dumps(headers), b"") for group, message_id, headers
             in LETTERS],
        )

    class Staff:
        is_active = is_staff = is_superuser = True
        pk = 1

        def has_perm(self, perm, obj=None):
            return True

    consumer = {"group": "shipping", "handler": "tests.contrib.django_project.shop.handlers:nope"}
    override_settings(
        OUTBOXER={**settings.OUTBOXER, "consumer": consumer,
                  "claim_check_store": "file://" + DIRECTORY,
                  "claim_check_read_timeout": float(os.environ["REVIEW_TIMEOUT"])}
    ).enable()

    model_admin = admin.site._registry[DeadLetter]
    selected = [str(letter.seq) for letter in DeadLetter.objects.all()]
    data = {"action": "purge", "index": "0", "_selected_action": selected}
    request = RequestFactory().post("/admin/outboxer/deadletter/", data)
    request.user = Staff()
    request._messages = CookieStorage(request)
    listing = model_admin.get_changelist_instance(request)
    began = time.monotonic()
    if ATOMIC:  # ATOMIC_REQUESTS: released once the request's transaction commits
        with transaction.atomic():
            model_admin.response_action(request, listing.get_queryset(request))
    else:
        model_admin.response_action(request, listing.get_queryset(request))
    took = time.monotonic() - began
    print(json.dumps({
        "said": [f"{m.level_tag} {m.message}" for m in request._messages],
        "left": DeadLetter.objects.count(),
        "took": took,
        "threads": sorted(t.name for t in threading.enumerate()
                          if t.name.startswith("outboxer-claim-check-")),
    }))
"""


@pytest.mark.parametrize("atomic", [False, True], ids=["autocommit", "atomic-request"])
def test_a_purge_of_several_groups_waits_one_timeout_on_a_hung_store(
    sqlite_url: str, monkeypatch: pytest.MonkeyPatch, tmp_path: Path, atomic: bool
) -> None:
    store = FileObjectStore(tmp_path / "objects")
    letters = []
    for group in ("shipping", "billing", "invoicing"):
        message_id = str(uuid.uuid4())
        name = object_name(message_id, "default")
        store.put(name, b"x" * 10)
        store.put_hold(name, group)
        letters.append((group, message_id, {HEADER_CLAIM_CHECK: name}))
    monkeypatch.setenv("REVIEW_STORE", str(tmp_path / "objects"))
    monkeypatch.setenv("REVIEW_LETTERS", json.dumps(letters))
    monkeypatch.setenv("REVIEW_ATOMIC", "1" if atomic else "0")
    monkeypatch.setenv("REVIEW_TIMEOUT", str(TIMEOUT))

    [line] = run_django(SCRIPT, sqlite_url).splitlines()
    run = json.loads(line)

    assert run["said"] == ["success Purged 3 dead letter(s)."]
    assert run["left"] == 0
    assert run["threads"] == ["outboxer-claim-check-call"], "one thread left hung, no more"
    assert run["took"] < 3 * TIMEOUT, run["took"]
