"""Spec stage: read spec files (YAML, TOML, JSON) into `AttentionSpec`, with readable errors.

Every problem, from a missing file to a cross-field rule, becomes a `Problem(location, message)`
inside one `SpecError`; `str(err)` is one `<source>: <location>: <message>` line per problem, so
the CLI can print it as is. Pydantic's error entries are translated here, never shown raw.
"""

from __future__ import annotations

import difflib
import hashlib
import json
import re
from collections.abc import Iterable, Mapping
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ValidationError

from fa4gen.spec.model import MASK_KINDS, MASK_TYPES, RULE_ERROR, AttentionSpec, show_value

try:
    import tomllib
except ModuleNotFoundError:  # Python 3.10
    try:
        import tomli as tomllib  # type: ignore[no-redef]
    except ModuleNotFoundError:
        tomllib = None  # type: ignore[assignment]

__all__ = [
    "DOCUMENT",
    "Problem",
    "SPEC_SUFFIXES",
    "SpecError",
    "discover_specs",
    "load_spec",
    "problems_from_validation_error",
    "spec_digest",
    "spec_from_dict",
    "spec_json_schema",
]

SPEC_SUFFIXES: tuple[str, ...] = (".yaml", ".yml", ".toml", ".json")
DOCUMENT = "<document>"  # location of problems that concern the whole file


@dataclass(frozen=True)
class Problem:
    """One thing wrong with a spec: where (dotted field path or <document>) and what."""

    location: str
    message: str

    def __str__(self) -> str:
        return f"{self.location}: {self.message}"


class SpecError(Exception):
    """A spec could not be loaded or validated; carries every problem found."""

    def __init__(self, source: str | Path, problems: Iterable[Problem]) -> None:
        self.source = str(source)
        self.problems = list(problems)
        super().__init__(self.source, self.problems)

    def lines(self) -> list[str]:
        return [f"{self.source}: {p}" for p in self.problems]

    def __str__(self) -> str:
        return "\n".join(self.lines())


def _document_error(source: str | Path, message: str) -> SpecError:
    return SpecError(source, [Problem(DOCUMENT, message)])


# --- public entry points ---------------------------------------------------------------------


def load_spec(path: str | Path) -> AttentionSpec:
    """Read and validate one spec file; the parser is chosen by the file suffix."""
    path = Path(path)
    if not path.exists():
        raise _document_error(path, "file not found")
    if path.is_dir():
        raise _document_error(path, "is a directory; expected a spec file")
    suffix = path.suffix.lower()
    if suffix not in SPEC_SUFFIXES:
        raise _document_error(
            path, f"unsupported file type {repr(path.suffix) if path.suffix else '(no suffix)'}"
            f"; expected one of {', '.join(SPEC_SUFFIXES)}"
        )
    try:
        text = path.read_text(encoding="utf-8-sig")  # a byte-order mark (Windows editors) is not content
    except UnicodeDecodeError:
        raise _document_error(path, "file is not valid UTF-8 text") from None
    except OSError as err:
        raise _document_error(path, f"cannot read file: {err.strerror or err}") from None
    if not text.strip():
        raise _document_error(path, "file is empty; expected a mapping of spec fields")
    data = _PARSERS[suffix](text, path)
    if data is None:
        raise _document_error(path, "file has no content; expected a mapping of spec fields")
    return spec_from_dict(data, source=str(path))


def spec_from_dict(data: Any, source: str = "<dict>") -> AttentionSpec:
    """Validate already-parsed data (e.g. a dict built in Python) into an AttentionSpec."""
    if not isinstance(data, Mapping):
        raise _document_error(
            source, f"expected a mapping of spec fields at the top level (got {_kind(data)})"
        )
    try:
        return AttentionSpec.model_validate(dict(data))
    except ValidationError as err:
        raise SpecError(source, problems_from_validation_error(err)) from None


def discover_specs(paths: Iterable[str | Path]) -> list[Path]:
    """Expand paths: files pass through, directories become their spec files (sorted)."""
    found: list[Path] = []
    for raw in paths:
        path = Path(raw)
        if path.is_dir():
            files = sorted(
                p for p in path.iterdir()
                if p.is_file() and p.suffix.lower() in SPEC_SUFFIXES and not p.name.startswith(".")
            )
            if not files:
                raise _document_error(
                    path, f"directory has no spec files ({', '.join(SPEC_SUFFIXES)})"
                )
            found.extend(files)
        elif path.exists():
            found.append(path)
        else:
            raise _document_error(path, "file or directory not found")
    unique: dict[Path, None] = dict.fromkeys(found)  # keep order, drop repeats
    return list(unique)


