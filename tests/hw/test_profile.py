"""Hardware profile loading: shipped profiles, sources, one-line errors, overrides."""

from __future__ import annotations

import copy
from pathlib import Path

import pytest
import yaml

from moesim.errors import ProfileError
from moesim.hw.cost import CostModel
from moesim.hw.profile import PROFILE_DIR, available_profiles, load_profile, parse_profile
from moesim.model.presets import load_preset
from moesim.model.spec import ModelSpec

SHIPPED = ["a100-40g", "h100-pcie", "rtx3090", "rtx4080", "rtx4090"]


def minimal() -> dict:
    """Smallest valid profile: one GPU curve, one CPU curve, flat PCIe."""
    return {
        "schema_version": 1,
        "name": "toy",
        "gpu": {"name": "toy gpu", "memory_gib": 24, "reserved_gib": 1, "launch_us": 10, "graph_launch_us": 1,
                "cuda_graph": False, "peak_tflops": {"bf16": 100}, "mem_bandwidth_gbps": 1000,
                "expert_ffn": [{"hidden": 64, "intermediate": 32, "dtype": "bf16", "tokens": [1, 100],
                                "time_us": [10, 1000], "source": "hand-made"}]},
        "cpu": {"name": "toy cpu", "cores": 8, "dram_bandwidth_gbps": 100, "peak_tflops": {"avx512": 1, "amx": 4},
                "amx_switch_tokens": 5},
        "pcie": {"generation": 4, "h2d": {"size_bytes": [1000], "gbps": [20], "source": "hand-made"},
                 "d2h": {"size_bytes": [1000], "gbps": [20], "source": "hand-made"},
                 "latency_us": 5, "copy_engines": 1, "duplex_slowdown": 0.5},
        "sync": {"per_layer_us": 12},
        "sources": {"gpu": "test", "cpu": "test", "pcie": "test", "sync": "test"},
    }


def fails(data, match: str) -> ProfileError:
    with pytest.raises(ProfileError, match=match) as err:
        parse_profile(data, origin="toy.yaml")
    message = str(err.value)
    assert "\n" not in message and message.startswith("toy.yaml")
    return err.value


# -- shipped profiles -------------------------------------------------------------
def test_all_shipped_profiles_load_by_name():
    assert set(SHIPPED) <= set(available_profiles())
    for name in SHIPPED:
        profile = load_profile(name)
        assert profile.name == name
        assert profile.gpu.expert_ffn and profile.cpu.expert_ffn and profile.gpu.attention


def test_shipped_testbed_facts():
    # numbers the seed papers state outright
    assert load_profile("rtx4090").cpu.cores == 10  # 000 Sec. VI-A
    assert load_profile("rtx3090").cpu.cores == 16  # 003 Sec. 6.1
    a100 = load_profile("a100-40g")
    assert a100.cpu.amx_switch_tokens == 5  # 001 Sec. 3.2: AVX-512 wins at <= 4 tokens
    assert a100.cpu.dram_bandwidth_gbps == 440  # 2 x 220 GB/s MLC, 001 Sec. 6.1
    assert load_profile("rtx4090").cpu.amx_switch_tokens is None  # Zen 3: no AMX
    assert load_profile("h100-pcie").pcie.generation == 5


@pytest.mark.parametrize("name", SHIPPED)
def test_shipped_derived_curves_equal_the_cost_model_roofline(name):
    """A derived curve is the fallback tabulated: none of its numbers is tuned by hand."""
    profile = load_profile(name)
    for c in profile.gpu.expert_ffn:
        assert c.curve.source.startswith("roofline")
        model = ModelSpec(name="s", num_layers=1, num_experts=1, top_k=1, hidden_size=c.hidden,
                          moe_intermediate_size=c.intermediate, expert_dtype=c.dtype)
        costs = CostModel(profile, model)
        for t, y in zip(c.curve.x, c.curve.y):
            assert costs.gpu_roofline(int(t), c.intermediate) * 1e6 == pytest.approx(y, rel=1e-3)
            assert costs.gpu_expert(int(t)) * 1e6 == pytest.approx(y, rel=1e-9)
        assert not costs.fallbacks
    for c in profile.cpu.expert_ffn:
        model = ModelSpec(name="s", num_layers=1, num_experts=1, top_k=1, hidden_size=c.hidden,
                          moe_intermediate_size=c.intermediate, expert_dtype=c.dtype)
        costs = CostModel(profile, model)
        assert c.threads == profile.cpu.cores
        for t, y in zip(c.curve.x, c.curve.y):
            assert costs.cpu_roofline(int(t), c.kernel) * 1e6 == pytest.approx(y, rel=1e-3)
    for a in profile.gpu.attention:
        costs = CostModel(profile, load_preset(a.model))
        for ctx, y in zip(a.curve.x, a.curve.y):
            assert costs.attention_roofline(a.tokens, int(ctx)) * 1e6 == pytest.approx(y, rel=1e-3)
            assert costs.attention(a.tokens, int(ctx)) * 1e6 == pytest.approx(y, rel=1e-9)


