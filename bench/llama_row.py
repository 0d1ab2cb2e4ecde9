"""Row l of `make bench`: llama.cpp (llama-cpp-python) on a GGUF, in a process of its own.

    python -m bench.llama_row --gguf FILE --prompts PROMPTS.json --temperature 0 --new-tokens 128 --threads 2

PROMPTS.json is a list of token-id lists (the bench's chat prompts, templated by the target's
tokenizer: the same ids the other rows get). Prints one JSON object: the generated ids per
prompt and the seconds they took (prompt processing included, as in the other rows). Its own
process: a crash inside llama.cpp costs the row, not the bench, and its OpenMP runtime does not
meet torch's.
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time
from pathlib import Path


def generate(gguf: Path, prompts: list[list[int]], temperature: float, new_tokens: int, threads: int):
    from llama_cpp import Llama

    llm = Llama(model_path=str(gguf), n_ctx=1024, n_threads=threads, n_threads_batch=threads, verbose=False, seed=0)
    eos = llm.token_eos()
    llm.generate(prompts[0][:4], top_k=1, temp=0.0).__next__()  # warm up
    outputs, start = [], time.perf_counter()
    for i, prompt in enumerate(prompts):
        llm.set_seed(i)
        out = []
        for token in llm.generate(prompt, reset=True, temp=temperature, top_k=1 if temperature == 0 else 0,
                                  top_p=1.0, min_p=0.0, repeat_penalty=1.0):
            out.append(token)
            if token == eos or len(out) == new_tokens:
                break
        outputs.append(out)
    return outputs, time.perf_counter() - start


def run(gguf: Path, prompts: list[list[int]], temperature: float, new_tokens: int, threads: int, scratch: Path):
    """The row from another process. -> (generated ids per prompt, seconds), or None with the reason printed."""
    listing = scratch / "llama_prompts.json"
    listing.write_text(json.dumps(prompts))
    done = subprocess.run([sys.executable, "-m", "bench.llama_row", "--gguf", str(gguf), "--prompts", str(listing),
                           "--temperature", str(temperature), "--new-tokens", str(new_tokens),
                           "--threads", str(threads)], capture_output=True, text=True)
    listing.unlink()
    if done.returncode != 0:
        print(f"row l failed (exit {done.returncode}): {done.stderr[-500:]}", flush=True)
        return None
    result = json.loads(done.stdout.strip().splitlines()[-1])
    return result["outputs"], result["seconds"]


def main(argv=None) -> None:
    parser = argparse.ArgumentParser(prog="python -m bench.llama_row", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--gguf", type=Path, required=True)
    parser.add_argument("--prompts", type=Path, required=True)
    parser.add_argument("--temperature", type=float, default=0.0)
    parser.add_argument("--new-tokens", type=int, default=128)
    parser.add_argument("--threads", type=int, default=2)
    args = parser.parse_args(argv)
    outputs, seconds = generate(args.gguf, json.loads(args.prompts.read_text()), args.temperature, args.new_tokens,
                                args.threads)
    print(json.dumps({"outputs": outputs, "seconds": seconds}))


if __name__ == "__main__":
    main()
