"""Replay evaluation equals real speculative decoding, count for count, for every drafter family.

The drafters are first fitted in-process to the target's own continuations of the test prompts (a few dozen
Adam steps of each family's real training loss on the real target's features), so they accept deep into their
drafts: the comparison then covers every draft position, the hidden-state rows of every commit and the
eos-and-budget truncation, not only the first position of an untrained head.
"""

from __future__ import annotations

import math

import pytest
import torch

from eval.metrics import DecodeStats
from train.drafters.eagle3 import NORM_FLAGS

pytestmark = pytest.mark.slow

TEXTS = (
    "Write a Python function that reverses a string.",
    "List the planets of the solar system, one per line.",
    "Answer with one word: what colour is the sky?",  # ends early: drafts past the eos are verified too
)
MAX_NEW = 40
ANSWERS_ONLY = {"loss_on_prompt": False, "feature_noise": 0.0}
"""The feature heads fit the continuations fastest without their default prompt loss and feature noise."""
FAMILY_KW = {
    "eagle": ANSWERS_ONLY,
    # without speculators' norms too: in 40 steps the normed head fits to depth 2, the test needs 3 (the normed
    # head's draft equals its TTT step in tests/test_train/test_eagle3.py)
    "eagle3": {"draft_vocab_size": 2048, "ttt_steps": 2, **ANSWERS_ONLY, **dict.fromkeys(NORM_FLAGS, False)},
    "medusa": {"num_heads": 4},
    "standalone": {"num_layers": 2, "gradient_checkpointing": False},
    "dflash": {"draft_vocab_size": 2048, "block_size": 5, "anchors_per_row": 64, "loss_gamma": 1.0},
    # a sliding window shorter than the prompts: every draft sees only the last 12 positions, in decode and replay
    "eagle3_window": {
        "draft_vocab_size": 2048,
        "sliding_window": 12,
        **ANSWERS_ONLY,
        **dict.fromkeys(NORM_FLAGS, False),
    },
}
FIT_STEPS = {"dflash": 80}
DEPTH = {"dflash": 2}
"""DFlash reads the context through its attention alone (no residual path from the target's features): fitted like
the heads it accepts 2-deep drafts, its later block positions learn slowly (BENCHMARKS)."""


@pytest.fixture(scope="module")
def traffic(target):  # -> (prompts, continuations)
    from data.render import prompt_ids
    from eval.traces import greedy_continuations

    tok = target.tokenizer
    prompts = [prompt_ids(tok, [{"role": "user", "content": t}]) for t in TEXTS]
    conts = greedy_continuations(target.model, prompts, MAX_NEW, tok.pad_token_id, batch_size=3)
    return prompts, conts


def test_continuations_are_the_targets_greedy_decoding(target, traffic) -> None:
    from eval.decoder import plain_decode

    prompts, conts = traffic
    eos = target.tokenizer.eos_token_id
    assert eos in conts[2][: MAX_NEW - 5], "the short-answer prompt must end early (it tests drafts past eos)"
    for p, c in zip(prompts, conts, strict=True):
        assert len(c) == MAX_NEW
        ref = plain_decode(target.model, torch.tensor([p]), MAX_NEW, eos).tokens
        assert c[: len(ref)] == ref  # batched, left-padded generation == batch-1 decoding


def _fit(spec, cfg, target, prompts, conts, steps: int = 40):  # -> module
    """Overfit a fresh drafter of this family to the continuations with its own training loss."""
    from train.batches import Row
    from train.drafters.registry import TargetFeatures, TrainBatch

    torch.manual_seed(0)
    module = spec.build(cfg, target.model).float()
    rows = [Row([*p, *c], [0] * len(p) + [1] * len(c)) for p, c in zip(prompts, conts, strict=True)]
    if spec.prepare is not None:
        spec.prepare(module, rows, cfg, target.model)
    width = max(len(r.input_ids) for r in rows)
    pad = target.tokenizer.pad_token_id
    ids = torch.tensor([r.input_ids + [pad] * (width - len(r.input_ids)) for r in rows])
    am = torch.tensor([[1] * len(r.input_ids) + [0] * (width - len(r.input_ids)) for r in rows])
    lm = torch.tensor([r.loss_mask + [0] * (width - len(r.loss_mask)) for r in rows])
    layers = spec.feature_layers(cfg, target.model.config)
    with torch.no_grad():
        hs = target.model(input_ids=ids, attention_mask=am, output_hidden_states=True).hidden_states
    n = target.model.config.num_hidden_layers
    feats = TargetFeatures({i: hs[i] for i in layers}, n, target.model.get_output_embeddings())
    params = [p for p in module.parameters() if p.requires_grad]
    opt = torch.optim.AdamW(params, lr=3e-3, weight_decay=0.0)
    module.train()
    for _ in range(steps):
        loss, _ = spec.loss(module, TrainBatch(ids, am, lm), feats, cfg)
        opt.zero_grad()
        loss.backward()
        opt.step()
    return module.eval()


