"""Stage deploy: the serving advice for a trained drafter, measured on the engine and machine it will run on.

``python -m train stage=deploy run_name=<run>`` (reads ``runs/<run>/train/best`` and ``runs/<run>/eval``):

1. exports the drafter in the format vLLM serves (checked and round-tripped like stage export) into
   ``runs/<run>/deploy/<format>/``;
2. calibrates vLLM (a real engine, started from ``.venv-engine`` or ``deploy.vllm_python``): plain decoding and each
   ``deploy.calibrate_k`` served at every ``deploy.batch_sizes`` concurrency on held-out prompts (real EOS, greedy),
   with vLLM's own speculative-decoding counters;
3. fits the cost of a speculative step per batch size (``a(B) + b(B) K`` plain steps, :mod:`eval.serving`), takes
   the drafter's per-position acceptance per source from the eval stage's replay (or vLLM's counters), and picks the
   K per batch-size range that maximises the predicted tokens/s, K=0 where speculation does not pay;
4. writes ``vllm.json`` (the ``speculative_config`` with ``num_speculative_tokens_per_batch_size``, for
   ``vllm serve --speculative-config``), ``sglang.txt`` (SGLang's flags, for the families SGLang loads),
   ``deploy.md`` (the table and why each range got its K, per-domain advice), ``deploy.png``, ``deploy.json`` and
   the same advice in the export's model card. ``deploy.verify=true`` also serves the schedule itself (and every K
   not calibrated) and reports measured against predicted.
"""

from __future__ import annotations

import contextlib
import json
import logging
import math
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from tqdm import tqdm

from data.atomic import atomic_write_json, atomic_write_text, atomic_write_with
from data.config import ConfigError, check_bounds
from data.layout import BEST, MANIFEST, METRICS
from data.manifest import write_manifest
from data.tables import table
from data.target import load_target
from data.vllm_engine import EngineError, VLLMEngine, find_engine_python
from eval.heldout import Prompt, load_heldout
from eval.serving import Measured, Plan, alpha_from_counts, expected_tokens, k_at, make_plan
from train.config import Config, DeployConfig
from train.drafters.registry import load_drafter
from train.export import drafter_family, export_drafter, find_train_manifest, read_eval
from train.export.core import ExportError, Source, get_format, model_card

logger = logging.getLogger(__name__)

VLLM_FORMAT: dict[str, tuple[str, str | None]] = {
    "eagle3": ("speculators", "eagle3"),
    "standalone": ("hf", None),
    "eagle": ("vllm_eagle", "eagle"),
    "medusa": ("vllm_medusa", "medusa"),
    "dflash": ("speculators", "dflash"),
}
"""Family -> (export format, ``speculative_config`` method) vLLM serves it with (None: a draft model, no method)."""

SGLANG_FORMAT: dict[str, tuple[str, str]] = {
    "eagle3": ("sglang_eagle3", "EAGLE3"),
    "eagle": ("sglang_eagle", "EAGLE"),
    "dflash": ("sglang_dflash", "DFLASH"),
}
"""Family -> (export format, ``--speculative-algorithm``) for SGLang."""


def vllm_format(family: str) -> tuple[str, str | None]:
    if family not in VLLM_FORMAT:
        raise ConfigError(f"stage deploy serves {', '.join(VLLM_FORMAT)} drafters in vLLM, not {family!r}")
    return VLLM_FORMAT[family]


def allowed_ks(family: str, dcfg: Any, k_max: int) -> list[int]:
    """The K a drafter can be served with: Medusa drafts one token per head; a DFlash block is trained for one
    length (vLLM drafts K + 1 positions, so another K changes what the block computes): only block_size - 1, whatever
    ``k_max`` says."""
    if family == "medusa":
        return list(range(1, min(k_max, int(dcfg.num_heads)) + 1))
    if family == "dflash":
        return [int(dcfg.block_size) - 1]
    return list(range(1, k_max + 1))


