"""The real ``outboxer`` refusing one outbox table listed as two databases (in the file, or
as a repeated ``--db``) before it connects anywhere: exit 2 and one line naming both; the
same table under two spellings would otherwise be relayed and counted twice."""

from __future__ import annotations

from pathlib import Path

import pytest

from tests.acceptance.test_cli import cli


def _same_database_twice(pg_url: str) -> tuple[str, str]:
    """``pg_url`` and another spelling of it: postgres://, explicit port, a query option."""
    other = pg_url.replace("postgresql://", "postgres://", 1)
    head, _, database = other.rpartition("/")
    if ":" not in head.rpartition("@")[2]:
        head += ":5432"
    return pg_url, f"{head}/{database}?application_name=audit12"


@pytest.mark.parametrize("command", [["relay", "--exit-when-idle"], ["status"]])
def test_one_outbox_in_two_file_tables_is_refused_by_the_cli(
    pg_url: str, tmp_path: Path, command: list[str]
) -> None:
    first, second = _same_database_twice(pg_url)
    config = tmp_path / "outboxer.toml"
    config.write_text(
        'broker = "memory://audit12"\n'
        f'[databases.orders]\nurl = "{first}"\n'
        f'[databases.orders_again]\nurl = "{second}"\n'
    )
    ran = cli(*command, "--config", str(config), timeout=60)
    assert ran.returncode == 2, (ran.returncode, ran.stdout, ran.stderr)
    assert "databases 'orders' and 'orders_again' are the same outbox" in ran.stderr
    assert "Traceback" not in ran.stderr
    assert ran.stdout == ""


def test_the_same_database_in_a_repeated_db_flag_is_refused_by_the_cli(pg_url: str) -> None:
    first, second = _same_database_twice(pg_url)
    ran = cli(
        "relay", "--exit-when-idle", "--broker", "memory://audit12", "--db", first, "--db", second
    )
    assert ran.returncode == 2, (ran.returncode, ran.stdout, ran.stderr)
    assert "databases 'db1' and 'db2' are the same outbox" in ran.stderr


def test_two_tables_of_one_database_stay_two_outboxes_for_the_cli(
    pg_url: str, tmp_path: Path
) -> None:
    first, second = _same_database_twice(pg_url)
    config = tmp_path / "outboxer.toml"
    config.write_text(
        'broker = "memory://audit12"\n'
        f'[databases.orders]\nurl = "{first}"\n'
        f'[databases.billing]\nurl = "{second}"\ntable = "billing_outbox"\n'
    )
    applied = cli("schema", "apply", "--config", str(config))
    assert applied.returncode == 0, applied.stderr
    ran = cli("relay", "--exit-when-idle", "--config", str(config))
    assert ran.returncode == 0, ran.stderr
