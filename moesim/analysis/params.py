"""Documentation of ``--set`` parameters, read from the dataclasses that define them.

Components, the engine and the memory planner document each parameter with a
``#:`` comment above the field (Sphinx autodoc style), e.g.::

    #: kernel launches per GPU expert (gate/up GEMM, activation, down GEMM)
    kernels_per_expert: int = 3

:func:`parameter_docs` parses the class source with :mod:`ast` and
:mod:`tokenize` (not regular expressions over text): each annotated field gets
the ``#:`` comment lines directly above it, or its trailing ``#`` comment, as
its meaning. The unit comes from the name's suffix (``_gib``, ``_ms``, ...) or
from a unit in parentheses at the end of the comment.
"""

from __future__ import annotations

import ast
import dataclasses
import inspect
import io
import re
import textwrap
import tokenize
from dataclasses import dataclass
from typing import Any

#: units implied by a parameter name's suffix
SUFFIX_UNITS = {"_gib": "GiB", "_mib": "MiB", "_bytes": "bytes", "_gbps": "GB/s", "_ms": "ms", "_us": "us",
                "_s": "s", "_tflops": "TFLOP/s", "_pct": "%", "_tokens": "tokens", "_slots": "slots",
                "_experts": "experts", "_layers": "layers", "_steps": "steps"}
_UNIT_IN_TEXT = re.compile(r"\((?:in )?(GiB|MiB|bytes|GB/s|ms|us|s|seconds|tokens|experts|layers|steps)\)\s*$")


@dataclass(frozen=True)
class ParamDoc:
    """One parameter: name, default, type, unit ("" when none) and meaning ("" when undocumented)."""

    name: str
    default: Any
    type: str
    unit: str
    meaning: str


def _comments(source: str) -> dict[int, str]:
    """Line number (1-based) -> text of the comment on that line, for every comment token."""
    out: dict[int, str] = {}
    try:
        for tok in tokenize.generate_tokens(io.StringIO(source).readline):
            if tok.type == tokenize.COMMENT:
                out[tok.start[0]] = tok.string
    except (tokenize.TokenError, IndentationError):
        pass
    return out


def _field_comments(cls: type) -> dict[str, str]:
    """Field name -> its ``#:`` block above, else its trailing comment, from the class source."""
    try:
        source = textwrap.dedent(inspect.getsource(cls))
    except (OSError, TypeError):  # defined in a notebook or at the prompt: no source to read
        return {}
    comments = _comments(source)
    lines = source.splitlines()
    tree = ast.parse(source)
    body = next((node.body for node in tree.body if isinstance(node, ast.ClassDef)), [])
    out: dict[str, str] = {}
    previous: tuple[int, str] | None = None  # (last line, comment) of the field just above
    for node in body:
        if not isinstance(node, ast.AnnAssign) or not isinstance(node.target, ast.Name):
            previous = None
            continue
        block: list[str] = []
        line = node.lineno - 1
        while line >= 1 and lines[line - 1].strip().startswith("#:"):
            block.insert(0, comments.get(line, lines[line - 1].strip())[2:].strip())
            line -= 1
        trailing = comments.get(node.end_lineno or node.lineno, "")
        text = " ".join(block) if block else trailing.lstrip("#:").strip()
        if not block and not text and previous and previous[0] == node.lineno - 1:
            block = [previous[1]]  # one #: block above a run of fields documents them all
            text = previous[1]
        out[node.target.id] = text
        previous = (node.end_lineno or node.lineno, text) if block else None
    return out


def _unit(name: str, meaning: str) -> str:
    found = _UNIT_IN_TEXT.search(meaning)
    if found:
        return found.group(1)
    for suffix, unit in SUFFIX_UNITS.items():
        if name.endswith(suffix):
            return unit
    return ""


def _type_name(field: dataclasses.Field) -> str:
    kind = field.type if isinstance(field.type, str) else getattr(field.type, "__name__", str(field.type))
    return str(kind)


def parameter_docs(cls: type) -> list[ParamDoc]:
    """Every public dataclass field of ``cls`` (and its bases) with default, type, unit and meaning."""
    if not dataclasses.is_dataclass(cls):
        return []
    comments: dict[str, str] = {}
    for base in reversed(cls.__mro__):
        if dataclasses.is_dataclass(base):
            comments.update({k: v for k, v in _field_comments(base).items() if v or k not in comments})
    out = []
    for field in dataclasses.fields(cls):
        if field.name.startswith("_") or not field.init:  # state, not a parameter
            continue
        if field.default is not dataclasses.MISSING:
            default: Any = field.default
        elif field.default_factory is not dataclasses.MISSING:  # type: ignore[misc]
            default = field.default_factory()  # type: ignore[misc]
        else:
            default = None
        meaning = comments.get(field.name, "")
        out.append(ParamDoc(field.name, default, _type_name(field), _unit(field.name, meaning), meaning))
    return out


