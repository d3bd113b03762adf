"""`specfleet validate` and `specfleet load` against a real `specfleet up` (tiny target, speculating with itself
as the draft, so its drafts are accepted): validate passes and writes its JSON; with a key without rights, or
an expected model version the fleet does not serve, it exits 1 naming the failed checks; load prints its table
and writes its JSON. The BLEU and percentile helpers are checked on their own."""

import json
import subprocess
import sys
import threading
from http.server import BaseHTTPRequestHandler, ThreadingHTTPServer
from pathlib import Path

import pytest

from shared.bleu import corpus_bleu
from shared.cli.validate import NUM_DEMO_PROMPTS, default_prompts
from shared.load import DEFAULT_PROMPTS, arrival_times_s, percentile
from shared.validation import pooled_speculation
from shared.webhook_signing import DEV_WEBHOOK_SECRET
from tests.helpers.up_process import UpProcess, running_up

ROOT = Path(__file__).resolve().parents[3]
LOADED_MACHINE = ["--max-ttft-p50-ms", "5000", "--max-ttft-p99-ms", "20000", "--max-tpot-p50-ms", "1000",
                  "--max-tpot-p99-ms", "5000"]  # 2 shared cores: the latency limits are the operator's to set


def cli(up: UpProcess, *args: str, api_key: str | None = None) -> subprocess.CompletedProcess[str]:
    env = {**up.env, "SPECFLEET_API_KEY": api_key or up.api_key}
    return subprocess.run([sys.executable, "-m", "shared.cli", *args, "--url", up.url], cwd=ROOT, env=env,
                          capture_output=True, text=True, timeout=600)


def test_bleu_and_percentiles() -> None:
    assert corpus_bleu([[1, 2, 3, 4, 5]], [[1, 2, 3, 4, 5]]) == 1.0
    assert corpus_bleu([[1, 2, 3, 4, 9]], [[1, 2, 3, 4, 5]]) == pytest.approx((4 / 5 * 3 / 4 * 2 / 3 * 1 / 2) ** 0.25)
    assert corpus_bleu([[9, 9, 9, 9]], [[1, 2, 3, 4]]) == 0.0
    assert percentile([1.0, 2.0, 3.0, 4.0], 50) == 2.5 and percentile([5.0], 99) == 5.0
    import random

    times = arrival_times_s(10.0, 100.0, random.Random(0))
    assert 900 < len(times) < 1100 and times == sorted(times) and times[-1] < 100.0


def test_rejection_rate_is_pooled_over_tokens() -> None:
    """A job that drafted once and lost its token weighs one judged token, not half of the figure."""
    once = {"num_draft_tokens": 4, "num_spec_steps": 1, "num_accepted_tokens": 0, "num_rejected_tokens": 1}
    # 100 passes of 4 drafts: 300 accepted; 20 passes ended on a rejection (80 passes accepted all 4)
    long = {"num_draft_tokens": 400, "num_spec_steps": 100, "num_accepted_tokens": 300, "num_rejected_tokens": 20}
    plain = {"num_draft_tokens": 0, "num_spec_steps": 0, "num_accepted_tokens": 0, "num_rejected_tokens": 0}
    figures = pooled_speculation([once, long, plain, {}])  # {}: a job that failed before its first step
    assert figures["rejection_rate"] == round(21 / 321, 4)  # the per-job mean was (1 + 20/320) / 2 = 0.53
    assert figures["tau"] == round((300 + 101) / 101, 3) and figures["drafted_discarded"] == round(1 - 300 / 404, 4)
    assert figures["jobs_that_drafted"] == 2 and figures["tokens_judged"] == 321
    assert pooled_speculation([plain])["rejection_rate"] is None  # nothing judged: no rate, the check fails


