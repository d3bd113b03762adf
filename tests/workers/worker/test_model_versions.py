"""Model versions on real worker loops (tiny target, in threads), a real Redis and the real gateway: a job
pinned to a version waits, untouched, while only other versions are served, and is taken by the first worker
that serves its version; every started job records its worker's version; /v1/models lists the versions."""

from pathlib import Path

import httpx
import redis

from shared import keys
from shared.settings import ServiceSettings, with_model_version
from tests.helpers.engine_worker import EngineThread
from tests.helpers.gateway import ThreadedGateway
from tests.helpers.redis_fixtures import submit_job
from tests.helpers.waiting import wait_until

SHORT = {"max_tokens": 6, "temperature": 0}


def _succeeded(client: redis.Redis, job_id: str) -> dict[str, str]:
    return wait_until(lambda: (f := client.hgetall(keys.job_hash(job_id)))["status"] == "succeeded" and f,
                      what=f"job {job_id} to succeed")


def test_pinned_jobs_only_run_on_their_version(
    settings: ServiceSettings, rclient: redis.Redis, tiny_target: Path, gateway: ThreadedGateway
) -> None:
    old = EngineThread(with_model_version(settings, "tiny@1"), tiny_target, worker_id="old", model_name="tiny",
                       max_num_seqs=2).start()
    new = None
    try:
        pinned = submit_job(rclient, settings, **SHORT, model_version="tiny@2")
        anyone = submit_job(rclient, settings, **SHORT)
        assert _succeeded(rclient, anyone)["model_version"] == "tiny@1"
        waiting = rclient.hgetall(keys.job_hash(pinned))  # the old worker saw it and put it back, untouched
        assert waiting["status"] == "queued" and waiting["attempt"] == "0" and "started_at" not in waiting
        with httpx.Client(base_url=gateway.url) as http:
            assert http.get("/v1/models").json()["data"][0]["versions"] == ["tiny@1"]
            new = EngineThread(with_model_version(settings, "tiny@2"), tiny_target, worker_id="new",
                               model_name="tiny", max_num_seqs=2).start()
            done = _succeeded(rclient, pinned)
            assert done["model_version"] == "tiny@2" and done["worker"] == "new" and done["attempt"] == "1"
            assert http.get("/v1/models").json()["data"][0]["versions"] == ["tiny@1", "tiny@2"]
            job = http.get(f"/v1/jobs/{pinned}").json()
            assert job["model_version"] == "tiny@2"
            bad = http.post("/v1/jobs", json={"prompt": "x", "model_version": "no spaces"})
            assert bad.status_code == 422 and bad.json()["error"]["field"] == "model_version"
    finally:
        old.stop()
        if new is not None:
            new.stop()
    assert rclient.hgetall(keys.WORKER_VERSIONS) == {}  # a stopped worker unregisters its version