def test_amx_curves_start_at_the_switch_point():
    profile = load_profile("a100-40g")
    amx = [c for c in profile.cpu.expert_ffn if c.kernel == "amx"]
    assert amx and all(c.curve.x[0] == profile.cpu.amx_switch_tokens for c in amx)


# -- sources ----------------------------------------------------------------------
def test_unsourced_number_names_its_dotted_path():
    data = minimal()
    data["sources"] = {"gpu": "x", "cpu": "x", "pcie": "x", "sync.other": "x"}
    err = fails(data, "number has no source")
    assert err.field == "sync.per_layer_us"
    data["sources"] = {"gpu": "x", "cpu.cores": "x", "cpu.name": "x", "pcie": "x", "sync": "x",
                       "cpu.dram_bandwidth_gbps": "x", "cpu.amx_switch_tokens": "x", "cpu.peak_tflops.amx": "x"}
    assert fails(data, "no source").field == "cpu.peak_tflops.avx512"


def test_profile_without_sources_fails():
    data = minimal()
    del data["sources"]
    assert fails(data, "no sources").field == "sources"


# -- one-line errors ----------------------------------------------------------------
def test_missing_section():
    data = minimal()
    del data["pcie"]
    err = fails(data, "missing section")
    assert err.field == "pcie" and "add a 'pcie' mapping" in str(err)


def test_missing_field():
    data = minimal()
    del data["gpu"]["mem_bandwidth_gbps"]
    assert fails(data, "missing field").field == "gpu.mem_bandwidth_gbps"


@pytest.mark.parametrize("blank", [None, "", "   "])
def test_an_empty_name_is_refused(blank):
    """A blank part name passed (None read as the text 'None') and titled tables 'rtx4090 ( + , 10 cores ...)'."""
    for section in ("gpu", "cpu"):
        data = minimal()
        data[section]["name"] = blank
        assert fails(data, "is empty").field == f"{section}.name"


def test_non_numeric_value():
    data = minimal()
    data["cpu"]["cores"] = "eight"
    assert fails(data, "must be a number, got 'eight'").field == "cpu.cores"


def test_curve_with_mismatched_lengths():
    data = minimal()
    data["gpu"]["expert_ffn"][0]["time_us"] = [10]
    err = fails(data, "'tokens' has 2 points but 'time_us' has 1")
    assert err.field == "gpu.expert_ffn[0]"


def test_curve_with_non_increasing_x():
    data = minimal()
    data["pcie"]["h2d"] = {"size_bytes": [1000, 1000], "gbps": [10, 20], "source": "x"}
    assert fails(data, "must increase strictly").field == "pcie.h2d"


@pytest.mark.parametrize("section", ["expert_ffn", "attention"])
def test_a_second_curve_for_the_same_shape_is_refused(section):
    """A copied curve with other times was read and never used (the first of the two won, silently)."""
    data = yaml.safe_load((PROFILE_DIR / "rtx4090.yaml").read_text())
    curves = data["gpu"][section]
    twin = copy.deepcopy(curves[0])
    twin["time_us"] = [t * 10 for t in twin["time_us"]]
    curves.append(twin)
    err = fails(data, f"a second curve with the {'hidden' if section == 'expert_ffn' else 'model'}")
    assert err.field == f"gpu.{section}[{len(curves) - 1}]" and f"gpu.{section}[0]" in str(err)


