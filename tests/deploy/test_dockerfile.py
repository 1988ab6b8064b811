"""deploy/Dockerfile, read (no Docker daemon here to build it; docs/deploy.md): a slim Python
base matching the project's Python, a non-root user, `narwhal-serve` as the entry point with
the mounted config, and deploy/install.sh as the one install step."""

from __future__ import annotations

import re
import tomllib
from pathlib import PurePosixPath

import pytest

from narwhal.cli.serve import main as serve_main
from tests.deploy.dockerfile import REPO, Dockerfile, Stage, logical_lines, parse

INSTALL_SCRIPT = "deploy/install.sh"


@pytest.fixture(scope="module")
def dockerfile() -> Dockerfile:
    return parse()


def final(dockerfile: Dockerfile) -> Stage:
    return dockerfile.stages[-1]


def test_the_base_is_slim_python_of_the_projects_version(dockerfile: Dockerfile) -> None:
    project = tomllib.loads((REPO / "pyproject.toml").read_text())
    python = project["tool"]["mypy"]["python_version"]  # 3.11
    assert project["project"]["requires-python"] == f">={python}"
    bases = {dockerfile.resolve(stage.base) for stage in dockerfile.stages}
    assert bases == {f"python:{python}-slim"}


def test_the_image_runs_as_an_unprivileged_user(dockerfile: Dockerfile) -> None:
    stage = final(dockerfile)
    user = stage.last("USER")
    assert user is not None, "the final stage sets no USER: it would run as root"
    uid, _, gid = user.args.partition(":")
    assert uid.isdigit() and int(uid) != 0, "a numeric non-root uid (runAsNonRoot can check it)"
    assert gid == "" or (gid.isdigit() and int(gid) != 0)
    runs = " ".join(i.args for i in stage.all("RUN"))
    assert f"--uid {uid}" in runs, "the user is created in the image"
    # The working directory (where relative state paths land) belongs to that user.
    workdir = stage.last("WORKDIR")
    assert workdir is not None
    assert re.search(rf"install -d -o {uid}\b[^&]*\s{re.escape(workdir.args)}(\s|$)", runs)
    # Nothing after USER switches back.
    after = stage.instructions[stage.instructions.index(user) :]
    assert [i for i in after if i.keyword == "USER"] == [user]


def test_the_entry_point_is_narwhal_serve_with_the_mounted_config(dockerfile: Dockerfile) -> None:
    stage = final(dockerfile)
    entrypoint, cmd = stage.last("ENTRYPOINT"), stage.last("CMD")
    assert entrypoint is not None and cmd is not None
    assert entrypoint.exec_form() == ["narwhal-serve"]  # exec form: signals reach it directly
    assert cmd.exec_form() == ["--config", "/etc/narwhal/narwhal.yaml"]
    # narwhal-serve resolves through PATH to the virtualenv copied from the build stage.
    env = " ".join(i.args for i in stage.all("ENV"))
    assert "PATH=/opt/narwhal/bin:$PATH" in env
    copies = [i.words() for i in stage.all("COPY")]
    assert ["--from=build", "/opt/narwhal", "/opt/narwhal"] in copies
    for stage in dockerfile.stages:  # the token is a runtime secret, never set in the image
        for i in stage.instructions:
            assert not (i.keyword in {"ENV", "ARG"} and "TOKEN" in i.args.upper()), i
    exposed = stage.last("EXPOSE")
    assert exposed is not None and exposed.args == "8080"


def test_narwhal_serve_takes_the_flag_the_image_passes(capsys: pytest.CaptureFixture[str]) -> None:
    with pytest.raises(SystemExit) as done:
        serve_main(["--help"])
    assert done.value.code == 0
    assert "--config FILE" in capsys.readouterr().out


def test_the_install_step_is_deploy_install_sh(dockerfile: Dockerfile) -> None:
    (build,) = [s for s in dockerfile.stages if s.name == "build"]
    runs = [i.args for s in dockerfile.stages for i in s.all("RUN")]
    installs = [r for r in runs if INSTALL_SCRIPT in r]
    assert len(installs) == 1, installs
    assert not [r for r in runs if re.search(r"\bpip\b", r)], "pip runs only inside install.sh"
    assert "python -m venv /opt/narwhal" in [i.args for i in build.all("RUN")]
    (install,) = installs
    assert install == f"PYTHON=/opt/narwhal/bin/python sh {INSTALL_SCRIPT} /src"
    # What it installs from is what the build stage copied into /src.
    workdir = build.last("WORKDIR")
    assert workdir is not None and workdir.args == "/src"
    copied = {
        str(PurePosixPath(workdir.args, words[-1], PurePosixPath(src).name))
        if words[-1].endswith("/") or len(words) > 2
        else str(PurePosixPath(workdir.args, words[-1]))
        for i in build.all("COPY")
        for words in [i.words()]
        for src in words[:-1]
    }
    assert {
        "/src/pyproject.toml",
        "/src/README.md",
        "/src/LICENSE",
        "/src/requirements/runtime.lock",
        "/src/src",
        f"/src/{INSTALL_SCRIPT}",
    } <= copied
    script = (REPO / INSTALL_SCRIPT).read_text()
    # The tracing extra, pinned by the lock the build copied.
    assert "$1/requirements/runtime.lock" in script
    pip = r'"\$PYTHON" -m pip install --no-cache-dir\b.*-c "\$LOCK"\S* "\$1\[tracing\]"'
    assert re.search(pip, script, re.S)


def test_what_the_build_copies_exists_and_passes_the_dockerignore(dockerfile: Dockerfile) -> None:
    ignore = (REPO / "deploy" / "Dockerfile.dockerignore").read_text().splitlines()
    allowed = {line[1:].rstrip("/") for line in ignore if line.startswith("!")}
    assert "*" in ignore, "the context is an allow-list"
    for stage in dockerfile.stages:
        for copy in stage.all("COPY"):
            words = copy.words()
            if any(w.startswith("--from=") for w in words):
                continue
            for src in words[:-1]:
                assert (REPO / src).exists(), src
                assert src.rstrip("/") in allowed, f"{src} is excluded from the build context"


def test_the_reader_joins_continuations_and_skips_comments() -> None:
    text = "# c\nFROM a AS b\nRUN one \\\n  # inside\n  two\n\nUSER 1\n"
    assert logical_lines(text) == ["FROM a AS b", "RUN one two", "USER 1"]
