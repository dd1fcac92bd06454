from __future__ import annotations

import types

import kvpool


def test_all_names_exist_and_are_exported_explicitly() -> None:
    for name in kvpool.__all__:
        assert hasattr(kvpool, name), name
    public = {
        n
        for n, v in vars(kvpool).items()
        if not n.startswith("_") and not isinstance(v, types.ModuleType)
    }
    assert public - {"annotations"} - set(kvpool.__all__) == set()