def _same(a: DecodeStats, b: DecodeStats) -> None:
    assert a.accepted_lengths == b.accepted_lengths
    assert a.attempted_per_position == b.attempted_per_position
    assert a.accepted_per_position == b.accepted_per_position
    assert a.draft_tokens_proposed == b.draft_tokens_proposed
    assert a.target_forwards == b.target_forwards and a.new_tokens == b.new_tokens


@pytest.mark.parametrize("family", list(FAMILY_KW))
def test_replay_equals_decode_for_every_family_chain_and_tree(target, traffic, family: str, tmp_path) -> None:
    from eval.decoder import SpeculativeDecoder
    from eval.heldout import Prompt
    from eval.replay import replay, replay_many
    from eval.traces import Sampling, TraceCache, continuations, trace_target
    from train.drafters import registry

    prompts, conts = traffic
    eos = target.tokenizer.eos_token_id
    spec = registry.get(family.removesuffix("_window"))
    base = {"chain_k": 4, "tree_depth": 4, "tree_top_k": 3, "tree_total_tokens": 10, **FAMILY_KW[family]}
    module = _fit(spec, spec.config_cls(**base), target, prompts, conts, FIT_STEPS.get(family, 40))
    deepest = 0
    refs = {}
    for mode in ("chain", "tree"):
        cfg = spec.config_cls(decode=mode, **base)
        for i, (p, c) in enumerate(zip(prompts, conts, strict=True)):
            ref = SpeculativeDecoder(target.model, spec.proposer(module, target.model, cfg)).generate(
                torch.tensor([p]), MAX_NEW, eos
            )
            refs[mode, i] = ref
            prop = spec.proposer(module, target.model, cfg)
            trace = trace_target(target.model, p, c, prop.aux_hidden_layers, prop.needs_hidden_states)
            tokens, stats = replay(prop, trace, MAX_NEW, eos)
            assert tokens == ref.tokens
            _same(stats, ref.stats)
            deepest = max(deepest, max(stats.accepted_lengths, default=0))
    need = DEPTH.get(family, 3)
    assert deepest >= need, f"{family}: the fitted drafter should accept deep drafts (deepest {deepest} < {need})"

    # many prompts at once: the feature heads draft for all of them in one batched head call per position / depth
    # (their replayer); the other families run in lockstep lanes (eval/lanes.py), linear layers batched across
    # them. lanes=2 < 3 prompts: a finished prompt's slot is refilled, and the live slots stop being 0..n-1.
    prop_of = {m: spec.proposer(module, target.model, spec.config_cls(decode=m, **base)) for m in ("chain", "tree")}
    batched = spec.name in ("eagle", "eagle3")
    assert (prop_of["tree"].replayer(2, 64) is not None) == batched
    held = [Prompt("t", str(i), p) for i, p in enumerate(prompts)]
    # the first run stores the traces, the second reads them back from disk (no target forward)
    traces = TraceCache(tmp_path, "fp")
    for lanes in (len(prompts), 2):
        per, outputs, _ = replay_many(target.model, prop_of, held, conts, MAX_NEW, eos, lanes=lanes, trace_cache=traces)
        assert (traces.computed, traces.loaded) == ((3, 0) if lanes == len(prompts) else (3, 3)), family
        for mode in prop_of:
            for i in range(len(prompts)):
                assert outputs[mode][f"t:{i}"] == refs[mode, i].tokens, (family, mode, i, lanes)
                _same(per[mode]["t"][i], refs[mode, i].stats)

    # sampled (T=1): along sampled paths, one prompt at a time (the proposer's own drafting with forced tokens) and
    # many at once (the feature heads' batched path_q, or lanes) walk the same steps: the drafter's probabilities
    # of the path tokens agree, and the acceptance draws come from per-prompt generators
    s = Sampling(1.0, 1.0, 0)
    paths = continuations(target.model, prompts, MAX_NEW, 3, s)
    assert paths != [list(c) for c in conts]  # sampled, not greedy
    one, _, _ = replay_many(target.model, prop_of, held, paths, MAX_NEW, eos, lanes=1, trace_cache=traces, sampling=s)
    many, outs, _ = replay_many(target.model, prop_of, held, paths, MAX_NEW, eos, lanes=2, sampling=s)
    for mode in prop_of:
        for i in range(len(prompts)):
            _same(one[mode]["t"][i], many[mode]["t"][i])
            assert outs[mode][f"t:{i}"] == paths[i][: len(outs[mode][f"t:{i}"])]  # the path itself is emitted


