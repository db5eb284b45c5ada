"""SQLite: a row abandoned at recovery while later rows of its key were in flight (the
scenario of test_store_audit_mysql_recovery)."""

from __future__ import annotations

import pytest

from tests.integration.test_store_audit_mysql_recovery import (
    check_order_after_abandoned_recovery,
)


@pytest.mark.parametrize("abandoned_blocks", [True, False])
async def test_sqlite_key_order_after_a_row_abandoned_at_recovery(
    sqlite_url: str, abandoned_blocks: bool
) -> None:
    await check_order_after_abandoned_recovery(sqlite_url, abandoned_blocks)
