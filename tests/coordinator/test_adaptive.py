"""Adaptive K: the goodput arithmetic, and that K follows acceptance and load."""

from __future__ import annotations

import json
import os
import shutil

import pytest

from coordinator.adaptive import (ALPHA_EMA, ALPHA_PRIOR_TOKENS, DECODE_CHUNK_MS, AcceptanceK, AdaptiveK, CostModel,
                                  expected_tokens)
from speculative.protocol import Cost, PassCost
from speculative.round import FixedK, Round

TARGET = PassCost(fixed=8.0, per_token=0.2, per_session=0.4)  # about the shipped target on 2 CPU cores
DRAFT = PassCost(fixed=1.2, per_token=0.08, per_session=0.1)


def test_expected_tokens():
    assert expected_tokens(0.0, 5) == 1.0
    assert expected_tokens(1.0, 4) == 5.0
    assert expected_tokens(0.5, 2) == pytest.approx(1.75)
    # with a shape, position i is accepted (after the ones before it) with probability alpha * shape[i]
    assert expected_tokens(0.5, 2, [1.0, 1.0]) == pytest.approx(1.75)
    assert expected_tokens(0.5, 3, [0.8, 1.2, 1.6]) == pytest.approx(1 + 0.4 + 0.4 * 0.6 + 0.4 * 0.6 * 0.8)
    assert expected_tokens(0.9, 2, [2.0, 2.0]) == pytest.approx(1 + 0.999 + 0.999 ** 2)  # never certain


def rounds_of(policy: AdaptiveK, accepted: int, proposed: int, batch: int, n: int = 20) -> None:
    for _ in range(n):
        policy.observe(Round([], proposed, accepted, Cost(), Cost(batch_size=batch), asked=proposed), 10.0)


# 40 rounds of 4 draft tokens, each the number accepted: position 0 accepted in 16 of 40 (0.4), 1 in 10
# of those 16 (0.625), 2 in 8 of 10 (0.8), 3 in 7 of 8 (0.875); mixed, so that the counts' fading
# weighs no kind of round more
RISING = [4, 0, 0, 1, 0, 2, 0, 4, 0, 1, 0, 0, 3, 0, 4, 0, 1, 0, 0, 4, 0, 2, 0, 1, 0, 4, 0, 0, 1, 0, 4, 0, 0, 1, 0, 4,
          0, 0, 0, 0]


def test_acceptance_along_a_round_is_learnt_per_position():
    """CostModel.shape: each draft position's acceptance (after the ones before it were accepted)
    over the pooled rate, from the rounds' counts (the EAGLE-3 head's rises along a round); a
    position no round reached reads like the one before it; before any round, one rate for all. A
    request prices its rounds with it, and so drafts further than one rate for all would have it."""
    costs = CostModel(TARGET, DRAFT, alpha=0.6)
    assert costs.shape(4) == [1.0] * 4
    policy = AdaptiveK(costs, k_max=8)
    for i in range(400):
        policy.observe(Round([], 4, RISING[i % 40], Cost(), Cost(batch_size=1), asked=4), 10.0)
    pooled = sum(costs.position_accepted) / sum(costs.position_tried)
    assert pooled == pytest.approx(41 / 74, abs=0.01)  # (16 + 10 + 8 + 7) of (40 + 16 + 10 + 8)
    got = [pooled * f for f in costs.shape(6)]
    # (each position's estimate leans on the one before it by POSITION_PRIOR tries)
    assert got[:4] == pytest.approx([0.4, 0.625, 0.8, 0.875], abs=0.035), got
    assert got[4] == pytest.approx(got[3]) and got[5] == pytest.approx(got[3])  # never reached
    shape = costs.shape(8)
    # a round of 4 brings 1 + 0.4 + 0.4 * 0.625 + ... = 2.025 tokens; one rate would read the 8 as 1 + 0.55 + ...
    assert expected_tokens(policy.alpha, 4, shape) == pytest.approx(2.025, abs=0.1)
    assert expected_tokens(policy.alpha, 8, shape) > expected_tokens(policy.alpha, 8) + 0.15
    for target in (TARGET, PassCost(fixed=20.0, per_token=2.0)):  # rows cheap, and dear
        costs.target = target
        flat = max(range(9), key=lambda k: expected_tokens(policy.alpha, k) / costs.round_cost(k, 1, 1))
        assert policy.choose(100) >= flat + 1, target


def test_k_follows_acceptance():
    good = AdaptiveK(CostModel(TARGET, DRAFT), k_max=8)
    rounds_of(good, accepted=4, proposed=4, batch=1)  # everything accepted
    bad = AdaptiveK(CostModel(TARGET, DRAFT), k_max=8)
    rounds_of(bad, accepted=0, proposed=4, batch=1)  # nothing accepted
    assert good.alpha > 0.9 and bad.alpha < 0.2
    assert good.choose(100) >= 6
    assert bad.choose(100) <= 1
    assert good.choose(3) == 2  # never more than the tokens left, less one


def test_k_backs_off_when_verification_is_compute_bound():
    """With the same acceptance, a big batch of an expensive-per-token target leaves no gain."""
    costs = CostModel(PassCost(fixed=8.0, per_token=3.0, per_session=0.0), DRAFT, alpha=0.6)
    policy = AdaptiveK(costs, k_max=8)
    rounds_of(policy, accepted=2, proposed=4, batch=1)
    alone = policy.choose(100)
    rounds_of(policy, accepted=2, proposed=4, batch=64)
    assert alone >= 2 and policy.choose(100) == 0


