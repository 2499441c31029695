"""Train the *peer* EAGLE-3 drafter with speculators' own trainer on our synth data, at our budget.

    python scripts/bench_peer.py [--runs-root runs] [--synth-dir <runs>/quickstart/synth] [--steps 150 --batch-rows 8]
        [--lr 1e-3 --warmup 10 --ttt-steps 3 --draft-vocab 8192 --layers 2,15,27 --seed 0]
        [--optimizer muon|adamw] [--attn sdpa|eager] [--precision float32|bfloat16] [--out <runs>/peer/<name>]
        [--judge RUN_NAME]

``<runs>`` is ``--runs-root`` (default ``$RUNS_ROOT``, else ``runs``). Needs a finished stage synth in
``--synth-dir`` (the default one is made by ``python -m train stage=synth experiment=quickstart runs_root=<runs>``);
the script stops at once, naming that command, without it.

The peer is what ``speculators train --speculator-type eagle3`` (speculators 0.9.0) makes; it is set against
our ``drafter=eagle3`` at an equal budget: the same target, the same training rows, the *same micro-batches in
the same order* (``train.batches.BatchPlan`` with ``--seed`` and ``--bucket-size``, exactly what ``stage=train``
draws), ``--steps`` optimizer steps, cosine LR with ``--warmup`` warm-up steps. speculators (with vLLM and its
own torch) lives only in the engine venv (``scripts/engine_env.sh``: ``.venv-engine``), so the script runs in
three parts:

1. Here (project interpreter): read the synth rows as ``stage=train`` does (``train.batches.load_rows``: the
   ``data/chunk-*.parquet`` rows with a target-written token, truncated to ``--max-seq-len``), plan the batches,
   load the target the synth data was made with (checked by fingerprint) and write the verifier hidden states
   for every row the plan uses, in the file layout speculators' ``FileTransfer`` reads: ``hs_<i>.safetensors``
   with ``token_ids`` int64 ``[L]`` and ``hidden_states`` ``[L, len(layers) + 1, H]``. Layer ``k`` of
   ``--layers`` is HF ``hidden_states[k]`` (vLLM's aux layer ``k``: the output of ``k`` decoder layers); the
   extra last entry is the *pre-norm* output of the last decoder layer (captured by a hook on the final norm;
   HF's own ``hidden_states[-1]`` is post-norm), which is what vLLM's ``extract_hidden_states`` writes and what
   speculators feeds to its frozen ``verifier_norm`` + ``verifier_lm_head`` to make the KL targets. Why not
   speculators' own data generation: it needs a vLLM server with the hidden-states KV connector, which is too
   heavy for a 2-core CPU; the HF forward here is the fp32 forward our own ``stage=features`` runs, so both
   drafters learn from the same numbers.
2. ``.venv-engine/bin/python -c <helper> job.json`` (the helper is the ``PEER_HELPER`` string below): build
   speculators' dataset (``input_ids``/``loss_mask``/``seq_len``, torch format: its "speculator-format rows"),
   ``token_freq.pt`` with speculators' ``save_token_frequency_distribution`` (d2t/t2d are then built by its
   trainer from that file), resolve the config through ``TrainConfig.resolve(argv)`` (the ``speculators train``
   CLI) and run ``speculators.train.cli.main`` -- its model construction, loss, optimizers, scheduler, gradient
   clipping (1.0, fixed in its trainer) and checkpointer. Its defaults are kept: 1 Llama decoder layer,
   ``norm_before_fc``/``norm_output``/``norm_before_residual`` on, KL loss over all positions' draft-vocabulary
   logits (masked by ``loss_mask``), ``ttt_step_loss_decay=1.0``, a frozen ``lm_head`` (the verifier's rows of
   the draft vocabulary; only ``fc``, the decoder layer and the norms train), Muon (``--optimizer adamw`` for
   AdamW) with weight decay 0.1 (Muon) / 0.01 (AdamW), checkpoint in bf16. The CPU patches, all inside the
   helper (the venv is not touched):

   * ``Trainer``: ``get_local_rank`` returns ``"cpu"`` (it moves the model and batches with ``.to(0)``, i.e.
     ``cuda:0``), autocast runs as ``device_type="cpu"`` (it assumes ``"cuda"`` without an accelerator; with
     fp32 hidden states autocast is a no-op, its warning is silenced) and ``_StepTimer`` stops calling
     ``torch.accelerator.synchronize`` (it raises without an accelerator).
   * Muon: ``torch.optim._muon._zeropower_via_newtonschulz`` runs the same Newton-Schulz iteration in fp32
     (torch's runs it in bf16, which a CPU without native bf16 matmul emulates: ~28 s a step on 2 cores).
   * Data loader: ``create_train_val_loaders`` is replaced by one over speculators' own ``ArrowDataset`` +
     ``CollateFn`` whose batch sampler is our batch plan (instead of its token-packing multipack sampler), no
     worker processes, no pinned memory, no validation split; the packed length of each batch is the sum of
     its rows' lengths instead of a fixed ``--total-seq-len`` padding.
   * Config choices, not code: ``--loss-implementation eager`` (the fused loss is a Triton GPU kernel),
     ``--hidden-states-dtype`` from ``--precision`` (the dtype of the hidden states it reads and of its autocast;
     master weights stay fp32): ``float32`` by default here, ``bfloat16`` is speculators' own default and what
     ``scripts/bench_vs_peer.py`` passes when our run trained in a bf16 autocast, so both sides compute in the
     same precision; ``--draft-attn-impl sdpa`` (or ``eager``: speculators' options for
     hardware without flex attention; its default ``simple_flex_attention`` has no backward on CPU),
     ``--full-attention-indices 0`` (speculators makes every draft layer a 2048-token sliding window by default;
     all our rows are shorter, so the math is the same and the config stays a plain full-attention layer),
     ``--epochs 1 --max-steps N``, ``--num-workers 0``, ``--on-missing raise``.

   The helper copies the epoch checkpoint (``config.json``, ``config.py``, ``model.safetensors``; no optimizer
   state) into ``--out`` and checks it loads with ``Eagle3DraftModel.from_pretrained(out)``, with one forward on
   the first batch. ``--out/trainer`` keeps speculators' ``run.yaml``/``train_command.txt`` (and its
   ``speculators.patch`` provenance file: a diff of the working tree), the epoch checkpoint itself only with
   ``--keep-trainer-dir``.
3. Here again: import the checkpoint with our importer (``train.export.core.get_format("eagle3",
   "speculators").load``) against the target (reported, not fatal: it refuses norm flags it has no math for).

Measured (``--out``/``peer.json``): ``hidden_states_seconds`` (part 1), ``train_seconds`` (speculators'
``train_epoch`` loop: data loading, forward, backward, clipping, optimizer and scheduler steps; not model
building or checkpoint writing), ``tokens_per_s`` = row tokens (sum of the rows' lengths, as ``stage=train``
counts ``seq_tokens``) / ``train_seconds``, ``peer_process_seconds`` (the whole helper), the loss curve
(first/last/min, mean of the last 10 steps, every ``--log-every`` steps) and the last step's per-TTT-step
accuracies, plus the resolved speculators config (``trainer/run.yaml``). speculators attends over the whole
packed batch with a document mask, so (with dense sdpa/eager masks on CPU) a step costs quadratically in the
batch's total length, and its logits and KL run over every position, not only the supervised ones.
"""

