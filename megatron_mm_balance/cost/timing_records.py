"""What the fits read from a job's per-pack timing records, shared by the online
calibration (:mod:`.calibration`) and the replay (:mod:`.replay`): the acceptance
thresholds of a vision fit and each micro-step's language compute.

A record (:mod:`megatron_mm_balance.megatron.timing`): ``iteration``, ``microbatch``,
``rank``, ``images`` (per-image tokens), ``lengths`` (per-sample), the four phases'
milliseconds and, optionally, ``start_s`` / ``end_s`` on the rank's clock.
"""
from __future__ import annotations

from typing import List, Sequence

#: Fewest records with images a vision fit accepts.
MIN_RECORDS = 8
#: Lowest R^2 of the vision fit that is accepted (below: image tokens stay the cost).
R2_FLOOR = 0.5


def language_compute_records(records: Sequence[dict]) -> List[dict]:
    """One record per micro-step: the rank that reached the language model last.

    Under expert parallelism the ranks meet in every MoE layer, so a rank's measured
    language time includes waiting for the others at the first all-to-all. The rank
    that arrived last waited least, and its time is the compute. A rank arrives after
    its vision backward of the previous micro-step, the host gap before this
    micro-batch (``start_s`` - previous ``end_s``) and its vision forward. Records are
    grouped by ``(iteration, microbatch)``; ties go to the lowest rank."""
    prev = {}
    for r in sorted(records, key=lambda r: (r["rank"], r["iteration"], r["microbatch"])):
        prev[(r["rank"], r["iteration"], r["microbatch"])] = r

    def arrival(r):
        before = prev.get((r["rank"], r["iteration"], r["microbatch"] - 1))
        t = float(r["vision_forward_ms"])
        if before is not None:
            t += float(before["vision_backward_ms"])
            if "start_s" in r and "end_s" in before:
                t += max(0.0, (r["start_s"] - before["end_s"]) * 1e3)
        return t

    best = {}
    for r in records:
        key = (r["iteration"], r["microbatch"])
        cur = best.get(key)
        if cur is None or (-arrival(r), r["rank"]) < (-arrival(cur), cur["rank"]):
            best[key] = r
    return [best[k] for k in sorted(best)]