def spec_json_schema() -> dict[str, Any]:
    """The JSON Schema of a spec file (for editor completion and `fa4gen schema`)."""
    schema = AttentionSpec.model_json_schema()
    return {"$schema": "https://json-schema.org/draft/2020-12/schema", **schema}


def spec_digest(spec: AttentionSpec) -> str:
    """sha256 of the canonical JSON of the resolved spec (sorted keys, no whitespace)."""
    canonical = json.dumps(
        spec.model_dump(mode="json"), sort_keys=True, separators=(",", ":"), ensure_ascii=True
    )
    return hashlib.sha256(canonical.encode("utf-8")).hexdigest()


# --- parsers ---------------------------------------------------------------------------------


class _SpecYamlLoader(yaml.SafeLoader):
    """SafeLoader that rejects duplicate keys instead of silently keeping the last one."""


def _construct_unique_mapping(loader: _SpecYamlLoader, node: yaml.MappingNode, deep: bool = False):
    loader.flatten_mapping(node)
    seen: set[Any] = set()
    for key_node, _ in node.value:
        key = loader.construct_object(key_node, deep=deep)
        try:
            duplicate = key in seen
            seen.add(key)
        except TypeError:  # unhashable key: let construct_mapping report it
            continue
        if duplicate:
            raise yaml.constructor.ConstructorError(
                None, None, f"duplicate key {key!r}", key_node.start_mark
            )
    return loader.construct_mapping(node, deep=deep)


_SpecYamlLoader.add_constructor(
    yaml.resolver.BaseResolver.DEFAULT_MAPPING_TAG, _construct_unique_mapping
)


def _parse_yaml(text: str, source: Path) -> Any:
    try:
        return yaml.load(text, Loader=_SpecYamlLoader)  # noqa: S506 - a SafeLoader subclass
    except yaml.MarkedYAMLError as err:
        mark = err.problem_mark or err.context_mark
        what = "YAML error" if isinstance(err, yaml.constructor.ConstructorError) else (
            "YAML syntax error"
        )
        problem = err.problem or err.context or "invalid YAML"
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        raise _document_error(source, f"{what}{where}: {problem}") from None
    except yaml.YAMLError as err:
        raise _document_error(source, f"invalid YAML: {err}") from None
    except RecursionError:
        raise _document_error(source, "YAML error: nested too deeply") from None
    except (ValueError, TypeError, OverflowError) as err:  # a scalar the constructors cannot build
        # (an integer beyond Python's digit limit, a date like 2001-13-45, !!int "abc")
        raise _document_error(source, f"YAML error: {_short(err)}") from None


_TOML_AT_END = " (at end of document)"
_TOML_POSITION = re.compile(r"^(?P<msg>.*?)\s*\(at line (?P<line>\d+), column (?P<col>\d+)\)$")


def _parse_toml(text: str, source: Path) -> Any:
    if tomllib is None:
        raise _document_error(source, "reading TOML needs Python >= 3.11 or the tomli package")
    try:
        return tomllib.loads(text)
    except tomllib.TOMLDecodeError as err:
        detail = str(err)
        if match := _TOML_POSITION.match(detail):
            where = f" at line {match['line']}, column {match['col']}"
            detail = match["msg"]
        elif detail.endswith(_TOML_AT_END):
            where = f" at end of document (line {text.count(chr(10)) + 1})"
            detail = detail[: -len(_TOML_AT_END)]
        else:
            where = ""
        raise _document_error(source, f"TOML syntax error{where}: {detail}") from None
    except RecursionError:
        raise _document_error(source, "TOML error: nested too deeply") from None
    except (ValueError, TypeError, OverflowError) as err:  # e.g. an integer beyond Python's digit limit
        raise _document_error(source, f"TOML error: {_short(err)}") from None


def _short(err: Exception) -> str:
    text = str(err)
    return text if len(text) <= 160 else text[:157] + "..."


def _parse_json(text: str, source: Path) -> Any:
    def unique_object(pairs: list[tuple[str, Any]]) -> dict[str, Any]:
        out: dict[str, Any] = {}
        for key, value in pairs:
            if key in out:
                raise _document_error(source, f"JSON error: duplicate key {key!r}")
            out[key] = value
        return out

    try:
        return json.loads(text, object_pairs_hook=unique_object)
    except json.JSONDecodeError as err:
        raise _document_error(
            source, f"JSON syntax error at line {err.lineno}, column {err.colno}: {err.msg}"
        ) from None
    except ValueError as err:  # e.g. an integer beyond Python's digit limit for str -> int
        raise _document_error(source, f"JSON error: {_short(err)}") from None
    except RecursionError:
        raise _document_error(source, "JSON error: nested too deeply") from None


_PARSERS = {".yaml": _parse_yaml, ".yml": _parse_yaml, ".toml": _parse_toml, ".json": _parse_json}


# --- pydantic errors -> problems -------------------------------------------------------------