from __future__ import annotations

import argparse
import json
import logging
import os
import shutil
import statistics
import subprocess
import sys
import time
from dataclasses import fields
from pathlib import Path
from typing import Any

sys.path.insert(0, str(Path(__file__).resolve().parent.parent))
from train.omp import set_default_wait

set_default_wait()  # OpenMP threads wait as the CLI has them (train/omp.py), set before torch loads

import torch  # noqa: E402

REPO = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(REPO))

logger = logging.getLogger("bench_peer")

ENGINE_PYTHON = REPO / ".venv-engine" / "bin" / "python"
ATTN_IMPLS = ("sdpa", "eager")  # speculators' flex attention has no backward on CPU
PRECISIONS = ("float32", "bfloat16")  # speculators refuses float16 (it would need gradient scaling)

PEER_HELPER = r"""
import json, logging, shutil, sys, time, warnings
from pathlib import Path

job = json.loads(Path(sys.argv[1]).read_text(encoding="utf-8"))
import torch

torch.set_num_threads(job["threads"])
import datasets
import torch.optim._muon as _muon
from torch.utils.data import DataLoader

from importlib.metadata import version

from speculators.train import cli
from speculators.train import data as sdata
from speculators.train import trainer as strainer
from speculators.train.config import TrainConfig
from speculators.train.vocab_mapping import save_token_frequency_distribution

log = logging.getLogger("bench_peer.helper")
out, data_path, save_path = Path(job["out"]), Path(job["data_path"]), Path(job["save_path"])
STATE = {"train_seconds": 0.0, "steps": [], "trainer": None, "loader": None}

# speculators' dataset: speculator-format rows, torch format, plus the token frequencies its trainer turns into
# d2t/t2d (save_token_frequency_distribution counts loss-masked tokens).
rows = json.loads(Path(job["rows_path"]).read_text(encoding="utf-8"))
ds = datasets.Dataset.from_dict(
    {"input_ids": [r[0] for r in rows], "loss_mask": [r[1] for r in rows], "seq_len": [len(r[0]) for r in rows]}
)
ds.set_format(type="torch")
ds.save_to_disk(str(data_path))
save_token_frequency_distribution(ds, data_path / "token_freq.pt")

# -- CPU patch 1: the trainer puts the model and batches on "cpu" (not .to(0) = cuda:0), autocasts as "cpu".
strainer.get_local_rank = lambda: "cpu"
warnings.filterwarnings("ignore", message=".*autocast.*")
warnings.filterwarnings("ignore", message=".*pin_memory.*")


class CpuTrainer(strainer.Trainer):
    def __init__(self, *args, **kwargs):
        super().__init__(*args, **kwargs)
        self.device_type = "cpu"
        STATE["trainer"] = self

    def train_epoch(self, epoch, *, step_callback=None):
        t0 = time.perf_counter()
        super().train_epoch(epoch, step_callback=step_callback)
        STATE["train_seconds"] += time.perf_counter() - t0


cli.Trainer = CpuTrainer


# -- CPU patch 2: the step timer without torch.accelerator.synchronize (it raises without an accelerator).
def _mark(self, name):
    if self.enabled:
        self._marks[name] = time.perf_counter()


def _now(self):
    return time.perf_counter() if self.enabled else None


strainer._StepTimer.mark = _mark
strainer._StepTimer.now = _now


# -- CPU patch 3: torch's Muon runs Newton-Schulz in bf16, which a CPU without native bf16 matmul emulates (~14 s
# a step here); the same iteration in fp32: the project's own (train/optim.py imports only torch, so the engine
# venv's torch runs it from the repository).
sys.path.insert(0, job["repo"])
from train.optim import orthogonalise


def _newton_schulz_fp32(grad, ns_coefficients, ns_steps, eps):
    return orthogonalise(grad, ns_steps, torch.float32, coefficients=tuple(ns_coefficients), eps=eps)


_muon._zeropower_via_newtonschulz = _newton_schulz_fp32


# -- CPU patch 4: speculators' ArrowDataset + CollateFn over our batch plan (no workers, no pinning, no val split),
# each batch packed to the sum of its rows' lengths (after shift_batch drops one token per row).
class PlanCollate(sdata.CollateFn):
    def __call__(self, batch):
        self.max_len = max(1, sum(int(b["input_ids"].shape[0]) - 1 for b in batch if isinstance(b, dict)))
        return super().__call__(batch)


def create_loaders(*, data_path, hidden_states_dtype, transfer, hidden_size, num_target_layers, preprocess, **_):
    dataset = sdata.ArrowDataset(
        max_len=job["max_seq_len"],
        datapath=data_path,
        transfer=transfer,
        on_missing="raise",
        train_ratio=1.0,
        split="train",
        hidden_states_dtype=hidden_states_dtype,
    )
    collate = PlanCollate(1, hidden_size, num_target_layers, hidden_states_dtype, preprocess)
    loader = DataLoader(dataset, batch_sampler=job["batches"], num_workers=0, collate_fn=collate)
    STATE["loader"] = loader
    return loader, None


cli.create_train_val_loaders = create_loaders


# Per-step metrics: speculators logs a dict per step to "speculators.metrics"; keep them, print a short line.
class Capture(logging.Handler):
    def emit(self, record):
        msg = record.msg
        if not (isinstance(msg, dict) and "train" in msg):
            return
        step = int(msg["global_step"]) + 1
        m = {k: float(v) for k, v in msg["train"].items()}
        prof = msg.get("profile") or {}
        STATE["steps"].append({"step": step, "lr": msg.get("lr"), "step_ms": prof.get("step_ms"), **m})
        if step % job["log_every"] == 0 or step == job["steps"] or step == 1:
            print(
                f"[peer] step {step}/{job['steps']} loss {m.get('loss', float('nan')):.4f} "
                f"full_acc_0 {m.get('full_acc_0', float('nan')):.3f} step {prof.get('step_ms', 0):.0f} ms "
                f"(fwd {prof.get('fwd_ms', 0):.0f} bwd {prof.get('bwd_ms', 0):.0f} opt {prof.get('opt_ms', 0):.0f})",
                flush=True,
            )


_setup_metric_logger = cli.setup_metric_logger


def setup_metric_logger(*args, **kwargs):
    _setup_metric_logger(*args, **kwargs)
    metrics = logging.getLogger("speculators.metrics")
    metrics.addHandler(Capture())
    metrics.propagate = False  # the per-step dicts would flood the console


cli.setup_metric_logger = setup_metric_logger

cfg = TrainConfig.resolve(job["argv"])
t0 = time.perf_counter()
cli.main(cfg)
main_seconds = time.perf_counter() - t0

# The epoch checkpoint (speculators format, bf16) -> out, without optimizer/scheduler state.
ckpt = save_path / "0"
copied = []
for f in sorted(ckpt.iterdir()):
    if f.is_file() and not f.name.startswith(("optimizer", "scheduler", "training_state")):
        shutil.copy2(f, out / f.name)
        copied.append(f.name)

from speculators.models.eagle3 import Eagle3DraftModel

verify = {}
try:
    model = Eagle3DraftModel.from_pretrained(str(out))
    verify["load"] = "ok"
    verify["parameters"] = sum(p.numel() for p in model.parameters())
    verify["dtype"] = str(next(model.parameters()).dtype)
    # The attention implementation is not saved (speculators re-applies its flag when it loads a draft, and the
    # default flex attention needs whole 128-token blocks): the forward check uses the one training used.
    config = Eagle3DraftModel.config_class.from_pretrained(str(out))
    config.transformer_layer_config._attn_implementation = cfg.draft.draft_attn_impl
    model = Eagle3DraftModel.from_pretrained(str(out), config=config).float().eval()
    batch = next(iter(STATE["loader"]))
    kwargs = STATE["trainer"].config.train_call_kwargs or {}
    with torch.no_grad():
        _, loss, metrics = model(**batch, **kwargs)
    verify["first_batch_loss"] = float(loss)
    verify["first_batch_full_acc_0"] = float(metrics["full_acc_0_sum"] / metrics["full_acc_0_total"])
except Exception as exc:  # reported, the caller decides
    verify["load"] = f"failed: {type(exc).__name__}: {exc}"

trained = STATE["trainer"].model
result = {
    "trainable_parameters": sum(p.numel() for p in trained.parameters() if p.requires_grad),
    "speculators_version": version("speculators"),
    "torch_version": torch.__version__,
    "threads": torch.get_num_threads(),
    "train_seconds": STATE["train_seconds"],
    "main_seconds": main_seconds,
    "steps": STATE["steps"],
    "checkpoint_files": copied,
    "verify": verify,
    "config": json.loads(cfg.model_dump_json()),
}
Path(job["result_path"]).write_text(json.dumps(result, indent=1), encoding="utf-8")
"""


