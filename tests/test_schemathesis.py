"""A bounded property-based fuzz of the live server from its own OpenAPI schema: no input makes it answer 5xx."""
from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error

from serving import start_server

EXAMPLES = 40   # per operation; bounded so the run takes about a minute on the 2-core CI machine


@pytest.fixture(scope="module")
def server(tiny_ckpt, tmp_path_factory):
    # a short context keeps every generated request cheap: max_tokens beyond it is a 400, not a long generation
    s = start_server(["--model", str(tiny_ckpt), "--max-model-len", "48", "--kv-cache-memory-bytes", str(32 * 2**20),
                      "--max-num-seqs", "8", "--speculative", "none"], tmp_path_factory.mktemp("fuzz"))
    yield s
    s.stop()


def test_fuzz_the_openapi_schema_finds_no_5xx(server):
    schema = schemathesis.openapi.from_url(server.url + "/openapi.json")
    ops = [r.ok() for r in schema.get_all_operations()]
    assert {(o.method.upper(), o.path) for o in ops} >= {("POST", "/v1/completions"), ("POST", "/v1/chat/completions"),
                                                         ("POST", "/tokenize"), ("GET", "/v1/models")}
    statuses: dict[int, int] = {}
    for op in ops:
        @given(case=op.as_strategy())
        @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        def fuzz(case):
            response = case.call(timeout=120)
            statuses[response.status_code] = statuses.get(response.status_code, 0) + 1
            case.validate_response(response, checks=[not_a_server_error])
        fuzz()
    print("schemathesis statuses:", statuses)
    assert sum(statuses.values()) >= len(ops) and not any(s >= 500 for s in statuses), statuses
    assert httpx.post(server.url + "/v1/completions", json={"prompt": "ok", "max_tokens": 2}).status_code == 200
