"""Claims: with several gateways, an atomic reserve at placement where a replica is nearly full.

Each gateway places requests on a view of the others' load that is a sync period and a round
trip old (`bouncer.core.sharing.peers`). Two gateways may each find the last room on one replica and
both send there: together they overfill it, and its engine queues or preempts what they sent.
So a dispatch that leaves its replica with less than `CLAIM_BELOW` of its KV blocks free is
claimed first, in one atomic call on the state the gateways share (the gateway's Redis, or the
simulator's store): the claim holds if the blocks the other gateways hold there now exceed what
this gateway's view counted by no more than the room the placement left beyond the request
(`holds`), and the request's blocks then count as this gateway's at once. When it fails, the
request goes back to the head of its queue (`AdmissionCore.unclaimed`) with the replica counted
as full as the others now hold it, until the next sync.

Far from full no claim is made: the round trip would buy nothing, and a gateway's requests pay
it only while a replica is near its limit. What each gateway holds on a replica is written in
full at every sync and expires with its lease, so a killed gateway's claims are gone within
`lease_s` and no claim outlives the request it was for by more than a sync period.
"""

from __future__ import annotations

import dataclasses

from bouncer.core.fleet.blocks import num_blocks
from bouncer.core.fleet.replica import ReplicaState
from bouncer.core.outcomes import Claim
from bouncer.core.requests import Admission

CLAIM_BELOW = 0.25  # of a replica's KV blocks: a dispatch leaving less free than this is claimed


def claim_for(adm: Admission, replica: ReplicaState, cached: int, usage: float, threshold: float) -> Claim | None:
    """The claim a dispatch of `adm` to `replica` makes (None: none needed), `cached` of its
    prompt tokens held there and `usage` its KV usage before it, in this gateway's view, whose
    placement fills a replica to `threshold` (its band's `placement.kv_limit`) at most."""
    cap = replica.capacity_blocks
    if not cap:
        return None  # no KV size known: the placement did not count blocks either
    output = 0 if replica.role == "prefill" else adm.expected_output
    need = num_blocks(adm.info.prompt_tokens - cached + output, replica.block_size)  # as `placement.room`
    slack = int(threshold * cap - usage * cap) - need
    if slack >= CLAIM_BELOW * cap:
        return None
    return Claim(adm.blocks, replica.peers.blocks, max(0, slack))


def holds(claim: Claim, others_now: int) -> bool:
    """Whether a claim holds, the other gateways holding `others_now` blocks on its replica at
    the moment it is made (the shared state's scripts apply the same rule)."""
    return others_now - claim.others_seen <= claim.slack


def count_others(replica: ReplicaState, others_blocks: int, now: float) -> None:
    """A claim on `replica` failed: the other gateways hold `others_blocks` there, sent since this
    gateway's view of them, so in no sample it has. Counted as theirs, and as sent recently
    (what the KV usage it projects adds), until the next sync brings their parts; and the
    replica is not idle (an idle one takes any one request)."""
    peers = replica.peers
    added = others_blocks - peers.blocks
    if added > 0:
        replica.set_peers(dataclasses.replace(peers, requests=max(1, peers.requests), blocks=others_blocks,
                                              recent_blocks=peers.recent_blocks + added), now)
