"""Shipped model presets: they load, every number names a source, and the shapes add up."""

from __future__ import annotations

import dataclasses
from pathlib import Path

import numpy as np
import pytest
import yaml

from moesim.errors import ConfigError
from moesim.model.presets import PRESET_DIR, available_presets, load_preset
from moesim.model.spec import ModelSpec

EXPECTED_PRESETS = [
    "deepseek-v2-lite", "deepseek-v2.5", "deepseek-v3", "flame-moe-290m", "mixtral-8x7b",
    "olmoe-1b-7b", "qwen1.5-moe-a2.7b", "qwen2-57b-a14b", "qwen3-235b-a22b", "qwen3-30b-a3b",
]

# (MoE layers, dense layers, routed experts, top-k, hidden, expert width, shared experts, shared width),
# copied from each model's config.json / training script as cited in the preset.
SHAPES = {
    "deepseek-v3": (58, 3, 256, 8, 7168, 2048, 1, 2048),
    "deepseek-v2.5": (59, 1, 160, 6, 5120, 1536, 2, 3072),
    "deepseek-v2-lite": (26, 1, 64, 6, 2048, 1408, 2, 2816),
    "qwen3-235b-a22b": (94, 0, 128, 8, 4096, 1536, 0, 0),
    "qwen3-30b-a3b": (48, 0, 128, 8, 2048, 768, 0, 0),
    "qwen2-57b-a14b": (28, 0, 64, 8, 3584, 2560, 8, 20480),
    "qwen1.5-moe-a2.7b": (24, 0, 60, 4, 2048, 1408, 4, 5632),
    "mixtral-8x7b": (32, 0, 8, 2, 4096, 14336, 0, 0),
    "olmoe-1b-7b": (16, 0, 64, 8, 2048, 1024, 0, 0),
    "flame-moe-290m": (8, 1, 64, 6, 1024, 704, 2, 1408),
}

FLAME_TRACE = (Path(__file__).resolve().parents[2].parent / "shared" / "real-traces"
               / "DynaNDE-Simulator-flame-moe-290m" / "flame-moe-290m_layers2-9_2048tok_top6.npz")


def _raw(name: str) -> dict:
    return yaml.safe_load((PRESET_DIR / f"{name}.yaml").read_text())


def test_the_expected_presets_ship() -> None:
    assert available_presets() == EXPECTED_PRESETS


@pytest.mark.parametrize("name", EXPECTED_PRESETS)
def test_preset_loads_and_passes_check(name: str) -> None:
    spec = load_preset(name)
    spec.check(name)
    assert spec.name == name
    assert spec.total_params > 0 and spec.vocab_size > 0


@pytest.mark.parametrize("name", EXPECTED_PRESETS)
def test_every_field_names_a_source(name: str) -> None:
    raw = _raw(name)
    sources = raw.pop("sources")
    assert all(isinstance(text, str) and len(text) > 20 for text in sources.values())
    field_names = {f.name for f in dataclasses.fields(ModelSpec)}
    assert set(sources) - {"*"} <= field_names, "a source key names no ModelSpec field"
    uncovered = [key for key in raw if key not in sources and "*" not in sources]
    assert uncovered == []


def test_a_config_file_source_is_not_allowed_to_hide_derived_numbers() -> None:
    # Fields not read straight from a config file carry their own explanation.
    for name in EXPECTED_PRESETS:
        sources = _raw(name)["sources"]
        assert "total_params" in sources, name
        if load_preset(name).attention == "mla":
            assert "v_head_dim" in sources["head_dim"], name
    flame = _raw("flame-moe-290m")["sources"]
    assert "*" not in flame  # no config.json exists: every number is sourced on its own
    assert "derived" in flame["vocab_size"] and "derived" in flame["total_params"]


