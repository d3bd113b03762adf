"""`specfleet up`: one command brings up Redis + a worker + the gateway; Ctrl-C stops all, no orphans."""

from pathlib import Path

import httpx

from tests.helpers.up_process import children_of, running_up


def test_up_serves_jobs_and_ctrl_c_leaves_no_process(tiny_pair: tuple[Path, Path], tmp_path: Path) -> None:
    with running_up(["--target", str(tiny_pair[0]), "--draft", str(tiny_pair[1])], tmp_path) as up:
        key_lines = [line for line in up.printed if line.startswith("specfleet: api key ")]
        assert len(key_lines) == 1  # dev mode prints a fresh key, before the URL
        assert httpx.get(f"{up.url}/v1/models", timeout=10).status_code == 401  # every route needs a key
        children = children_of(up.process.pid)
        assert len(children) == 4  # redis-server, celery, worker, gateway
        job = httpx.post(
            f"{up.url}/v1/jobs",
            json={"prompt": "def f(x):", "max_tokens": 6, "temperature": 0},
            headers={"Prefer": "wait=60", "Authorization": f"Bearer {up.api_key}"},
            timeout=90,
        ).json()
        assert job["status"] == "succeeded" and len(job["output"]["token_ids"]) == 6
        up.stop_with_ctrl_c(children)
        assert (tmp_path / "redis" / "appendonly.aof").exists()
    output = up.printed + up.rest_of_output()
    assert any("curl" in line for line in output)
    hints = [line for line in output if "--stream --url" in line]  # the hints name the installed command
    assert len(hints) == 1 and "specfleet submit " in hints[0] and "python -m" not in hints[0]
