"""The gateway's protocol contract: 405 says which methods a route takes (`Allow`), and the
served `/openapi.json` publishes every POST route's request schema and the errors each route
really answers (OpenAI's error body; no 422), checked by fuzzing the served schema with
schemathesis: no 5xx, and every response as documented. Over the scripted backend
(tests/helpers/gateway_fakes.py)."""

from __future__ import annotations

import httpx
import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_headers_conformance,
    response_schema_conformance,
    status_code_conformance,
)

from gateway_fakes import EchoBackend
from paraflex.gateway.app import build_app
from paraflex.gateway.server import ServerThread

POST_SCHEMAS = {"/v1/completions": "CompletionRequest", "/v1/chat/completions": "ChatCompletionRequest",
                "/tokenize": "TokenizeRequest", "/detokenize": "DetokenizeRequest"}


@pytest.fixture(scope="module")
def url():
    server = ServerThread(build_app(EchoBackend(max_context=256), max_outstanding=64)).start()
    yield server.url
    server.stop()


@pytest.mark.parametrize("method, path, allow", [("GET", "/v1/completions", "POST"), ("PUT", "/tokenize", "POST"),
                                                 ("POST", "/health", "GET, HEAD"), ("DELETE", "/v1/models", "GET")])
def test_405_says_which_methods_the_route_takes(url, method, path, allow):
    r = httpx.request(method, f"{url}{path}")
    assert r.status_code == 405 and set(r.headers["allow"].split(", ")) == set(allow.split(", "))
    assert r.json()["error"]["message"] == f"{method} is not allowed on {path}"


def test_the_document_has_every_request_schema_and_the_real_errors(url):
    doc = httpx.get(f"{url}/openapi.json").json()
    schemas = doc["components"]["schemas"]
    for path, name in POST_SCHEMAS.items():
        operation = doc["paths"][path]["post"]
        body = operation["requestBody"]["content"]["application/json"]["schema"]
        assert body == {"$ref": f"#/components/schemas/{name}"} and "properties" in schemas[name]
        assert {"400", "401", "404", "413", "415"} <= set(operation["responses"])
    for path in ("/v1/completions", "/v1/chat/completions"):
        responses = doc["paths"][path]["post"]["responses"]
        assert "503" in responses and "text/event-stream" in responses["200"]["content"]
    for operations in doc["paths"].values():
        for operation in operations.values():
            assert "422" not in operation["responses"]
            for status, response in operation["responses"].items():
                if status not in ("200", "503") or "ErrorBody" in str(response):
                    assert response["content"]["application/json"]["schema"] == {"$ref": "#/components/schemas/ErrorBody"}
    assert set(schemas["ErrorDetail"]["required"]) == {"message", "type", "param", "code"}
    assert "HTTPValidationError" not in schemas


def served_model(case):
    """The case naming a model the server has, so that valid bodies get past the 404 and run."""
    if isinstance(case.body, dict) and "model" in case.body:
        case.body["model"] = "echo-a"
    if case.path_parameters and "model_id" in case.path_parameters:
        case.path_parameters["model_id"] = "echo-b"
    return case


CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance, response_headers_conformance,
          response_schema_conformance]


@pytest.mark.slow
def test_fuzzing_the_served_schema_finds_no_5xx_and_nothing_undocumented(url):
    """A few hundred schemathesis cases over every route (valid bodies, and invalid ones that must
    be refused with a documented 4xx), derandomized so a failure reproduces."""
    schema = schemathesis.openapi.from_url(f"{url}/openapi.json")
    positive = schema.as_strategy(schemathesis.GenerationMode.POSITIVE)
    negative = schema.as_strategy(schemathesis.GenerationMode.NEGATIVE)

    @given(case=st.one_of(positive, positive.map(served_model), negative))
    @settings(max_examples=300, derandomize=True, database=None, deadline=None,
              suppress_health_check=list(HealthCheck))
    def fuzz(case):
        checks = CHECKS + ([negative_data_rejection] if case.meta and case.meta.generation.mode.is_negative else [])
        case.call_and_validate(checks=checks)

    fuzz()