def test_the_first_extra_row_is_priced():
    """A one-token pass is a matrix-vector product, cheaper than any pass over more rows (SmolLM2,
    fp32, CPU: 27.6 ms for 1 token, 36.6 for 2, 42.2 for 5). Priced linearly, a weak draft's
    first token looks worth drafting; priced with the jump, a lone request drafts nothing, while
    a batch (already past one row) still drafts."""
    linear = PassCost(fixed=25.4, per_token=2.2)
    jump = PassCost(fixed=25.4, per_token=2.2, multi_row=7.0)  # 27.6, 36.8, 43.4 ms for 1, 2, 5 tokens
    assert jump(1, 1) == pytest.approx(linear(1, 1)) and jump(2, 1) == pytest.approx(linear(2, 1) + 7.0)
    small_draft = PassCost(fixed=1.0, per_token=0.05)
    chosen = {}
    for name, target in (("linear", linear), ("jump", jump)):
        policy = AdaptiveK(CostModel(target, small_draft, alpha=0.3), k_max=8)
        for _ in range(10):  # this request's own acceptance: 1 of 3 tried (alpha 1/3), the first token's too
            rounds_of(policy, accepted=0, proposed=1, batch=1, n=2)
            rounds_of(policy, accepted=1, proposed=1, batch=1, n=1)
        chosen[name] = policy.choose(100)
        rounds_of(policy, accepted=2, proposed=2, batch=8)  # a batch of 8: every pass has rows to spare
        chosen[name + " batch 8"] = policy.choose(100)
    assert chosen["linear"] >= 1 and chosen["jump"] == 0
    # past one row the jump is shared by the batch and small: both still draft (a round's extra cost,
    # shared, can even favour a longer draft that spreads it)
    assert chosen["jump batch 8"] >= 1 and chosen["linear batch 8"] >= 1


def test_pipelined_rounds_cost_the_busier_service():
    """With other requests in flight the draft drafts while the target verifies others: a round
    costs max(target share, draft share), so the same acceptance affords a longer draft than a
    lone request's sequential round (target + draft); still none when verification is
    compute-bound."""
    costs = CostModel(TARGET, DRAFT, alpha=0.7)
    policy = AdaptiveK(costs, k_max=8)
    for _ in range(20):  # both services batch 4 sessions a pass
        policy.observe(Round([], 4, 3, Cost(batch_size=4), Cost(batch_size=4), asked=4), 10.0)
    costs.in_flight = 1
    alone = policy.choose(100)
    costs.in_flight = 8
    pipelined = policy.choose(100)
    assert pipelined > alone >= 1
    target = costs.target_scale * (TARGET.fixed / 4 + TARGET.per_token * 4 + TARGET.per_session)
    draft = 3 * (DRAFT.fixed / 4 + DRAFT.per_token + DRAFT.per_session)
    overhead = costs.overhead_ms * 2 / 4
    assert costs.round_cost(3, 4, 4, pipelined=True) == pytest.approx(max(target, draft) + overhead)
    assert costs.round_cost(3, 4, 4) == pytest.approx(target + draft + overhead)
    bound = AdaptiveK(CostModel(PassCost(fixed=8.0, per_token=3.0, per_session=0.0), DRAFT, alpha=0.6), k_max=8)
    bound.costs.in_flight = 64
    rounds_of(bound, accepted=2, proposed=4, batch=64)
    assert bound.choose(100) == 0


def test_under_load_a_request_prices_the_batch_passes_hold_not_its_own_last_pass():
    """With several requests in flight, a request whose last verify ran alone (out of step with the
    others' decode steps) must not price decoding as a whole pass for its one token: the batch its
    next pass shares is what the target's passes have held lately, over every request. Read from its
    own last pass, it drafted again and again at 8 streams on shared cores (a round that drafts runs
    its verify alone, which reads a batch of 1 again)."""
    costs = CostModel(PassCost(fixed=30.0, per_token=3.0, per_session=0.0), DRAFT, alpha=0.55, shared_cpus=True)
    others = AdaptiveK(costs, k_max=8)
    costs.in_flight = 8
    rounds_of(others, accepted=0, proposed=0, batch=7, n=40)  # the passes hold 7 sessions
    assert costs.batch == pytest.approx(7.0, abs=0.2)
    lone = AdaptiveK(costs, k_max=8)
    lone.observe(Round([], 4, 2, Cost(batch_size=1), Cost(batch_size=1), asked=4), 10.0)  # its verify ran alone
    assert lone.batch == 1.0
    assert lone.choose(100) == 0
    at_1 = [costs.round_cost(k, 1, 1, True) / expected_tokens(0.55, k) for k in (0, 1)]
    at_7 = [costs.round_cost(k, 7, 1, True) / expected_tokens(0.55, k) for k in (0, 1)]
    assert at_1[1] < at_1[0] and at_7[0] < at_7[1]  # priced at its own batch of 1 it would have drafted
    costs.in_flight = 1  # a lone request still prices its own pass, and drafts
    assert lone.choose(100) >= 1


def picks_of(policy: AdaptiveK, n: int) -> list[int]:
    """n rounds of one request: its choices, each round observed (a probe's token rejected)."""
    picks = []
    for _ in range(n):
        k = policy.choose(100)
        picks.append(k)
        policy.observe(Round([], k, 0, Cost(), Cost(batch_size=1), asked=k), 10.0)
    return picks


def test_probes_after_rounds_without_drafting():
    policy = AdaptiveK(CostModel(TARGET, DRAFT, alpha=0.0), k_max=4)
    picks = picks_of(policy, AdaptiveK.PROBE_EVERY + 1)
    assert picks[:-1] == [0] * AdaptiveK.PROBE_EVERY and picks[-1] == 1
    # probes that change nothing come half as often each time, down to one in PROBE_MAX rounds
    picks = picks_of(policy, 17 + 33 + 65 + 65 + 65)
    probes = [i + 1 for i, k in enumerate(picks) if k]
    assert [b - a for a, b in zip([0] + probes, probes)] == [17, 33, 65, 65, 65]
    # once a round is worth drafting again, the next idle spell probes after PROBE_EVERY again
    rounds_of(policy, accepted=4, proposed=4, batch=1)
    assert policy.choose(100) > 0
    rounds_of(policy, accepted=0, proposed=4, batch=1, n=200)
    picks = picks_of(policy, AdaptiveK.PROBE_EVERY + 1)
    assert picks[-1] == 1 and not any(picks[:-1])


