"""Benchmark stage synth's batched generation against a naive one-prompt-at-a-time ``generate`` loop.

Both paths decode the same real prompts (the first user turn of held-in ShareGPT / HumanEval
conversations picked by ``data.split.select``, prompts <= ``--max-prompt-tokens`` target tokens),
greedily, with the same ``max_new_tokens``, in one process, after a warm-up:

* batched: ``data.synth.synth_chunk`` on single-turn conversations (length-sorted, left-padded,
  KV-cached ``generate`` in batches of ``--batch-size``), exactly what stage synth runs;
* naive: one prompt at a time, ``model.generate(max_new_tokens=..., do_sample=False)``.

It then checks the outputs are token-identical, sweeps the batch size (padding fraction, decode slots
wasted on rows that already ended, tokens/s), splits batched time into prefill and decode, and compares
1 vs 2 torch threads for the naive loop.

``OMP_WAIT_POLICY=PASSIVE`` is set below *before torch is imported* (unless already set): with the
default spin-waiting, idle OpenMP workers busy-spin between ops, which on a 2-core machine steals the
core from the main thread and from anything else running, and makes timings noisy.

Run (8.5-9 minutes on a shared 2-core machine; ``--threads 1 --sweep 16 --thread-sweep ''``: 3.5)::

    DRAFTSMITH_CACHE=/tmp/dscache python scripts/bench_synth.py
"""

import os

os.environ.setdefault("OMP_WAIT_POLICY", "PASSIVE")  # must precede `import torch` (see docstring)

import argparse
import datetime
import json
import logging
import platform
import time
from dataclasses import dataclass, field, replace
from typing import Any

import torch

from data.config import DataConfig, SourceConfig, SynthConfig, TargetConfig
from data.render import prompt_ids
from data.sources import Conversation, SkipCounter
from data.split import select
from data.synth import generate_batch, synth_chunk
from data.target import Target, load_target

SOURCES = {
    "sharegpt": {"sharegpt": SourceConfig(kind="sharegpt", weight=1.0)},
    "humaneval": {"humaneval": SourceConfig(kind="humaneval", weight=1.0)},
    "mix": {  # as conf/data/mix.yaml
        "sharegpt": SourceConfig(kind="sharegpt", weight=0.8),
        "humaneval": SourceConfig(kind="humaneval", weight=0.2),
    },
}


@dataclass
class Run:
    """One timed pass over the prompts."""

    name: str
    threads: int
    seconds: float
    outputs: list[list[int]]
    gen_seconds: float = 0.0
    padded_tokens: int = 0
    prompt_tokens: int = 0
    extra: dict[str, Any] = field(default_factory=dict)

    @property
    def tokens(self) -> int:
        return sum(len(o) for o in self.outputs)

    @property
    def tok_s(self) -> float:
        return self.tokens / max(self.seconds, 1e-9)


def load_avg() -> str:
    return "/".join(f"{x:.2f}" for x in os.getloadavg())


def single_turn(conv: Conversation) -> Conversation:
    """The conversation cut to its (optional system message and) first user turn."""
    first_user = next(i for i, m in enumerate(conv.messages) if m["role"] == "user")
    return Conversation(id=conv.id, source=conv.source, messages=conv.messages[: first_user + 1])


def pick_prompts(target: Target, args: argparse.Namespace) -> list[Conversation]:
    data = DataConfig(
        sources=SOURCES[args.source], num_prompts=args.num_prompts, max_prompt_tokens=args.max_prompt_tokens
    )
    tok = target.tokenizer
    sel = select(data, SkipCounter(), prompt_len=lambda c: len(prompt_ids(tok, single_turn(c).messages)))
    return [single_turn(c) for c in sel.train]  # held-in (training) conversations only


def trim(row: list[int], eos: int) -> list[int]:
    return row[: row.index(eos) + 1] if eos in row else row


