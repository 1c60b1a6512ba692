"""Reading a deployment's YAML and wording its errors: what `disagg.config` builds on.

`load_yaml` is `yaml.safe_load` that refuses a key given twice in one mapping (`DuplicateKey`);
`yaml_problem` words a syntax error as ``file:line:column`` with the line marked;
`format_errors` turns a pydantic `ValidationError` into one line per field path, suggesting the
closest key for an unknown one (`suggest`); `Section` is the strict base of every section of the
schema. Pure Python (yaml, pydantic); imported by `disagg.config` and `disagg.config_instances`;
`disagg.config` re-exports these names.
"""

from __future__ import annotations

import difflib
from pathlib import Path
from typing import Any

import yaml
from pydantic import BaseModel, ConfigDict, ValidationError

__all__ = ["DuplicateKey", "Section", "format_errors", "load_yaml", "suggest", "yaml_problem"]


class Section(BaseModel):
    """Base of every section: unknown keys are errors, values are immutable once validated, and
    types are strict (no "1" for an int or a bool, no 2.0 for an int; an int for a float is fine)."""

    model_config = ConfigDict(extra="forbid", frozen=True, strict=True, protected_namespaces=())


class DuplicateKey(yaml.YAMLError):
    """A YAML mapping names one key twice (safe_load would keep the last value silently)."""


def load_yaml(text: str) -> Any:
    """`yaml.safe_load`, except that a key repeated in one mapping (at any depth) raises.

    Raises:
        DuplicateKey: naming the key's path and both lines, e.g.
            ``line 9: router.lease_s given twice (first at line 7); give each key once``.
        yaml.YAMLError: the text is not YAML.
    """
    loader = yaml.SafeLoader(text)
    try:
        node = loader.get_single_node()
        if node is None:
            return None
        _check_unique_keys(node, (), set())
        return loader.construct_document(node)
    finally:
        loader.dispose()


def yaml_problem(path: str | Path, err: yaml.MarkedYAMLError) -> str:
    """A YAML syntax error as ``path:line:column: not valid YAML: problem (context)`` and the line marked.

    PyYAML names the stream "<unicode string>" and puts problem and context on four lines; this
    names the file, as compilers do, and quotes the offending line with a caret under the column
    (the context's line when the problem is at the end of the file).
    """
    mark = err.problem_mark or err.context_mark
    problem = err.problem or err.context or type(err).__name__
    if mark is None:
        return f"{path}: not valid YAML: {problem}"
    text = f"{path}:{mark.line + 1}:{mark.column + 1}: not valid YAML: {problem}"
    context_mark = err.context_mark
    if err.problem and err.context:
        where = (f" at line {context_mark.line + 1}, column {context_mark.column + 1}"
                 if context_mark is not None and context_mark.line != mark.line else "")
        text += f" ({err.context}{where})"
    if "'\\t'" in problem:
        text += "; YAML indents with spaces, never tabs"
    lines = (mark.buffer or "").rstrip("\0").splitlines()
    shown = mark if mark.line < len(lines) and lines[mark.line].strip() else context_mark
    if shown is not None and shown.line < len(lines) and lines[shown.line].strip():
        gutter = f"{shown.line + 1:>5} | "
        text += f"\n{gutter}{lines[shown.line]}\n{' ' * (len(gutter) - 2)}| {' ' * shown.column}^"
    return text


def _check_unique_keys(node: yaml.Node, path: tuple[str, ...], seen: set[int]) -> None:
    """Walk the composed YAML tree; raise `DuplicateKey` at the first mapping key given twice.
    Merge keys (``<<: *anchor``) are left to YAML: keys written beside them override on purpose."""
    if id(node) in seen:  # an alias of a node already walked (anchors may even be recursive)
        return
    seen.add(id(node))
    if isinstance(node, yaml.MappingNode):
        first_line: dict[tuple[str, str], int] = {}
        for key_node, value_node in node.value:
            if key_node.tag == "tag:yaml.org,2002:merge":
                continue
            key = (key_node.tag, str(key_node.value))
            name = ".".join(path + (str(key_node.value),))
            if key in first_line:
                raise DuplicateKey(f"line {key_node.start_mark.line + 1}: {name} given twice (first at line "
                                   f"{first_line[key]}); give each key once")
            first_line[key] = key_node.start_mark.line + 1
            _check_unique_keys(value_node, path + (str(key_node.value),), seen)
    elif isinstance(node, yaml.SequenceNode):
        for index, item in enumerate(node.value):
            _check_unique_keys(item, path + (str(index),), seen)


def format_errors(err: ValidationError, origin: str, schema: type[BaseModel]) -> str:
    """One line per pydantic error: ``origin: field.path: what was expected (got value)``; an
    unknown key gets the closest field of its section in ``schema`` suggested."""
    lines = [f"{origin}: invalid config ({err.error_count()} error{'s' * (err.error_count() > 1)})"]
    for item in err.errors():
        loc = ".".join(str(part) for part in item["loc"]) or "(top level)"
        if item["type"] == "extra_forbidden":
            known = _fields_at(schema, item["loc"][:-1])
            lines.append(f"  {loc}: unknown key{suggest(str(item['loc'][-1]), known)}")
            continue
        msg = item["msg"].removeprefix("Value error, ")
        got = item.get("input")
        shown = "" if isinstance(got, (dict, list)) or item["type"] == "missing" else f" (got {got!r})"
        lines.append(f"  {loc}: {msg}{shown}")
    return "\n".join(lines)


def _fields_at(model: type[BaseModel], loc: tuple) -> list[str]:
    """Field names of the section at ``loc`` (empty when it is not a section)."""
    for part in loc:
        field = model.model_fields.get(str(part))
        annotation = getattr(field, "annotation", None)
        if not (isinstance(annotation, type) and issubclass(annotation, BaseModel)):
            return []
        model = annotation
    return list(model.model_fields)


def suggest(key: str, known) -> str:
    """``; did you mean 'x'?`` for the closest of ``known`` to ``key`` (else the list of them)."""
    known = list(known)
    close = difflib.get_close_matches(key, known, n=1, cutoff=0.5)
    if close:
        return f"; did you mean {close[0]!r}?"
    return f"; expected one of {', '.join(sorted(known))}" if known else ""