def test_requests_one_after_another_share_the_probes_wait():
    """Alone, a request waits the coordinator's rounds since any request drafted, not its own: 16
    requests of 18 rounds one after another probe as one request of 288 rounds does (at its rounds
    9, 26, 59, 124, 189, 254), not once or twice each (each probe a draft call taking in the rows
    since the last and a verify of one draft token)."""
    costs = CostModel(TARGET, DRAFT, alpha=0.0)
    picks = [k for _ in range(16) for k in picks_of(AdaptiveK(costs, k_max=4), 18)]
    assert [i + 1 for i, k in enumerate(picks) if k] == [9, 26, 59, 124, 189, 254]
    # a probe due at a request's first round waits for its second (a draft that reads the target's
    # features cannot draft in a first round: the probe would be spent, its wait doubled, nothing drafted)
    costs = CostModel(TARGET, DRAFT, alpha=0.0)
    assert picks_of(AdaptiveK(costs, k_max=4), 8) == [0] * 8
    assert picks_of(AdaptiveK(costs, k_max=4), 2) == [0, 1]


def test_a_lone_drafting_round_is_priced_with_what_its_calls_cost_besides_their_passes():
    """A round that decodes is priced over its whole call (decode_scale); a lone round that drafts
    pays, besides its passes, the target's time for the call beyond its pass and the draft's beyond
    its calibrated steps (a head's take-in of new rows, hand-offs), as measured: 2 and 1.5 ms here.
    Under load neither is learnt (a call there waits for others' passes) nor charged; nor is the draft's
    from a call that started its session or a pre-draft's."""
    costs = CostModel(TARGET, DRAFT, alpha=0.5)
    lone, loaded = costs.round_cost(3, 1, 1), costs.round_cost(3, 4, 4, pipelined=True)
    verify = Cost(service_ms=TARGET(4, 1) + 2.0, batch_size=1, pass_ms=TARGET(4, 1))
    for _ in range(200):
        costs.observe(Round([1, 2], 3, 1, Cost(service_ms=3 * DRAFT(1, 1) + 1.5, batch_size=1), verify, asked=3,
                            draft_calls=1), 20.0)
    assert costs.verify_extra_ms == pytest.approx(2.0, rel=1e-3)
    assert costs.draft_extra_ms == pytest.approx(1.5, rel=1e-3)
    assert costs.round_cost(3, 1, 1) == pytest.approx(lone + 3.5 + (costs.overhead_ms - 0.5) * 2)
    assert costs.round_cost(0, 1, 1, steps=8) < costs.round_cost(3, 1, 1)  # (K = 0 charges neither)
    assert costs.round_cost(3, 4, 4, pipelined=True) == pytest.approx(loaded + (costs.overhead_ms - 0.5) * 2 / 4)
    # nor from a call that started the draft's session (it took in the whole prompt) or a pre-draft's
    costs.observe(Round([1, 2], 3, 1, Cost(service_ms=50.0, batch_size=1), verify, asked=3, draft_calls=1,
                        draft_started=True), 70.0)
    costs.observe(Round([1, 2], 3, 1, Cost(service_ms=50.0, batch_size=1), verify, asked=3, draft_calls=1,
                        predrafted=True), 70.0)
    assert costs.draft_extra_ms == pytest.approx(1.5, rel=1e-3)
    costs.in_flight = 2
    slow = Cost(service_ms=TARGET(4, 1) + 20.0, batch_size=1, pass_ms=TARGET(4, 1))
    costs.observe(Round([1, 2], 3, 1, Cost(service_ms=50.0, batch_size=1), slow, asked=3, draft_calls=1), 80.0)
    assert costs.verify_extra_ms == pytest.approx(2.0, rel=1e-3)
    assert costs.draft_extra_ms == pytest.approx(1.5, rel=1e-3)


def test_a_lone_drafting_round_prices_its_verify_pass_as_such_passes_ran():
    """Where a request seldom drafts, most passes are decode steps', which run back to back faster
    than a verify pass after a draft call: a lone drafting round's pass is priced at what the verify
    passes measured (verify_scale), not at every round's (target_scale). Under load, a pass is
    every request's (target_scale)."""
    costs = CostModel(TARGET, DRAFT, alpha=0.5)
    lone = costs.round_cost(4, 1, 1)
    verify = Cost(service_ms=1.5 * TARGET(5, 1), batch_size=1, pass_ms=1.5 * TARGET(5, 1), batch_tokens=5)
    step = Cost(service_ms=0.8 * TARGET(1, 1), batch_size=1, pass_ms=0.8 * TARGET(1, 1), batch_tokens=1)
    for i in range(300):  # one drafting round in four (0.5 ms a call outside the services, as the model starts)
        if i % 4 == 0:
            costs.observe(Round([1, 2], 4, 1, Cost(), verify, asked=4), verify.service_ms + 1.0)
        else:
            costs.observe(Round([1], 0, 0, Cost(), step), step.service_ms + 0.5)
    assert costs.verify_scale == pytest.approx(1.5, rel=1e-3)
    assert 0.8 < costs.target_scale < 1.2  # every round's: mostly the decode steps'
    assert costs.round_cost(4, 1, 1) == pytest.approx(lone + 0.5 * TARGET(5, 1), rel=1e-3)
    loaded = costs.round_cost(4, 4, 4, pipelined=True)
    costs.verify_scale = 7.0
    assert costs.round_cost(4, 4, 4, pipelined=True) == loaded and costs.round_cost(4, 1, 1) > 2 * lone
    costs.verify_scale = 1.5
    costs.in_flight = 2  # a verify under load waited for others' passes: not a sample
    costs.observe(Round([1, 2], 4, 1, Cost(), Cost(service_ms=90.0, batch_size=1, pass_ms=80.0, batch_tokens=5),
                        asked=4), 91.0)
    assert costs.verify_scale == pytest.approx(1.5, rel=1e-3)