@pytest.mark.parametrize("name", EXPECTED_PRESETS)
def test_shapes_match_the_cited_configs(name: str) -> None:
    spec = load_preset(name)
    got = (spec.num_layers, spec.num_dense_layers, spec.num_experts, spec.top_k, spec.hidden_size,
           spec.moe_intermediate_size, spec.num_shared_experts, spec.shared_intermediate_size)
    assert got == SHAPES[name]


@pytest.mark.parametrize("name", EXPECTED_PRESETS)
def test_parameter_count_from_shapes_matches_the_published_total(name: str) -> None:
    """Embeddings + attention + dense FFN + experts + routers, against the model card's total.

    DeepSeek-V2.5/V3 come out 1-2 % high because attention_params_per_layer ignores
    their low-rank query compression; a wrong width or expert count would miss by far more.
    """
    s = load_preset(name)
    estimate = (2 * s.vocab_size * s.hidden_size
                + (s.num_layers + s.num_dense_layers) * s.attention_params_per_layer()
                + s.num_dense_layers * 3 * s.hidden_size * s.dense_intermediate_size
                + s.num_layers * (s.num_experts * (s.expert_params + s.hidden_size) + s.shared_params))
    assert estimate == pytest.approx(s.total_params, rel=0.025)


def test_deepseek_v3_routed_experts_are_most_but_not_all_of_671b() -> None:
    spec = load_preset("deepseek-v3")
    assert spec.routed_expert_params == 58 * 256 * 3 * 7168 * 2048 == 653_908_770_816
    assert spec.routed_expert_params < spec.total_params == 671_000_000_000
    # KTransformers 001_66a328d79a3cae8d.txt Table 1: 654B CPU (routed expert) parameters.
    assert spec.routed_expert_params == pytest.approx(654e9, rel=0.002)
    # SMoE 000_dba2fecbbc66318b.txt Sec. I: MoE modules are about 98 % of the weights.
    assert 0.97 < spec.routed_expert_params / spec.total_params < 0.98


def test_mixtral_routed_experts_are_45_1b_of_46_7b() -> None:
    spec = load_preset("mixtral-8x7b")
    assert spec.routed_expert_params == 45_097_156_608
    assert spec.routed_expert_params < spec.total_params == 46_702_792_704


@pytest.mark.parametrize(("name", "cpu_params"), [("deepseek-v2.5", 223e9), ("qwen2-57b-a14b", 49e9)])
def test_routed_params_match_ktransformers_table_1(name: str, cpu_params: float) -> None:
    assert load_preset(name).routed_expert_params == pytest.approx(cpu_params, rel=0.01)


def test_expert_sizes_in_mib() -> None:
    mib = {name: load_preset(name).expert_bytes("bf16") / 2**20 for name in EXPECTED_PRESETS}
    assert mib == {
        "deepseek-v3": 84.0, "deepseek-v2.5": 45.0, "deepseek-v2-lite": 16.5, "qwen3-235b-a22b": 36.0,
        "qwen3-30b-a3b": 9.0, "qwen2-57b-a14b": 52.5, "qwen1.5-moe-a2.7b": 16.5, "mixtral-8x7b": 336.0,
        "olmoe-1b-7b": 12.0, "flame-moe-290m": 4.125,
    }


@pytest.mark.skipif(not FLAME_TRACE.exists(), reason="shared FLAME-MoE router log not present")
def test_flame_preset_matches_its_router_log() -> None:
    """The log's Megatron layers 2..9 (1-based) are MoE indices 0..7 after one dense layer."""
    spec = load_preset("flame-moe-290m")
    log = np.load(FLAME_TRACE)
    megatron_layers = log["layers"].astype(int)
    assert list(megatron_layers - (spec.num_dense_layers + 1)) == list(range(spec.num_layers))
    assert log["indices"].shape[-1] == spec.top_k
    assert int(log["indices"].max()) < spec.num_experts
    assert int(log["token_ids"].max()) < spec.vocab_size