def parse_args() -> argparse.Namespace:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument(
        "--runs-root",
        default=os.environ.get("RUNS_ROOT", "runs"),
        help="<runs>: the runs root of the default paths and of --judge (default $RUNS_ROOT, else runs)",
    )
    ap.add_argument("--synth-dir", default=None, help="stage synth output (default <runs>/quickstart/synth)")
    ap.add_argument("--steps", type=int, default=150, help="optimizer steps")
    ap.add_argument("--batch-rows", type=int, default=8, help="rows per step (our train.micro_batch_size)")
    ap.add_argument("--lr", type=float, default=1e-3, help="learning rate (Muon and AdamW groups alike)")
    ap.add_argument("--warmup", type=int, default=10, help="cosine schedule warm-up steps")
    ap.add_argument("--ttt-steps", type=int, default=3, help="training-time-test steps")
    ap.add_argument("--draft-vocab", type=int, default=8192, help="draft vocabulary size")
    ap.add_argument("--layers", default="2,15,27", help="verifier layers (HF hidden_states indices)")
    ap.add_argument("--seed", type=int, default=0, help="batch order (as stage=train's seed) and speculators' seed")
    ap.add_argument("--bucket-size", type=int, default=64, help="our train.bucket_size (batch plan)")
    ap.add_argument("--max-seq-len", type=int, default=768, help="our train.max_seq_len (rows are cut to it)")
    ap.add_argument("--optimizer", choices=("muon", "adamw"), default="muon", help="speculators' optimizer")
    ap.add_argument("--attn", choices=ATTN_IMPLS, default="sdpa", help="speculators' --draft-attn-impl")
    ap.add_argument(
        "--precision",
        choices=PRECISIONS,
        default="float32",
        help="speculators' --hidden-states-dtype: its autocast and hidden-state dtype (bfloat16 is its own default)",
    )
    ap.add_argument("--threads", type=int, default=0, help="torch threads (0: all cores)")
    ap.add_argument("--log-every", type=int, default=10, help="print (and keep in peer.json) every N steps")
    ap.add_argument("--out", default=None, help="output directory (default <runs>/peer/<name>)")
    ap.add_argument("--overwrite", action="store_true", help="replace an existing --out")
    ap.add_argument("--keep-trainer-dir", action="store_true", help="keep speculators' epoch checkpoint (+optimizer)")
    ap.add_argument("--engine-python", default=str(ENGINE_PYTHON), help="the interpreter that has speculators")
    ap.add_argument(
        "--judge", default=None, help="also save the peer as our checkpoint <runs>/<JUDGE>/train/best (for stage=eval)"
    )
    args = ap.parse_args()
    args.synth_dir = args.synth_dir or str(Path(args.runs_root) / "quickstart" / "synth")
    if args.steps < 1 or args.batch_rows < 1 or args.warmup < 0 or args.ttt_steps < 1:
        ap.error("--steps, --batch-rows and --ttt-steps must be >= 1, --warmup >= 0")
    return args


