"""End-to-end tests of eval.decoder: greedy identity, eos / length handling, KV rollback,
hidden-state plumbing for feature-level proposers and sampling losslessness."""

from __future__ import annotations

import copy
from collections.abc import Callable
from typing import Any

import pytest
import torch
from transformers import DynamicCache

from eval import decoder as decoder_mod
from eval import sampling
from eval.decoder import SpeculativeDecoder, build_verification_mask, model_forward, plain_decode
from eval.proposers import DraftModelProposer, PromptLookupProposer, Proposer, TargetOutput
from eval.sampling import logits_to_probs
from eval.tree import DraftTree, chain

Chi2 = Callable[[torch.Tensor, torch.Tensor], tuple[float, float]]
ModelPairT = tuple[torch.nn.Module, torch.nn.Module]

# ---------------------------------------------------------------------------------------------
# helpers
# ---------------------------------------------------------------------------------------------

PROPOSER_CONFIGS: dict[str, dict[str, Any]] = {
    "prompt_lookup": {},
    "chain_k1": {"mode": "chain", "num_tokens": 1},
    "chain_k3": {"mode": "chain", "num_tokens": 3},
    "chain_k5": {"mode": "chain", "num_tokens": 5},
    "dynamic_tree": {"mode": "tree", "tree_depth": 4, "tree_top_k": 3, "tree_total_tokens": 10},
    "static_tree": {"mode": "static"},
}


def make_proposer(pair: Any, config: str) -> Proposer:
    if config == "prompt_lookup":
        return PromptLookupProposer(num_tokens=4, max_ngram=3)
    kw = dict(PROPOSER_CONFIGS[config])
    if kw["mode"] == "static":
        kw["tree_paths"] = pair.static_paths
    return DraftModelProposer(pair.draft, pair.target.config.vocab_size, **kw)


_REF_CACHE: dict[tuple[int, int, int], list[int]] = {}


def hf_greedy(target: torch.nn.Module, prompt: torch.Tensor, max_new: int, eos: int | list[int] | None) -> list[int]:
    """``target.generate(do_sample=False)`` reference (memoised per target / prompt)."""
    key = (id(target), hash(tuple(prompt[0].tolist())), max_new)
    if key not in _REF_CACHE:
        with torch.inference_mode():
            out = target.generate(
                prompt,
                attention_mask=torch.ones_like(prompt),
                do_sample=False,
                max_new_tokens=max_new,
                eos_token_id=eos,
                pad_token_id=(eos[0] if isinstance(eos, list) else eos) or 0,
            )
        _REF_CACHE[key] = out[0, prompt.shape[1] :].tolist()
    return _REF_CACHE[key]


class FixedProposer(Proposer):
    """Proposes ``make_tree(context)`` (test helper)."""

    name = "fixed"

    def __init__(self, make_tree: Callable[[torch.Tensor], DraftTree]) -> None:
        self.make_tree = make_tree

    def begin(self, prompt_ids: torch.Tensor, target_out: TargetOutput) -> None:
        return None

    def propose(self, context: torch.Tensor) -> DraftTree:
        return self.make_tree(context)