def test_curve_without_source():
    data = minimal()
    del data["gpu"]["expert_ffn"][0]["source"]
    assert fails(data, "curve has no source").field == "gpu.expert_ffn[0].source"


def test_unknown_schema_version():
    data = minimal()
    data["schema_version"] = 2
    err = fails(data, "unknown or missing schema_version 2")
    assert "set schema_version: 1" in str(err)


def test_unknown_field_is_not_ignored():
    data = minimal()
    data["pcie"]["bandwith_scale"] = 0.5
    err = fails(data, "unknown field")
    assert err.field == "pcie.bandwith_scale" and "(fix: did you mean bandwidth_scale? valid fields here:" in str(err)


def test_cuda_graph_must_be_boolean():
    data = minimal()
    data["gpu"]["cuda_graph"] = "false"
    assert fails(data, "must be true or false").field == "gpu.cuda_graph"


def test_invalid_yaml_names_the_line(tmp_path: Path):
    path = tmp_path / "bad.yaml"
    text = yaml.safe_dump(minimal(), sort_keys=False).splitlines()
    text.insert(3, "gpu: [unclosed")
    path.write_text("\n".join(text))
    with pytest.raises(ProfileError, match=r"not valid YAML at line \d+") as err:
        load_profile(path)
    assert str(path) in str(err.value) and "\n" not in str(err.value)


def test_numbers_in_exponent_notation_are_numbers(tmp_path: Path):
    """YAML 1.1 would read ``1e3`` as text; a profile reads it as the number it is."""
    path = tmp_path / "exp.yaml"
    text = yaml.safe_dump(minimal(), sort_keys=False).replace("mem_bandwidth_gbps: 1000", "mem_bandwidth_gbps: 1e3")
    path.write_text(text.replace("latency_us: 5", "latency_us: 5.0E+0"))
    profile = load_profile(path)
    assert profile.gpu.mem_bandwidth_gbps == 1000.0 and profile.pcie.latency_us == 5.0


def test_unknown_profile_name_lists_the_shipped_ones():
    with pytest.raises(ProfileError, match="hardware profile not found.*rtx4090"):
        load_profile("rtx9999")


def test_a_path_without_its_yaml_is_the_file_with_it(tmp_path: Path, monkeypatch):
    """``--hw hwprofiles/rtx4090`` is ``hwprofiles/rtx4090.yaml``; a bare name stays a bundled profile's."""
    monkeypatch.chdir(PROFILE_DIR.parent)
    assert load_profile("hwprofiles/rtx4090").path == "hwprofiles/rtx4090.yaml"
    (tmp_path / "rtx4090.yaml").write_text(yaml.safe_dump(minimal()))
    monkeypatch.chdir(tmp_path)
    assert load_profile("rtx4090").path == str(PROFILE_DIR / "rtx4090.yaml")
    assert load_profile("./rtx4090").path == "rtx4090.yaml"


def test_a_missing_path_whose_file_name_is_a_slip_of_a_profile_suggests_it(tmp_path: Path):
    with pytest.raises(ProfileError, match=r"not found \(fix: did you mean rtx4090\?"):
        load_profile(tmp_path / "rtx4091.yaml")


def test_profile_file_round_trip(tmp_path: Path):
    path = tmp_path / "toy.yaml"
    path.write_text(yaml.safe_dump(minimal()))
    profile = load_profile(path)
    assert profile.gpu.expert_ffn[0].curve.y == (10.0, 1000.0)
    assert profile.path == str(path)


# -- overrides ----------------------------------------------------------------------
def test_override_applies_and_is_sourced():
    profile = parse_profile(minimal(), origin="toy.yaml")
    changed = profile.with_overrides({"pcie.bandwidth_scale": 0.5, "cpu.cores": 4})
    assert changed.pcie.bandwidth_scale == 0.5 and changed.cpu.cores == 4
    assert changed.sources["cpu.cores"] == "command-line override"
    assert profile.cpu.cores == 8  # the original is untouched