def naive_loop(target: Target, prompts: list[list[int]], max_new_tokens: int) -> tuple[list[list[int]], list[float]]:
    """One prompt at a time, greedy ``generate`` (KV cache on, HF default); returns outputs and per-prompt seconds."""
    tok = target.tokenizer
    outs: list[list[int]] = []
    secs: list[float] = []
    for ids in prompts:
        t0 = time.perf_counter()
        x = torch.tensor([ids], device=target.device)
        with torch.inference_mode():
            out = target.model.generate(
                input_ids=x,
                attention_mask=torch.ones_like(x),
                max_new_tokens=max_new_tokens,
                do_sample=False,
                temperature=None,
                top_p=None,
                top_k=None,
                pad_token_id=tok.pad_token_id,
                eos_token_id=tok.eos_token_id,
            )
        outs.append(trim(out[0, len(ids) :].tolist(), tok.eos_token_id))
        secs.append(time.perf_counter() - t0)
    return outs, secs


def decode_step_ms(target: Target, prompt: list[int], batch: int, steps: int = 8) -> float:
    """Milliseconds per KV-cached single-token forward for ``batch`` rows of ``prompt`` (no padding)."""
    model = target.model
    x = torch.tensor([prompt] * batch, device=target.device)
    with torch.inference_mode():
        out = model(input_ids=x, use_cache=True, logits_to_keep=1)
        cache, nxt = out.cache, out.logits[:, -1:].argmax(-1)
        t0 = time.perf_counter()
        for _ in range(steps):
            out = model(input_ids=nxt, cache=cache, use_cache=True, logits_to_keep=1)
            cache, nxt = out.cache, out.logits[:, -1:].argmax(-1)
    return (time.perf_counter() - t0) / steps * 1000


def batched_synth(target: Target, convs: list[Conversation], cfg: SynthConfig, max_prompt_tokens: int) -> Run:
    """Stage synth's own path: ``synth_chunk`` on single-turn conversations (timed end to end)."""
    t0 = time.perf_counter()
    rows, stats = synth_chunk(target, convs, cfg, max_prompt_tokens, None)
    seconds = time.perf_counter() - t0
    by_id = {(r["source"], r["id"]): r["gen_token_ids"][0] for r in rows}
    outs = [by_id.get((c.source, c.id), []) for c in convs]
    return Run(
        name=f"batched bs={cfg.batch_size}",
        threads=torch.get_num_threads(),
        seconds=seconds,
        outputs=outs,
        gen_seconds=stats.gen_seconds,
        padded_tokens=stats.padded_tokens,
        prompt_tokens=stats.prompt_tokens,
    )


def batches_like_synth(prompts: list[list[int]], batch_size: int) -> list[list[int]]:
    """Indices of ``prompts`` grouped as ``synth_chunk`` groups them (stable sort by length, then slices)."""
    order = sorted(range(len(prompts)), key=lambda i: len(prompts[i]))
    return [order[b : b + batch_size] for b in range(0, len(order), batch_size)]


def wasted_decode_fraction(outputs: list[list[int]], groups: list[list[int]]) -> float:
    """Share of batched decode slots spent on rows that had already emitted EOS (ragged finish)."""
    slots = sum(len(g) * max(len(outputs[i]) for i in g) for g in groups)
    used = sum(len(outputs[i]) for g in groups for i in g)
    return 1 - used / max(slots, 1)


def prefill_seconds(target: Target, prompts: list[list[int]], batch_size: int, cfg: SynthConfig) -> float:
    """Time of ``generate_batch`` with max_new_tokens=1 over the synth batches (prefill + 1 token)."""
    one = replace(cfg, max_new_tokens=1, batch_size=batch_size)
    t0 = time.perf_counter()
    for g in batches_like_synth(prompts, batch_size):
        generate_batch(target, [prompts[i] for i in g], one)
    return time.perf_counter() - t0


def compare(a: list[list[int]], b: list[list[int]], lengths: list[int]) -> dict[str, Any]:
    same = sum(x == y for x, y in zip(a, b, strict=True))
    diffs = []
    for i, (x, y) in enumerate(zip(a, b, strict=True)):
        if x != y:
            first = next((k for k, (p, q) in enumerate(zip(x, y, strict=False)) if p != q), min(len(x), len(y)))
            diffs.append({"prompt": i, "prompt_len": lengths[i], "first_diff_at": first, "lens": [len(x), len(y)]})
    return {"identical": same, "total": len(a), "diffs": diffs}


