"""``python -m bench.runs.capture_vllm`` (``make fixtures-vllm``): what a real vLLM 0.32 answers, into
``tests/fixtures/vllm-0.32/``, for the test that holds the mock's vLLM dialect against it.

One replica of the tiny model with both LoRA adapters is started, sent a fixed history (a chat, a completion on
each adapter, a streamed chat), and read: ``/metrics``, ``/v1/models``, ``/openapi.json``, and its error bodies
(an unknown model, a malformed request, the agents' APIs' not-found answers), and the routes it logs as it starts. Local
paths and ids are replaced
by placeholders; values stay (the comparison is of names, types, label keys and shapes, not numbers).
"""

from __future__ import annotations

import argparse
import json
import os
import re
import sys
import tempfile
import time
import urllib.error
import urllib.request
from pathlib import Path

from extproc.tools.stack import real_vllm

OUT = real_vllm.REPO / "tests" / "fixtures" / "vllm-0.32"
ADAPTERS = ("tiny-lora-a", "tiny-lora-b")

# what is sent, by name; the mock is sent the same (tests/integration/test_mock_against_vllm.py)
HISTORY = [
    ("/v1/chat/completions", {"model": "{model}", "max_tokens": 8, "messages": [{"role": "user",
                                                                                 "content": "hello " * 40}]}),
    ("/v1/completions", {"model": "tiny-lora-a", "prompt": "adapter a " * 20, "max_tokens": 8}),
    ("/v1/completions", {"model": "tiny-lora-b", "prompt": "adapter b " * 20, "max_tokens": 8}),
    ("/v1/chat/completions", {"model": "{model}", "max_tokens": 8, "stream": True,
                              "stream_options": {"include_usage": True},
                              "messages": [{"role": "user", "content": "hello " * 40}]}),
]
ERRORS = {
    "unknown-model": ("/v1/chat/completions", {"model": "no-such-model", "messages": [{"role": "user",
                                                                                       "content": "x"}]}),
    "messages-not-a-list": ("/v1/chat/completions", {"model": "{model}", "messages": "x"}),
    # what the mock refuses itself: a max_tokens that is no number, a prompt longer than the model reads
    "max-tokens-not-a-number": ("/v1/chat/completions", {"model": "{model}", "max_tokens": "many",
                                                         "messages": [{"role": "user", "content": "x"}]}),
    "prompt-too-long": ("/v1/completions", {"model": "{model}", "max_tokens": 8, "prompt": "word " * 20000}),
    # the agents' APIs: Anthropic's error shape on /v1/messages; a stored response this replica does not hold
    "anthropic-unknown-model": ("/v1/messages", {"model": "no-such-model", "max_tokens": 8,
                                                 "messages": [{"role": "user", "content": "x"}]}),
    "previous-response-not-found": ("/v1/responses", {"model": "{model}", "input": "x",
                                                      "previous_response_id": "resp_not_here"}),
    "stored-response-not-found": ("GET /v1/responses/resp_not_here", None),
}
ROUTE_LINE = re.compile(r"Route: (\S+), (?:Methods: ([A-Z, ]+)|Endpoint: \w+)")


def routes_of(log: str) -> dict[str, list[str]]:
    """Every route vLLM logs as it starts (``launchers/launcher.py``), those outside /openapi.json too."""
    out: dict[str, set[str]] = {}
    for m in ROUTE_LINE.finditer(log):
        out.setdefault(m.group(1), set()).update(x.strip() for x in (m.group(2) or "").split(",") if x.strip())
    return {p: sorted(ms) for p, ms in out.items()}


def send(url: str, path: str, doc: dict | None, model: str) -> tuple[int, bytes]:
    """POST ``doc`` to ``path`` (``"GET /path"`` with no doc: a GET)."""
    method, _, path = path.rpartition(" ")
    body = json.dumps(doc).replace("{model}", model).encode() if doc is not None else None
    req = urllib.request.Request(url + path, data=body, headers={"content-type": "application/json"},
                                 method=method or "POST")
    try:
        with urllib.request.urlopen(req, timeout=60) as r:
            return r.status, r.read()
    except urllib.error.HTTPError as e:
        return e.code, e.read()


def clean(text: str, model_dir: str) -> str:
    text = text.replace(model_dir, "/models/tiny-llama")
    text = re.sub(r'"(modelperm|chatcmpl|cmpl)-[0-9a-f-]+"', r'"\1-x"', text)
    return re.sub(r'"created": ?\d+', '"created": 0', text)


def engine_model(argv: list[str] | None, doc: str) -> str | None:
    """The served model's name once the arguments are read and the engine is here; None (said why) if it is not."""
    argparse.ArgumentParser(description=doc.split("\n\n")[0]).parse_args(argv)
    why = real_vllm.available()
    if why:
        print(why, file=sys.stderr)
        return None
    return real_vllm.model_info()["served_name"]


def main(argv: list[str] | None = None) -> int:
    model = engine_model(argv, __doc__)
    if model is None:
        return 1
    with tempfile.TemporaryDirectory(prefix="warmroute-capture-") as d:
        os.environ["VLLM_LOGGING_LEVEL"] = "INFO"  # its routes are logged at INFO as it starts
        proc, port = real_vllm.start_vllm("vllm", Path(d), real_vllm.VllmOptions(lora=ADAPTERS,
                                                                                            responses_store=True))
        try:
            url = f"http://127.0.0.1:{port}"
            for path, doc in HISTORY:
                status, _ = send(url, path, doc, model)
                assert status == 200, (path, status)
            errors = {}
            for name, (path, doc) in ERRORS.items():
                status, body = send(url, path, doc, model)
                errors[name] = {"status": status, "body": json.loads(body)}
            time.sleep(1.0)  # the engine's stats reach the front end's /metrics a moment after a request ends
            read = {p: urllib.request.urlopen(url + p, timeout=10).read().decode() for p in
                    ("/metrics", "/v1/models", "/openapi.json")}
            routes = routes_of(proc.log_tail(1 << 22))
        finally:
            proc.stop()
    mdir = str(real_vllm.model_dir())
    OUT.mkdir(parents=True, exist_ok=True)
    (OUT / "metrics.txt").write_text(clean(read["/metrics"], mdir))
    (OUT / "models.json").write_text(clean(json.dumps(json.loads(read["/v1/models"]), indent=1, sort_keys=True),
                                           mdir) + "\n")
    (OUT / "openapi-paths.json").write_text(json.dumps(
        {p: sorted(m.upper() for m in ops) for p, ops in json.loads(read["/openapi.json"])["paths"].items()},
        indent=1, sort_keys=True) + "\n")
    (OUT / "errors.json").write_text(json.dumps(errors, indent=1, sort_keys=True) + "\n")
    (OUT / "routes.json").write_text(json.dumps(routes, indent=1, sort_keys=True) + "\n")
    print(f"wrote {OUT}: metrics.txt models.json openapi-paths.json errors.json routes.json")
    return 0


if __name__ == "__main__":
    sys.exit(main())
