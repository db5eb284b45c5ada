"""Django model events honour ``settings.OUTBOXER``'s payload protection, as ``outboxer
enqueue`` does: with ``encryption_keys`` the outbox holds ciphertext, with
``claim_check_store`` a large payload goes to the object store and the row holds a reference.

Django runs in a subprocess (tests/contrib/django_project): its settings are process-wide.
"""

from __future__ import annotations

import json
import os
import pathlib
import subprocess
import sys
import textwrap

import pytest

from outboxer.claimcheck import create_object_store, fetch_payload, is_claim_checked
from outboxer.crypto import KeyRing, decrypt, generate_key, is_encrypted
from tests.contrib.helpers import claim_all
from tests.contrib.test_django import ROOT, SETTINGS


def run_django(script: str, url: str) -> None:
    """Run ``script`` (Django set up on the test project over ``url``) in a subprocess; the
    caller's PYTHONPATH stays behind the project's (to run against another outboxer)."""
    path = os.pathsep.join(filter(None, [str(ROOT), os.environ.get("PYTHONPATH")]))
    env = dict(os.environ, OUTBOXER_TEST_DJANGO_DB=url, PYTHONPATH=path)
    env["DJANGO_SETTINGS_MODULE"] = SETTINGS
    result = subprocess.run(
        [sys.executable, "-c", textwrap.dedent(script)],
        cwd=ROOT,
        env=env,
        capture_output=True,
        text=True,
        timeout=120,
    )
    assert result.returncode == 0, f"exit {result.returncode}\n{result.stdout}\n{result.stderr}"


WRITE = """
    import django
    from django.conf import settings
    import tests.contrib.django_project.settings as project

    values = {{name: getattr(project, name) for name in dir(project) if name.isupper()}}
    values["OUTBOXER"] = {outboxer!r}
    settings.configure(**values)
    django.setup()
    from django.core.management import call_command
    from django.db import transaction
    from tests.contrib.django_project.shop.models import Order

    call_command("migrate", verbosity=0)
    with transaction.atomic():
        order = Order(customer={customer!r})
        order.place()
        order.save()
"""


@pytest.mark.parametrize("fixture", ["pg_url", "mysql_url", "sqlite_url"])
def test_model_events_are_encrypted_with_the_keys_of_settings_outboxer(
    request: pytest.FixtureRequest, fixture: str
) -> None:
    url: str = request.getfixturevalue(fixture)
    keys = f"k1={generate_key()}"
    run_django(
        WRITE.format(outboxer={"broker": "memory://x", "encryption_keys": keys}, customer="c-7"),
        url,
    )
    [stored] = claim_all(url)
    assert is_encrypted(stored), "the outbox holds the model event's payload in plaintext"
    assert b"order" not in stored.payload and b'"id"' not in stored.payload
    opened = decrypt(stored, KeyRing.from_text(keys), destination="default")
    assert json.loads(opened.payload) == {"id": 1}


def test_a_large_model_event_goes_to_the_claim_check_store_of_settings_outboxer(
    sqlite_url: str, tmp_path: pathlib.Path
) -> None:
    store_url = f"file://{tmp_path / 'claims'}"
    # Threshold 0: every payload is "large".
    outboxer = {"broker": "memory://x", "claim_check_store": store_url, "claim_check_threshold": 0}
    run_django(WRITE.format(outboxer=outboxer, customer="c-7"), sqlite_url)
    [stored] = claim_all(sqlite_url)
    assert is_claim_checked(stored), "the payload was not offloaded to the claim-check store"
    store = create_object_store(store_url)
    try:
        assert json.loads(fetch_payload(stored, store).payload) == {"id": 1}
    finally:
        store.close()
