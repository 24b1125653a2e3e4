"""schemathesis over a real `sglite serve` (tiny-random): every operation of its
/openapi.json, bodies drawn from the request models (sglite/entrypoints/protocol.py),
valid and invalid, sent to the live server. No answer may be a 5xx, and every answer
must be what the schema says the route gives. The models must also accept exactly the
fields the routes' parsers do, or the fuzzer would explore the wrong bodies."""

from __future__ import annotations

import pytest
import schemathesis
from hypothesis import HealthCheck, settings
from schemathesis.config import SchemathesisConfig

from sglite.entrypoints import openai_api, protocol
from sglite.entrypoints.http_server import GENERATE_FIELDS
from sglite.sampling.sampling_params import SamplingParams
from tests.entrypoints.test_http_server import Server

EXAMPLES = 12  # per operation and mode: a small budget for CI (about 400 requests in all)


@pytest.fixture(scope="module")
def fuzzed_server():
    # a short context keeps every drawn max_new_tokens quick; /debug/control stays off (a
    # drawn "pause" would stop the scheduler for the rest of the run)
    s = Server("--context-length", "64")
    yield s
    rc, err = s.stop()
    assert rc == 0 and "Traceback" not in err, err


@pytest.fixture(scope="module")
def api_schema(fuzzed_server):
    config = SchemathesisConfig.from_dict({"generation": {"mode": "all"}})
    return schemathesis.openapi.from_url(f"{fuzzed_server.url}/openapi.json", config=config)


schema = schemathesis.pytest.from_fixture("api_schema")


@schema.parametrize()
@settings(max_examples=EXAMPLES, deadline=None, suppress_health_check=list(HealthCheck))
def test_no_request_makes_a_server_error(case):
    if case.path == "/debug/events":
        pytest.skip("an event stream never ends (and is off here: 403 whatever the request)")
    response = case.call(timeout=120)
    assert response.status_code < 500, f"{case.method} {case.formatted_path} {case.body!r}: {response.text[:500]}"


def test_the_body_models_take_the_fields_the_routes_take():
    assert set(protocol.GenerateReqInput.model_fields) == GENERATE_FIELDS
    params = {f for f in SamplingParams.__dataclass_fields__ if f != "stop_strs"}
    assert set(protocol.SamplingParamsInput.model_fields) == params
    openai_fields = set(openai_api.SAMPLING_KEYS) | set(openai_api.UNSUPPORTED) | set(openai_api.IGNORED_KEYS)
    assert set(protocol.CompletionRequest.model_fields) == openai_fields | openai_api.COMPLETION_KEYS
    assert set(protocol.ChatCompletionRequest.model_fields) == openai_fields | openai_api.CHAT_KEYS
