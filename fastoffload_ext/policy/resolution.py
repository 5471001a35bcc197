"""Turn a user's offload config into final settings through ordered steps, recording who decided what.

Offload settings are not independent: unified memory makes every host offload a loss, MPS cannot run
layerwise offload, layerwise offload excludes FSDP inference and whole-DiT offload, and an unset
``lazy_module_load`` depends on all of that. Writing those rules as one function hides which rule
changed a value, and a user whose offload "silently" turned off deserves to see why. So each rule is
a small *step*, and the resolver applies them in order and keeps the provenance.

The contract:

* A step is ``Callable[[ResolutionView], Mapping[str, Any]]`` (:data:`ResolutionStep`). It reads the
  config so far through a read-only :class:`ResolutionView` and returns ``{dotted.path: value}`` for
  the settings it decides (``{}`` to decide nothing). A step cannot change the config any other
  way, so the provenance is complete.
* :func:`resolve` applies the steps in order to a deep copy: the caller's mapping is never mutated,
  and each step sees the results of the steps before it.
* Steps may only set paths of the *schema* (:data:`DEFAULT_SCHEMA` unless one is given). A typo in a
  step would otherwise create a setting nobody reads, and the offload it meant to change would stay
  as it was; such a path raises :class:`UnknownPathError` naming the path and the step.
* Schema values are checked and normalised both on input and on every step result (``mode`` accepts
  ``"finetuning"`` as well as ``ExecutionMode.FINETUNING``; on/off flags must be booleans, because
  the string ``"false"`` is truthy and would turn an offload *on*). Bad values raise
  :class:`InvalidValueError` naming the path, the value and where it came from.
* Settings that no step decided and the input did not set receive the schema default after the
  last step, so :attr:`Resolution.config` holds every schema path. Steps see ``None`` for them
  (:meth:`ResolutionView.get`), which is how a step tells "unset" from "set to False".
* Keys of the input that the schema does not name are carried through: the offload settings usually
  live inside a larger config. Its containers (mappings, lists, tuples, sets) are copied, so the result
  shares none with the input; every other value is the caller's own object, never copied, since a
  config may hold a lock, a module or a device handle that cannot or must not be copied.
* Schema settings are read from nested mappings only. A key that spells one with dots
  (``{"engine.offload.vae": True}``) would be carried through unread while the setting took its
  default, so it raises :class:`InvalidValueError` saying how to nest it.

:class:`Resolution` carries the final ``config``, ``provenance`` (path → name of the step that set it
last), the full ``history`` of decisions, and :meth:`Resolution.explain`, a readable table of every
schema setting with its origin.
"""
from __future__ import annotations

import copy
import enum
import logging
from collections.abc import Callable, Iterable, Mapping
from dataclasses import dataclass, field
from types import MappingProxyType
from typing import Any, TypeAlias

from fastoffload_ext.errors import MESSAGE_PREFIX, OffloadConfigError

logger = logging.getLogger(__name__)

__all__ = [
    "DEFAULT_SCHEMA",
    "Decision",
    "ExecutionMode",
    "InvalidValueError",
    "Resolution",
    "ResolutionError",
    "ResolutionStep",
    "ResolutionView",
    "SchemaField",
    "StepResultError",
    "UnknownPathError",
    "resolve",
]

_UNSET: Any = object()


class ExecutionMode(enum.StrEnum):
    """What the run is for; training modes keep every component resident (no lazy loading).

    A ``StrEnum``, so a config may say ``"finetuning"`` and compare equal to ``FINETUNING``.
    """

    INFERENCE = "inference"
    PREPROCESS = "preprocess"
    FINETUNING = "finetuning"
    DISTILLATION = "distillation"


class ResolutionError(OffloadConfigError):
    """Base class of every error :func:`resolve` raises for a bad config, step or schema value."""


class UnknownPathError(ResolutionError):
    """A step returned a path that the schema does not name."""


class InvalidValueError(ResolutionError):
    """A schema setting received a value of the wrong kind (from the input or from a step)."""


class StepResultError(ResolutionError):
    """A step returned something other than a mapping of dotted paths to values."""


@dataclass(frozen=True)
class SchemaField:
    """One setting the steps may decide.

    Attributes:
        default: the value of the setting when neither the input nor a step set it.
        normalize: checks a non-None value and returns its canonical form; raises ``ValueError`` or
            ``TypeError`` with a message for a value it cannot accept. ``None`` accepts anything.
        doc: one line for :meth:`Resolution.explain` readers and schema authors.
    """

    default: Any = None
    normalize: Callable[[Any], Any] | None = None
    doc: str = ""


