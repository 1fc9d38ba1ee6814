"""Passkey retrieval through the cache: one prefill per haystack, one fork per question.

A needle counts as retrieved when greedy decoding after its question would
produce the key: the answer tokens are fed teacher-forced and every one must
be the argmax of the distribution before it (for greedy decoding this is the
same condition, without the decode loop).
"""

from __future__ import annotations

from kvq.eval.data import Haystack
from kvq.eval.session import CacheSession


def run_haystack(session: CacheSession, hay: Haystack, chunk: int) -> list[dict]:
    """-> one result per needle: {depth, name, key, correct, predicted (token ids)}."""
    return run_haystacks(session, [hay], chunk)[0]


def run_haystacks(session: CacheSession, hays: list[Haystack], chunk: int) -> list[list[dict]]:
    """Haystacks side by side: their prefills share every step (:meth:`CacheSession.prefill_many`),
    then every question of every haystack is asked in one step, each on a fork of its haystack;
    -> per haystack one result per needle (as :func:`run_haystack`)."""
    parents = [("hay", h.bin, h.trial, k) for k, h in enumerate(hays)]
    asked: list = []
    try:
        session.prefill_many([(p, h.token_ids, ()) for p, h in zip(parents, hays)], chunk)
        parts = []
        for p, h in zip(parents, hays):
            for i, needle in enumerate(h.needles):
                child = (*p, "question", i)
                session.bm.fork(p, child)
                asked.append(child)
                q, a = list(needle.question_ids), list(needle.answer_ids)
                parts.append((child, q + a, tuple(range(len(q) - 1, len(q) + len(a) - 1))))  # rows predicting a
        logits = session.step(parts)
    finally:
        for sid in asked + parents:
            if sid in session.bm:
                session.free(sid)
    out, it = [], iter(logits)
    for h in hays:
        res = []
        for needle in h.needles:
            pred = next(it).argmax(-1).tolist()
            a = list(needle.answer_ids)
            res.append({"depth": needle.depth, "name": needle.name, "key": needle.key,
                        "correct": pred == a, "predicted": pred})
        out.append(res)
    return out


def accuracy_by_depth(results: list[dict]) -> dict[str, float]:
    """{depth: share of needles at that depth retrieved} over every trial given."""
    by: dict[float, list[bool]] = {}
    for r in results:
        by.setdefault(r["depth"], []).append(bool(r["correct"]))
    return {f"{d:g}": sum(v) / len(v) for d, v in sorted(by.items())}
