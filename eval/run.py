"""Stage eval: held-out acceptance length (tau) and wall-clock speedup of every proposer, same prompts.

For each data source of the held-out split it runs plain target decoding (the baseline) and each proposer
(the trained drafter as a chain and as a tree, prompt lookup, a standalone draft model, and HF's assisted
generation / prompt lookup as peers), then reports per source: tau (mean and distribution), per-position
acceptance alpha_i, draft tokens per step, target forwards, tokens/s, speedup over plain decoding, the
draft cost ratio c = T_draft / T_target and the speedup the analytic model predicts from alpha and c.
Outputs: ``metrics.json``, ``table.md`` (also printed), ``acceptance.png``; W&B when on.

Conventions: tau = tokens emitted per target verification pass, bonus token included (plain decoding has
tau = 1); alpha_i = P(draft position i accepted | position i-1 accepted). See :mod:`eval.metrics`.
"""

from __future__ import annotations

import copy
import logging
import math
import time
from collections.abc import Callable
from dataclasses import asdict, dataclass
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from data.atomic import atomic_write_json, atomic_write_text
from data.config import ConfigError, check_bounds
from data.layout import BEST, MANIFEST, METRICS, PLOT, REPLAY, TABLE
from data.manifest import write_manifest
from data.sources import SkipCounter
from data.split import select
from data.target import Target, load_target
from data.tracking import Tracker
from eval import context
from eval.config import EvalRunConfig
from eval.decoder import SpeculativeDecoder, plain_decode
from eval.expected import ExpectedAcceptance, expected_acceptance
from eval.heldout import Prompt, load_heldout, traffic_prompts, turn_prompts
from eval.hf_baselines import hf_assisted_generate, hf_prompt_lookup_generate
from eval.metrics import DecodeStats
from eval.proposers import DraftModelProposer, PromptLookupProposer
from eval.replay import replay_many
from eval.report import (
    GROUP_FIGURES,
    Result,
    acceptance,
    combine,
    finish_result,
    markdown_table,
    plot,
    temperature_table,
)
from eval.traces import ContinuationCache, Sampling, TraceCache

logger = logging.getLogger(__name__)

PROPOSERS = ("drafter", "prompt_lookup", "draft_model", "hf_assisted", "hf_prompt_lookup")


GenerateFn = Callable[[Prompt, torch.Tensor], tuple[list[int], DecodeStats]]
DrafterLoader = Callable[[str, Target], tuple[Any, torch.nn.Module, Any]]
"""``load(directory, target) -> (family spec, drafter module, drafter config)`` for a saved drafter: the train
layer passes :func:`train.drafters.registry.load_drafter` down (eval never imports the drafter families)."""


@dataclass
class Method:
    """One compared method: its decode function and, for our proposers, the proposer (replayable)."""

    name: str
    fn: GenerateFn
    k: int | None = None
    proposer: Any = None
    """A :class:`eval.proposers.base.Proposer` (replay needs one); None for HF peers (decode only)."""


def run_method(name: str, prompts: list[Prompt], fn: GenerateFn, k: int | None = None) -> Result:
    res = Result(name=name, k=k)
    per: dict[str, list[DecodeStats]] = {}
    for p in tqdm(prompts, desc=f"eval {name}", unit="prompt", mininterval=5.0):
        tokens, stats = fn(p, torch.tensor([p.input_ids]))
        per.setdefault(p.source, []).append(stats)
        res.outputs[f"{p.source}:{p.id}"] = tokens
    return finish_result(res, per)


def _decode_budget(e: Any) -> tuple[int, int]:
    """(prompts per source, new tokens) of the decoded sample: the whole sample in mode decode, else the
    smaller ``decode_prompts`` x ``decode_max_new_tokens`` one (never more than the replayed sample)."""
    if e.mode == "decode":
        return e.num_prompts, e.max_new_tokens
    return min(e.decode_prompts, e.num_prompts), min(e.decode_max_new_tokens, e.max_new_tokens)


def _ours(target: Target, proposer: Any, cfg: EvalRunConfig) -> GenerateFn:

    dec = SpeculativeDecoder(target.model, proposer, temperature=cfg.eval.temperature, top_p=cfg.eval.top_p)

    def fn(p: Prompt, ids: torch.Tensor) -> tuple[list[int], DecodeStats]:
        gen = torch.Generator().manual_seed(cfg.eval.seed) if cfg.eval.temperature > 0 else None
        r = dec.generate(ids, _decode_budget(cfg.eval)[1], target.tokenizer.eos_token_id, gen)
        return r.tokens, r.stats

    return fn


