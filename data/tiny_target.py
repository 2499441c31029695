"""Tiny random-weight targets of the architectures users serve, saved as Hugging Face directories.

They exist to check that every stage works on a target's *architecture* (its config, hidden states, cache, LM
head) in seconds, without downloading a model: a few small decoder layers of Llama, Qwen3, Qwen3-MoE,
Mistral, Gemma 3, GPT-OSS, ... built from transformers' own config classes with random weights, and the
embedded target's tokenizer and chat template (so real traffic renders). Their text is noise; what they prove is
that the code paths of the architecture run and stay exact (replay == decode, outputs identical to plain).

    python -m data.tiny_target --arch qwen3 --out /tmp/tiny-qwen3
    python -m train stage=all experiment=quickstart target=hf target.path=/tmp/tiny-qwen3

``--arch list`` prints the architectures.
"""

from __future__ import annotations

import argparse
import logging
from collections.abc import Callable
from pathlib import Path
from typing import Any

import torch

from data.atomic import atomic_dir
from data.config import TargetConfig
from data.target import resolve_target_path

logger = logging.getLogger(__name__)

HIDDEN = 128
LAYERS = 8
HEADS = 2
KV_HEADS = 1
HEAD_DIM = 64
INTERMEDIATE = 256

_COMMON: dict[str, Any] = {
    "hidden_size": HIDDEN,
    "num_hidden_layers": LAYERS,
    "num_attention_heads": HEADS,
    "num_key_value_heads": KV_HEADS,
    "intermediate_size": INTERMEDIATE,
    "max_position_embeddings": 4096,
}


def _moe(**kw: Any) -> dict[str, Any]:
    return {"num_experts": 4, "num_experts_per_tok": 2, "moe_intermediate_size": 64, **kw}


ARCHITECTURES: dict[str, tuple[str, Callable[[], dict[str, Any]]]] = {
    # name: (transformers config class, extra settings); the common dimensions are added to each
    "llama": ("LlamaConfig", lambda: {"head_dim": HEAD_DIM, "tie_word_embeddings": True}),
    "qwen2": ("Qwen2Config", lambda: {"tie_word_embeddings": False}),
    "qwen3": ("Qwen3Config", lambda: {"head_dim": HEAD_DIM, "tie_word_embeddings": False}),
    "qwen3_moe": ("Qwen3MoeConfig", lambda: _moe(head_dim=HEAD_DIM, decoder_sparse_step=1, mlp_only_layers=[])),
    "mistral": ("MistralConfig", lambda: {"head_dim": HEAD_DIM, "sliding_window": 16}),
    "gemma3": (
        "Gemma3TextConfig",
        lambda: {"head_dim": HEAD_DIM, "sliding_window": 16, "query_pre_attn_scalar": HEAD_DIM},
    ),
    "gemma2": ("Gemma2Config", lambda: {"head_dim": HEAD_DIM, "sliding_window": 16}),
    "phi3": ("Phi3Config", lambda: {"pad_token_id": 0}),
    "gpt_oss": (
        "GptOssConfig",
        lambda: {
            "head_dim": HEAD_DIM,
            "num_local_experts": 4,
            "num_experts_per_tok": 2,
            "sliding_window": 16,
            "intermediate_size": 64,
        },
    ),
    "olmo2": ("Olmo2Config", lambda: {"pad_token_id": 0}),
    "granite": ("GraniteConfig", lambda: {}),
    "mixtral": ("MixtralConfig", lambda: {"num_local_experts": 4, "num_experts_per_tok": 2}),
    # beyond the usual ones: multi-head latent attention, logit scaling, partial rotary, learned positions, ...
    "deepseek_v3": (
        "DeepseekV3Config",
        lambda: {
            "num_key_value_heads": HEADS,
            "kv_lora_rank": 32,
            "q_lora_rank": 32,
            "qk_rope_head_dim": 16,
            "qk_nope_head_dim": 32,
            "v_head_dim": 32,
            "n_routed_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
            "first_k_dense_replace": 1,
            "n_group": 1,
            "topk_group": 1,
        },
    ),
    "cohere": ("CohereConfig", lambda: {"logit_scale": 0.5}),
    "glm4": ("Glm4Config", lambda: {"head_dim": HEAD_DIM}),
    "gpt2": ("GPT2Config", lambda: {"n_embd": HIDDEN, "n_layer": LAYERS, "n_head": HEADS, "n_positions": 4096}),
    "falcon": ("FalconConfig", lambda: {}),
    "starcoder2": ("Starcoder2Config", lambda: {"sliding_window": 16}),
    "smollm3": ("SmolLM3Config", lambda: {}),
    "olmoe": ("OlmoeConfig", lambda: {"num_experts": 4, "num_experts_per_tok": 2}),
    "ernie4_5": ("Ernie4_5Config", lambda: {"head_dim": HEAD_DIM}),
    "exaone4": ("Exaone4Config", lambda: {"sliding_window": 16}),
}
REFUSED = {
    "qwen3_next": (
        "Qwen3NextConfig",
        lambda: {
            "head_dim": HEAD_DIM,
            "linear_num_value_heads": 2,
            "linear_num_key_heads": 2,
            "linear_key_head_dim": 32,
            "linear_value_head_dim": 32,
            "num_experts": 4,
            "num_experts_per_tok": 2,
            "moe_intermediate_size": 64,
        },
    ),
    "llama4_text": (
        "Llama4TextConfig",
        lambda: {
            "head_dim": HEAD_DIM,
            "num_local_experts": 2,
            "intermediate_size_mlp": 256,
            "attention_chunk_size": 16,
        },
    ),
}
"""Architectures the drafters cannot work with (linear attention's recurrent state, chunked attention), which
``load_target`` refuses naming them; built by the same function for the tests of that refusal."""


