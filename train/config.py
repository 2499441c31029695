"""The typed configuration tree: dataclasses registered in Hydra's ConfigStore.

YAML files under ``conf/`` hold values; these dataclasses are the schema. Hydra merges the YAML onto the
schema, so a misspelt key in a YAML file fails at start-up. Command-line overrides are checked before
Hydra runs (:func:`check_overrides`), so a typo there names the valid keys and the closest match.
Code below the entry point receives a :class:`Config` object, never a ``DictConfig``.
"""

from __future__ import annotations

import difflib
import os
import re
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, get_args, get_origin, get_type_hints

from hydra.core.config_store import ConfigStore


@dataclass
class TargetConfig:
    """The target model whose outputs the drafter learns to predict."""

    name: str = "smollm2-135m"
    """A label for logs and manifests."""
    path: str | None = None
    """A local Hugging Face directory or a hub id; None selects the embedded SmolLM2 GGUF."""
    gguf_file: str | None = None
    """A GGUF file name inside ``path`` (converted once to a cached safetensors directory)."""
    dtype: str = "auto"
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
class SourceConfig:
    """One prompt source in the data mixture."""

    kind: str = "sharegpt"
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
    max_prompt_tokens: int = 1024
    """A conversation whose first prompt is longer than this (in target tokens) is skipped and counted."""
    max_message_chars: int = 16000
    """A message longer than this (in characters) makes the row malformed (skipped and counted)."""
    shuffle_seed: int = 0
    """Seed of the deterministic shuffle that picks which conversations are used."""


@dataclass
class SynthConfig:
    """Stage synth: decode real prompts through the target ("mid-training" data)."""

    max_new_tokens: int = 512
    temperature: float = 0.0
    """0 means greedy decoding."""
    top_p: float = 1.0
    batch_size: int = 16
    """Rows decoded together: engine=hf keeps this many rows in its batch (continuous batching); engine=hf_generate
    decodes length-sorted, left-padded batches of this size."""
    engine: str = "hf"
    """hf: continuous batching on the HF target (data/generate.py: every prompt prefilled alone, finished rows
    replaced at once) | hf_generate: transformers' ``generate`` on padded batches (the reference path) |
    vllm: a vLLM worker process (data/vllm_engine.py; continuous batching, paged KV cache) | auto: vllm when a
    Python that imports vllm is found (``vllm_python``, $DRAFTSMITH_VLLM_PYTHON, this one, ./.venv-engine),
    else hf."""
    vllm_python: str | None = None
    """Interpreter that runs the vLLM worker (e.g. .venv-engine/bin/python); None: look for one (see engine)."""
    vllm_dtype: str = "float32"
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
class TrainConfig:
    """Stage train: the one training loop (accelerate + DeepSpeed) shared by every drafter family."""

    max_steps: int = 2000
    """Optimizer steps."""
    micro_batch_size: int = 4
    """Sequences per process per micro-step."""
    grad_accum: int = 1
    """Micro-steps per optimizer step. Global batch = micro_batch_size * grad_accum * world size."""
    lr: float = 3e-4
    weight_decay: float = 0.0
    beta1: float = 0.9
    beta2: float = 0.95
    warmup_steps: int = 50
    min_lr_ratio: float = 0.1
    """The cosine schedule decays to lr * min_lr_ratio at max_steps."""
    max_grad_norm: float = 0.5
    max_seq_len: int = 1024
    """Training rows are cut to this many tokens."""
    bucket_size: int = 64
    """Rows are sorted by length within windows of bucket_size * micro_batch_size (length bucketing)."""
    features: str = "online"
    """online: target hidden states computed in each step (target frozen) | precomputed: read from features_dir."""
    features_dir: str = "${runs_root}/${run_name}/features"
    dtype: str = "auto"
    """auto (bf16 on GPU, fp32 on CPU) | float32 | bfloat16."""
    log_every: int = 10
    save_every: int = 200
    """Save a resumable checkpoint every N steps (and at the end)."""
    keep_checkpoints: int = 2
    eval_every: int = 0
    """Measure held-out tau with the eval decoder every M steps to pick the best checkpoint (0: at the end only)."""
    eval_prompts: int = 32
    """Held-out prompts per source for the checks (replayed: one target forward per prompt, cached continuations)."""
    eval_max_new_tokens: int = 128
    eval_mode: str = "replay"
    """replay (default; same counts as decoding, far cheaper) | decode (the real decoder, slow)."""
    stop_after_steps: int | None = None
    """Stop (after checkpointing) at this step although max_steps is later: for tests and time-sliced jobs."""


