"""What a model service (draft_service, target_service) runs: the model and its sessions, the
per-call engines, batching on one model thread, and the servicer and main body both share.

  model_runner.py    one model, its tokenizer and the sessions it serves (KV caches, rollback)
  fast_forward.py    the lean batched forward (Llama, Mistral, Qwen2); scripted.py: its layer loop in TorchScript
  int4.py            its --quantize int4 (q4_kernel.py: specdec's int4 kernel)
  kv_cache.py        its KV caches: a session's own, or a slot of a shared pool
  slot_attention.py  a pass's attention as one call over the pool's slots
  sharding.py        the lean forward's weights split over tensor-parallel ranks (Megatron's)
  loading.py         a tensor-parallel rank loads only its own slices of the checkpoint
  tensor_parallel.py that forward sharded over Ray ranks
  sessions.py        the session table (idle eviction, capacity)
  drafting.py        the contract a drafting method follows (what it receives, returns and holds)
  engines.py         what the draft (propose) and the target (verify) compute per call, batched
  oracle.py          a drafting method replaying known continuations (benchmarks: acceptance 1)
  ngram.py           a drafting method without a model: prompt lookup (copies n-gram continuations)
  local.py           the engines as the round's peers in one process (tests, bench)
  threads.py         torch threads by role; the model thread
  batcher.py         continuous batching onto that thread
  servicer.py        the gRPC servicer both services build on; errors as statuses
  service.py         model flags and the main body: load off the event loop, sweep, serve
  metrics.py         the service's Prometheus metrics
  openmp.py          OpenMP settings, imported before torch
"""