def _normalize_flag(value: Any) -> bool:
    # bool is a subclass of int, but 0/1 and "false" are rejected on purpose: "false" is truthy.
    if isinstance(value, bool):
        return value
    kind = type(value)
    if kind.__module__ != "builtins":
        # numpy's bool calls itself "bool": name the module, or the message would say a bool was refused.
        hint = f"{kind.__module__}.{kind.__qualname__}, not a Python bool; pass bool(value)"
    else:
        hint = kind.__name__
    raise TypeError(f"fastoffload: expected true or false (or None to leave it unset), got {value!r} ({hint})")


def _normalize_mode(value: Any) -> ExecutionMode:
    if isinstance(value, ExecutionMode):
        return value
    if isinstance(value, str):
        try:
            return ExecutionMode(value.strip().lower())
        except ValueError:
            pass
    allowed = ", ".join(repr(mode.value) for mode in ExecutionMode)
    raise ValueError(f"fastoffload: expected one of {allowed} (or an ExecutionMode), got {value!r}")


def _flag(doc: str, default: bool | None = False) -> SchemaField:
    return SchemaField(default=default, normalize=_normalize_flag, doc=doc)


DEFAULT_SCHEMA: Mapping[str, SchemaField] = MappingProxyType({
    "mode": SchemaField(default=ExecutionMode.INFERENCE, normalize=_normalize_mode,
                        doc="what the run is for; training modes never load lazily"),
    "engine.use_fsdp_inference": _flag("shard the DiT with FSDP for inference"),
    "engine.offload.dit_layerwise": _flag("layerwise offload of the DiT's blocks (fastoffload_ext.engine.layerwise)"),
    "engine.offload.dit": _flag("whole-DiT CPU offload"),
    "engine.offload.text_encoder": _flag("text encoder CPU offload"),
    "engine.offload.image_encoder": _flag("image encoder CPU offload"),
    "engine.offload.vae": _flag("VAE CPU offload"),
    "engine.offload.lazy_module_load": _flag(
        "load components on first use and release them after their last stage; unset lets the device "
        "policy decide", default=None),
})
"""The offload settings FastVideo's device policy decides, with their defaults."""


def _lookup(config: Mapping[str, Any], path: str) -> Any:
    """The value at dotted ``path`` in nested mappings, or ``_UNSET`` where any level is missing."""
    node: Any = config
    for key in path.split("."):
        if not isinstance(node, Mapping) or key not in node:
            return _UNSET
        node = node[key]
    return node


def _copy_containers(value: Any, memo: dict[int, Any]) -> Any:
    """``value`` with its containers copied (mappings as plain dicts) and every other object as is."""
    if id(value) in memo:
        return memo[id(value)]
    if isinstance(value, Mapping):
        copied: Any = {}
        memo[id(value)] = copied
        copied.update((key, _copy_containers(item, memo)) for key, item in value.items())
        return copied
    if isinstance(value, list):
        copied = []
        memo[id(value)] = copied
        copied.extend(_copy_containers(item, memo) for item in value)
        return copied
    if type(value) is tuple:  # a named tuple is a value of its own type: carried as is
        return tuple(_copy_containers(item, memo) for item in value)
    if isinstance(value, (set, frozenset)):
        return type(value)(value) if type(value) in (set, frozenset) else value
    return value


def _plain_copy(config: Mapping[str, Any]) -> dict[str, Any]:
    """A copy as nested plain dicts, so any Mapping type (read-only ones too) can be resolved; values
    that are not containers are carried as the same objects (see the module docstring)."""
    return _copy_containers(config, {})


def _store(config: dict[str, Any], path: str, value: Any) -> None:
    keys = path.split(".")
    node = config
    for key in keys[:-1]:
        # Parents are mappings or None (unset) here: _check_parents and _check_schema ran first.
        if node.get(key) is None:
            node[key] = {}
        node = node[key]
    node[keys[-1]] = value


def _check_parents(config: Mapping[str, Any], path: str) -> None:
    """Reject, before any step runs, a config where a parent of a schema path is not a mapping."""
    keys = path.split(".")
    node: Any = config
    for depth, key in enumerate(keys[:-1]):
        node = node.get(key)
        if node is None:
            return
        if not isinstance(node, dict):
            parent = ".".join(keys[:depth + 1])
            raise InvalidValueError(f"fastoffload: cannot set {path}: {parent} holds {node!r}, not a mapping; make "
                                    f"{parent} a mapping of settings (or remove it) in the config")


def _nested_example(path: str) -> str:
    example = "..."
    for key in reversed(path.split(".")):
        example = f"{{{key!r}: {example}}}"
    return example


