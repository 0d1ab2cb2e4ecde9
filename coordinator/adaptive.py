"""How many tokens to draft next round: a fixed K, or K chosen per round from costs and acceptance.

`AdaptiveK` picks, before each round of one request, the K that maximises expected tokens
per unit of cost, the "goodput" of SmartSpec (Liu et al. 2024):

    tokens(K) = 1 + sum over j <= K of prod over i <= j of a s_i     expected tokens a round commits
    cost(K)   = target share + draft share + overhead          one request in flight
              = max(target share, draft share) + overhead     several: pipelined

with `a` the request's acceptance, draft tokens accepted per token tried (its own counts, decayed
so it follows the text, pulled towards the coordinator-wide figure of its kind, greedy or sampled,
while they are few: CostModel.alpha_of), `s_i` how
the i-th draft position's acceptance stands to it (CostModel.shape; all 1: Leviathan's
(1 - a^(K+1)) / (1 - a)), and the costs from `CostModel`:
each service's pass time fitted at start-up (`ModelRunner.calibrate`: fixed + per token +
per session), scaled by how its passes run now, and divided among the sessions that share
a pass. With one request the round is sequential: the draft drafts, then the target verifies.
With several, the draft drafts for some while the target verifies others, and a round costs
the system what its busier service spends on it. A pass's fixed cost is shared by its batch
while its per-token cost is not, so as
batches grow, extra draft tokens cost relatively more: K backs off, down to 0 (no
speculation) once verification is compute-bound or the draft is poor. Whatever K is
chosen, the output is the target's: K only moves cost around.

A round at K = 0 asks the target for several tokens in its one call (`decode_steps`, one pass each;
speculative_round; so does a round whose draft proposed nothing), as many as fit in DECODE_CHUNK_MS
of one session's passes (a fixed K = 0 too, from the costs when the request starts): its call
overhead is shared by them, which K = 0's price here counts when this request is alone (with others
in flight the target decodes on only in passes no one else waits on, so K = 0 is priced as one token
a call). (SmolLM2 int4 on 2 cores: a pass ~9.5 ms, a round trip ~1.4 ms more; a target alone through
the services ran at 0.87x of its runner.) A lone request prices such a call's passes at what such
calls measure (CostModel.decode_scale), not at the verify passes' scale: they run back to back,
faster than a pass the target takes after waiting for a draft call. Where such a call's passes also
verify the target's copies of the context (prompt lookup, VerifyCall.lookup), a pass commits more
than one token where the text repeats itself: K = 0 is priced per token at what its passes would
commit and feed (`step_yield`): the request's committed tokens replayed as such passes would have
copied them (CopyYield), whatever its rounds did, pulled towards the coordinator-wide figure while
they are few.
"""

from __future__ import annotations


from speculative.lookup import CopyYield
from speculative.protocol import PassCost
from speculative.round import Round

EMA = 0.1  # weight of a new observation in the running scales
STEPS_EMA = 0.01  # ... in the slower one decode steps read (CostModel.decode_steps)
ALPHA_EMA = 0.02  # per drafted round, the fade of the counts the coordinator-wide acceptance pools (~50 rounds)
ALPHA_PRIOR_TOKENS = 8.0  # the starting acceptance counts as this many draft tokens tried
DEFAULT_ALPHA = 0.6  # the acceptance assumed of a draft whose own (ModelInfo.acceptance_prior) is not known
STOP_MAX = 0.9  # the highest probability AdaptiveK.stop_for asks of a draft token (a sure one is always drafted)
DECODE_CHUNK_MS = 100.0  # a round that drafts nothing decodes at most about this long before its tokens stream
POSITION_DECAY = 0.995  # per drafted round: the fade of the counts CostModel.shape reads (~200 rounds)
POSITION_PRIOR = 8.0  # tries a position's acceptance needs to count as much as the one before it (CostModel.shape)


