"""Every shipped config composes; typos fail at start-up and name the valid choices."""

from __future__ import annotations

import re
import subprocess
from pathlib import Path

import pytest

from data.config import ConfigError
from tests import cli
from tests.conftest import CONF, compose
from train.config import Config, check_key_path

GROUPS = sorted(p.name for p in CONF.iterdir() if p.is_dir() and p.name != "experiment")
EXPERIMENTS = sorted(p.stem for p in (CONF / "experiment").glob("*.yaml"))


@pytest.mark.parametrize(
    "override",
    [f"{g}={p.stem}" for g in GROUPS for p in sorted((CONF / g).glob("*.yaml"))]
    + [f"experiment={e}" for e in EXPERIMENTS],
)
def test_every_shipped_config_composes(override: str) -> None:
    extra = []
    if override == "target=hf":
        extra = ["target.path=/models/x"]
    if override == "data=jsonl":
        extra = ["data.sources.mine.paths=[a.jsonl]"]
    cfg = compose([override, *extra])
    assert isinstance(cfg, Config)
    assert cfg.data.sources, override
    if override.startswith("data="):  # a data group selects exactly its own sources
        expected = {
            "sharegpt": {"sharegpt"},
            "humaneval": {"humaneval"},
            "mix": {"sharegpt", "humaneval"},
            "jsonl": {"mine"},
        }[override.split("=")[1]]
        assert set(cfg.data.sources) == expected


def test_quickstart_is_small() -> None:
    cfg = compose(["experiment=quickstart"])
    assert cfg.run_name == "quickstart"
    assert cfg.data.num_prompts is not None and cfg.data.num_prompts <= 200
    assert set(cfg.data.sources) == {"sharegpt", "humaneval"}
    assert cfg.synth.max_new_tokens <= 128
    assert cfg.drafter.name == "eagle3" and cfg.train.ema_decay > 0  # the family and average the README measures
    assert compose(["experiment=quickstart", "drafter=eagle"]).drafter.name == "eagle"  # drafter= still wins


def test_misspelt_key_lists_valid_keys() -> None:
    with pytest.raises(ConfigError) as err:
        check_key_path("synth.max_new_tokenz")
    msg = str(err.value)
    assert "Did you mean 'synth.max_new_tokens'" in msg
    assert "temperature" in msg and "batch_size" in msg


def _cli(*args: str) -> subprocess.CompletedProcess[str]:
    return cli.run(list(args), timeout=120)


def test_cli_typo_fails_at_startup_with_valid_keys() -> None:
    res = _cli("stage=synth", "synth.max_new_tokenz=4")
    assert res.returncode == 2
    assert "Unknown config key 'synth.max_new_tokenz'" in res.stderr
    assert "Valid keys of 'synth'" in res.stderr and "max_new_tokens" in res.stderr


def test_drafter_keys_are_checked_against_the_experiments_drafter() -> None:
    """``experiment=cpu_1h`` (and ``quickstart``) select drafter=eagle3 in their defaults: its keys are valid on the
    command line without ``drafter=eagle3``, and a typo is named against eagle3's keys, not the root default's
    (eagle); no experiment, or ``drafter=eagle``, checks against eagle's keys."""
    from train.__main__ import config_groups, default_drafter, experiment_drafter
    from train.config import check_overrides

    assert experiment_drafter("cpu_1h") == "eagle3" and experiment_drafter("quickstart") == "eagle3"
    assert experiment_drafter("gpu_node") == "eagle3"
    groups = config_groups()

    def check(*ovs: str) -> None:
        check_overrides(list(ovs), groups, default_drafter(list(ovs)))

    check("experiment=cpu_1h", "drafter.loss_on_prompt=true")
    check("experiment=quickstart", "drafter.loss_on_prompt=true")
    check("drafter.init_from_target=true")  # the root default is eagle
    with pytest.raises(ConfigError, match=r"Did you mean 'drafter.loss_on_prompt'"):
        check("experiment=cpu_1h", "drafter.loss_on_promt=true")
    with pytest.raises(ConfigError, match=r"'ttt_steps' is not a key of 'drafter'"):  # eagle has no such key
        check("experiment=quickstart", "drafter=eagle", "drafter.ttt_steps=2")
    check("experiment=cpu_1h", "drafter=eagle", "drafter.init_from_target=true")  # drafter= wins over the experiment's
    res = _cli("stage=synth", "experiment=cpu_1h", "drafter.loss_on_promt=true")
    assert res.returncode == 2 and "Did you mean 'drafter.loss_on_prompt'" in res.stderr