def _check_dotted_keys(config: Mapping[str, Any], schema: Mapping[str, SchemaField], prefix: str = "") -> None:
    """Reject a key that spells a schema path (or a parent of one) with dots instead of nesting.

    Such a key is never read, so the setting would silently take its default: an offload the user asked for
    would end up off.
    """
    for key, value in config.items():
        if not isinstance(key, str):
            continue
        path = prefix + key
        below = [other for other in schema if other.startswith(path + ".")]
        if "." in key and (path in schema or below):
            present = [other for other in below
                       if isinstance(value, Mapping) and _lookup(value, other[len(path) + 1:]) is not _UNSET]
            setting = path if path in schema else (present or below)[0]
            raise InvalidValueError(f"fastoffload: the config key {key!r} holds {setting}, but settings are read from "
                                    f"nested mappings only, so it would be ignored; nest it: "
                                    f"{_nested_example(setting)}")
        if below and isinstance(value, Mapping):
            _check_dotted_keys(value, schema, path + ".")


def _check_schema(schema: Mapping[str, SchemaField]) -> None:
    # A setting cannot also be the parent of settings: storing one would erase or break the other.
    for path in schema:
        prefix = path + "."
        for other in schema:
            if other.startswith(prefix):
                raise ResolutionError(f"fastoffload: schema paths {path!r} and {other!r} overlap: a setting cannot "
                                      f"also hold settings; rename {path!r} (e.g. {prefix}enabled)")


def _step_name(step: Callable[..., Any]) -> str:
    return getattr(step, "__name__", None) or repr(step)


class ResolutionView:
    """Read-only access to the config as it stands before a step runs.

    ``get`` hands out copies of nested mappings and lists, so a step can only influence the result
    through what it returns, and every change is recorded. Other objects (a lock, a module) are the
    config's own, never copied.
    """

    __slots__ = ("_config",)

    def __init__(self, config: Mapping[str, Any]) -> None:
        self._config = config

    def get(self, path: str) -> Any:
        """The value at ``path`` (e.g. ``"engine.offload.vae"``); None when it is unset."""
        value = _lookup(self._config, path)
        if value is _UNSET:
            return None
        return _copy_containers(value, {})

    def __contains__(self, path: object) -> bool:
        """Whether ``path`` is set to something other than None."""
        return isinstance(path, str) and self.get(path) is not None

    def as_dict(self) -> dict[str, Any]:
        """A deep copy of the whole config as it stands (schema defaults not yet filled in)."""
        return _plain_copy(self._config)

    def __repr__(self) -> str:
        return f"ResolutionView({self._config!r})"


ResolutionStep: TypeAlias = Callable[[ResolutionView], Mapping[str, Any]]
"""A rule: reads the config so far and returns ``{dotted.path: value}`` for what it decides."""


@dataclass(frozen=True)
class Decision:
    """One setting set by one step: ``path`` went from ``before`` (None when unset) to ``value``."""

    step: str
    path: str
    before: Any
    value: Any


@dataclass(frozen=True)
class Resolution:
    """The outcome of :func:`resolve`.

    Attributes:
        config: the resolved config as nested dicts: the input, the steps' decisions, and the schema
            default for every schema setting still unset.
        provenance: for every path a step set, the name of the step that set it last.
        history: every decision in the order it was applied, including repeated ones.
        steps: the names of the steps that ran, in order.
        origins: for every schema path, ``"input"``, ``"default"`` or the deciding step's name.
        input_values: for every schema path the input set, its (normalised) input value.
    """

    config: dict[str, Any]
    provenance: dict[str, str]
    history: tuple[Decision, ...]
    steps: tuple[str, ...]
    origins: dict[str, str] = field(default_factory=dict)
    input_values: dict[str, Any] = field(default_factory=dict)

    def get(self, path: str) -> Any:
        """The resolved value at ``path``; None when it is unset and has no default."""
        value = _lookup(self.config, path)
        return None if value is _UNSET else value

    def decided_by(self, path: str) -> str | None:
        """The name of the step that set ``path`` last, or None when no step set it."""
        return self.provenance.get(path)

    def explain(self) -> str:
        """A table of every schema setting, its value, and why it has that value.

        Example line: ``engine.offload.dit = False  decided by apply_layerwise_offload_conflicts (input: True)``.
        """
        names = ", ".join(self.steps) if self.steps else "none"
        lines = [f"Offload settings after {len(self.steps)} resolution step(s) ({names}):"]
        path_width = max((len(path) for path in self.origins), default=0)
        value_width = max((len(str(self.get(path))) for path in self.origins), default=0)
        for path, origin in self.origins.items():
            if origin == "input":
                why = "from the input"
            elif origin == "default":
                why = "default (not set)"
            else:
                start = f"input: {self.input_values[path]}" if path in self.input_values else "input: unset"
                chain = [f"{decision.step}: {decision.value}" for decision in self.history if decision.path == path]
                detail = start if len(chain) == 1 else "; ".join([start, *chain])
                why = f"decided by {origin} ({detail})"
            lines.append(f"  {path:<{path_width}} = {self.get(path)!s:<{value_width}}  {why}")
        return "\n".join(lines)

    def __str__(self) -> str:
        return self.explain()


