"""Stage export: turn a trained drafter into the files a serving engine loads, checked before it is written.

``python -m train stage=export export.format=<format>`` reads ``export.drafter_dir`` (default: the train
stage's best checkpoint), looks the (drafter family, format) pair up in :data:`train.export.core.FORMATS`
(an unknown pair is a ConfigError listing the valid ones), and writes ``export.out_dir`` atomically:

1. the format's tensors are checked against its required names and shapes (refused if one is missing/wrong);
2. weights (safetensors only), ``config.json`` (naming the target and its fingerprint) and a model card
   ``README.md`` (training data, budget, the eval stage's held-out tau table) go into a temporary directory;
3. the written files are read back and checked again, re-imported by the project (the format's importer
   maps them back to the family's module), and the re-imported drafter must give the trained drafter's
   draft logits on a fixed input;
4. only then is the directory renamed onto ``export.out_dir``.
"""

from __future__ import annotations

import json
import logging
import time
from pathlib import Path
from typing import Any

from data.atomic import atomic_dir, sweep_unfinished
from data.config import ConfigError
from data.layout import BEST, MANIFEST, METRICS, TABLE, export_dir
from data.manifest import write_manifest
from data.target import load_target
from data.tracking import log_stage
from train.config import Config
from train.drafters.registry import load_drafter
from train.export.core import (
    ExportError,
    Format,
    Source,
    check_safetensors_only,
    check_tensors,
    get_format,
    max_abs_diff,
    model_card,
    read_shapes,
)

__all__ = ["drafter_family", "export_drafter", "find_train_manifest", "read_deploy", "read_eval", "run_export"]

logger = logging.getLogger(__name__)

ROUND_TRIP_ATOL = 1e-5
"""Largest |logit difference| allowed between the trained and the re-imported drafter. The weights are the
same bits and the forward is the same code on the same device, so the difference is 0 in practice; the
margin only covers kernels that are not bitwise deterministic across calls."""


def drafter_family(drafter_dir: Path) -> str:
    conf = drafter_dir / "config.json"
    if not conf.is_file():
        raise FileNotFoundError(
            f"No drafter checkpoint in {drafter_dir}: run stage=train for this run_name first, or set "
            "export.drafter_dir"
        )
    meta = json.loads(conf.read_text(encoding="utf-8")).get("draftsmith", {}).get("drafter")
    if not meta or "name" not in meta:
        raise ValueError(f"{conf} does not say which drafter family it holds (draftsmith.drafter.name)")
    return str(meta["name"])


def find_train_manifest(drafter_dir: Path) -> dict[str, Any] | None:
    """The train stage's manifest.json in the drafter directory or up to three levels above it."""
    for d in [drafter_dir, *list(drafter_dir.resolve().parents)[:3]]:
        path = d / MANIFEST
        if path.is_file():
            m = json.loads(path.read_text(encoding="utf-8"))
            if m.get("stage") == "train":
                return m
    return None


def read_eval(eval_dir: str | None) -> tuple[dict[str, Any] | None, str | None]:
    if not eval_dir:
        return None, None
    d = Path(eval_dir)
    metrics = json.loads((d / METRICS).read_text(encoding="utf-8")) if (d / METRICS).is_file() else None
    table = (d / TABLE).read_text(encoding="utf-8") if (d / TABLE).is_file() else None
    return metrics, table


def read_deploy(deploy_dir: str | None, drafter_dir: Path) -> dict[str, Any] | None:
    """``deploy.json`` of a stage deploy made for this drafter directory, or None."""
    path = Path(deploy_dir) / "deploy.json" if deploy_dir else None
    if path is None or not path.is_file():
        return None
    report = json.loads(path.read_text(encoding="utf-8"))
    same = Path(str(report.get("drafter_dir", ""))).resolve() == drafter_dir.resolve()
    return report if same else None


