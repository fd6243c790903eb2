"""Probe keys, registry names and method labels: one spelling for a probe trained on one domain."""

from __future__ import annotations

import pytest

from semspec.models.project.names import registered_name
from semspec.models.spec.names import method_label, parse_label, probe_key, split_probe_key


def test_domain_probes_are_named_with_their_domain():
    assert probe_key("all") == probe_key("all", "all") == "all"
    assert probe_key("all", "math") == "all@math" and split_probe_key("all@math") == ("all", "math")
    assert split_probe_key("random") == ("random", None)
    assert registered_name("qwen-coder", "draft", "all") == "semspec-qwen-coder-draft-all"
    assert registered_name("qwen-coder", "draft", "all@science") == "semspec-qwen-coder-draft-all-science"
    assert method_label("semanticspec", "last@math") == "semanticspec-last@math"
    assert parse_label("semanticspec-last@math") == ("semanticspec", "last@math")
    assert method_label("target") == "target"


@pytest.mark.parametrize(
    "call, match",
    [
        (lambda: probe_key("best", "math"), "unknown probe variant"),
        (lambda: probe_key("all", "a-b"), "domain 'a-b'"),
        (lambda: probe_key("all", ""), "domain ''"),
        (lambda: split_probe_key("all@"), "domain ''"),
        (lambda: method_label("semanticspec"), "needs a probe variant"),
        (lambda: registered_name("p", "draft", "all@x/y"), "domain 'x/y'"),
    ],
)
def test_bad_probe_names_are_refused(call, match):
    with pytest.raises(ValueError, match=match):
        call()
