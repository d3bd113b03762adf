"""The launch checklist behind `specfleet validate`, run against a fleet over HTTP (shared/cli/validate.py).

Each check gives a `Check(name, passed, value, limit)`; `passed` None = skipped (what it needs was not given).
- sd_greedy_token_match, sd_bleu: the prompts decoded greedily with speculation and without, one job at a
  time: the share of token positions that agree, and corpus BLEU over token ids (shared/bleu.py);
- seeded_sample_reproduces: a sampled request with a seed, sent twice, gives the same tokens;
- rejection_rate: of the draft tokens the target judged, the share it rejected (1 - α, the per-token acceptance
  of Leviathan et al.; pooled over the jobs' tokens, from the counts each job reports), with τ (tokens per target pass) and the share
  of drafted tokens discarded (1 - `acceptance_rate`: it also counts the tokens after a rejection, never judged,
  so it grows with the speculation length the engine chose) reported too;
- ttft_p50_ms … tpot_p99_ms, load_errors: a short open-loop load (shared/load.py);
- unauthorized_401, oversized_413: a request with a bad key, and a body over the gateway's limit;
- cancel: a long job cancelled right after submit ends `cancelled`;
- webhook_signed: a job's `completed` webhook reaches a receiver started here, with a valid Standard Webhooks
  signature (needs --webhook-secret, the validating key's; and a gateway that may call --webhook-host);
- model_version: the live workers serve a version (the expected one, when given) and a job records it.
Speaks HTTP only: imports nothing of the gateway or the workers.
"""

import asyncio
import json
import queue
import threading
from dataclasses import asdict, dataclass, field
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from typing import Any

import httpx

from shared.bleu import corpus_bleu
from shared.load import DEFAULT_PROMPTS, LoadPlan, run_load
from shared.webhook_signing import InvalidSignature, verify

WAIT_S = 120  # Prefer: wait for the checklist's own jobs


@dataclass
class Check:
    name: str
    passed: bool | None  # None: skipped
    value: Any
    limit: Any = None


@dataclass
class ValidationPlan:
    prompts: tuple[str, ...] = DEFAULT_PROMPTS
    max_tokens: int = 48
    min_token_match: float = 0.98  # greedy SD vs plain: bf16 verification may round a near-tie differently
    min_bleu: float = 0.95
    max_rejection_rate: float = 0.15  # the operators' checklist
    load_rate_per_s: float = 4.0
    load_duration_s: float = 3.0
    load_min_requests: int = 12  # the load lasts at least this many mean inter-arrival times
    max_ttft_ms: dict[str, float] = field(default_factory=lambda: {"p50": 500.0, "p99": 2000.0})
    max_tpot_ms: dict[str, float] = field(default_factory=lambda: {"p50": 100.0, "p99": 250.0})
    oversize_bytes: int = 4 << 20  # over the gateway's max_request_bytes (1 MiB by default)
    webhook_secret: str | None = None
    webhook_host: str = "127.0.0.1"
    model_version: str | None = None  # expected; None: any


