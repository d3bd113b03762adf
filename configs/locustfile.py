"""A locust load test of a running fleet, for teams that use locust (`specfleet load` is the built-in one,
shared/load.py). locust is not a specfleet dependency: `pip install locust`, then

    SPECFLEET_API_KEY=sf-... locust -f configs/locustfile.py --host http://127.0.0.1:8000

Each user submits greedy jobs (mixed priorities) and reads each to its end, half by streaming (SSE), half by
polling; TTFT is reported as its own request type ("ttft") so locust's percentiles show it next to the calls.
tests/configs/test_locustfile.py checks that every path used here is one the gateway serves.
"""

import os
import random
import time

from locust import HttpUser, between, task

PROMPTS = ("def fibonacci(n):", "import os\n\n\ndef main():", "class Stack:\n    def __init__(self):")
PRIORITIES = ("interactive", "default", "default", "batch")
MAX_TOKENS = 32
POLL_INTERVAL_S = 0.05


class FleetUser(HttpUser):
    wait_time = between(0.5, 2.0)

    def on_start(self) -> None:
        self.client.headers["Authorization"] = f"Bearer {os.environ.get('SPECFLEET_API_KEY', '')}"

    def _submit(self) -> tuple[str, float] | None:
        body = {"prompt": random.choice(PROMPTS), "max_tokens": MAX_TOKENS, "temperature": 0, "ignore_eos": True,
                "priority": random.choice(PRIORITIES)}
        sent_s = time.perf_counter()
        with self.client.post("/v1/jobs", json=body, name="/v1/jobs", catch_response=True) as response:
            if response.status_code != 202:
                response.failure(f"submit: HTTP {response.status_code}")
                return None
            return str(response.json()["id"]), sent_s

    def _record_ttft(self, sent_s: float) -> None:
        self.environment.events.request.fire(request_type="ttft", name="first token", response_length=0,
                                             response_time=(time.perf_counter() - sent_s) * 1e3, exception=None,
                                             context={})

    @task
    def streaming(self) -> None:
        submitted = self._submit()
        if submitted is None:
            return
        job_id, sent_s = submitted
        with self.client.get(f"/v1/jobs/{job_id}/stream", name="/v1/jobs/{id}/stream", stream=True) as response:
            first = True
            for line in response.iter_lines(decode_unicode=True):
                if first and line == "event: token":
                    self._record_ttft(sent_s)
                    first = False
                if line in ("event: done", "event: error"):
                    break

    @task
    def polling(self) -> None:
        submitted = self._submit()
        if submitted is None:
            return
        job_id, sent_s = submitted
        first = True
        while True:
            job = self.client.get(f"/v1/jobs/{job_id}", name="/v1/jobs/{id}").json()
            if first and (job.get("output") or {}).get("token_ids"):
                self._record_ttft(sent_s)
                first = False
            if job["status"] not in ("queued", "running"):
                return
            time.sleep(POLL_INTERVAL_S)
