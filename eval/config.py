"""The configuration of stage eval (nested in the root :class:`train.config.Config` as ``eval``)."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import ClassVar, Protocol

from data.config import Bound, Choice, Choices, RunConfig, at_least, between


class EvalMode(Choice):
    replay = "replay"
    decode = "decode"
    both = "both"


class Decode(Choice):
    """How a drafter drafts: one chain, or a tree."""

    chain = "chain"
    tree = "tree"


class DraftSampling(Choice):
    """How a chain is drafted at temperature > 0."""

    sampled = "sampled"
    greedy = "greedy"


class Turns(Choice):
    """Which user turns of a held-out conversation are judged."""

    first = "first"
    last = "last"
    all = "all"


class EvalDecode(Choice):
    chain = "chain"
    tree = "tree"
    both = "both"


@dataclass
class EvalConfig(Choices):
    """Stage eval: held-out acceptance length and speedup with the built-in speculative decoder."""

    config_key: ClassVar[str] = "eval"
    bounds: ClassVar[dict[str, Bound]] = {
        **{
            k: at_least(1)
            for k in ("num_prompts", "max_new_tokens", "decode_prompts", "decode_max_new_tokens", "replay_batch_size")
        },
        "replay_lanes": at_least(1),
        "bootstrap": at_least(1),
        "samples": at_least(1),
        "temperature": at_least(0, "0 = greedy"),
        "temperatures": at_least(0, "0 = greedy"),
        "top_p": between(0, 1, lo_open=True),
        "k": at_least(1),
        "tree_depth": at_least(1, "or null: the drafter's own"),
        "tree_top_k": at_least(1, "or null: the drafter's own"),
        "tree_total_tokens": at_least(1, "or null: the drafter's own"),
        "prompt_lookup_max_ngram": at_least(1),
        "context_buckets": at_least(1, "increasing prompt lengths in tokens"),
    }

    proposers: list[str] = field(default_factory=lambda: ["drafter", "prompt_lookup"])
    """Compared with plain decoding: drafter (the trained one) | prompt_lookup | draft_model | hf_assisted
    | hf_prompt_lookup."""
    drafter_dir: str | None = None
    """A saved drafter (default: the train stage's best checkpoint of this run)."""
    draft_model: str | None = None
    """A standalone draft model directory for the draft_model / hf_assisted proposers."""
    prompts: str = "synth"
    """Where held-out prompts come from: synth (the synth run's heldout.jsonl) | data (the held-out split of
    the configured data sources, e.g. data=jsonl for your own traffic; no synth run needed) | a JSONL or Parquet
    file or glob (every row's prompt is judged; grouped by its ``source`` / ``domain`` field when present)."""
    mode: EvalMode = EvalMode.both
    """replay | decode | both. replay: tau, alpha and their 95% intervals from replaying the target's
    continuation of num_prompts prompts per source (greedy; at temperature > 0 sampled paths, eval.samples per
    prompt; one target forward per path, see eval/replay.py); decode: real speculative decoding (wall-clock
    speed, token-for-token check at temperature 0); both: replay for tau, decode for speed on the first
    decode_prompts prompts per source."""
    num_prompts: int = 200
    """Held-out conversations (or traffic rows) per source (replay; decode too when mode=decode); each gives one
    prompt per judged turn (eval.turns)."""
    turns: Turns = Turns.all
    """Which user turns of each held-out conversation are judged: all (each turn, its earlier turns and their
    answers as context) | first | last. The held-out split keeps data.heldout_max_turns turns (default
    data.max_turns: a recipe that trains on first turns judges first turns unless it raises it); a turn whose
    prompt is over data.max_prompt_tokens is left out. table.md then shows tau by turn and by context length."""
    context_buckets: list[int] = field(default_factory=lambda: [512, 2048, 4096])
    """Edges of the context-length buckets (prompt tokens, earlier turns included) of table.md's "tau by context
    length" table and metrics.json's ``by_context``: the default gives <512, 512-2k, 2k-4k, 4k+."""
    max_new_tokens: int = 256
    """New tokens per prompt (replay; decode too when mode=decode)."""
    decode_prompts: int = 4
    """mode=both: prompts per source that are also decoded for speed and the lossless check (at most
    num_prompts: the first ones of the replayed sample)."""
    decode_max_new_tokens: int = 64
    """mode=both: new tokens per decoded prompt (at most max_new_tokens)."""
    continuations_dir: str | None = None
    """Where the continuations (greedy and sampled) are cached (default: <synth_dir>/replay for prompts=synth,
    else the eval run dir's replay/)."""
    trace_cache: bool = True
    """Keep each judged prompt's target trace (the hidden states replay feeds the drafters, fp32) on disk beside
    the continuations (``<continuations_dir>/traces``): a second checkpoint or family on the same prompts then
    costs only its drafting. About 9 KB per token for the embedded target's EAGLE-3 layers (200 prompts x 450
    tokens: ~0.8 GB; sampled replay keeps one per sampled path: eval.samples x each temperature > 0 times that);
    false = recompute every time."""
    replay_batch_size: int = 16
    """Batch size for generating the continuations."""
    replay_lanes: int = 32
    """Prompts replayed at once: feature heads draft for all of them in one batched call per draft position
    (their replayer, eval/proposers/feature_head.py), other drafters' linear layers are batched across them
    (eval/lanes.py); each weight is read once per round instead of once per prompt; same trajectories. 1 = one
    prompt at a time (the reference path). Also used by the training-time checks."""
    bootstrap: int = 2000
    """Bootstrap replicates for the 95% interval of tau (resampling prompts)."""
    temperature: float = 0.0
    """0 = greedy; > 0: lossless speculative sampling at this temperature (replay along sampled paths, decode
    with rejection sampling)."""
    top_p: float = 1.0
    """Nucleus filter of the target's and the drafter's distributions when sampling."""
    temperatures: list[float] = field(default_factory=list)
    """Replay also at each of these temperatures (e.g. [0, 0.7, 1.0]): one tau column per temperature in
    table.md's "tau by temperature" table, ``by_temperature`` in metrics.json, W&B and compare. Empty: only
    eval.temperature."""
    draft_sampling: DraftSampling = DraftSampling.sampled
    """At temperature > 0: sampled (each chain token drawn from the drafter's q, accepted with min(1, p/q); the
    higher acceptance) | greedy (chains drafted by argmax, accepted with p(x): what vLLM does by default,
    draft_sample_method="greedy"). Trees are drafted by ranking either way. No effect at temperature 0."""
    samples: int = 1
    """Sampled paths per prompt at temperature > 0 (seeds eval.seed, eval.seed + 1, ...): each is one draw of
    the decoder's trajectory; a prompt's paths are pooled, intervals resample prompts."""
    k: int = 5
    """Chain length K for chain proposers."""
    decode: EvalDecode = EvalDecode.both
    """chain | tree | both: how the trained drafter drafts."""
    tree_depth: int | None = None
    """Tree drafts: maximum depth (None: the drafter's own setting; draft_model: 4)."""
    tree_top_k: int | None = None
    """Tree drafts: branching per expanded node (None: the drafter's own setting; draft_model: 4)."""
    tree_total_tokens: int | None = None
    """Tree drafts: draft tokens verified per step (None: the drafter's own setting; draft_model: 16)."""
    prompt_lookup_max_ngram: int = 3
    seed: int = 0
    plot: bool = True


DRAFT_SHAPE_BOUNDS: dict[str, Bound] = {
    k: at_least(1) for k in ("chain_k", "tree_depth", "tree_top_k", "tree_total_tokens")
}
"""Bounds of the draft-shape settings every drafter family's config carries."""


class EvalRunConfig(RunConfig, Protocol):
    """What stage eval reads of the root config."""

    eval: EvalConfig