def test_a_lone_request_prices_decoding_as_its_calls_ran():
    """A call that decodes several tokens runs its passes back to back, faster than the verify pass
    that waits while the draft drafts (the EAGLE head and the int4 target on 2 cores: 4.2 ms a pass
    against 5.4): priced at the verify pass's scale, a weak draft looked worth drafting. The calls
    are priced at what they measure, a pass for each token not copied; the verify pass keeps its own."""
    costs = CostModel(TARGET, DRAFT, alpha=0.5)
    policy = AdaptiveK(costs, k_max=4, steps=8)
    verify = costs.round_cost(2, 1, 1)
    per_token = lambda k: costs.round_cost(k, 1, 1, steps=8) / expected_tokens(0.5, k)  # noqa: E731
    assert policy.choose(100) >= 1 and per_token(1) < per_token(0)  # 1.5 tokens for 11.2 ms, against 8.7 a token
    calls = 0.6 * 4 * TARGET(1, 1)  # ms in the target: 8 tokens, 4 of them copies kept, 4 passes at 0.6x
    for _ in range(100):  # (0.5 ms a call outside the services, as the model starts from)
        costs.observe(Round(list(range(8)), 0, 0, Cost(), Cost(service_ms=calls, batch_size=1), copied=4), calls + 0.5)
    assert costs.decode_scale == pytest.approx(0.6, rel=1e-3)
    assert costs.round_cost(0, 1, 1, steps=8) == pytest.approx(costs.decode_scale * TARGET(1, 1) + 0.5 / 8)
    assert costs.round_cost(2, 1, 1) == pytest.approx(verify)
    assert costs.round_cost(0, 1, 1, pipelined=True) == pytest.approx(TARGET(1, 1) + 0.5)
    assert per_token(0) < per_token(1)
    for _ in range(100):  # other sessions' passes share those calls: not a lone call's time
        costs.observe(Round(list(range(8)), 0, 0, Cost(), Cost(service_ms=2 * calls, batch_size=2)), 2 * calls + 0.5)
    costs.in_flight = 2  # nor a call that ran alone while other requests were in flight (at 1.0x here)
    costs.observe(Round(list(range(8)), 0, 0, Cost(), Cost(service_ms=8 * TARGET(1, 1), batch_size=1)), 50.0)
    costs.in_flight = 1  # nor a verify pass's round, whatever it commits
    costs.observe(Round(list(range(4)), 3, 3, Cost(), Cost(service_ms=2 * calls, batch_size=1), asked=3), 2 * calls)
    assert costs.decode_scale == pytest.approx(0.6, rel=1e-3)
    # a call that first takes in a whole context (its target session started again) is one bounded sample
    costs.observe(Round(list(range(8)), 0, 0, Cost(), Cost(service_ms=100 * calls, batch_size=1), copied=4), 10.0)
    assert costs.decode_scale == pytest.approx(0.6 + 0.1 * (4.0 - 0.6), rel=1e-3)


def test_requests_in_flight_share_their_probes():
    """Under load the requests' acceptance is shared (CostModel.alpha): one request's probe or
    drafted round keeps it current for all, so 8 requests at K = 0 probe about as often together as
    one alone, not 8 times as often (each probe's draft call costs its session a target pass)."""
    def probes(requests: int, rounds: int = 200) -> int:
        costs = CostModel(TARGET, DRAFT, alpha=0.0)
        costs.in_flight = requests
        policies = [AdaptiveK(costs, k_max=4) for _ in range(requests)]
        count = 0
        for _ in range(rounds):
            for policy in policies:
                k = policy.choose(100)
                count += k > 0
                policy.observe(Round([], k, 0, Cost(), Cost(batch_size=requests), asked=k), 10.0)
        return count

    alone = probes(1)
    assert alone == 5  # at rounds 9, 26, 59, 124 and 189 (alone: the coordinator's rounds since the last)
    assert 1 <= probes(8) <= 2 * alone  # each of 8 on its own: 8 x 5


def test_each_kind_of_request_probes_for_its_own_acceptance():
    """The probes' waits are per kind: a greedy request drafting under load keeps greedy's acceptance
    current, not the sampled requests' (a pool only their rounds move), so sampled requests at K = 0
    go on probing; and a lone sampled request's wait is not reset by greedy requests' drafting."""
    costs = CostModel(TARGET, DRAFT, alpha=0.0)
    costs.in_flight = 4
    greedy = AdaptiveK(costs, k_max=4)
    rounds_of(greedy, accepted=4, proposed=4, batch=4, n=50)  # greedy's draft is right every time
    sampled = [AdaptiveK(costs, k_max=4, sampled=True) for _ in range(3)]
    probes = 0
    for _ in range(200):
        greedy.observe(Round([], 4, 4, Cost(), Cost(batch_size=4), asked=4), 10.0)  # drafting on, every round
        for policy in sampled:
            k = policy.choose(100)
            probes += k > 0
            policy.observe(Round([], k, 0, Cost(), Cost(batch_size=4), asked=k), 10.0)
    assert probes >= 3  # (with one wait for both kinds, greedy's drafting stopped every probe: 0)
    lone = CostModel(TARGET, DRAFT, alpha=0.0)
    request = AdaptiveK(lone, k_max=4, sampled=True)
    picks = picks_of(request, AdaptiveK.PROBE_EVERY)  # rounds 1..8 without drafting
    AdaptiveK(lone, k_max=4).observe(Round([], 4, 4, Cost(), Cost(batch_size=1), asked=4), 10.0)  # a greedy round
    assert picks == [0] * AdaptiveK.PROBE_EVERY and picks_of(request, 1) == [1]


def test_cost_model_scales_to_measured_passes():
    costs = CostModel(TARGET, DRAFT)
    predicted = TARGET(10, 2)
    for _ in range(100):
        costs.observe(Round([], 4, 4, Cost(), Cost(batch_size=2, batch_tokens=10, pass_ms=2 * predicted), asked=4), 0)
    assert costs.target_scale == pytest.approx(2.0, rel=0.01)
    for _ in range(100):  # starts that scored their prompts: output rows the pass cost does not model
        costs.observe(Round([], 0, 0, Cost(), Cost(batch_size=1, batch_tokens=10, pass_ms=9 * predicted),
                            scored_prompt=True), 0)
    assert costs.target_scale == pytest.approx(2.0, rel=0.01)
    overhead = costs.overhead_ms
    for _ in range(10):  # rounds whose target session started (again): their wall time may hold a wait for room
        costs.observe(Round([], 0, 0, Cost(), Cost(batch_size=1, service_ms=1.0), target_restarted=True), 2000.0)
    assert costs.overhead_ms == overhead
    costs.observe(Round([], 0, 0, Cost(), Cost(batch_size=1, service_ms=1.0)), 2000.0)
    assert costs.overhead_ms > overhead + 50  # (any other round's counts)