def tiny_config(arch: str, vocab_size: int, special: dict[str, int | None]) -> Any:
    """The transformers config of a tiny ``arch`` target with ``vocab_size`` tokens."""
    import transformers

    known = {**ARCHITECTURES, **REFUSED}
    if arch not in known:
        raise ValueError(f"unknown architecture {arch!r}; one of: {', '.join(known)}")
    cls_name, extra = known[arch]
    cls = getattr(transformers, cls_name, None)
    if cls is None:
        raise ValueError(f"this transformers ({transformers.__version__}) has no {cls_name}")
    kw = {**_COMMON, **extra(), "vocab_size": vocab_size, **{k: v for k, v in special.items() if v is not None}}
    return cls(**kw)


def make_tiny_target(arch: str, out: str | Path, tokenizer_dir: str | Path | None = None, seed: int = 0) -> Path:
    """Write a random-weight ``arch`` target with the tokenizer of ``tokenizer_dir`` (default: the embedded
    target's) to ``out`` (atomically; an existing complete directory is kept). Returns ``out``."""
    from transformers import AutoModelForCausalLM, AutoTokenizer

    out = Path(out)
    if (out / "config.json").is_file():
        return out
    if tokenizer_dir is None:
        tokenizer_dir = resolve_target_path(TargetConfig())
    tok = AutoTokenizer.from_pretrained(str(tokenizer_dir))
    special = {"bos_token_id": tok.bos_token_id, "eos_token_id": tok.eos_token_id, "pad_token_id": tok.pad_token_id}
    config = tiny_config(arch, len(tok), special)
    torch.manual_seed(seed)
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    with torch.no_grad():  # random init at the usual std gives near-uniform logits; sharpen them a little
        for p in model.parameters():
            if p.dim() >= 2:
                p.normal_(0.0, 0.08)
    out.parent.mkdir(parents=True, exist_ok=True)
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
    logger.info(
        "tiny %s target (%s, %d layers, hidden %d) written to %s", arch, type(model).__name__, LAYERS, HIDDEN, out
    )
    return out


def main(argv: list[str] | None = None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--arch", required=True, help="an architecture name, or 'list'")
    ap.add_argument("--out", help="the directory to write")
    ap.add_argument("--seed", type=int, default=0)
    args = ap.parse_args(argv)
    if args.arch == "list":
        print("\n".join(f"{k}\t{v[0]}" for k, v in ARCHITECTURES.items()))
        print("\n".join(f"{k}\t{v[0]}\t(refused by load_target)" for k, v in REFUSED.items()))
        return 0
    if not args.out:
        ap.error("--out is required")
    logging.basicConfig(level=logging.INFO, format="%(levelname)s %(message)s")
    print(make_tiny_target(args.arch, args.out, seed=args.seed))
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
