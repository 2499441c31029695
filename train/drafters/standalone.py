"""A small standalone draft model (a causal LM with the target's tokenizer), distilled from the target.

Leviathan et al., "Fast Inference from Transformers via Speculative Decoding" (ICML 2023); Chen et al.,
"Accelerating Large Language Model Decoding with Speculative Sampling" (2023). The draft is a plain
Hugging Face causal LM of the target's own architecture (``AutoModelForCausalLM.from_config`` on a copy of
the target's config with ``num_hidden_layers = num_layers``, sdpa attention), so the saved directory loads
with ``AutoModelForCausalLM.from_pretrained`` and serves in vLLM/transformers as an ordinary draft model.

Initialisation (``init``):

* ``target``: the embeddings, final norm, LM head (tied if the target ties) and the target layers
  ``layer_ids`` (default: evenly spaced, first and last included) are copied; needs the target's hidden
  size, intermediate size and head counts.
* ``scratch``: a fresh random model; the embeddings (and an untied LM head) are still copied from the
  target when the hidden size equals the target's, since they are the most expensive part to learn.
* ``pretrained``: an existing HF causal LM directory (``pretrained_path``, safetensors) whose tokenizer must
  equal the target's (checked with both tokenizers before anything is built).

Loss (target-written positions only: the prediction at t for token t+1 counts where ``loss_mask[t+1]``; with
``loss_on_prompt`` wherever x[t+1] is a real token, since the target's distribution is known there too):
``kl`` = forward KL(p_target || q_draft), ``tv`` = total variation ``0.5 * sum |p - q|`` (the expected
greedy/sampled acceptance is ``1 - TV``), ``kl_tv`` = their sum. Both LM heads run only on counted rows.
Decoding (``eval.proposers.draft_model.DraftModelProposer``, chain or EAGLE-2-style dynamic tree) is exact.
"""

from __future__ import annotations

import copy
import json
import logging
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any, ClassVar

import torch
from accelerate.utils import extract_model_from_parallel
from torch import nn

from data.atomic import atomic_write_json
from data.config import Bound, Choice, Choices, ConfigError, at_least
from eval.config import DRAFT_SHAPE_BOUNDS, Decode
from eval.proposers.draft_model import DraftModelProposer, check_vocab_compatibility
from train.drafters.registry import DrafterSpec, TargetFeatures, TrainBatch, register

logger = logging.getLogger(__name__)


class Init(Choice):
    target = "target"
    scratch = "scratch"
    pretrained = "pretrained"


class Loss(Choice):
    kl = "kl"
    tv = "tv"
    kl_tv = "kl_tv"


@dataclass
class StandaloneConfig(Choices):
    """A small causal LM with the target's tokenizer, distilled on the synth data."""

    config_key: ClassVar[str] = "drafter"
    bounds: ClassVar[dict[str, Bound]] = {
        **{k: at_least(1) for k in ("num_layers", "hidden_size", "intermediate_size")},
        **{k: at_least(1) for k in ("num_attention_heads", "num_key_value_heads")},
        "layer_ids": at_least(0),
        **DRAFT_SHAPE_BOUNDS,
    }
    name: str = "standalone"
    init: Init = Init.target
    """target (embeddings, LM head and ``layer_ids`` copied from the target) | scratch | pretrained
    (an existing HF causal LM at ``pretrained_path`` with the target's tokenizer)."""
    pretrained_path: str | None = None
    num_layers: int = 4
    layer_ids: list[int] | None = None
    """Target layers copied when init=target (default: evenly spaced, first and last included)."""
    hidden_size: int | None = None
    """None = the target's (required for init=target)."""
    intermediate_size: int | None = None
    num_attention_heads: int | None = None
    num_key_value_heads: int | None = None
    loss: Loss = Loss.kl
    """kl (forward KL to the target's next-token distribution) | tv (total variation) | kl_tv (sum)."""
    loss_on_prompt: bool = False
    """Also distil at prompt positions (the target's next-token distribution after each prompt token, computed
    anyway); off = only where the next token is target-written."""
    freeze_embeddings: bool = True
    """Freeze the input embeddings (and the LM head when it is tied to them)."""
    gradient_checkpointing: bool = True
    decode: Decode = Decode.tree
    chain_k: int = 5
    tree_depth: int = 5
    tree_top_k: int = 4
    tree_total_tokens: int = 16


_SHAPE_KEYS = ("hidden_size", "intermediate_size", "num_attention_heads", "num_key_value_heads")


def default_layer_ids(num_layers: int, target_layers: int) -> list[int]:
    """``num_layers`` target layer indices, evenly spaced with the first and the last included."""
    if num_layers == 1:
        return [target_layers - 1]
    return [round(i * (target_layers - 1) / (num_layers - 1)) for i in range(num_layers)]


