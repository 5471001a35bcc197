"""Release each lazy component right after the last stage that uses it.

:class:`~fastoffload_ext.pipeline.lazy.LazyModule` loads a component on first use but never decides when to drop
it; FastVideo's pipeline does that from its stage list. This module gives the same to pipelines that
are not FastVideo's: describe the stages in order and the components each one uses, and the schedule
works out after which stage each component is used for the last time and releases it there. With
components that are each used by one stage (encode → denoise → decode), peak memory falls from the
*sum* of the components to the *largest* one.

Usage, with your own stage functions::

    schedule = ReleaseSchedule.from_stages([
        ("encode", ["text_encoder"]),
        ("denoise", ["transformer"]),
        ("decode", ["vae"]),
    ])
    components = {"text_encoder": LazyModule("text_encoder", load_te), ...}

    embeddings = encode(components["text_encoder"], prompt)
    schedule.release_after("encode", components)     # text_encoder dropped here
    ...

or let :func:`run_pipeline` drive it: each :class:`Stage` carries its function, which is called as
``run(state, components)`` with only the components the stage declared, and returns the next state::

    output = run_pipeline([
        Stage("encode", ["text_encoder"], lambda prompt, c: c["text_encoder"](prompt)),
        Stage("denoise", ["transformer"], lambda emb, c: c["transformer"](emb)),
        Stage("decode", ["vae"], lambda latents, c: c["vae"](latents)),
    ], components, state=prompt)

Rules, and why:

* Computing the schedule never loads anything: it works on names only, and deciding whether a
  component can be released uses :func:`~fastoffload_ext.pipeline.lazy.is_lazy_module` (``isinstance`` on a
  proxy would load it).
* Only lazy components are released. A plain module is a strong reference the caller holds; there is
  nothing this module could free, so it is left alone.
* Every component name a stage declares must be present in the components mapping: a typo would
  otherwise keep a component resident for the whole run while everything looked normal.
* In :func:`run_pipeline` a stage sees only the components it declared, so an undeclared use fails at
  once with a ``KeyError`` instead of silently reloading a component the schedule already released.
* ``keep`` names components that must stay loaded across runs (e.g. a transformer reused request
  after request); releasing is a latency cost on the next run, never a correctness one.
* One component under two names (the same object in the mapping twice) is released after the last
  use of either name, and never when either name is kept: releasing it after one name's last use
  would load it again for the other's.
* If a stage raises, :func:`run_pipeline` releases nothing more and the exception propagates: the
  components the failed run loaded stay loaded and are reused by a retry.
"""
from __future__ import annotations

import logging
from collections.abc import Callable, Collection, Mapping, Sequence
from dataclasses import dataclass
from types import MappingProxyType
from typing import Any

from fastoffload_ext.pipeline.lazy import is_lazy_module

logger = logging.getLogger(__name__)

__all__ = ["ReleaseSchedule", "Stage", "StageFunction", "StageSpec", "run_pipeline"]

StageFunction = Callable[[Any, Mapping[str, Any]], Any]
"""A stage's work: ``run(state, components) -> next state``; ``components`` holds only what it declared."""


@dataclass(frozen=True)
class Stage:
    """One pipeline stage: its unique ``name``, the component names it ``uses``, and optionally its ``run``."""

    name: str
    uses: Sequence[str]
    run: StageFunction | None = None

    def __post_init__(self) -> None:
        # Stored as a tuple so a stage cannot change after the schedule was computed from it.
        object.__setattr__(self, "uses", _component_names(self.name, self.uses))


StageSpec = Stage | tuple[str, Sequence[str]] | tuple[str, Sequence[str], StageFunction]
"""A stage as :class:`Stage`, ``(name, uses)`` or ``(name, uses, run)``."""