def test_prompt_lookup_replay_equals_decode(target, traffic) -> None:
    from eval.decoder import SpeculativeDecoder
    from eval.proposers import PromptLookupProposer
    from eval.replay import replay
    from eval.traces import trace_target

    prompts, conts = traffic
    eos = target.tokenizer.eos_token_id
    for p, c in zip(prompts, conts, strict=True):
        ref = SpeculativeDecoder(target.model, PromptLookupProposer(num_tokens=5)).generate(
            torch.tensor([p]), MAX_NEW, eos
        )
        trace = trace_target(target.model, p, c, None, need_hidden=False)
        tokens, stats = replay(PromptLookupProposer(num_tokens=5), trace, MAX_NEW, eos)
        assert tokens == ref.tokens
        _same(stats, ref.stats)


def test_bootstrap_interval() -> None:
    from eval.stats import bootstrap_tau_ci

    def stats(acc: list[int]) -> DecodeStats:
        s = DecodeStats()
        for a in acc:
            s.record_step(a, a + 1, 5)
        return s

    same = [stats([1, 1, 1, 1]) for _ in range(20)]
    assert bootstrap_tau_ci(same) == pytest.approx((2.0, 2.0))  # no spread between prompts: a point
    mixed = [stats([0] * 10), stats([4] * 10)] * 10
    lo, hi = bootstrap_tau_ci(mixed)
    assert 1.0 < lo < 3.0 < hi < 5.0  # pooled tau is 3.0; the interval straddles it
    lo2, hi2 = bootstrap_tau_ci(mixed * 4)
    assert hi2 - lo2 < hi - lo  # more prompts, narrower interval
    assert all(math.isnan(x) for x in bootstrap_tau_ci([]))


def test_paired_difference_sees_what_separate_intervals_cannot() -> None:
    """Prompts vary a lot (tau 1.2 .. 3.0) but b beats a by ~0.1 on every one: the separate intervals overlap,
    the paired interval excludes zero; the pairing is by id, whatever the order; unpairable input gives None."""
    from eval.stats import describe_paired, paired_tau_diff

    ids = [f"s:{i}" for i in range(30)]
    steps = [40] * 30
    ea = [int(40 * (1.2 + 1.8 * i / 29)) for i in range(30)]
    eb = [e + 4 for e in ea]  # +0.1 tau on every prompt
    a = {"ids": ids, "emitted": ea, "steps": steps}
    b = {"ids": ids[::-1], "emitted": eb[::-1], "steps": steps}  # another order: matched by id
    p = paired_tau_diff(a, b)
    assert p is not None and p["diff"] == pytest.approx(0.1)
    assert 0.09 < p["ci"][0] <= p["ci"][1] < 0.11 and p["better"] == 30 and p["worse"] == 0
    assert describe_paired(p).startswith("+0.100 [")
    q = paired_tau_diff(b, a)
    assert q is not None and q["diff"] == pytest.approx(-0.1) and q["worse"] == 30
    noisy = {"ids": ids, "emitted": [e + (4 if i % 2 else -4) for i, e in enumerate(ea)], "steps": steps}
    r = paired_tau_diff(a, noisy)
    assert r is not None and r["ci"][0] < 0 < r["ci"][1] and r["better"] == 15 and r["worse"] == 15
    assert paired_tau_diff(a, {"ids": None, "emitted": eb, "steps": steps}) is None
    assert paired_tau_diff(a, {"ids": ["x:1", "x:2"], "emitted": [1, 2], "steps": [1, 1]}) is None