class Validator:
    def __init__(self, url: str, api_key: str | None, plan: ValidationPlan) -> None:
        self.url = url
        self.api_key = api_key
        self.plan = plan
        headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
        self.http = httpx.Client(base_url=url, headers=headers, timeout=WAIT_S + 30)

    def run(self) -> list[Check]:
        checks: list[Check] = []
        for step in (self._speculation, self._seeded, self._load, self._refusals, self._cancel, self._webhook,
                     self._model_version):
            try:
                checks += step()
            except (httpx.HTTPError, KeyError, ValueError, TypeError) as exc:  # a broken fleet fails the step
                checks.append(Check(step.__name__.strip("_"), False, f"{type(exc).__name__}: {exc}"))
        self.http.close()
        return checks

    def _job(self, body: dict[str, Any]) -> dict[str, Any]:
        """Submit and wait for the job's end -> the job (raises ValueError on an error answer)."""
        response = self.http.post("/v1/jobs", json=body, headers={"Prefer": f"wait={WAIT_S}"})
        if response.status_code >= 400:
            raise ValueError(f"HTTP {response.status_code}: {response.text[:200]}")
        job: dict[str, Any] = response.json()
        while job["status"] in ("queued", "running"):  # Prefer: wait is capped by the gateway's max_wait_s
            job = self.http.get(f"/v1/jobs/{job['id']}", headers={}).json()
        return job

    def _speculation(self) -> list[Check]:
        plan = self.plan
        base = {"max_tokens": plan.max_tokens, "temperature": 0, "ignore_eos": True}
        spec = [self._job({**base, "prompt": p, "speculative": True}) for p in plan.prompts]
        plain = [self._job({**base, "prompt": p, "speculative": False}) for p in plan.prompts]
        spec_ids = [j["output"]["token_ids"] if j["status"] == "succeeded" else [] for j in spec]
        plain_ids = [j["output"]["token_ids"] if j["status"] == "succeeded" else [] for j in plain]
        positions = sum(max(len(a), len(b)) for a, b in zip(spec_ids, plain_ids, strict=True))
        same = sum(x == y for a, b in zip(spec_ids, plain_ids, strict=True) for x, y in zip(a, b, strict=False))
        match = same / positions if positions else 0.0
        bleu = corpus_bleu(spec_ids, plain_ids)
        # jobs that verified draft tokens (the engine's length policy may rightly choose plain decoding: then
        # there is no rate to judge, and the check fails saying so - SD is not what serves this fleet)
        figures = pooled_speculation([j["metrics"] for j in spec])
        rejection = figures["rejection_rate"]
        return [
            Check("sd_greedy_token_match", match >= plan.min_token_match, round(match, 4), f">= {plan.min_token_match}"),
            Check("sd_bleu", bleu >= plan.min_bleu, round(bleu, 4), f">= {plan.min_bleu}"),
            Check("rejection_rate", rejection is not None and rejection <= plan.max_rejection_rate,
                  {**figures, "num_prompts": len(plan.prompts)}, f"<= {plan.max_rejection_rate}"),
        ]

    def _seeded(self) -> list[Check]:
        body = {"prompt": self.plan.prompts[0], "max_tokens": self.plan.max_tokens, "temperature": 0.8,
                "seed": 1234, "ignore_eos": True}
        first, second = self._job(body), self._job(body)
        same = first["status"] == second["status"] == "succeeded" and (
            first["output"]["token_ids"] == second["output"]["token_ids"]
        )
        return [Check("seeded_sample_reproduces", same, same, True)]

    def _load(self) -> list[Check]:
        plan = self.plan
        # long enough for about load_min_requests arrivals: a percentile of one request says nothing
        duration_s = max(plan.load_duration_s, plan.load_min_requests / plan.load_rate_per_s)
        load = LoadPlan(rate_per_s=plan.load_rate_per_s, duration_s=duration_s, prompts=plan.prompts,
                        max_tokens=plan.max_tokens)
        report = asyncio.run(run_load(self.url, self.api_key, load))
        checks = []
        for series, limits in (("ttft", plan.max_ttft_ms), ("tpot", plan.max_tpot_ms)):
            for q, limit in limits.items():
                value = report.percentiles_ms[series][q]
                checks.append(Check(f"{series}_{q}_ms", value <= limit, round(value, 1), f"<= {limit:g}"))
        num_errors = report.num_sent - report.num_ok
        checks.append(Check("load_errors", num_errors == 0 and report.num_sent > 0,
                            {"sent": report.num_sent, "errors": report.errors}, "0 errors"))
        return checks

    def _refusals(self) -> list[Check]:
        body = {"prompt": "hello", "max_tokens": 1}
        unauthorized = self.http.post("/v1/jobs", json=body, headers={"Authorization": "Bearer sf-validate-bogus"})
        oversized = self.http.post("/v1/jobs", content=b'{"prompt": "' + b"x" * self.plan.oversize_bytes + b'"}',
                                   headers={"Content-Type": "application/json"})
        return [
            Check("unauthorized_401", unauthorized.status_code == 401, unauthorized.status_code, 401),
            Check("oversized_413", oversized.status_code == 413, oversized.status_code, 413),
        ]

    def _cancel(self) -> list[Check]:
        max_tokens = 4096  # long enough that it is still running when the cancel arrives; halved while it is 413
        while True:
            submitted = self.http.post("/v1/jobs", json={"prompt": self.plan.prompts[0], "max_tokens": max_tokens,
                                                          "temperature": 0, "ignore_eos": True})
            if submitted.status_code != 413 or max_tokens <= 64:
                break
            max_tokens //= 2
        if submitted.status_code >= 400:
            return [Check("cancel", False, f"submit: HTTP {submitted.status_code}", "cancelled")]
        job_id = submitted.json()["id"]
        answer = self.http.post(f"/v1/jobs/{job_id}/cancel")
        status = self.http.get(f"/v1/jobs/{job_id}").json().get("status")
        return [Check("cancel", answer.status_code == 200 and status == "cancelled", status, "cancelled")]

    def _webhook(self) -> list[Check]:
        secret = self.plan.webhook_secret
        if not secret:
            return [Check("webhook_signed", None, "skipped: no --webhook-secret", "a valid signature")]
        received: queue.Queue[tuple[dict[str, str], bytes]] = queue.Queue()

        class Receiver(BaseHTTPRequestHandler):
            def do_POST(self) -> None:  # noqa: N802  (http.server's name)
                body = self.rfile.read(int(self.headers.get("Content-Length") or 0))
                received.put((dict(self.headers.items()), body))
                self.send_response(204)
                self.end_headers()

            def log_message(self, format: str, *args: Any) -> None:  # noqa: A002  (silence the access log)
                return

        server = ThreadingHTTPServer((self.plan.webhook_host, 0), Receiver)
        threading.Thread(target=server.serve_forever, daemon=True).start()
        try:
            hook = f"http://{self.plan.webhook_host}:{server.server_address[1]}/hook"
            job = self._job({"prompt": "hello", "max_tokens": 2, "webhook": hook,
                             "webhook_events_filter": ["completed"]})
            try:
                headers, body = received.get(timeout=60)
            except queue.Empty:
                return [Check("webhook_signed", False, f"no delivery within 60 s (job {job['status']})",
                              "a valid signature")]
            try:
                verify(secret, headers, body)
            except InvalidSignature as exc:
                return [Check("webhook_signed", False, str(exc), "a valid signature")]
            return [Check("webhook_signed", json.loads(body)["id"] == job["id"], "valid", "a valid signature")]
        finally:
            server.shutdown()
            server.server_close()

    def _model_version(self) -> list[Check]:
        models = self.http.get("/v1/models").json().get("data", [])
        versions = models[0].get("versions", []) if models else []
        job = self._job({"prompt": "hello", "max_tokens": 1})
        expected = self.plan.model_version
        served = job.get("model_version")
        passed = bool(versions) and served in versions and (expected is None or versions == [expected])
        return [Check("model_version", passed, {"served": versions, "job": served}, expected or "any, recorded")]


