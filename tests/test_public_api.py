from __future__ import annotations

import kvpool


def test_all_names_exist_and_are_exported_explicitly() -> None:
    for name in kvpool.__all__:
        assert hasattr(kvpool, name), name
    public = {n for n in vars(kvpool) if not n.startswith("_")}
    modules = {"core", "errors", "cli", "annotations"}
    assert public - modules - set(kvpool.__all__) == set()