def system_parameter_docs(system: str) -> list[tuple[str, ParamDoc | None, str]]:
    """Rows ``(key, doc, note)`` for ``moesim systems NAME``: each role's component and its parameters,
    then the parameters every system takes (``engine.*``, ``memory.*``, ``cache.slots_per_layer``).

    A role row (``doc`` None) names the component in use and the alternatives ``--set ROLE=NAME`` swaps in.
    The system's own defaults (``SystemSpec.defaults``) replace the component's.
    """
    from moesim.policy.systems import COMPONENTS, ROLES, SYSTEMS
    from moesim.sim.config import SimConfig
    from moesim.sim.run import MemoryConfig
    spec = SYSTEMS[system]
    own = dict(spec.defaults)
    rows: list[tuple[str, ParamDoc | None, str]] = []
    members = spec.portfolio or (system,)
    seen: set[str] = set()
    for member in members:
        member_spec = SYSTEMS[member]
        member_own = {**dict(member_spec.defaults), **own}
        for role in ROLES:
            comp_name = member_spec.roles()[role]
            cls = COMPONENTS[role][comp_name]
            key = f"{role}={comp_name}"
            if key in seen:
                continue
            seen.add(key)
            others = [n for n in COMPONENTS[role] if n != comp_name]
            note = (f"{member}: " if spec.portfolio else "") + (
                f"swap with --set {role}=NAME, NAME one of: {', '.join(others)}" if others else "")
            rows.append((f"{role} = {comp_name}", None, "\n".join(p for p in (summary(cls), note) if p)))
            for doc in parameter_docs(cls):
                dotted = f"{role}.{doc.name}"
                if dotted in member_own:
                    doc = dataclasses.replace(doc, default=member_own[dotted])
                rows.append((dotted, doc, ""))
    slots = ParamDoc("slots_per_layer", None, "int", "experts",
                     "GPU cache slots per MoE layer (default: as many as fit in GPU memory)")
    rows.append(("cache.slots_per_layer", slots, "every system"))
    for section, cls in (("engine", SimConfig), ("memory", MemoryConfig)):
        for doc in parameter_docs(cls):
            dotted = f"{section}.{doc.name}"
            if dotted in own:
                doc = dataclasses.replace(doc, default=own[dotted])
            rows.append((dotted, doc, "every system"))
    return rows


def system_records() -> list[dict]:
    """What ``moesim systems`` lists, one record per system: name, description, whether ``all`` runs it,
    its runtime, its portfolio members (an oracle) or the component in each role."""
    from moesim.policy.systems import SYSTEMS
    return [{"name": system, "description": spec.description, "listed": spec.listed, "runtime": spec.runtime,
             "portfolio": list(spec.portfolio), **({} if spec.portfolio else spec.roles())}
            for system, spec in SYSTEMS.items()]


def system_rows(name: str) -> list[tuple[str, ParamDoc | None, str]]:
    """``system_parameter_docs`` of ``name`` with what every system also takes: ``cache.slots`` beside
    ``cache.slots_per_layer``, ``runtime`` with the system's own and the names it takes, and the dtypes
    ``memory.*_dtype`` take."""
    from moesim.model.spec import DTYPE_BITS
    from moesim.policy.systems import SYSTEMS
    dtypes = ", ".join(DTYPE_BITS)
    rows = []
    for key, doc, note in system_parameter_docs(name):
        if doc is not None and key in ("memory.non_expert_dtype", "memory.expert_dtype"):
            doc = dataclasses.replace(doc, meaning=f"{doc.meaning}; one of {dtypes}")
        rows.append((key, doc, note))
        if key == "cache.slots_per_layer":
            rows[-1] = (key, dataclasses.replace(doc, meaning=f"{doc.meaning}; one number for every layer or a "
                                                 "list of one per layer, e.g. [2,1,2,...]"), note)
            rows.append(("cache.slots", ParamDoc(
                "slots", None, "int", "experts",
                "GPU expert slots in all, spread over the layers by the system's cache (default: as many as fit "
                "in GPU memory); give it or cache.slots_per_layer"), note))
    rows.append(("runtime", ParamDoc(
        "runtime", SYSTEMS[name].runtime, "str", "",
        "the software the system runs on (kernel launches, CUDA Graph, CPU kernel efficiency): generic (the "
        "profile's gpu section), ideal (no launch or host costs) or a runtime of the profile (the bundled ones: "
        "ktransformers, ktransformers-eager, pytorch-eager, llamacpp)"), "every system"))
    return rows


def system_record(name: str, field: str = "NAME") -> dict:
    """What ``moesim systems NAME`` lists: the components in use and every parameter, each default as a value
    of its type. ``field`` names the argument in the error an unknown name gets."""
    from moesim.policy.systems import SYSTEMS, check_system_name
    check_system_name(name, field=field)
    rows = system_rows(name)
    return {"name": name, "description": SYSTEMS[name].description,
            "components": [{"role": key.partition(" = ")[0], "component": key.partition(" = ")[2], "about": note}
                           for key, doc, note in rows if doc is None],
            "parameters": [{"key": key, "default": typed_default(doc.default, doc.type), "type": doc.type,
                            "unit": doc.unit, "meaning": doc.meaning} for key, doc, _ in rows if doc is not None]}


def typed_default(default: object, kind: str) -> object:
    """A default as a value of its parameter's type: a system's own default is kept as the ``--set`` string
    that sets it, and ``moesim systems smoe-flex --json -`` gave prefetch.n "3" where smoe's reads -1."""
    if not isinstance(default, str):
        return default
    try:
        if kind == "int":
            return int(default)
        if kind == "float":
            return float(default)
    except ValueError:  # a per-layer list, say: as written
        return default
    if kind == "bool" and default.lower() in ("true", "false"):
        return default.lower() == "true"
    return default


def summary(cls: type) -> str:
    """First line of a class's own docstring ("" for the signature dataclasses make up)."""
    doc = (cls.__doc__ or "").strip()
    if not doc or doc.startswith(f"{cls.__name__}("):
        return ""
    return " ".join(doc.split("\n\n")[0].split())


def format_default(value: Any) -> str:
    if isinstance(value, str):
        return f'"{value}"' if value == "" else value
    if isinstance(value, bool):
        return str(value).lower()
    if isinstance(value, (tuple, list)):
        return ",".join(str(v) for v in value) or "(none)"
    return str(value)