def check_deploy_config(d: DeployConfig) -> None:
    check_bounds(d, "deploy.")
    if not d.batch_sizes:
        raise ConfigError("deploy.batch_sizes is empty: give one or more batch sizes")
    if max(d.batch_sizes) > d.max_batch:
        raise ConfigError(f"deploy.batch_sizes go up to {max(d.batch_sizes)} > deploy.max_batch={d.max_batch}")
    if not d.calibrate_k or any(k > d.k_max for k in d.calibrate_k):
        raise ConfigError(f"deploy.calibrate_k={d.calibrate_k}: give one or more K in 1..deploy.k_max={d.k_max}")


def read_acceptance(eval_dir: str | None, family: str) -> tuple[dict[str, list[float]], str] | None:
    """Per-source conditional per-position acceptance of the drafter's chain from the eval stage, and where it came
    from; None when there is no eval of this family's chain."""
    if not eval_dir or not (Path(eval_dir) / METRICS).is_file():
        return None
    metrics = json.loads((Path(eval_dir) / METRICS).read_text(encoding="utf-8")).get("metrics") or {}
    chains = [n for n in metrics if n.startswith(f"{family}_chain_k")]
    if not chains:
        return None
    name = max(chains, key=lambda n: len((metrics[n].get("all") or {}).get("alpha") or []))  # the longest chain
    alpha = {
        src: [0.0 if a is None or (isinstance(a, float) and math.isnan(a)) else float(a) for a in m.get("alpha") or []]
        for src, m in metrics[name].items()
    }
    alpha = {s: a for s, a in alpha.items() if a}
    if "all" not in alpha:
        return None
    how = (metrics[name]["all"].get("tau_from") or "eval") + f" ({name}, {eval_dir})"
    return alpha, how


@dataclass
class Served:
    """One configuration at one batch size, pooled over repeats: the counts, and the first repeat's tokens of each
    request (for the lossless check)."""

    measured: Measured
    outputs: list[list[int]]
    rates: list[float] = field(default_factory=list)
    """tokens/s of each repeat."""

    @property
    def spread(self) -> float:
        """(max - min) / mean of the repeats' tokens/s: how much this point moved between repeats."""
        r = self.rates
        return (max(r) - min(r)) / (sum(r) / len(r)) if len(r) > 1 else 0.0

    def add(self, other: Served) -> None:
        self.rates += other.rates
        m, o = self.measured, other.measured
        m.generated += o.generated
        m.seconds += o.seconds
        m.drafts += o.drafts
        m.draft_tokens += o.draft_tokens
        m.accepted += o.accepted
        n = max(len(m.per_pos), len(o.per_pos))
        m.per_pos = [(m.per_pos + [0] * n)[i] + (o.per_pos + [0] * n)[i] for i in range(n)]


def start_engine(target_path: str, python: str, spec: dict[str, Any] | None, d: DeployConfig, eos: int | None) -> Any:
    """A vLLM engine with ``spec`` (None: plain decoding), its engine core in the worker process itself: on a small
    CPU machine vLLM's separate engine-core process busy-polls a core the model needs, and throughput then differs
    between engine processes by more than the effect measured (up to 30% here; in-process: a few %)."""
    extra: dict[str, Any] = {
        "disable_log_stats": False,  # the speculative-decoding counters
        "max_num_seqs": max(d.batch_sizes),
        "enable_prefix_caching": False,  # a prompt repeated to fill a batch must cost what a new one does
    }
    if spec is not None:
        extra["speculative_config"] = spec
    return VLLMEngine(
        target_path,
        python=python,
        max_model_len=d.max_model_len,
        kv_cache_gb=d.kv_cache_gb,
        eos_token_id=eos,
        extra_args=extra,
        in_process=True,
    )


