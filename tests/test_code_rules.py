"""House rules that a reader of the source checks by eye, checked by the source's syntax tree instead.

One error style: every message the package builds for an exception or a warning (Python and the
compiled core's ``TORCH_CHECK``) starts with ``fastoffload: ``. And no function in the package or the benchmark suite
grows past about 80 lines (its docstring included), so each still reads as one job.
"""
from __future__ import annotations

import ast
import builtins
import importlib
import re
from collections.abc import Iterator
from pathlib import Path

from fastoffload_ext.errors import MESSAGE_PREFIX

ROOT = Path(__file__).resolve().parents[1]
MAX_FUNCTION_LINES = 80


def _sources(*folders: str) -> Iterator[tuple[Path, ast.Module]]:
    for folder in folders:
        for path in sorted((ROOT / folder).rglob("*.py")):
            yield path, ast.parse(path.read_text(), filename=str(path))


def _is_exception_class(name: str) -> bool:
    builtin = getattr(builtins, name, None)
    if isinstance(builtin, type):
        return issubclass(builtin, BaseException)
    return name.endswith(("Error", "Exception"))


def _leading_text(node: ast.expr, module: object) -> str | None:
    """The text a message expression starts with, or None when it is not built from a known string.

    Literals, f-strings, ``literal + ...``, ``TEXT.format(...)`` and module-level constants count; a
    caught error passed on unchanged (a plain variable) does not.
    """
    if isinstance(node, ast.Constant):
        return node.value if isinstance(node.value, str) else None
    if isinstance(node, ast.JoinedStr):
        first = node.values[0] if node.values else None
        return first.value if isinstance(first, ast.Constant) else ""
    if isinstance(node, ast.BinOp) and isinstance(node.op, ast.Add):
        return _leading_text(node.left, module)
    if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute) and node.func.attr == "format":
        return _leading_text(node.func.value, module)
    if isinstance(node, ast.Name) and node.id.isupper():
        value = getattr(module, node.id, None)
        return value if isinstance(value, str) else None
    return None


def _module_name(path: Path) -> str:
    parts = path.relative_to(ROOT).with_suffix("").parts
    return ".".join(parts[:-1] if parts[-1] == "__init__" else parts)


def unprefixed_messages() -> list[str]:
    """``file:line: text`` for every exception (or ``warnings.warn``) built with a message that lacks the prefix."""
    found = []
    for path, tree in _sources("fastoffload_ext"):
        module = importlib.import_module(_module_name(path))
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Call) and node.args):
                continue
            func = node.func
            name = func.id if isinstance(func, ast.Name) else func.attr if isinstance(func, ast.Attribute) else ""
            if not (_is_exception_class(name) or name == "warn"):
                continue
            text = _leading_text(node.args[0], module)
            if text is not None and not text.startswith(MESSAGE_PREFIX):
                found.append(f"{path.relative_to(ROOT)}:{node.lineno}: {name}({text[:60]!r}...)")
    return found


def test_every_python_error_message_starts_with_the_prefix() -> None:
    assert unprefixed_messages() == []


def test_message_constants_start_with_the_prefix() -> None:
    """The shared texts (``*_ERROR`` constants) that several modules raise."""
    bad = []
    for path, tree in _sources("fastoffload_ext"):
        for node in tree.body:
            if isinstance(node, ast.Assign) and isinstance(node.value, ast.Constant | ast.JoinedStr):
                for target in node.targets:
                    if isinstance(target, ast.Name) and target.id.endswith("_ERROR"):
                        text = _leading_text(node.value, None)
                        if text is not None and not text.startswith(MESSAGE_PREFIX):
                            bad.append(f"{path.relative_to(ROOT)}:{node.lineno}: {target.id}")
    assert bad == []


def test_the_checker_catches_a_message_without_the_prefix() -> None:
    tree = ast.parse('raise ValueError(f"value {x} is wrong")\nraise OffloadStateError(TEXT.format(n=1))')
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and node.args]
    texts = [_leading_text(call.args[0], type("M", (), {"TEXT": "no prefix {n}"})) for call in calls]
    assert texts == ["value ", "no prefix {n}"]


# A TORCH_CHECK(cond, "text", ...): the first string literal after the condition is the message's start.
_TORCH_CHECK = re.compile(r'\bTORCH_CHECK(?:_\w+)?\s*\((?:[^;"]|"(?:[^"\\]|\\.)*"(?=\s*\)))*?,\s*"((?:[^"\\]|\\.)*)"',
                          re.S)
# A TORCH_WARN("text", ...): the message is its first argument.
_TORCH_WARN = re.compile(r'\bTORCH_WARN(?:_ONCE)?\s*\(\s*"((?:[^"\\]|\\.)*)"')


def test_every_torch_check_and_warning_starts_with_the_prefix() -> None:
    bad = []
    for path in sorted((ROOT / "csrc").iterdir()):
        if path.suffix not in (".cpp", ".h", ".cu"):
            continue
        text = path.read_text()
        for match in [*_TORCH_CHECK.finditer(text), *_TORCH_WARN.finditer(text)]:
            if not match.group(1).startswith(MESSAGE_PREFIX):
                bad.append(f"{path.name}:{text.count(chr(10), 0, match.start()) + 1}: {match.group(1)[:60]!r}")
    assert bad == []


def test_the_torch_check_pattern_reads_a_multi_line_check() -> None:
    source = 'TORCH_CHECK(a.size() == b.size(),\n  "fastoffload: sizes must match, got ", a.size());'
    assert [m.group(1) for m in _TORCH_CHECK.finditer(source)] == ["fastoffload: sizes must match, got "]
    assert [m.group(1) for m in _TORCH_WARN.finditer('TORCH_WARN("pinning ", n);')] == ["pinning "]


def long_functions() -> list[str]:
    """``file:line name (N lines)`` for every function over the limit, its docstring included."""
    found = []
    for path, tree in _sources("fastoffload_ext", "benchmarks"):
        for node in ast.walk(tree):
            if isinstance(node, ast.FunctionDef | ast.AsyncFunctionDef):
                length = (node.end_lineno or node.lineno) - node.lineno + 1
                if length > MAX_FUNCTION_LINES:
                    found.append(f"{path.relative_to(ROOT)}:{node.lineno} {node.name} ({length} lines)")
    return found


def test_no_function_is_over_80_lines() -> None:
    assert long_functions() == []