@dataclass
class DeepSpeedConfig:
    """DeepSpeed settings; the DeepSpeed config dict is built from these (no second JSON)."""

    enabled: bool = True
    zero_stage: int = 2
    offload_optimizer: bool = False
    offload_param: bool = False
    overlap_comm: bool = False
    reduce_bucket_size: int = 50_000_000
    allgather_bucket_size: int = 50_000_000


@dataclass
class EvalConfig:
    """Stage eval: held-out acceptance length and speedup with the built-in speculative decoder."""

    proposers: list[str] = field(default_factory=lambda: ["drafter", "prompt_lookup"])
    """Compared with plain decoding: drafter (the trained one) | prompt_lookup | draft_model | hf_assisted
    | hf_prompt_lookup."""
    drafter_dir: str | None = None
    """A saved drafter (default: the train stage's best checkpoint of this run)."""
    draft_model: str | None = None
    """A standalone draft model directory for the draft_model / hf_assisted proposers."""
    prompts: str = "synth"
    """Where held-out prompts come from: synth (the synth run's heldout.jsonl) | data (the held-out split of
    the configured data sources, e.g. data=jsonl for your own traffic; no synth run needed) | a JSONL or Parquet
    file or glob (every row's prompt is judged; grouped by its ``source`` / ``domain`` field when present)."""
    mode: str = "both"
    """replay | decode | both. replay: tau, alpha and their 95% intervals from replaying the target's greedy
    continuation of num_prompts prompts per source (one target forward per prompt, see eval/replay.py);
    decode: real speculative decoding (wall-clock speed, token-for-token check); both: replay for tau, decode
    for speed on the first decode_prompts prompts per source."""
    num_prompts: int = 200
    """Held-out prompts per source (replay; decode too when mode=decode)."""
    max_new_tokens: int = 256
    """New tokens per prompt (replay; decode too when mode=decode)."""
    decode_prompts: int = 4
    """mode=both: prompts per source that are also decoded for speed and the lossless check (at most
    num_prompts: the first ones of the replayed sample)."""
    decode_max_new_tokens: int = 64
    """mode=both: new tokens per decoded prompt (at most max_new_tokens)."""
    continuations_dir: str | None = None
    """Where the greedy continuations are cached (default: <synth_dir>/replay for prompts=synth, else the eval
    run dir's replay/)."""
    replay_batch_size: int = 16
    """Batch size for generating the continuations."""
    replay_lanes: int = 32
    """Prompts replayed at once, the drafters' linear layers batched across them (eval/lanes.py: each weight is
    read once per round instead of once per prompt; same trajectories). 1 = one prompt at a time. Also used by
    the training-time checks."""
    bootstrap: int = 2000
    """Bootstrap replicates for the 95% interval of tau (resampling prompts)."""
    temperature: float = 0.0
    top_p: float = 1.0
    k: int = 5
    """Chain length K for chain proposers."""
    decode: str = "both"
    """chain | tree | both: how the trained drafter drafts."""
    tree_depth: int | None = None
    """Tree drafts: maximum depth (None: the drafter's own setting; draft_model: 4)."""
    tree_top_k: int | None = None
    """Tree drafts: branching per expanded node (None: the drafter's own setting; draft_model: 4)."""
    tree_total_tokens: int | None = None
    """Tree drafts: draft tokens verified per step (None: the drafter's own setting; draft_model: 16)."""
    prompt_lookup_max_ngram: int = 3
    seed: int = 0
    plot: bool = True


@dataclass
class ExportConfig:
    """Stage export: write a trained drafter in a serving engine's format (checked, then written atomically)."""

    format: str | None = None
    """eagle | sglang_eagle (drafter=eagle), hf (standalone), medusa (medusa); None lists the valid pairs."""
    drafter_dir: str = "${train_dir}/best"
    """The trained drafter to export (default: the train stage's best checkpoint)."""
    out_dir: str = "${runs_root}/${run_name}/export/${export.format}"
    eval_dir: str | None = "${runs_root}/${run_name}/eval"
    """The eval stage's output whose held-out tau table goes into the model card (skipped when absent)."""
    verify: bool = True
    """Re-import the export and require the trained drafter's draft logits before renaming it into place."""


@dataclass
class WandbConfig:
    mode: str = "offline"
    """offline (default; no account needed) | online (needs WANDB_API_KEY) | disabled."""
    project: str = "draftsmith"
    entity: str | None = None


@dataclass
class RuntimeConfig:
    num_threads: int = 0
    """torch CPU threads (0: number of cores)."""
    log_every: int = 10


