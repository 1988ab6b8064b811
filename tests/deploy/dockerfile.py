"""A small reader of deploy/Dockerfile for the tests: instructions by stage.

There is no Docker daemon on the machines this project's tests run on (and no registry to pull
`python:3.11-slim` from), so the image is never built here. The tests read the Dockerfile
instead, and run its install step for real in a fresh virtualenv (test_install.py).
"""

from __future__ import annotations

import json
import re
import shlex
from dataclasses import dataclass, field
from pathlib import Path

REPO = Path(__file__).resolve().parents[2]
DOCKERFILE = REPO / "deploy" / "Dockerfile"


@dataclass
class Instruction:
    keyword: str  # upper case
    args: str  # the rest of the (joined) line

    def exec_form(self) -> list[str]:
        """ENTRYPOINT/CMD/RUN in JSON (exec) form; ValueError when in shell form."""
        value = json.loads(self.args)
        if not isinstance(value, list) or not all(isinstance(x, str) for x in value):
            raise ValueError(f"{self.keyword} is not in exec form: {self.args}")
        return value

    def words(self) -> list[str]:
        return shlex.split(self.args)


@dataclass
class Stage:
    base: str
    name: str | None
    instructions: list[Instruction] = field(default_factory=list)

    def all(self, keyword: str) -> list[Instruction]:
        return [i for i in self.instructions if i.keyword == keyword]

    def last(self, keyword: str) -> Instruction | None:
        found = self.all(keyword)
        return found[-1] if found else None


@dataclass
class Dockerfile:
    global_args: dict[str, str]
    stages: list[Stage]

    def resolve(self, text: str) -> str:
        """Expand ${NAME} / $NAME from the global ARG defaults."""
        return re.sub(
            r"\$\{(\w+)\}|\$(\w+)",
            lambda m: self.global_args.get(m[1] or m[2], m[0]),
            text,
        )


def logical_lines(text: str) -> list[str]:
    """Instruction lines with continuations joined; comments and blank lines dropped."""
    lines: list[str] = []
    current = ""
    for raw in text.splitlines():
        stripped = raw.strip()
        if not current and (not stripped or stripped.startswith("#")):
            continue
        if current and stripped.startswith("#"):
            continue  # a comment inside a continued instruction
        if stripped.endswith("\\"):
            current += stripped[:-1].rstrip() + " "
            continue
        lines.append(current + stripped)
        current = ""
    if current:
        lines.append(current)
    return lines


def parse(path: Path = DOCKERFILE) -> Dockerfile:
    global_args: dict[str, str] = {}
    stages: list[Stage] = []
    for line in logical_lines(path.read_text()):
        keyword, _, args = line.partition(" ")
        keyword = keyword.upper()
        args = args.strip()
        if keyword == "FROM":
            words = args.split()
            name = words[2] if len(words) == 3 and words[1].upper() == "AS" else None
            stages.append(Stage(base=words[0], name=name))
        elif not stages:
            if keyword != "ARG":
                raise ValueError(f"{keyword} before the first FROM")
            arg_name, _, default = args.partition("=")
            global_args[arg_name] = default
        else:
            stages[-1].instructions.append(Instruction(keyword, args))
    return Dockerfile(global_args, stages)