def test_unknown_override_key():
    """An override the profile has no field for is named as the --set parameter given (hw.KEY), not as a field
    of the profile file, which never had it; the fix offers the full key to give."""
    profile = parse_profile(minimal(), origin="toy.yaml")
    with pytest.raises(ProfileError, match="no such profile field") as err:
        profile.with_overrides({"pcie.bandwith_scale": 0.5})
    assert err.value.field == "--set" and "bandwidth_scale" not in str(err.value).split("fix")[0]
    assert str(err.value).startswith("field '--set': parameter 'hw.pcie.bandwith_scale'=0.5: no such profile field "
                                     "in toy.yaml (fix: ")
    # the optional scalars a profile may leave out are offered too
    assert "did you mean hw.pcie.bandwidth_scale? fields of hw.pcie: bandwidth_scale, " in str(err.value)
    with pytest.raises(ProfileError, match="no such profile field") as err:
        profile.with_overrides({"pcei.latency_us": 1})
    assert "(fix: did you mean hw.pcie.latency_us? sections of hw: " in str(err.value)
    with pytest.raises(ProfileError, match="no such profile field") as err:
        profile.with_overrides({"disk.speed": 1})
    assert "(fix: sections of hw: " in str(err.value)


def test_override_with_a_bad_value_fails_cleanly():
    profile = parse_profile(minimal(), origin="toy.yaml")
    with pytest.raises(ProfileError, match=r"'many' is not a number \(fix: give a number, like 8\)"):
        profile.with_overrides({"cpu.cores": "many"})
    # a whole-number field takes no fraction (the parser's check), a size written as 24 takes 4.7
    with pytest.raises(ProfileError, match="must be a whole number, got 4.5"):
        profile.with_overrides({"cpu.cores": "4.5"})
    assert profile.with_overrides({"gpu.memory_gib": "4.7"}).gpu.memory_gib == 4.7


def test_a_mapping_of_cpu_kernels_takes_overrides_by_key_and_as_a_whole():
    """A runtime's cpu_compute_efficiency is a mapping of CPU kernel to factor, empty in the bundled profiles:
    --set adds a kernel to it, or gives the whole mapping as YAML (both were refused: "no such profile
    field", and "must be a mapping" with that very syntax as the fix). A kernel name not among the CPU
    kernels is refused, naming the --set parameter, in an override and in a file."""
    profile = load_profile("a100-40g")
    assert profile.runtimes["ktransformers"].cpu_compute_efficiency == {}
    one = profile.with_overrides({"runtimes.ktransformers.cpu_compute_efficiency.amx": "0.5"})
    assert one.runtimes["ktransformers"].cpu_compute_efficiency == {"amx": 0.5}
    whole = profile.with_overrides({"runtimes.ktransformers.cpu_compute_efficiency": "{amx: 0.5, avx512: 0.8}"})
    assert whole.runtimes["ktransformers"].cpu_compute_efficiency == {"amx": 0.5, "avx512": 0.8}
    with pytest.raises(ProfileError) as err:
        profile.with_overrides({"runtimes.ktransformers.cpu_compute_efficiency": "{amxx: 0.5}"})
    assert str(err.value).startswith("field '--set': parameter 'hw.runtimes.ktransformers.cpu_compute_efficiency'="
                                     "{amxx: 0.5} (")
    assert "unknown CPU kernel 'amxx' (fix: use one of avx512, amx, avx2)" in str(err.value)
    raw = copy.deepcopy(profile.raw)
    raw["runtimes"]["ktransformers"]["cpu_compute_efficiency"] = {"amxx": 0.5}
    with pytest.raises(ProfileError, match="cpu_compute_efficiency.amxx': unknown CPU kernel 'amxx'"):
        parse_profile(raw, origin="a100-40g.yaml")


def test_raw_is_not_shared_with_the_caller():
    data = minimal()
    profile = parse_profile(copy.deepcopy(data), origin="toy.yaml")
    profile.with_overrides({"sync.per_layer_us": 1})
    assert profile.raw["sync"]["per_layer_us"] == 12
    assert PROFILE_DIR.name == "hwprofiles"