def _plain(target: Target, cfg: EvalRunConfig) -> GenerateFn:

    def fn(p: Prompt, ids: torch.Tensor) -> tuple[list[int], DecodeStats]:
        gen = torch.Generator().manual_seed(cfg.eval.seed) if cfg.eval.temperature > 0 else None
        r = plain_decode(
            target.model,
            ids,
            _decode_budget(cfg.eval)[1],
            target.tokenizer.eos_token_id,
            cfg.eval.temperature,
            cfg.eval.top_p,
            gen,
        )
        return r.tokens, r.stats

    return fn


def _hf_peer(target: Target, run: Callable[[torch.Tensor, int], Any], max_new_tokens: int) -> GenerateFn:
    """Run an HF generation on ``prompt + [first token]``, the first token from an (untimed) prefill.

    Our decoder emits the first token from its prefill and drafts afterwards; HF's first forward verifies
    ``prompt + draft``. Starting HF one token later makes both take the same drafts and verdicts, so their
    tau are directly comparable (HF's first forward is then its prefill and its first verification).
    """
    eos = target.tokenizer.eos_token_id

    def fn(p: Prompt, ids: torch.Tensor) -> tuple[list[int], DecodeStats]:
        with torch.inference_mode():
            first = int(target.model(input_ids=ids.to(target.device)).logits[0, -1].argmax())
        n = max_new_tokens - 1
        if first == eos or n == 0:
            return [first], DecodeStats(n_sequences=1, new_tokens=1)
        r = run(torch.cat([ids, torch.tensor([[first]])], dim=1), n)
        r.stats.new_tokens += 1
        return [first, *r.tokens], r.stats

    return fn


def load_draft_model(spec: str, target: Target) -> torch.nn.Module:
    """A standalone draft: a HF directory, or ``target_layers:N`` (the target's first N layers + its head)."""
    from transformers import AutoModelForCausalLM

    if spec.startswith("target_layers:"):
        n = int(spec.split(":", 1)[1])
        conf = copy.deepcopy(target.model.config)
        conf.num_hidden_layers = n
        draft = AutoModelForCausalLM.from_config(conf, dtype=target.model.dtype)
        missing, _ = draft.load_state_dict(target.model.state_dict(), strict=False)
        if [k for k in missing if "lm_head" not in k]:
            raise RuntimeError(f"could not copy target layers into the draft: missing {missing}")
        draft.tie_weights()
        return draft.eval().requires_grad_(False)
    path = Path(spec)
    if not path.exists():
        raise ConfigError(f"eval.draft_model={spec!r} does not exist (a HF directory, or target_layers:N)")
    return AutoModelForCausalLM.from_pretrained(path, dtype=target.model.dtype).eval()