def default_name(args: argparse.Namespace) -> str:
    bf16 = "_bf16" if args.precision == "bfloat16" else ""
    return f"{Path(args.synth_dir).parent.name}_s{args.steps}_b{args.batch_rows}_{args.optimizer}{bf16}_seed{args.seed}"


def target_config(synth_manifest: dict[str, Any]) -> Any:
    """The target config the synth data was made with (from its manifest)."""
    from data.config import TargetConfig

    saved = synth_manifest["config"]["target"]
    names = {f.name for f in fields(TargetConfig)}
    return TargetConfig(**{k: v for k, v in saved.items() if k in names})


def plan_batches(rows: list[Any], args: argparse.Namespace, pad_id: int) -> list[list[int]]:
    """Row indices of each step, exactly as ``stage=train`` draws them (one process, no accumulation)."""
    from train.batches import BatchPlan

    plan = BatchPlan(rows, args.batch_rows, args.bucket_size, args.seed, pad_id)
    return [list(plan.indices(i)) for i in range(args.steps)]


def write_hidden_states(target: Any, rows: list[Any], used: list[int], layers: list[int], hs_dir: Path) -> int:
    """``hs_<i>.safetensors`` for each used row ``i``: aux layers + the pre-norm last layer; returns the tokens."""
    from safetensors.torch import save_file

    model = target.model
    final_norm = model.base_model.norm
    captured: dict[str, torch.Tensor] = {}
    hook = final_norm.register_forward_pre_hook(lambda _m, a: captured.__setitem__("pre_norm", a[0]))
    hs_dir.mkdir(parents=True, exist_ok=True)
    tokens = 0
    try:
        for n, i in enumerate(used, 1):
            ids = torch.tensor([rows[i].input_ids], device=target.device)
            with torch.inference_mode():
                hs = model(input_ids=ids, output_hidden_states=True, use_cache=False).hidden_states
            stack = torch.stack([hs[k][0] for k in layers] + [captured["pre_norm"][0]], dim=1)
            save_file(
                {"hidden_states": stack.float().cpu().contiguous(), "token_ids": ids[0].cpu().to(torch.int64)},
                str(hs_dir / f"hs_{i}.safetensors"),
            )
            tokens += ids.shape[1]
            if n % 25 == 0 or n == len(used):
                logger.info("hidden states: %d/%d rows", n, len(used))
    finally:
        hook.remove()
    return tokens


