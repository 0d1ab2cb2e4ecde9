"""A structured-output constraint (protocol.py's Constraint) as an llguidance grammar, and the
check the coordinator runs before any service is asked (no tokenizer needed). The services
compile it with their own tokenizer and mask with it: model_service/grammar.py."""

from __future__ import annotations

import json

import llguidance

from .errors import InvalidRequest
from .protocol import Constraint


def grammar_text(constraint: Constraint) -> str:
    """The constraint as an llguidance grammar (not yet checked). InvalidRequest where the text
    itself is not what its kind needs (a schema that is not JSON, choices that are not strings)."""
    kind, text = constraint.kind, constraint.text
    try:
        if kind == "json_schema":
            schema = json.loads(text)
            if not isinstance(schema, (dict, bool)):
                raise InvalidRequest("a JSON schema is a JSON object (or true / false)")
            return llguidance.LLMatcher.grammar_from_json_schema(schema)
        if kind == "json_object":
            return llguidance.LLMatcher.grammar_from_json_schema({"type": "object"})
        if kind == "regex":
            return llguidance.LLMatcher.grammar_from_regex(text)
        if kind == "grammar":
            return llguidance.grammar_from("grammar", text)
        if kind == "choice":
            choices = json.loads(text)
            if not choices or not all(isinstance(c, str) and c for c in choices):
                raise InvalidRequest("a choice constraint needs at least one choice, each a non-empty string")
            return llguidance.grammar_from("choice", choices)
    except InvalidRequest:
        raise
    except json.JSONDecodeError as e:
        raise InvalidRequest(f"the {kind} constraint is not valid JSON: {e}") from e
    except RecursionError as e:  # (json's parser, on arrays or objects nested some thousand deep)
        raise InvalidRequest(f"the {kind} constraint is nested too deeply to read") from e
    except ValueError as e:
        raise InvalidRequest(f"the {kind} constraint does not compile: {e}") from e
    raise InvalidRequest(f"unknown constraint kind {kind!r}")


def check(constraint: Constraint) -> None:
    """Raise InvalidRequest with the compiler's reason where the constraint does not compile (no
    tokenizer needed: the coordinator's check before any service is asked)."""
    constraint.validate()
    error = llguidance.LLMatcher.validate_grammar(grammar_text(constraint), None, limits=limits())
    if error:
        raise InvalidRequest(f"the {constraint.kind} constraint does not compile: {error.strip()}")


def limits():
    return llguidance.LLParserLimits()  # llguidance's defaults bound compilation and each mask step