def _component_names(stage: str, uses: Sequence[str]) -> tuple[str, ...]:
    # A bare string is a sequence of characters: ("encode", "vae") would otherwise declare "v", "a", "e".
    if isinstance(uses, str):
        raise TypeError(f"fastoffload: stage {stage!r} lists its components as the string {uses!r}; pass a sequence of "
                        f"names, e.g. ({uses!r},)")
    names = tuple(uses)
    for name in names:
        # is_lazy_module first: isinstance() on a LazyModule would load it just to reject it.
        if is_lazy_module(name) or not isinstance(name, str):
            raise TypeError(f"fastoffload: stage {stage!r} lists component {name!r} ({type(name).__name__}); "
                            "components are named by strings, the keys of the components mapping")
    return names


def _as_stage(spec: StageSpec) -> Stage:
    # A LazyModule given by mistake is rejected by type() alone: isinstance() would load it.
    if not is_lazy_module(spec):
        if isinstance(spec, Stage):
            return spec
        if isinstance(spec, tuple) and len(spec) in (2, 3) and isinstance(spec[0], str):
            return Stage(*spec)
    raise TypeError(f"fastoffload: cannot read stage {spec!r}; give a Stage, a (name, components) pair or a (name, "
                    "components, run) triple")


class ReleaseSchedule:
    """After which stage each component is used for the last time, computed from names alone."""

    __slots__ = ("_stages", "_last_use", "_releases", "_kept")

    def __init__(self, stages: Sequence[Stage], keep: Collection[str] = ()) -> None:
        """Prefer :meth:`from_stages`; this takes already-built :class:`Stage` objects."""
        if isinstance(keep, str):
            raise TypeError(f"fastoffload: keep must be a collection of component names, got the string {keep!r}; "
                            f"write keep=({keep!r},)")
        # Read once: a generator is exhausted by its first reading, and would then keep (or release) nothing.
        stages, kept = tuple(stages), frozenset(keep)
        seen: set[str] = set()
        for stage in stages:
            if stage.name in seen:
                raise ValueError(f"fastoffload: stage name {stage.name!r} appears twice; give every stage a unique "
                                 "name, releases are keyed by stage name")
            seen.add(stage.name)

        last_use: dict[str, str] = {}
        for stage in stages:
            for component in stage.uses:
                # Re-inserting moves the key to the end, so the dict ends ordered by last use.
                last_use.pop(component, None)
                last_use[component] = stage.name

        unused = sorted(kept - set(last_use))
        if unused:
            raise ValueError(f"fastoffload: keep names {', '.join(map(repr, unused))}, which no stage uses; keep only "
                             f"components that appear in a stage (used: {', '.join(last_use) or 'none'})")

        releases: dict[str, list[str]] = {stage.name: [] for stage in stages}
        for component, stage_name in last_use.items():
            if component not in kept:
                releases[stage_name].append(component)

        self._stages: tuple[Stage, ...] = stages
        self._last_use: Mapping[str, str] = MappingProxyType(last_use)
        self._releases: Mapping[str, tuple[str, ...]] = MappingProxyType(
            {name: tuple(names) for name, names in releases.items()})
        self._kept: frozenset[str] = kept

    @classmethod
    def from_stages(cls, stages: Sequence[StageSpec], *, keep: Collection[str] = ()) -> ReleaseSchedule:
        """Build the schedule for ``stages`` in the order they run.

        Args:
            stages: :class:`Stage` objects or ``(name, components)`` / ``(name, components, run)`` tuples.
            keep: components never to release (they stay loaded between runs).

        Raises:
            TypeError: a stage or its component list is malformed (the message says which).
            ValueError: two stages share a name, or ``keep`` names a component no stage uses.
        """
        return cls([_as_stage(spec) for spec in stages], keep=keep)

    @property
    def stages(self) -> tuple[Stage, ...]:
        """The stages, in the order they run."""
        return self._stages

    @property
    def last_use(self) -> Mapping[str, str]:
        """Component name → name of the last stage that uses it (kept components included)."""
        return self._last_use

    @property
    def kept(self) -> frozenset[str]:
        """The components this schedule never releases."""
        return self._kept

    def releases_after(self, stage_name: str) -> list[str]:
        """The components whose last use is ``stage_name`` (excluding kept ones), in declaration order."""
        return list(self._releases_for(stage_name))

    def release_after(self, stage_name: str, components: Mapping[str, Any]) -> list[str]:
        """Release the lazy components last used by ``stage_name``; return the names actually released.

        A component that is not lazy, or lazy but not loaded (nothing to drop), is skipped, and so is one
        that ``components`` also holds under another name that is kept or used by a later stage.

        Raises:
            ValueError: ``stage_name`` is not a stage of this schedule, or ``components`` lacks a
                component that should be released after it.
        """
        due = self._releases_for(stage_name)
        missing = [name for name in due if name not in components]
        if missing:
            raise ValueError(f"fastoffload: components {', '.join(map(repr, missing))} are due for release after stage "
                             f"{stage_name!r} but missing from the components mapping; pass the same mapping the "
                             "stages use")
        released: list[str] = []
        needed_later = self._needed_after(stage_name, components) if due else set()
        for name in due:
            component = components[name]
            if id(component) in needed_later:
                logger.debug("Kept %s after stage %s: the same component is used later under another name", name,
                             stage_name)
                continue
            if is_lazy_module(component) and component.release():
                released.append(name)
        if released:
            logger.debug("Released %s after stage %s", ", ".join(released), stage_name)
        return released

    def _needed_after(self, stage_name: str, components: Mapping[str, Any]) -> set[int]:
        """The ids of the components that a stage after ``stage_name`` uses, or ``keep`` names (compared by
        identity, which loads nothing)."""
        names = set(self._kept)
        later = False
        for stage in self._stages:
            if later:
                names.update(stage.uses)
            later = later or stage.name == stage_name
        return {id(components[name]) for name in names if name in components}

    def _releases_for(self, stage_name: str) -> tuple[str, ...]:
        try:
            return self._releases[stage_name]
        except KeyError:
            known = ", ".join(repr(stage.name) for stage in self._stages) or "none"
            raise ValueError(f"fastoffload: unknown stage {stage_name!r}; this schedule's stages are "
                             f"{known}") from None

    def __repr__(self) -> str:
        plan = "; ".join(f"{name}: {', '.join(names) or '-'}" for name, names in self._releases.items())
        return f"ReleaseSchedule(release after {plan})"


