"""The `specdec` command: one entry point with a subcommand per process, as inference servers
ship theirs (`vllm serve`).

    specdec target --model models/target --port 50051
    specdec draft --model models/draft --port 50052      # or --method ngram: no draft model
    specdec coordinator --draft 127.0.0.1:50052 --target 127.0.0.1:50051 --port 50050
    specdec client --chat --stream "What is the capital of France?"
    specdec launch --demo                 # all three locally, one answer, then stop

`specdec COMMAND --help` lists a command's flags. Each command is its module's own
main(argv, prog), which `python -m MODULE` runs too; the module is imported only once chosen,
so a model service imports model_service.openmp before anything loads torch.
"""

from __future__ import annotations

import argparse
import importlib
import sys
from typing import NoReturn

from runtime.cli import exit_process

# command -> (module whose main(argv, prog) it runs, one line for `specdec --help`)
COMMANDS = {
    "coordinator": ("coordinator.__main__", "serve the Generation API in front of draft and target services"),
    "draft": ("draft_service.__main__", "serve a drafting method (a draft model, or n-gram lookup): it proposes tokens"),
    "target": ("target_service.__main__", "serve a target model: it verifies proposals"),
    "client": ("coordinator.client", "send a prompt to a coordinator and print the answer"),
    "launch": ("coordinator.launch", "start a draft, a target and a coordinator on this machine"),
}


def parser() -> argparse.ArgumentParser:
    width = max(map(len, COMMANDS))
    listing = "\n".join(f"  {name:<{width}}  {summary}" for name, (_, summary) in COMMANDS.items())
    made = argparse.ArgumentParser(prog="specdec", description=__doc__, epilog=f"commands:\n{listing}",
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    commands = made.add_subparsers(dest="command", metavar="COMMAND", required=True,
                                   help="one of the commands below, then its own flags")
    for name in COMMANDS:
        commands.add_parser(name, add_help=False)
    return made


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    # only the command name is parsed here: everything after it is the command's own
    command = parser().parse_args(argv[:1]).command
    module = importlib.import_module(COMMANDS[command][0])
    return module.main(argv[1:], prog=f"specdec {command}") or 0


def run() -> NoReturn:
    """The installed `specdec` command: main, then exit_process (a stopped service skips the
    interpreter's teardown)."""
    exit_process(main())


if __name__ == "__main__":
    run()
