"""The JSON types of a saved plan, checked before any field is used: a bad file is one PlanError.

A hand-edited or damaged plan file can hold any JSON; without this check a wrong type surfaces later as
a TypeError or AttributeError inside the report or the runtime. ``check_plan_dict`` walks the parsed
JSON against ``PLAN`` and names the first field of the wrong type by its path ("stages[0].ranks[1]").
(A dozen lines of walker instead of a JSON-Schema library: autopar depends on none, and the schema
reads as the dataclasses it mirrors.)
"""
from __future__ import annotations

from typing import Any

from autopar.errors import PlanError

INT, NUM, STR, BOOL = "integer", "number", "string", "boolean"
ANY = "any"


def list_of(item) -> tuple:
    return ("list", item)


def dict_of(value) -> tuple:
    return ("dict", value)


def pair(item) -> tuple:
    return ("pair", item)


def nullable(inner) -> tuple:
    return ("nullable", inner)


NODE_SHARDING = {"out": STR, "ins": list_of(STR), "kernels": list_of(("list", ANY))}
COLLECTIVE = {"src": STR, "dst": STR, "kind": STR, "axis": INT, "nbytes": NUM, "phase": STR, "seconds": NUM}
STAGE = {"index": INT, "ranks": list_of(INT), "mesh_shape": pair(INT), "submesh": pair(INT), "nodes": list_of(STR),
         "shardings": dict_of(NODE_SHARDING), "collectives": list_of(COLLECTIVE), "layers": nullable(pair(INT)),
         "predicted": dict_of(NUM), "inputs": dict_of(STR), "outputs": list_of(STR)}
PLAN = {"model": STR, "graph_fingerprint": STR, "input_signature": list_of(("list", ANY)), "cluster": dict_of(ANY),
        "stages": list_of(STAGE), "microbatches": INT, "schedule": STR, "optimizer": STR, "predicted": dict_of(NUM),
        "planner": dict_of(ANY), "repeated_blocks": dict_of(list_of(list_of(STR))), "node_ops": dict_of(STR),
        "node_layers": dict_of(INT), "transfers": list_of(dict_of(ANY)), "virtual_stages": INT, "version": INT}
REQUIRED = ("model", "graph_fingerprint", "input_signature", "cluster", "stages")


def check_plan_dict(d: Any) -> None:
    if not isinstance(d, dict):
        raise PlanError(f"plan JSON must be an object, got {_name(d)}")
    missing = [k for k in REQUIRED if k not in d]
    if missing:
        raise PlanError(f"plan JSON is missing {missing}; regenerate it with autopar.plan(...)")
    _check(d, PLAN, "plan")
    for i, (shape, dtype) in enumerate(_pairs(d["input_signature"], "plan.input_signature")):
        _check(shape, list_of(INT), f"plan.input_signature[{i}][0]")
        _check(dtype, STR, f"plan.input_signature[{i}][1]")


def _pairs(items: list, where: str) -> list:
    for i, item in enumerate(items):
        if len(item) != 2:
            raise PlanError(f"{where}[{i}] must be [shape, dtype], got {len(item)} entries; re-plan")
    return items


def _check(value: Any, schema, where: str) -> None:
    if isinstance(schema, dict):  # a record: the fields present must have their types (others are ignored)
        if not isinstance(value, dict):
            _fail(where, "an object", value)
        for key, inner in schema.items():
            if key in value:
                _check(value[key], inner, f"{where}.{key}")
    elif isinstance(schema, tuple):
        _check_container(value, schema, where)
    elif schema != ANY and not _is(value, schema):
        _fail(where, f"a {schema}", value)


def _check_container(value: Any, schema: tuple, where: str) -> None:
    kind, inner = schema
    if kind == "nullable":
        if value is not None:
            _check(value, inner, where)
    elif kind == "dict":
        if not isinstance(value, dict):
            _fail(where, "an object", value)
        for key, item in value.items():
            _check(item, inner, f"{where}[{key!r}]")
    else:  # list or pair
        if not isinstance(value, list) or (kind == "pair" and len(value) != 2):
            _fail(where, "a list of 2" if kind == "pair" else "a list", value)
        for i, item in enumerate(value):
            _check(item, inner, f"{where}[{i}]")


def _is(value: Any, kind: str) -> bool:
    if kind == STR:
        return isinstance(value, str)
    if kind == BOOL:
        return isinstance(value, bool)
    if isinstance(value, bool):
        return False
    return isinstance(value, int) if kind == INT else isinstance(value, (int, float))


def _fail(where: str, expected: str, value: Any) -> None:
    raise PlanError(f"malformed plan JSON: {where} must be {expected}, got {_name(value)} {_short(value)}; "
                    f"regenerate it with autopar.plan(...).to_json() or `autopar plan`")


def _name(value: Any) -> str:
    return {dict: "an object", list: "a list", str: "a string", bool: "a boolean", type(None): "null"}.get(
        type(value), f"a {type(value).__name__}")


def _short(value: Any) -> str:
    text = repr(value)
    return text if len(text) <= 40 else text[:37] + "..."
