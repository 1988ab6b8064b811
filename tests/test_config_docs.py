"""docs/configuration.md and examples/narwhal.yaml say what the config model does.

The keys of the doc's tables are the config model's keys, walked from the pydantic models in
`narwhal.config` (a section's keys as `section.key`, a list of entries' as `engines[].key`),
and each stated default is the model's: a literal (`256`, `not set`, `{}`) must equal the
field's default; `required` is a field without one (or `engines`, whose default the fleet
rules refuse); `see below` is a section; any other words describe a default derived at
validation (the field's default is then None). The example must load, name no key the model
lacks (commented-out ones included), and every plain `Default: X.` it states must be the
model's.
"""

from __future__ import annotations

import re
import types
import typing
from enum import Enum
from pathlib import Path
from typing import Any

import pytest
import yaml
from pydantic import BaseModel
from pydantic.fields import FieldInfo
from pydantic_core import PydanticUndefined

from narwhal.config import Config, ConfigError, load_config, parse_config

ROOT = Path(__file__).resolve().parents[1]
DOC = ROOT / "docs" / "configuration.md"
EXAMPLE = ROOT / "examples" / "narwhal.yaml"

REQUIRED = object()  # a field without a default


def _entry_model(annotation: Any) -> type[BaseModel] | None:
    """The model of a section (`serving`) or of a list's entries (`engines`), else None."""
    if isinstance(annotation, type) and issubclass(annotation, BaseModel):
        return annotation
    origin = typing.get_origin(annotation)
    if origin in (tuple, list):
        args = [a for a in typing.get_args(annotation) if a is not Ellipsis]
        if len(args) == 1 and isinstance(args[0], type) and issubclass(args[0], BaseModel):
            return args[0]
    if origin in (typing.Union, types.UnionType):
        models = [m for m in map(_entry_model, typing.get_args(annotation)) if m is not None]
        return models[0] if len(models) == 1 else None
    return None


def _default(field: FieldInfo) -> Any:
    if field.default_factory is not None:
        return field.default_factory()  # type: ignore[call-arg]
    return REQUIRED if field.default is PydanticUndefined else field.default


def model_keys(model: type[BaseModel] = Config, prefix: str = "") -> dict[str, Any]:
    """Every key of the config as the doc names it, with its default."""
    keys: dict[str, Any] = {}
    for name, field in model.model_fields.items():
        key = f"{prefix}{name}"
        keys[key] = _default(field)
        inner = _entry_model(field.annotation)
        if inner is None:
            continue
        is_list = typing.get_origin(field.annotation) in (tuple, list)
        keys.update(model_keys(inner, f"{key}[]." if is_list else f"{key}."))
    return keys


def _plain(value: Any) -> Any:
    """A default as YAML would write it: tuples as lists, enum members as their values."""
    if isinstance(value, tuple | list):
        return [_plain(v) for v in value]
    if isinstance(value, Enum):
        return value.value
    return value


def _same(doc: Any, model: Any) -> bool:
    if isinstance(doc, bool) or isinstance(model, bool):
        return type(doc) is type(model) and doc == model
    return bool(doc == model)


def doc_rows() -> dict[str, str]:
    """Key -> its Default cell, from every table of the doc with Key and Default columns."""
    rows: dict[str, str] = {}
    header: list[str] | None = None
    for line in DOC.read_text().splitlines():
        if not line.startswith("|"):
            header = None
            continue
        cells = [c.strip() for c in line.strip().strip("|").split("|")]
        if header is None:
            header = [c.lower() for c in cells]
            continue
        if set("".join(cells)) <= set("-: ") or "key" not in header or "default" not in header:
            continue
        key = re.fullmatch(r"`([a-z_][a-z_.\[\]]*)`", cells[header.index("key")])
        if key is None:
            continue
        assert key[1] not in rows, f"{key[1]} has two rows"
        rows[key[1]] = cells[header.index("default")]
    return rows


LITERAL = re.compile(r"`([^`]*)`")


MINIMAL = {
    "model": "m",
    "engines": [
        {"id": "p0", "url": "http://127.0.0.1:9001", "role": "prefill"},
        {"id": "d0", "url": "http://127.0.0.1:9101", "role": "decode"},
    ],
}


def _refused_without(key: str) -> bool:
    """Whether the minimal config without top-level `key` is refused naming that key."""
    if key not in MINIMAL:
        return False
    try:
        parse_config({k: v for k, v in MINIMAL.items() if k != key})
    except ConfigError as exc:
        return any(p.startswith(f"{key}: ") for p in exc.problems)
    return False


