"""Stage synth's generation engines side by side on the same prompts: tokens/s and token-for-token equality.

    python scripts/bench_engine.py [--batch-sizes 16,32,64] [--max-new-tokens 64] [--vllm] [hydra overrides ...]

Default prompts: the quickstart's own training conversations (``experiment=quickstart``: 100 ShareGPT +
HumanEval first turns, <= 384 prompt tokens), greedy, fp32, in one process after a warm-up:

* ``hf_generate`` at ``--baseline-batch-size`` (32, what the recipes used with it): transformers' ``generate``
  on length-sorted, left-padded batches -- stage synth's engine before continuous batching, the baseline every
  ratio is against;
* ``hf`` (continuous batching, data/generate.py) at each ``--batch-sizes`` value, with oneDNN-prepacked weights
  (``synth.prepack``, the default; data/prepack.py); with ``--unpacked`` also without them (``hf_unpacked``), with
  ``--unshared`` also without reusing prompts' common prefix (``synth.share_prefix=false``: ``hf_unshared``).

Each runs as stage synth runs it, over ``synth.chunk_size`` conversations a chunk, so rows, decoding and
detokenising are included: ``hf`` streams every chunk through one engine (``data.synth.synth_stream``; before
2026-12-03 session 22 it was one ``synth_chunk`` call over all prompts), ``hf_generate`` and ``vllm`` call
``data.synth.synth_chunk`` chunk by chunk; tokens/s are over the chunks' ``gen_seconds``, as the manifest counts.
The baseline runs first and again last; prints tokens/s, the ratio to the mean of the baseline's two runs, and
whether every row's tokens equal the baseline's.

With ``--vllm`` (needs an engine venv, ``scripts/engine_env.sh``; fp32, eager, as ``synth.vllm_*`` default):

* ``vllm``: stage synth's vLLM engine (``data/vllm_engine.py``) through ``synth_chunk``, chunk by chunk
  (``synth.chunk_size`` conversations per ``LLM.generate`` call, as the stage runs) -- tokens/s as the
  manifest counts them (engine seconds; the engine's start is reported apart);
* ``vllm_bare``: a bare ``LLM.generate`` of all first-turn prompts at once in the engine's Python, nothing of
  ours around it -- the ceiling the stage's engine is judged against (``vs_bare``).
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import sys
import time
from dataclasses import replace
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from train.omp import set_default_wait

set_default_wait()  # OpenMP threads wait as the CLI has them (train/omp.py), set before torch loads

import torch  # noqa: E402

logger = logging.getLogger("bench_engine")


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--batch-sizes", default="16,32,64", help="continuous-batching batch sizes to time")
    ap.add_argument("--max-new-tokens", type=int, default=64)
    ap.add_argument(
        "--baseline-batch-size", type=int, default=32, help="rows per padded batch of the hf_generate baseline"
    )
    ap.add_argument("--unpacked", action="store_true", help="also time engine=hf with synth.prepack=false")
    ap.add_argument("--unshared", action="store_true", help="also time engine=hf with synth.share_prefix=false")
    ap.add_argument("--vllm", action="store_true", help="also time the vLLM engine and a bare LLM.generate")
    ap.add_argument("--skip-hf", default="", help="comma list of HF batch sizes to skip (e.g. when only vLLM matters)")
    ap.add_argument("--out", default=None, help="write the figures as JSON here")
    ap.add_argument("overrides", nargs="*", help="Hydra overrides (default: experiment=quickstart)")
    args = ap.parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")

    from data.render import prompt_ids
    from data.sources import Conversation, SkipCounter
    from data.split import select
    from data.synth import ChunkStats, synth_chunk, synth_stream
    from data.target import load_target
    from train.config import compose_config

    cfg = compose_config(args.overrides or ["experiment=quickstart"])
    torch.set_num_threads(cfg.runtime.num_threads or torch.get_num_threads())
    target = load_target(cfg.target)
    tok = target.tokenizer

    def first_len(c: Conversation) -> int:  # as stage synth measures prompts
        i = next(j for j, m in enumerate(c.messages) if m["role"] == "user")
        return len(prompt_ids(tok, c.messages[: i + 1]))

    convs = select(cfg.data, SkipCounter(), prompt_len=first_len).train
    base_cfg = replace(cfg.synth, max_new_tokens=args.max_new_tokens, temperature=0.0)
    synth_chunk(target, convs[:4], replace(base_cfg, max_new_tokens=4), cfg.data.max_prompt_tokens, None)  # warm-up

    def run(engine: str, bs: int, vllm: object = None, prepack: bool = True, share: bool = True) -> dict:
        c = replace(base_cfg, engine=engine, batch_size=bs, prepack=prepack, share_prefix=share)
        t0 = time.perf_counter()
        chunks = [convs[i : i + cfg.synth.chunk_size] for i in range(0, len(convs), cfg.synth.chunk_size)]
        rows, engine_s, stats = [], 0.0, ChunkStats()
        if engine == "hf":  # as stage synth runs it: every chunk streamed through one engine
            done: dict[int, tuple[list, ChunkStats]] = {}
            work = [(i, ch, [True] * len(ch)) for i, ch in enumerate(chunks)]
            synth_stream(target, work, c, cfg.data.max_prompt_tokens, None, lambda i, r, st: done.update({i: (r, st)}))
            parts = [done[i] for i in sorted(done)]
        else:  # chunk by chunk, as stage synth calls them; engine seconds as the manifest counts them
            parts = [synth_chunk(target, ch, c, cfg.data.max_prompt_tokens, None, vllm=vllm) for ch in chunks]
        for r, st in parts:
            rows += r
            engine_s += st.gen_seconds
            stats.add(st)
        dt = time.perf_counter() - t0
        outs = {(r["source"], r["id"]): r["gen_token_ids"] for r in rows}
        return {
            "engine": engine
            if engine != "hf"
            else "hf" + ("" if prepack else "_unpacked") + ("" if share else "_unshared"),
            "batch_size": bs,
            "seconds": round(dt, 2),
            "engine_seconds": round(engine_s, 2),
            "generated_tokens": stats.generated_tokens,
            "tokens_per_s": round(stats.generated_tokens / engine_s, 1),
            "padded_prompt_tokens": stats.padded_tokens,
            "outputs": outs,
        }

    base = run("hf_generate", args.baseline_batch_size)
    results = [base]
    skip = {int(x) for x in args.skip_hf.split(",") if x}
    for bs in [int(x) for x in args.batch_sizes.split(",") if x]:
        if bs not in skip:
            if args.unpacked:
                results.append(run("hf", bs, prepack=False))
            if args.unshared:
                results.append(run("hf", bs, share=False))
            results.append(run("hf", bs))
    if args.vllm:
        results += run_vllm(cfg, target, convs, base_cfg, run)
    # the baseline again, last: order effects (a first run faulting in fresh memory, a neighbour's load) then fall
    # on both sides; every ratio is against the mean of its two tokens/s
    again = run("hf_generate", args.baseline_batch_size)
    again["engine"] = "hf_generate (again)"
    results.append(again)
    base_rate = (base["tokens_per_s"] + again["tokens_per_s"]) / 2
    report = {
        "prompts": len(convs),
        "turns_per_conversation": cfg.data.max_turns,
        "max_new_tokens": args.max_new_tokens,
        "threads": torch.get_num_threads(),
        "runs": [],
    }
    bare = next((r for r in results if r["engine"] == "vllm_bare"), None)
    for r in results:
        same = sum(r["outputs"].get(k) == v for k, v in base["outputs"].items())
        row = {k: v for k, v in r.items() if k != "outputs"}
        row.update({"vs_hf_generate": round(r["tokens_per_s"] / base_rate, 2), "rows_identical": same})
        if bare is not None:
            row["vs_bare_vllm"] = round(r["tokens_per_s"] / bare["tokens_per_s"], 2)
        report["runs"].append(row)
        logger.info(
            "%-19s bs=%-3d %7.1f s  %6.1f tokens/s  %.2fx  identical rows %d/%d",
            r["engine"],
            r["batch_size"],
            r["engine_seconds"],
            r["tokens_per_s"],
            row["vs_hf_generate"],
            same,
            len(base["outputs"]),
        )
    if args.out:
        Path(args.out).write_text(json.dumps(report, indent=2))
    print(json.dumps(report, indent=2))


BARE = """
import json, os, sys, time
os.environ.setdefault("VLLM_CPU_KVCACHE_SPACE", "2")
from vllm import LLM, SamplingParams
from vllm.inputs import TokensPrompt
model, prompts_file = sys.argv[1:3]
max_tokens, max_len, eos = map(int, sys.argv[3:6])
prompts = json.load(open(prompts_file))
llm = LLM(model=model, dtype="float32", enforce_eager=True, seed=0, max_model_len=max_len, generation_config="vllm")
params = SamplingParams(temperature=0.0, max_tokens=max_tokens, stop_token_ids=[eos])
llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts[:4]], SamplingParams(max_tokens=4), use_tqdm=False)
t0 = time.perf_counter()
res = llm.generate([TokensPrompt(prompt_token_ids=p) for p in prompts], params, use_tqdm=False)
dt = time.perf_counter() - t0
print("BARE " + json.dumps({"seconds": dt, "outputs": [list(r.outputs[0].token_ids) for r in res]}))
"""


def run_vllm(cfg, target, convs, base_cfg, run) -> list[dict]:  # type: ignore[no-untyped-def]
    """Stage synth's vLLM engine (through synth_chunk), then a bare LLM.generate of the same first-turn prompts."""
    import subprocess
    import tempfile

    from data.render import prompt_ids
    from data.synth import turn_history
    from data.target import resolve_target_path
    from data.vllm_engine import VLLMEngine, find_engine_python

    python = find_engine_python(cfg.synth.vllm_python)
    if python is None:
        raise SystemExit("--vllm: no Python with vllm found (build one: bash scripts/engine_env.sh)")
    model_dir = resolve_target_path(cfg.target)
    tok = target.tokenizer
    max_len = cfg.data.max_prompt_tokens + base_cfg.max_new_tokens
    out = []
    with VLLMEngine(model_dir, python=python, max_model_len=max_len, eos_token_id=tok.eos_token_id) as eng:
        logger.info("vLLM worker started in %.1f s", eng.start_seconds)
        eng.generate([[1, 2, 3]], 4)  # warm-up, as the other engines get one
        r = run("vllm", 0, vllm=eng)
        r["engine_start_seconds"] = round(eng.start_seconds, 1)
        out.append(r)
    prompts = [prompt_ids(tok, turn_history(c, [], 0)) for c in convs]
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(prompts, f)
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.setdefault("VLLM_LOGGING_LEVEL", "WARNING")
    t0 = time.perf_counter()
    p = subprocess.run(
        [python, "-c", BARE, model_dir, f.name, str(base_cfg.max_new_tokens), str(max_len), str(tok.eos_token_id)],
        env=env,
        capture_output=True,
        text=True,
    )
    os.unlink(f.name)
    line = next((x for x in p.stdout.splitlines() if x.startswith("BARE ")), None)
    if p.returncode != 0 or line is None:
        raise SystemExit(f"bare vLLM run failed:\n{p.stderr[-3000:]}")
    bare = json.loads(line[5:])
    n = sum(len(o) for o in bare["outputs"])
    out.append(
        {
            "engine": "vllm_bare",
            "batch_size": len(prompts),
            "seconds": round(time.perf_counter() - t0, 2),
            "engine_seconds": round(bare["seconds"], 2),
            "generated_tokens": n,
            "tokens_per_s": round(n / bare["seconds"], 1),
            "padded_prompt_tokens": 0,
            "outputs": {(c.source, c.id): [o] for c, o in zip(convs, bare["outputs"], strict=True)},
        }
    )
    return out


if __name__ == "__main__":
    main()
