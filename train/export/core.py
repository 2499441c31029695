"""The export machinery shared by every format: the (family, format) table, tensor checks, provenance, model card.

An exporter never writes a checkpoint it has not checked: the tensors are checked against the format's
required names and shapes before anything is written, the files are written into a temporary directory,
read back and checked again, re-imported by the project and compared with the trained drafter (same draft
logits), and only then renamed onto ``export.out_dir`` (:func:`data.atomic.atomic_dir`).
"""

from __future__ import annotations

import importlib
import json
import logging
import time
from collections.abc import Callable, Mapping
from dataclasses import asdict, dataclass, field, is_dataclass
from pathlib import Path
from typing import Any, TypeVar

import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from data.config import ConfigError
from train.drafters import registry
from train.drafters.layers import draft_layer_config

logger = logging.getLogger(__name__)

Shapes = dict[str, tuple[int, ...]]
"""Tensor name -> shape."""
T = TypeVar("T")


class ExportError(ConfigError):
    """An export was refused: a required tensor is missing, a shape is wrong, or the re-import differs. A user error
    (a drafter that cannot be written in the asked format): the CLI ends it as ``error: ...``, exit 2."""


@dataclass
class Source:
    """What an exporter works from: the trained drafter, the target it was trained for, and the run's records."""

    drafter_dir: Path
    family: str
    module: torch.nn.Module
    """The trained drafter as the family loads it."""
    drafter_cfg: Any
    target: Any
    """``data.target.Target`` (model, tokenizer, path, fingerprint)."""
    target_name: str
    train_manifest: dict[str, Any] | None = None
    eval_metrics: dict[str, Any] | None = None
    eval_table: str | None = None
    extra: dict[str, Any] = field(default_factory=dict)
    deploy_report: dict[str, Any] | None = None
    """``deploy.json`` of a stage deploy of this drafter: its serving advice goes into the model card."""

    @property
    def target_config(self) -> Any:
        return self.target.model.config

    def provenance(self, fmt: str) -> dict[str, Any]:
        """The ``draftsmith`` block every exported ``config.json`` carries."""
        cfg = asdict(self.drafter_cfg) if is_dataclass(self.drafter_cfg) else dict(self.drafter_cfg or {})
        train = self.train_manifest or {}
        return {
            "drafter": cfg,
            "export_format": fmt,
            "target": {
                "name": self.target_name,
                "path": str(self.target.path),
                "fingerprint": self.target.fingerprint,
            },
            "trained": {
                "steps": (train.get("result") or {}).get("steps"),
                "git_commit": train.get("git_commit"),
                "written_at": train.get("written_at"),
            },
        }


Dim = int | str
"""One dimension of a required shape: a number, or a symbol of the dims a format resolves (``"H"``, ``"V"``...)."""
ShapeTable = dict[str, tuple[Dim, ...]]
"""A format's required tensors as data: tensor name -> symbolic shape (resolved by :func:`shapes`)."""


def shapes(table: ShapeTable, dims: Mapping[str, int], prefix: str = "") -> Shapes:
    """Resolve a :data:`ShapeTable` against ``dims`` (every name gets ``prefix``)."""
    return {prefix + name: tuple(d if isinstance(d, int) else dims[d] for d in shape) for name, shape in table.items()}


LLAMA_LAYER: ShapeTable = {
    "self_attn.q_proj.weight": ("q", "A"),
    "self_attn.k_proj.weight": ("kv", "A"),
    "self_attn.v_proj.weight": ("kv", "A"),
    "self_attn.o_proj.weight": ("H", "q"),
    "mlp.gate_proj.weight": ("I", "H"),
    "mlp.up_proj.weight": ("I", "H"),
    "mlp.down_proj.weight": ("H", "I"),
    "post_attention_layernorm.weight": ("H",),
}
"""A Llama decoder layer's tensors (no ``input_layernorm``: formats differ there). ``A`` is the attention's input
width: ``H`` for a plain layer, ``2H`` for EAGLE-3's ``[embedding, feature]`` input."""


