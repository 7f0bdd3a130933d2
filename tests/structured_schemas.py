"""Constraints for structured-output tests and benchmarks: JSON schemas of varied shape,
regexes, choices and a small Lark grammar, each with a short prompt asking for it.

Data only (no tests): tests/test_structured_schemas.py runs them on the default model, and
the jump-forward tests and benchmarks/bench_structured.py import them too.

Every free string has a maxLength and every array a maxItems, so that outputs sampled at
temperature 1 end well within ~200 tokens (an output cut by max_tokens would not parse).
The formats used (date, email, uuid, date-time) are ones llguidance 1.9.1 enforces; a format
it refuses ("format": "frob") is a bad constraint, tested with the others.
"""

from __future__ import annotations

from typing import Any

Schema = dict[str, Any]


def _obj(required: list[str] | None = None, **properties: Schema) -> Schema:
    """A closed object: the given properties, all required unless `required` says which."""
    return {"type": "object", "properties": properties,
            "required": list(properties) if required is None else required,
            "additionalProperties": False}


def _str(max_length: int, **kw: Any) -> Schema:
    return {"type": "string", "maxLength": max_length, **kw}


def _int(lo: int, hi: int) -> Schema:
    return {"type": "integer", "minimum": lo, "maximum": hi}


_POINT = _obj(x=_int(-100, 100), y=_int(-100, 100))

# (name, schema, prompt)
SCHEMAS: list[tuple[str, Schema, str]] = [
    ("person", _obj(name=_str(24), age=_int(0, 120)),
     "Give a person's name and age as JSON."),
    ("tag_list", _obj(tags={"type": "array", "minItems": 2, "maxItems": 4,
                            "items": _str(12)}),
     "List a few tags for a cooking blog as JSON."),
    ("enum_and_number", _obj(color={"enum": ["red", "green", "blue"]},
                             score={"type": "number", "minimum": 0, "maximum": 1}),
     "Pick a color and a score between 0 and 1, as JSON."),
    ("nested_3_levels", _obj(user=_obj(name=_str(16), address=_obj(
        city=_str(20), zip=_str(5, pattern="^[0-9]{5}$")))),
     "Describe a user with an address as JSON."),
    ("any_of_id", _obj(id={"anyOf": [_int(0, 99999), _str(8)]}, ok={"type": "boolean"}),
     "Give an id and whether it is ok, as JSON."),
    ("ref_defs", {"$defs": {"point": _POINT}, **_obj(
        start={"$ref": "#/$defs/point"}, end={"$ref": "#/$defs/point"})},
     "Give the start and end points of a line as JSON."),
    ("optional_fields", _obj(["title"], title=_str(30), year=_int(1900, 2030),
                             note=_str(10)),
     "Describe a movie as JSON."),
    ("top_level_int_array", {"type": "array", "items": _int(1, 9),
                             "minItems": 3, "maxItems": 3},
     "Give three digits as a JSON array."),
    ("const_version", _obj(version={"const": "1.0"}, enabled={"type": "boolean"}),
     "Give a config with a version and an enabled flag as JSON."),
    ("date_format", _obj(event=_str(20), day={"type": "string", "format": "date"}),
     "Name an event and its date as JSON."),
    ("email_format", _obj(name=_str(20), email={"type": "string", "format": "email",
                                                "maxLength": 40}),
     "Give a contact's name and email as JSON."),
    ("uuid_format", _obj(id={"type": "string", "format": "uuid"}, label=_str(12)),
     "Give a record with a UUID and a label as JSON."),
    ("date_time_format", _obj(level={"enum": ["info", "warn", "error"]},
                              at={"type": "string", "format": "date-time"}),
     "Give a log entry with a level and a timestamp as JSON."),
    ("one_of_shapes", {"oneOf": [
        _obj(kind={"const": "circle"}, radius=_int(1, 50)),
        _obj(kind={"const": "square"}, side=_int(1, 50))]},
     "Describe a circle or a square as JSON."),
    ("nullable", _obj(first=_str(16), middle={"type": ["string", "null"], "maxLength": 16},
                      nothing={"type": "null"}),
     "Give a first and middle name as JSON."),
    ("booleans", _obj(admin={"type": "boolean"}, active={"type": "boolean"},
                      verified={"type": "boolean"}),
     "Give a user's flags as JSON."),
    ("array_of_objects", _obj(items={"type": "array", "minItems": 1, "maxItems": 3,
                                     "items": _obj(sku=_str(8, pattern="^[A-Z]{2}[0-9]{3}$"),
                                                   qty=_int(1, 10))}),
     "List the items of an order as JSON."),
    ("exclusive_ranges", _obj(
        ratio={"type": "number", "exclusiveMinimum": 0, "exclusiveMaximum": 1},
        count={"type": "integer", "exclusiveMinimum": 0, "maximum": 1000}),
     "Give a ratio and a count as JSON."),
    ("required_subset", _obj(["sku", "price"], sku=_str(10), price=_int(0, 10000),
                             color=_str(10), stock=_int(0, 500)),
     "Describe a product as JSON."),
    ("patterns", _obj(code=_str(8, pattern="^[A-Z]{3}-[0-9]{4}$"),
                      phone=_str(12, pattern="^\\+[0-9]{1,3} [0-9]{6,8}$")),
     "Give a product code and a phone number as JSON."),
    ("mixed_enum", _obj(value={"enum": [1, "two", None, True, 4.5]}),
     "Pick a value as JSON."),
    ("top_level_object_array", {"type": "array", "minItems": 1, "maxItems": 3,
                                "items": _POINT},
     "List a few points as a JSON array."),
    ("matrix", _obj(rows={"type": "array", "minItems": 2, "maxItems": 3, "items": {
        "type": "array", "minItems": 2, "maxItems": 3, "items": _int(-9, 9)}}),
     "Give a small matrix of integers as JSON."),
]

# A recursive schema ($ref to itself). JSON Schema cannot bound its depth (maxItems bounds
# only the width), and the default model tends to nest until max_tokens at temperature 1
# (measured: 2 of 5 seeds hit 200 tokens; a children-array form nests at every seed, even
# greedy), so it is not in SCHEMAS: the tests run it greedy only, which ends in 13 tokens.
RECURSIVE: tuple[str, Schema, str] = (
    "recursive_manager",
    {"$defs": {"employee": _obj(["name"], name=_str(12),
                                manager={"$ref": "#/$defs/employee"})},
     "$ref": "#/$defs/employee"},
    "Describe an employee as JSON.")

# (name, regex, prompt): the whole output must match (re.fullmatch).
REGEXES: list[tuple[str, str, str]] = [
    ("phone", r"\(\d{3}\) \d{3}-\d{4}", "Give a phone number."),
    ("iso_date", r"(19|20)\d{2}-(0[1-9]|1[0-2])-(0[1-9]|[12]\d|3[01])", "Give a date."),
    ("word_list", r"[a-z]{1,10}(, [a-z]{1,10}){1,3}", "Name some animals."),
]

# (name, choices, prompt): the output must be one of the choices.
CHOICES: list[tuple[str, list[str], str]] = [
    ("yes_no", ["yes", "no", "it depends"], "Is the sky blue?"),
    ("sentiment", ["positive", "negative", "neutral"], "How does 'I love it' sound?"),
]

# Arithmetic over small integers; LARK_PROMPT asks for an expression.
LARK = """\
start: expr
expr: term (OP term){0,3}
term: NUMBER | "(" expr ")"
OP: " + " | " - " | " * "
NUMBER: /[0-9]{1,3}/
"""
LARK_PROMPT = "Write an arithmetic expression."