def test_command_line_overrides_take_the_type_they_replace():
    profile = parse_profile(minimal(), origin="toy.yaml")
    assert profile.with_overrides({"gpu.cuda_graph": "true"}).gpu.cuda_graph is True
    assert profile.with_overrides({"cpu.cores": "4"}).cpu.cores == 4
    with pytest.raises(ProfileError, match="'yes please' is not true or false"):
        profile.with_overrides({"gpu.cuda_graph": "yes please"})


# -- names the cost model looks up, curve shapes, the file's top level -----------------
@pytest.mark.parametrize("path, value, field, valid", [
    (("gpu", "expert_ffn", 0, "dtype"), "bf61", "gpu.expert_ffn[0].dtype", "bf16, fp16, fp8, int8, int4"),
    (("cpu", "expert_ffn"), [{"hidden": 64, "intermediate": 32, "dtype": "int3", "kernel": "amx", "tokens": [1],
                              "time_us": [5], "source": "x"}], "cpu.expert_ffn[0].dtype", "bf16, fp16, fp8"),
    (("gpu", "attention"), [{"tokens": 1, "context": [1], "time_us": [5], "dtype": "b16", "source": "x"}],
     "gpu.attention[0].dtype", "bf16, fp16, fp8"),
    (("gpu", "output"), [{"kind": "lm-head", "hidden": 64, "vocab": 100, "sequences": [1], "time_us": [5],
                          "source": "x"}], "gpu.output[0].kind", "lm_head, sampling"),
    (("gpu", "peak_tflops", "bf61"), 100, "gpu.peak_tflops.bf61", "bf16, fp16, fp8"),
    (("cpu", "peak_tflops", "avx521"), 1, "cpu.peak_tflops.avx521", "avx512, amx, avx2"),
])
def test_a_name_no_cost_would_look_up_is_refused(path, value, field, valid):
    data = minimal()
    node = data
    for key in path[:-1]:
        node = node[key]
    node[path[-1]] = value
    err = fails(data, "unknown")
    assert err.field == field and valid in str(err)


def test_every_shipped_dtype_is_accepted():
    for dtype in ("bf16", "fp16", "fp8", "int8", "int4"):
        data = minimal()
        data["gpu"]["expert_ffn"][0]["dtype"] = dtype
        assert parse_profile(data, origin="toy.yaml").gpu.expert_ffn[0].dtype == dtype


@pytest.mark.parametrize("times, bad_point", [
    ([1000, 10], 1),  # the lists reversed
    ([100, 24], 1),  # a little over 4x
    ([10, 1000, 240], 2),  # a fall after a rise, measured from the slowest point before it
])
def test_a_time_that_falls_more_than_the_limit_is_refused_naming_the_point(times, bad_point):
    data = minimal()
    data["gpu"]["expert_ffn"][0].update(tokens=[1, 10, 100][:len(times)], time_us=times)
    err = fails(data, "time falls from .* more than 4x")
    assert err.field == f"gpu.expert_ffn[0].time_us[{bad_point}]"
    data = minimal()
    data["gpu"]["attention"] = [{"tokens": 1, "context": [1, 10, 100][:len(times)], "time_us": times,
                                 "source": "x"}]
    assert fails(data, "time falls").field == f"gpu.attention[0].time_us[{bad_point}]"


@pytest.mark.parametrize("times", [[100, 30], [10, 1000, 260], [50, 50, 49]])
def test_a_measured_dip_within_the_limit_is_accepted_and_used(times):
    """Noise and a library's kernel switch dip measured curves; interpolation uses them as they are."""
    from moesim.hw.cost import interp_loglog
    data = minimal()
    data["gpu"]["expert_ffn"][0].update(tokens=[1, 10, 100][:len(times)], time_us=times)
    curve = parse_profile(data, origin="toy.yaml").gpu.expert_ffn[0].curve
    assert curve.y == tuple(float(t) for t in times) and interp_loglog(curve, 10 ** (len(times) - 1)) == times[-1]