def export_drafter(src: Source, fmt: Format, out_dir: Path, verify: bool = True) -> dict[str, Any]:
    """Check, write, re-check and (``verify``) round-trip one export; return what was written."""
    where = f"{fmt.family} -> {fmt.name} export {out_dir}"
    weights = fmt.tensors(src)
    required = fmt.required(src)
    check_tensors(where, weights, required)
    result: dict[str, Any] = {"format": fmt.name, "family": fmt.family, "out_dir": str(out_dir)}
    sweep_unfinished(out_dir.parent, names=(out_dir.name,))  # what a killed export of out_dir left behind
    with atomic_dir(out_dir) as tmp:
        fmt.write(src, tmp, weights)
        files = sorted(p.name for p in tmp.iterdir() if p.is_file())
        (tmp / "README.md").write_text(model_card(src, fmt, [*files, "README.md"]), encoding="utf-8")
        check_safetensors_only(tmp)
        for f in tmp.iterdir():
            f.chmod(0o644)
        check_tensors(where + " (as written)", read_shapes(tmp, list(required)), required)
        if verify:
            # the importers build on the CPU; the probe runs both drafters on the target's device
            imported = fmt.load(tmp, src.target).to(src.target.device)
            diff = max_abs_diff(fmt.probe(src.module, src.target), fmt.probe(imported, src.target))
            result["round_trip_max_abs_logit_diff"] = diff
            atol = ROUND_TRIP_ATOL if fmt.round_trip_atol is None else fmt.round_trip_atol
            if not diff <= atol:
                raise ExportError(
                    f"refusing to write {where}: the re-imported drafter's draft logits differ from the trained "
                    f"drafter's by {diff:.3g} (> {atol})"
                )
        result["files"] = sorted(p.name for p in tmp.iterdir())
    return result


def run_export(cfg: Config, run_dir: Path, target: Any = None) -> dict[str, Any]:
    t0 = time.perf_counter()
    e = cfg.export
    drafter_dir = Path(e.drafter_dir or f"{cfg.train_dir}/{BEST}")
    family = drafter_family(drafter_dir)
    fmt = get_format(family, e.format)
    out_dir = Path(e.out_dir) if e.out_dir else export_dir(cfg.runs_root, cfg.run_name, fmt.name)
    if out_dir.exists() and any(out_dir.iterdir()) and not cfg.overwrite:
        prev = out_dir / "config.json"
        same = (
            prev.is_file()
            and (json.loads(prev.read_text(encoding="utf-8")).get("draftsmith") or {}).get("export_format") == fmt.name
        )
        if not same:
            raise ConfigError(
                f"{out_dir} exists and holds something else; set overwrite=true or another export.out_dir"
            )
    target = target or load_target(cfg.target)
    train_manifest = find_train_manifest(drafter_dir)
    trained_fp = ((train_manifest or {}).get("target") or {}).get("fingerprint")
    if trained_fp and trained_fp != target.fingerprint:
        raise ExportError(
            f"the drafter in {drafter_dir} was trained for target fingerprint {trained_fp}, but the configured "
            f"target ({cfg.target.name}, {target.path}) has {target.fingerprint}: export it with its own target"
        )
    if train_manifest is None:
        logger.warning("no train manifest found beside %s: the model card will not name the training data", drafter_dir)
    _, module, dcfg = load_drafter(str(drafter_dir), target)
    metrics, table = read_eval(e.eval_dir)
    src = Source(
        drafter_dir=drafter_dir,
        family=family,
        module=module,
        drafter_cfg=dcfg,
        target=target,
        target_name=cfg.target.name,
        train_manifest=train_manifest,
        eval_metrics=metrics,
        eval_table=table,
        deploy_report=read_deploy(e.deploy_dir, drafter_dir),
    )
    result = export_drafter(src, fmt, out_dir, verify=e.verify)

    result["seconds"] = round(time.perf_counter() - t0, 2)
    write_manifest(
        run_dir / f"manifest-{fmt.name}.json",
        "export",
        cfg,
        target={"name": cfg.target.name, "fingerprint": target.fingerprint},
        inputs={"drafter_dir": str(drafter_dir), "eval_dir": e.eval_dir if metrics else None},
        result=result,
    )

    log_stage(
        cfg,
        run_dir,
        "export",
        {"format": fmt.name, "family": family, **result},
        {"manifest": f"manifest-{fmt.name}.json", "export": str(out_dir)},
    )
    logger.info(
        "exported %s drafter as %s to %s (round trip max |logit diff| %s)",
        family,
        fmt.name,
        out_dir,
        result.get("round_trip_max_abs_logit_diff"),
    )
    return result