def loss_summary(steps: list[dict[str, Any]], every: int) -> dict[str, Any]:
    losses = [s["loss"] for s in steps if "loss" in s]
    if not losses:
        return {}
    last = steps[-1]
    return {
        "first": losses[0],
        "last": losses[-1],
        "min": min(losses),
        "mean_last_10": statistics.fmean(losses[-10:]),
        "curve": [[s["step"], round(s["loss"], 5)] for s in steps if s["step"] % every == 0 or s in (steps[0], last)],
        "last_step": {k: v for k, v in last.items() if k.startswith(("full_acc", "cond_acc", "loss_"))},
    }


def import_check(
    out: Path, target: Any, judge: str | None = None, train_seconds: float = 0.0, runs_root: str | Path = "runs"
) -> str:
    """Our importer on the peer checkpoint: "ok: ..." or why it refused. With ``judge``, the imported head is also
    saved as our own EAGLE-3 checkpoint in ``<runs_root>/<judge>/train/best`` (fp32, its norm flags, layers and
    d2t), so that ``python -m train stage=eval run_name=<judge> drafter=eagle3 eval.mode=replay runs_root=<runs_root>``
    judges the peer on exactly the held-out prompts and with the decoder every one of our runs is judged with."""
    from train.drafters.eagle3 import Eagle3Config, save
    from train.export.core import get_format

    try:
        head = get_format("eagle3", "speculators").load(out, target)
    except Exception as exc:  # reported, not fatal: the importer refuses math it does not have
        return f"failed: {type(exc).__name__}: {exc}"
    if judge:
        run = Path(runs_root) / judge / "train"
        cfg = Eagle3Config(layer_ids=list(head.layer_ids), draft_vocab_size=head.draft_vocab_size, **head.norms)
        save(head.float(), str(run / "best"), cfg)
        manifest = {"stage": "train", "peer": str(out), "result": {"seconds": train_seconds, "steps": 0}}
        manifest["result"]["trainable_parameters"] = 0
        (run / "manifest.json").write_text(json.dumps(manifest, indent=1), encoding="utf-8")
        logger.info("peer saved as our checkpoint %s: judge it with stage=eval run_name=%s", run / "best", judge)
    return f"ok: {type(head).__name__}, {sum(p.numel() for p in head.parameters())} parameters"