def warm_up(target: Target, prompts: list[list[int]], cfg: SynthConfig) -> None:
    generate_batch(target, prompts[:2], replace(cfg, max_new_tokens=8))
    naive_loop(target, prompts[:1], 8)


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    p.add_argument("--num-prompts", type=int, default=32)
    p.add_argument("--max-new-tokens", type=int, default=64)
    p.add_argument("--batch-size", type=int, default=16)
    p.add_argument("--threads", type=int, default=os.cpu_count() or 1, help="torch threads (default: all cores)")
    p.add_argument("--source", choices=sorted(SOURCES), default="mix")
    p.add_argument("--max-prompt-tokens", type=int, default=384)
    p.add_argument("--sweep", default="4,8,16,32", help="batch sizes for the padding/throughput sweep ('' to skip)")
    p.add_argument("--thread-sweep", default="1,2", help="torch threads for the naive-loop comparison ('' to skip)")
    p.add_argument("--thread-prompts", type=int, default=8, help="prompts for the naive-loop thread comparison")
    p.add_argument("--json", help="also write the results to this JSON file")
    args = p.parse_args()
    logging.basicConfig(level=logging.WARNING)
    t_script = time.perf_counter()
    print(f"OMP_WAIT_POLICY={os.environ.get('OMP_WAIT_POLICY')} (set before importing torch)")
    print(f"torch {torch.__version__}, {os.cpu_count()} cores, {platform.processor() or platform.machine()}")
    print(f"load average (1/5/15 min) at start: {load_avg()}")

    torch.set_num_threads(args.threads)
    target = load_target(TargetConfig(device="cpu"))
    convs = pick_prompts(target, args)
    tok = target.tokenizer
    prompts = [prompt_ids(tok, c.messages) for c in convs]
    lengths = [len(x) for x in prompts]
    n_src = {s: sum(c.source == s for c in convs) for s in sorted({c.source for c in convs})}
    print(
        f"{len(convs)} prompts {n_src}: prompt tokens min/mean/max = "
        f"{min(lengths)}/{sum(lengths) / len(lengths):.0f}/{max(lengths)}; "
        f"max_new_tokens={args.max_new_tokens}, greedy, threads={args.threads}"
    )
    cfg = SynthConfig(max_new_tokens=args.max_new_tokens, temperature=0.0, batch_size=args.batch_size)
    warm_up(target, prompts, cfg)

    # (a) the batched synth path and (b) the naive loop, same prompts, same threads
    batched = batched_synth(target, convs, cfg, args.max_prompt_tokens)
    print(f"load after batched: {load_avg()}")
    outs, per_prompt = naive_loop(target, prompts, args.max_new_tokens)
    naive = Run(name="naive loop", threads=args.threads, seconds=sum(per_prompt), outputs=outs)
    print(f"load after naive: {load_avg()}")
    check = compare(batched.outputs, naive.outputs, lengths)
    ratio = batched.tok_s / naive.tok_s

    print("\n== batched synth vs naive loop ==")
    for r in (batched, naive):
        print(f"{r.name:>16}: {r.tokens} tokens in {r.seconds:.2f} s = {r.tok_s:.1f} tok/s (threads={r.threads})")
    print(f"batched/naive throughput ratio: {ratio:.2f}x (target >= 3x: {'yes' if ratio >= 3 else 'NO'})")
    print(f"outputs token-identical: {check['identical']}/{check['total']}")
    for d in check["diffs"]:
        print(f"  prompt {d['prompt']} (len {d['prompt_len']}): first differs at token {d['first_diff_at']}")

    # prefill vs decode for both paths
    pre_b = prefill_seconds(target, prompts, args.batch_size, cfg)
    pre_n = sum(naive_loop(target, prompts, 1)[1])
    print(
        f"prefill (+1 token): batched {pre_b:.2f} s of {batched.gen_seconds:.2f} s generation; "
        f"naive {pre_n:.2f} s of {naive.seconds:.2f} s"
    )

    # batch-size sweep (padding, ragged finish, throughput)
    sweep: list[dict[str, Any]] = []
    sizes = [int(s) for s in args.sweep.split(",") if s.strip()]
    for bs in sorted(set(sizes) | {args.batch_size}):
        if bs > len(convs) and bs != args.batch_size:
            continue
        if bs == args.batch_size:
            r = batched
        else:
            r = batched_synth(target, convs, replace(cfg, batch_size=bs), args.max_prompt_tokens)
        groups = batches_like_synth(prompts, bs)
        row = {
            "batch_size": bs,
            "batches": len(groups),
            "padding_fraction": r.padded_tokens / max(r.padded_tokens + r.prompt_tokens, 1),
            "wasted_decode_fraction": wasted_decode_fraction(r.outputs, groups),
            "tokens": r.tokens,
            "seconds": r.seconds,
            "tok_s": r.tok_s,
            "vs_naive": r.tok_s / naive.tok_s,
            "identical_to_naive": compare(r.outputs, naive.outputs, lengths)["identical"],
        }
        sweep.append(row)
        print(
            f"bs={bs:>3}: {row['batches']} batches, padding {row['padding_fraction']:.1%}, "
            f"post-EOS decode slots {row['wasted_decode_fraction']:.1%}, {r.tokens} tok in {r.seconds:.2f} s "
            f"= {r.tok_s:.1f} tok/s ({row['vs_naive']:.2f}x naive), identical {row['identical_to_naive']}/{len(convs)}"
            f"; load {load_avg()}"
        )

    # one KV-cached decode step vs batch size (prompt: the median-length prompt, no padding)
    mid = sorted(prompts, key=len)[len(prompts) // 2]
    step_sizes = sorted({1, *[bs for bs in sizes if bs <= len(convs)], args.batch_size})
    steps = {bs: decode_step_ms(target, mid, bs) for bs in step_sizes}
    print(
        f"decode step ({len(mid)}-token context): "
        + ", ".join(f"bs={bs} {ms:.0f} ms ({bs / ms * 1000:.0f} tok/s)" for bs, ms in steps.items())
    )

    # torch threads 1 vs 2: the naive loop (on the first --thread-prompts prompts), the batched path, one decode step
    k = min(args.thread_prompts, len(prompts))
    threads: list[dict[str, Any]] = []
    for n in [int(s) for s in args.thread_sweep.split(",") if s.strip()]:
        torch.set_num_threads(n)
        warm_up(target, prompts, cfg)
        if n == args.threads:
            sub_outs, sub_secs, rb = naive.outputs[:k], per_prompt[:k], batched
        else:
            sub_outs, sub_secs = naive_loop(target, prompts[:k], args.max_new_tokens)
            rb = batched_synth(target, convs, cfg, args.max_prompt_tokens)
        sub_tok_s = sum(len(o) for o in sub_outs) / sum(sub_secs)
        ms1, msb = decode_step_ms(target, mid, 1), decode_step_ms(target, mid, args.batch_size)
        threads.append(
            {
                "threads": n,
                "naive_prompts": k,
                "naive_tok_s": sub_tok_s,
                "batched_tok_s": rb.tok_s,
                "decode_step_ms_bs1": ms1,
                f"decode_step_ms_bs{args.batch_size}": msb,
            }
        )
        print(
            f"threads={n}: naive (first {k} prompts) {sub_tok_s:.1f} tok/s, batched bs={args.batch_size} "
            f"{rb.tok_s:.1f} tok/s ({rb.seconds:.2f} s), decode step bs=1 {ms1:.0f} ms, "
            f"bs={args.batch_size} {msb:.0f} ms; load {load_avg()}"
        )
    torch.set_num_threads(args.threads)

    total = time.perf_counter() - t_script
    print(f"\nload average at end: {load_avg()}; script wall time {total:.0f} s")
    if args.json:
        result = {
            "date": datetime.datetime.now().isoformat(timespec="seconds"),
            "args": vars(args),
            "torch": torch.__version__,
            "cores": os.cpu_count(),
            "num_prompts": len(convs),
            "sources": n_src,
            "prompt_lengths": lengths,
            "batched": {"tokens": batched.tokens, "seconds": batched.seconds, "tok_s": batched.tok_s},
            "naive": {"tokens": naive.tokens, "seconds": naive.seconds, "tok_s": naive.tok_s},
            "ratio": ratio,
            "identical": check,
            "prefill_seconds": {"batched": pre_b, "naive": pre_n},
            "batch_sweep": sweep,
            "decode_step_ms": steps,
            "thread_sweep": threads,
            "script_seconds": total,
        }
        with open(args.json, "w", encoding="utf-8") as fh:
            json.dump(result, fh, indent=2)


if __name__ == "__main__":
    main()