def serve_point(
    engine: Any, prompts: list[Prompt], b: int, d: DeployConfig, key: int, k: int | None, counters: bool
) -> Served:
    """Serve ``min_requests`` (rounded up to a multiple of ``b``) held-out prompts in groups of ``b`` concurrent
    requests; ``k``: the draft length to set in the engine first (:func:`data.vllm_engine.set_k`); ``counters``:
    the engine's speculative-decoding counters before and after give drafts and acceptances."""
    n = b * math.ceil(d.min_requests / b)
    reqs = [prompts[i % len(prompts)].input_ids for i in range(n)]
    before = engine.counters if counters else {}
    seconds, outputs = 0.0, []
    for g in range(0, n, b):
        last = g + b >= n
        outs, dt = engine.generate(reqs[g : g + b], d.max_new_tokens, counters=counters and last, k=k)
        seconds += dt
        outputs += outs
    m = Measured(k=key, batch=b, generated=sum(len(o) for o in outputs), seconds=seconds)
    if counters:
        after = engine.counters
        m.drafts = after["drafts"] - before["drafts"]
        m.draft_tokens = after["draft_tokens"] - before["draft_tokens"]
        m.accepted = after["accepted"] - before["accepted"]
        prev = list(before.get("per_pos") or []) + [0] * len(after.get("per_pos") or [])
        m.per_pos = [a - p for a, p in zip(after.get("per_pos") or [], prev, strict=False)]
    return Served(m, outputs, [m.tokens_per_s])


def warm_up(engine: Any, prompts: list[Prompt], counters: bool) -> None:
    """First calls pay one-time set-up; the counters start being read here."""
    engine.generate([p.input_ids for p in prompts[:2]], 4, counters=counters)


def measure(
    engines: dict[str, tuple[Any, int | None, bool]],
    prompts: list[Prompt],
    d: DeployConfig,
    desc: str,
) -> dict[str, dict[int, Served]]:
    """Every configuration at every batch size, ``deploy.repeats`` times, interleaved (batch size by batch size, each
    repeat visiting every configuration in turn) so that a drift of the machine lands on all of them alike.
    ``engines``: key -> (engine, K to set or None, read counters)."""
    out: dict[str, dict[int, Served]] = {key: {} for key in engines}
    with tqdm(total=len(engines) * len(d.batch_sizes) * d.repeats, desc=desc, unit="run") as bar:
        for b in sorted(d.batch_sizes):
            for _ in range(d.repeats):
                for key, (engine, k, counters) in engines.items():
                    kk = int(key) if key.isdigit() else k or 0
                    got = serve_point(engine, prompts, b, d, kk, k, counters)
                    if b in out[key]:
                        out[key][b].add(got)
                    else:
                        out[key][b] = got
                    bar.update(1)
                    bar.set_postfix(config=key, batch=b, tok_s=f"{got.measured.tokens_per_s:.1f}")
    return out


def why(plan: Plan, b: int, allowed: list[int]) -> str:
    k, r = plan.chosen[b]
    preds = {kk: plan.predicted("all", b, kk) for kk in allowed}
    best = max(preds, key=lambda x: preds[x]) if preds else 0
    if k == 0:
        return (
            f"off: the best, K={best}, is predicted {preds.get(best, 1.0):.2f}x plain, under {plan.margin(b):.2f} x "
            f"the drafter's engine at K=0 ({plan.idle(b):.2f}x)"
        )
    runner = sorted((v, kk) for kk, v in preds.items() if kk != k)
    nxt = f"; next K={runner[-1][1]} {runner[-1][0]:.2f}x" if runner else ""
    return f"K={k}: predicted {r:.2f}x plain, the highest{nxt}"