def default_problem(key: str, cell: str, model: Any) -> str | None:
    """Why the doc's Default cell for `key` is not the model's default, or None."""
    literal = LITERAL.fullmatch(cell)
    if cell == "required":  # no default, or one the fleet rules refuse (`engines: []`)
        ok = model is REQUIRED or _refused_without(key)
    elif cell == "not set":
        ok = model is None
    elif cell == "see below":
        ok = isinstance(model, BaseModel)
    elif literal is not None:
        ok = model is not REQUIRED and _same(yaml.safe_load(literal[1]), _plain(model))
    elif cell.startswith("`"):  # `file` when a section is given, ...: the literal leads
        ok = _same(yaml.safe_load(LITERAL.match(cell)[1]), _plain(model))  # type: ignore[index]
    else:  # words: a default derived at validation from other keys
        ok = model is None
    if ok:
        return None
    shown = "(required)" if model is REQUIRED else repr(_plain(model))
    return f"{key}: the doc says {cell!r}, the model {shown}"


def test_the_doc_has_a_row_for_every_key_and_no_other() -> None:
    documented, modelled = set(doc_rows()), set(model_keys())
    assert sorted(modelled - documented) == [], "keys the doc does not describe"
    assert sorted(documented - modelled) == [], "rows for keys the model does not have"


def test_the_docs_defaults_are_the_models() -> None:
    keys = model_keys()
    problems = [
        problem
        for key, cell in doc_rows().items()
        if key in keys and (problem := default_problem(key, cell, keys[key])) is not None
    ]
    assert problems == []


@pytest.mark.parametrize(
    ("cell", "model", "ok"),
    [
        ("`256`", 256, True),
        ("`256`", 255, False),
        ("`60`", 60.0, True),
        ("`false`", False, True),
        ("`0`", False, False),
        ("not set", None, True),
        ("not set", 3, False),
        ("required", REQUIRED, True),
        ("required", (), False),  # a default nothing refuses
        ("`[]`", REQUIRED, False),
        ("`[]`", (), True),
        ('`["http://127.0.0.1:2379"]`', ("http://127.0.0.1:2379",), True),
        ("`file` when a `lease` section is given", "file", True),
        ("derived from `role`", None, True),
        ("derived from `role`", "kv_both", False),
    ],
)
def test_the_default_comparison_itself(cell: str, model: Any, ok: bool) -> None:
    assert (default_problem("k", cell, model) is None) is ok


# --- examples/narwhal.yaml ------------------------------------------------------------------

# `key: value`, maybe commented out, maybe a list entry; a value with no bare space (prose
# such as `# none: a single router, no lease.` is not a key).
EXAMPLE_KEY = re.compile(
    r"^(?P<lead>\s*)(?:# ?)?(?P<inner>\s*)(?P<dash>- )?(?P<key>[a-z_]+):"
    r"(?:\s*(?:#.*)?$|\s+(?P<value>\"[^\"]*\"|\[[^\]]*\]|[^\s#]\S*)(?:\s+#.*)?$)"
)
STATED = re.compile(r"\bDefault: (.*)$")


def example_keys() -> list[tuple[str, str | None]]:
    """(key path, its stated default or None) for every key line of the example, commented
    out or not, in order."""
    found: list[tuple[str, str | None]] = []
    stack: list[tuple[int, str]] = []  # (indent, key path) of the enclosing mappings
    stated: list[str] = []  # the `Default:` lines of the comment block before a key
    for line in EXAMPLE.read_text().splitlines():
        match = EXAMPLE_KEY.match(line)
        if match is None:
            default = STATED.search(line)
            if default is not None:
                stated.append(default[1])
            if not line.strip():
                stated = []
            continue
        indent = len(match["lead"]) + len(match["inner"])  # `# ` is not indentation
        while stack and stack[-1][0] >= indent:
            stack.pop()
        parent = stack[-1][1] if stack else ""
        if match["dash"]:  # a list entry: its keys are the list's `[]` keys
            parent += "[]"
            indent += 2
        path = f"{parent}.{match['key']}" if parent else match["key"]
        # A block stating several defaults describes several keys in prose: not this one's.
        found.append((path, stated[0] if len(stated) == 1 else None))
        stated = []
        if match["value"] is None:
            stack.append((indent, path))
        elif match["dash"]:
            stack.append((indent - 1, parent))
    return found


def test_the_example_loads() -> None:
    config = load_config(EXAMPLE)
    assert len(config.engines) == 4


def test_the_example_names_only_real_keys() -> None:
    keys = set(model_keys())
    paths = [path for path, _ in example_keys()]
    assert len(paths) > 60, "the parser missed most keys"
    assert sorted(set(paths) - keys) == []


def test_the_examples_stated_defaults_are_the_models() -> None:
    keys = model_keys()
    problems = []
    checked = 0
    for path, stated in example_keys():
        if stated is None or isinstance(keys[path], BaseModel):
            continue  # a section's comment is about its use, not its keys' defaults
        # A plain value: `256.`, `4194304 (4 MiB).`, `not set (...`; else words, unchecked.
        plain = re.fullmatch(r"(not set|\S+?)\.?(?: \(.*)?", stated)
        if plain is None:
            continue
        cell = "not set" if plain[1] == "not set" else f"`{plain[1]}`"
        problem = default_problem(path, cell, keys[path])
        checked += 1
        if problem is not None:
            problems.append(problem)
    assert checked > 30, "the parser missed most stated defaults"
    assert problems == []
