from __future__ import annotations

import json
from pathlib import Path

import pytest

from kvpool.ops.up.tiny_model import build_tiny_model, main, sample_text


def test_build_is_deterministic(tmp_path: Path) -> None:
    a = build_tiny_model(tmp_path / "a", seed=3)
    b = build_tiny_model(tmp_path / "b", seed=3)
    names = sorted(p.name for p in a.iterdir())
    assert "model.safetensors" in names and "tokenizer.json" in names
    for name in names:
        assert (a / name).read_bytes() == (b / name).read_bytes(), name


def test_config_shape_and_tokenizer_round_trip(tmp_path: Path) -> None:
    from tokenizers import Tokenizer

    path = build_tiny_model(tmp_path / "m", layers=3, hidden=256, heads=4, kv_heads=2)
    cfg = json.loads((path / "config.json").read_text())
    assert (cfg["num_hidden_layers"], cfg["hidden_size"], cfg["head_dim"]) == (3, 256, 64)
    assert cfg["num_key_value_heads"] == 2
    tok = Tokenizer.from_file(str(path / "tokenizer.json"))
    text = sample_text(50, seed=1) + " ünïcode ✓"
    ids = tok.encode(text).ids
    assert max(ids) < cfg["vocab_size"]
    assert tok.decode(ids) == text


def test_no_weights_and_bad_shape(tmp_path: Path) -> None:
    path = build_tiny_model(tmp_path / "d", weights=False)
    assert not (path / "model.safetensors").exists()
    with pytest.raises(ValueError, match="kv_heads"):
        build_tiny_model(tmp_path / "x", heads=3, kv_heads=2)


def test_cli_bench_preset(tmp_path: Path, capsys: pytest.CaptureFixture[str]) -> None:
    assert main([str(tmp_path / "b"), "--preset", "bench", "--no-weights"]) == 0
    cfg = json.loads((tmp_path / "b" / "config.json").read_text())
    assert cfg["hidden_size"] == 1024
    assert str(tmp_path / "b") in capsys.readouterr().out