def markdown(report: dict[str, Any], plan: Plan, allowed: list[int]) -> str:
    sizes = sorted(plan.costs)
    ks = allowed
    if plan.speculates:
        advice = [
            "```",
            f'vllm serve {report["target"]} --speculative-config "$(cat {report["vllm_json"]})"',
            "```",
            "",
            *table(["batch sizes", "K"], ([f"{lo}-{hi}", k if k else "off"] for lo, hi, k in plan.schedule)),
            "",
            "Where the schedule says off, vLLM still runs the draft's first forward (to keep its KV cache), so the "
            "drafter's engine runs at the K=0 column's speed there, not plain's: if your server spends most of its "
            "time at those loads, serve without speculation.",
        ]
    else:
        advice = [
            "**Serve without speculation on this machine**: no K is predicted to beat plain decoding at any measured "
            "load (no vllm.json written).",
        ]
    lines = [
        f"# Serving advice for {report['drafter_dir']} ({report['family']}, vLLM {report.get('vllm_version', '?')})",
        "",
        f"Measured on {report['host']} ({report['device']}): vLLM served the target plainly, with the drafter held "
        f"at K=0 and at K in {report['calibrate_k']}, at batch sizes {sizes} ({report['requests_note']}); a "
        "speculative step costs `a + b K` plain steps of the same batch (fitted per batch size), the drafter emits "
        f"`E_K` tokens per step (acceptance: {report['acceptance_from']}). Predicted throughput = plain x E_K / "
        f"(a + b K); K > 0 only where it beats the drafter's engine at K=0 by {plan.min_gain:.2f}x, or by more than "
        "plain decoding moved between repeats at that batch size.",
        "",
        "## The schedule",
        "",
        *advice,
        "",
    ]
    meas = report.get("measured_vs_plain") or {}
    rows = []
    for b in sizes:
        c = plan.costs[b]
        cells = []
        for k in ks:
            m = meas.get(str(b), {}).get(str(k))
            cells.append(f"{plan.predicted('all', b, k):.2f}x" + (f" ({m:.2f}x)" if m is not None else ""))
        rows.append(
            [
                str(b),
                f"{plan.plain_tokens_per_s[b]:.1f}",
                f"{plan.idle(b):.2f}x",
                f"{c.a:.2f}",
                f"{c.b:.3f}",
                *cells,
                str(plan.chosen[b][0] or "off"),
                why(plan, b, ks),
            ]
        )
    header = ["batch", "plain tok/s", "K=0 (meas)", "a", "b", *(f"K={k} pred (meas)" for k in ks), "chosen", "why"]
    lines += table(header, rows)
    e = ", ".join(f"E_{k}={expected_tokens(plan.alpha['all'], k):.2f}" for k in ks)
    al = ", ".join(f"{a:.2f}" for a in plan.alpha["all"][: max(ks, default=0)])
    lines += ["", f"Acceptance (all sources): alpha = [{al}]; {e}.", ""]
    spread = report.get("spread") or {}
    if spread:
        worst = max((v, b, key) for b, per in spread.items() for key, v in per.items())
        plain = max(per.get("0", 0.0) for per in spread.values())
        lines += [
            f"Measurement noise: the repeats of a point differed by up to {worst[0]:.0%} (batch {worst[1]}, "
            f"{worst[2]}); plain decoding's by up to {plain:.0%}. Predicted gains smaller than that are not "
            "resolved by this calibration: raise deploy.repeats or deploy.min_requests, or deploy.min_gain.",
            "",
        ]
    if plan.per_domain:
        lines += [
            "## Per domain",
            "",
            "vLLM's schedule is one for all traffic. The K a deployment per domain would choose, and what it would "
            "gain over the global schedule (predicted, ratio to plain):",
            "",
        ]
        rows = []
        for dom, ch in plan.per_domain.items():
            cells = []
            for b in sizes:
                kd, rd = ch[b]
                kg = plan.chosen[b][0]
                rg = plan.predicted(dom, b, kg)
                glob = f" (global K={kg or 'off'}: {rg:.2f}x)" if kd != kg else ""
                cells.append(f"K={kd or 'off'} {rd:.2f}x{glob}")
            rows.append([dom, *cells])
        lines += table(["domain", *(f"B={b}" for b in sizes)], rows)
        lines.append("")
    if report.get("sglang"):
        lines += ["## SGLang", "", report["sglang"], ""]
    if report.get("verify"):
        lines += [
            "## Measured: the schedule against every fixed K",
            "",
            f"Schedule served: `{report['schedule_verified']}`.",
            "",
        ]
        header = [
            "batch", "plain tok/s", "best fixed", "schedule (K)", "schedule / best", "schedule / plain", "predicted",
            "identical to plain", "K vLLM drafted",
        ]  # fmt: skip
        lines += table(
            header,
            (
                [
                    str(r["batch"]),
                    f"{r['plain_tokens_per_s']:.1f}",
                    f"K={r['best_fixed_k'] or 'plain'} {r['best_fixed_vs_plain']:.2f}x",
                    f"{r['schedule_vs_plain']:.2f}x (K={r['schedule_k'] or 'off'})",
                    f"{r['schedule_vs_best']:.3f}",
                    f"{r['schedule_vs_plain']:.3f}",
                    f"{r['predicted_vs_plain']:.2f}x",
                    str(r["identical"]),
                    f"{r['schedule_k_served']:.2f}",
                ]
                for r in report["verify"]
            ),
        )
        lines += [
            "",
            "K vLLM drafted: draft tokens per proposal from vLLM's counters (requests finish at different times, "
            "so a group of B ends at smaller batches, with their K).",
            "",
        ]
    return "\n".join(lines)


