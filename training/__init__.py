"""Reproducible training of specdec's default model pair: a small code target and its distilled draft.

    python -m training all          # corpus -> tokenizer -> target -> draft -> export (~1.5 h on 2 CPU cores, fp32)
    python -m training target       # one stage; re-running resumes from its last checkpoint
    python -m training all --smoke  # the whole pipeline at toy scale in /tmp/specdec-smoke (a few minutes)

Stages (each skips work already done):
  corpus     the running interpreter's standard-library .py files (site-packages excluded), sorted;
             a seeded ~2% of the files held out for evaluation                        -> data.py
  tokenizer  byte-level BPE (8192 ids, "<|endoftext|>" = eos = bos = pad); both splits -> uint16 arrays
  target     a 13.8 M-parameter Llama trained from scratch on next-token cross-entropy  -> loop.py, models.py
  draft      a <= 2 M-parameter Llama distilled from the target: forward KL(p_target || q_draft)
  export     bf16 safetensors + tokenizer + model cards + metrics.json into models/;
             acceptance rate of the pair in specdec's own speculative round          -> export.py

Outputs: models/{target,draft}/ and models/metrics.json (committed); .cache/training/ (scratch, checkpoints).
"""