@pytest.mark.parametrize("temperature", [1.0, 0.6])
def test_expected_acceptance_matches_the_sampled_decoder(target_and_draft, temperature: float) -> None:
    """Sampling: tau expected from the target's and the drafter's distributions along sampled paths agrees with
    the tau the lossless sampling decoder really reaches (same pair, same K, 120 generations each)."""
    from eval.decoder import SpeculativeDecoder, plain_decode
    from eval.expected import ExpectedAcceptance, expected_acceptance
    from eval.proposers import DraftModelProposer

    pair = target_and_draft
    k, n = 3, 32
    vocab = pair.target.config.vocab_size
    emitted = steps = 0
    expected: list[ExpectedAcceptance] = []
    for seed in range(40):
        for p in pair.prompts:
            prop = DraftModelProposer(pair.draft, vocab, num_tokens=k, mode="chain")
            gen = torch.Generator().manual_seed(seed)
            r = SpeculativeDecoder(pair.target, prop, temperature=temperature).generate(p, n, None, gen)
            emitted += sum(a + 1 for a in r.stats.accepted_lengths)
            steps += len(r.stats.accepted_lengths)
            path = plain_decode(pair.target, p, n, None, temperature, 1.0, torch.Generator().manual_seed(1000 + seed))
            prop = DraftModelProposer(pair.draft, vocab, num_tokens=k, mode="chain")
            gen = torch.Generator().manual_seed(seed)
            expected.append(expected_acceptance(prop, pair.target, p[0].tolist(), path.tokens, temperature, 1.0, gen))
    decoded = emitted / steps
    assert decoded > 2.0  # the pair accepts often: deeper positions matter
    assert ExpectedAcceptance.pooled_tau(expected) == pytest.approx(decoded, rel=0.04)
    alpha = [a / t for a, t in zip(expected[0].accepted, expected[0].attempted, strict=True) if t > 0]
    assert all(0.0 <= a <= 1.0 for a in alpha)


@pytest.mark.parametrize(
    ("mode", "temperature"), [("chain", 1.0), ("chain", 0.6), ("greedy_chain", 0.15), ("tree", 0.6)]
)
def test_sampled_replay_matches_the_sampled_decoder(target_and_draft, mode: str, temperature: float) -> None:
    """Sampled replay (a path sampled from the target, the decoder's acceptance law along it) reaches the tau and
    per-position acceptance of the lossless sampling decoder itself: same pair, same drafts, 300 generations each
    (120 for the tree; replay within 3% of the decoder; the two samples differed by <= 0.7% on this pair). Chains
    sampled from q, chains drafted by argmax (vLLM's default; at T=0.15, where this random pair's argmax drafts are
    accepted often enough to test) and trees."""
    from eval.decoder import SpeculativeDecoder
    from eval.proposers import DraftModelProposer
    from eval.replay import replay
    from eval.traces import Sampling, continuations, trace_target

    pair = target_and_draft
    n, seeds = 32, 40 if mode == "tree" else 100  # the tree accepts little here (tau ~1.05): less spread
    vocab = pair.target.config.vocab_size
    shape = {"tree_depth": 3, "tree_top_k": 2, "tree_total_tokens": 6} if mode == "tree" else {"num_tokens": 3}
    kind = "tree" if mode == "tree" else "chain"

    def proposer() -> DraftModelProposer:
        prop = DraftModelProposer(pair.draft, vocab, mode=kind, **shape)
        prop.greedy_drafts = mode == "greedy_chain"
        return prop

    prompts = [p[0].tolist() for p in pair.prompts]
    decoded, replayed = DecodeStats(), DecodeStats()
    for seed in range(seeds):
        s = Sampling(temperature, 1.0, seed)
        for p, path in zip(prompts, continuations(pair.target, prompts, n, len(prompts), s), strict=True):
            gen = torch.Generator().manual_seed(seed)
            dec = SpeculativeDecoder(pair.target, proposer(), temperature=temperature)
            decoded = decoded.merge(dec.generate(torch.tensor([p]), n, None, gen).stats)
            trace = trace_target(pair.target, p, path, None, False, s)
            replayed = replayed.merge(replay(proposer(), trace, n, None, s)[1])
    if mode == "chain":
        assert decoded.tau() > 2.5  # the pair accepts deep: every draft position matters
    if mode == "greedy_chain":  # argmax drafts of this pair's flat distributions: accepted often only when cold
        assert decoded.tau() > 1.3
    assert replayed.tau() == pytest.approx(decoded.tau(), rel=0.03)
    assert replayed.alpha()[0] == pytest.approx(decoded.alpha()[0], abs=0.03)
    assert replayed.new_tokens == decoded.new_tokens == seeds * len(prompts) * n