def expected_tokens(alpha: float, k: int, shape: list[float] | None = None) -> float:
    """Tokens a round commits on average: accepted draft tokens plus the target's own. With
    `shape`, draft position i (from 0) is accepted with probability alpha * shape[i] once the ones
    before it were (CostModel.shape), else alpha everywhere: (1 - alpha^(k+1)) / (1 - alpha)."""
    if shape is None:
        if alpha >= 1.0:
            return k + 1.0
        return (1.0 - alpha ** (k + 1)) / (1.0 - alpha)
    total, run = 1.0, 1.0
    for i in range(k):
        run *= min(0.999, alpha * (shape[i] if i < len(shape) else 1.0))
        total += run
    return total


class Acceptance:
    """A draft's acceptance over recent rounds: draft tokens accepted per token tried, pooled over
    the rounds (as AdaptiveK.alpha pools a request's), each round's counts fading by ALPHA_EMA a
    drafted round (~50 rounds), the starting figure (the draft's card's, else 0.6) counting as
    ALPHA_PRIOR_TOKENS tried and fading alike: made before the pair has drafted anything, it gives
    way within a few requests' rounds, not after ~100 of them (SmolLM2's draft: 0.2-0.3; at 0.6 the
    first requests drafted where it did not pay). Not the mean of the rounds' rates, which a round
    of 0 of 1 pulls down as much as one of 3 of 4 pulls up: with the EAGLE-3 head it read 0.32-0.42
    where the rounds' tokens were accepted at 0.52-0.62, and its requests, which start from it,
    drafted less than paid."""

    def __init__(self, start: float):
        self.start = start
        self.accepted, self.tried, self.weight = 0.0, 0.0, ALPHA_PRIOR_TOKENS
        # when it was last measured: CostModel.rounds when a request of its kind last drafted or chose to
        # probe, and a lone request's rounds without drafting before the next probe (AdaptiveK.choose)
        self.drafted_at = 0
        self.probe_wait = AdaptiveK.PROBE_EVERY

    def add(self, accepted: float, tried: float) -> None:
        fade = 1.0 - ALPHA_EMA
        self.accepted = fade * self.accepted + accepted
        self.tried = fade * self.tried + tried
        self.weight *= fade

    @property
    def value(self) -> float:
        return (self.accepted + self.weight * self.start) / (self.tried + self.weight)