def assert_cache_equals_fresh_prefill(target: torch.nn.Module, cache: Any, tokens: torch.Tensor) -> None:
    fresh = DynamicCache(config=target.config)
    with torch.inference_mode():
        model_forward(target, tokens[None], fresh)
    assert cache.get_seq_length() == tokens.numel()
    for layer, ref in zip(cache.layers, fresh.layers, strict=True):
        assert layer.keys.shape == ref.keys.shape
        torch.testing.assert_close(layer.keys, ref.keys, atol=1e-4, rtol=1e-4)
        torch.testing.assert_close(layer.values, ref.values, atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------------
# greedy identity
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config", list(PROPOSER_CONFIGS))
def test_greedy_output_identical_to_hf_generate(target_and_draft: Any, config: str) -> None:
    pair = target_and_draft
    total_accepted = 0
    for prompt in pair.prompts:
        ref = hf_greedy(pair.target, prompt, pair.max_new_tokens, pair.eos_token_id)
        dec = SpeculativeDecoder(pair.target, make_proposer(pair, config))
        res = dec.generate(prompt, pair.max_new_tokens, eos_token_id=pair.eos_token_id)
        assert res.tokens == ref, f"{config}: speculative output differs from target.generate"
        s = res.stats
        assert s.new_tokens == len(res.tokens)
        assert s.prefill_forwards == 1 and s.target_forwards == 1 + s.verify_steps
        # every step emits accepted + 1 tokens except possibly a truncated last one
        assert sum(a + 1 for a in s.accepted_lengths) >= len(res.tokens) - 1
        total_accepted += sum(s.accepted_lengths)
    if pair.name == "tiny_llama":  # the noisy-copy draft and repetitive prompt must get accepts
        assert total_accepted > 0


def test_plain_decode_matches_hf_generate(target_and_draft: Any) -> None:
    pair = target_and_draft
    for prompt in pair.prompts:
        res = plain_decode(pair.target, prompt, pair.max_new_tokens, pair.eos_token_id)
        assert res.tokens == hf_greedy(pair.target, prompt, pair.max_new_tokens, pair.eos_token_id)
        assert res.stats.tau() == 1.0


def test_tiny_pair_exercises_partial_acceptance(target_and_draft: Any) -> None:
    """Sanity check of the fixture: chain K=5 sees rejections at several depths (not all-or-nothing)."""
    pair = target_and_draft
    if pair.name != "tiny_llama":
        pytest.skip("fixture-specific")
    res = SpeculativeDecoder(pair.target, make_proposer(pair, "chain_k5")).generate(pair.prompts[0], 48)
    assert len(set(res.stats.accepted_lengths)) >= 3
    assert 1.3 < res.stats.tau() < 5.5


def test_greedy_identity_with_eager_attention(target_and_draft: Any) -> None:
    """Custom 4D tree masks also work with attn_implementation='eager' (additive float mask)."""
    pair = target_and_draft
    target = copy.deepcopy(pair.target)
    target.set_attn_implementation("eager")
    assert target.config._attn_implementation == "eager"
    prompt = pair.prompts[0]
    ref = hf_greedy(pair.target, prompt, pair.max_new_tokens, pair.eos_token_id)
    for config in ("dynamic_tree", "chain_k3"):
        res = SpeculativeDecoder(target, make_proposer(pair, config)).generate(
            prompt, pair.max_new_tokens, eos_token_id=pair.eos_token_id
        )
        assert res.tokens == ref


def test_tree_requires_custom_mask_capable_attention(target_and_draft: Any, monkeypatch: pytest.MonkeyPatch) -> None:
    """Trees are refused (before any forward) when the attention implementation can't take a 4D mask."""
    pair = target_and_draft
    impl = pair.target.config._attn_implementation
    # pretend the target's implementation is unsupported (setting e.g. flash_attention_2 needs the kernel)
    monkeypatch.setattr(decoder_mod, "TREE_ATTN_IMPLEMENTATIONS", ("some_other_impl",))
    tree = DraftTree(tokens=torch.tensor([1, 2]), parents=[-1, -1])
    dec = SpeculativeDecoder(pair.target, FixedProposer(lambda ctx: tree))
    state = dec.start(pair.prompts[0], 8)
    with pytest.raises(ValueError, match=f"target uses '{impl}'"):
        dec.step(state)
    # chains do not need a custom mask
    dec = SpeculativeDecoder(pair.target, FixedProposer(lambda ctx: chain([1, 2])))
    state = dec.start(pair.prompts[0], 8)
    dec.step(state)


def test_verification_mask_layout() -> None:
    mask = build_verification_mask([-1, -1, 0], past_len=2, dtype=torch.float32)
    assert mask.shape == (1, 1, 4, 6)
    allowed = (mask[0, 0] == 0).int().tolist()
    assert allowed == [
        # past past root n0 n1 n2
        [1, 1, 1, 0, 0, 0],  # root
        [1, 1, 1, 1, 0, 0],  # n0
        [1, 1, 1, 0, 1, 0],  # n1
        [1, 1, 1, 1, 0, 1],  # n2 (child of n0)
    ]
    assert mask.min() == torch.finfo(torch.float32).min


# ---------------------------------------------------------------------------------------------
# eos / max_new_tokens
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("config", ["chain_k5", "dynamic_tree", "prompt_lookup"])
def test_max_new_tokens_and_eos(target_and_draft: Any, config: str) -> None:
    pair = target_and_draft
    prompt = pair.prompts[0]
    ref = hf_greedy(pair.target, prompt, pair.max_new_tokens, None)
    for n in (1, 2, 7):
        res = SpeculativeDecoder(pair.target, make_proposer(pair, config)).generate(prompt, n)
        assert res.tokens == ref[:n]
        assert res.stats.new_tokens == n
    # eos = a token that first appears at position >= 3: output stops right after it
    pos = next((i for i in range(3, len(ref)) if ref[i] not in ref[:i]), None)
    if pos is None:
        pytest.skip("greedy output has no fresh token to use as eos")
    eos = ref[pos]
    res = SpeculativeDecoder(pair.target, make_proposer(pair, config)).generate(
        prompt, pair.max_new_tokens, eos_token_id=[eos, -5]
    )
    assert res.tokens == ref[: pos + 1]
    assert SpeculativeDecoder(pair.target, make_proposer(pair, config)).generate(prompt, 0).tokens == []


# ---------------------------------------------------------------------------------------------
# KV rollback
# ---------------------------------------------------------------------------------------------


def _wrong(tok: int, vocab: int, k: int = 1) -> int:
    return (tok + k) % vocab


def test_kv_rollback_after_chain_rejection(target_and_draft: Any) -> None:
    pair = target_and_draft
    vocab = pair.target.config.vocab_size
    target = pair.target
    holder: dict[str, list[int]] = {}

    def make_chain(context: torch.Tensor) -> DraftTree:
        c = plain_decode(target, context[None], 4).tokens
        holder["c"] = c
        return chain([c[0], c[1], _wrong(c[2], vocab), c[3]])  # accept 2, reject the 3rd

    dec = SpeculativeDecoder(target, FixedProposer(make_chain))
    state = dec.start(pair.prompts[0], 32)
    emitted = dec.step(state)
    c = holder["c"]
    assert emitted == [c[0], c[1], c[2]]
    assert state.stats.accepted_lengths == [2]
    assert state.stats.attempted_per_position == [1, 1, 1]
    assert_cache_equals_fresh_prefill(target, state.cache, state.context[:-1])
    # keep decoding: the result must still be the greedy continuation
    dec.proposer = make_proposer(pair, "chain_k3")
    dec.proposer.begin(state.context, TargetOutput(logits=torch.zeros(1)))
    while not state.finished:
        dec.step(state)
    assert state.new_tokens == hf_greedy(target, pair.prompts[0], 32, None)


def test_kv_rollback_after_tree_rejection(target_and_draft: Any) -> None:
    pair = target_and_draft
    vocab = pair.target.config.vocab_size
    target = pair.target
    holder: dict[str, list[int]] = {}

    def make_tree(context: torch.Tensor) -> DraftTree:
        c = plain_decode(target, context[None], 3).tokens
        holder["c"] = c
        tokens = [
            _wrong(c[0], vocab),  # n0  root child (wrong)
            c[0],  # n1  root child (right)
            _wrong(c[0], vocab, 2),  # n2  root child (wrong)
            c[1],  # n3  child of wrong n0 (must be ignored)
            _wrong(c[1], vocab),  # n4  child of n1 (wrong)
            c[1],  # n5  child of n1 (right)
            _wrong(c[2], vocab),  # n6  child of n5 (wrong)
        ]
        return DraftTree(tokens=torch.tensor(tokens), parents=[-1, -1, -1, 0, 1, 1, 5])

    dec = SpeculativeDecoder(target, FixedProposer(make_tree))
    state = dec.start(pair.prompts[1], 32)
    past_len = state.context.numel() - 1
    emitted = dec.step(state)
    c = holder["c"]
    assert emitted == [c[0], c[1], c[2]]
    assert state.stats.accepted_lengths == [2]
    # kept KV = past + root + n1 + n5 (non-contiguous in the verification input)
    assert state.cache.get_seq_length() == past_len + 3
    assert_cache_equals_fresh_prefill(target, state.cache, state.context[:-1])
    dec.proposer = make_proposer(pair, "dynamic_tree")
    dec.proposer.begin(state.context, TargetOutput(logits=torch.zeros(1)))
    while not state.finished:
        dec.step(state)
    assert state.new_tokens == hf_greedy(target, pair.prompts[1], 32, None)


def test_draft_model_cache_tracks_context(target_and_draft: Any) -> None:
    """The draft's own cache equals a fresh prefill of what it claims to hold after every propose."""
    pair = target_and_draft
    for config in ("chain_k3", "dynamic_tree"):
        prop = make_proposer(pair, config)
        assert isinstance(prop, DraftModelProposer)
        dec = SpeculativeDecoder(pair.target, prop)
        state = dec.start(pair.prompts[0], 24)
        for _ in range(4):
            if state.finished:
                break
            dec.step(state)
            ctx = prop._cached
            assert_cache_equals_fresh_prefill(pair.draft, prop._cache, torch.tensor(ctx))


# ---------------------------------------------------------------------------------------------
# hidden states for feature-level proposers (EAGLE / Medusa plumbing)
# ---------------------------------------------------------------------------------------------


class HiddenRecorder(DraftModelProposer):
    """A draft-model proposer that also asks for target hidden states and records them."""

    needs_hidden_states = True
    aux_hidden_layers = [1]  # noqa: RUF012

    def begin(self, prompt_ids: torch.Tensor, target_out: TargetOutput) -> None:
        super().begin(prompt_ids, target_out)
        assert target_out.hidden_states is not None
        self.rows = {key: [v] for key, v in target_out.hidden_states.items()}
        assert self.rows["last"][0].shape[0] == prompt_ids.numel()

    def commit(self, context: torch.Tensor, n_new: int, hidden: dict[int | str, torch.Tensor] | None) -> None:
        assert hidden is not None and set(hidden) == {"last", 1}
        for key, v in hidden.items():
            assert v.shape[0] == n_new
            self.rows[key].append(v)
        # invariant: hidden states known for every committed token but the last one
        assert sum(r.shape[0] for r in self.rows["last"]) == context.numel() - 1


@pytest.mark.parametrize("mode", ["chain", "tree"])
def test_hidden_states_of_accepted_positions(target_and_draft: Any, mode: str) -> None:
    pair = target_and_draft
    kw = {"num_tokens": 3} if mode == "chain" else {"tree_depth": 3, "tree_top_k": 3, "tree_total_tokens": 8}
    prop = HiddenRecorder(pair.draft, pair.target.config.vocab_size, mode=mode, **kw)
    res = SpeculativeDecoder(pair.target, prop).generate(pair.prompts[0], 24)
    assert sum(res.stats.accepted_lengths) > 0 or pair.name != "tiny_llama"
    context = torch.cat([pair.prompts[0][0], torch.tensor(res.tokens)])
    with torch.inference_mode():
        full = pair.target(context[None], output_hidden_states=True)
    for key, idx in (("last", -1), (1, 1)):
        got = torch.cat(prop.rows[key])
        torch.testing.assert_close(got, full.hidden_states[idx][0, : got.shape[0]], atol=1e-4, rtol=1e-4)


# ---------------------------------------------------------------------------------------------
# sampling: end-to-end distribution of the first generated tokens
# ---------------------------------------------------------------------------------------------


def exact_joint(
    target: torch.nn.Module, prompt: torch.Tensor, n: int, temperature: float, top_p: float
) -> torch.Tensor:
    """Exact target probability of every n-token continuation, flattened ``[V**n]`` (row-major)."""
    vocab = target.config.vocab_size
    probs = torch.ones(1, dtype=torch.float64)
    seqs = prompt.clone()  # [B, T]
    with torch.inference_mode():
        for _ in range(n):
            logits = target(seqs).logits[:, -1]
            p = logits_to_probs(logits, temperature, top_p).double()  # [B, V]
            probs = (probs[:, None] * p).reshape(-1)
            seqs = torch.cat([seqs.repeat_interleave(vocab, 0), torch.arange(vocab).repeat(seqs.shape[0])[:, None]], 1)
    return probs


def sample_first_tokens(
    dec: Any, prompt: torch.Tensor, n_tokens: int, runs: int, seed: int, vocab: int
) -> torch.Tensor:
    g = torch.Generator().manual_seed(seed)
    counts = torch.zeros(vocab**n_tokens)
    for _ in range(runs):
        toks = dec.generate(prompt, n_tokens + 1, generator=g).tokens[:n_tokens]
        idx = 0
        for t in toks:
            idx = idx * vocab + t
        counts[idx] += 1
    return counts


PROMPT4 = torch.tensor([[0, 1, 2, 3, 1]])


@pytest.mark.parametrize(
    ("mode", "temperature", "top_p"),
    [("chain", 1.0, 1.0), ("tree", 0.8, 0.95)],
)
def test_sampling_first_tokens_match_target_distribution(
    tiny_vocab_pair: ModelPairT, chi2: Chi2, mode: str, temperature: float, top_p: float
) -> None:
    """First 3 tokens (prefill token + a K=2 chain / depth-2 tree step and its bonus) ~ target."""
    target, draft = tiny_vocab_pair
    kw = {"num_tokens": 2} if mode == "chain" else {"tree_depth": 2, "tree_top_k": 2, "tree_total_tokens": 4}
    dec = SpeculativeDecoder(target, DraftModelProposer(draft, 4, mode=mode, **kw), temperature, top_p)
    counts = sample_first_tokens(dec, PROMPT4, 3, runs=600, seed=0, vocab=4)
    stat, crit = chi2(counts, exact_joint(target, PROMPT4, 3, temperature, top_p))
    assert stat < crit, (stat, crit)


def test_sampling_check_detects_wrong_residual(
    tiny_vocab_pair: ModelPairT, chi2: Chi2, monkeypatch: pytest.MonkeyPatch
) -> None:
    """Negative control: resampling from p instead of the residual is caught by the same check."""
    target, draft = tiny_vocab_pair
    monkeypatch.setattr(sampling, "residual_distribution", lambda p, q: p.float() / p.float().sum())
    dec = SpeculativeDecoder(target, DraftModelProposer(draft, 4, mode="chain", num_tokens=2), 1.0, 1.0)
    counts = sample_first_tokens(dec, PROMPT4, 3, runs=400, seed=0, vocab=4)
    stat, crit = chi2(counts, exact_joint(target, PROMPT4, 3, 1.0, 1.0))
    assert stat > 2 * crit, (stat, crit)


def test_sampling_requires_generator_and_first_token_matches_plain(tiny_vocab_pair: ModelPairT) -> None:
    target, draft = tiny_vocab_pair
    dec = SpeculativeDecoder(target, DraftModelProposer(draft, 4, num_tokens=2), temperature=1.0)
    with pytest.raises(ValueError, match="Generator"):
        dec.generate(PROMPT4, 3)
    for seed in range(5):
        a = dec.generate(PROMPT4, 1, generator=torch.Generator().manual_seed(seed)).tokens
        b = plain_decode(target, PROMPT4, 1, temperature=1.0, generator=torch.Generator().manual_seed(seed)).tokens
        assert a == b
