"""python -m training {convert,distill,eagle} ...

  convert   a GGUF file -> a transformers model directory (the default target: make setup)
  distill   a small draft for any local transformers causal LM, on the target's own answers
  eagle     an EAGLE-3 draft head for any local Llama-family target (vLLM / speculators layout)

    python -m training convert [--gguf FILE --out DIR]
    python -m training distill --target models/target --out models/draft --acceptance
    python -m training eagle --target models/target --out models/eagle

`python -m training COMMAND --help` says more. Long runs resume where they stopped (scratch and
checkpoints under --work): run them in the background with their log, e.g.
    nohup python -m training distill --target models/target --out models/draft > distill.log 2>&1 &
"""

from __future__ import annotations

import sys


def main(argv: list[str] | None = None) -> None:
    argv = sys.argv[1:] if argv is None else argv
    if not argv or argv[0] not in ("convert", "distill", "eagle"):
        raise SystemExit(__doc__)
    if argv[0] == "convert":
        from .convert import main as command
    elif argv[0] == "distill":
        from .distill import main as command
    else:
        from .eagle import main as command
    command(argv[1:])


if __name__ == "__main__":
    main()