def plot(report: dict[str, Any], plan: Plan, allowed: list[int], path: Path) -> None:
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    sizes = sorted(plan.costs)
    fig, ax = plt.subplots(figsize=(7, 4.5))
    plain = [plan.plain_tokens_per_s[b] for b in sizes]
    ax.plot(sizes, plain, "k-o", label="plain (measured)")
    ax.plot(sizes, [p * plan.idle(b) for p, b in zip(plain, sizes, strict=True)], "k:", label="drafter at K=0")
    meas = report.get("measured_tokens_per_s") or {}
    for k in allowed:
        pred = [plan.plain_tokens_per_s[b] * plan.predicted("all", b, k) for b in sizes]
        (line,) = ax.plot(sizes, pred, "--", alpha=0.7, label=f"K={k} predicted")
        pts = [(b, meas[str(b)][str(k)]) for b in sizes if str(k) in meas.get(str(b), {})]
        if pts:
            ax.plot(*zip(*pts, strict=True), "o", color=line.get_color(), label=f"K={k} measured")
    sched = [plan.plain_tokens_per_s[b] * plan.predicted("all", b, k_at(plan.schedule, b)) for b in sizes]
    ax.plot(sizes, sched, "r-", linewidth=2.5, alpha=0.6, label="schedule predicted")
    if report.get("verify"):
        ax.plot(
            [r["batch"] for r in report["verify"]],
            [r["schedule_tokens_per_s"] for r in report["verify"]],
            "r*",
            markersize=12,
            label="schedule measured",
        )
    ax.set_xscale("log", base=2)
    ax.set_xlabel("concurrent requests (batch size)")
    ax.set_ylabel("generated tokens/s")
    ax.set_title(f"{report['family']} drafter in vLLM: tokens/s by load")
    ax.legend(fontsize=7, ncol=2)
    fig.tight_layout()
    atomic_write_with(path, lambda p: fig.savefig(p, format="png", dpi=110))
    plt.close(fig)