class CostModel:
    """Round costs, shared by all of a coordinator's requests and updated from every round."""

    def __init__(self, target: PassCost, draft: PassCost, alpha: float = DEFAULT_ALPHA, overhead_ms: float = 0.5,
                 shared_cpus: bool = False):
        self.target, self.draft = target, draft
        self.shared_cpus = shared_cpus  # the draft and the target compute on the same cores (peers.share_cpus)
        self.target_scale = 1.0  # measured / calibrated pass time: contention, other hardware states
        # the same for a lone request's rounds that draft nothing, over the whole call (the target's time for it,
        # its handling with the passes): its passes run back to back, and run faster than a verify pass that
        # waited while the draft drafted (round_cost)
        self.decode_scale = 1.0
        # the same for a lone request's verify pass, after its draft call: what a lone drafting round's
        # pass is priced at (target_scale follows every round's, mostly decode steps where drafting is rare)
        self.verify_scale = 1.0
        self.steps_scale = 1.0  # the same, averaged over ~100 rounds: what decode_steps reads
        self.draft_scale = 1.0   # the same for the draft (reported; see round_cost)
        # a lone request's verify call: the target's time for it beyond its pass (the hand-off to the model
        # thread and back, the servicer), and the draft's call beyond its calibrated steps' price (the
        # take-in of the tokens and feature rows since its last call, its hand-off): what a drafting round
        # costs besides its passes, where a round that decodes is priced over its whole call (decode_scale)
        self.verify_extra_ms = 0.0
        self.draft_extra_ms = 0.0
        self.overhead_ms = overhead_ms  # per peer call, outside both services (wire, coordinator)
        # acceptance over all recent rounds (alpha, reported), and over greedy requests' and sampled
        # ones' (alpha_of: the prior of a new request of that kind)
        self.acceptance = Acceptance(alpha)
        self.modes = {False: Acceptance(alpha), True: Acceptance(alpha)}
        # each draft position's tries and acceptances (from 0: the round's first draft token), faded per
        # drafted round: how acceptance moves along a round (shape)
        self.position_tried: list[float] = []
        self.position_accepted: list[float] = []
        self.in_flight = 0  # requests generating now (the coordinator counts them)
        self.rounds = 0  # rounds observed, every request's
        self.batch = 1.0  # sessions a target pass has held lately, over every request's rounds
        # a pass of a round that drafts nothing, where the target's copies are on (VerifyCall.lookup): tokens it
        # commits, rows it feeds (AdaptiveK.step_yield: the requests' figures, lately)
        self.step_yield, self.step_rows = 1.0, 1.0

    def observe(self, r: Round, wall_ms: float, stopped: bool = False, sampled: bool | None = None) -> None:
        """stopped: the draft stopped short of the tokens asked at one too unsure to draft
        (AdaptiveK.stop_for), which for the tokens the round brings is a rejection there. sampled:
        whether the round's request samples (alpha_of), None where not known (counted in alpha only)."""
        t, d = r.target, r.draft
        self.rounds += 1
        if r.asked:  # (a round of a kind not known: both kinds')
            for kind in self.modes.values() if sampled is None else (self.modes[sampled],):
                kind.drafted_at = self.rounds
        if t.batch_size > 0:
            self.batch += EMA * (t.batch_size - self.batch)
        passes = len(r.tokens) - r.copied  # a pass commits its copies kept and one token of its own
        alone = self.in_flight <= 1  # a lone request's calls: not waiting behind others' passes
        lone_verify = r.proposed and t.batch_size == 1 and alone  # ... a drafting round's verify
        if not r.proposed and passes > 1 and t.batch_size == 1 and alone and t.service_ms > 0:
            # a lone request's call that decoded alone: its passes as a whole (one token's, and the rows they feed
            # lately); bounded, as a call that first takes in a whole context (a target session started again)
            # is one sample, not what decoding costs
            predicted = passes * self.target(self.step_rows, 1)
            if predicted > 0:
                ratio = min(4.0, max(0.25, t.service_ms / predicted))
                self.decode_scale += EMA * (ratio - self.decode_scale)
        if t.pass_ms > 0 and t.batch_tokens > 0 and not r.scored_prompt:  # (its output rows: not what a pass costs)
            predicted = self.target(t.batch_tokens, t.batch_size)
            if predicted > 0:
                ratio = t.pass_ms / predicted
                self.target_scale += EMA * (ratio - self.target_scale)
                self.steps_scale += STEPS_EMA * (ratio - self.steps_scale)
        if lone_verify and t.service_ms > t.pass_ms > 0:
            self.verify_extra_ms += EMA * (t.service_ms - t.pass_ms - self.verify_extra_ms)
        if lone_verify and t.pass_ms > 0 and t.batch_tokens > 0:
            predicted = self.target(t.batch_tokens, 1)
            if predicted > 0:
                self.verify_scale += EMA * (min(4.0, max(0.25, t.pass_ms / predicted)) - self.verify_scale)
        # (not a call that started the draft's session, taking in the whole context: once a request; nor a
        # pre-draft's, made while the target verified)
        if (r.proposed and r.draft_calls == 1 and not r.draft_started and not r.predrafted and d.batch_size == 1
                and alone and d.service_ms > 0):
            predicted = max(1, r.asked) * self.draft(1, 1)
            self.draft_extra_ms += EMA * (max(0.0, d.service_ms - predicted) - self.draft_extra_ms)
        if r.proposed and d.pass_ms > 0 and d.batch_size > 0:
            steps = max(1.0, d.batch_tokens / d.batch_size)
            predicted = steps * self.draft(d.batch_size, d.batch_size)
            if predicted > 0:
                self.draft_scale += EMA * (d.pass_ms / predicted - self.draft_scale)
        calls = 1 + (r.asked > 0)
        outside = max(0.0, wall_ms - d.service_ms - t.service_ms) / calls
        if not r.target_restarted:  # (its wall time may hold a wait for a full target's room)
            self.overhead_ms += EMA * (outside - self.overhead_ms)
        if r.proposed or stopped:
            tried = r.accepted + (r.accepted < r.proposed or stopped)
            self.count_positions(r.accepted, tried)
            self.acceptance.add(r.accepted, tried)
            if sampled is not None:
                self.modes[sampled].add(r.accepted, tried)

    @property
    def alpha(self) -> float:
        """The acceptance over every request's recent rounds (Acceptance), greedy and sampled: what
        the coordinator reports (ServerInfo.acceptance). Requests start from their kind's (alpha_of)."""
        return self.acceptance.value

    def alpha_of(self, sampled: bool) -> float:
        """The acceptance over recent rounds of greedy requests (sampled False) or of sampled ones: the
        prior of a new request of that kind, each from the draft's card's figure until its kind has
        drafted. The two differ: a greedy round accepts a token where it is the target's top one, a
        sampled round with probability sum over x of min(p(x), q(x)), and they are priced apart. Pooled,
        sampled requests after greedy ones started from greedy's figure (the EAGLE head, int4 target,
        T = 0.7, 2 Xeon cores: the pool read 0.62-0.68 where the sampled rounds accepted ~0.5, and one
        run of 16 requests drafted in 73 calls at 190.6 tokens/s, where drafting nothing ran 230)."""
        return self.modes[sampled].value

    def count_positions(self, accepted: int, tried: int) -> None:
        """A drafted round's positions: 0 .. accepted - 1 accepted, and `accepted` tried and lost
        where tried says so (a rejection, or a stop: see observe)."""
        grow = tried - len(self.position_tried)
        if grow > 0:
            self.position_tried += [0.0] * grow
            self.position_accepted += [0.0] * grow
        for i in range(len(self.position_tried)):
            self.position_tried[i] *= POSITION_DECAY
            self.position_accepted[i] *= POSITION_DECAY
        for i in range(tried):
            self.position_tried[i] += 1.0
            self.position_accepted[i] += i < accepted

    def shape(self, k: int) -> list[float]:
        """How acceptance moves along a round: for draft positions 0 .. k - 1, the acceptance of
        position i (given the ones before it were accepted) over the rate over every token tried
        (pooled, as CostModel.alpha and AdaptiveK.alpha pool theirs).
        A draft's tokens are not alike: the first of a round follows a rejection, where the draft
        has just gone wrong, and a token after several accepted ones follows text the draft reads
        well (the EAGLE-3 head on SmolLM2, float32, K = 8, 260 rounds: 0.49, 0.56, 0.61, 0.65, 0.79,
        0.91, 0.90, 0.94), so one rate for all, fitted where rounds are short, prices the longer
        rounds below what they bring. Each position's estimate is its own counts with the position
        before's estimate (for the first, the pooled rate) counted as POSITION_PRIOR tries: a
        position seldom reached reads like the one before it. All 1 before any round drafted."""
        tried_all = sum(self.position_tried)
        if tried_all <= 0:
            return [1.0] * k
        pooled = min(max(sum(self.position_accepted) / tried_all, 1e-3), 0.999)
        factors, before = [], pooled
        for i in range(k):
            tried = self.position_tried[i] if i < len(self.position_tried) else 0.0
            accepted = self.position_accepted[i] if i < len(self.position_tried) else 0.0
            before = (accepted + POSITION_PRIOR * before) / (tried + POSITION_PRIOR)
            factors.append(before / pooled)
        return factors

    def decode_steps(self, most: int) -> int:
        """Tokens a round that drafts nothing asks for: as many target passes of one session (a
        token, as passes have run over the last ~100 rounds: `steps_scale`) as DECODE_CHUNK_MS
        holds, 1 to `most`. Adaptive K and a fixed K = 0 ask alike. Not as passes ran in the last
        few rounds (`target_scale`): under load those jump from round to round, the requests'
        steps then differ, and requests whose calls end at different steps fall out of step (the
        target decodes on only while no other call waits) and split its batches (the EAGLE head,
        int4 target, 8 streams, two stacks each in turn: 4.09 tokens a call and batches of 6.23
        sessions against 3.54 and 6.00). Not passes of the batch the request's passes hold under
        load: fewer tokens a call are more round trips, each of which the session spends out of
        the target's batches
        (the EAGLE head, int4 target, 2 Zen 3 cores, 8 streams, 5 alternating runs: spec at K ~ 0
        183-205 tokens/s, median 197.5, against 157-186, median 180.6, priced at the batch's pass:
        2-3 tokens a call where no spec asked 4-5)."""
        pass_ms = self.steps_scale * self.target(1, 1)
        return max(1, min(most, int(DECODE_CHUNK_MS // max(pass_ms, 1.0))))

    def round_cost(self, k: int, batch: float, draft_batch: float, pipelined: bool = False, steps: int = 1,
                   step_yield: tuple[float, float] = (1.0, 1.0)) -> float:
        """ms of this request's share of one round with k draft tokens, per target pass where
        the round (k = 0) decodes `steps` tokens in its one call; per token where each of its passes
        commits and feeds (tokens, rows) = `step_yield` (the target's copies, VerifyCall.lookup).

        The target's share is scaled by how its passes run now; the draft's only where it runs
        faster than calibrated: under load the draft works while the target verifies other
        sessions, so its slowdown from sharing cores is hidden. `pipelined` (other requests in
        flight): the two services work at once, each on other sessions' rounds, so the round
        costs the larger share, not the sum. Measured at 8 streams on 2 cores, the sum picked
        K = 1.5 on average and ran 0.87x of fixed K = 4; the larger share picks about 3 and
        matches it (median of 3 runs, 439 vs 432 tokens/s; the 14 M toy pair, whose draft paid).
        Unless the two share cores (`shared_cpus`): then every ms the draft computes is one the
        target's passes wait for, and a round costs the sum even when pipelined (SmolLM2 and its
        weak draft on 2 cores, 8 streams: 85.7-87.4 tokens/s against 61.0 with the larger share), and
        the draft is charged what it measures, not only what it calibrated (the EAGLE head on 2
        cores, 8 streams: 68.0 tokens/s at mean K 0.18 against 55.2 at K 0.81 with the calibrated
        price; the target alone 62.7). A lone request's draft keeps its calibrated steps' price, plus what
        its calls measured beyond it (draft_extra_ms: a head's take-in of the rows since its last call,
        the hand-offs), and its verify what the target's call took beyond its pass (verify_extra_ms): a
        round at K = 0 is priced over its whole call (decode_scale), and without them a drafting round
        looked a third cheaper than it ran (the EAGLE head on the int4 target: ~10 ms priced, ~14.7 run
        at K = 4), and the first requests of a fresh coordinator drafted 30-68 times over 16 requests
        where 5-10 paid. (Charged its measured steps scaled, before K = 0 was priced as its calls run,
        the head stopped drafting at one stream where K = 4 ran ~10% faster than no drafting.)"""
        # the pass of `batch` sessions of k + 1 tokens each, shared among them (its free rows too)
        tokens, rows = (1.0, k + 1.0) if k else step_yield
        # a lone call that decodes on: priced as such calls have run (decode_scale), not as the verify
        # passes after a draft call (the EAGLE head and the int4 target on 2 cores: 4.2 ms a pass in the
        # calls, 5.4 a verify pass; priced alike, the head drafted at the start of each stack); a lone
        # drafting round's verify as such passes have run (verify_scale), not as every round's passes
        # (target_scale): where drafting is rare those are the decode steps', and the head's int4 rounds
        # at K = 4 were priced ~12 ms where they ran ~15-18
        if pipelined:
            scale = self.target_scale
        elif k == 0:
            scale = self.decode_scale if steps > 1 else self.target_scale
        else:
            scale = self.verify_scale
        target = scale * self.target(rows * batch, batch) / batch / tokens
        draft = 0.0
        if k:
            step = self.draft(draft_batch, draft_batch) / draft_batch  # a pass of a token per session
            # measured where it runs faster than calibrated; never charged for slowing down under load,
            # when it drafts while the target verifies others; unless the two share cores, where
            # every ms it computes under load is one the target's passes wait for
            scale = self.draft_scale if pipelined and self.shared_cpus else min(self.draft_scale, 1.0)
            draft = scale * k * step
        overhead = self.overhead_ms * (1 + (k > 0)) / batch / (steps if k == 0 else 1)
        if k and not pipelined:  # what a lone drafting round's calls cost besides their passes, as measured
            overhead += self.verify_extra_ms + self.draft_extra_ms
        if k and pipelined and self.shared_cpus:
            # the target's next pass waits for the sessions at work (--batch-wait-ms): while this
            # one's draft call is on its way there and back, the whole batch waits, so that call's
            # time outside the services is the system's, not a share of it (8 streams, the EAGLE head
            # on 2 cores: mean K 0.57 at 99.0 tokens/s, against 128.7 drafting nothing)
            overhead += self.overhead_ms * (1 - 1 / batch)
        if pipelined and not self.shared_cpus:
            return max(target, draft) + overhead
        return target + draft + overhead


class AcceptanceK:
    """K per round for one request from its own acceptance alone: 2 more after a round whose
    draft tokens were all accepted, 1 fewer (not below 1) after one with a rejection, within
    [1, k_max], from k_max / 2 (the "heuristic" schedule of transformers' assisted generation).

    What a sampled round draws depends on its K: how many acceptance tests, and whether a
    position's token comes from the residual or is the bonus. AdaptiveK reads timings and the
    load, so a seeded sampled request under it would draw differently from run to run. This
    policy reads nothing but the request's own rounds, so its K sequence, and with it its
    output, is a function of the request: the coordinator gives it to sampled requests that
    name their seed. The price: it does not back off under load. It drafts nothing only for a
    request's last token and past a draft's context (speculative.round.generate's draft_context),
    where each round decodes `steps` tokens: how many a call carries changes no token drawn.
    """

    adaptive = True
    stop_below = 0.0  # (its K sequence reads nothing but the request: neither does where the draft stops)
    replays = True

    def __init__(self, k_max: int, costs: CostModel | None = None, steps: int = 1, sampled: bool = True):
        self.k = k_max
        self.sampled = sampled  # (CostModel.alpha_of: the coordinator gives it to sampled requests)
        self.next = max(1, k_max // 2)
        self.costs = costs  # fed (for the other requests' AdaptiveK), never read
        self.steps = steps

    def choose(self, remaining: int) -> int:
        return max(0, min(self.next, self.k, remaining - 1))

    def decode_steps(self, remaining: int) -> int:
        return max(1, min(self.steps, remaining))

    def observe(self, r: Round, wall_ms: float) -> None:
        if self.costs is not None:
            self.costs.observe(r, wall_ms, sampled=self.sampled)
        if r.proposed:
            self.next = min(self.k, self.next + 2) if r.accepted == r.proposed else max(1, self.next - 1)


class AdaptiveK:
    """K per round for one request, from its acceptance and the shared CostModel."""

    adaptive = True
    replays = False  # its K follows timings and load
    PRIOR_WEIGHT = 16.0  # the coordinator-wide alpha counts as this many draft tokens
    DECAY = 0.98        # per round: old acceptance counts fade (round-to-round acceptance is mostly noise)
    PROBE_EVERY = 8     # after this many rounds without drafting, draft one token to re-measure...
    PROBE_MAX = 64      # ...and twice as many after each probe that changed nothing, up to this

    def __init__(self, costs: CostModel, k_max: int, steps: int = 1, lookup: int = 0, prompt: list[int] = (),
                 sampled: bool = False):
        """lookup: the tokens a pass of a round that drafts nothing also verifies from the target's
        copies of the context (VerifyCall.lookup; 0: none), `prompt` the context they start from;
        sampled: whether the request samples (its acceptance's prior: CostModel.alpha_of)."""
        self.costs = costs
        self.sampled = sampled
        self.k = k_max
        self.steps = steps  # the most tokens a K = 0 round asks the target for
        self.accepted = 0.0
        self.tried = 0.0
        self.batch = 1.0
        self.draft_batch = 1.0
        self.idle = 0
        self.wait = self.PROBE_EVERY  # rounds without drafting before the next probe
        self.stop_below = 0.0  # the round's: see stop_for
        # what those copies would bring, in calls of as many tokens as rounds that draft nothing ask for
        self.copies = CopyYield(list(prompt), lookup, costs.decode_steps(steps)) if lookup > 0 else None
        self.seen = 0  # rounds of this request observed

    @property
    def alpha(self) -> float:
        w = self.PRIOR_WEIGHT
        return (self.accepted + w * self.costs.alpha_of(self.sampled)) / (self.tried + w)

    def decode_steps(self, remaining: int) -> int:
        return self.costs.decode_steps(min(self.steps, remaining))

    @property
    def step_yield(self) -> tuple[float, float]:
        """(tokens, rows) of a pass of this request's rounds that draft nothing: (1, 1), and more where
        the target's copies of the context are on and the text repeats it: its committed tokens replayed
        (CopyYield), whether its rounds drafted or not, the coordinator-wide figures counting as
        PRIOR_WEIGHT passes."""
        if self.copies is None:
            return 1.0, 1.0
        w, c = self.PRIOR_WEIGHT, self.copies
        return ((c.tokens + w * self.costs.step_yield) / (c.passes + w),
                (c.rows + w * self.costs.step_rows) / (c.passes + w))

    def choose(self, remaining: int) -> int:
        top = max(0, min(self.k, remaining - 1))
        alpha = min(self.alpha, 0.999)
        pipelined = self.costs.in_flight > 1
        # several in flight: a K = 0 call shares its pass with others' verifications and gets one
        # token (TargetEngine), so its overhead is not shared; and the batch its next pass will share
        # is what passes hold lately, not its own last one, which is 1 whenever its verify ran out of
        # step with the others' decode steps; read alone, a request that drafted once finds its
        # verify alone, prices decoding as a whole pass for one token and drafts again (8 streams,
        # the EAGLE head on 2 cores: 115 of the 117 choices under load that read a batch of 1
        # drafted, 23 of the other 692)
        steps = 1 if pipelined else self.decode_steps(remaining)
        batch = max(self.batch, self.costs.batch) if pipelined else self.batch
        step_yield = self.step_yield if steps > 1 else (1.0, 1.0)  # (a call of one token copies nothing)
        shape = self.costs.shape(top + 1) if top else None  # (at top 0 the only choice is 0)
        best = max(range(top + 1), key=lambda k: expected_tokens(alpha, k, shape)
                   / self.costs.round_cost(k, batch, self.draft_batch, pipelined, steps, step_yield))
        if best == 0 and top > 0 and not pipelined:
            # alone: the coordinator's rounds since any request drafted or probed, against a wait that
            # doubles with each probe that changed nothing, whatever request it was in: the acceptance
            # probes re-measure is mostly the coordinator's (a request's own counts weigh little against
            # PRIOR_WEIGHT), and each request waiting PROBE_EVERY of its own rounds afresh had every
            # request probe once or twice (the EAGLE head, int4 target, 16 requests of 128 tokens: 16
            # probes, each a draft call taking in the rows since the last and a verify of 1.6 tokens)
            # (not in its first round, which a draft that reads the target's features cannot draft in).
            # Each kind (greedy, sampled) its own: a probe measures its kind's acceptance only (alpha_of)
            costs, kind = self.costs, self.costs.modes[self.sampled]
            if self.seen and costs.rounds - kind.drafted_at >= kind.probe_wait:
                best = 1
                kind.drafted_at = costs.rounds
                kind.probe_wait = min(2 * kind.probe_wait, self.PROBE_MAX)
        elif best == 0 and top > 0:
            self.idle += 1
            if self.idle >= self.wait:
                # a probe round costs a multi-row verify and a draft call (SmolLM2 fp32: ~1.5x a
                # plain step): where probes keep finding the draft not worth it, probe less often.
                # Not where another request drafted within as many of the coordinator's rounds as this
                # one's wait is of its own: the acceptance they share is current. Under load a probe's
                # draft call comes back after the target's next pass has started and costs its session
                # that pass: every request probing on its own, the coordinator probed in_flight times
                # as often as one request alone (EAGLE head, 2 cores, 8 streams at K ~ 0: spec 0.94x
                # no spec, batches of 6.8 sessions against 7.25)
                kind = self.costs.modes[self.sampled]  # (the acceptance they share is their kind's)
                shared = pipelined and self.costs.rounds - kind.drafted_at < self.wait * self.costs.in_flight
                self.idle = 0
                self.wait = min(2 * self.wait, self.PROBE_MAX)
                if not shared:
                    best = 1
                    kind.drafted_at = self.costs.rounds
        else:
            self.idle = 0
            if best > 0:
                self.wait = self.costs.modes[self.sampled].probe_wait = self.PROBE_EVERY
        self.stop_below = self.stop_for(best, alpha, batch, pipelined, shape) if best else 0.0
        return best

    def stop_for(self, k: int, alpha: float, batch: float, pipelined: bool, shape: list[float] | None = None) -> float:
        """The draft's top probability below which a token is not worth drafting in a round of k:
        one more drafted token costs what the cost model adds for it (a draft step, a verified row
        past the free ones), and brings at most its probability of acceptance (a greedy draft's
        top probability; less where an earlier token is rejected) times what a token costs in
        this round. So the draft stops at a token whose probability is under cost / worth: where
        verifying is cheap (float32 on CPU: its rows come free) it drafts nearly everything, where
        each row costs (int4 on CPU, a batch bound by arithmetic) it stops at the tokens that
        would mostly be rejected. (The EAGLE head at K = 4, int4 target, one process: a stop at
        0.3 proposed 1.55 tokens a round instead of 3.7, for 1.77 tokens a round instead of 1.99,
        and ran 1.2-1.3x faster; at 0.2 against float32, 0.8-0.9x: there the rows cost nothing.)"""
        if self.costs.draft.costs_nothing:
            return 0.0  # a draft that costs nothing (n-gram copies, q = 1): it stops where no copy goes on
        cost = lambda n: self.costs.round_cost(n, batch, self.draft_batch, pipelined)  # noqa: E731
        per_token = cost(k) / expected_tokens(alpha, k, shape)
        return min(STOP_MAX, max(0.0, (cost(k + 1) - cost(k)) / per_token)) if per_token > 0 else 0.0

    def observe(self, r: Round, wall_ms: float) -> None:
        # a draft that stopped short at a token too unsure to draft brought no more tokens than one
        # rejected there: counted as such, the acceptance stays a rate per token asked for, which
        # is what expected_tokens and round_cost price (counted as nothing, the stop raised it,
        # and drafting looked better than it ran: the EAGLE head with the int4 target drafted at
        # mean K 1.04 and made 0.73x of the target alone, acceptance 0.54, alpha 0.66)
        stopped = self.stop_below > 0 and r.proposed < r.asked
        self.costs.observe(r, wall_ms, stopped, self.sampled)
        self.seen += 1
        self.batch = max(1.0, r.target.batch_size)
        if r.asked:
            self.draft_batch = max(1.0, r.draft.batch_size)
        if self.copies is not None:
            c = self.copies
            tokens, passes, rows = c.tokens, c.passes, c.rows
            c.add(r.tokens)
            if c.passes > passes:  # the coordinator-wide figures: a new request's prior
                costs = self.costs
                costs.step_yield += EMA * ((c.tokens - tokens) / (c.passes - passes) - costs.step_yield)
                costs.step_rows += EMA * ((c.rows - rows) / (c.passes - passes) - costs.step_rows)
        if r.proposed or stopped:
            self.accepted = self.DECAY * self.accepted + r.accepted
            self.tried = self.DECAY * self.tried + r.accepted + (r.accepted < r.proposed or stopped)