@dataclass
class SlurmConfig:
    """launcher=slurm: how ``python -m train stage=... launcher=slurm`` fills the sbatch templates in ``slurm/``.

    The defaults run on the single-node test cluster (``scripts/slurm_local.sh``); on a GPU cluster set
    partition, account, nodes, gpus_per_node and time.
    """

    partition: str | None = None
    """sbatch --partition (None: the cluster's default partition)."""
    account: str | None = None
    """sbatch --account (None: your default account)."""
    nodes: int = 1
    """Nodes of the training job (one srun task per node launches its per-GPU processes with torchrun)."""
    gpus_per_node: int = 0
    """GPUs per node (torchrun --nproc_per_node). 0: a CPU job with tasks_per_node processes over gloo."""
    tasks_per_node: int = 1
    """CPU jobs (gpus_per_node=0): training processes per node, one srun task each."""
    cpus_per_task: int = 2
    """sbatch --cpus-per-task (also the torch threads of a CPU task)."""
    mem: str | None = None
    """sbatch --mem, e.g. 200G (None: the partition's default)."""
    time: str = "01:00:00"
    """sbatch --time of every job (train jobs are requeued past it, see max_requeues)."""
    signal_grace: int = 120
    """Seconds before the time limit at which the training processes get SIGUSR2 (--signal=USR2@grace):
    they checkpoint at the next step, then the job requeues itself."""
    max_requeues: int = 3
    """How often a training job requeues itself after a preemption signal before giving up."""
    array: int = 2
    """stage=synth: shards, one job-array task each (synth.num_shards = the array size)."""
    array_parallel: int | None = None
    """At most this many array tasks at once (--array=0-N%P; None: no limit)."""
    master_port: int = 29500
    """Rendezvous port on the first node of a training job."""
    python: str | None = None
    """The interpreter jobs run (None: the one that submits)."""
    setup: list[str] = field(default_factory=list)
    """Shell lines run at the top of every job (module load ..., source venv/bin/activate)."""
    extra: list[str] = field(default_factory=list)
    """Extra #SBATCH lines, e.g. ["--qos=high", "--constraint=h100"]."""
    snapshot: bool = True
    """Copy the code into the job directory (jobs run that copy, not the working tree)."""
    dry_run: bool = False
    """Write the job directory and scripts but do not call sbatch."""