def test_cli_unknown_stage_lists_stages() -> None:
    res = _cli("stage=synthh")
    assert res.returncode == 2
    assert "Unknown stage 'synthh'" in res.stderr
    assert "synth" in res.stderr and "merge" in res.stderr


def test_cli_unknown_launcher_fails_at_startup() -> None:
    res = _cli("stage=synth", "launcher=slurmm")
    assert res.returncode == 2
    assert "Unknown launcher 'slurmm'" in res.stderr and "local, slurm" in res.stderr


def test_cli_bad_value_is_a_message_not_a_traceback(tmp_path: Path) -> None:
    """Values outside their schema bounds, of this stage's keys and of later stages' (and the drafter's), are all
    listed at once with a clear message, exit 2, before any stage does work."""
    res = _cli(
        "stage=synth",
        "synth.top_p=1.5",
        "synth.max_new_tokens=0",
        "eval.k=0",
        "drafter.tree_top_k=0",
        "data.heldout_fraction=1",
        f"hydra.run.dir={tmp_path}",
    )
    assert res.returncode == 2, res.stderr[-2000:]
    assert "error: Invalid config" in res.stderr and "synth.top_p=1.5 must be in (0, 1]" in res.stderr
    for needle in ("synth.max_new_tokens=0 must be >= 1", "eval.k=0 must be >= 1", "drafter.tree_top_k=0 must"):
        assert needle in res.stderr
    assert "data.heldout_fraction=1.0 must be in [0, 1)" in res.stderr
    assert "Traceback" not in res.stderr + res.stdout and not tmp_path.joinpath("manifest.json").exists()


NO_BOUND = {"seed", "data.shuffle_seed", "eval.seed", "drafter.init_layer_from_target"}
"""Numeric keys whose every value is meaningful (seeds; a layer index that counts from the end when negative)."""


def _numeric_keys(cls: type, prefix: str = "") -> list[tuple[type, str, str]]:
    """(owning dataclass, field, dotted key) of every int/float field of a config tree."""
    from dataclasses import fields, is_dataclass
    from typing import get_origin, get_type_hints

    out = []
    hints = get_type_hints(cls)
    for f in fields(cls):
        tp = hints[f.name]
        parts = (tp, *getattr(tp, "__args__", ()))
        sub = [a for a in parts if isinstance(a, type) and is_dataclass(a)]
        if sub:  # a mapping of sections (data.sources) is probed at an entry named x
            out.extend(_numeric_keys(sub[0], f"{prefix}{f.name}.{'x.' if get_origin(tp) is dict else ''}"))
        elif any(a in (int, float) for a in parts) or any(int in getattr(a, "__args__", ()) for a in parts):
            out.append((cls, f.name, f"{prefix}{f.name}"))
    return out


def _all_numeric_keys() -> list[tuple[type, str, str]]:
    from train.config import drafter_config_class
    from train.drafters import registry

    keys = _numeric_keys(Config)
    for name in registry.names():
        keys += _numeric_keys(drafter_config_class(name), "drafter.")
    return keys


