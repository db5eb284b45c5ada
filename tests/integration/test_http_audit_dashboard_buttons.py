"""The dashboard's requeue and purge buttons (dashboard.js, run by Node over a minimal DOM)
against the real HTTP API and database, when another operator got to the message first."""

from __future__ import annotations

import asyncio
import json
import shutil
from importlib.resources import files

import pytest

from tests.integration.test_http_api import abandoned, serving, statuses

#: Loads dashboard.js into a context with just the DOM it touches, presses one button, and
#: prints what the row and the result line show. argv: base URL, button (requeue|purge),
#: message id, destination, status.
HARNESS = r"""
const vm = require("vm");
const fs = require("fs");
const [script, base, action, id, destination, status] = process.argv.slice(1);  // node -e: no script path in argv
const result = { textContent: "", className: "" };
const cell = { textContent: status };
const row = {
  classes: [],
  classList: { add(name) { row.classes.push(name); } },
  querySelectorAll() { return [button]; },
  querySelector(selector) { return selector === "td.status" ? cell : null; },
};
const button = { dataset: { id, destination, status }, disabled: false, closest() { return row; } };
const context = {
  document: {
    getElementById(name) { return name === "requeue-result" ? result : null; },
    addEventListener() {},
  },
  sessionStorage: { getItem() { return null; }, setItem() {} },
  window: { confirm() { return true; } },
  fetch: (path, options) => fetch(base + path, options),
  console,
};
vm.createContext(context);
vm.runInContext(fs.readFileSync(script, "utf8"), context);
vm.runInContext(action + "(button)", Object.assign(context, { button })).then(() => {
  console.log(JSON.stringify({
    status: cell.textContent, result: result.textContent, ok: result.className === "ok",
    purged: row.classes.includes("purged"), disabled: button.disabled,
  }));
});
"""


async def press(base: str, action: str, row: dict[str, object]) -> dict[str, object]:
    node = shutil.which("node")
    if node is None:
        pytest.skip("node is not installed")
    script = str(files("outboxer").joinpath("dashboard.js"))
    process = await asyncio.create_subprocess_exec(
        node,
        "-e",
        HARNESS,
        script,
        base,
        action,
        str(row["id"]),
        str(row["destination"]),
        str(row["status"]),
        stdout=asyncio.subprocess.PIPE,
        stderr=asyncio.subprocess.PIPE,
    )
    out, err = await asyncio.wait_for(process.communicate(), 30)
    assert process.returncode == 0, err.decode()
    return dict(json.loads(out))


async def shown_row(client: object) -> dict[str, object]:
    rows = (await client.get("/messages?status=ABANDONED")).json()["messages"]  # type: ignore[attr-defined]
    assert len(rows) == 1
    return dict(rows[0])


@pytest.mark.parametrize("first", ["purge", "requeue"])
async def test_a_requeue_that_found_nothing_does_not_show_the_row_pending(
    sqlite_url: str, first: str
) -> None:
    # The page lists a message; another operator (or the other tab) purges or requeues it;
    # then this operator presses requeue. The API answers {"requeued": 0}: the page showed
    # the row as PENDING all the same, though the message is gone or was never touched.
    async with abandoned(sqlite_url, 1) as store, serving(sqlite_url) as client:
        row = await shown_row(client)
        other = await client.post(f"/messages/{first}", json={"ids": [str(row["id"])]})
        assert other.status_code == 200, other.text
        shown = await press(str(client.base_url).rstrip("/"), "requeue", row)
        remaining = await statuses(store)
    assert remaining == ({} if first == "purge" else {"PENDING": 1})
    assert shown["status"] == "ABANDONED", shown
    assert not shown["ok"] and "nothing" in str(shown["result"]), shown
    assert not shown["disabled"], "the buttons work again"


@pytest.mark.parametrize("first", ["purge", "requeue"])
async def test_a_purge_that_found_nothing_does_not_show_the_row_purged(
    sqlite_url: str, first: str
) -> None:
    async with abandoned(sqlite_url, 1) as store, serving(sqlite_url) as client:
        row = await shown_row(client)
        other = await client.post(f"/messages/{first}", json={"ids": [str(row["id"])]})
        assert other.status_code == 200, other.text
        shown = await press(str(client.base_url).rstrip("/"), "purge", row)
        remaining = await statuses(store)
    # A requeued message is PENDING now: the button's filter (its status ABANDONED) keeps
    # the purge from deleting a message that is about to be published.
    assert remaining == ({} if first == "purge" else {"PENDING": 1})
    assert shown["status"] == "ABANDONED" and not shown["purged"], shown
    assert not shown["ok"] and "nothing" in str(shown["result"]), shown
    assert not shown["disabled"], "the buttons work again"


@pytest.mark.parametrize(("action", "shown_status"), [("requeue", "PENDING"), ("purge", "PURGED")])
async def test_a_button_that_changed_its_row_shows_it(
    sqlite_url: str, action: str, shown_status: str
) -> None:
    async with abandoned(sqlite_url, 1) as store, serving(sqlite_url) as client:
        row = await shown_row(client)
        shown = await press(str(client.base_url).rstrip("/"), action, row)
        remaining = await statuses(store)
    assert remaining == ({"PENDING": 1} if action == "requeue" else {})
    assert shown["status"] == shown_status and shown["ok"], shown
    assert shown["result"] == f"{action}d 1 message(s): {row['id']}", shown
    assert shown["disabled"], "the row's buttons stay off once it changed"
