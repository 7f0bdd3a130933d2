"""Property-based tests of the HTTP API from its own OpenAPI document (schemathesis).

Requests generated from the schema (valid ones, and invalid ones) go to a real server on
the tiny model; every response must be no 5xx, have a documented status and content type,
and match the documented schema. Bounded: a fixed number of examples per operation and a
short context, so it runs in well under a minute.
"""

from __future__ import annotations

from collections.abc import Iterator
from pathlib import Path

import pytest
import schemathesis
from hypothesis import HealthCheck, given, settings
from schemathesis.checks import not_a_server_error
from schemathesis.specs.openapi.checks import (
    content_type_conformance,
    negative_data_rejection,
    response_schema_conformance,
    status_code_conformance,
)

from kvloop.config import EngineConfig
from kvloop.engine.llm_engine import LLMEngine
from kvloop.server.app import ServerSettings, create_app
from kvloop.server.background import BackgroundServer

EXAMPLES = 100  # per operation and generation mode
CHECKS = [not_a_server_error, status_code_conformance, content_type_conformance,
          response_schema_conformance]


@pytest.fixture(scope="module")
def server(tiny_model_dir: Path) -> Iterator[BackgroundServer]:
    # A 64-token context bounds the work any generated request can ask for.
    engine = LLMEngine(str(tiny_model_dir), EngineConfig(kv_cache_memory="16MiB",
                                                         max_model_len=64))
    with BackgroundServer(create_app(engine, ServerSettings(model_name="tiny",
                                                            default_max_tokens=8))) as s:
        yield s


@pytest.mark.parametrize("mode", [schemathesis.GenerationMode.POSITIVE,
                                  schemathesis.GenerationMode.NEGATIVE])
def test_api_conforms_to_its_openapi_document(server: BackgroundServer,
                                              mode: schemathesis.GenerationMode) -> None:
    schema = schemathesis.openapi.from_url(f"{server.url}/openapi.json")
    checks = CHECKS + ([negative_data_rejection]
                       if mode is schemathesis.GenerationMode.NEGATIVE else [])
    operations = [result.ok() for result in schema.get_all_operations()]
    assert {op.path for op in operations} >= {"/v1/completions", "/v1/chat/completions",
                                              "/health", "/metrics", "/v1/models"}
    for op in operations:
        if mode is schemathesis.GenerationMode.NEGATIVE and op.method.upper() != "POST":
            continue  # no parameters and no body: nothing to make invalid
        @given(case=op.as_strategy(generation_mode=mode))
        @settings(max_examples=EXAMPLES, deadline=None, database=None, derandomize=True,
                  suppress_health_check=list(HealthCheck))
        def run(case: schemathesis.Case) -> None:
            case.call_and_validate(base_url=server.url, checks=checks, timeout=60)

        run()
