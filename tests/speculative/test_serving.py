"""Flags from the environment."""

from __future__ import annotations

from speculative.serving import EnvArgumentParser, add_common_flags


def test_environment_sets_flags_and_flags_win(monkeypatch):
    def parse(*argv):
        parser = EnvArgumentParser("SPECDEC_TEST")
        add_common_flags(parser, 1234)
        parser.add_argument("--model", required=True)
        parser.add_argument("--fast", action="store_true")
        return parser.parse_args(list(argv))

    monkeypatch.setenv("SPECDEC_TEST_PORT", "999")
    monkeypatch.setenv("SPECDEC_TEST_MODEL", "/models/x")  # satisfies a required flag
    monkeypatch.setenv("SPECDEC_TEST_FAST", "true")
    args = parse()
    assert (args.port, args.model, args.fast, args.host) == (999, "/models/x", True, "127.0.0.1")
    assert parse("--port", "7").port == 7