def test_every_numeric_key_has_bounds_in_the_schema() -> None:
    """The schema carries a range for every numeric key (a new key without one fails here), and every shipped
    default and every shipped config is inside its ranges."""
    from data.config import bound_errors

    missing = [key for cls, name, key in _all_numeric_keys() if name not in getattr(cls, "bounds", {})]
    assert sorted(set(missing) - NO_BOUND) == []
    assert sorted(NO_BOUND - set(missing)) == []  # the exemptions are still numeric keys without bounds
    for cls, _, key in _all_numeric_keys():
        assert bound_errors(cls(), key.rsplit(".", 1)[0] + ".") == [], key
    for e in EXPERIMENTS:
        assert bound_errors(compose([f"experiment={e}"])) == [], e


def test_every_bound_refuses_a_value_just_outside_it() -> None:
    """Each bound, probed on the composed config: the value just outside is refused naming the key, the edge value
    (where closed) is accepted."""
    import copy

    from data.config import SourceConfig, bound_errors, check_bounds
    from train.drafters import registry

    bases = {}
    for family in registry.names():
        bases[family] = compose([f"drafter={family}"])
        bases[family].data.sources = {"x": SourceConfig()}
    probes = 0
    for cls, name, key in _all_numeric_keys():
        bound = getattr(cls, "bounds", {}).get(name)
        if bound is None:
            continue
        base = next(b for b in bases.values() if not key.startswith("drafter.") or isinstance(b.drafter, cls))
        owner_path = key.rsplit(".", 1)[0].split(".")
        for lo_side in (True, False):
            edge = bound.lo if lo_side else bound.hi
            if edge is None:
                continue
            open_ = bound.lo_open if lo_side else bound.hi_open
            step = 1 if isinstance(edge, int) and not isinstance(getattr(cls(), name) or 0, float) else 1e-6
            outside = (edge if open_ else edge - step) if lo_side else (edge if open_ else edge + step)
            cfg = copy.deepcopy(base)
            owner: object = cfg
            for part in owner_path:
                owner = owner[part] if isinstance(owner, dict) else getattr(owner, part)
            setattr(owner, name, [outside] if key.endswith("layer_ids") else outside)
            with pytest.raises(ConfigError, match=re.escape(f"{key}=")):
                check_bounds(cfg)
            if not open_:
                setattr(owner, name, [edge] if key.endswith("layer_ids") else edge)
                assert not [e for e in bound_errors(cfg) if e.startswith(f"{key}=")], key
            probes += 1
    assert probes > 100


def test_choice_values_are_enums_refused_with_the_choices() -> None:
    """Choice-valued keys are :class:`Choice` enums: one check, on the command line (before Hydra), in Hydra's
    compose, and in ``__post_init__`` for a config built in code or read back from a manifest."""
    import dataclasses
    import json

    from data.config import SynthConfig, SynthEngine
    from train.drafters.eagle3 import Eagle3Config

    res = _cli("stage=synth", "synth.engine=vlm")
    assert res.returncode == 2 and "Traceback" not in res.stderr
    assert (
        "synth.engine='vlm' is not one of: hf, hf_generate, vllm, auto. Did you mean synth.engine=vllm?" in res.stderr
    )
    res = _cli("stage=synth", "drafter=standalone", "drafter.loss=ce")
    assert res.returncode == 2 and "drafter.loss='ce' is not one of: kl, tv, kl_tv" in res.stderr
    with pytest.raises(ConfigError, match=r"synth\.engine='vlm' is not one of"):
        SynthConfig(engine="vlm")  # type: ignore[arg-type]
    with pytest.raises(ConfigError, match=r"drafter\.decode='both' is not one of: chain, tree"):
        Eagle3Config(decode="both")  # type: ignore[arg-type]
    cfg = SynthConfig(engine="vllm")  # type: ignore[arg-type]
    assert cfg.engine is SynthEngine.vllm and cfg.engine == "vllm" and f"{cfg.engine}" == "vllm"
    assert json.loads(json.dumps(dataclasses.asdict(cfg)))["engine"] == "vllm"  # manifests hold the string
    assert compose(["eval.mode=replay"]).eval.mode == "replay"


def test_cli_unknown_group_option_lists_options() -> None:
    res = _cli("stage=synth", "data=sharegtp")
    assert res.returncode != 0
    assert "sharegpt" in res.stderr and "humaneval" in res.stderr