def _validate(cfg: StandaloneConfig, tcfg: Any) -> None:
    errors = []
    if cfg.init != "pretrained" and cfg.num_layers < 1:
        errors.append(f"drafter.num_layers={cfg.num_layers} must be >= 1")
    if cfg.init == "pretrained" and not cfg.pretrained_path:
        errors.append("drafter.init=pretrained needs drafter.pretrained_path (a HF causal LM directory)")
    if cfg.init == "target":
        differ = [
            f"{k}={getattr(cfg, k)} (target: {getattr(tcfg, k)})"
            for k in _SHAPE_KEYS
            if getattr(cfg, k) is not None and getattr(cfg, k) != getattr(tcfg, k)
        ]
        if differ:
            errors.append(
                "drafter.init=target copies target layers, so the layer shapes must be the target's: "
                f"{', '.join(differ)}; drop these overrides or use drafter.init=scratch"
            )
        n = tcfg.num_hidden_layers
        if cfg.layer_ids is not None:
            if len(cfg.layer_ids) != cfg.num_layers:
                errors.append(f"drafter.layer_ids={cfg.layer_ids} must name num_layers={cfg.num_layers} layers")
            bad = [i for i in cfg.layer_ids if not 0 <= i < n]
            if bad:
                errors.append(f"drafter.layer_ids {bad} are not target layers (0..{n - 1})")
        elif cfg.num_layers > n:
            errors.append(f"drafter.num_layers={cfg.num_layers} > the target's {n} layers (init=target)")
    if (
        cfg.init == "scratch"
        and cfg.freeze_embeddings
        and cfg.hidden_size is not None
        and cfg.hidden_size != tcfg.hidden_size
    ):
        errors.append(
            f"drafter.init=scratch with hidden_size={cfg.hidden_size} != the target's {tcfg.hidden_size} cannot "
            "copy the target's embeddings, and freeze_embeddings=true would freeze random ones: set "
            "drafter.freeze_embeddings=false"
        )
    if errors:
        raise ConfigError("Invalid standalone drafter config:\n  - " + "\n  - ".join(errors))


def _draft_config(cfg: StandaloneConfig, tcfg: Any) -> Any:
    conf = copy.deepcopy(tcfg)
    for attr in ("draftsmith", "quantization_config"):
        if hasattr(conf, attr):
            delattr(conf, attr)
    conf.num_hidden_layers = cfg.num_layers
    if isinstance(getattr(conf, "layer_types", None), list):  # e.g. sliding/full attention per layer
        ids = cfg.layer_ids or default_layer_ids(cfg.num_layers, tcfg.num_hidden_layers)
        conf.layer_types = [tcfg.layer_types[i] for i in ids]
    for k in _SHAPE_KEYS:
        if getattr(cfg, k) is not None:
            setattr(conf, k, getattr(cfg, k))
    if cfg.hidden_size is not None or cfg.num_attention_heads is not None:
        if conf.hidden_size % conf.num_attention_heads:
            raise ConfigError(
                f"drafter.hidden_size={conf.hidden_size} is not divisible by num_attention_heads="
                f"{conf.num_attention_heads}"
            )
        if hasattr(conf, "head_dim"):
            conf.head_dim = conf.hidden_size // conf.num_attention_heads
    if conf.num_attention_heads % conf.num_key_value_heads:
        raise ConfigError(
            f"drafter num_attention_heads={conf.num_attention_heads} is not a multiple of "
            f"num_key_value_heads={conf.num_key_value_heads}"
        )
    return conf


def _copy_from_target(draft: nn.Module, target: nn.Module, layer_ids: list[int] | None) -> None:
    """Copy target tensors into ``draft`` by name; draft layer i <- target layer ``layer_ids[i]``.

    With ``layer_ids=None`` only the tensors outside the decoder layers are copied (when shapes match).
    """
    src = target.state_dict()
    own = draft.state_dict()
    state: dict[str, torch.Tensor] = {}
    for key, value in own.items():
        parts = key.split(".")
        name = key
        if "layers" in parts:
            if layer_ids is None:
                continue
            at = parts.index("layers") + 1
            parts[at] = str(layer_ids[int(parts[at])])
            name = ".".join(parts)
        if name in src and src[name].shape == value.shape:
            state[key] = src[name]
        elif layer_ids is not None:
            raise ConfigError(f"init=target: cannot copy {name} from the target into the draft's {key}")
    with torch.no_grad():
        draft.load_state_dict(state, strict=False)
    if getattr(draft.config, "tie_word_embeddings", False):
        draft.tie_weights()


