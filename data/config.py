"""The configuration of the data layer: the target, prompt sources, the synth stage, W&B, and the helpers every
stage uses to compare configs. The root :class:`train.config.Config` nests these dataclasses; code in ``data``
and ``eval`` imports them from here (the layers import downwards only: data <- eval <- train).
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, field, fields, is_dataclass
from enum import Enum, StrEnum
from typing import Any, ClassVar, Protocol, get_type_hints


class ConfigError(ValueError):
    """A configuration value or key is wrong; the message says which and what is allowed."""


class TargetError(RuntimeError):
    """The target model or its tokenizer could not be loaded or is unusable; the message says why."""


@dataclass(frozen=True)
class Bound:
    """The allowed range of a numeric config value: part of the schema (a config dataclass's ``bounds``), checked
    for the whole config tree at once by :func:`check_bounds` before any stage does work. ``None`` (an optional
    key left unset) is always allowed; a list of numbers is checked element by element."""

    lo: float | None = None
    hi: float | None = None
    lo_open: bool = False
    hi_open: bool = False
    hint: str = ""
    """Said after the range, e.g. ``0 = off``."""

    def allows(self, value: float) -> bool:
        if self.lo is not None and (value <= self.lo if self.lo_open else value < self.lo):
            return False
        return not (self.hi is not None and (value >= self.hi if self.hi_open else value > self.hi))

    def describe(self) -> str:
        if self.hi is None:
            return f"{'>' if self.lo_open else '>='} {self.lo:g}"
        if self.lo is None:
            return f"{'<' if self.hi_open else '<='} {self.hi:g}"
        return f"in {'(' if self.lo_open else '['}{self.lo:g}, {self.hi:g}{')' if self.hi_open else ']'}"


def at_least(lo: float, hint: str = "") -> Bound:
    return Bound(lo=lo, hint=hint)


def above(lo: float, hint: str = "") -> Bound:
    return Bound(lo=lo, lo_open=True, hint=hint)


def between(lo: float, hi: float, lo_open: bool = False, hi_open: bool = False, hint: str = "") -> Bound:
    return Bound(lo=lo, hi=hi, lo_open=lo_open, hi_open=hi_open, hint=hint)


def bound_errors(obj: Any, prefix: str = "") -> list[str]:
    """Every value of a config tree (dataclasses, dicts and lists of them) outside its field's :class:`Bound`,
    as ``key=value must be <range>`` lines. A dataclass declares its bounds in a ``bounds`` class attribute."""
    errors: list[str] = []
    if isinstance(obj, dict):
        for k, v in obj.items():
            errors.extend(bound_errors(v, f"{prefix}{k}."))
        return errors
    if not (is_dataclass(obj) and not isinstance(obj, type)):
        return errors
    bounds: dict[str, Bound] = getattr(type(obj), "bounds", {})
    unknown = set(bounds) - {f.name for f in fields(obj)}
    if unknown:
        raise TypeError(f"{type(obj).__name__}.bounds names no field: {sorted(unknown)}")
    for f in fields(obj):
        value = getattr(obj, f.name)
        key = f"{prefix}{f.name}"
        bound = bounds.get(f.name)
        if bound is None:
            errors.extend(bound_errors(value, key + "."))
            continue
        for v in value if isinstance(value, list | tuple) else [value]:
            if v is None or isinstance(v, bool) or not isinstance(v, int | float):
                continue
            if v != v or not bound.allows(v):  # NaN is never in range
                hint = f" ({bound.hint})" if bound.hint else ""
                errors.append(f"{key}={v!r} must be {bound.describe()}{hint}")
    return errors


def check_bounds(obj: Any, prefix: str = "") -> None:
    """:class:`ConfigError` listing every value of the config tree ``obj`` outside its bounds (all at once)."""
    errors = bound_errors(obj, prefix)
    if errors:
        raise ConfigError("Invalid config:\n  - " + "\n  - ".join(errors))


class Choice(StrEnum):
    """A config value from a fixed set. Members are named as their values, so Hydra/OmegaConf accept the plain
    string from YAML or the command line (and refuse others at compose time, naming the valid ones), JSON
    manifests hold the string, and a member compares, hashes and formats as its string."""

    @classmethod
    def parse(cls, value: Any, key: str) -> Choice:
        try:
            return cls(value)
        except ValueError:
            raise ConfigError(f"{key}={value!r} is not one of: {', '.join(cls.values())}") from None

    @classmethod
    def values(cls) -> list[str]:
        return [m.value for m in cls]


def choice_fields(cls: type) -> dict[str, type[Choice]]:
    """The fields of a config dataclass typed with a :class:`Choice` (``Optional`` included)."""
    hints = get_type_hints(cls)
    out: dict[str, type[Choice]] = {}
    for f in fields(cls):
        tp = hints[f.name]
        for t in (tp, *getattr(tp, "__args__", ())):
            if isinstance(t, type) and issubclass(t, Choice):
                out[f.name] = t
    return out


class Choices:
    """Mixin for config dataclasses: each :class:`Choice` field is parsed once, in ``__post_init__``, so a value
    given as a string (a manifest read back, a config built in code) is refused with the valid ones listed."""

    config_key: ClassVar[str] = ""
    """The section's key in the config tree (``synth``, ``drafter``...), for error messages."""

    def __post_init__(self) -> None:
        for name, tp in choice_fields(type(self)).items():
            value = getattr(self, name)
            if value is not None and not isinstance(value, tp):
                setattr(self, name, tp.parse(value, f"{self.config_key}.{name}" if self.config_key else name))


class Dtype(Choice):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"
    float16 = "float16"


class SourceKind(Choice):
    sharegpt = "sharegpt"
    humaneval = "humaneval"
    jsonl = "jsonl"


class SynthEngine(Choice):
    hf = "hf"
    hf_generate = "hf_generate"
    vllm = "vllm"
    auto = "auto"


class WandbMode(Choice):
    offline = "offline"
    online = "online"
    disabled = "disabled"


@dataclass
class TargetConfig(Choices):
    """The target model whose outputs the drafter learns to predict."""

    config_key: ClassVar[str] = "target"

    name: str = "smollm2-135m"
    """A label for logs and manifests."""
    path: str | None = None
    """A local Hugging Face directory or a hub id; None selects the embedded SmolLM2 GGUF."""
    gguf_file: str | None = None
    """A GGUF file name inside ``path`` (converted once to a cached safetensors directory)."""
    dtype: Dtype = Dtype.auto
    """auto (bf16 on GPU, fp32 on CPU) | float32 | bfloat16 | float16."""
    device: str = "auto"
    """auto (cuda when available, else cpu) | cpu | cuda | cuda:N."""
    trust_remote_code: bool = False
    """Run model code shipped with the checkpoint. Off unless you trust the checkpoint's author."""
    cache_dir: str | None = None
    """Where converted targets (GGUF -> safetensors) are cached, keyed by the GGUF's hash
    (None: $DRAFTSMITH_CACHE, else ~/.cache/draftsmith)."""

    def resolved_cache_dir(self) -> str:
        return resolve_path(self.cache_dir or os.environ.get("DRAFTSMITH_CACHE") or "~/.cache/draftsmith")


@dataclass
class SourceConfig(Choices):
    """One prompt source in the data mixture."""

    config_key: ClassVar[str] = "data.sources.<name>"
    bounds: ClassVar[dict[str, Bound]] = {
        "weight": at_least(0),
        "max_records": at_least(1, "or null: all"),
        "regenerate": between(0, 1),
    }
    kind: SourceKind = SourceKind.sharegpt
    """sharegpt | humaneval | jsonl."""
    weight: float = 1.0
    """Share of ``data.num_prompts`` drawn from this source (weights are normalised)."""
    paths: list[str] = field(default_factory=list)
    """For kind=jsonl: JSONL or Parquet files with OpenAI-style ``messages`` lists or ``prompt`` strings."""
    max_records: int | None = None
    """Read at most this many records from the source (None: all)."""
    regenerate: float | None = None
    """Share of this source's training conversations whose answers the target regenerates in stage synth (picked
    by a salted hash of the id); the others keep the dataset's own answers, which cost no generation, only the
    one target forward every row gets for its features. None: all of them when synth.regenerate, else none."""


@dataclass
class DataConfig:
    """Prompt sources (real traffic), their mixture, validation limits and the held-out split."""

    bounds: ClassVar[dict[str, Bound]] = {
        "num_prompts": at_least(1, "or null: every valid conversation"),
        "heldout_fraction": between(0, 1, hi_open=True),
        "max_heldout": at_least(0),
        "max_turns": at_least(1),
        "heldout_max_turns": at_least(1, "or null: data.max_turns"),
        "max_prompt_tokens": at_least(1),
        "max_message_chars": at_least(1),
    }

    sources: dict[str, SourceConfig] = field(default_factory=dict)
    """Named prompt sources; set by the data group (data=sharegpt|humaneval|mix|jsonl), which replaces the
    whole mapping (a source named in a YAML file is never silently mixed with the default's)."""
    num_prompts: int | None = None
    """Training conversations to synthesise in total (None: every valid training conversation)."""
    heldout_fraction: float = 0.05
    """Fraction of conversations (by hashed id) held out for evaluation and never trained on."""
    split_salt: str = "heldout-v1"
    """Salt of the hash that assigns conversations to the held-out split; change it to redraw the split."""
    max_heldout: int = 200
    """Held-out conversations written per source for the eval stage."""
    max_turns: int = 4
    """User turns kept per conversation (later turns are dropped)."""
    heldout_max_turns: int | None = None
    """User turns kept per held-out conversation (None: data.max_turns), so that stage eval can judge later
    turns (``eval.turns``) of a recipe that trains on first turns only. Training rows are the same either way."""
    max_prompt_tokens: int = 1024
    """A conversation whose first prompt is longer than this (in target tokens) is skipped and counted."""
    max_message_chars: int = 16000
    """A message longer than this (in characters) makes the row malformed (skipped and counted)."""
    shuffle_seed: int = 0
    """Seed of the deterministic shuffle that picks which conversations are used."""

    def read_turns(self) -> int:
        """User turns each source reader keeps (the most of training's and the held-out split's)."""
        return max(self.max_turns, self.heldout_max_turns or 0)


@dataclass
class SynthConfig(Choices):
    """Stage synth: decode real prompts through the target ("mid-training" data)."""

    config_key: ClassVar[str] = "synth"
    bounds: ClassVar[dict[str, Bound]] = {
        "max_new_tokens": at_least(1),
        "temperature": at_least(0, "0 = greedy"),
        "top_p": between(0, 1, lo_open=True),
        "batch_size": at_least(1),
        "chunk_size": at_least(1),
        "num_shards": at_least(1),
        "shard_index": at_least(0, "or null: every shard"),
        "max_seq_len": at_least(2),
    }

    max_new_tokens: int = 512
    temperature: float = 0.0
    """0 means greedy decoding."""
    top_p: float = 1.0
    batch_size: int = 16
    """Rows decoded together: engine=hf keeps this many rows in its batch (continuous batching); engine=hf_generate
    decodes length-sorted, left-padded batches of this size."""
    engine: SynthEngine = SynthEngine.hf
    """hf: continuous batching on the HF target (data/generate.py: every prompt prefilled alone, finished rows
    replaced at once) | hf_generate: transformers' ``generate`` on padded batches (the reference path) |
    vllm: a vLLM worker process (data/vllm_engine.py; continuous batching, paged KV cache) | auto: vllm when a
    Python that imports vllm is found (``vllm_python``, $DRAFTSMITH_VLLM_PYTHON, this one, ./.venv-engine),
    else hf."""
    prepack: bool = True
    """engine=hf on a CPU with a float32 target: multiply by oneDNN-prepacked weights (data/prepack.py; 1.23-1.31x
    the engine's tokens/s on a 2-core CPU, every greedy row the same in the benchmark; BENCHMARKS). false: F.linear."""
    share_prefix: bool = True
    """engine=hf: prompts prefilled together compute the keys and values of their common prefix (>= 8 tokens, e.g. a
    chat template's system header) once instead of once per prompt (data/generate.py). false: every prompt whole."""
    vllm_python: str | None = None
    """Interpreter that runs the vLLM worker (e.g. .venv-engine/bin/python); None: look for one (see engine)."""
    vllm_dtype: Dtype = Dtype.float32
    """vLLM weights/activations dtype: float32 (greedy rows equal the HF engine's) | bfloat16 | float16 | auto."""
    vllm_eager: bool = True
    """enforce_eager: no torch.compile/CUDA graphs (exact and starts fast); false is the fast choice on a GPU."""
    chunk_size: int = 64
    """Conversations per output file; the unit of atomic writes and of resume."""
    num_shards: int = 1
    """Split the work into this many shards (SLURM array tasks, GPUs)."""
    shard_index: int | None = None
    """Which shard this process runs (None: all shards, then merge)."""
    max_seq_len: int = 2048
    """Training rows are cut to this many tokens."""
    regenerate: bool = True
    """False keeps the original assistant answers (the baseline for the mid-training comparison)."""


@dataclass
class WandbConfig(Choices):
    config_key: ClassVar[str] = "wandb"
    mode: WandbMode = WandbMode.offline
    """offline (default; no account needed) | online (needs WANDB_API_KEY) | disabled."""
    project: str = "draftsmith"
    entity: str | None = None


SAFE_TO_CHANGE: tuple[str, ...] = (
    "stage",
    "resume",
    "overwrite",
    "launcher",
    "slurm.",
    "wandb.",
    "runtime.",
    "runs",
    "train.max_steps",
    "train.stop_after_steps",
    "train.save_every",
    "train.eval_every",
    "train.log_every",
    "train.keep_checkpoints",
    "target.device",
    "target.cache_dir",
    "export.",
    "eval.plot",
)
"""Config keys (or ``prefix.``) whose change does not change what a run computes: a resumed run continues with
them changed (recorded in its manifest), and an output made with other values of them is not "another config"."""


def flat_config(obj: Any, prefix: str = "") -> dict[str, Any]:
    """A nested config (dataclass or dict) as ``{"a.b.c": value}``."""

    if is_dataclass(obj) and not isinstance(obj, type):
        obj = asdict(obj)
    out: dict[str, Any] = {}
    if isinstance(obj, dict):
        for k, v in obj.items():
            out.update(flat_config(v, f"{prefix}{k}."))
        if not obj and prefix:
            out[prefix[:-1]] = {}
        return out
    out[prefix[:-1]] = obj
    return out


def shown_value(v: Any) -> str:
    """A config value as a user typed it: a choice as its string (``'replay'``, not ``<EvalMode.replay: ...>``)."""
    return repr(v.value) if isinstance(v, Enum) else repr(v)


def changed_keys(old: Any, new: Any, only: tuple[str, ...] | None = None) -> dict[str, tuple[Any, Any]]:
    """``{key: (old, new)}`` for every config key that differs (restricted to keys under ``only`` if given)."""
    a, b = flat_config(old), flat_config(new)
    out = {}
    for key in sorted(set(a) | set(b)):
        if only is not None and not any(key == p or key.startswith(p if p.endswith(".") else p + ".") for p in only):
            continue
        if a.get(key, "<unset>") != b.get(key, "<unset>"):
            out[key] = (a.get(key, "<unset>"), b.get(key, "<unset>"))
    return out


def is_safe_change(key: str) -> bool:
    return any(key == s or (s.endswith(".") and key.startswith(s)) for s in SAFE_TO_CHANGE)


def resolve_path(path: str) -> str:
    """Expand ``~`` and environment variables in a configured path."""
    return os.path.expandvars(os.path.expanduser(path))


class RunConfig(Protocol):
    """What the data and eval stages read of the root config (:class:`train.config.Config` is one): the
    layers below ``train`` are typed against this instead of importing the root."""

    run_name: str
    runs_root: str
    seed: int
    synth_dir: str
    train_dir: str
    overwrite: bool
    target: TargetConfig
    data: DataConfig
    synth: SynthConfig
    wandb: WandbConfig
