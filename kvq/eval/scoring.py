"""One teacher-forced pass of real text through the cache, scored at every bin.

For bins ``L1 < L2 < ...`` one sequence grows through the text once::

    [0 ........................ c1-W)[c1-W .. c1)[c1 .. L1)(fork: greedy) ... [.. c2-W)[c2-W .. c2) ...
     context, chunks of `chunk`       scored      greedy continuation
                                      (W positions, block-sized chunks)

with ``c = L - greedy_span``: the W scored positions end at ``c`` and the greedy
continuation of ``greedy_tokens`` tokens (on a fork of the cache) fills
``[c, L)``, so nothing of bin ``L`` reads beyond position ``L``.  After the fork
is dropped the teacher-forced text continues from ``c``.  Scored tokens are fed
in block-sized chunks, as decode would feed them, so a format's recent window
holds what it would hold in decode (at most the window plus one chunk), not a
whole prefill chunk.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

from kvq.eval.metrics import log_softmax
from kvq.eval.session import CacheSession

SEQ = "text"


@dataclass(frozen=True)
class StreamSpec:
    bins: tuple[int, ...]  # ascending
    window: int  # scored positions per bin
    chunk: int  # prefill chunk (tokens)
    score_chunk: int  # chunk of scored tokens
    greedy_tokens: int  # greedy continuation length per bin

    def greedy_span(self, align: int) -> int:
        return -(-self.greedy_tokens // align) * align

    def tokens_needed(self, align: int) -> int:
        """Text tokens the pass reads (the last scored position's target included)."""
        return max(self.bins) - self.greedy_span(align) + 1

    def check(self, align: int) -> None:
        """ValueError when a bin cannot hold its scored window and greedy span on block boundaries."""
        g = self.greedy_span(align)
        for L in self.bins:
            if L % align:
                raise ValueError(f"bin {L} is not a multiple of the block size {align}")
            if L - g - self.window < align:
                raise ValueError(f"bin {L} is too short for {self.window} scored and {self.greedy_tokens} greedy "
                                 f"tokens (bins must be >= {self.window + g + align})")
        if self.window % align or self.score_chunk % align or self.chunk % align:
            raise ValueError(f"window, score chunk and chunk must be multiples of the block size {align}")


@dataclass
class BinScore:
    bin: int
    context: int  # c: the scored positions are [c - window, c)
    logprobs: torch.Tensor  # [window, V] float32
    targets: torch.Tensor  # [window] int64
    greedy: list[int]


def score_stream(session: CacheSession, ids: list[int], spec: StreamSpec, align: int,
                 progress=None) -> list[BinScore]:
    """:func:`score_streams` of one passage."""
    return score_streams(session, [ids], spec, align, progress)[0]


def score_streams(session: CacheSession, passages: list[list[int]], spec: StreamSpec, align: int,
                  progress=None) -> list[list[BinScore]]:
    """Run the pass over each passage, the passages side by side in every forward (one sequence
    each, in lockstep: they have the same bins), chunks aligned to ``align`` (a multiple of the
    cache's block size, the same for every format compared); each passage holds at least
    ``spec.tokens_needed(align)`` real tokens.  -> per passage its bins' scores."""
    if align % session.block_size:
        raise ValueError(f"alignment {align} is not a multiple of the block size {session.block_size}")
    spec.check(align)
    g = spec.greedy_span(align)
    for ids in passages:
        if len(ids) < spec.tokens_needed(align):
            raise ValueError(f"{len(ids)} text tokens, {spec.tokens_needed(align)} needed")
    seqs = [(SEQ, k) for k in range(len(passages))]
    out: list[list[BinScore]] = [[] for _ in passages]
    pos = 0

    def feed(end: int, size: int, scored: bool) -> list[list[torch.Tensor]]:
        nonlocal pos
        got: list[list[torch.Tensor]] = [[] for _ in passages]
        while pos < end:
            stop = min(pos + size, end)
            rows = tuple(range(stop - pos)) if scored else ()
            lgs = session.step([(sid, ids[pos:stop], rows) for sid, ids in zip(seqs, passages)])
            if scored:
                for mine, lg in zip(got, lgs):
                    mine.append(lg)
            if progress is not None:
                progress.update((stop - pos) * len(passages))
            pos = stop
        return got

    try:
        for L in spec.bins:
            c = L - g
            feed(c - spec.window, spec.chunk, scored=False)
            logits = [torch.cat(x) for x in feed(c, spec.score_chunk, scored=True)]
            greedy = (session.greedy_many([(sid, lg[-1], (*sid, "greedy")) for sid, lg in zip(seqs, logits)],
                                          spec.greedy_tokens) if spec.greedy_tokens else [[] for _ in passages])
            if progress is not None:
                progress.update(g * len(passages))
            for k, ids in enumerate(passages):
                out[k].append(BinScore(L, c, log_softmax(logits[k]), torch.tensor(ids[c - spec.window + 1:c + 1]),
                                       greedy[k]))
    finally:
        for sid in seqs:
            if sid in session.bm:
                session.free(sid)
    return out
