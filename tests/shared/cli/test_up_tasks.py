"""`specfleet up` runs the Celery worker too: a batch submitted to it completes; Ctrl-C stops everything."""

import json
import subprocess
import sys
from pathlib import Path

from tests.helpers import REPO_ROOT
from tests.helpers.up_process import children_of, running_up


def test_up_starts_celery_and_a_batch_completes(tiny_target: Path, tmp_path: Path) -> None:
    with running_up(["--target", str(tiny_target)], tmp_path) as up:
        children = children_of(up.process.pid)
        source = tmp_path / "in.jsonl"
        source.write_text(
            "".join(
                json.dumps(
                    {
                        "custom_id": f"c{i}",
                        "method": "POST",
                        "url": "/v1/jobs",
                        "body": {"prompt": "def f(", "max_tokens": 2},
                    }
                )
                + "\n"
                for i in range(3)
            )
        )
        done = subprocess.run(
            [
                sys.executable,
                "-m",
                "shared.cli",
                "batch",
                "submit",
                str(source),
                "--wait",
                "-o",
                str(tmp_path / "out.jsonl"),
                "--url",
                up.url,
            ],
            cwd=REPO_ROOT,
            env=up.env,
            capture_output=True,
            text=True,
            timeout=120,
        )
        assert done.returncode == 0, done.stderr
        assert len((tmp_path / "out.jsonl").read_text().splitlines()) == 3
        up.stop_with_ctrl_c(children)