def sglang_advice(src: Source, family: str, plan: Plan, export_hint: str) -> str:
    """SGLang's flags for the families it loads (it takes one K, no per-batch schedule)."""
    if family not in SGLANG_FORMAT:
        return f"SGLang does not load a {family} drafter exported by this project."
    fmt_name, algo = SGLANG_FORMAT[family]
    try:
        get_format(family, fmt_name).tensors(src)
    except ExportError as e:
        return f"This drafter cannot be exported for SGLang: {e}"
    k1 = plan.chosen[min(plan.chosen)][0] if plan.chosen else 0
    off = next((lo for lo, _, k in plan.schedule if k == 0), None)
    if not k1:
        return "Speculation does not pay at batch 1 on this machine: serve SGLang without it."
    flags = f"--speculative-algorithm {algo} --speculative-draft-model-path {export_hint.format(fmt=fmt_name)}"
    if family != "dflash":  # a DFlash block drafts its own length; the chain families take K as steps
        flags += f" --speculative-num-steps {k1} --speculative-eagle-topk 1 --speculative-num-draft-tokens {k1 + 1}"
    note = (
        f" Measured here, speculation stops paying from batch {off}: above that load serve without it." if off else ""
    )
    return (
        f"Export with `python -m train stage=export export={fmt_name}`, then `python -m sglang.launch_server "
        f"--model-path <target> {flags}`. SGLang takes one K for every load: this is the batch-1 choice.{note}"
    )


def run_deploy(cfg: Config, run_dir: Path) -> dict[str, Any]:
    try:
        return _deploy(cfg, run_dir)
    except EngineError as e:  # vLLM could not start or serve a configuration: one message, not a traceback
        raise ConfigError(
            f"stage deploy: {e}. Nothing was written but the export; the engine's log is above "
            "(VLLM_LOGGING_LEVEL=INFO for more)"
        ) from None


