"""The local launcher's flags reach the services it starts."""

from __future__ import annotations

import pytest

import coordinator.launch as launch


class Started(Exception):
    """Raised by the stand-in LocalStack: the flags are what the test reads, nothing starts."""


@pytest.fixture
def stacks(monkeypatch) -> list[dict]:
    made = []

    def local_stack(*args, **kwargs):
        made.append(kwargs)
        raise Started

    monkeypatch.setattr(launch, "LocalStack", local_stack)
    monkeypatch.setattr(launch, "default_models", lambda: ("models/draft", "models/target"))
    return made


@pytest.mark.parametrize("argv, target_tail, draft_args", [
    ([], ["--tensor-parallel-size", "1"], []),
    (["--quantize", "int4"], ["--tensor-parallel-size", "1", "--quantize", "int4"], ["--quantize", "int4"]),
    # the n-gram method loads no model: nothing to quantize there
    (["--quantize", "int4", "--draft-method", "ngram"], ["--tensor-parallel-size", "1", "--quantize", "int4"], []),
])
def test_quantize_reaches_both_model_services(stacks, argv, target_tail, draft_args):
    with pytest.raises(Started):
        launch.main(argv)
    (kwargs,) = stacks
    assert kwargs["target_args"] == target_tail and list(kwargs.get("draft_args", [])) == draft_args