def build(cfg: StandaloneConfig, target: Any) -> nn.Module:
    from transformers import AutoModelForCausalLM

    tcfg = target.config
    _validate(cfg, tcfg)
    if cfg.init == "pretrained":
        assert cfg.pretrained_path is not None
        draft = _load_hf(cfg.pretrained_path, torch.float32)
        _check_vocab_size(draft, tcfg, cfg.pretrained_path)
    else:
        conf = _draft_config(cfg, tcfg)
        draft = sdpa_or_eager(
            lambda impl: AutoModelForCausalLM.from_config(conf, attn_implementation=impl, dtype=torch.float32)
        )
        if cfg.init == "target":
            ids = cfg.layer_ids or default_layer_ids(cfg.num_layers, tcfg.num_hidden_layers)
            _copy_from_target(draft, target, list(ids))
        elif conf.hidden_size == tcfg.hidden_size:
            _copy_from_target(draft, target, None)  # scratch: embeddings (and an untied LM head) only
    if cfg.freeze_embeddings:
        draft.get_input_embeddings().weight.requires_grad_(False)  # the tied LM head is the same tensor
    if cfg.gradient_checkpointing:
        kwargs = {"use_reentrant": False}  # trains with frozen (no-grad) embeddings feeding the first layer
        if hasattr(draft, "activation_checkpointing_enable"):  # transformers >= 5.x name
            draft.activation_checkpointing_enable(activation_checkpointing_kwargs=kwargs)
        else:
            draft.gradient_checkpointing_enable(gradient_checkpointing_kwargs=kwargs)
    return draft.to(next(target.parameters()).dtype)


def sdpa_or_eager(make: Callable[[str], nn.Module]) -> nn.Module:
    """``make("sdpa")``, or ``make("eager")`` for an architecture without an sdpa attention (GPT-OSS, whose attention
    sinks transformers computes eagerly); both take the decoder's custom 4D tree masks."""
    try:
        return make("sdpa")
    except ValueError as exc:
        if "attention implementation" not in str(exc):
            raise
        logger.info("no sdpa attention for this architecture (%s); eager attention", str(exc).split(".")[0])
        return make("eager")


def _load_hf(path: str, dtype: torch.dtype) -> nn.Module:
    from transformers import AutoModelForCausalLM

    p = Path(path)
    if not (p / "config.json").is_file():
        raise ConfigError(f"drafter.pretrained_path={path!r} is not a Hugging Face model directory (no config.json)")
    if not list(p.glob("*.safetensors")):
        raise ConfigError(f"{path!r} holds no safetensors weights (only safetensors checkpoints are loaded)")
    return sdpa_or_eager(
        lambda impl: AutoModelForCausalLM.from_pretrained(
            p, dtype=dtype, attn_implementation=impl, use_safetensors=True
        )
    )


def _check_vocab_size(draft: nn.Module, tcfg: Any, where: str) -> None:

    try:
        check_vocab_compatibility(int(tcfg.vocab_size), int(draft.config.get_text_config().vocab_size))
    except ValueError as exc:
        raise ConfigError(f"draft model {where} does not fit this target: {exc}") from exc


def check(cfg: StandaloneConfig, target: Any) -> None:
    """Refuse before building: a bad config, or a pretrained draft whose tokenizer is not the target's."""
    _validate(cfg, target.model.config)
    if cfg.init != "pretrained":
        return
    from transformers import AutoConfig, AutoTokenizer

    path = str(cfg.pretrained_path)
    if not (Path(path) / "config.json").is_file():
        raise ConfigError(f"drafter.pretrained_path={path!r} is not a Hugging Face model directory (no config.json)")
    try:
        draft_tok = AutoTokenizer.from_pretrained(path)
    except Exception as exc:  # transformers raises many types for a missing/bad tokenizer
        raise ConfigError(
            f"drafter.pretrained_path={path!r} has no loadable tokenizer ({exc}); the draft must ship the "
            f"target's tokenizer files so the shared vocabulary can be checked"
        ) from exc
    vocab = int(AutoConfig.from_pretrained(path).get_text_config().vocab_size)
    try:
        check_vocab_compatibility(int(target.model.config.vocab_size), vocab, target.tokenizer, draft_tok)
        check_vocab_compatibility(int(target.model.config.vocab_size), vocab)  # the loss needs equal logit sizes
    except ValueError as exc:
        raise ConfigError(f"drafter.pretrained_path={path!r} cannot draft for target {target.path!r}: {exc}") from exc


