"""The Django admin's Purge action on dead letters releases their claim-check holds once the
delete has committed, as ``outboxer dead-letters purge`` does: it deleted the rows and left
the holds, so the sweep kept their objects for ever. Each group's hold is its own: the
hold of another group, and that of a dead letter not selected, stay.

Django runs in subprocesses (tests/contrib/django_project): its settings are process-wide.
"""

from __future__ import annotations

import json
import uuid
from pathlib import Path

import pytest

from outboxer.claimcheck import HEADER_CLAIM_CHECK, FileObjectStore, object_name
from tests.contrib.test_audit10_djadmin_dead_letters import DIALECTS
from tests.integration.test_audit9_o_django_admin import run_django

SCRIPT = """
    import json
    import os

    import django
    django.setup()
    from django.conf import settings
    from django.contrib import admin
    from django.contrib.messages.storage.cookie import CookieStorage
    from django.db import connection, transaction
    from django.test import RequestFactory, override_settings

    from outboxer.contrib.django import conf
    from outboxer.contrib.django.models import DeadLetter

    STORE = os.environ["CCFOLLOW_STORE"]
    LETTERS = json.loads(os.environ["CCFOLLOW_LETTERS"])
    ATOMIC = os.environ["CCFOLLOW_ATOMIC"] == "1"
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
        OUTBOXER={**settings.OUTBOXER, "consumer": consumer, "claim_check_store": STORE}
    ).enable()

    model_admin = admin.site._registry[DeadLetter]
    purged = [str(letter.seq) for letter in DeadLetter.objects.all()
              if str(letter.message_id) != LETTERS[-1][1]]  # the last one is kept
    data = {"action": "purge", "index": "0", "_selected_action": purged}
    request = RequestFactory().post("/admin/outboxer/deadletter/", data)
    request.user = Staff()
    request._messages = CookieStorage(request)
    listing = model_admin.get_changelist_instance(request)
    seen_in_transaction = None
    if ATOMIC:  # ATOMIC_REQUESTS: released only once the request's transaction commits
        with transaction.atomic():
            model_admin.response_action(request, listing.get_queryset(request))
            seen_in_transaction = len(os.listdir(os.path.join(STORE[len("file://"):], ".holds")))
    else:
        model_admin.response_action(request, listing.get_queryset(request))
    print(json.dumps({
        "said": [f"{m.level_tag} {m.message}" for m in request._messages],
        "left": sorted(str(m) for m in DeadLetter.objects.values_list("message_id", flat=True)),
        "holds_in_transaction": seen_in_transaction,
    }))
"""


@pytest.mark.parametrize("atomic", [False, True], ids=["autocommit", "atomic-request"])
@pytest.mark.parametrize("dialect", list(DIALECTS))
def test_the_admin_purge_releases_the_claim_check_holds(
    request: pytest.FixtureRequest,
    monkeypatch: pytest.MonkeyPatch,
    tmp_path: Path,
    dialect: str,
    atomic: bool,
) -> None:
    url = request.getfixturevalue(DIALECTS[dialect])
    store = FileObjectStore(tmp_path / "objects")
    letters = []
    names = {}
    for who in ("shipping-1", "shipping-2", "billing", "shipping-kept"):
        message_id = str(uuid.uuid4())
        name = object_name(message_id, "default")
        store.put(name, b"x" * 10)
        group = "billing" if who == "billing" else "shipping"
        store.put_hold(name, group)
        names[who] = name
        letters.append((group, message_id, {HEADER_CLAIM_CHECK: name, "type": "order"}))
    # Another group's hold on a purged shipping letter's object: not the purge's to release.
    store.put_hold(names["shipping-1"], "invoicing")
    assert store.held() == set(names.values())

    monkeypatch.setenv("CCFOLLOW_STORE", f"file://{tmp_path / 'objects'}")
    monkeypatch.setenv("CCFOLLOW_LETTERS", json.dumps(letters))
    monkeypatch.setenv("CCFOLLOW_ATOMIC", "1" if atomic else "0")
    [line] = run_django(SCRIPT, url).splitlines()
    run = json.loads(line)
    assert run["said"] == ["success Purged 3 dead letter(s)."]
    assert run["left"] == [letters[-1][1]]
    if atomic:  # nothing released before the commit: 5 holds as put
        assert run["holds_in_transaction"] == 5
    # The purged letters' holds are gone (billing's by billing's row); invoicing's and the
    # kept letter's stay.
    assert store.held() == {names["shipping-1"], names["shipping-kept"]}
    holds = sorted(p.name for p in (tmp_path / "objects" / ".holds").iterdir())
    assert len(holds) == 2, holds
