"""The fleet file: which stacks of one Pulumi project roll, in which waves, and what gates each wave.

A fleet file (YAML)::

    name: b300-fleet               # names the fleet's progress folder
    project: ..                    # the Pulumi project (Pulumi.yaml, stacks/), relative to this file
                                   # (default: the nearest folder above the file that has a Pulumi.yaml)
    parallel: 2                    # stacks of one wave rolled at once (default 1)
    waves:
      - name: canary               # the first wave is the canary: exactly one stack
        stacks: [canary-b300]
      - name: europe
        stacks: [eu-b300-1, eu-b300-2]
        parallel: 1                # this wave's own limit (default: the fleet's)
    gate:                          # run after each stack's up; a wave passes when every stack's gate does
      doctorArgs: []               # extra arguments of `glm-infra doctor STACK`
      slaArgs: [--quiet]           # extra arguments of `glm-infra sla STACK`

Every stack named is ``stacks/Pulumi.<stack>.yaml`` of the project and must validate.
"""

from __future__ import annotations

from dataclasses import dataclass
from pathlib import Path
from typing import Annotated

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError
from pydantic.alias_generators import to_camel

from glm_infra.stack import StackError, load_file

# A Pulumi stack name (its own rule: letters, digits, -, _ and .), and a wave's name.
STACK_NAME = r"[A-Za-z0-9][A-Za-z0-9_.-]{0,99}"
MAX_PARALLEL = 16
# Arguments the fleet passes to the gate itself: a fleet file must not set them.
GATE_OWNED = {"sla": ("--out", "--api-key-env", "--cacert"), "doctor": ()}


class FleetError(Exception):
    """A fleet file that must not be rolled; ``str()`` names the file and each key at fault."""

    def __init__(self, source: str, problems: list[str]):
        self.source, self.problems = source, problems
        super().__init__(f"{source}: invalid fleet file ({len(problems)} problem{'s' if len(problems) != 1 else ''})\n"
                         + "\n".join(f"  {source}: {p}" for p in problems))


class _Model(BaseModel):
    model_config = ConfigDict(extra="forbid", alias_generator=to_camel, populate_by_name=True, frozen=True)


class WaveSpec(_Model):
    name: Annotated[str, Field(pattern=f"^{STACK_NAME}$")]
    stacks: Annotated[list[Annotated[str, Field(pattern=f"^{STACK_NAME}$")]], Field(min_length=1)]
    parallel: Annotated[int | None, Field(ge=1, le=MAX_PARALLEL)] = None


class GateSpec(_Model):
    doctor_args: list[str] = Field(default_factory=list)
    sla_args: list[str] = Field(default_factory=list)


class FleetSpec(_Model):
    name: Annotated[str, Field(pattern=f"^{STACK_NAME}$")]
    project: str | None = None
    parallel: Annotated[int, Field(ge=1, le=MAX_PARALLEL)] = 1
    waves: Annotated[list[WaveSpec], Field(min_length=1)]
    gate: GateSpec = Field(default_factory=GateSpec)


@dataclass(frozen=True)
class Wave:
    name: str
    stacks: tuple[str, ...]
    parallel: int


@dataclass(frozen=True)
class Fleet:
    name: str
    source: Path  # the fleet file
    project: Path  # the Pulumi project folder
    waves: tuple[Wave, ...]
    doctor_args: tuple[str, ...]
    sla_args: tuple[str, ...]

    @property
    def stacks(self) -> list[str]:
        return [s for w in self.waves for s in w.stacks]

    def wave_of(self, stack: str) -> Wave:
        return next(w for w in self.waves if stack in w.stacks)


def _where(loc: tuple) -> str:
    out = ""
    for part in loc:
        out += f"[{part}]" if isinstance(part, int) else (f".{part}" if out else str(part))
    return out or "(file)"


def _project(source: Path, given: str | None) -> tuple[Path | None, str | None]:
    if given is not None:
        d = (source.parent / given).resolve()
        if not (d / "Pulumi.yaml").is_file():
            return None, f"project: {given}: no Pulumi.yaml in {d}"
        return d, None
    for d in (source.parent.resolve(), *source.parent.resolve().parents):
        if (d / "Pulumi.yaml").is_file():
            return d, None
    return None, f"project: no Pulumi.yaml in {source.parent.resolve()} or above it: say where the project is"


def load_fleet(path: str | Path) -> Fleet:
    """The fleet ``path`` declares, every stack file it names validated; FleetError lists what is wrong."""
    source = Path(path)
    where = str(source)
    try:
        doc = yaml.safe_load(source.read_text())
    except OSError as e:
        raise FleetError(where, [f"(file): cannot read: {e.strerror}"]) from None
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        at = f"line {mark.line + 1}, column {mark.column + 1}" if mark else "unknown position"
        raise FleetError(where, [f"(yaml): YAML syntax error at {at}: {getattr(e, 'problem', None) or e}"]) from None
    if not isinstance(doc, dict):
        raise FleetError(where, ["(file): a fleet file is a mapping with name, waves and gate"])
    try:
        spec = FleetSpec.model_validate(doc)
    except ValidationError as e:
        raise FleetError(where, [f"{_where(err['loc'])}: {err['msg']}" for err in e.errors()]) from None
    problems: list[str] = []
    seen: dict[str, str] = {}
    for i, w in enumerate(spec.waves):
        if w.name in [v.name for v in spec.waves[:i]]:
            problems.append(f"waves[{i}].name: {w.name}: another wave has this name")
        for j, s in enumerate(w.stacks):
            if s in seen:
                problems.append(f"waves[{i}].stacks[{j}]: {s} is already in wave {seen[s]}: a stack rolls once")
            seen.setdefault(s, w.name)
    if len(spec.waves[0].stacks) != 1:
        problems.append(f"waves[0].stacks: the first wave is the canary: one stack, not {len(spec.waves[0].stacks)}")
    for tool, owned in GATE_OWNED.items():
        args = spec.gate.sla_args if tool == "sla" else spec.gate.doctor_args
        for k, a in enumerate(args):
            if a.split("=", 1)[0] in owned:
                problems.append(f"gate.{tool}Args[{k}]: {a}: the fleet sets {a.split('=', 1)[0]} itself")
    project, why = _project(source, spec.project)
    if why:
        problems.append(why)
    if project is not None:
        for s in seen:
            f = project / "stacks" / f"Pulumi.{s}.yaml"
            if not f.is_file():
                problems.append(f"{_at(spec, s)}: {s}: no stack file {f}")
                continue
            try:
                load_file(f)
            except StackError as e:
                problems.append(f"{_at(spec, s)}: {s} does not validate:\n    " + str(e).replace("\n", "\n    "))
    if problems:
        raise FleetError(where, problems)
    assert project is not None
    waves = tuple(Wave(w.name, tuple(w.stacks), w.parallel or spec.parallel) for w in spec.waves)
    return Fleet(spec.name, source, project, waves, tuple(spec.gate.doctor_args), tuple(spec.gate.sla_args))


def _at(spec: FleetSpec, stack: str) -> str:
    for i, w in enumerate(spec.waves):
        if stack in w.stacks:
            return f"waves[{i}].stacks[{w.stacks.index(stack)}]"
    return "waves"