def test_unknown_preset_names_the_valid_ones() -> None:
    with pytest.raises(ConfigError) as err:
        load_preset("deepseek-v4")
    message = str(err.value)
    assert "field '--model': unknown model preset 'deepseek-v4'" in message
    for name in EXPECTED_PRESETS:
        assert name in message
    assert "\n" not in message


def test_dotted_preset_names_resolve_to_the_preset_not_a_path() -> None:
    assert load_preset("qwen1.5-moe-a2.7b").num_experts == 60
    assert load_preset("deepseek-v2.5").num_experts == 160


def _write_preset(tmp_path: Path, text: str) -> str:
    path = tmp_path / "custom.yaml"
    path.write_text(text)
    return str(path)


GOOD_BODY = """name: custom
num_layers: 2
num_experts: 4
top_k: 2
hidden_size: 64
moe_intermediate_size: 32
"""


def test_preset_yaml_path_loads(tmp_path: Path) -> None:
    spec = load_preset(_write_preset(tmp_path, GOOD_BODY + 'sources:\n  "*": "made up for a test"\n'))
    assert spec.expert_params == 3 * 64 * 32
    assert spec.sources == {"*": "made up for a test"}


def test_a_missing_preset_file_is_said_to_be_a_missing_file(tmp_path: Path) -> None:
    """Not an "unknown preset": the path, the option and, for a slip of a bundled name, that name."""
    with pytest.raises(ConfigError, match=r"^\S+mixtral-8x7\.yaml, field '--model': model preset file not found "
                                          r"\(fix: did you mean mixtral-8x7b\? check the path"):
        load_preset(str(tmp_path / "mixtral-8x7.yaml"))


def test_a_preset_path_without_its_yaml_is_the_file_with_it(tmp_path: Path) -> None:
    _write_preset(tmp_path, GOOD_BODY + 'sources:\n  "*": "made up for a test"\n')
    assert load_preset(str(tmp_path / "custom")).name == "custom"
    with pytest.raises(ConfigError, match="model preset file not found"):
        load_preset(str(tmp_path / "other"))


def test_an_edited_preset_that_kept_the_released_total_is_refused(tmp_path: Path) -> None:
    """Mixtral cut to 2 layers of 2 experts but still claiming 46.7B parameters would plan 86 GiB of
    non-expert weights; the shapes count 0.35B besides the experts, and the error gives the total they imply."""
    text = (PRESET_DIR / "mixtral-8x7b.yaml").read_text()
    cut = text.replace("num_layers: 32", "num_layers: 2").replace("num_experts: 8", "num_experts: 2")
    path = tmp_path / "cut.yaml"
    path.write_text(cut)
    with pytest.raises(ConfigError) as err:
        load_preset(str(path))
    assert err.value.field == "total_params" and str(path) in str(err.value)
    shape = ModelSpec.from_dict({k: v for k, v in yaml.safe_load(cut).items() if k != "sources"})
    implied = shape.routed_expert_params + shape.counted_non_expert_params()
    assert f"about {implied:,}" in str(err.value)
    path.write_text(cut.replace("total_params: 46702792704", f"total_params: {implied}"))
    assert load_preset(str(path)).non_expert_bytes() == 2 * shape.counted_non_expert_params()


def test_a_total_below_the_routed_experts_is_refused_without_a_vocabulary(tmp_path: Path) -> None:
    path = _write_preset(tmp_path, GOOD_BODY + "total_params: 1000\nsources:\n  '*': x\n")
    with pytest.raises(ConfigError, match="leaves -48,152 parameters besides the routed experts \\(49,152\\)"):
        load_preset(path)


def test_preset_without_sources_is_rejected(tmp_path: Path) -> None:
    path = _write_preset(tmp_path, GOOD_BODY)
    with pytest.raises(ConfigError) as err:
        load_preset(path)
    assert err.value.field == "sources"
    assert path in str(err.value) and "fix:" in str(err.value)