def build_methods(cfg: EvalRunConfig, target: Target, load_drafter: DrafterLoader | None = None) -> list[Method]:
    """The proposers named in ``eval.proposers`` (name, decode function, chain K, proposer); the trained drafter
    (``drafter``) is loaded with ``load_drafter``."""

    e = cfg.eval
    unknown = [p for p in e.proposers if p not in PROPOSERS]
    if unknown:
        raise ConfigError(f"eval.proposers: unknown {unknown}; valid: {', '.join(PROPOSERS)}")
    if any(p in e.proposers for p in ("draft_model", "hf_assisted")) and not e.draft_model:
        raise ConfigError(
            "eval.proposers has draft_model/hf_assisted but eval.draft_model is not set "
            "(a HF directory with the target's tokenizer, or target_layers:N)"
        )
    if e.temperature > 0 and any(p.startswith("hf_") for p in e.proposers):
        raise ConfigError("HF peers are greedy-only here: use eval.temperature=0 or drop hf_* from eval.proposers")
    modes = ["chain", "tree"] if e.decode == "both" else [e.decode]
    eos = target.tokenizer.eos_token_id
    methods: list[Method] = []
    draft: torch.nn.Module | None = None
    if e.draft_model:
        draft = load_draft_model(e.draft_model, target)
    for name in e.proposers:
        if name == "drafter":
            if load_drafter is None:
                raise ConfigError(
                    "eval.proposers has 'drafter' but no drafter loader was given (run it via python -m train)"
                )
            spec, module, dcfg = load_drafter(e.drafter_dir or f"{cfg.train_dir}/{BEST}", target)
            for mode in modes:
                d = copy.copy(dcfg)
                d.decode, d.chain_k = mode, e.k
                d.tree_depth = e.tree_depth or d.tree_depth
                d.tree_top_k = e.tree_top_k or d.tree_top_k
                d.tree_total_tokens = e.tree_total_tokens or d.tree_total_tokens
                prop = spec.proposer(module, target.model, d)
                # A family may draft fewer tokens than asked (Medusa: one per head): label and cost model use
                # what the proposer really drafts.
                k_eff = int(getattr(prop, "chain_k", e.k))
                label = f"{dcfg.name}_{mode}" + (f"_k{k_eff}" if mode == "chain" else f"_n{d.tree_total_tokens}")
                methods.append(Method(label, _ours(target, prop, cfg), k_eff if mode == "chain" else None, prop))
        elif name == "prompt_lookup":
            prop = PromptLookupProposer(num_tokens=e.k, max_ngram=e.prompt_lookup_max_ngram)
            methods.append(Method(f"prompt_lookup_k{e.k}", _ours(target, prop, cfg), e.k, prop))
        elif name == "draft_model":
            assert draft is not None
            for mode in modes:
                n_tree = e.tree_total_tokens or 16
                prop = DraftModelProposer(
                    draft,
                    target.model.config.vocab_size,
                    num_tokens=e.k,
                    mode=mode,
                    tree_depth=e.tree_depth or 4,
                    tree_top_k=e.tree_top_k or 4,
                    tree_total_tokens=n_tree,
                    target_tokenizer=target.tokenizer,
                )
                label = f"draft_model_{mode}" + (f"_k{e.k}" if mode == "chain" else f"_n{n_tree}")
                methods.append(Method(label, _ours(target, prop, cfg), e.k if mode == "chain" else None, prop))
        elif name == "hf_assisted":
            assert draft is not None

            def assisted(ids: torch.Tensor, n: int, dm: torch.nn.Module = draft) -> Any:
                return hf_assisted_generate(target.model, dm, ids, n, e.k, eos)

            methods.append(Method(f"hf_assisted_k{e.k}", _hf_peer(target, assisted, _decode_budget(e)[1]), e.k))
        elif name == "hf_prompt_lookup":

            def lookup(ids: torch.Tensor, n: int) -> Any:
                return hf_prompt_lookup_generate(target.model, ids, n, e.k, eos_token_id=eos)

            methods.append(Method(f"hf_prompt_lookup_k{e.k}", _hf_peer(target, lookup, _decode_budget(e)[1]), e.k))
    for m in methods:
        if m.proposer is not None:
            m.proposer.greedy_drafts = e.draft_sampling == "greedy"
    return methods


def select_prompts(cfg: EvalRunConfig, target: Target) -> list[Prompt]:
    """Held-out prompts: from the synth run's split, or straight from the configured data sources' split."""
    e, tok, limit = cfg.eval, target.tokenizer, cfg.data.max_prompt_tokens
    if e.prompts == "synth":
        return load_heldout(cfg.synth_dir, tok, e.num_prompts, limit, str(e.turns))
    if e.prompts != "data":
        return traffic_prompts(e.prompts, tok, e.num_prompts, limit, cfg.data.max_message_chars, str(e.turns))[0]

    data = copy.deepcopy(cfg.data)
    data.num_prompts, data.max_heldout = 0, e.num_prompts
    prompts: list[Prompt] = []
    for conv in select(data, SkipCounter()).heldout:
        prompts.extend(turn_prompts(tok, conv.source, conv.id, conv.messages, str(e.turns), limit))
    if not prompts:
        raise ValueError("no held-out prompts in the configured data sources (raise data.heldout_fraction?)")
    return prompts


def check_eval_config(e: Any) -> None:
    """Cheap value checks of the eval settings (before anything loads): each within its schema bounds
    (``EvalConfig.bounds``), and the combinations that cannot work."""
    check_bounds(e, "eval.")
    context.check_buckets(e.context_buckets)
    if e.temperatures and e.mode == "decode":
        raise ConfigError(
            "eval.temperatures replays at each temperature: use eval.mode=replay or both (or drop eval.temperatures "
            "and decode at eval.temperature)"
        )