@dataclass(frozen=True)
class KeyMap:
    """How a family's module names become a format's tensor names, as data, read both ways.

    ``to_file`` drops the module tensors the format does not store (``drop``: name prefixes) and renames the
    first matching ``(module prefix, file prefix)`` of ``rename``; ``to_module`` is its inverse, used by the
    re-importers. A format that stores the module's names as they are has an empty map."""

    rename: tuple[tuple[str, str], ...] = ()
    drop: tuple[str, ...] = ()

    def to_file(self, state: Mapping[str, T]) -> dict[str, T]:
        """Module names -> file names (tensors, or the shapes of a required table)."""
        return {self._map(k, 0, 1): v for k, v in state.items() if not (self.drop and k.startswith(self.drop))}

    def to_module(self, state: Mapping[str, T]) -> dict[str, T]:
        return {self._map(k, 1, 0): v for k, v in state.items()}

    def _map(self, key: str, src: int, dst: int) -> str:
        for pair in self.rename:
            if key.startswith(pair[src]):
                return pair[dst] + key[len(pair[src]) :]
        return key


@dataclass(frozen=True)
class Format:
    """One (drafter family, export format) pair: its weight file and name map (data), and its hooks."""

    family: str
    name: str
    doc: str
    weights: str
    """The safetensors file the weights go into."""
    keys: KeyMap
    """Module names -> this format's tensor names (and back, for the re-importer)."""
    required: Callable[[Source], dict[str, Shapes]]
    """``required(src) -> {file name: {tensor name: shape}}``: every tensor the format must hold (built from
    :data:`ShapeTable` s)."""
    write_config: Callable[[Source, Path], None]
    """``write_config(src, tmp_dir)``: config.json and any other engine files (the weights are written by
    :func:`write_weights`)."""
    load: Callable[[Path, Any], torch.nn.Module]
    """The importer: ``load(export_dir, target) -> the family's module`` (used by the round-trip check)."""
    probe: Callable[[torch.nn.Module, Any], torch.Tensor]
    """``probe(module, target) -> draft logits`` on a fixed input: equal for the trained and re-imported drafter."""
    tensors: Callable[[Source], dict[str, dict[str, torch.Tensor]]] = None  # type: ignore[assignment]
    """``tensors(src) -> {file name: {tensor name: tensor}}``; default: the module's state through :attr:`keys`."""
    check: Callable[[Source, dict[str, torch.Tensor], str], None] | None = None
    """``check(src, weights, where)``: refusals beyond names and shapes, before anything is written."""
    round_trip_atol: float | None = None
    """The round-trip check's bound on |logit difference| for a format that rewrites weights (None: the default
    bound for the same bits, ``train.export.ROUND_TRIP_ATOL``)."""

    def __post_init__(self) -> None:
        if self.tensors is None:
            object.__setattr__(self, "tensors", self.mapped_tensors)

    def mapped_tensors(self, src: Source) -> dict[str, dict[str, torch.Tensor]]:
        """The module's state dict in this format's names."""
        return {self.weights: contiguous(self.keys.to_file(src.module.state_dict()))}

    def write(self, src: Source, out: Path, weights: dict[str, dict[str, torch.Tensor]]) -> None:
        """Check, then write the weight files and the format's config into ``out``."""
        if self.check is not None:
            self.check(src, weights[self.weights], f"{self.family} -> {self.name} export {out}")
        for fname, state in weights.items():
            save_file(state, str(out / fname), metadata={"format": "pt"})
        self.write_config(src, out)

    def read(self, directory: Path) -> dict[str, torch.Tensor]:
        """The re-importer's first step: the written weights, in the module's names."""
        return read_weights(directory, self.weights, self.keys)