@dataclass
class Config:
    """The root of the configuration tree."""

    stage: str = "synth"
    """Which stage to run; see ``python -m train stage=help``."""
    run_name: str = "default"
    """Runs of the same name share ``runs_root/run_name/``: each stage writes its own subdirectory."""
    runs_root: str = "runs"
    seed: int = 0
    synth_dir: str = "${runs_root}/${run_name}/synth"
    """Where the synth stage writes (and later stages read) the training data and the held-out split."""
    overwrite: bool = False
    """Allow a stage to replace outputs written by a different config (otherwise it refuses)."""
    resume: bool = False
    """stage=train: continue from the run's latest checkpoint exactly (weights, optimizer, schedule, data, RNG)."""
    train_dir: str = "${runs_root}/${run_name}/train"
    """Where the train stage writes (and eval/export read) the drafter checkpoints."""
    target: TargetConfig = field(default_factory=TargetConfig)
    data: DataConfig = field(default_factory=DataConfig)
    synth: SynthConfig = field(default_factory=SynthConfig)
    drafter: Any = None
    """The drafter family's config (a group: drafter=eagle | ...); its dataclass comes from the registry."""
    train: TrainConfig = field(default_factory=TrainConfig)
    deepspeed: DeepSpeedConfig = field(default_factory=DeepSpeedConfig)
    eval: EvalConfig = field(default_factory=EvalConfig)
    export: ExportConfig = field(default_factory=ExportConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    launcher: str = "local"
    """local: run the stage in this process | slurm: submit it as SLURM job(s) (see ``slurm``)."""
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    runs: list[str] = field(default_factory=list)
    """stage=compare: run directories (runs/<name>, a stage directory, or a W&B offline run directory)."""


DRAFTER_SCHEMAS: dict[str, str] = {
    "eagle": "train.drafters.eagle:EagleConfig",
    "eagle3": "train.drafters.eagle3:Eagle3Config",
    "medusa": "train.drafters.medusa:MedusaConfig",
    "standalone": "train.drafters.standalone:StandaloneConfig",
}
"""Drafter family -> its config dataclass (module:Class), stored in Hydra's ConfigStore as
``_schemas/drafter/<name>`` (outside the ``drafter`` group, so Hydra never offers it as a drafter choice) so the
YAML in ``conf/drafter/`` is validated against it (``defaults: [/_schemas/drafter/<name>@_here_]``)."""


def drafter_config_class(name: str) -> type:
    import importlib

    if name not in DRAFTER_SCHEMAS:
        raise ConfigError(f"Unknown drafter {name!r}; valid: {', '.join(sorted(DRAFTER_SCHEMAS))}")
    module, cls = DRAFTER_SCHEMAS[name].split(":")
    return getattr(importlib.import_module(module), cls)


def register_configs() -> None:
    """Register the schemas so ``conf/config.yaml`` and ``conf/drafter/*.yaml`` can name them."""
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    for name in DRAFTER_SCHEMAS:
        cs.store(group="_schemas/drafter", name=name, node=drafter_config_class(name))


class ConfigError(ValueError):
    """A configuration value or key is wrong; the message says which and what is allowed."""


def _field_type(cls: type, name: str) -> Any:
    return get_type_hints(cls)[name]


def _unwrap(tp: Any) -> Any:
    """Strip Optional[...] and return the dataclass or the mapping's value type, else None."""
    if is_dataclass(tp):
        return tp
    origin = get_origin(tp)
    args = [a for a in get_args(tp) if a is not type(None)]
    if origin is dict and len(args) == 2:
        return ("dict", _unwrap(args[1]))
    if len(args) == 1:
        return _unwrap(args[0])
    return None


def check_key_path(dotted: str, root: type = Config, groups: tuple[str, ...] = (), base: str = "") -> None:
    """Raise :class:`ConfigError` if ``dotted`` (e.g. ``synth.max_new_tokenz``) is not in the schema.

    The message lists the valid keys at the failing level and the closest match.
    """
    node: Any = root
    parts = [*base.split("."), *dotted.split(".")] if base else dotted.split(".")
    start = len(base.split(".")) if base else 0
    dotted = ".".join(parts)
    for depth, part in enumerate(parts):
        if depth < start:
            continue
        if isinstance(node, tuple) and node[0] == "dict":  # free-form mapping: any key, typed values
            node = node[1]
            continue
        if not is_dataclass(node):
            return
        names = [f.name for f in fields(node)]
        if part not in names:
            prefix = ".".join(parts[:depth])
            where = f"'{prefix}'" if prefix else "the root config"
            valid = sorted(names + (list(groups) if depth == 0 else []))
            close = difflib.get_close_matches(part, valid, n=1)
            hint = f" Did you mean '{'.'.join([*parts[:depth], close[0]])}'?" if close else ""
            raise ConfigError(
                f"Unknown config key '{dotted}': '{part}' is not a key of {where}.{hint}\n"
                f"Valid keys of {where}: {', '.join(valid)}"
            )
        node = _unwrap(_field_type(node, part))


def check_overrides(overrides: list[str], groups: tuple[str, ...], default_drafter: str = "eagle") -> None:
    """Check ``key=value`` command-line overrides against the schema before Hydra composes.

    Group selections (``drafter=eagle``), Hydra's own keys (``hydra.*``) and additions (``+key=...``)
    are left to Hydra, which lists the valid group options itself.
    """
    for ov in overrides:
        if "=" not in ov or ov.startswith(("+", "~", "hydra.", "hydra/")):
            continue
        key = ov.split("=", 1)[0].lstrip("+")
        if key in groups or "/" in key or key.split(".")[0] in ("hydra",):
            continue
        if key.split(".")[0] in groups and key.split(".")[0] not in {f.name for f in fields(Config)}:
            continue
        if key.startswith("drafter."):
            chosen = next((o.split("=", 1)[1] for o in overrides if o.startswith("drafter=")), default_drafter)
            if chosen in DRAFTER_SCHEMAS and "," not in chosen:
                check_key_path(key.split(".", 1)[1], drafter_config_class(chosen), (), base="drafter")
            continue
        check_key_path(key, Config, groups)


RUN_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_run_name(name: str) -> None:
    """``run_name`` becomes a directory under ``runs_root``: one safe path component, never ``..`` or a path."""
    if not isinstance(name, str) or not RUN_NAME_RE.match(name) or ".." in name:
        raise ConfigError(
            f"run_name={name!r} is not a safe name: use letters, digits, '.', '_' and '-' (starting with a letter "
            f"or digit, no '..', no '/'); it names the directory runs_root/run_name"
        )


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
    from dataclasses import asdict

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