def continuations_dir(cfg: EvalRunConfig, run_dir: Path) -> Path:
    """Where the continuations (greedy and sampled) of the judged prompts are cached."""
    if cfg.eval.continuations_dir:
        return Path(cfg.eval.continuations_dir)
    if cfg.eval.prompts == "synth":
        return Path(cfg.synth_dir) / REPLAY
    return run_dir / REPLAY


def load_continuations(
    cfg: EvalRunConfig, target: Target, prompts: list[Prompt], run_dir: Path, sampling: Sampling | None = None
) -> list[list[int]]:
    """The target's continuation of every prompt (``eval.max_new_tokens``; greedy, or sampled at ``sampling``),
    from the cache or made now."""
    cache = ContinuationCache(continuations_dir(cfg, run_dir), target.fingerprint)
    return cache.get(
        target.model,
        [p.input_ids for p in prompts],
        cfg.eval.max_new_tokens,
        target.tokenizer.pad_token_id,
        cfg.eval.replay_batch_size,
        sampling,
    )


def samplings(e: Any, temperature: float) -> list[Sampling | None]:
    """The replayed paths at ``temperature``: the greedy one, or ``eval.samples`` sampled ones (seeds
    ``eval.seed``, ``eval.seed + 1``, ...)."""
    if temperature == 0:
        return [None]
    return [Sampling(float(temperature), float(e.top_p), int(e.seed) + s) for s in range(int(e.samples))]


def replay_methods(
    cfg: EvalRunConfig,
    target: Target,
    prompts: list[Prompt],
    methods: list[Method],
    run_dir: Path,
    temperature: float | None = None,
) -> tuple[dict[str, Result], dict[str, float]]:
    """Replay every method that has a proposer on every prompt (continuations cached on disk), at
    ``temperature`` (default ``eval.temperature``): greedy, or along ``eval.samples`` sampled paths per prompt
    (:mod:`eval.replay`), a prompt's counters pooled over its paths."""
    e = cfg.eval
    temp = e.temperature if temperature is None else temperature
    t0 = time.perf_counter()
    proposers = {m.name: m.proposer for m in methods if m.proposer is not None}
    traces = TraceCache(continuations_dir(cfg, run_dir), target.fingerprint) if e.trace_cache else None
    t_cont = trace_s = 0.0
    merged: dict[str, dict[str, list[DecodeStats]]] = {}
    first_outputs: dict[str, dict[str, list[int]]] = {}
    for sampling in samplings(e, temp):
        t1 = time.perf_counter()
        conts = load_continuations(cfg, target, prompts, run_dir, sampling)
        t_cont += time.perf_counter() - t1
        stats, outputs, t_trace = replay_many(
            target.model,
            proposers,
            prompts,
            conts,
            e.max_new_tokens,
            target.tokenizer.eos_token_id,
            desc="replay" if sampling is None else f"replay {sampling.tag}",
            lanes=e.replay_lanes,
            trace_cache=traces,
            sampling=sampling,
        )
        trace_s += t_trace
        if not merged:
            merged, first_outputs = stats, outputs
            continue
        for name, per in stats.items():  # the same prompts in the same order: pool each prompt's paths
            for src, xs in per.items():
                merged[name][src] = [a.merge(b) for a, b in zip(merged[name][src], xs, strict=True)]
    results = {name: finish_result(Result(name=name, outputs=first_outputs[name]), merged[name]) for name in proposers}
    timings = {
        "continuations_seconds": round(t_cont, 2),
        "trace_seconds": round(trace_s, 2),
        "traces_read_from_cache": traces.loaded if traces else 0,
        "trace_read_seconds": round(traces.load_seconds, 2) if traces else 0.0,
        "replay_seconds": round(time.perf_counter() - t0 - t_cont, 2),
    }
    logger.info(
        "replay at temperature %g: %d prompts x %d tokens%s, %d methods: continuations %.1f s, target traces %.1f s "
        "(%d read from %s), in all %.1f s",
        temp,
        len(prompts),
        e.max_new_tokens,
        f" x {e.samples} sampled paths" if temp > 0 else "",
        len(proposers),
        t_cont,
        trace_s,
        traces.loaded if traces else 0,
        traces.directory if traces else "no cache",
        time.perf_counter() - t0,
    )
    return results, timings


