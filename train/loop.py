"""Stage train: the one training loop for every drafter family (accelerate + DeepSpeed).

``setup -> train -> cleanup``. Drafter differences live in the drafter spec (build, loss, proposer, save);
this loop owns the data order, the optimizer and schedule, distribution, checkpoints, exact resume,
held-out acceptance checks and logging. One CPU process here, torchrun/accelerate/srun processes over
gloo on CPU or NCCL on GPUs elsewhere, with the same code.

Checkpoints (``<run_dir>/checkpoints/step-000100/``) hold the accelerate/DeepSpeed state (weights,
optimizer, scheduler, RNG) plus ``drafter/`` (safetensors, ready for eval/export) and ``trainer_state.json``
(step, best held-out tau). Every micro-batch is a pure function of its global index, so ``resume=true``
continues exactly where the run stopped.
"""

from __future__ import annotations

import logging
import math
import os
import resource
import signal
import socket
import time
from dataclasses import asdict
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from data.config import ConfigError, bound_errors
from data.layout import BEST, CHECKPOINTS, HELDOUT, MANIFEST, REPLAY
from data.manifest import read_manifest, write_manifest
from data.target import load_target, output_head
from data.tracking import Tracker
from eval.heldout import load_heldout, measure
from eval.replay import replay_many
from eval.report import Result, finish_result
from eval.stats import bootstrap_tau_ci
from eval.traces import ContinuationCache, TraceCache
from train.batches import BatchPlan, load_rows
from train.checkpointing import Checkpointing
from train.checkpoints import CorruptCheckpointError
from train.config import Config, DeepSpeedConfig, TrainConfig
from train.drafters import registry
from train.drafters.registry import TargetFeatures
from train.features import FeatureStore
from train.optim import build_optimizer

logger = logging.getLogger(__name__)


def cpu_has_bf16_matmul() -> bool:
    """Whether this CPU multiplies bf16 matrices in hardware (AMX tiles or AVX-512 BF16), where a bf16 autocast
    trains faster than float32 (measured: BENCHMARKS, "bf16 autocast on CPU")."""
    cpu = getattr(torch, "cpu", None)
    probes = [getattr(cpu, name, None) for name in ("_is_amx_tile_supported", "_is_avx512_bf16_supported")]
    return any(bool(f()) for f in probes if callable(f))


def deepspeed_dict(ds: DeepSpeedConfig, train: TrainConfig, bf16: bool) -> dict[str, Any]:
    """The DeepSpeed config, built from the Hydra config (the only source of these settings)."""
    if ds.zero_stage not in (0, 1, 2, 3):
        raise ConfigError(f"deepspeed.zero_stage={ds.zero_stage} must be 0, 1, 2 or 3")
    zero: dict[str, Any] = {
        "stage": ds.zero_stage,
        "overlap_comm": ds.overlap_comm,
        "contiguous_gradients": True,
        "reduce_bucket_size": ds.reduce_bucket_size,
        "allgather_bucket_size": ds.allgather_bucket_size,
    }
    if ds.offload_optimizer:
        zero["offload_optimizer"] = {"device": "cpu", "pin_memory": True}
    if ds.offload_param:
        if ds.zero_stage != 3:
            raise ConfigError("deepspeed.offload_param needs deepspeed.zero_stage=3")
        zero["offload_param"] = {"device": "cpu", "pin_memory": True}
    out: dict[str, Any] = {
        "train_micro_batch_size_per_gpu": train.micro_batch_size,
        "gradient_accumulation_steps": train.grad_accum,
        "gradient_clipping": train.max_grad_norm,
        "zero_optimization": zero,
        "zero_allow_untested_optimizer": True,
        "steps_per_print": 10**9,
        "wall_clock_breakdown": False,
    }
    if bf16:
        out["bf16"] = {"enabled": True}
    return out