def test_preset_with_unknown_field_is_rejected(tmp_path: Path) -> None:
    path = _write_preset(tmp_path, GOOD_BODY + "n_routed_experts: 4\nsources:\n  '*': x\n")
    with pytest.raises(ConfigError) as err:
        load_preset(path)
    message = str(err.value)
    assert path in message and "n_routed_experts" in message and "num_experts" in message


def test_preset_that_is_not_a_mapping_is_rejected(tmp_path: Path) -> None:
    with pytest.raises(ConfigError, match="must be a YAML mapping"):
        load_preset(_write_preset(tmp_path, "- 1\n- 2\n"))


def test_a_file_that_is_no_preset_yaml_is_said_to_be_one(tmp_path: Path, monkeypatch) -> None:
    """`--model g.jsonl` (a file that is there) was 'unknown model preset' or 'preset file not found'."""
    (tmp_path / "g.jsonl").write_text("{}\n")
    monkeypatch.chdir(tmp_path)
    for given in ("g.jsonl", str(tmp_path / "g.jsonl")):
        with pytest.raises(ConfigError, match=r"g\.jsonl, field '--model': not a model preset: a preset is a YAML"):
            load_preset(given)


@pytest.mark.parametrize("sources", ['"config.json"', "[a, b]"])
def test_sources_that_are_no_mapping_are_one_line_naming_the_field(tmp_path: Path, sources: str) -> None:
    """`sources: "config.json"` was an internal error (dict() of a string) after the shapes had loaded."""
    path = _write_preset(tmp_path, GOOD_BODY + f"sources: {sources}\n")
    with pytest.raises(ConfigError) as err:
        load_preset(path)
    assert err.value.field == "sources" and path in str(err.value) and "fix:" in str(err.value)


def test_a_source_key_that_names_no_field_is_refused(tmp_path: Path) -> None:
    path = _write_preset(tmp_path, GOOD_BODY + "sources:\n  top_kk: config.json\n")
    with pytest.raises(ConfigError, match=r"did you mean top_k\?") as err:
        load_preset(path)
    assert err.value.field == "sources.top_kk"


def test_an_empty_source_text_is_refused(tmp_path: Path) -> None:
    path = _write_preset(tmp_path, GOOD_BODY + "sources:\n  '*': ''\n")
    with pytest.raises(ConfigError, match="must name a document") as err:
        load_preset(path)
    assert err.value.field == "sources.*"


def test_a_number_no_source_names_is_refused(tmp_path: Path) -> None:
    """Every number of a preset names its source, by its own key or by "*"; a source for the name alone was
    accepted for a preset of five numbers."""
    path = _write_preset(tmp_path, GOOD_BODY + "sources:\n  name: made up\n  num_layers: config.json\n")
    with pytest.raises(ConfigError) as err:
        load_preset(path)
    assert err.value.field == "sources" and path in str(err.value)
    assert "no source for num_experts, top_k, hidden_size, moe_intermediate_size" in str(err.value)
    every = "".join(f"  {key}: config.json\n" for key in ("num_experts", "top_k", "hidden_size",
                                                           "moe_intermediate_size"))
    assert load_preset(_write_preset(tmp_path, GOOD_BODY + "sources:\n  num_layers: config.json\n" + every)).top_k == 2


@pytest.mark.parametrize("edit, field", [
    ("top_k: 9", "top_k"), ("top_k: 0", "top_k"), ("hidden_size: 64.5", "hidden_size"),
    ("attention: [gqa]", "attention"), ("num_kv_heads: -1", "num_kv_heads"),
])
def test_every_shape_error_names_its_field_and_a_fix(tmp_path: Path, edit: str, field: str) -> None:
    key = edit.split(":")[0]
    body = "".join(line + "\n" for line in GOOD_BODY.splitlines() if not line.startswith(key + ":"))
    path = _write_preset(tmp_path, body + edit + "\nsources:\n  '*': x\n")
    with pytest.raises(ConfigError) as err:
        load_preset(path)
    assert err.value.field == field and "fix:" in str(err.value), str(err.value)