def test_yaml_typo_in_experiment_fails(tmp_path: Path) -> None:
    conf = tmp_path / "conf"
    import shutil

    shutil.copytree(CONF, conf)
    (conf / "experiment" / "typo.yaml").write_text("# @package _global_\nsynth:\n  max_new_tokenz: 3\n")
    from hydra import compose as hydra_compose
    from hydra import initialize_config_dir
    from omegaconf.errors import ConfigKeyError

    from train.config import register_configs

    register_configs()
    with initialize_config_dir(config_dir=str(conf), version_base="1.3"), pytest.raises(Exception) as err:
        hydra_compose("config", overrides=["experiment=typo"])
    assert "max_new_tokenz" in str(err.value) or isinstance(err.value, ConfigKeyError)


def test_bad_values_are_collected() -> None:
    from data.synth import validate_synth

    cfg = compose(["synth.top_p=1.5", "synth.max_new_tokens=0"])
    with pytest.raises(ConfigError) as err:
        validate_synth(cfg.synth)
    assert "top_p" in str(err.value) and "max_new_tokens" in str(err.value)


def _flat(d: dict, prefix: str = "") -> dict:
    out: dict = {}
    for k, v in d.items():
        if isinstance(v, dict) and v:
            out.update(_flat(v, f"{prefix}{k}."))
        else:
            out[f"{prefix}{k}"] = v
    return out


DRAFTER_YAMLS = sorted(p.stem for p in (CONF / "drafter").glob("*.yaml"))
PRESETS = {"eagle3_sglang"}
"""conf/drafter/ files that select a family with other values (a recipe), not a family's defaults."""


def test_every_drafter_yaml_is_a_family_or_a_preset() -> None:
    from train.drafters import registry

    assert set(registry.BUILTIN) <= set(DRAFTER_YAMLS)
    assert set(DRAFTER_YAMLS) - set(registry.BUILTIN) == PRESETS
    for preset in PRESETS:
        assert compose([f"drafter={preset}"]).drafter.name in registry.BUILTIN


@pytest.mark.parametrize("family", [f for f in DRAFTER_YAMLS if f not in PRESETS])
def test_the_cli_default_is_the_schema_default(family: str) -> None:
    """One source of truth: what ``python -m train drafter=<family>`` composes with no other override is the config
    a user gets in code (``Config()`` with that family's dataclass), key for key -- a value a YAML file sets
    differently from the schema fails here. Only the groups' selections (the target and traffic) and paths that
    the schema leaves as interpolations differ."""
    from dataclasses import asdict

    cli = compose([f"drafter={family}"])
    code = Config()
    code.drafter = type(cli.drafter)()
    a, b = _flat(asdict(cli)), _flat(asdict(code))
    selected = ("target.", "data.sources")
    differ = {
        k: (a.get(k), b.get(k))
        for k in sorted(set(a) | set(b))
        if a.get(k) != b.get(k)
        and not k.startswith(selected)
        and not (isinstance(b.get(k), str) and "${" in b.get(k))  # a path the schema derives by interpolation
    }
    assert not differ, f"conf/ and the schema disagree (cli, code): {differ}"
    assert a["drafter.name"] == family


def test_the_sglang_preset_is_eagle3_without_the_norms() -> None:
    """``drafter=eagle3_sglang`` (conf/drafter/eagle3_sglang.yaml) trains the EAGLE-3 family with every eagle3 default
    but speculators' three optional norms, which SGLang's EAGLE-3 model lacks (its export refuses them)."""
    from dataclasses import asdict

    base = asdict(compose(["drafter=eagle3"]).drafter)
    preset = compose(["experiment=quickstart", "drafter=eagle3_sglang"]).drafter
    sgl = asdict(preset)
    assert preset.name == "eagle3"
    differ = {k for k in base if base[k] != sgl[k]}
    assert differ == {"norm_before_fc", "norm_before_residual", "norm_output"}, differ
    assert not any(sgl[k] for k in differ)