def subset_rows(n_rows: int, k: int, seed: int) -> list[int]:
    """``train.max_rows``: ``k`` of ``n_rows`` row indices drawn at random (seeded; in data order), so that a
    smaller data volume keeps the mix of sources, which the synth chunks store one after another."""
    g = torch.Generator().manual_seed(seed)
    return sorted(torch.randperm(n_rows, generator=g)[:k].tolist())


def validate_train(cfg: Config) -> None:
    """The train settings: each value within its schema bounds (``TrainConfig.bounds``, the drafter's) and the
    combinations that cannot work."""
    errors = bound_errors(cfg.train, "train.") + bound_errors(cfg.deepspeed, "deepspeed.")
    if cfg.drafter is not None:
        errors += bound_errors(cfg.drafter, "drafter.")
    t = cfg.train
    if t.ema_decay > 0 and cfg.deepspeed.enabled and cfg.deepspeed.zero_stage == 3:
        errors.append("train.ema_decay needs whole parameters on every process: not with deepspeed.zero_stage=3")
    if cfg.drafter is None:
        errors.append(f"no drafter chosen: add drafter=<{'|'.join(registry.names())}>")
    if errors:
        raise ConfigError("Invalid train config:\n  - " + "\n  - ".join(errors))


def _free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return int(s.getsockname()[1])


def _ensure_dist_env() -> None:
    """A single process started without a launcher still gets a (1-process) process group."""
    if "WORLD_SIZE" in os.environ:
        return
    if "SLURM_NTASKS" in os.environ and int(os.environ["SLURM_NTASKS"]) > 1:
        os.environ.update(
            RANK=os.environ["SLURM_PROCID"],
            LOCAL_RANK=os.environ.get("SLURM_LOCALID", "0"),
            WORLD_SIZE=os.environ["SLURM_NTASKS"],
        )
        os.environ.setdefault("MASTER_ADDR", "127.0.0.1")
        os.environ.setdefault("MASTER_PORT", "29500")
        return
    os.environ.update(RANK="0", LOCAL_RANK="0", WORLD_SIZE="1", MASTER_ADDR="127.0.0.1", MASTER_PORT=str(_free_port()))


def lr_lambda(train: TrainConfig) -> Any:
    def f(step: int) -> float:
        if step < train.warmup_steps:
            return (step + 1) / max(1, train.warmup_steps)
        progress = min(1.0, (step - train.warmup_steps) / max(1, train.max_steps - train.warmup_steps))
        return train.min_lr_ratio + (1 - train.min_lr_ratio) * 0.5 * (1 + math.cos(math.pi * progress))

    return f


class WeightAverage:
    """An exponential moving average of the drafter's trainable weights (``train.ema_decay``), by their names in
    the unwrapped model. Registered with accelerate for checkpointing, so a resumed run continues the same average.
    The decay ramps up as ``min(decay, (1 + n) / (warmup + n))`` after n updates, so early weights fade quickly."""

    def __init__(self, model: torch.nn.Module, decay: float, warmup: float = 10.0) -> None:
        self.decay = decay
        self.warmup = warmup
        self.updates = 0
        self.shadow = {n: p.detach().float().clone() for n, p in model.named_parameters() if p.requires_grad}

    @torch.no_grad()
    def update(self, model: torch.nn.Module) -> None:
        self.updates += 1
        d = min(self.decay, (1 + self.updates) / (self.warmup + self.updates))
        for n, p in model.named_parameters():
            if n in self.shadow:
                self.shadow[n].lerp_(p.detach().float(), 1.0 - d)

    def state_dict(self) -> dict[str, Any]:
        return {"decay": self.decay, "updates": self.updates, "shadow": self.shadow}

    def load_state_dict(self, state: dict[str, Any]) -> None:
        if set(state["shadow"]) != set(self.shadow):
            raise CorruptCheckpointError("the checkpoint's weight average names other parameters than this drafter's")
        self.updates = int(state["updates"])
        for n, t in state["shadow"].items():
            self.shadow[n].copy_(t)