def read_weights(directory: Path, fname: str, keys: KeyMap) -> dict[str, torch.Tensor]:
    """A written weight file, renamed back to the module's names through ``keys``."""
    return keys.to_module(load_file(str(directory / fname)))


FORMATS: dict[tuple[str, str], Format] = {}


def target_dims(tcfg: Any) -> dict[str, int]:
    """The sizes every head format is checked against: the target's hidden ``H`` and vocabulary ``V``, and the
    draft layer's MLP ``I`` and q / kv projection widths (``heads x head_dim``, with grouped-query attention), from
    the draft layer config derived from the target (:func:`train.drafters.layers.draft_layer_config`)."""
    d = draft_layer_config(tcfg)
    H, nh, nkv, hd = d.hidden_size, d.num_attention_heads, d.num_key_value_heads, d.head_dim
    return {"H": H, "V": d.vocab_size, "I": d.intermediate_size, "q": nh * hd, "kv": nkv * hd}


LOCAL_CONFIG_KEYS = ("_name_or_path", "_model_name_or_path", "draftsmith", "quantization_config")
"""Keys of a config dict that describe this machine or this run, not the model: never copied into an export."""


def clean_config(config: Any, keep_version: bool = False) -> dict[str, Any]:
    """``config.to_dict()`` without :data:`LOCAL_CONFIG_KEYS` (and without ``transformers_version`` unless
    ``keep_version``: a plain HF directory keeps it, a head config written for an engine does not)."""
    conf = config.to_dict()
    for k in LOCAL_CONFIG_KEYS + (() if keep_version else ("transformers_version",)):
        conf.pop(k, None)
    return conf


def register_format(fmt: Format) -> Format:
    key = (fmt.family, fmt.name)
    if key in FORMATS:
        raise ValueError(f"export format {key} is registered twice")
    FORMATS[key] = fmt
    return fmt


def _load_builtin() -> None:
    """Import the export module of every registered drafter family (each registers its formats)."""
    for name in registry.names():
        module = registry.get(name).export_module
        if module:
            importlib.import_module(module)


def valid_pairs() -> list[tuple[str, str]]:
    _load_builtin()
    return sorted(FORMATS)


def pairs_text() -> str:
    lines = [f"  drafter={f} export.format={n}: {FORMATS[(f, n)].doc}" for f, n in valid_pairs()]
    bare = [name for name in registry.names() if not any(f == name for f, _ in FORMATS)]
    none = [f"  drafter={name}: no export format" for name in bare]
    return "Valid (drafter, format) pairs:\n" + "\n".join(lines + none)


def get_format(family: str, name: str | None) -> Format:
    _load_builtin()
    if not name:
        raise ConfigError(f"export.format is not set.\n{pairs_text()}")
    if (family, name) not in FORMATS:
        own = [n for f, n in valid_pairs() if f == family]
        fits = f"a {family} drafter exports as: {', '.join(f'export={n}' for n in own)}" if own else ""
        raise ConfigError(
            f"No exporter for drafter {family!r} in format {name!r}; {fits or f'{family} has no export format'}.\n"
            f"{pairs_text()}"
        )
    return FORMATS[(family, name)]


def check_tensors(where: str, tensors: Mapping[str, Mapping[str, Any]], required: Mapping[str, Shapes]) -> None:
    """Refuse when a required file or tensor is missing, or a shape differs. ``tensors`` values need ``.shape``."""
    problems: list[str] = []
    for fname, req in required.items():
        have = tensors.get(fname)
        if have is None:
            problems.append(f"file {fname} is missing")
            continue
        missing = [k for k in req if k not in have]
        if missing:
            problems.append(f"{fname}: missing tensors {missing}")
        for k, shape in req.items():
            if k in have and tuple(have[k].shape) != tuple(shape):
                problems.append(f"{fname}: {k} has shape {list(have[k].shape)}, expected {list(shape)}")
    if problems:
        raise ExportError(f"refusing to write {where}:\n  " + "\n  ".join(problems))


