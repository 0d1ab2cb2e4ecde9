"""Making the default pair's models: `python -m training {convert,distill}`.

  convert.py     a GGUF file -> a transformers directory (the default target, at `make setup`)
  distill.py     a small draft for any local transformers causal LM, on the target's own answers
  loop.py        the resumable training loop (AdamW, warmup + cosine, checkpoints, progress bar)
  acceptance.py  a pair's acceptance rate in specdec's own round
"""
