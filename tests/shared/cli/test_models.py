import json
from pathlib import Path

import typer
from typer.testing import CliRunner

from shared.cli.models import register
from workers.demo.build import BUILD_MARKER, DEMO_RECIPE
from workers.demo.eagle_build import DEMO_HEAD_RECIPE

app = typer.Typer()


@app.callback()
def _root() -> None:
    """A root like shared/cli/main.py's, with only the models group."""


register(app)
runner = CliRunner()


def test_path_fails_when_the_pair_is_not_built(tmp_path: Path) -> None:
    result = runner.invoke(app, ["models", "path", "--home", str(tmp_path)])

    assert result.exit_code == 1
    assert "not built" in result.output


def built_pair_marker(home: Path, build_time_s: float) -> Path:
    """The demo pair's directory under `home`, holding only the marker of a finished build of this recipe."""
    directory = home / "models" / DEMO_RECIPE.name
    directory.mkdir(parents=True)
    (directory / BUILD_MARKER).write_text(
        json.dumps({"fingerprint": DEMO_RECIPE.fingerprint(), "build_time_s": build_time_s})
    )
    return directory


def test_path_prints_the_two_directories_of_a_built_pair(tmp_path: Path) -> None:
    directory = built_pair_marker(tmp_path, build_time_s=1.0)

    result = runner.invoke(app, ["models", "path", "--home", str(tmp_path)])

    assert result.exit_code == 0
    assert result.output.splitlines() == [f"target: {directory / 'target'}", f"draft: {directory / 'draft'}"]


def test_build_demo_reports_an_existing_pair_without_building(tmp_path: Path) -> None:
    directory = built_pair_marker(tmp_path, build_time_s=201.5)
    head = tmp_path / "models" / DEMO_HEAD_RECIPE.name
    head.mkdir()
    (head / BUILD_MARKER).write_text(json.dumps({"fingerprint": DEMO_HEAD_RECIPE.fingerprint(), "build_time_s": 99.0}))

    result = runner.invoke(app, ["models", "build-demo", "--home", str(tmp_path)])

    assert result.exit_code == 0
    assert "build_time_s: 201.5 (already built; nothing to do)" in result.output
    assert "eagle_build_time_s: 99.0 (already built; nothing to do)" in result.output
    assert sorted(path.name for path in directory.iterdir()) == [BUILD_MARKER]
    assert sorted(path.name for path in head.iterdir()) == [BUILD_MARKER]