def problems_from_validation_error(err: ValidationError) -> list[Problem]:
    """Translate pydantic's error entries into located, readable Problems."""
    problems: list[Problem] = []
    for entry in err.errors(include_url=False):
        loc = _strip_union_tags(entry["loc"])
        if entry["type"] == RULE_ERROR:
            for field, message in entry["ctx"]["problems"]:
                problems.append(Problem(_dotted(loc + tuple(field.split(".") if field else ())),
                                        message))
            continue
        if entry["type"] in ("union_tag_invalid", "union_tag_not_found"):
            loc = loc + ("kind",)
        problems.append(Problem(_dotted(loc), _message(entry)))
    return problems


def _strip_union_tags(loc: tuple[Any, ...]) -> tuple[Any, ...]:
    # Pydantic puts the chosen mask variant into the path: ("mask", "chunked", "chunk_size").
    if len(loc) >= 2 and loc[0] == "mask" and loc[1] in MASK_KINDS:
        return (loc[0],) + loc[2:]
    return tuple(loc)


def _dotted(loc: tuple[Any, ...]) -> str:
    return ".".join(str(part) for part in loc) or DOCUMENT


def _message(entry: Mapping[str, Any]) -> str:
    kind, ctx, given = entry["type"], entry.get("ctx") or {}, entry.get("input")
    got = f"(got {show_value(given)})"
    if kind == "missing":
        return "required field is missing"
    if kind == "extra_forbidden":
        return _unknown_field_message(entry["loc"])
    if kind == "literal_error":
        return f"expected one of {ctx['expected'].replace(' or ', ', ')} {got}"
    if kind in ("union_tag_invalid", "union_tag_not_found"):
        options = ", ".join(repr(k) for k in MASK_KINDS)
        if kind == "union_tag_not_found":
            return f"required field is missing; expected one of {options}"
        return f"expected one of {options} (got {show_value(ctx.get('tag'))})"
    if kind in ("int_type", "int_parsing", "int_from_float"):
        if isinstance(given, bool):
            return f"expected an integer, not a boolean {got}"
        return f"expected an integer {got}"
    if kind in ("float_type", "float_parsing"):
        if isinstance(given, bool):
            return f"expected a number, not a boolean {got}"
        return f"expected a number {got}"
    if kind == "finite_number":
        return f"must be a finite number {got}"
    if kind in ("bool_type", "bool_parsing"):
        return f"expected true or false {got}"
    if kind == "string_type":
        return f"expected a string {got}"
    if kind in ("list_type", "tuple_type"):
        return f"expected a list {got}"
    if kind in ("model_type", "model_attributes_type", "dict_type", "model_class_type"):
        hint = " such as {kind: causal}" if tuple(entry["loc"][:1]) == ("mask",) else ""
        return f"expected a mapping{hint} {got}"
    if kind == "too_short":
        if ctx.get("min_length") == 1:
            return f"must not be empty {got}"
        return f"must have at least {ctx.get('min_length')} items {got}"
    if kind == "string_too_long":
        return f"must be at most {ctx['max_length']} characters (got {len(given)})"
    bounds = {"greater_than_equal": (">=", "ge"), "less_than_equal": ("<=", "le"),
              "greater_than": (">", "gt"), "less_than": ("<", "lt")}
    if kind in bounds:
        op, key = bounds[kind]
        return f"must be {op} {_number(ctx[key])} {got}"
    return str(entry["msg"])


def _unknown_field_message(loc: tuple[Any, ...]) -> str:
    allowed = _fields_at(loc[:-1])
    if allowed is None:
        return "unknown field"
    message = f"unknown field; allowed fields here: {', '.join(allowed)}"
    close = difflib.get_close_matches(str(loc[-1]), allowed, n=1)
    return message + (f" (did you mean {close[0]!r}?)" if close else "")


def _fields_at(loc: tuple[Any, ...]) -> list[str] | None:
    """Field names of the model at a raw pydantic location (union tags still in it)."""
    model: type[BaseModel] = AttentionSpec
    parts = list(loc)
    while parts:
        part = parts.pop(0)
        if model is AttentionSpec and part == "mask":
            if not parts or parts[0] not in MASK_TYPES:
                return None
            model = MASK_TYPES[parts.pop(0)]
            continue
        field = model.model_fields.get(part) if isinstance(part, str) else None
        annotation = field.annotation if field else None
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return None
        model = annotation
    return list(model.model_fields)


def _number(value: Any) -> str:
    if isinstance(value, float) and value.is_integer():
        return str(int(value))
    return repr(value)


def _kind(value: Any) -> str:
    names = {list: "a list", str: "a string", int: "an integer", float: "a number",
             bool: "a boolean", type(None): "null"}
    return names.get(type(value), type(value).__name__)