def run_pipeline(stages: Sequence[StageSpec], components: Mapping[str, Any], state: Any = None, *,
                 keep: Collection[str] = ()) -> Any:
    """Run ``stages`` in order, releasing each lazy component right after its last use.

    Each stage's ``run(state, components)`` receives the previous stage's return value (``state``
    for the first) and a read-only mapping of only the components it declared; its return value is
    the next state. The last stage's return value is returned.

    Everything is checked before the first stage runs, so a malformed pipeline fails without loading
    anything.

    Raises:
        TypeError / ValueError: as :meth:`ReleaseSchedule.from_stages`.
        ValueError: a stage has no ``run`` function, or declares a component missing from ``components``.
    """
    schedule = ReleaseSchedule.from_stages(stages, keep=keep)
    runs: list[StageFunction] = []
    for stage in schedule.stages:
        if stage.run is None:
            raise ValueError(f"fastoffload: stage {stage.name!r} has no function to run; give it as Stage(name, "
                             "components, run) or (name, components, run), or use ReleaseSchedule.release_after in "
                             "your own loop")
        missing = [name for name in stage.uses if name not in components]
        if missing:
            raise ValueError(f"fastoffload: stage {stage.name!r} uses {', '.join(map(repr, missing))}, missing from "
                             f"the components mapping (it has {', '.join(map(repr, components)) or 'nothing'})")
        runs.append(stage.run)

    for stage, run in zip(schedule.stages, runs):
        visible = MappingProxyType({name: components[name] for name in stage.uses})
        state = run(state, visible)
        schedule.release_after(stage.name, components)
    return state