def _normalized(schema: Mapping[str, SchemaField], path: str, value: Any, source: str) -> Any:
    spec = schema[path]
    if value is None or spec.normalize is None:
        return value
    try:
        return spec.normalize(value)
    except (TypeError, ValueError) as error:
        # The check's own message goes inside this one: one prefix at the front is enough.
        reason = str(error).removeprefix(MESSAGE_PREFIX)
        raise InvalidValueError(f"fastoffload: invalid value for {path} from {source}: {reason}") from None


def resolve(config: Mapping[str, Any], steps: Iterable[ResolutionStep],
            schema: Mapping[str, SchemaField] = DEFAULT_SCHEMA) -> Resolution:
    """Apply ``steps`` in order to a copy of ``config`` and return the result with its provenance.

    Args:
        config: nested mappings, e.g. ``{"engine": {"offload": {"dit_layerwise": True}}}``. Never
            mutated. Keys the schema does not name are carried through: containers copied, other
            objects as they are (never deep-copied).
        steps: the rules to apply, in order; each sees the results of those before it.
        schema: the settings steps may decide, with their defaults and value checks.

    Raises:
        TypeError: ``config`` is not a mapping.
        InvalidValueError: a schema setting has a value of the wrong kind, in the input or from a
            step, the input holds a non-mapping where a schema path needs a mapping of settings, or
            the input spells a schema path as a dotted key instead of nesting it.
        ResolutionError: two schema paths overlap (one is the parent of another).
        UnknownPathError: a step returned a path the schema does not name.
        StepResultError: a step returned something other than a mapping with string keys.
        Exception: whatever a step raises propagates, with a note naming the step.
    """
    if not isinstance(config, Mapping):
        raise TypeError("fastoffload: resolve() needs the config as a mapping of settings, got "
                        f"{type(config).__name__}; pass e.g. {{'engine': {{'offload': {{'dit_layerwise': True}}}}}}")
    working = _plain_copy(config)

    origins: dict[str, str] = {}
    input_values: dict[str, Any] = {}
    _check_schema(schema)
    _check_dotted_keys(working, schema)
    for path in schema:
        _check_parents(working, path)
        value = _lookup(working, path)
        if value is _UNSET or value is None:
            continue
        value = _normalized(schema, path, value, "the input config")
        _store(working, path, value)
        origins[path] = "input"
        input_values[path] = value

    provenance: dict[str, str] = {}
    history: list[Decision] = []
    step_names: list[str] = []
    view = ResolutionView(working)
    for step in steps:
        name = _step_name(step)
        step_names.append(name)
        try:
            decided = step(view)
        except Exception as error:
            error.add_note(f"(raised by resolution step {name})")
            raise
        if not isinstance(decided, Mapping):
            raise StepResultError(f"fastoffload: resolution step {name} returned {type(decided).__name__}; a step must "
                                  "return a mapping of {dotted.path: value} (return {} to decide nothing)")
        for path, value in decided.items():
            if not isinstance(path, str) or path not in schema:
                known = ", ".join(sorted(schema))
                raise UnknownPathError(f"fastoffload: resolution step {name} set {path!r}, which is not a known "
                                       f"setting; fix the path in {name} (known settings: {known})")
            value = _normalized(schema, path, value, f"resolution step {name}")
            before = _lookup(working, path)
            _store(working, path, value)
            history.append(Decision(step=name, path=path, before=None if before is _UNSET else before, value=value))
            provenance[path] = name
            origins[path] = name
            logger.debug("Resolution step %s set %s = %r", name, path, value)

    # Defaults go in last so that steps can tell "unset" (None) from an explicit value.
    for path, spec in schema.items():
        value = _lookup(working, path)
        if value is _UNSET or value is None:
            _store(working, path, copy.deepcopy(spec.default))

    ordered_origins = {path: origins.get(path, "default") for path in schema}
    return Resolution(config=working, provenance=provenance, history=tuple(history), steps=tuple(step_names),
                      origins=ordered_origins, input_values=input_values)
