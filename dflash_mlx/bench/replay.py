"""Block policies replayed over recorded acceptance: auto against fixed blocks
without the machine's timing noise.

A greedy generation's tokens are fixed; so is what the draft proposes after
any prefix of them. ``acceptance_table`` records, for every position of a
reply, how many drafts a cycle would accept there at every block size.
``replay`` then runs any ``BlockPolicy`` over that table exactly as the
decoder drives it (a choice before each cycle, the outcome after it, a probe
beside a plain step judged against the next tokens) and prices each cycle on
a cost curve, so two policies compare on the same tokens and the same prices.
What the replay leaves out is only the gap between the curve and the cycles'
real cost; ``dflash-mlx bench`` measures both together.
"""

from dataclasses import dataclass

import mlx.core as mx

from ..loop import BlockSampler, SamplingParams, propose_block, proposer_for


def acceptance_table(target, draft, prompt: list[int], reply: list[int]) -> list[list[int]]:
    """Row i: drafts accepted at blocks 2 .. the draft's trained size when a
    cycle starts from ``reply[i]`` (the context holding the prompt and the
    reply before it), greedy. The target's features come from one pass over
    the whole sequence; the draft's context grows one position per row."""
    sequence = list(prompt) + list(reply)
    layer_ids = draft.config.target_layer_ids
    features = target.forward(mx.array(sequence[:-1])[None], target.make_cache(), layer_ids).features
    proposer = proposer_for(draft, target)
    start = len(prompt)
    proposer.observe(features[:, :start], mx.array(sequence[:start]))
    sampler = BlockSampler(SamplingParams())
    table = []
    for p in range(start, len(sequence)):
        if p > start:
            proposer.observe(features[:, p - 1 : p], mx.array(sequence[p - 1 : p]))
        row = []
        for b in range(2, draft.config.block_size + 1):
            drafted = propose_block(proposer, mx.array(sequence[p : p + 1]), b, sampler)[0].tolist()
            truth = sequence[p + 1 : p + b]
            row.append(next((i for i, (d, t) in enumerate(zip(drafted, truth)) if d != t), len(truth)))
        table.append(row)
    return table


@dataclass
class Replayed:
    tokens: int  # generated, the prefill's first included
    seconds: float  # the cycles' and probes' prices summed (no prefill)
    blocks: list[int]  # each cycle's block (1: a plain step)
    accepted: list[int]  # drafts each cycle accepted
    probes: list[int]  # each probe's block, in order


@dataclass
class _Probe:
    block: int
    hits: list[float]
    judged_at: int  # the row whose token completes its judgement


def replay(table: list[list[int]], prompt_tokens: int, policy, costs, max_tokens: int) -> Replayed:
    """``policy`` (a fresh ``FixedBlock`` or ``AdaptiveBlock``) over the reply
    whose ``acceptance_table`` is ``table``, for ``max_tokens`` tokens or as
    many as the table has, in the decoder's order (``loop/decoder.py``): the
    next block is chosen once a cycle's outcome is known; a probe is drafted
    from the token a plain step just made, while no other is in flight, and
    judged by the plain steps after it, its hits reaching the policy with the
    token that ends them (one drafted before speculation resumed still
    counts, later ones are not drafted). Each cycle is priced by ``costs``
    (``cycle_seconds``) at the context it was chosen at, each probe by its
    ``draft`` pass."""
    limit = min(max_tokens, len(table))
    out = Replayed(1, 0.0, [], [], [])
    probe = None

    def queue_next() -> int:
        nonlocal probe
        row, left = out.tokens - 1, limit - out.tokens
        b = max(1, min(policy.choose(prompt_tokens + row, left), left))
        out.seconds += costs.cycle_seconds(b, prompt_tokens + row)
        if b > 1:
            probe = None
        elif probe is None and hasattr(policy, "probe"):
            due = policy.probe()
            if due > 1:
                a = table[row][due - 2]
                probe = _Probe(due, ([1.0] * a + [0.0])[: due - 1], row + min(a + 1, due - 1))
                out.seconds += costs.draft(due, prompt_tokens + row)
                out.probes.append(due)
        return b

    b = queue_next()
    while out.tokens < limit:
        row = out.tokens - 1
        a = 0 if b == 1 else table[row][b - 2]
        policy.update(b, a)
        out.tokens += a + 1
        out.blocks.append(b)
        out.accepted.append(a)
        inflight = probe if b == 1 else None
        if out.tokens < limit:
            b = queue_next()
        if inflight is not None and inflight.judged_at == out.tokens - 1:
            policy.probed(inflight.block, inflight.hits)
            probe = None if probe is inflight else probe
    return out


def hindsight(table: list[list[int]], prompt_tokens: int, costs, max_tokens: int) -> Replayed:
    """The fastest blocks for the reply whose ``acceptance_table`` is
    ``table``, chosen knowing every cycle's outcome in advance: the ceiling no
    block policy passes on these prices. Dynamic programming over the tokens
    made: from each count, the block whose cycle plus the fastest rest is
    cheapest (a plain step on a tie), capped at the tokens left as the decoder
    caps it; priced as ``replay`` prices (no probes: nothing is left to learn)."""
    limit = min(max_tokens, len(table))
    widest = len(table[0]) + 1 if table else 1
    rest = [0.0] * (limit + 1)  # seconds from ``made`` tokens to ``limit``
    choice = [1] * (limit + 1)
    for made in range(limit - 1, 0, -1):
        row = made - 1
        for b in range(1, min(widest, limit - made) + 1):
            a = 0 if b == 1 else table[row][b - 2]
            seconds = costs.cycle_seconds(b, prompt_tokens + row) + rest[made + a + 1]
            if b == 1 or seconds < rest[made]:
                rest[made], choice[made] = seconds, b
    out = Replayed(1, rest[1] if limit > 1 else 0.0, [], [], [])
    while out.tokens < limit:
        b = choice[out.tokens]
        a = 0 if b == 1 else table[out.tokens - 1][b - 2]
        out.blocks.append(b)
        out.accepted.append(a)
        out.tokens += a + 1
    return out