def pooled_speculation(metrics: list[dict[str, Any]]) -> dict[str, Any]:
    """The speculation figures of jobs' metrics, pooled over their tokens: rejection_rate (rejected over judged),
    tau (tokens emitted per verifying pass) and drafted_discarded (1 - accepted over drafted), None where no job
    verified a draft. Pooled, not averaged per job: a job the length policy let draft once judges a token or two,
    and its rate (often 0 or 1) would weigh as much as a job that judged hundreds."""
    drafted = [m for m in metrics if m.get("num_draft_tokens") and m.get("num_spec_steps") is not None]
    num_steps = sum(m["num_spec_steps"] for m in drafted)
    num_drafted = sum(m["num_draft_tokens"] for m in drafted)
    num_accepted = sum(m["num_accepted_tokens"] for m in drafted)
    num_judged = num_accepted + sum(m["num_rejected_tokens"] for m in drafted)
    return {
        "rejection_rate": round(1 - num_accepted / num_judged, 4) if num_judged else None,
        "tau": round((num_accepted + num_steps) / num_steps, 3) if num_steps else None,  # a bonus token each pass
        "drafted_discarded": round(1 - num_accepted / num_drafted, 4) if num_drafted else None,
        "jobs_that_drafted": len(drafted),
        "tokens_judged": num_judged,
    }


def report_json(checks: list[Check]) -> dict[str, Any]:
    return {"checks": [asdict(c) for c in checks]}
