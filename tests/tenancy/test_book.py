"""kvpool.tenancy.book: namespaces and per-tenant accounting, without a master."""

from __future__ import annotations

import pytest

from kvpool.tenancy.book import TenantBook, scoped, tenant_of, unscoped


def test_scoped_keys_name_their_tenant_and_only_it() -> None:
    assert scoped("red", "k") == "@red/k" and scoped("", "k") == "k"
    assert unscoped("red", "@red/k") == "k" and unscoped("red", "@blue/k") == "@blue/k"
    assert tenant_of("@red/k") == "red" and tenant_of("@red/@blue/k") == "red"
    assert tenant_of("k") == "" and tenant_of("@/k") == "" and tenant_of("@red") == ""
    # a tenant's key spelled like another's stored name stays in its own namespace
    assert tenant_of(scoped("blue", "@red/k")) == "blue"


def test_the_book_counts_an_object_once_from_reservation_to_drop() -> None:
    book = TenantBook()
    book.set_quota("red", 300)
    book.reserved("@red/a", 100)
    assert book.tenants["red"].bytes == 100 and book.tenants["red"].objects == 0
    book.reserved("@red/a", 100)  # its own retry: still one reservation
    book.stored("@red/a")
    book.stored("@red/a")
    assert (book.tenants["red"].bytes, book.tenants["red"].objects) == (100, 1)
    book.reserved("@nobody/x", 10**9)  # a tenant the book does not keep: ignored
    assert "nobody" not in book.tenants
    assert book.over_by("@red/b", 200) == 0 and book.over_by("@red/b", 250) == 50
    book.dropped("@red/a")
    book.dropped("@red/a")
    assert (book.tenants["red"].bytes, book.tenants["red"].objects) == (0, 0)
    with pytest.raises(ValueError, match="quota"):
        book.set_quota("red", -1)


def test_victims_are_the_tenants_own_least_recently_used() -> None:
    book = TenantBook()
    book.set_quota("red", 1000)
    book.add("blue")
    for key in ("@red/a", "@red/b", "@blue/a", "@red/c"):
        book.reserved(key, 10)
        book.stored(key)
    book.hit("@red/a")
    book.reserved("@red/pending", 10)  # being written: never a victim
    assert [k for k, _ in book.victims("@red/new")] == ["@red/b", "@red/c", "@red/a"]
    assert book.tenants["red"].hits == 1
