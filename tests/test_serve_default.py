"""`python -m dspark.serve` with no arguments serves the embedded model, and the README's curl example works
as written (only the port changes)."""
from __future__ import annotations

import json
import re
import shlex
import shutil
import subprocess

import httpx
import pytest

from dspark.model.checkpoint import DEFAULT_MODEL
from serving import ROOT, start_server


@pytest.fixture(scope="module")
def default_server(tmp_path_factory):
    assert (DEFAULT_MODEL / "config.json").is_file(), "the embedded default model is missing from the package"
    s = start_server(["--max-num-seqs", "4"], tmp_path_factory.mktemp("default"))
    yield s
    s.stop()


def readme_curl() -> str:
    m = re.search(r"```bash\n(curl .*?)\n```", (ROOT / "README.md").read_text(), re.S)
    assert m, "README has no curl example"
    return m.group(1).replace("\\\n", " ")


def test_no_arguments_serves_the_embedded_model(default_server):
    models = httpx.get(default_server.url + "/v1/models").json()["data"]
    assert models[0]["id"] == models[0]["root"] == "default"               # the directory's name, never its path


def test_readme_curl_example_works_as_written(default_server):
    cmd = readme_curl().replace("http://127.0.0.1:8000", default_server.url)
    if shutil.which("curl"):
        out = subprocess.run(shlex.split(cmd), capture_output=True, text=True, timeout=300).stdout
    else:                                       # the same request without curl
        args = shlex.split(cmd)
        out = httpx.post(args[2], content=args[args.index("-d") + 1], headers={"Content-Type": "application/json"},
                         timeout=300).text
    body = json.loads(out)
    assert body["object"] == "text_completion" and body["choices"][0]["text"].strip(), body
    assert body["choices"][0]["finish_reason"] in ("stop", "length")