def main() -> None:
    args = parse_args()
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s")
    t_start = time.perf_counter()
    threads = args.threads or os.cpu_count() or 1
    torch.set_num_threads(threads)
    engine = Path(args.engine_python)
    if not engine.is_file():
        raise SystemExit(f"{engine} not found: build the engine venv with scripts/engine_env.sh")

    from data.manifest import read_manifest
    from data.target import load_target
    from train.batches import load_rows

    synth_dir = Path(args.synth_dir)
    if not (synth_dir / "manifest.json").is_file():
        raise SystemExit(
            f"{synth_dir / 'manifest.json'} not found: --synth-dir needs a finished stage synth (the default one: "
            f"python -m train stage=synth experiment=quickstart runs_root={args.runs_root})"
        )
    synth = read_manifest(synth_dir / "manifest.json")
    out = Path(args.out or Path(args.runs_root) / "peer" / default_name(args))
    if out.exists() and any(out.iterdir()):
        if not args.overwrite:
            raise SystemExit(f"{out} is not empty: pass --overwrite to replace it, or another --out")
        shutil.rmtree(out)
    out.mkdir(parents=True, exist_ok=True)

    target = load_target(target_config(synth))
    if synth["target"]["fingerprint"] != target.fingerprint:
        raise SystemExit(f"{synth_dir} was made by another target ({synth['target']['fingerprint']})")
    n_layers = int(target.model.config.num_hidden_layers)
    layers = [int(x) for x in args.layers.split(",") if x.strip()]
    if not layers or min(layers) < 0 or max(layers) > n_layers or len(set(layers)) != len(layers):
        raise SystemExit(f"--layers {args.layers}: need distinct ids in [0, {n_layers}]")

    rows = load_rows(synth_dir, args.max_seq_len)
    batches = plan_batches(rows, args, target.tokenizer.pad_token_id)
    used = sorted({i for b in batches for i in b})
    row_tokens = sum(len(rows[i].input_ids) for b in batches for i in b)
    logger.info(
        "%d training rows, %d used by %d steps x %d rows (%d row tokens)",
        len(rows),
        len(used),
        args.steps,
        args.batch_rows,
        row_tokens,
    )

    data_dir = out / "data"
    t0 = time.perf_counter()
    hs_tokens = write_hidden_states(target, rows, used, layers, data_dir / "hidden_states")
    hs_seconds = time.perf_counter() - t0
    logger.info("hidden states: %d rows, %d tokens in %.1f s", len(used), hs_tokens, hs_seconds)

    rows_path = data_dir / "rows.json"
    rows_path.write_text(json.dumps([[r.input_ids, r.loss_mask] for r in rows]), encoding="utf-8")
    save_path = out / "trainer"
    argv = [
        "--speculator-type", "eagle3",
        "--verifier-name-or-path", str(target.path),
        "--data-path", str(data_dir / "dataset"),
        "--hidden-states-path", str(data_dir / "hidden_states"),
        "--token-freq-path", str(data_dir / "dataset" / "token_freq.pt"),
        "--save-path", str(save_path),
        "--log-dir", str(out / "logs"),
        "--target-layer-ids", *[str(x) for x in layers],
        "--draft-vocab-size", str(args.draft_vocab),
        "--ttt-steps", str(args.ttt_steps),
        "--optimizer", args.optimizer,
        "--lr", str(args.lr),
        "--scheduler-type", "cosine",
        "--scheduler-warmup-steps", str(args.warmup),
        "--scheduler-total-steps", str(args.steps),
        "--max-steps", str(args.steps),
        "--epochs", "1",
        "--seed", str(args.seed),
        "--hidden-states-dtype", args.precision,
        "--loss-implementation", "eager",
        "--draft-attn-impl", args.attn,
        "--full-attention-indices", "0",
        "--num-workers", "0",
        "--on-missing", "raise",
        "--log-freq", "1",
        "--no-resume-from-checkpoint",
    ]  # fmt: skip
    job = {
        "argv": argv,
        "out": str(out),
        "data_path": str(data_dir / "dataset"),
        "save_path": str(save_path),
        "rows_path": str(rows_path),
        "result_path": str(out / "peer_train.json"),
        "batches": batches,
        "steps": args.steps,
        "max_seq_len": args.max_seq_len,
        "threads": threads,
        "log_every": args.log_every,
        "repo": str(REPO),
    }
    job_path = out / "job.json"
    job_path.write_text(json.dumps(job), encoding="utf-8")

    env = {k: v for k, v in os.environ.items() if k not in ("LOCAL_RANK", "RANK", "WORLD_SIZE", "PYTHONPATH")}
    env.update(OMP_NUM_THREADS=str(threads), OMP_WAIT_POLICY="PASSIVE", TOKENIZERS_PARALLELISM="false")
    logger.info("speculators trainer: %s -c <helper> %s", engine, job_path)
    t0 = time.perf_counter()
    proc = subprocess.run([str(engine), "-c", PEER_HELPER, str(job_path)], env=env, check=False)
    peer_seconds = time.perf_counter() - t0
    if proc.returncode != 0:
        raise SystemExit(f"speculators trainer failed (exit {proc.returncode}) after {peer_seconds:.1f} s")
    peer = json.loads((out / "peer_train.json").read_text(encoding="utf-8"))
    if not args.keep_trainer_dir:  # the weights are in --out; keep run.yaml and train_command.txt
        shutil.rmtree(save_path / "0")
        for link in save_path.glob("epoch0_*"):
            link.unlink()

    importer = import_check(out, target, args.judge, float(peer["train_seconds"]), args.runs_root)
    logger.info("our importer: %s", importer)
    train_s = float(peer["train_seconds"])
    result = {
        "command": [sys.executable, *sys.argv],
        "synth_dir": str(synth_dir),
        "synth_plan": synth.get("plan_hash"),
        "target": {"path": str(target.path), "fingerprint": target.fingerprint},
        "budget": {
            "steps": args.steps,
            "batch_rows": args.batch_rows,
            "lr": args.lr,
            "warmup": args.warmup,
            "scheduler": "cosine",
            "ttt_steps": args.ttt_steps,
            "draft_vocab": args.draft_vocab,
            "layers": layers,
            "optimizer": args.optimizer,
            "attn": args.attn,
            "precision": args.precision,
            "seed": args.seed,
            "bucket_size": args.bucket_size,
            "max_seq_len": args.max_seq_len,
        },
        "rows": {"train": len(rows), "used": len(used), "row_tokens": row_tokens},
        "timings": {
            "hidden_states_seconds": round(hs_seconds, 2),
            "train_seconds": round(train_s, 2),
            "tokens_per_s": round(row_tokens / max(train_s, 1e-9), 1),
            "seconds_per_step": round(train_s / max(len(peer["steps"]), 1), 3),
            "peer_process_seconds": round(peer_seconds, 2),
            "total_seconds": round(time.perf_counter() - t_start, 2),
            "threads": peer["threads"],
        },
        "steps_done": len(peer["steps"]),
        "loss": loss_summary(peer["steps"], args.log_every),
        "verify": {"speculators_from_pretrained": peer["verify"], "draftsmith_import": importer},
        "checkpoint_files": peer["checkpoint_files"],
        "trainable_parameters": peer["trainable_parameters"],
        "versions": {"speculators": peer["speculators_version"], "engine_torch": peer["torch_version"]},
        "speculators_config": peer["config"],
    }
    (out / "peer.json").write_text(json.dumps(result, indent=1), encoding="utf-8")
    logger.info(
        "peer: %d steps in %.1f s (%.1f row tokens/s), loss %.4f -> %.4f; wrote %s",
        len(peer["steps"]),
        train_s,
        result["timings"]["tokens_per_s"],
        result["loss"].get("first", float("nan")),
        result["loss"].get("last", float("nan")),
        out / "peer.json",
    )


if __name__ == "__main__":
    main()