def distill_terms(t_logits: torch.Tensor, d_logits: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """Per-row forward KL(p || q) and total variation between target logits and draft logits ``[N, V]``."""
    t_logp = torch.log_softmax(t_logits.float(), -1)
    d_logp = torch.log_softmax(d_logits.float(), -1)
    p = t_logp.exp()
    kl = (p * (t_logp - d_logp)).sum(-1)
    tv = 0.5 * (p - d_logp.exp()).abs().sum(-1)
    return kl, tv


def loss_fn(
    model: nn.Module, batch: TrainBatch, feats: TargetFeatures, cfg: StandaloneConfig
) -> tuple[torch.Tensor, dict[str, torch.Tensor]]:
    """Distillation on positions t whose next token x[t+1] was written by the target."""
    B, L = batch.input_ids.shape
    keep = torch.zeros(B, L, dtype=torch.bool, device=batch.input_ids.device)
    am = batch.attention_mask[:, 1:]
    keep[:, :-1] = (am if cfg.loss_on_prompt else batch.loss_mask[:, 1:] * am).bool()
    # The draft's LM head runs only on the columns some row keeps (a 1D logits_to_keep: every transformers 5.x
    # takes it; a 2D boolean one only from ~5.2x), then the kept rows are picked out: [N, V].
    cols = keep.any(0).nonzero().squeeze(1)
    out = model(input_ids=batch.input_ids, attention_mask=batch.attention_mask, use_cache=False, logits_to_keep=cols)
    d_logits = out.logits[keep[:, cols]]
    with torch.no_grad():
        t_logits = feats.lm_head(feats.last[keep].to(feats.lm_head.weight.dtype)).float()
    n = max(1, d_logits.shape[0])
    kl, tv = distill_terms(t_logits, d_logits)
    kl, tv = kl.sum() / n, tv.sum() / n
    loss = {"kl": kl, "tv": tv, "kl_tv": kl + tv}[cfg.loss]
    with torch.no_grad():
        acc = (d_logits.argmax(-1) == t_logits.argmax(-1)).float().sum() / n
        tokens = torch.tensor(float(d_logits.shape[0]))
    return loss, {"acc_top1_pos1": acc, "tv": tv.detach(), "kl": kl.detach(), "tokens": tokens}


def save(model: nn.Module, directory: str, cfg: StandaloneConfig, target: Any = None) -> None:
    """A plain HF directory (``config.json`` with ``draftsmith.drafter``, safetensors) with the tokenizer of
    ``target`` (``data.target.Target``; without it, no tokenizer files and a warning)."""
    draft = extract_model_from_parallel(model)
    out = Path(directory)
    out.mkdir(parents=True, exist_ok=True)
    draft.save_pretrained(str(out), safe_serialization=True)
    meta = json.loads((out / "config.json").read_text(encoding="utf-8"))
    meta["draftsmith"] = {"drafter": asdict(cfg)}
    atomic_write_json(out / "config.json", meta)
    if target is not None:
        target.tokenizer.save_pretrained(str(out))
    else:
        logger.warning("standalone drafter saved to %s without tokenizer files (no target given)", out)


def load(directory: str, target: Any, cfg: StandaloneConfig | None = None) -> nn.Module:
    path = Path(directory)
    if not (path / "config.json").is_file() or not list(path.glob("*.safetensors")):
        raise ValueError(f"{path} is not a saved standalone drafter (config.json + safetensors)")
    from transformers import AutoModelForCausalLM

    dtype = next(target.parameters()).dtype
    draft = sdpa_or_eager(
        lambda impl: AutoModelForCausalLM.from_pretrained(
            path, dtype=dtype, attn_implementation=impl, use_safetensors=True
        )
    )
    draft_vocab, target_vocab = int(draft.config.get_text_config().vocab_size), int(target.config.vocab_size)
    if draft_vocab != target_vocab:
        raise ValueError(
            f"standalone drafter in {path} has vocab_size={draft_vocab}, this target has {target_vocab}: "
            f"it was trained for another target (a draft must share the target's tokenizer)"
        )
    return draft.to(next(target.parameters()).device).eval().requires_grad_(False)


def make_proposer(model: nn.Module, target: Any, cfg: StandaloneConfig) -> Any:

    return DraftModelProposer(
        extract_model_from_parallel(model),
        target.config.vocab_size,
        num_tokens=cfg.chain_k,
        mode="chain" if cfg.decode == "chain" else "tree",
        tree_depth=cfg.tree_depth,
        tree_top_k=cfg.tree_top_k,
        tree_total_tokens=cfg.tree_total_tokens,
    )


SPEC = register(
    DrafterSpec(
        name="standalone",
        export_module="train.export.standalone",
        config_cls=StandaloneConfig,
        build=build,
        loss=loss_fn,
        proposer=make_proposer,
        load=load,
        save=save,
        check=check,
    )
)
