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
    parent = ("hay", hay.bin, hay.trial)
    session.prefill(parent, hay.token_ids, chunk)
    out = []
    try:
        for i, needle in enumerate(hay.needles):
            child = ("question", hay.bin, hay.trial, i)
            session.bm.fork(parent, child)
            try:
                q, a = list(needle.question_ids), list(needle.answer_ids)
                rows = range(len(q) - 1, len(q) + len(a) - 1)  # positions predicting each answer token
                logits = session.append(child, q + a, rows=list(rows))
            finally:
                session.free(child)
            pred = logits.argmax(-1).tolist()
            out.append({"depth": needle.depth, "name": needle.name, "key": needle.key,
                        "correct": pred == a, "predicted": pred})
    finally:
        session.free(parent)
    return out


def accuracy_by_depth(results: list[dict]) -> dict[str, float]:
    """{depth: share of needles at that depth retrieved} over every trial given."""
    by: dict[float, list[bool]] = {}
    for r in results:
        by.setdefault(r["depth"], []).append(bool(r["correct"]))
    return {f"{d:g}": sum(v) / len(v) for d, v in sorted(by.items())}