def test_continuation_cache_reuses_prefixes_and_survives_an_unwritable_dir(tmp_path, target_and_draft, caplog) -> None:
    """Continuations are made once: a shorter budget is served by prefix (no model call), a new prompt adds a row;
    an unwritable cache directory only costs a warning."""
    from eval.decoder import plain_decode
    from eval.traces import ContinuationCache

    model = target_and_draft.target
    prompts = [p[0].tolist() for p in target_and_draft.prompts]
    cache = ContinuationCache(tmp_path / "replay", "fp")
    long = cache.get(model, prompts[:2], 12, pad_token_id=0, batch_size=2)
    for p, c in zip(prompts[:2], long, strict=True):  # left-padded batch == batch-1 greedy decoding
        assert c == plain_decode(model, torch.tensor([p]), 12).tokens
    reread = ContinuationCache(tmp_path / "replay", "fp")
    assert len(reread) == 2
    assert reread.get(None, prompts[:2], 5, pad_token_id=0) == [c[:5] for c in long]  # type: ignore[arg-type]
    assert (
        len(reread.get(model, prompts, 5, pad_token_id=0)) == 3
        and len(ContinuationCache(tmp_path / "replay", "fp")) == 3
    )
    other = ContinuationCache(tmp_path / "replay", "another target")  # another target's rows are never served
    other.get(model, prompts[:1], 4, pad_token_id=0)
    assert len(other) == 4
    blocked = tmp_path / "a_file"
    blocked.write_text("x")
    nowhere = ContinuationCache(blocked / "replay", "fp")  # its directory cannot be created
    assert nowhere.get(model, prompts[:1], 4, pad_token_id=0)[0] == long[0][:4]
    assert "cannot write the continuation cache" in caplog.text


def test_trace_cache_reads_back_adds_layers_and_survives_bad_files(target, traffic, tmp_path, caplog) -> None:
    """A stored trace is read back bit for bit; a request for a layer it lacks recomputes it with the union of
    layers (so the next family finds both); a corrupt file or one holding another prompt is recomputed; another
    target's fingerprint never reads it; an unwritable directory only costs a warning."""
    from eval.traces import TraceCache, trace_target

    prompts, conts = traffic
    p, c = prompts[0], conts[0]
    ref = trace_target(target.model, p, c, [2, 15], True)
    cache = TraceCache(tmp_path, "fp")
    first = cache.get(target.model, p, c, [2, 15], True)
    again = TraceCache(tmp_path, "fp").get(target.model, p, c, [15], True)  # a subset: read, not recomputed
    for t in (first, again):
        assert torch.equal(t.prompt, ref.prompt) and t.continuation == ref.continuation
        assert torch.equal(t.prompt_logits, ref.prompt_logits)
        for k in ("last", 2, 15):
            assert torch.equal(t.hidden[k], ref.hidden[k]), k
    files = list((tmp_path / "traces").glob("*.safetensors"))
    assert len(files) == 1 and cache.computed == 1
    more = TraceCache(tmp_path, "fp")
    union = more.get(target.model, p, c, [27], True)  # a layer it lacks: recomputed with 2, 15 and 27
    assert more.computed == 1 and set(union.hidden) == {"last", 2, 15, 27}
    assert TraceCache(tmp_path, "fp").get(target.model, p, c, [2, 27], True).hidden.keys() == union.hidden.keys()
    other = TraceCache(tmp_path, "another target")
    other.get(target.model, p, c, [2], True)
    assert other.computed == 1 and len(list((tmp_path / "traces").glob("*.safetensors"))) == 2
    for f in (tmp_path / "traces").glob("*.safetensors"):
        f.write_bytes(b"not a safetensors file")
    bad = TraceCache(tmp_path, "fp")
    fixed = bad.get(target.model, p, c, [2], True)
    assert bad.computed == 1 and torch.equal(fixed.hidden[2], ref.hidden[2])
    assert "unreadable trace" in caplog.text
    # a file that holds another prompt under this key (a collision or a copied file) is not trusted
    path = bad._path(target.model, p, c)
    elsewhere = TraceCache(tmp_path / "x", "fp")
    elsewhere.get(target.model, prompts[1], conts[1], [2], True)
    path.write_bytes(elsewhere._path(target.model, prompts[1], conts[1]).read_bytes())
    check = TraceCache(tmp_path, "fp")
    assert torch.equal(check.get(target.model, p, c, [2], True).hidden[2], ref.hidden[2]) and check.computed == 1
    assert "does not hold this prompt" in caplog.text
    blocked = tmp_path / "a_file"
    blocked.write_text("x")
    nowhere = TraceCache(blocked, "fp")
    assert torch.equal(nowhere.get(target.model, p, c, [2], True).hidden[2], ref.hidden[2])
    assert "cannot write the trace cache" in caplog.text
