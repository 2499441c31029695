"""The training run's checkpoints: save (atomic, a full disk loses nothing), held-out check at a save, prune,
publish ``best/``, resume from the newest checkpoint that loads (refusing a changed config), preemption.

:class:`Checkpointing` is the part of :class:`train.loop.Trainer` that manages ``<run_dir>/checkpoints/`` and
``<run_dir>/best``; the safety checks it applies before anything is loaded are in :mod:`train.checkpoints`.
"""

from __future__ import annotations

import json
import logging
import os
import shutil
import signal
import time
from dataclasses import asdict, is_dataclass
from pathlib import Path
from typing import Any

import torch

from data.atomic import atomic_dir, atomic_write_json, raise_if_disk_full, sweep_unfinished
from data.config import ConfigError
from data.layout import BEST, CHECKPOINT_DRAFTER, CHECKPOINT_STATE, STEP_GLOB, STOPPED, TRAINER_STATE, step_name
from data.tracking import Tracker
from train.checkpoints import CorruptCheckpointError, compare_resume_config, verify_checkpoint
from train.config import Config

logger = logging.getLogger(__name__)


class Checkpointing:
    """Checkpoint management of a training run (a base of :class:`train.loop.Trainer`, which sets the attributes)."""

    cfg: Config
    run_dir: Path
    ckpt_root: Path
    acc: Any
    spec: Any
    target: Any
    model: torch.nn.Module
    ema: Any
    deepspeed: bool
    world: int
    tracker: Tracker | None
    step: int
    best: dict[str, Any]
    history: list[dict[str, Any]]
    losses: list[list[float]]
    accounting: dict[str, Any]
    resumes: list[dict[str, Any]]
    resume_changes: dict[str, Any]
    heldout_skip: str | None
    stop_signal: int | None
    _segment: dict[str, float]

    def _eval_tau(self, drafter: torch.nn.Module) -> dict[str, Any]:  # the held-out check (Trainer)
        raise NotImplementedError

    def _checkpoints(self) -> list[Path]:
        return sorted(p for p in self.ckpt_root.glob(STEP_GLOB) if (p / TRAINER_STATE).is_file())

    def _check_resume_config(self) -> dict[str, Any]:
        """Compare the newest readable checkpoint's saved config with this run's (see train/checkpoints.py)."""

        for ckpt in reversed(self._checkpoints()):
            try:
                saved = json.loads((ckpt / TRAINER_STATE).read_text(encoding="utf-8"))
            except (OSError, UnicodeDecodeError, json.JSONDecodeError):
                continue  # corrupt: the resume itself skips it (and says so)
            return compare_resume_config(saved.get("config"), asdict(self.cfg), ckpt, self._schema_defaults())
        return {}

    def _schema_defaults(self) -> dict[str, Any]:
        """The schema's defaults for this run's config (its drafter family's included), for the resume check."""
        defaults = Config()
        if is_dataclass(self.cfg.drafter):  # a key newer than the checkpoint: what the code did before it existed
            family = type(self.cfg.drafter)
            defaults.drafter = family(**getattr(family, "absent_means", {}))
        return asdict(defaults)

    def _resume_or_refuse(self) -> None:
        if self.acc.is_main_process:  # what a killed save or publish left (this run holds the lock): never resumed
            sweep_unfinished(self.run_dir)
            sweep_unfinished(self.ckpt_root)
        self.acc.wait_for_everyone()
        existing = self._checkpoints()
        if not self.cfg.resume:
            if existing and not self.cfg.overwrite:
                raise ConfigError(
                    f"{self.run_dir} already holds checkpoints ({existing[-1].name}): add resume=true to "
                    f"continue that run (same drafter and settings), overwrite=true to start again, or train a new "
                    f"run: run_name=<new> synth_dir={self.cfg.synth_dir} (the same data) train.features=online (or "
                    f"stage=features for the new run first)."
                )
            if existing and self.acc.is_main_process:
                shutil.rmtree(self.ckpt_root, ignore_errors=True)
            self.acc.wait_for_everyone()
            return
        if not existing:
            logger.warning("resume=true but no checkpoint in %s: starting from step 0", self.ckpt_root)
            return

        skipped: list[dict[str, str]] = []
        for last in reversed(existing):  # the newest checkpoint that loads; never one that could run code
            try:
                state = verify_checkpoint(last)
                self.acc.load_state(str(last / CHECKPOINT_STATE))
            except CorruptCheckpointError as exc:
                logger.warning("resume: skipping checkpoint %s: %s", last.name, exc)
                skipped.append({"checkpoint": last.name, "reason": str(exc)})
                continue
            break
        else:
            raise ConfigError(
                f"resume=true: no checkpoint in {self.ckpt_root} loads ("
                + "; ".join(f"{s['checkpoint']}: {s['reason']}" for s in skipped)
                + "). Start again with overwrite=true."
            )
        self.step, self.best, self.history = state["step"], state["best"], state.get("history", [])
        self.losses = state.get("losses", [])
        self.accounting = state.get("accounting") or self.accounting  # checkpoints older than it: from here on
        self.resumes = [
            *state.get("resumes", []),
            {"step": self.step, "from": last.name, "changed": self.resume_changes, "skipped": skipped},
        ]
        if skipped:
            names = [s["checkpoint"] for s in skipped]
            logger.warning("resumed from the older checkpoint %s (skipped %s)", last.name, names)
            self.acc.wait_for_everyone()
            if self.acc.is_main_process:  # set the unloadable ones aside (kept for inspection, never resumed)
                for name in names:
                    aside = self.ckpt_root / f".{name}.corrupt"
                    shutil.rmtree(aside, ignore_errors=True)
                    os.replace(self.ckpt_root / name, aside)
            self.acc.wait_for_everyone()
        logger.info("resumed from %s (step %d)", last, self.step)

    def _drafter_copy(self) -> torch.nn.Module:
        """A plain (unwrapped, gathered under ZeRO-3) copy of the drafter for saving and decoding."""
        state = self._full_state() if self.deepspeed else self.acc.get_state_dict(self.model)
        if self.ema is not None:  # the averaged weights are what is saved, checked and published
            state = {**state, **self.ema.shadow}
        copy = self.spec.build(self.cfg.drafter, self.target.model)
        if self.acc.is_main_process:
            copy.load_state_dict(
                {k: v.to(torch.float32) if v.is_floating_point() else v for k, v in state.items()}, strict=False
            )
        # on the target's device: the held-out check feeds it the target's hidden states (spec.build builds on the CPU)
        return copy.to(device=self.target.device, dtype=self.target.model.dtype).eval()

    def _full_state(self) -> dict[str, torch.Tensor]:
        """The drafter's whole state under DeepSpeed, on every process (a collective under ZeRO-3): trained weights
        from the optimizer's float32 master copy (the module itself holds bf16 copies in bf16 runs, and only a
        shard under ZeRO-3), frozen weights and buffers gathered from the module."""
        from deepspeed import zero
        from deepspeed.utils import safe_get_full_fp32_param

        module = self.acc.unwrap_model(self.model)
        state: dict[str, torch.Tensor] = {}
        for name, p in module.named_parameters():
            full = safe_get_full_fp32_param(p) if p.requires_grad else None
            if full is None:  # no optimizer state (frozen): the module's own copy, gathered under ZeRO-3
                with zero.GatheredParameters([p], modifier_rank=None, enabled=hasattr(p, "ds_id")):
                    full = p.detach().clone()
            state[name] = full.detach().cpu().clone()
        for name, b in module.named_buffers():
            state[name] = b.detach().cpu().clone()
        return state

    def _save(self, final: bool = False, evaluate: bool = False) -> None:
        """Write the step's checkpoint into a temporary directory and rename it into place; a full disk (or any
        error) on the way removes the temporary directory and leaves the previous checkpoints as they were."""
        name = step_name(self.step)
        final_dir = self.ckpt_root / name
        tmp = self.ckpt_root / f".{name}.tmp"
        try:
            self._write_checkpoint(name, final_dir, tmp, final, evaluate)
        except BaseException as exc:
            if self.acc.is_main_process:
                shutil.rmtree(tmp, ignore_errors=True)
            if isinstance(exc, OSError):
                raise_if_disk_full(exc, final_dir)
            raise

    def _write_checkpoint(self, name: str, final_dir: Path, tmp: Path, final: bool, evaluate: bool) -> None:
        if self.acc.is_main_process:
            shutil.rmtree(tmp, ignore_errors=True)
            tmp.mkdir(parents=True)
        self.acc.wait_for_everyone()
        self.acc.save_state(str(tmp / CHECKPOINT_STATE))
        drafter = self._drafter_copy()
        if self.acc.is_main_process:
            self.spec.save(drafter, str(tmp / CHECKPOINT_DRAFTER), self.cfg.drafter, self.target)
            if evaluate:
                heldout = self._eval_tau(drafter)
                tau = heldout["all"]["tau"]
                self.history.append({"step": self.step, "heldout": heldout})
                if self.tracker:
                    self.tracker.log(
                        {
                            "heldout/tau": tau,
                            **{f"heldout/tau_{s}": v["tau"] for s, v in heldout.items()},
                            **{f"heldout/alpha_{i + 1}": a for i, a in enumerate(heldout["all"]["alpha"])},
                            **dict(
                                zip(
                                    ("heldout/tau_lo", "heldout/tau_hi"), heldout["all"].get("tau_ci", []), strict=False
                                )
                            ),
                        },
                        step=self.step,
                    )
                logger.info(
                    "step %d: held-out tau %.3f %s", self.step, tau, {s: round(v["tau"], 3) for s, v in heldout.items()}
                )
                if self.best["tau"] is None or tau > self.best["tau"]:
                    self.best = {"tau": tau, "step": self.step, "checkpoint": name}
            atomic_write_json(
                tmp / TRAINER_STATE,
                {
                    "step": self.step,
                    "best": self.best,
                    "history": self.history,
                    "losses": self.losses,
                    "config": asdict(self.cfg),
                    "resumes": self.resumes,
                    "accounting": self._accounting_now(),
                },
            )
            shutil.rmtree(final_dir, ignore_errors=True)
            os.replace(tmp, final_dir)
            self._prune()
            if final or evaluate:
                self._publish_best()
        self.acc.wait_for_everyone()

    def _accounting_now(self, seconds: float | None = None) -> dict[str, Any]:
        """:attr:`accounting` with this process's segment so far added (a checkpoint records it; the result too);
        ``seconds``: the segment's own (default: since it started)."""
        seg = self._segment
        seconds = time.perf_counter() - seg["t0"] if seconds is None else seconds
        acct = self.accounting
        segment = {
            "steps": [int(seg["step0"]), self.step],
            "seconds": round(seconds, 2),
            "world_size": self.world,
            "threads": torch.get_num_threads(),
        }
        return {
            "seconds": round(acct["seconds"] + seconds, 2),
            "seq_tokens": acct["seq_tokens"] + seg["seq"],
            "sup_tokens": acct["sup_tokens"] + seg["sup"],
            "segments": [*acct["segments"], segment],
        }

    def _prune(self) -> None:
        keep = {self.best.get("checkpoint")}
        ckpts = self._checkpoints()
        for p in ckpts[: max(0, len(ckpts) - self.cfg.train.keep_checkpoints)]:
            if p.name not in keep:
                shutil.rmtree(p, ignore_errors=True)

    def _publish_best(self) -> None:
        """Copy the best (else the latest) checkpoint's drafter to ``<run_dir>/best`` atomically."""

        name = self.best.get("checkpoint") or self._checkpoints()[-1].name
        with atomic_dir(self.run_dir / BEST) as tmp:
            shutil.copytree(self.ckpt_root / name / CHECKPOINT_DRAFTER, tmp, dirs_exist_ok=True)

    def _stop_for_signal(self) -> None:
        """Preempted (SIGUSR2/SIGTERM): checkpoint, leave ``stopped.json`` for the job script, exit."""
        self._save()
        if self.acc.is_main_process:  # tells a SLURM job script to requeue (slurm/train.sbatch)
            atomic_write_json(self.run_dir / STOPPED, {"step": self.step, "signal": self.stop_signal or signal.SIGUSR2})
        raise SystemExit(f"stopped by signal {self.stop_signal} at step {self.step}; resume=true continues")

    def _finish_checkpoints(self, done: bool) -> None:
        """The last checkpoint (with the final held-out check when training is done), and best/."""
        need_eval = done and self.heldout_skip is None and (not self.history or self.history[-1]["step"] != self.step)
        saved = self._checkpoints()
        if need_eval or not saved or saved[-1].name != step_name(self.step):
            self._save(final=done, evaluate=need_eval)
        elif done and self.acc.is_main_process:  # no held-out check at the end: best/ is the best so far, or the last
            self._publish_best()