class _Shape:
    def __init__(self, shape: list[int]) -> None:
        self.shape = tuple(shape)


def read_shapes(directory: Path, files: list[str]) -> dict[str, dict[str, _Shape]]:
    """Read the tensor names and shapes of written safetensors files (no tensor data is loaded)."""
    out: dict[str, dict[str, _Shape]] = {}
    for fname in files:
        path = directory / fname
        if not path.is_file():
            continue
        with safe_open(str(path), "pt") as fh:
            out[fname] = {k: _Shape(fh.get_slice(k).get_shape()) for k in fh.keys()}  # noqa: SIM118
    return out


def check_safetensors_only(directory: Path) -> None:
    bad = [p.name for p in directory.rglob("*") if p.suffix in (".bin", ".pt", ".pth", ".ckpt", ".pkl")]
    if bad:
        raise ExportError(f"export wrote non-safetensors weight files {bad}; exports are safetensors only")


def contiguous(state: Mapping[str, torch.Tensor]) -> dict[str, torch.Tensor]:
    return {k: v.detach().to("cpu").contiguous() for k, v in state.items()}


def tau_table(metrics: dict[str, Any] | None, table: str | None) -> str:
    if table:
        return table.strip()
    if not metrics:
        return ""
    lines = ["| source | method | tau | alpha_1..3 |", "|---|---|---|---|"]
    for name, per in metrics.get("metrics", {}).items():
        for src, m in per.items():
            al = ", ".join(f"{a:.2f}" for a in (m.get("alpha") or [])[:3]) or "-"
            lines.append(f"| {src} | {name} | {m['tau']:.2f} | {al} |")
    return "\n".join(lines)


def serving_section(report: dict[str, Any] | None) -> list[str]:
    """The model card's lines for stage deploy's advice (none without a deploy of this drafter)."""
    if not report:
        return []
    plan = report.get("plan") or {}
    sched = ", ".join(f"{lo}-{hi}: {k or 'off'}" for lo, hi, k in plan.get("schedule") or [])
    where = f"measured on {report.get('host')} ({report.get('device')}), vLLM {report.get('vllm_version')}"
    conf = report.get("vllm")
    lines = ["", "## Serving (stage deploy)", ""]
    if conf:
        lines.append(
            f"K per batch size, {where}: {sched}. vLLM: `--speculative-config '{json.dumps(conf)}'` (its `model` is "
            "the deploy stage's export; point it at this directory)."
        )
    else:
        lines.append(f"Speculation did not pay at any measured load, {where}: serve the target without it.")
    if report.get("sglang"):
        lines.append(f"SGLang: {report['sglang']}")
    lines.append("Details and the measurements: `deploy.md` of the run's deploy stage.")
    return lines