def test_copy_time_of_a_pcie_curve_may_not_fall_beyond_the_limit():
    data = minimal()
    data["pcie"]["latency_us"] = 0
    data["pcie"]["h2d"] = {"size_bytes": [1000, 1_000_000], "gbps": [1, 5000], "source": "x"}  # 1 µs, then 0.2
    assert fails(data, "copy time falls from 1 µs").field == "pcie.h2d.gbps[1]"
    data["pcie"]["latency_us"] = 5  # 6 µs, then 5.2: the latency dominates both copies
    assert parse_profile(data, origin="toy.yaml").pcie.h2d.y == (1.0, 5000.0)
    data["pcie"]["h2d"]["gbps"] = [20, 5]  # bandwidth falling with size: copy time still grows
    assert parse_profile(data, origin="toy.yaml").pcie.h2d.y == (20.0, 5.0)


@pytest.mark.parametrize("section", ["gpu", "cpu", "pcie", "sync"])
def test_a_section_written_as_a_list_must_be_a_mapping_not_unsourced_numbers(section):
    data = minimal()
    data[section] = [1, 2]
    data["sources"] = {"gpu.name": "x"}  # gpu[0] and gpu[1] have no source either: the shape comes first
    err = fails(data, "must be a mapping")
    assert err.field == section and f"add a '{section}' mapping" in str(err)
    data = minimal()
    data["gpu"]["peak_tflops"] = [100]
    assert fails(data, "must be a mapping").field == "gpu.peak_tflops"


@pytest.mark.parametrize("text, got", [("", "an empty file"), ("- 1\n- 2\n", "a YAML list"),
                                       ("just text\n", "a YAML str")])
def test_a_file_that_is_no_mapping_says_how_to_fix_it(tmp_path: Path, text, got):
    path = tmp_path / "hw.yaml"
    path.write_text(text)
    with pytest.raises(ProfileError, match=f"a profile must be a YAML mapping, got {got}") as err:
        load_profile(path)
    message = str(err.value)
    assert message.startswith(str(path)) and "(fix: write sections schema_version, name, gpu" in message
    assert "\n" not in message


def test_output_curves_time_the_lm_head_and_sampling_of_their_shape_only():
    data = minimal()
    data["gpu"]["output"] = [
        {"kind": "lm_head", "hidden": 64, "vocab": 1000, "sequences": [1, 10], "time_us": [40, 400], "source": "m"},
        {"kind": "sampling", "hidden": 64, "vocab": 1000, "sequences": [1, 10], "time_us": [3, 30], "source": "m"}]
    profile = parse_profile(data, origin="toy.yaml")
    model = ModelSpec(name="toy", num_layers=2, num_experts=4, top_k=2, hidden_size=64, moe_intermediate_size=32,
                      vocab_size=1000)
    costs = CostModel(profile, model)
    assert costs.lm_head(1) == pytest.approx(40e-6) and costs.lm_head(10) == pytest.approx(400e-6)
    assert costs.sampling(10) == pytest.approx(30e-6)
    # an int8 LM head is the bf16 curve times the roofline ratio of a memory-bound GEMV: 1 byte per weight plus
    # a 2-byte scale per group of 128 (the default quant_group_size), over 2 bytes
    assert CostModel(profile, model, non_expert_dtype="int8").lm_head(1) == pytest.approx(40e-6 * (1 + 2 / 128) / 2)
    # a profile with halved memory bandwidth scales the memory-bound LM head of one sequence by 2
    slow = CostModel(profile.with_overrides({"gpu.mem_bandwidth_gbps": 500}), model)
    assert slow.lm_head(1) == pytest.approx(80e-6)
    # another vocabulary has no curve: the roofline
    other = CostModel(profile, ModelSpec(name="toy", num_layers=2, num_experts=4, top_k=2, hidden_size=64,
                                         moe_intermediate_size=32, vocab_size=2000))
    assert other.lm_head(1) == pytest.approx(other._gpu_roof(profile, 2.0 * 2000 * 64, 2000 * 64 * 2, "bf16"))


# -- plausibility ceilings -------------------------------------------------------------
def _set(data: dict, path: str, value) -> None:
    """Set ``path`` (dots between keys, a number for a list's item) of a profile dict to ``value``."""
    *parents, last = [int(p) if p.isdigit() else p for p in path.split(".")]
    node = data
    for part in parents:
        node = node[part]
    node[last] = value


