from __future__ import annotations

from outboxer.stores.sqlfiles import migrations, queries, to_numbered, to_pyformat


def test_parameters_convert_and_casts_survive() -> None:
    sql = "SELECT :a, :b::text, CAST(:a AS int), '10%' WHERE x = :c"
    assert to_numbered(sql) == (
        "SELECT $1, $2::text, CAST($1 AS int), '10%' WHERE x = $3",
        ("a", "b", "c"),
    )
    assert (
        to_pyformat(sql) == "SELECT %(a)s, %(b)s::text, CAST(%(a)s AS int), '10%%' WHERE x = %(c)s"
    )


def test_every_dialect_has_the_queries_the_relay_needs() -> None:
    needed = {"insert", "claim", "cleanup", "counts", "list", "requeue"}
    # PostgreSQL settles in one call of a function (migration 0004); the others run each UPDATE.
    settles = {
        "postgres": {"settle"},
        "sqlite": {"settle_published", "settle_failed", "release"},
        "mysql": {"settle_published", "settle_failed", "release", "claim_update", "key_lock"},
    }
    for dialect in ("postgres", "sqlite", "mysql"):
        assert needed | settles[dialect] <= set(queries(dialect)), dialect
        # Applied by version; numbers are reserved per feature, so there may be gaps.
        versions = [m.version for m in migrations(dialect)]
        assert versions == sorted(set(versions)) and versions[0] == 1, versions
        assert {"insert", "key_blocked", "list", "delete", "failed_again"} <= set(
            queries(dialect, "consumer.sql")
        ), dialect