def model_card(src: Source, fmt: Format, files: list[str]) -> str:
    """``README.md`` of an export: what it is, what it was trained for and on, and its held-out tau."""
    t = src.train_manifest or {}
    conf = t.get("config") or {}
    data, train = conf.get("data") or {}, conf.get("train") or {}
    result = t.get("result") or {}
    sources = ", ".join(
        f"{name} ({s.get('kind')}, weight {s.get('weight')})" for name, s in (data.get("sources") or {}).items()
    )
    micro, accum = train.get("micro_batch_size"), train.get("grad_accum")
    world = result.get("world_size") or 1
    lines = [
        f"# {src.family} drafter for {src.target_name} ({fmt.name} format)",
        "",
        f"{fmt.doc}. Exported by draftsmith (`python -m train stage=export export.format={fmt.name}`) on "
        f"{time.strftime('%Y-%m-%d')}.",
        "",
        "## Target",
        f"- name: `{src.target_name}`; path at export: `{src.target.path}`",
        f"- fingerprint: `{src.target.fingerprint}` (config, vocabulary and weight layout; also in config.json "
        "under `draftsmith.target`). Use this drafter only with this target.",
        "",
        "## Training",
    ]
    if t:
        lines += [
            f"- data: {sources or 'unknown'}; held-out fraction {data.get('heldout_fraction')} "
            f"(split salt `{data.get('split_salt')}`), never trained on",
            f"- synth data: `{(t.get('inputs') or {}).get('synth_dir')}` (target-regenerated answers: "
            f"{(conf.get('synth') or {}).get('regenerate')})",
            f"- budget: {result.get('steps')} optimizer steps x global batch {micro} x {accum} x {world} "
            f"processes, max_seq_len {train.get('max_seq_len')}, lr {train.get('lr')}; "
            f"{result.get('seconds')} s of training",
            f"- drafter config: `{json.dumps(asdict(src.drafter_cfg) if is_dataclass(src.drafter_cfg) else {})}`",
            f"- best checkpoint: {json.dumps(result.get('best'))}",
        ]
    else:
        lines.append("- no train manifest was found beside the drafter directory: training data and budget unknown")
    lines += ["", "## Held-out acceptance (eval stage)"]
    table = tau_table(src.eval_metrics, src.eval_table)
    if table:
        settings = (src.eval_metrics or {}).get("settings") or {}
        lines += [
            "tau = tokens per target forward, bonus token included (plain decoding = 1.00); alpha_i = "
            "P(position i accepted | i-1 accepted). "
            + (
                f"Greedy (temperature {settings.get('temperature')}), {settings.get('max_new_tokens')} new "
                f"tokens, K={settings.get('k')}."
                if settings
                else ""
            ),
            "",
            table,
        ]
    else:
        lines.append("No eval stage results were found for this run (run `stage=eval` before exporting).")
    lines += serving_section(src.deploy_report)
    lines += ["", "## Files", *[f"- `{f}`" for f in sorted(files)], ""]
    return "\n".join(lines)


PROBE_LEN = 24


def probe_ids(vocab: int, n: int = PROBE_LEN) -> torch.Tensor:
    """The fixed token sequence every format's round-trip probe runs on."""
    g = torch.Generator().manual_seed(1234)
    return torch.randint(3, vocab, (1, n), generator=g)


def trained_d2t_hash(src: Source) -> str | None:
    """The hash of the vocabulary map the drafter was trained with (``draftsmith.d2t_hash`` in its config.json), or
    None when it records none."""
    if "d2t_hash" in src.extra:
        return str(src.extra["d2t_hash"])
    conf = Path(src.drafter_dir) / "config.json"
    if not conf.is_file():
        return None
    h = (json.loads(conf.read_text(encoding="utf-8")).get("draftsmith") or {}).get("d2t_hash")
    return None if h is None else str(h)


SPECULATORS_VERSION = "0.9.0"
"""The speculators release whose config layout the ``speculators`` formats write (checked with it in .venv-engine)."""


def speculators_config(src: Source, algorithm: str, speculative_tokens: int) -> dict[str, Any]:
    """speculators' ``speculators_config`` block: a greedy proposal of ``speculative_tokens``, the target as the
    verifier."""
    return {
        "algorithm": algorithm,
        "default_proposal_method": "greedy",
        "proposal_methods": [
            {
                "accept_tolerance": 0.0,
                "proposal_type": "greedy",
                "speculative_tokens": int(speculative_tokens),
                "verifier_accept_k": 1,
            }
        ],
        "verifier": {
            "architectures": list(getattr(src.target_config, "architectures", None) or ["LlamaForCausalLM"]),
            "name_or_path": str(src.target.path),
        },
    }


def read_config(directory: Path) -> dict[str, Any]:
    return json.loads((directory / "config.json").read_text(encoding="utf-8"))


def max_abs_diff(a: torch.Tensor, b: torch.Tensor) -> float:
    return float((a.float() - b.float()).abs().max()) if a.numel() else 0.0
