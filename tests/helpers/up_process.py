"""A real `specfleet up` process for tests: started, read until the gateway's URL, stopped with Ctrl-C."""

import contextlib
import os
import queue
import signal
import subprocess
import sys
import threading
from collections.abc import Iterator
from dataclasses import dataclass, field
from pathlib import Path

from tests.helpers import REPO_ROOT
from tests.helpers.redis_fixtures import FAST_TIMINGS

GATEWAY_LINE = "specfleet: gateway at "
API_KEY_LINE = "specfleet: api key "
UP_LINE_TIMEOUT_S = 180.0  # start-up: Redis, Celery, the worker (models, kernels, warm-up), the gateway


def children_of(pid: int) -> list[int]:
    found = []
    for stat in Path("/proc").glob("[0-9]*/stat"):
        try:
            fields = stat.read_text().rsplit(")", 1)[1].split()
        except OSError:
            continue
        if int(fields[1]) == pid:
            found.append(int(stat.parent.name))
    return found


def is_alive(pid: int) -> bool:
    try:
        state = Path(f"/proc/{pid}/stat").read_text().rsplit(")", 1)[1].split()[0]
    except OSError:
        return False
    return state != "Z"


@dataclass
class UpProcess:
    process: subprocess.Popen[str]
    lines: queue.Queue[str]  # stdout lines not read yet
    env: dict[str, str]  # the environment it runs in (carries SPECFLEET_API_KEY once printed)
    printed: list[str] = field(default_factory=list)  # stdout up to and including the gateway line
    url: str = ""
    api_key: str = ""

    def rest_of_output(self) -> list[str]:
        rest = []
        while not self.lines.empty():
            rest.append(self.lines.get())
        return rest

    def stop_with_ctrl_c(self, children: list[int]) -> None:
        """SIGINT: `up` exits 0 and none of `children` (its processes, taken while it ran) is left."""
        self.process.send_signal(signal.SIGINT)
        assert self.process.wait(timeout=60) == 0
        assert [pid for pid in children if is_alive(pid)] == []


@contextlib.contextmanager
def running_up(model_args: list[str], tmp_path: Path, extra_env: dict[str, str] | None = None) -> Iterator[UpProcess]:
    """`specfleet up --port 0 <model_args>` with its Redis under tmp_path; yields once the gateway serves."""
    env = {k: v for k, v in os.environ.items() if not k.startswith("SPECFLEET_") and k != "REDIS_URL"}
    env.update({f"SPECFLEET_{k.upper()}": str(v) for k, v in FAST_TIMINGS.items()})
    env.update(extra_env or {})
    env["SPECFLEET_REDIS_DIR"] = str(tmp_path / "redis")
    stderr_path = tmp_path / "up.stderr"  # up's and its children's logs: quoted when it does not come up
    with open(stderr_path, "wb") as stderr:
        process = subprocess.Popen(
            [sys.executable, "-m", "shared.cli", "up", "--port", "0", *model_args],
            cwd=REPO_ROOT,
            env=env,
            stdout=subprocess.PIPE,
            stderr=stderr,
            text=True,
        )
    up = UpProcess(process, queue.Queue(), env)

    def pump_stdout() -> None:
        for line in process.stdout or []:
            up.lines.put(line)

    reader = threading.Thread(target=pump_stdout, daemon=True)
    reader.start()
    try:
        while not any(line.startswith(GATEWAY_LINE) for line in up.printed):
            try:
                line = up.lines.get(timeout=UP_LINE_TIMEOUT_S)
            except queue.Empty:
                logs = stderr_path.read_text(errors="replace")[-6000:]
                raise AssertionError(
                    f"`specfleet up` printed no line for {UP_LINE_TIMEOUT_S:.0f} s (exit code {process.poll()}); "
                    f"its output so far: {up.printed}; its log ends:\n{logs}"
                ) from None
            up.printed.append(line)
            if line.startswith(API_KEY_LINE):  # dev mode prints a fresh key before the URL
                up.api_key = env["SPECFLEET_API_KEY"] = line.removeprefix(API_KEY_LINE).strip()
        up.url = up.printed[-1].removeprefix(GATEWAY_LINE).strip()
        yield up
    finally:
        if process.poll() is None:
            process.kill()
            process.wait()
        reader.join(timeout=5)
        if process.stdout:
            process.stdout.close()