@pytest.mark.parametrize("path, value, field, words", [
    ("gpu.expert_ffn.0.time_us.1", 1e308, "gpu.expert_ffn[0].time_us[1]", "3.6e+09 µs (one hour), got 1e+308"),
    ("gpu.launch_us", 1e308, "gpu.launch_us", "3.6e+09 µs (one hour), got 1e+308"),
    ("pcie.latency_us", 3.7e9, "pcie.latency_us", "3.6e+09 µs (one hour), got 3.7e+09"),
    pytest.param("sync.per_layer_us", 10**400, "sync.per_layer_us", "got more than 1e+308",
                 id="an-int-beyond-floats"),  # an OverflowError before
    ("pcie.h2d.gbps.0", 1e308, "pcie.h2d.gbps[0]", "1e+05 GB/s (100 TB/s), got 1e+308"),
    ("gpu.mem_bandwidth_gbps", 2e5, "gpu.mem_bandwidth_gbps", "1e+05 GB/s (100 TB/s)"),
    ("cpu.dram_bandwidth_gbps", 1e308, "cpu.dram_bandwidth_gbps", "1e+05 GB/s (100 TB/s)"),
    ("gpu.memory_gib", 200 * 1024, "gpu.memory_gib", "102400 GiB (100 TiB), got 204800"),
    ("pcie.d2h.size_bytes.0", 1e20, "pcie.d2h.size_bytes[0]", "bytes (100 TiB), got 1e+20"),
    ("gpu.peak_tflops.bf16", 1e308, "gpu.peak_tflops.bf16", "1e+06 TFLOPS (1 exaFLOPS)"),
    ("gpu.expert_ffn.0.tokens.1", 1e12, "gpu.expert_ffn[0].tokens[1]", "1e+09 (a billion), got 1e+12"),
    ("gpu.roofline_efficiency", 1.5, "gpu.roofline_efficiency", "must be at most 1, got 1.5"),
    ("pcie.bandwidth_scale", 1e308, "pcie.bandwidth_scale", "1000 (a factor), got 1e+308"),
])
def test_a_number_beyond_any_machine_is_refused_in_one_line_naming_field_and_unit(path, value, field, words):
    """A latency of 1e308 µs or a bandwidth of 1e308 GB/s was accepted (and 10**400 raised OverflowError)."""
    data = minimal()
    _set(data, path, value)
    err = fails(data, "must be at most")
    assert err.field == field and words in str(err) and "(fix: " in str(err)


def test_runtime_numbers_have_ceilings_too():
    raw = copy.deepcopy(load_profile("rtx4090").raw)
    raw["runtimes"]["llamacpp"]["host_us_per_step"] = 1e308
    with pytest.raises(ProfileError, match=r"llamacpp.host_us_per_step': must be at most 3.6e\+09 µs"):
        parse_profile(raw, origin="rtx4090.yaml")
    raw = copy.deepcopy(load_profile("rtx4090").raw)
    raw["runtimes"]["llamacpp"]["cpu_bandwidth_efficiency"] = 1e308
    with pytest.raises(ProfileError, match=r"cpu_bandwidth_efficiency': must be at most 1000 \(a factor\)"):
        parse_profile(raw, origin="rtx4090.yaml")


def test_numbers_at_the_ceilings_are_accepted():
    """The ceilings refuse only what no machine has: a one-hour latency, 100 TB/s, 100 TiB still load."""
    data = minimal()
    for path, value in (("gpu.launch_us", 3.6e9), ("gpu.mem_bandwidth_gbps", 1e5), ("gpu.memory_gib", 100 * 1024),
                        ("gpu.peak_tflops.bf16", 1e6), ("pcie.bandwidth_scale", 1000)):
        _set(data, path, value)
    data["gpu"]["expert_ffn"][0]["time_us"] = [10, 3.6e9]
    profile = parse_profile(data, origin="toy.yaml")
    assert profile.gpu.launch_us == 3.6e9 and profile.gpu.expert_ffn[0].curve.y[-1] == 3.6e9


def test_every_bundled_and_test_profile_is_within_the_ceilings():
    from tests.factories import profile_dict
    for path in sorted(PROFILE_DIR.glob("*.yaml")):
        load_profile(path)
    parse_profile(profile_dict(pcie_gbps=0.0001), origin="factory")
    parse_profile(profile_dict(pcie_gbps=1.0), origin="factory")


