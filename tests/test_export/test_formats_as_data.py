"""Export formats are data: a key map read both ways and required tensors as symbolic shape tables."""

from __future__ import annotations

import torch

from train.export import core
from train.export import eagle as eagle_fmt
from train.export import eagle3 as eagle3_fmt
from train.export import medusa as medusa_fmt


def test_key_maps_rename_drop_and_invert() -> None:
    state = {"midlayer.self_attn.q_proj.weight": 1, "rotary.inv_freq": 2, "fc.weight": 3, "embed_tokens.weight": 4}
    spec = eagle3_fmt.SPEC_KEYS.to_file(state)
    assert spec == {"layers.0.self_attn.q_proj.weight": 1, "fc.weight": 3, "embed_tokens.weight": 4}
    assert eagle3_fmt.SPEC_KEYS.to_module(spec) == {k: v for k, v in state.items() if not k.startswith("rotary.")}
    assert eagle3_fmt.SGL_KEYS.to_file(state) == {"midlayer.self_attn.q_proj.weight": 1, "fc.weight": 3}
    heads = {"heads.0.0.linear.weight": 1, "heads.1.1.weight": 2, "rank_hits": 3, "rank_count": 4}
    medusa = medusa_fmt.KEYS.to_file(heads)
    assert medusa == {"0.0.linear.weight": 1, "1.1.weight": 2}  # the Medusa repository's names
    assert medusa_fmt.KEYS.to_module(medusa) == {"heads.0.0.linear.weight": 1, "heads.1.1.weight": 2}
    plain = {"layers.0.mlp.up_proj.weight": 1}
    assert eagle_fmt.KEYS.to_file({**plain, "rotary.x": 2}) == plain


def test_shape_tables_resolve_against_the_target_dims() -> None:
    dims = {"H": 8, "I": 16, "q": 8, "kv": 4, "A": 16}
    got = core.shapes(core.LLAMA_LAYER, dims, "layers.0.")
    assert got["layers.0.self_attn.q_proj.weight"] == (8, 16)  # A: EAGLE-3's [embedding, feature] input
    assert got["layers.0.self_attn.k_proj.weight"] == (4, 16)
    assert got["layers.0.mlp.down_proj.weight"] == (8, 16)
    assert core.shapes({"t2d": ("V",), "x": (3, "H")}, {"V": 5, "H": 2}) == {"t2d": (5,), "x": (3, 2)}


def test_every_format_is_a_weight_file_a_key_map_and_hooks() -> None:
    pairs = core.valid_pairs()
    assert {("eagle", "eagle"), ("eagle3", "speculators"), ("medusa", "medusa"), ("standalone", "hf")} <= set(pairs)
    for pair in pairs:
        fmt = core.FORMATS[pair]
        assert fmt.weights.endswith(".safetensors") and isinstance(fmt.keys, core.KeyMap)
        assert callable(fmt.tensors) and callable(fmt.required) and callable(fmt.write_config)


def test_read_weights_maps_file_names_back(tmp_path) -> None:
    from safetensors.torch import save_file

    save_file({"layers.0.mlp.up_proj.weight": torch.ones(2, 2), "fc.weight": torch.zeros(1)}, str(tmp_path / "w.st"))
    got = core.read_weights(tmp_path, "w.st", eagle3_fmt.SPEC_KEYS)
    assert set(got) == {"midlayer.mlp.up_proj.weight", "fc.weight"}
