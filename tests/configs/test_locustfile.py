"""configs/locustfile.py: locust is not installed here (not a dependency), so the file is checked statically:
it parses, imports only locust and the standard library, and every path it calls is one the gateway serves
(read from the gateway's own OpenAPI schema)."""

import ast
import re
import sys
from pathlib import Path

from gateway.main import create_app
from shared.settings import ServiceSettings

LOCUSTFILE = Path(__file__).resolve().parents[2] / "configs" / "locustfile.py"


def test_locustfile_imports_and_paths() -> None:
    tree = ast.parse(LOCUSTFILE.read_text())
    imported = {alias.name.split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.Import)
                for alias in node.names}
    imported |= {str(node.module).split(".")[0] for node in ast.walk(tree) if isinstance(node, ast.ImportFrom)}
    assert imported - set(sys.stdlib_module_names) == {"locust"}
    # every call names its path template (`name=`): locust groups its statistics by it
    names = {kw.value.value for node in ast.walk(tree) if isinstance(node, ast.Call) for kw in node.keywords
             if kw.arg == "name" and isinstance(kw.value, ast.Constant) and str(kw.value.value).startswith("/")}
    calls = [node for node in ast.walk(tree) if isinstance(node, ast.Call) and isinstance(node.func, ast.Attribute)
             and node.func.attr in ("get", "post") and getattr(node.func.value, "attr", "") == "client"]
    assert calls and all(any(kw.arg == "name" for kw in call.keywords) for call in calls)
    app = create_app(ServiceSettings(redis_url="redis://127.0.0.1:1/0"))  # the schema needs no connection
    schema_paths = set(app.openapi()["paths"])
    called = {re.sub(r"\{[^}]+\}", "{job_id}", name) for name in names}
    assert called == {"/v1/jobs", "/v1/jobs/{job_id}", "/v1/jobs/{job_id}/stream"} and called <= schema_paths
