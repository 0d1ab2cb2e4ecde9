"""Shared fixtures: tiny random-weight models made at test time, and local stacks
(target + draft + coordinator as three processes on free loopback ports).

The stacks' processes are forked from one that has their libraries loaded (tests/prefork.py);
`pytest --exec-services` starts each as a fresh `python -m` process instead."""

from __future__ import annotations

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM, AutoTokenizer

from coordinator.launch import LocalStack
from specdec.v1 import specdec_pb2_grpc as pb_grpc
from speculative.tiny import make_model, make_pair, make_tokenizer
from tests import prefork


def pytest_addoption(parser):
    parser.addoption("--device", default="cpu",
                     help="where tests/gpu runs: cuda or cuda:N (make test-gpu); cpu (the default) skips it")
    parser.addoption("--exec-services", action="store_true",
                     help="start local stacks' services as fresh processes, not forked from a preloaded one")


def pytest_configure(config):
    if not config.getoption("--exec-services"):
        LocalStack.launcher = staticmethod(prefork.launch)


@pytest.fixture(scope="session")
def pair(tmp_path_factory):
    """(draft_dir, target_dir): byte-level BPE, a draft that mostly disagrees with its target."""
    return make_pair(tmp_path_factory.mktemp("bpe"))


@pytest.fixture(scope="session")
def small_vocab_pair(tmp_path_factory):
    """(draft_dir, target_dir) over a 12-token vocabulary, with peaked random distributions."""
    return make_pair(tmp_path_factory.mktemp("chars"), vocab="chars", init_std=0.3)


@pytest.fixture(scope="session")
def other_tokenizer_model(tmp_path_factory):
    """A model whose tokenizer differs from `pair`'s: the coordinator must refuse the pairing."""
    out = tmp_path_factory.mktemp("other")
    return make_model(out / "model", make_tokenizer(out / "tok", "chars"), hidden=32, layers=1, heads=2, kv_heads=1)


@pytest.fixture(scope="session")
def reference(pair):
    """Greedy continuations by transformers `generate` on `pair`'s target alone: (prompt, n) -> ids."""
    _, target_dir = pair
    tokenizer = AutoTokenizer.from_pretrained(target_dir)
    model = AutoModelForCausalLM.from_pretrained(target_dir).eval()

    def greedy(prompt: str, n: int) -> list[int]:
        ids = tokenizer(prompt, return_tensors="pt").input_ids
        with torch.inference_mode():
            out = model.generate(ids, max_new_tokens=n, do_sample=False)
        return out[0, ids.shape[1] :].tolist()

    return greedy


def _stack(draft, target, request, **kwargs):
    stack = LocalStack(draft, target, **kwargs).start()
    request.addfinalizer(stack.stop)
    return stack


@pytest.fixture(scope="session")
def stack(pair, request):
    draft, target = pair
    return _stack(draft, target, request)


@pytest.fixture(scope="session")
def self_stack(pair, request):
    """The target drafting for itself: every draft token is accepted."""
    _, target = pair
    return _stack(target, target, request)


@pytest.fixture(scope="session")
def small_vocab_stack(small_vocab_pair, request):
    draft, target = small_vocab_pair
    return _stack(draft, target, request)


@pytest.fixture(scope="session")
def client(stack):
    channel = grpc.insecure_channel(stack.addr)
    yield pb_grpc.GenerationStub(channel)
    channel.close()