def test_decode_steps_follow_the_pass_time_not_each_pass():
    """A K = 0 call's steps follow how passes run over ~100 rounds, not the last few: under load the
    passes' times jump from round to round, and requests whose steps differ fall out of step (the
    target decodes on only while no other call waits), which split its batches (8 streams, int4:
    3.0-3.3 tokens a call at K ~ 0 where a fixed K = 0 made 4.1-4.7)."""
    costs = CostModel(PassCost(fixed=12.0), DRAFT)
    seen = set()
    for i in range(600):  # passes at 1.0x and 1.4x their calibrated time in turn: 1.2x on the whole
        costs.observe(Round([], 0, 0, Cost(), Cost(batch_size=1, batch_tokens=1, pass_ms=12.0 * (1.0, 1.4)[i % 2])), 0)
        if i >= 500:
            seen.add(costs.decode_steps(8))
    assert seen == {int(DECODE_CHUNK_MS // (1.2 * 12.0))}
    assert costs.target_scale != pytest.approx(1.2, abs=0.005)  # (the round-to-round scale: 1.19 or 1.21)


def test_fixed_k():
    assert FixedK(4).choose(100) == 4 and FixedK(4).choose(3) == 2 and FixedK(0).choose(9) == 0
    assert FixedK(0).decode_steps(100) == 1 and FixedK(0, 8).decode_steps(100) == 8
    assert FixedK(0, 8).decode_steps(3) == 3


def test_rounds_without_drafting_decode_what_fits_in_a_chunk():
    """A K = 0 round asks for as many tokens as DECODE_CHUNK_MS of target passes hold, within its
    steps and the tokens left; and K = 0's price shares the call's overhead among them."""
    fast = CostModel(PassCost(fixed=9.5), DRAFT)  # SmolLM2 int4: ~10 passes in 100 ms
    slow = CostModel(PassCost(fixed=26.0), DRAFT)  # float32: 3
    assert AdaptiveK(fast, k_max=8, steps=8).decode_steps(100) == 8
    assert AdaptiveK(slow, k_max=8, steps=8).decode_steps(100) == int(DECODE_CHUNK_MS // 26.0)
    assert AdaptiveK(fast, k_max=8, steps=8).decode_steps(5) == 5
    assert AdaptiveK(fast, k_max=8).decode_steps(100) == 1  # steps default: one
    slow.steps_scale = 2.0  # passes running at twice their calibrated time fit half as many
    assert AdaptiveK(slow, k_max=8, steps=8).decode_steps(100) == int(DECODE_CHUNK_MS // 52.0)
    assert slow.decode_steps(8) == int(DECODE_CHUNK_MS // 52.0) and fast.decode_steps(4) == 4  # (a fixed K = 0's)
    busy = AdaptiveK(CostModel(PassCost(fixed=9.5, per_token=2.0, per_session=1.0), DRAFT), k_max=8, steps=8)
    busy.batch = 6.0  # its passes hold 6 sessions: it asks for what a fixed K = 0 of the same costs asks
    fixed = FixedK(0, busy.costs.decode_steps(8))
    assert busy.decode_steps(100) == fixed.decode_steps(100) == int(DECODE_CHUNK_MS // 12.5)
    costs = CostModel(PassCost(fixed=9.5), DRAFT, overhead_ms=2.0)
    assert costs.round_cost(0, 1, 1, steps=8) == pytest.approx(9.5 + 2.0 / 8)
    assert costs.round_cost(0, 1, 1) == pytest.approx(9.5 + 2.0)
    assert costs.round_cost(2, 1, 1, steps=8) == costs.round_cost(2, 1, 1)  # drafting rounds verify once


def test_a_draft_barely_worth_it_one_token_a_call_is_not_worth_it_eight():
    """Where a round trip is a large share of a plain step, a poor draft pays for itself against
    one-token calls, not against calls that share the trip among several tokens."""
    target = PassCost(fixed=9.5, per_token=0.5)
    draft = PassCost(fixed=0.3, per_token=0.05)
    picks = {}
    for steps in (1, 8):
        policy = AdaptiveK(CostModel(target, draft, alpha=0.3, overhead_ms=3.0), k_max=8, steps=steps)
        for _ in range(20):  # alpha about 1/3: one of three tried accepted
            rounds_of(policy, accepted=0, proposed=2, batch=1, n=1)
            rounds_of(policy, accepted=1, proposed=2, batch=1, n=1)
        assert policy.alpha == pytest.approx(1 / 3, abs=0.03)
        policy.costs.overhead_ms = 3.0
        picks[steps] = policy.choose(100)
    assert picks[1] > 0 and picks[8] == 0



def test_where_the_text_repeats_itself_the_targets_copies_price_k_0_per_token():
    """A request whose committed tokens go on as copies of its context would (CopyYield, replayed
    whatever its rounds did) prices K = 0 per token at the tokens and rows such passes commit and
    feed: a draft worth it against one token a pass is not against several."""
    target = PassCost(fixed=9.5, per_token=0.5)
    draft = PassCost(fixed=0.3, per_token=0.05)
    costs = CostModel(target, draft, overhead_ms=1.0)
    assert costs.round_cost(0, 1, 1, steps=8, step_yield=(2.0, 3.0)) == pytest.approx(costs.target(3, 1) / 2 + 1 / 8)
    assert costs.round_cost(2, 1, 1, steps=8, step_yield=(2.0, 3.0)) == costs.round_cost(2, 1, 1)
    prompt = list(range(100, 200))
    picks, yields = {}, {}
    for name, lookup, text in (("copies", 4, prompt), ("none", 4, list(range(200, 400))), ("off", 0, prompt)):
        policy = AdaptiveK(CostModel(target, draft, alpha=0.5, overhead_ms=1.0), k_max=8, steps=8, lookup=lookup,
                           prompt=prompt)
        for i in range(20):  # alpha 0.5; the rounds commit `text` on from its start, 5 tokens each
            policy.observe(Round(text[5 * i: 5 * i + 5], 3, 1, Cost(), Cost(batch_size=1), asked=3), 10.0)
        policy.costs.overhead_ms = 1.0
        picks[name], yields[name] = policy.choose(100), policy.step_yield
    assert yields["copies"][0] > 2.5 and yields["none"] == pytest.approx((1.0, 1.0)) and yields["off"] == (1.0, 1.0)
    assert picks["none"] > 0 and picks["off"] > 0 and picks["copies"] == 0


def test_acceptance_k_follows_only_the_request_s_rounds():
    """+2 after a round accepting all, -1 after a rejection, within [1, k_max], from k_max / 2;
    timings and batch sizes play no part."""
    k = AcceptanceK(k_max=8)
    assert k.choose(100) == 4 and k.choose(3) == 2
    picks = []
    for accepted, proposed, batch, wall in [(4, 4, 1, 5.0), (6, 6, 16, 900.0), (1, 8, 3, 1.0), (0, 7, 1, 2.0),
                                            (6, 6, 8, 40.0), (8, 8, 1, 5.0), (8, 8, 1, 5.0)]:
        k.observe(Round([], proposed, accepted, Cost(), Cost(batch_size=batch), asked=proposed), wall)
        picks.append(k.choose(100))
    assert picks == [6, 8, 7, 6, 8, 8, 8]
    low = AcceptanceK(k_max=8)
    rounds_of(low, accepted=0, proposed=2, batch=1)
    assert low.choose(100) == 1  # never 0: it keeps measuring
    assert AcceptanceK(k_max=0).choose(100) == 0


def test_the_shared_acceptance_leaves_its_starting_guess_within_a_few_rounds():
    """The coordinator-wide acceptance (a new request's prior) starts at a guess, 0.6 unless told;
    against a draft's rounds it is their tokens accepted per token tried, pooled, the guess counting
    as ALPHA_PRIOR_TOKENS tried, everything fading by ALPHA_EMA a round: it neither keeps the guess
    for ~100 rounds nor forgets a long history at once, and a round of 0 of 1 weighs as one token
    tried, not as much as a round of 3 of 4 (the mean of the rounds' rates read a draft's
    acceptance low)."""
    costs = CostModel(TARGET, DRAFT)
    assert costs.alpha == 0.6
    for _ in range(20):
        costs.observe(Round([], 4, 1, Cost(), Cost(batch_size=1), asked=4), 10.0)  # 1 accepted of 2 tried
    fade = 1 - ALPHA_EMA
    kept = sum(fade ** i for i in range(20))
    assert costs.alpha == pytest.approx((kept + 0.6 * ALPHA_PRIOR_TOKENS * fade ** 20)
                                        / (2 * kept + ALPHA_PRIOR_TOKENS * fade ** 20))
    assert 0.5 < costs.alpha < 0.52
    for _ in range(30):
        costs.observe(Round([], 4, 0, Cost(), Cost(batch_size=1), asked=4), 10.0)  # 0 of 1
    assert 0.2 < costs.alpha < 0.3  # 50 rounds, ~0.25 (not 0.0: no one round decides)
    mixed = CostModel(TARGET, DRAFT)
    for i in range(200):  # 0 of 1 and 3 of 4 in turn: 3 of 5 tokens tried, a mean of the rates of 0.375
        mixed.observe(Round([], 4, 3 * (i % 2), Cost(), Cost(batch_size=1), asked=4), 10.0)
    assert mixed.alpha == pytest.approx(0.6, abs=0.01)
    for _ in range(600):
        costs.observe(Round([], 4, 4, Cost(), Cost(batch_size=1), asked=4), 10.0)  # 4 of 4
    assert costs.alpha > 0.99  # past 1 / ALPHA_EMA rounds, it follows the draft



def test_greedy_and_sampled_requests_start_from_their_own_kinds_acceptance():
    """A greedy round accepts where the draft's top token is the target's, a sampled one with
    probability sum min(p, q): their acceptance is learnt apart (CostModel.alpha_of), and a sampled
    request after many greedy ones that accepted nearly everything starts from the sampled rounds'
    figure, not theirs; the coordinator's reported figure pools both. A request of either kind feeds
    its own kind only, seeded sampled ones (AcceptanceK) too."""
    costs = CostModel(TARGET, DRAFT, alpha=0.2)
    greedy = AdaptiveK(costs, k_max=4)
    rounds_of(greedy, accepted=4, proposed=4, batch=1, n=100)
    assert costs.alpha_of(False) > 0.95
    assert costs.alpha_of(True) == 0.2  # untouched: the card's figure
    sampled = AdaptiveK(costs, k_max=4, sampled=True)
    assert sampled.alpha == pytest.approx(0.2)
    assert sampled.choose(100) == 0  # at the card's 0.2 drafting does not pay here; at greedy's it would
    assert AdaptiveK(costs, k_max=4).choose(100) == 4
    rounds_of(sampled, accepted=0, proposed=1, batch=1, n=60)  # its kind's rounds: nothing accepted
    assert costs.alpha_of(True) < 0.05 and costs.alpha_of(False) > 0.95
    assert costs.alpha_of(True) < costs.alpha < costs.alpha_of(False)
    seeded = AcceptanceK(k_max=4, costs=costs)
    before = costs.alpha_of(False), costs.alpha_of(True)
    seeded.observe(Round([], 4, 4, Cost(), Cost(batch_size=1), asked=4), 10.0)
    assert costs.alpha_of(False) == before[0] and costs.alpha_of(True) > before[1]

# ----------------------------------------------------------------- the prior from the draft's card

def test_acceptance_prior_flag(tmp_path):
    from draft_service.__main__ import acceptance_prior

    card = tmp_path / "distill.json"
    card.write_text(json.dumps({"final": {"heldout_agreement": 0.49}}))
    assert acceptance_prior("auto", str(tmp_path)) == 0.49  # agreement on held-out answers, where no rounds ran
    card.write_text(json.dumps({"final": {"heldout_agreement": 0.49}, "acceptance": {"alpha_pooled": 0.33}}))
    assert acceptance_prior("auto", str(tmp_path)) == 0.33  # alpha in specdec's own rounds comes first
    assert acceptance_prior("auto", str(tmp_path / "none")) == 0.0 and acceptance_prior("auto", None) == 0.0
    assert acceptance_prior("0.7", None) == 0.7
    with pytest.raises(SystemExit, match="auto or a number"):
        acceptance_prior("high", None)
    with pytest.raises(SystemExit, match="within 0..1"):
        acceptance_prior("1.5", None)


def test_adaptive_k_starts_from_the_drafts_card(pair, tmp_path):
    """A draft whose card measured alpha 0.2: its service reports it (ModelInfo.acceptance_prior), the
    coordinator's acceptance starts there instead of at 0.6 (ServerInfo.acceptance), and moves once
    rounds are seen. A draft without a card reports 0 and the coordinator keeps 0.6."""
    import grpc

    from coordinator.launch import LocalStack
    from specdec.v1 import specdec_pb2 as pb
    from specdec.v1 import specdec_pb2_grpc as pb_grpc

    draft_dir, target_dir = pair
    carded = shutil.copytree(draft_dir, tmp_path / "draft")
    (carded / "distill.json").write_text(json.dumps({"acceptance": {"alpha_pooled": 0.2}}))
    with LocalStack(carded, target_dir) as stack, grpc.insecure_channel(stack.addr) as channel:
        client = pb_grpc.GenerationStub(channel)
        info = client.GetInfo(pb.GetInfoRequest())
        assert info.draft.acceptance_prior == pytest.approx(0.2) and info.target.acceptance_prior == 0.0
        assert info.acceptance == pytest.approx(0.2)
        # both on this machine's CPUs: they say so, and adaptive K prices their rounds as sharing cores
        assert info.draft.host_id and info.draft.host_id == info.target.host_id
        assert set(info.draft.cpus) == set(info.target.cpus) == set(os.sched_getaffinity(0))
        # a seeded sampled request without K: its K comes from its acceptance alone (AcceptanceK), so it
        # drafts whatever the prior, and its rounds count in the coordinator's acceptance
        reply = client.Generate(pb.GenerateRequest(prompt="def f(x):", max_new_tokens=24, temperature=1.0, seed=3))
        assert reply.stats.draft_tokens > 0
        assert client.GetInfo(pb.GetInfoRequest()).acceptance != pytest.approx(0.2)  # the rounds' own figure
    with LocalStack(draft_dir, target_dir, draft_args=["--acceptance-prior", "auto"]) as stack, \
            grpc.insecure_channel(stack.addr) as channel:
        info = pb_grpc.GenerationStub(channel).GetInfo(pb.GetInfoRequest())
        assert info.draft.acceptance_prior == 0.0 and info.acceptance == pytest.approx(0.6)


def test_a_draft_on_the_targets_cores_is_paid_for_under_load():
    """Pipelined (several requests in flight), a round costs the larger of the two services' shares:
    on separate hardware they work at once. On shared cores the draft's work delays the target's
    passes, so the round costs the sum, and K backs off sooner."""
    draft = PassCost(fixed=1.2, per_token=0.3, per_session=0.3)
    apart, shared = CostModel(TARGET, draft), CostModel(TARGET, draft, shared_cpus=True)
    for k in (1, 4):
        assert shared.round_cost(k, 4.0, 4.0, pipelined=True) > apart.round_cost(k, 4.0, 4.0, pipelined=True)
        # the sum, as for a lone request, and the draft call's time outside the services in full (see
        # test_on_shared_cores_the_batch_waits_for_a_drafting_sessions_call)
        assert shared.round_cost(k, 4.0, 4.0, pipelined=True) == pytest.approx(
            shared.round_cost(k, 4.0, 4.0, pipelined=False) + shared.overhead_ms * (1 - 1 / 4))
    assert shared.round_cost(0, 4.0, 4.0, pipelined=True) == apart.round_cost(0, 4.0, 4.0, pipelined=True)
    chosen = {}
    for name, costs in (("apart", apart), ("shared", shared)):
        costs.in_flight = 8
        policy = AdaptiveK(costs, k_max=8)
        for i in range(20):  # 0 to 4 of 4 accepted in turn (0.69 of the tokens tried), passes of 4 sessions
            policy.observe(Round([], 4, i % 5, Cost(), Cost(batch_size=4), asked=4), 1.0)
        chosen[name] = policy.choose(100)
    assert chosen["shared"] < chosen["apart"], chosen


def test_on_shared_cores_the_batch_waits_for_a_drafting_sessions_call():
    """The target's passes wait for the sessions at work (--batch-wait-ms), so under load on shared
    cores a session's draft call holds the whole batch while it is on the wire: its time outside the
    services is not shared by the batch. At 8 streams (the EAGLE head on 2 cores, SmolLM2 float32, the
    costs below) drafting nothing ran 128.7 tokens/s and adaptive K, drafting 0.57 a round, 99.0.
    Apart, or for a lone request, the price does not change."""
    target = PassCost(fixed=34.9, per_token=1.6, per_session=1.0, free_rows=8)
    head = PassCost(fixed=0.14, per_session=0.09)
    chosen = {}
    for shared in (False, True):
        costs = CostModel(target, head, alpha=0.55, overhead_ms=3.0, shared_cpus=shared)
        costs.target_scale, costs.draft_scale, costs.in_flight = 1.2, 5.0, 8
        policy = AdaptiveK(costs, k_max=8)
        policy.batch, policy.draft_batch = 7.0, 1.0
        chosen[shared] = policy.choose(100)
        if shared:  # the overhead in a round: K = 0's call shared by the batch; a draft call's in full
            free = CostModel(target, head, alpha=0.55, overhead_ms=0.0, shared_cpus=True)
            free.target_scale, free.draft_scale = 1.2, 5.0
            extra = [costs.round_cost(k, 7.0, 1.0, pipelined=True) - free.round_cost(k, 7.0, 1.0, pipelined=True)
                     for k in (0, 2)]
            assert extra == pytest.approx([3.0 / 7, 3.0 / 7 + 3.0])
            costs.in_flight = 1  # alone: its round is the sum, as before, and worth drafting
            chosen["alone"] = policy.choose(100)
    assert chosen[True] == 0 and chosen[False] > 0 and chosen["alone"] > 0, chosen


def test_a_draft_slower_than_calibrated_is_charged_for_it_on_shared_cores():
    """The draft's measured slowness (draft_scale > 1: taking in the new tokens' features, running
    beside the target) is hidden on its own hardware, where it drafts while the target verifies
    others; on the target's cores every ms of it is one the target waits for. There, at 8 streams
    (the EAGLE head on 2 cores, adaptive K 0.81 at 55.2 tok/s against the target alone's 62.7), K
    backs off; apart, or for a lone request, it does not move."""
    draft = PassCost(fixed=1.2, per_token=0.3, per_session=0.3)
    chosen = {}
    for shared in (False, True):
        for scale in (1.0, 3.0):
            costs = CostModel(TARGET, draft, alpha=0.5, shared_cpus=shared)
            costs.in_flight, costs.draft_scale = 8, scale
            chosen[shared, scale] = AdaptiveK(costs, k_max=8).choose(100)
    assert chosen[False, 3.0] == chosen[False, 1.0] > 0
    assert chosen[True, 3.0] < chosen[True, 1.0], chosen
    alone = {}
    for scale in (1.0, 3.0):
        costs = CostModel(TARGET, draft, alpha=0.5, shared_cpus=True)
        costs.draft_scale = scale  # (in_flight 0: no other request)
        alone[scale] = AdaptiveK(costs, k_max=8).choose(100)
    assert alone[3.0] == alone[1.0] > 0


def test_rows_a_verify_carries_free_are_not_charged():
    """SmolLM2 float32 on 2 cores: one session's pass of up to ~8 tokens costs what a pass of 1
    does (the weights' reads set it), and past that ~1.5 ms a token. Priced so (free_rows), a
    cheap draft at acceptance 0.35 drafts 3 a round, as K = 3-4 runs fastest there; priced
    linearly it drafts 2 (the bench: adaptive K ran 0.85x of K = 4 with the EAGLE head)."""
    head = PassCost(fixed=0.85, per_session=0.12)
    free = PassCost(fixed=34.0, per_token=1.5, free_rows=8)
    linear = PassCost(fixed=34.0, per_token=1.5)
    assert free(5, 1) == free(1, 1) == 34.0 and free(16, 2) == pytest.approx(34.0 + 1.5 * 8)
    chosen = {name: AdaptiveK(CostModel(target, head, alpha=0.35), k_max=8).choose(100)
              for name, target in (("free", free), ("linear", linear))}
    assert chosen == {"free": 3, "linear": 2}


def test_the_draft_stops_where_a_token_costs_more_than_it_brings():
    """Where a verify's rows come free (SmolLM2 float32 on 2 cores), a drafted token costs only the
    head's step: the draft is asked to stop only at tokens it gives under ~5%. Where each row
    costs (int4: ~0.5 ms a row on a ~3.4 ms pass), it stops at the tokens that would cost more than
    their chance of acceptance brings. No stop on a round that drafts nothing."""
    head = PassCost(fixed=0.85, per_session=0.12)
    free = AdaptiveK(CostModel(PassCost(fixed=34.0, per_token=1.5, free_rows=8), head, alpha=0.35), k_max=8)
    int4 = AdaptiveK(CostModel(PassCost(fixed=3.4, per_token=0.5), PassCost(fixed=0.3, per_session=0.1),
                               alpha=0.55, overhead_ms=0.0), k_max=8)
    assert free.choose(100) == 3 and 0 < free.stop_below < 0.05
    k = int4.choose(100)
    cost = lambda n: int4.costs.round_cost(n, 1.0, 1.0)  # noqa: E731
    assert k > 0 and int4.stop_below == pytest.approx((cost(k + 1) - cost(k)) * expected_tokens(0.55, k) / cost(k))
    assert 0.15 < int4.stop_below < 0.5
    bad = AdaptiveK(CostModel(TARGET, DRAFT), k_max=8)
    rounds_of(bad, accepted=0, proposed=4, batch=1)
    assert bad.choose(100) == 0 and bad.stop_below == 0.0
    assert FixedK(4).stop_below == AcceptanceK(8).stop_below == 0.0  # a seeded request's draws read no timings


def test_the_policys_stop_reaches_the_draft_as_the_rounds_p_min(pair):
    """The round's p_min is the larger of the request's and the policy's stop, on drafting rounds;
    the output is the target's whatever the draft was asked."""
    import asyncio

    from model_service.engines import DraftEngine, TargetEngine
    from model_service.local import LocalDraft, LocalTarget
    from model_service.model_runner import ModelRunner
    from speculative.protocol import SamplingParams
    from speculative.round import generate

    class Stopping(FixedK):
        stop_below = 0.4

    draft_dir, target_dir = pair
    draft, target = LocalDraft(DraftEngine(ModelRunner(draft_dir))), LocalTarget(TargetEngine(ModelRunner(target_dir)))
    asked: list[float] = []
    propose = draft.propose

    async def recording(call, **kwargs):
        asked.append(call.p_min)
        return await propose(call, **kwargs)

    draft.propose = recording

    def run(policy, p_min):
        async def go():
            out = []
            async for new in generate(draft, target, [5, 6, 7], max_new_tokens=24, k=policy,
                                      params=SamplingParams(0.0), max_context=256, p_min=p_min):
                out.extend(new)
            return out
        asked.clear()
        return asyncio.run(go()), set(asked)

    alone, _ = run(FixedK(0), 0.0)
    assert run(Stopping(3), 0.1) == (alone, {0.4})
    assert run(Stopping(3), 0.6) == (alone, {0.6})
    assert run(FixedK(3), 0.1) == (alone, {0.1})


def test_a_draft_that_stops_short_counts_as_rejected_where_it_stopped():
    """Asked for 4, the draft stops after 1 (the rest too unsure) and the target accepts it: the
    round brought what a rejection at the second token brings, and the acceptance says so (a rate
    per token asked for: 1 of 2). A free draft (n-gram copies) that proposes less found no copy:
    no stop, and its short rounds count as before."""
    int4 = (PassCost(fixed=3.4, per_token=0.5), PassCost(fixed=0.3, per_session=0.1))
    stopping = AdaptiveK(CostModel(*int4, alpha=0.55, overhead_ms=0.0), k_max=8)
    free = AdaptiveK(CostModel(int4[0], PassCost(), alpha=0.55, overhead_ms=0.0), k_max=8)
    for policy in (stopping, free):
        for _ in range(200):
            k = policy.choose(100)
            policy.observe(Round([1, 2], 1, 1, Cost(), Cost(batch_size=1), asked=max(k, 2)), 10.0)
    assert stopping.stop_below > 0 and free.stop_below == 0.0
    assert stopping.alpha == pytest.approx(0.5, abs=0.05) and stopping.costs.alpha == pytest.approx(0.5, abs=0.05)
    assert free.alpha > 0.9 and free.costs.alpha > 0.9
