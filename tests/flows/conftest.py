"""Fixtures of the server tests: a pair of tiny models served on a free loopback port (one per module)."""

from __future__ import annotations

import pytest

from tests.helpers.serving import TinySpec, running_server


@pytest.fixture(scope="module")
def llm() -> TinySpec:
    """The tiny pair the module's server serves (the API's answers to compare with)."""
    return TinySpec()


@pytest.fixture(scope="module")
def server(llm):
    """(base URL, app) of ``llm`` served with max_tokens up to 64 and speculation always on."""
    with running_server(llm, max_tokens_limit=64, spec_max_batch=None) as (base, app):
        yield base, app
