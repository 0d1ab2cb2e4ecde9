"""The eagle drafting method across processes: the target's features travel over gRPC (shape,
dtype, position order), the draft service pairs with the target by them, a session that asks
for none gets none, and the three services give the target's own greedy output."""

from __future__ import annotations

import grpc
import pytest
import torch
from transformers import AutoModelForCausalLM

from coordinator.launch import LocalStack
from model_service import features as wire
from model_service import q4_kernel
from specdec.v1 import specdec_pb2 as pb
from specdec.v1 import specdec_pb2_grpc as pb_grpc
from speculative.protocol import SamplingParams, features_from_proto, params_to_proto
from tests.model_service.test_eagle import LAYERS, make_head

GREEDY = params_to_proto(SamplingParams(0.0))


@pytest.fixture(scope="module")
def eagle_stack(pair, tmp_path_factory, request):
    _, target_dir = pair
    head = make_head(target_dir, tmp_path_factory.mktemp("head"))
    stack = LocalStack(head, target_dir, draft_method="eagle").start()
    request.addfinalizer(stack.stop)
    return stack


def test_features_travel_over_grpc_in_position_order(eagle_stack, pair):
    _, target_dir = pair
    model = AutoModelForCausalLM.from_pretrained(target_dir).eval()
    with grpc.insecure_channel(eagle_stack.target_addr) as channel:
        target = pb_grpc.TargetStub(channel)
        prompt = [7, 3, 99, 12, 5]
        reply = target.Verify(pb.VerifyRequest(session_id="f", start=True, append=prompt, sampling=GREEDY,
                                               feature_layers=LAYERS))
        assert reply.HasField("features")
        got = wire.unpack(features_from_proto(reply.features))
        with torch.inference_mode():
            states = model(torch.tensor([prompt]), output_hidden_states=True).hidden_states
        torch.testing.assert_close(got, torch.cat([states[i][0] for i in LAYERS], dim=-1), atol=2e-3, rtol=2e-3)
        assert (reply.features.start, reply.features.rows, reply.features.dtype) == (0, len(prompt), "float16")
        # the next call feeds the sampled token: one row, at the next position
        reply = target.Verify(pb.VerifyRequest(session_id="f", sampling=GREEDY))
        assert (reply.features.start, reply.features.rows) == (len(prompt), 1)
        # told to drop them (its draft can take no more), the session sends none from that call on
        for _ in range(2):
            reply = target.Verify(pb.VerifyRequest(session_id="f", sampling=GREEDY, drop_features=_ == 0))
            assert not reply.HasField("features")
        # a session that asks for none gets none, and its answers carry no feature bytes
        plain = target.Verify(pb.VerifyRequest(session_id="p", start=True, append=prompt, sampling=GREEDY))
        assert not plain.HasField("features")
        with pytest.raises(grpc.RpcError) as err:
            target.Verify(pb.VerifyRequest(session_id="x", start=True, append=prompt, sampling=GREEDY,
                                           feature_layers=[0, 40]))
        assert err.value.code() == grpc.StatusCode.INVALID_ARGUMENT and "feature layer 40" in err.value.details()
        for session in ("f", "p"):
            target.Release(pb.ReleaseRequest(session_id=session))


def test_the_draft_says_what_it_reads_and_the_output_is_the_targets(eagle_stack, pair, reference):
    with grpc.insecure_channel(eagle_stack.addr) as channel:
        info = pb_grpc.GenerationStub(channel).GetInfo(pb.GetInfoRequest())
        assert info.draft.draft_method == "eagle" and list(info.draft.feature_layers) == list(LAYERS)
        assert info.draft.feature_width == len(LAYERS) * info.target.hidden_size
        # --head-quantize auto: specdec's int4 kernel where it is built, else int8
        assert info.draft.quantization.startswith("int4" if q4_kernel.available() else "int8"), info.draft.quantization
        stub = pb_grpc.GenerationStub(channel)
        for prompt in ("def fibonacci(n):", "The quick brown fox"):
            reply = stub.Generate(pb.GenerateRequest(prompt=prompt, max_new_tokens=24, temperature=0,
                                                     num_speculative_tokens=3))
            assert list(reply.token_ids) == reference(prompt, 24)
            assert reply.stats.draft_tokens > 0  # the head drafted (from the features it was sent)
            stream = list(stub.GenerateStream(pb.GenerateRequest(prompt=prompt, max_new_tokens=24, temperature=0)))
            assert [t for chunk in stream for t in chunk.token_ids] == list(reply.token_ids)
