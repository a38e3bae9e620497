"""Mutations that turn a valid trace, trace file or hardware profile into a clearly invalid one.

Each mutation takes the valid object and a random generator (for the row, column or value it breaks).
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Any, Callable

import numpy as np
import pyarrow as pa
import pyarrow.parquet as pq
import yaml

from moesim.trace.schema import META_KEY, SCORE_BYTES, score_rows, scores_to_arrow


def _table(path: Path) -> pa.Table:
    return pq.read_table(path)


def _meta(table: pa.Table) -> dict[str, Any]:
    return json.loads(table.schema.metadata[META_KEY])


def _with_meta(table: pa.Table, meta: Any, raw: bytes | None = None) -> pa.Table:
    text = raw if raw is not None else json.dumps(meta).encode()
    return table.replace_schema_metadata({META_KEY: text})


def _set(table: pa.Table, name: str, array: pa.Array) -> pa.Table:
    i = table.schema.get_field_index(name)
    return table.set_column(i, pa.field(name, array.type), array)


def _list_column(table: pa.Table, name: str, values: np.ndarray, typ: pa.DataType | None = None) -> pa.Table:
    width = values.shape[1]
    inner = pa.array(values.reshape(-1), type=typ)
    return _set(table, name, pa.FixedSizeListArray.from_arrays(inner, width))


# ----------------------------------------------------------------------------- trace mutations
def _matrix(table: pa.Table, name: str) -> np.ndarray:
    col = table.column(name).combine_chunks()
    if pa.types.is_fixed_size_binary(col.type):  # scores as written: float16 values in one binary per row
        return score_rows(col, col.type.byte_width // SCORE_BYTES).copy()
    return col.flatten().to_numpy(zero_copy_only=False).reshape(len(col), -1).copy()


def _ints(table: pa.Table, name: str) -> np.ndarray:
    return table.column(name).to_numpy().copy()


def trace_mutations() -> dict[str, Callable[[pa.Table, np.random.Generator], pa.Table | bytes]]:
    """name -> mutation of a valid table (or of the file's bytes when it returns bytes)."""
    def expert_value(value: int) -> Callable:
        def mutate(t: pa.Table, rng: np.random.Generator) -> pa.Table:
            e = _matrix(t, "experts")
            e[rng.integers(len(e)), rng.integers(e.shape[1])] = value
            return _list_column(t, "experts", e, pa.int16())
        return mutate

    def duplicate_expert(t, rng):
        e = _matrix(t, "experts")
        r = rng.integers(len(e))
        e[r, 1] = e[r, 0]
        return _list_column(t, "experts", e, pa.int16())

    def float_matrix(name: str, value: float, typ: pa.DataType, as_list: bool = False) -> Callable:
        """One value set to ``value``; scores written back as stored, or in version 1's list form."""
        def mutate(t, rng):
            m = _matrix(t, name).astype(np.float64)
            m[rng.integers(len(m)), rng.integers(m.shape[1])] = value
            if name == "scores" and not as_list:
                return _set(t, name, scores_to_arrow(m, m.shape[1]))
            return _list_column(t, name, m, typ)
        return mutate

    def scores_width(t, rng):
        m = _matrix(t, "scores")
        return _set(t, "scores", scores_to_arrow(m[:, :-1], m.shape[1] - 1))

    def unnormalised(t, rng):
        w = _matrix(t, "weights")
        w[rng.integers(len(w))] *= 0.5
        return _list_column(t, "weights", w, pa.float32())

    def weights_ascending(t, rng):
        w = _matrix(t, "weights")
        r = rng.integers(len(w))
        w[r] = w[r][::-1]
        if w[r][0] == w[r][1]:
            w[r] = [0.4, 0.6]
        return _list_column(t, "weights", w, pa.float32())

    def scalar(name: str, value: int) -> Callable:
        def mutate(t, rng):
            v = _ints(t, name)
            v[rng.integers(len(v))] = value
            return _set(t, name, pa.array(v, type=t.schema.field(name).type))
        return mutate

    def swap_rows(t, rng):
        i = int(rng.integers(len(t) - 1))
        order = np.arange(len(t))
        order[i], order[i + 1] = order[i + 1], order[i]
        return t.take(pa.array(order))

    def duplicate_row(t, rng):
        i = int(rng.integers(len(t)))
        order = np.insert(np.arange(len(t)), i, i)
        return t.take(pa.array(order))

    def positions_backwards(t, rng):
        # the last decode step repeats an earlier position for every row of one request
        pos, step, req = _ints(t, "position"), _ints(t, "step"), _ints(t, "request")
        last = step == step.max()
        r = int(rng.integers(req.max() + 1))
        pos[last & (req == r)] = int(rng.integers(0, 2))
        return _set(t, "position", pa.array(pos, type=pa.int32()))

    def prefill_after_decode(t, rng):
        phase = np.array(t.column("phase").to_pylist())
        step = _ints(t, "step")
        phase[step == step.max()] = "prefill"
        return _set(t, "phase", pa.DictionaryArray.from_arrays(
            pa.array([0 if p == "prefill" else 1 for p in phase], type=pa.int8()), pa.array(["prefill", "decode"])))

    def bad_phase(t, rng):
        phase = t.column("phase").to_pylist()
        phase[int(rng.integers(len(phase)))] = rng.choice(["Decode", "", "generate", "prefil"])
        return _set(t, "phase", pa.array(phase, type=pa.string()))

    def null_in(name: str) -> Callable:
        def mutate(t, rng):
            values = t.column(name).to_pylist()
            r = int(rng.integers(len(values)))
            if isinstance(values[r], list) and rng.random() < 0.5:
                values[r] = [None] + values[r][1:]
            else:
                values[r] = None
            typ = t.schema.field(name).type
            if pa.types.is_dictionary(typ):
                typ = pa.string()
            return _set(t, name, pa.array(values, type=typ))
        return mutate

    def drop(name: str) -> Callable:
        return lambda t, rng: t.drop_columns([name])

    def all_null(name: str) -> Callable:
        def mutate(t, rng):
            typ = t.schema.field(name).type
            if pa.types.is_dictionary(typ):
                typ = pa.string()
            return _set(t, name, pa.nulls(len(t), type=typ))
        return mutate

    def retype(name: str, typ: pa.DataType) -> Callable:
        def mutate(t, rng):
            values = t.column(name).to_pylist()
            if pa.types.is_string(typ):
                values = [str(v) for v in values]
            elif pa.types.is_floating(typ):
                values = [float(v) + 0.5 for v in values]
            return _set(t, name, pa.array(values, type=typ))
        return mutate

    def variable_width(t, rng):
        e = _matrix(t, "experts").tolist()
        r = int(rng.integers(len(e)))
        e[r] = e[r] + [5 if 5 not in e[r] else 4]
        return _set(t, "experts", pa.array(e, type=pa.list_(pa.int16())))

    def no_rows(t, rng):
        return t.slice(0, 0)

    def meta_field(path: tuple[str, ...], value: Any) -> Callable:
        def mutate(t, rng):
            meta = _meta(t)
            node = meta
            for key in path[:-1]:
                node = node[key]
            node[path[-1]] = value
            return _with_meta(t, meta)
        return mutate

    def meta_drop(path: tuple[str, ...]) -> Callable:
        def mutate(t, rng):
            meta = _meta(t)
            node = meta
            for key in path[:-1]:
                node = node[key]
            del node[path[-1]]
            return _with_meta(t, meta)
        return mutate

    def meta_raw(raw: bytes) -> Callable:
        return lambda t, rng: _with_meta(t, None, raw)

    def deep_meta(t, rng):
        depth = int(rng.integers(100, 100_000))
        meta = _meta(t)
        meta["source"] = {"x": "[" * depth + "]" * depth}
        text = json.dumps(meta).replace('"[' + "[" * (depth - 1), "[" * depth).replace("]" * depth + '"', "]" * depth)
        return _with_meta(t, None, text.encode())

    def no_meta(t, rng):
        return t.replace_schema_metadata({})

    def top_k_mismatch(t, rng):
        meta = _meta(t)
        meta["model"]["top_k"] = int(rng.choice([1, 3, 4]))
        return _with_meta(t, meta)

    muts: dict[str, Callable] = {
        "expert_id_out_of_range": expert_value(99), "expert_id_negative": expert_value(-1),
        "expert_id_at_num_experts": expert_value(6), "duplicate_expert": duplicate_expert,
        "weight_nan": float_matrix("weights", float("nan"), pa.float32()),
        "weight_inf": float_matrix("weights", float("inf"), pa.float32()),
        "weight_negative": float_matrix("weights", -0.3, pa.float32()),
        "weights_unnormalised": unnormalised, "weights_not_highest_first": weights_ascending,
        "score_nan": float_matrix("scores", float("nan"), pa.float16()),
        "score_inf": float_matrix("scores", float("-inf"), pa.float16()),
        "score_negative": float_matrix("scores", -0.5, pa.float16()),
        "score_above_one": float_matrix("scores", 7.0, pa.float16()),
        "score_nan_as_list": float_matrix("scores", float("nan"), pa.float16(), as_list=True),
        "score_above_one_as_list": float_matrix("scores", 7.0, pa.float16(), as_list=True),
        "scores_one_expert_short": scores_width,
        "step_negative": scalar("step", -1), "position_negative": scalar("position", -5),
        "request_negative": scalar("request", -2), "token_id_negative": scalar("token_id", -9),
        "layer_out_of_range": scalar("layer", 7), "layer_negative": scalar("layer", -1),
        "rows_unsorted": swap_rows, "duplicate_row": duplicate_row,
        "positions_backwards": positions_backwards, "prefill_after_decode": prefill_after_decode,
        "phase_unknown": bad_phase, "no_rows": no_rows, "top_k_mismatch": top_k_mismatch,
        "experts_variable_width": variable_width,
        "schema_version_true": meta_field(("schema_version",), True),
        "schema_version_string": meta_field(("schema_version",), "1"),
        "schema_version_float": meta_field(("schema_version",), 1.5),
        "schema_version_3": meta_field(("schema_version",), 3),
        "schema_version_0": meta_field(("schema_version",), 0),
        "schema_version_missing": meta_drop(("schema_version",)),
        "num_layers_1e9": meta_field(("model", "num_layers"), 1e9),
        "num_layers_int_1e9": meta_field(("model", "num_layers"), 10**9),
        "num_experts_int_1e9": meta_field(("model", "num_experts"), 10**9),
        "num_experts_true": meta_field(("model", "num_experts"), True),
        "num_layers_zero": meta_field(("model", "num_layers"), 0),
        "top_k_zero": meta_field(("model", "top_k"), 0),
        "hidden_negative": meta_field(("model", "hidden_size"), -64),
        "expert_matrices_zero": meta_field(("model", "expert_matrices"), 0),
        "quant_group_size_zero": meta_field(("model", "quant_group_size"), 0),
        "expert_dtype_unknown": meta_field(("model", "expert_dtype"), "fp3"),
        "model_unknown_field": meta_field(("model", "num_expertz"), 8),
        "model_not_object": meta_field(("model",), [1, 2]),
        "model_missing": meta_drop(("model",)),
        "source_not_object": meta_field(("source",), "fuzz"),
        "renormalized_not_bool": meta_field(("weights_renormalized",), "yes"),
        "meta_not_json": meta_raw(b"{not json"), "meta_not_object": meta_raw(b"[1, 2, 3]"),
        "meta_not_utf8": meta_raw(b"\xff\xfe{}"), "meta_huge": meta_raw(b'{"x": "' + b"a" * (2 << 20) + b'"}'),
        "meta_deep": deep_meta, "meta_missing": no_meta,
    }
    for col in ("request", "step", "phase", "position", "layer", "experts"):
        muts[f"missing_{col}"] = drop(col)
        muts[f"all_null_{col}"] = all_null(col)
        muts[f"null_in_{col}"] = null_in(col)
    for col in ("weights", "scores", "token_id"):
        muts[f"null_in_{col}"] = null_in(col)
        muts[f"all_null_{col}"] = all_null(col)
    muts.update({"step_as_string": retype("step", pa.string()), "layer_as_float": retype("layer", pa.float64()),
                 "position_as_float": retype("position", pa.float32()),
                 "token_id_as_string": retype("token_id", pa.string())})
    return muts


def byte_mutations() -> dict[str, Callable[[bytes, np.random.Generator], bytes]]:
    def magic(data, rng):
        return bytes(rng.choice([b"PAR0", b"\x00\x00\x00\x00", b"par1", b"ZIP1"])) + data[4:]

    def tail_magic(data, rng):
        return data[:-4] + b"PARX"

    def garble(data, rng):
        buf = bytearray(data)
        start = int(rng.integers(4, max(5, len(buf) // 2)))
        for i in range(start, min(len(buf) - 8, start + int(rng.integers(16, 512)))):
            buf[i] = int(rng.integers(256))
        return bytes(buf)

    def truncate(data, rng):
        return data[:int(rng.integers(0, len(data) - 1))]

    return {"wrong_magic": magic, "wrong_tail_magic": tail_magic, "garbled_pages": garble, "truncated": truncate,
            "not_parquet": lambda d, rng: [b"", b"hello\n", b"PAR1", b"PAR1PAR1",
                                           b"PAR1" + b"\x00" * 20 + b"PAR1"][int(rng.integers(5))]}


# ----------------------------------------------------------------------------- profiles
def profile_mutations() -> dict[str, Callable[[dict, np.random.Generator], str | bytes]]:
    def field_value(path: tuple, value: Any) -> Callable:
        def mutate(d, rng):
            node = d
            for key in path[:-1]:
                node = node[key]
            node[path[-1]] = value
            return yaml.safe_dump(d)
        return mutate

    def raw(text: str | bytes) -> Callable:
        return lambda d, rng: text

    laughs = "a: &a [lol, lol, lol, lol, lol, lol, lol, lol, lol]\n" + "".join(
        f"{c}: &{c} [{', '.join(['*' + p] * 9)}]\n" for p, c in zip("abcdefgh", "bcdefghi"))
    nan, inf = float("nan"), float("inf")
    muts: dict[str, Callable] = {
        "pcie_bandwidth_nan": field_value(("pcie", "h2d", "gbps"), [nan, nan]),
        "pcie_bandwidth_inf": field_value(("pcie", "d2h", "gbps"), [inf, 1.0]),
        "roofline_efficiency_5": field_value(("gpu", "roofline_efficiency"), 5),
        "bandwidth_efficiency_2": field_value(("cpu", "bandwidth_efficiency"), 2.0),
        "memory_gib_nan": field_value(("gpu", "memory_gib"), nan),
        "memory_gib_string": field_value(("gpu", "memory_gib"), "24 GiB"),
        "memory_gib_negative": field_value(("gpu", "memory_gib"), -24),
        "reserved_above_memory": field_value(("gpu", "reserved_gib"), 99),
        "cores_half": field_value(("cpu", "cores"), 0.5), "cores_fraction": field_value(("cpu", "cores"), 2.5),
        "cores_zero": field_value(("cpu", "cores"), 0), "cores_huge": field_value(("cpu", "cores"), 10**12),
        "peak_tflops_empty": field_value(("cpu", "peak_tflops"), {}),
        "gpu_peak_tflops_empty": field_value(("gpu", "peak_tflops"), {}),
        "peak_tflops_nan": field_value(("gpu", "peak_tflops", "bf16"), nan),
        "launch_us_negative": field_value(("gpu", "launch_us"), -5),
        "copy_engines_fraction": field_value(("pcie", "copy_engines"), 1.5),
        "duplex_slowdown_3": field_value(("pcie", "duplex_slowdown"), 3),
        "generation_string": field_value(("pcie", "generation"), "four"),
        "latency_inf": field_value(("pcie", "latency_us"), inf),
        "sync_nan": field_value(("sync", "per_layer_us"), nan),
        "curve_unknown_key": field_value(("pcie", "h2d", "gbpz"), [1, 2]),
        "expert_curve_unknown_key": field_value(("gpu", "expert_ffn", 0, "tokenz"), [1, 2]),
        "curve_time_nan": field_value(("gpu", "expert_ffn", 0, "time_us"), [nan, 1.0]),
        "curve_not_increasing": field_value(("cpu", "expert_ffn", 0, "tokens"), [100, 1]),
        "curve_no_source": field_value(("pcie", "h2d", "source"), ""),
        "unknown_section_key": field_value(("gpu", "memory_gb"), 24),
        "schema_version_true": field_value(("schema_version",), True),
        "cuda_graph_string": field_value(("gpu", "cuda_graph"), "yes"),
        "gpu_not_mapping": field_value(("gpu",), [1, 2]),
        "name_mapping": field_value(("gpu", "name"), {"a": 1}),
        "duplicate_keys": lambda d, rng: yaml.safe_dump(d) + "schema_version: 1\n",
        "billion_laughs": raw(laughs), "python_tag": raw("a: !!python/object/apply:os.system ['true']\n"),
        "python_name_tag": raw("gpu: !!python/name:os.system\n"), "unknown_tag": raw("gpu: !custom 3\n"),
        "not_utf8": raw(b"schema_version: 1\nname: \xff\xfe\n"),
        "utf16": lambda d, rng: yaml.safe_dump(d).encode("utf-16"),
        "empty": raw(""), "list": raw("- 1\n- 2\n"), "syntax_error": raw("gpu: [1, 2\n"),
        "binary": raw(b"\x00\x01\x02PAR1"), "huge": raw("# " + "x" * (5 << 20) + "\n"),
        "deep": raw("a: " + "[" * 5000 + "]" * 5000 + "\n"),
    }
    return muts