def _deploy(cfg: Config, run_dir: Path) -> dict[str, Any]:
    t0 = time.perf_counter()
    d = cfg.deploy
    check_deploy_config(d)
    drafter_dir = Path(d.drafter_dir or f"{cfg.train_dir}/{BEST}")
    family = drafter_family(drafter_dir)
    fmt_name, method = vllm_format(family)
    try:
        python = find_engine_python(d.vllm_python)
    except EngineError as e:
        raise ConfigError(str(e)) from None
    if python is None:
        raise ConfigError(
            "stage deploy measures vLLM, and no Python here can import it: build .venv-engine with "
            "scripts/engine_env.sh, or set deploy.vllm_python (or $DRAFTSMITH_VLLM_PYTHON)"
        )
    accept = read_acceptance(d.eval_dir, family) if d.acceptance != "engine" else None
    if d.acceptance == "eval" and accept is None:
        raise ConfigError(
            f"deploy.acceptance=eval, but {d.eval_dir} holds no eval of a {family} chain: run stage=eval first, or "
            "use deploy.acceptance=engine (vLLM's counters)"
        )
    target = load_target(cfg.target)
    _, module, dcfg = load_drafter(str(drafter_dir), target)
    allowed = allowed_ks(family, dcfg, d.k_max)
    if accept is not None:
        allowed = [k for k in allowed if k <= len(accept[0]["all"])]
    if not allowed:
        raise ConfigError(f"no K <= deploy.k_max={d.k_max} can serve this {family} drafter ({dcfg})")
    calib = sorted({k for k in d.calibrate_k if k in allowed} or {max(allowed)})
    metrics, table = read_eval(d.eval_dir)
    src = Source(
        drafter_dir, family, module, dcfg, target, cfg.target.name, find_train_manifest(drafter_dir), metrics, table
    )
    export_dir = run_dir / fmt_name
    logger.info("deploy: exporting %s -> %s (%s)", drafter_dir, export_dir, fmt_name)
    export_drafter(src, get_format(family, fmt_name), export_dir)
    spec_base: dict[str, Any] = {"model": str(export_dir.resolve())}
    if method:
        spec_base["method"] = method

    budget = d.max_model_len - d.max_new_tokens - max(allowed) - 8
    prompts = load_heldout(cfg.synth_dir, target.tokenizer, 10**9, budget)
    if not prompts:
        raise ConfigError(f"no held-out prompts of at most {budget} tokens in {cfg.synth_dir}")
    eos = target.tokenizer.eos_token_id

    def engine_conf(k: int, schedule: list[list[int]] | None = None) -> dict[str, Any]:
        conf = {**spec_base, "num_speculative_tokens": k}
        if schedule is not None:
            conf["num_speculative_tokens_per_batch_size"] = schedule
        return conf

    # One plain engine and one drafter engine, side by side; the drafter's engine is started with a schedule so that
    # its K can be set between calls (K=0: the draft still runs its first forward, as in a served schedule's "off").
    top = max(allowed)
    ks = sorted(set(allowed) if d.verify else set(calib))
    with contextlib.ExitStack() as stack:
        plain = stack.enter_context(start_engine(str(target.path), python, None, d, eos))
        engines = {"0": {"start_s": round(plain.start_seconds, 1), "vllm_version": plain.info.get("vllm_version")}}
        drafter = stack.enter_context(
            start_engine(str(target.path), python, engine_conf(top, [[1, d.max_batch, top]]), d, eos)
        )
        engines["drafter"] = {"start_s": round(drafter.start_seconds, 1)}
        warm_up(plain, prompts, False)
        warm_up(drafter, prompts, True)
        table = {"0": (plain, None, False), "idle": (drafter, 0, True)}
        table.update({str(k): (drafter, k, True) for k in ks})
        served = measure(table, prompts, d, "deploy: calibrate")
        drafter.close()
        fitted = {"0", *map(str, calib)}  # the other K (verify) are predicted, then compared with what they measured
        measured = [s.measured for key, per in served.items() if key in fitted for s in per.values()]
        if accept is None:
            runs = [served[str(max(calib))][b].measured for b in d.batch_sizes]
            per_pos = [sum(x) for x in zip(*[m.per_pos for m in runs], strict=False)]
            counts = alpha_from_counts(sum(m.drafts for m in runs), per_pos)
            accept = ({"all": counts}, f"vLLM's counters in the calibration at K={max(calib)}")
            allowed = [k for k in allowed if k <= len(counts)]
        idle = [s.measured for s in served["idle"].values()]
        noise = {b: s.spread for b, s in served["0"].items()}
        plan = make_plan(
            measured, accept[0], max(allowed), d.min_gain, d.max_batch, idle=idle, allowed=allowed, noise=noise
        )
        k_top = max(k for _, _, k in plan.schedule) if plan.speculates else 0
        vllm_conf = engine_conf(k_top, plan.schedule) if plan.speculates else None
        check = d.schedule or plan.schedule
        if d.verify and (d.schedule or plan.speculates):
            top_s = max(k for _, _, k in check) or top
            sched = stack.enter_context(start_engine(str(target.path), python, engine_conf(top_s, check), d, eos))
            engines["schedule"] = {"start_s": round(sched.start_seconds, 1)}
            warm_up(sched, prompts, True)
            again = measure({"0": (plain, None, False), "schedule": (sched, None, True)}, prompts, d, "deploy: verify")
            served["schedule"] = again["schedule"]
            served["0 (verify)"] = again["0"]

    def ref(key: str) -> str:  # the plain runs a configuration was measured beside
        return "0 (verify)" if key in ("schedule", "0 (verify)") else "0"

    def per_batch(f: Any) -> dict[str, dict[str, Any]]:
        return {
            str(b): {key: f(per[b], served[ref(key)][b]) for key, per in served.items()} for b in sorted(d.batch_sizes)
        }

    measured_tps = per_batch(lambda s, _: s.measured.tokens_per_s)
    measured_ratio = per_batch(lambda s, p: s.measured.tokens_per_s / p.measured.tokens_per_s)
    mal = per_batch(lambda s, _: s.measured.mean_acceptance_length)
    k_served = per_batch(lambda s, _: s.measured.k_served)
    spread = per_batch(lambda s, _: s.spread)
    identical = per_batch(
        lambda s, p: f"{sum(a == b for a, b in zip(s.outputs, p.outputs, strict=True))}/{len(s.outputs)}"
    )
    verify_rows: list[dict[str, Any]] = []
    if "schedule" in served:
        for b in sorted(d.batch_sizes):
            r = measured_ratio[str(b)]
            fixed = {int(k): v for k, v in r.items() if k.isdigit()}
            best = max(fixed, key=lambda x: fixed[x])
            kb = k_at(check, b)
            verify_rows.append(
                {
                    "batch": b,
                    "plain_tokens_per_s": measured_tps[str(b)]["0 (verify)"],
                    "best_fixed_k": best,
                    "best_fixed_vs_plain": fixed[best],
                    "schedule_k": kb,
                    "schedule_k_served": k_served[str(b)]["schedule"],
                    "schedule_tokens_per_s": measured_tps[str(b)]["schedule"],
                    "schedule_vs_plain": r["schedule"],
                    "schedule_vs_best": r["schedule"] / fixed[best],
                    "predicted_vs_plain": plan.predicted("all", b, kb),
                    "identical": identical[str(b)]["schedule"],
                }
            )

    import platform

    import torch

    report: dict[str, Any] = {
        "drafter_dir": str(drafter_dir),
        "family": family,
        "format": fmt_name,
        "export_dir": str(export_dir),
        "target": str(target.path),
        "vllm_json": str(run_dir / "vllm.json"),
        "host": platform.node(),
        "device": "CUDA" if torch.cuda.is_available() else f"CPU, {platform.processor() or platform.machine()}",
        "calibrate_k": calib,
        "allowed_k": allowed,
        "batch_sizes": sorted(d.batch_sizes),
        "prompts": len(prompts),
        "requests_note": f"{d.min_requests}+ requests x {d.max_new_tokens} new tokens per point, "
        f"{len(prompts)} held-out prompts",
        "acceptance_from": accept[1],
        "engines": engines,
        "vllm_version": engines["0"]["vllm_version"],
        "schedule_verified": check if "schedule" in served else None,
        "plan": plan.to_json(),
        "vllm": vllm_conf,
        "measured_tokens_per_s": measured_tps,
        "measured_vs_plain": measured_ratio,
        "mean_acceptance_length": mal,
        "k_served": k_served,
        "spread": spread,
        "identical_to_plain": identical,
        "verify": verify_rows,
    }
    hint = f"{cfg.runs_root}/{cfg.run_name}/export/{{fmt}}"
    report["sglang"] = sglang_advice(src, family, plan, hint)
    text = markdown(report, plan, allowed)
    if vllm_conf is not None:
        atomic_write_json(run_dir / "vllm.json", vllm_conf)
    elif (run_dir / "vllm.json").exists():  # a rerun that no longer speculates leaves no stale advice
        (run_dir / "vllm.json").unlink()
    atomic_write_text(run_dir / "sglang.txt", report["sglang"] + "\n")
    atomic_write_json(run_dir / "deploy.json", report)
    atomic_write_text(run_dir / "deploy.md", text)
    plot(report, plan, allowed, run_dir / "deploy.png")
    src.deploy_report = report  # the export's model card, written again with the advice
    card = export_dir / "README.md"
    files = sorted(f.name for f in export_dir.iterdir() if f.is_file())
    atomic_write_text(card, model_card(src, get_format(family, fmt_name), files))
    write_manifest(
        run_dir / MANIFEST,
        "deploy",
        cfg,
        inputs={"drafter_dir": str(drafter_dir), "eval_dir": d.eval_dir, "synth_dir": cfg.synth_dir},
        timings={"seconds": round(time.perf_counter() - t0, 2)},
        result={"schedule": plan.schedule, "vllm": vllm_conf},
        files={
            **({"vllm": "vllm.json"} if vllm_conf is not None else {}),
            "report": "deploy.md",
            "plot": "deploy.png",
            "json": "deploy.json",
        },
    )
    print(text)
    return report