class Trainer(Checkpointing):
    """One training run; see the module docstring."""

    def __init__(self, cfg: Config, run_dir: Path) -> None:
        validate_train(cfg)
        self.cfg = cfg
        self.run_dir = run_dir
        self.ckpt_root = run_dir / CHECKPOINTS
        self.spec = registry.get(cfg.drafter.name)
        self.stop_signal: int | None = None
        self.stop_now = False
        self.tracker: Tracker | None = None
        self.resumes: list[dict[str, Any]] = []
        self.resume_changes: dict[str, Any] = {}
        if cfg.resume:  # cheap, before the target loads: refuse a changed config now
            self.resume_changes = self._check_resume_config()
        if cfg.train.features == "precomputed" and not (Path(cfg.train.features_dir) / MANIFEST).is_file():
            raise ConfigError(
                f"train.features=precomputed but {cfg.train.features_dir} holds no finished features (no "
                f"manifest.json): run stage=features first (same overrides), set train.features_dir, or use "
                f"train.features=online"
            )

    # -- setup ---------------------------------------------------------------------------------

    def setup(self) -> None:
        """Accelerator, target and data, drafter and optimizer, resume, tracking -- in that order."""
        self._setup_accelerator()
        rows = self._setup_target_and_data()
        self._setup_drafter(rows)
        self.step = 0
        self.best: dict[str, Any] = {"tau": None, "step": None}
        self.history: list[dict[str, Any]] = []
        self.losses: list[list[float]] = []
        self.accounting: dict[str, Any] = {"seconds": 0.0, "seq_tokens": 0.0, "sup_tokens": 0.0, "segments": []}
        """Training time and tokens of the run so far, over every process segment (start, resumes after a kill
        or a preemption): what the checkpoint this run resumed from recorded, plus this segment at each save."""
        self._segment: dict[str, float] = {"t0": time.perf_counter(), "step0": 0, "seq": 0.0, "sup": 0.0}
        self._resume_or_refuse()
        self._setup_tracking(len(rows))

    def _setup_accelerator(self) -> None:
        from accelerate import Accelerator
        from accelerate.utils import DeepSpeedPlugin, DistributedType, InitProcessGroupKwargs

        cfg = self.cfg
        cuda = torch.cuda.is_available() and cfg.target.device != "cpu"
        self.bf16 = cfg.train.dtype == "bfloat16" or (cfg.train.dtype == "auto" and cuda)
        if self.bf16 and not cuda and not cpu_has_bf16_matmul():
            logger.warning(
                "train.dtype=bfloat16 on a CPU without AMX or AVX-512 BF16: bf16 products are emulated there, up to "
                "~25x slower than float32 (measured on an AVX2-only CPU); set train.dtype=float32"
            )
        _ensure_dist_env()
        plugin = None
        ds = cfg.deepspeed.enabled
        if ds:
            try:
                import deepspeed  # noqa: F401  (its CPU accelerator is picked when no GPU is visible)
            except ImportError as exc:
                raise ConfigError(
                    f"deepspeed.enabled (ZeRO-{cfg.deepspeed.zero_stage}) needs the deepspeed package ({exc}): "
                    f"pip install deepspeed, or train without it: deepspeed=none"
                ) from exc
            plugin = DeepSpeedPlugin(hf_ds_config=deepspeed_dict(cfg.deepspeed, cfg.train, self.bf16))
        # accelerate builds a DeepSpeed engine only when it is not told cpu=True: a DeepSpeed run on a CPU machine
        # leaves cpu unset, and DeepSpeed's CPU accelerator takes the processes (gloo between them).
        self.acc = Accelerator(
            cpu=not cuda and not ds,
            deepspeed_plugin=plugin,
            gradient_accumulation_steps=cfg.train.grad_accum,
            mixed_precision="bf16" if self.bf16 else "no",
            kwargs_handlers=[InitProcessGroupKwargs(backend="nccl" if cuda else "gloo")],
        )
        if cfg.runtime.num_threads:
            # accelerate sets torch's threads to the physical cores / local processes when OMP_NUM_THREADS is unset,
            # over the thread count the user chose
            torch.set_num_threads(cfg.runtime.num_threads)
        self.rank, self.world = self.acc.process_index, self.acc.num_processes
        self._rng_devices = [self.acc.device] if self.acc.device.type == "cuda" else []
        self.deepspeed = self.acc.distributed_type == DistributedType.DEEPSPEED
        if ds and not self.deepspeed:
            raise ConfigError(
                f"deepspeed.enabled, but accelerate built no DeepSpeed engine ({self.acc.distributed_type}): "
                f"train without it (deepspeed=none) or check the DeepSpeed install (ds_report)"
            )
        self.engine = f"DeepSpeed ZeRO-{cfg.deepspeed.zero_stage}" if self.deepspeed else "accelerate (no DeepSpeed)"
        if self.deepspeed:
            # accelerate tells transformers which DeepSpeed config is on; under ZeRO-3 every from_pretrained or
            # from_config would then build its weights already partitioned (the target would hold no weights on
            # any process) and generate() would wait for the other processes. The target and the drafter copies
            # used for saving and checks stay whole; the engine partitions the drafter when it is prepared (each
            # process briefly holds the whole drafter, as under DDP). Forgetting the config is what transformers
            # offers for this (unset_hf_deepspeed_config); accelerate itself reads its own plugin, not this.
            from transformers.integrations import unset_hf_deepspeed_config

            unset_hf_deepspeed_config()
        if not self.acc.is_main_process:
            logging.getLogger().setLevel(logging.WARNING)

    def _setup_target_and_data(self) -> list[Any]:
        """Load the target (on this process's device), check it made the synth data, plan the batches."""
        cfg = self.cfg
        synth_manifest = read_manifest(Path(cfg.synth_dir) / MANIFEST)
        tcfg = cfg.target
        tcfg.device = str(self.acc.device)
        self.target = load_target(tcfg)
        if self.spec.check is not None:
            self.spec.check(cfg.drafter, self.target)
        if synth_manifest["target"]["fingerprint"] != self.target.fingerprint:
            raise ConfigError(
                f"The synth data in {cfg.synth_dir} was made with target fingerprint "
                f"{synth_manifest['target']['fingerprint']}, but this target is {self.target.fingerprint}: "
                f"train on data from the same target (run stage=synth with this target)."
            )
        self.synth_manifest = synth_manifest
        self.heldout_skip = self._heldout_unavailable()
        rows = load_rows(cfg.synth_dir, cfg.train.max_seq_len)
        self.feature_layers = self.spec.feature_layers(cfg.drafter, self.target.model.config)
        self.store = None
        if cfg.train.features == "precomputed":
            self.store = FeatureStore(
                cfg.train.features_dir,
                synth_manifest.get("plan_hash"),
                self.target.fingerprint,
                self.feature_layers,
                len(rows),
                cfg.train.max_seq_len,
            )
        self.row_ids = list(range(len(rows)))  # plan index -> row index in the synth data (and the features)
        if cfg.train.max_rows is not None:
            if cfg.train.max_rows > len(rows):
                raise ConfigError(
                    f"train.max_rows={cfg.train.max_rows} but {cfg.synth_dir} has only {len(rows)} training rows"
                )
            self.row_ids = subset_rows(len(rows), cfg.train.max_rows, cfg.seed)
            logger.info("training on %d of %d rows, drawn at random (train.max_rows)", cfg.train.max_rows, len(rows))
            rows = [rows[i] for i in self.row_ids]
        self.plan = BatchPlan(
            rows, cfg.train.micro_batch_size, cfg.train.bucket_size, cfg.seed, self.target.tokenizer.pad_token_id
        )
        return rows

    def _setup_drafter(self, rows: list[Any]) -> None:
        """Build (and prepare) the drafter, its optimizer and schedule, wrapped by accelerate."""
        cfg = self.cfg
        torch.manual_seed(cfg.seed)
        model = self.spec.build(cfg.drafter, self.target.model).float()
        self.drafter_info: dict[str, Any] = {}
        if self.spec.prepare is not None:
            self.drafter_info = self.spec.prepare(model, rows, cfg.drafter, self.target.model)
            logger.info("drafter data: %s", self.drafter_info)
        self.n_trainable = sum(p.numel() for p in model.parameters() if p.requires_grad)
        try:
            opt, opt_line = build_optimizer(model, cfg.train, self.acc.device, self.deepspeed)
        except ValueError as e:
            raise ConfigError(str(e)) from e
        logger.info("optimizer: %s", opt_line)
        self.scheduler = torch.optim.lr_scheduler.LambdaLR(opt, lr_lambda(cfg.train))
        self.model, self.opt = self.acc.prepare(model, opt)
        if self.deepspeed:  # what was built, by class: the manifest says which engine trained the drafter
            inner = getattr(self.opt, "optimizer", self.opt)
            self.engine = (
                f"DeepSpeed ZeRO-{self.cfg.deepspeed.zero_stage}: {type(self.model).__name__} + {type(inner).__name__}"
            )
        self.acc.register_for_checkpointing(self.scheduler)
        self.ema: WeightAverage | None = None
        if cfg.train.ema_decay > 0:
            self.ema = WeightAverage(self.acc.unwrap_model(self.model), cfg.train.ema_decay, cfg.train.ema_warmup)
            self.acc.register_for_checkpointing(self.ema)

    def _setup_tracking(self, n_rows: int) -> None:
        cfg = self.cfg
        if self.acc.is_main_process:
            self.tracker = Tracker(
                cfg.wandb, self.run_dir, f"{cfg.run_name}-train-{cfg.drafter.name}", cfg.run_name, "train", asdict(cfg)
            )
        for sig in (signal.SIGUSR2, signal.SIGTERM):
            signal.signal(sig, self._on_signal)
        logger.info(
            "train %s: %d trainable parameters, %d processes, %s, %s; %d rows, %d micro-batches/epoch",
            cfg.drafter.name,
            self.n_trainable,
            self.world,
            self.engine,
            "bf16" if self.bf16 else "fp32",
            n_rows,
            self.plan.per_epoch,
        )

    def _on_signal(self, signum: int, frame: Any) -> None:
        logger.warning("signal %d: checkpointing at the next step, then exiting (resume=true continues)", signum)
        self.stop_signal = signum

    def _heldout_unavailable(self) -> str | None:
        """Why the held-out checks cannot run (no usable held-out prompt), or None. Training then goes on without
        them (a warning, not a failure): best/ becomes the last checkpoint."""

        path = Path(self.cfg.synth_dir) / HELDOUT
        try:
            load_heldout(self.cfg.synth_dir, self.target.tokenizer, 1, self.cfg.data.max_prompt_tokens)
        except FileNotFoundError:
            reason = f"{path} does not exist"
        except (ValueError, KeyError, TypeError, StopIteration) as exc:  # empty, or a corrupt line
            reason = f"{path}: {type(exc).__name__}: {str(exc)[:200]}"
        else:
            return None
        logger.warning(
            "held-out checks skipped (%s): training goes on; best/ will be the last checkpoint. "
            "Raise data.heldout_fraction (or add traffic) and rerun stage=synth to pick best/ on held-out tau.",
            reason,
        )
        return reason

    # -- one optimizer step ----------------------------------------------------------------------

    def _features(self, batch: Any, row_ids: list[int]) -> TargetFeatures:
        """Target hidden states for the batch: from the features stage's files, or a frozen forward now."""
        n_layers = self.target.model.config.num_hidden_layers
        lm_head = output_head(self.target.model)
        B, L = batch.input_ids.shape
        if self.store is not None:
            layers: dict[int, torch.Tensor] = {}
            per_row = [self.store.get(self.row_ids[i]) for i in row_ids]
            for layer in self.feature_layers:
                t = torch.zeros(B, L, per_row[0][layer].shape[-1], dtype=per_row[0][layer].dtype)
                for b, feats in enumerate(per_row):
                    t[b, : feats[layer].shape[0]] = feats[layer]
                layers[layer] = t.to(self.acc.device)
            return TargetFeatures(layers=layers, num_layers=n_layers, lm_head=lm_head)
        with torch.no_grad():
            out = self.target.model(
                input_ids=batch.input_ids,
                attention_mask=batch.attention_mask,
                output_hidden_states=True,
                use_cache=False,
            )
        layers = {i: out.hidden_states[i] for i in self.feature_layers}
        return TargetFeatures(layers=layers, num_layers=n_layers, lm_head=lm_head)

    def _train_step(self) -> dict[str, float]:
        cfg = self.cfg.train
        self.model.train()
        sums: dict[str, float] = {}
        tokens = 0
        for a in range(cfg.grad_accum):
            gi = (self.step * cfg.grad_accum + a) * self.world + self.rank
            batch = self.plan.batch(gi, self.acc.device)
            feats = self._features(batch, self.plan.indices(gi))
            # Randomness inside the loss (EAGLE-3's feature noise) is drawn from a generator seeded by the run's seed
            # and the micro-batch index alone: the same after a resume, whatever else consumed the global generator.
            with self.acc.accumulate(self.model), torch.random.fork_rng(devices=self._rng_devices):
                torch.manual_seed(self.cfg.seed * 1_000_003 + gi)
                # the whole loss under autocast (bf16 runs), not only the wrapped module's forward: the heads' own
                # logits (EAGLE-3's draft LM head is called outside forward) are most of a step's arithmetic
                with self._autocast():
                    loss, metrics = self.spec.loss(self.model, batch, feats, self.cfg.drafter)
                self.acc.backward(loss)
                if self.acc.sync_gradients and not self.deepspeed and cfg.max_grad_norm > 0:
                    self.acc.clip_grad_norm_(self.model.parameters(), cfg.max_grad_norm)
                self.opt.step()
                self.opt.zero_grad()
            tokens += int(batch.attention_mask.sum())
            for k, v in {"loss": loss.detach(), **metrics}.items():
                sums[k] = sums.get(k, 0.0) + float(v)
        self.scheduler.step()
        if self.ema is not None:
            self.ema.update(self.acc.unwrap_model(self.model))
        # The stop flag (a signal seen by any rank before this point) travels with the step's metrics, so every
        # rank decides to stop at the same step (signals reach the ranks at slightly different times).
        stop = float(self.stop_signal is not None)
        vec = torch.tensor([*sums.values(), float(tokens), stop], dtype=torch.float64, device=self.acc.device)
        vec = self.acc.reduce(vec, reduction="sum")
        n = cfg.grad_accum * self.world
        out = {k: vec[i].item() / (1 if k == "tokens" else n) for i, k in enumerate(sums)}
        out["seq_tokens"] = vec[-2].item()
        self.stop_now = vec[-1].item() > 0
        return out

    def _autocast(self) -> Any:
        """bf16 autocast for bf16 runs. Under DeepSpeed accelerate leaves precision to the engine, which holds the
        drafter in bf16 (fp32 master weights in the optimizer) but does not cast its inputs: the target's features
        (float32 on a CPU) meet bf16 weights, so the autocast is entered here as well."""
        if self.deepspeed and self.bf16:
            return torch.autocast(device_type=self.acc.device.type, dtype=torch.bfloat16)
        return self.acc.autocast()

    # -- held-out checks (at a checkpoint: train/checkpointing.py) ------------------------------------

    def _eval_tau(self, drafter: torch.nn.Module) -> dict[str, Any]:
        """Held-out tau of the drafter's configured decode (chain or tree) on a fixed held-out sample.

        ``train.eval_mode=replay`` (default) replays the target's cached greedy continuations (same counts as
        the decoder, see eval/replay.py; one target forward per prompt); ``decode`` runs the real decoder.
        """

        cfg = self.cfg
        prompts = load_heldout(cfg.synth_dir, self.target.tokenizer, cfg.train.eval_prompts, cfg.data.max_prompt_tokens)
        proposer = self.spec.proposer(drafter, self.target.model, cfg.drafter)
        eos = self.target.tokenizer.eos_token_id
        n_tok = cfg.train.eval_max_new_tokens
        desc = f"held-out tau @ step {self.step}"
        if cfg.train.eval_mode == "decode":
            stats, _ = measure(self.target.model, proposer, prompts, n_tok, eos, desc=desc)
            return {src: {"tau": s.tau(), "alpha": s.alpha()} for src, s in stats.items()}

        cache = ContinuationCache(Path(cfg.synth_dir) / REPLAY, self.target.fingerprint)
        conts = cache.get(self.target.model, [p.input_ids for p in prompts], n_tok, self.target.tokenizer.pad_token_id)
        # every check replays the same prompts: the traces are made at the first and read at the others
        traces = TraceCache(Path(cfg.synth_dir) / REPLAY, self.target.fingerprint) if cfg.eval.trace_cache else None
        per, _, _ = replay_many(
            self.target.model,
            {"drafter": proposer},
            prompts,
            conts,
            n_tok,
            eos,
            desc=desc,
            lanes=cfg.eval.replay_lanes,
            trace_cache=traces,
        )
        res = finish_result(Result(name="drafter"), per["drafter"])
        return {
            src: {"tau": s.tau(), "alpha": s.alpha(), "tau_ci": list(bootstrap_tau_ci(res.per_prompt[src]))}
            for src, s in res.stats.items()
        }

    # -- the loop ----------------------------------------------------------------------------------

    def train(self) -> dict[str, Any]:

        cfg = self.cfg.train
        stop_at = min(cfg.max_steps, cfg.stop_after_steps or cfg.max_steps)
        t_start = time.perf_counter()
        self._segment = {"t0": t_start, "step0": self.step, "seq": 0.0, "sup": 0.0}
        seq_tokens = sup_tokens = 0.0
        window_t, window_tok = time.perf_counter(), 0.0
        bar = tqdm(
            total=stop_at,
            initial=self.step,
            unit="step",
            desc="train",
            dynamic_ncols=True,
            disable=not self.acc.is_main_process,
            mininterval=2.0,
        )
        start_step = self.step
        while self.step < stop_at:
            m = self._train_step()
            self.step += 1
            self.losses.append([self.step, m["loss"]])
            seq_tokens += m["seq_tokens"]
            sup_tokens += m.get("tokens", 0.0) * cfg.grad_accum * self.world
            self._segment["seq"], self._segment["sup"] = seq_tokens, sup_tokens
            window_tok += m["seq_tokens"]
            bar.update(1)
            if self.step % cfg.log_every == 0 or self.step == stop_at:
                m["tokens_per_s"] = window_tok / max(time.perf_counter() - window_t, 1e-9)
                window_t, window_tok = time.perf_counter(), 0.0
                self._log_step(m, bar)
            if self.stop_now:
                bar.close()
                self._stop_for_signal()
            evaluate = bool(cfg.eval_every) and self.step % cfg.eval_every == 0 and self.heldout_skip is None
            if self.step % cfg.save_every == 0 or evaluate:
                self._save(evaluate=evaluate)
        bar.close()
        elapsed = time.perf_counter() - t_start
        done = self.step >= cfg.max_steps
        self._finish_checkpoints(done)
        total = self._accounting_now(elapsed)
        # every process's peak resident memory (the target, the drafter, its optimizer state, buffers): what ZeRO-3
        # saves per process shows here (a collective: every process reaches this line)
        rss = torch.tensor([resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0], dtype=torch.float64)
        peak_rss = [round(float(v), 1) for v in self.acc.gather(rss.to(self.acc.device)).cpu()]
        peak_gpu = None
        if self.acc.device.type == "cuda":
            mb = torch.tensor([torch.cuda.max_memory_allocated(self.acc.device) / 2**20], dtype=torch.float64)
            peak_gpu = [round(float(v), 1) for v in self.acc.gather(mb.to(self.acc.device)).cpu()]
        result = {
            "steps": self.step,
            "steps_this_process": self.step - start_step,
            "finished": done,
            "best": self.best,
            "trainable_parameters": self.n_trainable,
            "drafter_data": self.drafter_info,
            "train_rows": len(self.plan.rows),
            "world_size": self.world,
            "engine": self.engine,
            "precision": "bf16" if self.bf16 else "fp32",
            "peak_rss_mb_per_process": peak_rss,
            "peak_gpu_mb_per_process": peak_gpu,
            # over every segment of the run (a resumed run counts the time before its resume too)
            "train_tokens_per_second": round(total["seq_tokens"] / max(total["seconds"], 1e-9), 2),
            "supervised_tokens_per_second": round(total["sup_tokens"] / max(total["seconds"], 1e-9), 2),
            "seconds": total["seconds"],
            "seconds_this_process": round(elapsed, 2),
            "segments": total["segments"],
            "heldout_checks": "ran" if self.heldout_skip is None else f"skipped: {self.heldout_skip}",
        }
        self._write_result(result)
        return result

    def _log_step(self, m: dict[str, float], bar: Any) -> None:
        """One logged step: progress bar, log line, W&B (``m`` holds the step's metrics and the window's rate)."""
        m["lr"] = self.scheduler.get_last_lr()[0]
        bar.set_postfix(
            loss=f"{m['loss']:.3f}",
            acc=f"{m.get('acc_top1_pos1', 0):.3f}",
            tok_s=f"{m['tokens_per_s']:.0f}",
            refresh=False,
        )
        logger.info(
            "step %d loss %.4f %s", self.step, m["loss"], {k: float(f"{v:.4g}") for k, v in m.items() if k != "loss"}
        )
        if self.tracker:
            self.tracker.log({f"train/{k}": v for k, v in m.items()}, step=self.step)

    def _write_result(self, result: dict[str, Any]) -> None:
        if self.acc.is_main_process:
            write_manifest(
                self.run_dir / MANIFEST,
                "train",
                self.cfg,
                inputs={"synth_dir": self.cfg.synth_dir, "synth_plan": self.synth_manifest.get("plan_hash")},
                target={"name": self.cfg.target.name, "fingerprint": self.target.fingerprint},
                result=result,
                history=self.history,
                losses=self.losses,
                resumes=self.resumes,
                files={"best": "best/", "checkpoints": "checkpoints/step-*/"},
            )
            if self.tracker:
                self.tracker.summary({"best_tau": self.best["tau"], "best_step": self.best["step"]})
                self.tracker.summary({f"result/{k}": v for k, v in result.items() if isinstance(v, int | float)})
                files = {"manifest": MANIFEST, "best": BEST, "checkpoints": CHECKPOINTS}
                self.tracker.files(self.run_dir, files)

    def cleanup(self) -> None:
        from accelerate.state import AcceleratorState

        if self.tracker:
            self.tracker.finish()
        if hasattr(self, "acc"):
            self.acc.end_training()  # destroys the process group ...
            # ... but accelerate's process-wide state (a singleton) still says it is set up: the next training job
            # in this process (a local Hydra multirun sweep) would build on a process group that is gone
            AcceleratorState._reset_state(reset_partial_state=True)


def run_train(cfg: Config, run_dir: Path) -> dict[str, Any]:
    trainer = Trainer(cfg, run_dir)
    try:
        trainer.setup()
        return trainer.train()
    finally:
        trainer.cleanup()