def expected_along_paths(
    cfg: EvalRunConfig, target: Target, method: Method, prompts: list[Prompt], base: Result
) -> dict[str, tuple[float, list[float]]]:
    """Sampling: the expected tau and alpha_j of a sampled-chain method along plain decoding's sampled outputs
    (:func:`eval.expected.expected_acceptance`), per source; empty for methods without sampled chain drafts."""

    if method.proposer is None:
        return {}
    per: dict[str, list[ExpectedAcceptance]] = {}
    try:
        for p in prompts:
            path = base.outputs[f"{p.source}:{p.id}"]
            gen = torch.Generator().manual_seed(cfg.eval.seed)
            x = expected_acceptance(
                method.proposer, target.model, p.input_ids, path, cfg.eval.temperature, cfg.eval.top_p, gen
            )
            per.setdefault(p.source, []).append(x)
    except ValueError as exc:  # deterministic drafts (trees, prompt lookup): no proposal distribution to read
        logger.info("expected acceptance not computed for %s: %s", method.name, exc)
        return {}
    per["all"] = [x for v in per.values() for x in v]
    out: dict[str, tuple[float, list[float]]] = {}
    for src, xs in per.items():
        depth = max(len(x.attempted) for x in xs)
        att = [sum(x.attempted[j] for x in xs if j < len(x.attempted)) for j in range(depth)]
        acc = [sum(x.accepted[j] for x in xs if j < len(x.accepted)) for j in range(depth)]
        out[src] = (
            ExpectedAcceptance.pooled_tau(xs),
            [a / t if t > 0 else math.nan for a, t in zip(acc, att, strict=True)],
        )
    return out


def first_per_source(prompts: list[Prompt], n: int) -> list[Prompt]:
    counts: dict[str, int] = {}
    out = []
    for p in prompts:
        if counts.get(p.source, 0) < n:
            counts[p.source] = counts.get(p.source, 0) + 1
            out.append(p)
    return out


