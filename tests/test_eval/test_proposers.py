"""Tests of the proposers: prompt lookup, draft-model compatibility checks and draft outputs."""

from __future__ import annotations

from typing import Any

import pytest
import torch

from eval.proposers import DraftModelProposer, PromptLookupProposer, TargetOutput
from eval.proposers.draft_model import check_vocab_compatibility
from eval.proposers.prompt_lookup import find_ngram_continuation


def test_find_ngram_continuation_most_recent_match_longest_ngram_first() -> None:
    toks = [1, 2, 3, 9, 9, 1, 2, 3, 7, 8, 5, 2, 3]
    # last 3-gram (5, 2, 3) never occurred; 2-gram (2, 3) occurred at 1 and 6 -> most recent is 6
    assert find_ngram_continuation(toks, 3, max_ngram=3, min_ngram=1) == [7, 8, 5]
    assert find_ngram_continuation(toks, 10, max_ngram=3, min_ngram=1) == [7, 8, 5, 2, 3]
    # min_ngram=3 forbids falling back to shorter n-grams
    assert find_ngram_continuation(toks, 3, max_ngram=3, min_ngram=3) == []
    # a longer match wins over a more recent shorter one
    toks = [4, 5, 6, 1, 9, 6, 2, 4, 5, 6]
    assert find_ngram_continuation(toks, 2, max_ngram=3, min_ngram=1) == [1, 9]
    assert find_ngram_continuation([1, 2, 3], 2, 3, 1) == []
    assert find_ngram_continuation([7], 2, 3, 1) == []
    # the match may overlap the suffix (repetition)
    assert find_ngram_continuation([3, 3, 3], 4, 2, 1) == [3]


def test_prompt_lookup_proposer_chain_and_empty() -> None:
    prop = PromptLookupProposer(num_tokens=2, max_ngram=2)
    prop.begin(torch.tensor([1]), TargetOutput(logits=torch.zeros(1, 4)))
    tree = prop.propose(torch.tensor([1, 2, 3, 4, 1, 2]))
    assert tree.is_chain() and tree.tokens.tolist() == [3, 4] and tree.draft_probs is None
    assert len(prop.propose(torch.tensor([1, 2, 3]))) == 0
    with pytest.raises(ValueError):
        PromptLookupProposer(num_tokens=0)


class FakeTokenizer:
    def __init__(self, vocab: dict[str, int]) -> None:
        self.vocab = vocab

    def get_vocab(self) -> dict[str, int]:
        return dict(self.vocab)

    def __len__(self) -> int:
        return len(self.vocab)


def test_vocab_compatibility_checks() -> None:
    check_vocab_compatibility(128, 128)
    with pytest.raises(ValueError, match="vocab size"):
        check_vocab_compatibility(128, 64)
    tok = FakeTokenizer({f"t{i}": i for i in range(100)})
    other = FakeTokenizer({**{f"t{i}": i for i in range(99)}, "x": 99})
    with pytest.raises(ValueError, match="tokenizer"):
        check_vocab_compatibility(128, 128, tok, other)
    # same tokenizer, only embedding padding differs -> accepted
    check_vocab_compatibility(128, 112, tok, FakeTokenizer(tok.get_vocab()))
    # padding smaller than the tokenizer -> refused
    with pytest.raises(ValueError):
        check_vocab_compatibility(128, 96, tok, FakeTokenizer(tok.get_vocab()))


def test_draft_model_proposer_rejects_incompatible_draft(target_and_draft: Any) -> None:
    pair = target_and_draft
    with pytest.raises(ValueError, match="vocab size"):
        DraftModelProposer(pair.draft, pair.target.config.vocab_size + 1)
    with pytest.raises(ValueError):
        DraftModelProposer(pair.draft, pair.target.config.vocab_size, mode="static")  # no paths
    with pytest.raises(ValueError):
        DraftModelProposer(pair.draft, pair.target.config.vocab_size, mode="beam")  # type: ignore[arg-type]


def test_draft_model_proposer_outputs(target_and_draft: Any) -> None:
    pair = target_and_draft
    vocab = pair.target.config.vocab_size
    prompt = pair.prompts[0][0]
    out = TargetOutput(logits=torch.zeros(prompt.numel(), vocab))

    # greedy chain = the draft's own greedy continuation
    prop = DraftModelProposer(pair.draft, vocab, num_tokens=4)
    prop.begin(prompt, out)
    tree = prop.propose(prompt)
    with torch.inference_mode():
        ref = pair.draft.generate(
            prompt[None],
            attention_mask=torch.ones_like(prompt[None]),
            do_sample=False,
            max_new_tokens=4,
            pad_token_id=0,
        )[0, prompt.numel() :]
    assert tree.is_chain() and tree.tokens.tolist() == ref.tolist() and tree.draft_probs is None

    # sampled chain returns the q rows it sampled from
    prop.setup(temperature=1.0, top_p=0.9, generator=torch.Generator().manual_seed(0))
    prop.begin(prompt, out)
    tree = prop.propose(prompt)
    assert tree.draft_probs is not None and tree.draft_probs.shape == (4, vocab)
    torch.testing.assert_close(tree.draft_probs.sum(-1), torch.ones(4))
    assert all(tree.draft_probs[i, t] > 0 for i, t in enumerate(tree.tokens.tolist()))

    # dynamic tree: root children are the draft's top-k next tokens, in order
    prop = DraftModelProposer(pair.draft, vocab, mode="tree", tree_depth=3, tree_top_k=3, tree_total_tokens=7)
    prop.begin(prompt, out)
    tree = prop.propose(prompt)
    assert len(tree) == 7 and tree.max_depth() <= 3 and tree.draft_probs is None
    with torch.inference_mode():
        top3 = pair.draft(prompt[None]).logits[0, -1].topk(3).indices.tolist()
    roots = [t for t, p in zip(tree.tokens.tolist(), tree.parents, strict=True) if p == -1]
    assert roots == top3[: len(roots)] and roots[0] == top3[0]
    # tree children of the best root node match the draft's prediction after that token
    first = tree.parents.index(-1)
    kids = [t for t, p in zip(tree.tokens.tolist(), tree.parents, strict=True) if p == first]
    if kids:
        with torch.inference_mode():
            nxt = pair.draft(torch.cat([prompt, torch.tensor([roots[0]])])[None]).logits[0, -1].argmax().item()
        assert kids[0] == nxt