def test_an_override_beyond_the_ceiling_is_refused_naming_the_parameter():
    profile = parse_profile(minimal(), origin="toy.yaml")
    with pytest.raises(ProfileError) as err:
        profile.with_overrides({"gpu.launch_us": "1e308"})
    assert err.value.field == "--set" and "\n" not in str(err.value)
    assert str(err.value).startswith("field '--set': parameter 'hw.gpu.launch_us'=1e308 (toy.yaml's own: 10): "
                                     "must be at most 3.6e+09 µs (one hour), got 1e+308 (fix: write the time in µs")
    assert profile.with_overrides({"gpu.launch_us": "3600"}).gpu.launch_us == 3600


def test_a_bad_override_of_a_field_the_profile_leaves_unset_says_so():
    """`--set hw.pcie.bandwidth_scale=abc` said "(not in rtx4090.yaml)", which read as if the field did not
    exist; bandwidth_scale is a field the profile leaves at its default."""
    profile = load_profile(PROFILE_DIR / "rtx4090.yaml")
    with pytest.raises(ProfileError) as err:
        profile.with_overrides({"pcie.bandwidth_scale": "abc"})
    assert str(err.value) == (f"field '--set': parameter 'hw.pcie.bandwidth_scale'=abc ({PROFILE_DIR / 'rtx4090.yaml'}"
                              " does not set it): must be a number, got 'abc' (fix: write a number for "
                              "'bandwidth_scale')")


@pytest.mark.parametrize("how", ["file", "--set"])
def test_replay_with_an_absurd_profile_number_exits_2_with_one_line(tmp_path: Path, capsys, how):
    from moesim.cli import main
    from tests.factories import write_trace_and_profile
    trace, hw = write_trace_and_profile(tmp_path, seed=0)
    args = ["replay", trace, "--hw", hw, "--system", "gpu-only-lru"]
    if how == "file":
        data = yaml.safe_load(Path(hw).read_text())
        data["gpu"]["expert_ffn"][0]["time_us"][1] = 1e308
        Path(hw).write_text(yaml.safe_dump(data))
    else:
        args += ["--set", "hw.sync.per_layer_us=1e308"]
    assert main(args) == 2
    err = capsys.readouterr().err
    assert err.count("\n") == 1 and "Traceback" not in err
    field = "gpu.expert_ffn[0].time_us[1]" if how == "file" else "--set"
    assert f"field '{field}'" in err and "must be at most 3.6e+09 µs (one hour), got 1e+308" in err
    assert (hw in err) if how == "file" else ("parameter 'hw.sync.per_layer_us'=1e+308" in err)


@pytest.mark.parametrize("where, value, field", [("h2d_gbps", -26.19, "pcie.h2d.gbps[0]"),
                                                 ("h2d_bytes", "512MiB", "pcie.h2d.size_bytes[0]")])
def test_a_bad_curve_point_is_named_with_its_value(tmp_path: Path, capsys, where, value, field):
    """A negative bandwidth in pcie.h2d said "field 'pcie.h2d': curve values must be positive numbers (fix:
    fix the tabulated values)": neither the point nor the value. The field is now the point itself."""
    from moesim.cli import main
    data = yaml.safe_load((PROFILE_DIR / "rtx4090.yaml").read_text())
    data["pcie"]["h2d"]["gbps" if where == "h2d_gbps" else "size_bytes"][0] = value
    path = tmp_path / "bad.yaml"
    path.write_text(yaml.safe_dump(data))
    with pytest.raises(ProfileError) as err:
        load_profile(path)
    assert err.value.field == field and f"got {value!r}" in str(err.value)
    trace = Path(__file__).resolve().parents[2] / "traces" / "mixtral-8x7b-humaneval.parquet"
    assert main(["replay", str(trace), "--hw", str(path)]) == 2
    err_text = capsys.readouterr().err
    assert err_text.count("\n") == 1 and f"{path}, field '{field}': curve values must be positive numbers, got " \
        f"{value!r} (fix: write every value of '{field.split('.')[-1].split('[')[0]}' as a number above 0)" in err_text