def run_eval(
    cfg: EvalRunConfig, run_dir: Path, target: Target | None = None, load_drafter: DrafterLoader | None = None
) -> dict[str, Any]:
    e = cfg.eval
    check_eval_config(e)
    t0 = time.perf_counter()
    target = target or load_target(cfg.target)
    prompts = select_prompts(cfg, target)
    methods = build_methods(cfg, target, load_drafter)  # check every proposer before the expensive runs
    sources = [*sorted({p.source for p in prompts}), "all"]
    n_dec, tok_dec = _decode_budget(e)
    logger.info(
        "eval (mode=%s): %d held-out prompts (%s), %d methods; replay %d tokens each; decode %s",
        e.mode,
        len(prompts),
        ", ".join(sources[:-1]),
        len(methods),
        e.max_new_tokens,
        "off" if e.mode == "replay" else f"{n_dec} prompts per source x {tok_dec} tokens",
    )
    timings: dict[str, float] = {}
    replayed: dict[str, Result] = {}
    by_temp: dict[float, dict[str, Result]] = {}
    if e.mode in ("replay", "both"):
        replayed, timings = replay_methods(cfg, target, prompts, methods, run_dir)
        for t in dict.fromkeys(float(x) for x in e.temperatures or []):
            if t == float(e.temperature):
                by_temp[t] = replayed
                continue
            by_temp[t], tt = replay_methods(cfg, target, prompts, methods, run_dir, temperature=t)
            timings[f"replay_T{t:g}_seconds"] = round(tt["continuations_seconds"] + tt["replay_seconds"], 2)
    decoded: dict[str, Result] = {}
    base: Result | None = None
    if e.mode in ("decode", "both"):
        t1 = time.perf_counter()
        dprompts = first_per_source(prompts, n_dec)
        _plain(target, cfg)(dprompts[0], torch.tensor([dprompts[0].input_ids[-64:]]))  # warm-up, untimed
        base = run_method("plain", dprompts, _plain(target, cfg))
        decoded = {m.name: run_method(m.name, dprompts, m.fn, m.k) for m in methods}
        timings["decode_seconds"] = round(time.perf_counter() - t1, 2)
    metrics: dict[str, dict[str, Any]] = {}
    if base is not None:
        metrics["plain"] = combine("plain", base, base, None, None, e)
    for m in methods:
        metrics[m.name] = combine(m.name, decoded.get(m.name), base, replayed.get(m.name), m.k, e)
    if e.temperature > 0 and base is not None:
        for m in methods:
            expected = expected_along_paths(cfg, target, m, dprompts, base)
            for src, (tau_x, alpha_x) in expected.items():
                metrics[m.name][src].update({"expected_tau": tau_x, "expected_alpha": alpha_x})
    for t, res in by_temp.items():
        for name, r in res.items():
            for src in r.stats:
                a = acceptance(r.stats[src], r.per_prompt[src], e.bootstrap, e.seed, r.prompt_ids.get(src))
                metrics[name][src].setdefault("by_temperature", {})[f"{t:g}"] = {k: a[k] for k in GROUP_FIGURES}
    for m in methods:  # tau by turn and by context length, from the sample that gave tau
        judged = replayed.get(m.name) or decoded.get(m.name)
        if judged is not None:
            for src, groups in context.grouped(judged, prompts, e.context_buckets, e.bootstrap, e.seed).items():
                metrics[m.name][src].update(groups)
    table = markdown_table(metrics, sources)
    if e.temperature > 0:
        table = (
            f"Sampled at temperature {e.temperature:g}, top-p {e.top_p:g}, chains drafted {e.draft_sampling}: tau from "
            f"{e.samples} sampled path(s) per prompt{' (replay)' if e.mode != 'decode' else ''}.\n\n{table}"
        )
    if by_temp:
        table += "\n\n" + temperature_table(metrics, sources, list(by_temp))
    table += "\n\n" + context.context_table(metrics, sources, e.context_buckets)
    run_dir.mkdir(parents=True, exist_ok=True)
    atomic_write_json(
        run_dir / METRICS,
        {
            "settings": asdict(e),
            "num_prompts": len(prompts),
            "decode_prompts": len(first_per_source(prompts, n_dec)) if e.mode != "replay" else 0,
            "metrics": metrics,
        },
    )
    atomic_write_text(run_dir / TABLE, table + "\n")
    if e.plot:
        plot(metrics, run_dir / PLOT, context.bucket_labels(e.context_buckets))
    write_manifest(
        run_dir / MANIFEST,
        "eval",
        cfg,
        target={"name": cfg.target.name, "fingerprint": target.fingerprint},
        inputs={"synth_dir": cfg.synth_dir},
        timings={"seconds": round(time.perf_counter() - t0, 2), **timings},
        files={"metrics": METRICS, "table": TABLE, "plot": PLOT},
    )
    tracker = Tracker(cfg.wandb, run_dir, f"{cfg.run_name}-eval", cfg.run_name, "eval", asdict(cfg))
    try:
        flat = {
            f"{name}/{src}/{k}": v
            for name, per in metrics.items()
            for src, m in per.items()
            for k, v in m.items()
            if isinstance(v, int | float)
        }
        flat.update({f"{name}/{src}/tau_lo": m["tau_ci"][0] for name, per in metrics.items() for src, m in per.items()})
        flat.update({f"{name}/{src}/tau_hi": m["tau_ci"][1] for name, per in metrics.items() for src, m in per.items()})
        for name, per in metrics.items():
            for src, m in per.items():
                for t, bt in (m.get("by_temperature") or {}).items():
                    flat[f"{name}/{src}/tau@T{t}"] = bt["tau"]
                    flat[f"{name}/{src}/tau_lo@T{t}"], flat[f"{name}/{src}/tau_hi@T{t}"] = bt["tau_ci"]
        flat.update(context.flat(metrics))
        tracker.log(flat)
        if tracker.run is not None:
            import wandb

            cols = ["source", "method", "tau", "tau_lo", "tau_hi", "speedup", "predicted_speedup", "draft_cost_ratio_c"]
            tracker.log(
                {
                    "eval_table": wandb.Table(
                        columns=cols,
                        data=[
                            [
                                src,
                                name,
                                m["tau"],
                                *m["tau_ci"],
                                m["speedup"],
                                m["predicted_speedup"],
                                m["draft_cost_ratio_c"],
                            ]
                            for name, per in metrics.items()
                            for src, m in per.items()
                        ],
                    )
                }
            )
            if e.plot:
                tracker.log({"acceptance": wandb.Image(str(run_dir / PLOT))})
        tracker.files(run_dir, {"metrics": METRICS, "table": TABLE, "plot": PLOT})
    finally:
        tracker.finish()
    logger.info(
        "held-out acceptance (tau = tokens per target forward, bonus included; 95%% bootstrap interval over "
        "prompts):\n%s",
        table,
    )
    return metrics