def test_validate_and_load_against_up(tiny_target: Path, tmp_path: Path) -> None:
    args = ["--target", str(tiny_target), "--draft", str(tiny_target), "--model-version", "tiny@1"]
    # a target drafting for itself: its draft costs what it does, so lengths from measured costs would draft
    # nothing; a fixed k makes SD run, and its acceptance is what the rejection check reads
    env = {"SPECFLEET_WEBHOOK_ALLOW_HOSTS": "127.0.0.1", "SPECFLEET_ENGINE_IS_ADAPTIVE": "false"}
    with running_up(args, tmp_path, env) as up:
        passed = cli(up, "validate", "--json", str(tmp_path / "ok.json"), "--webhook-secret", DEV_WEBHOOK_SECRET,
                     "--model-version", "tiny@1", *LOADED_MACHINE)
        assert passed.returncode == 0, passed.stdout + passed.stderr
        checks = {c["name"]: c for c in json.loads((tmp_path / "ok.json").read_text())["checks"]}
        assert all(c["passed"] is True for c in checks.values()), checks
        assert {"sd_greedy_token_match", "sd_bleu", "seeded_sample_reproduces", "rejection_rate", "ttft_p99_ms",
                "unauthorized_401", "oversized_413", "cancel", "webhook_signed", "model_version"} <= checks.keys()
        assert checks["rejection_rate"]["value"]["tau"] > 1  # the drafts were accepted
        assert checks["rejection_rate"]["value"]["tokens_judged"] > 0  # the jobs report the counts it pools

        assert default_prompts(up.url, up.api_key) == DEFAULT_PROMPTS  # a fleet not serving the demo pair

        prompts = tmp_path / "prompts.jsonl"
        prompts.write_text('{"prompt": "def parse(text):"}\nclass Queue:\n')
        wrong_version = cli(up, "validate", "--json", str(tmp_path / "version.json"), "--model-version", "tiny@2",
                            "--prompts", str(prompts), *LOADED_MACHINE)
        assert wrong_version.returncode == 1 and "failed: model_version" in wrong_version.stderr
        checks = {c["name"]: c for c in json.loads((tmp_path / "version.json").read_text())["checks"]}
        assert checks["rejection_rate"]["value"]["num_prompts"] == 2  # the speculation checks ran the file's prompts

        no_rights = cli(up, "validate", "--json", str(tmp_path / "bad.json"), *LOADED_MACHINE,
                        api_key="sf-not-a-key")
        assert no_rights.returncode == 1 and "validate: failed:" in no_rights.stderr
        bad = {c["name"]: c["passed"] for c in json.loads((tmp_path / "bad.json").read_text())["checks"]}
        assert bad["unauthorized_401"] is True and bad["load_errors"] is False

        load = cli(up, "load", "--rate", "5", "--duration", "2", "--json", str(tmp_path / "load.json"))
        assert load.returncode == 0, load.stderr
        assert "goodput" in load.stdout and "ttft" in load.stdout
        report = json.loads((tmp_path / "load.json").read_text())
        assert report["num_sent"] > 0 and report["num_ok"] == report["num_sent"] and report["errors"] == {}
        assert report["percentiles_ms"]["ttft"]["p50"] > 0 and report["by_client"]["stream"] > 0


def test_validate_defaults_to_the_demo_corpus_held_out_prompts_for_the_demo_pair() -> None:
    """A fleet whose /v1/models names the demo pair is validated on its corpus's held-out files (the workload it
    was built for), never on the files it trained on. The fleet is a stand-in answering /v1/models only: a demo
    worker takes minutes to start here, and the route's own answer is tested with the gateway."""
    from workers.demo.corpus import held_out_prompts

    class Models(BaseHTTPRequestHandler):
        def do_GET(self) -> None:  # noqa: N802 (http.server's name)
            body = json.dumps({"object": "list", "data": [{"id": "demo", "object": "model"}]}).encode()
            self.send_response(200 if self.path == "/v1/models" else 404)
            self.send_header("Content-Type", "application/json")
            self.end_headers()
            self.wfile.write(body)

        def log_message(self, *args: object) -> None:
            pass

    server = ThreadingHTTPServer(("127.0.0.1", 0), Models)
    threading.Thread(target=server.serve_forever, daemon=True).start()
    try:
        prompts = default_prompts(f"http://127.0.0.1:{server.server_port}", None)
    finally:
        server.shutdown()
        server.server_close()
    assert prompts == tuple(held_out_prompts(NUM_DEMO_PROMPTS)) and len(prompts) == NUM_DEMO_PROMPTS
    assert default_prompts("http://127.0.0.1:9", None) == DEFAULT_PROMPTS  # nothing listening: the generic set
