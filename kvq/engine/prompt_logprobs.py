"""Prompt logprobs (``SamplingParams.prompt_logprobs = k``): the logprob of each prompt token given
the tokens before it, and the top k tokens at each position -- the engine side of OpenAI ``echo`` with
``logprobs`` (what a loglikelihood evaluation reads).  vLLM's ``prompt_logprobs`` in shape and meaning.

Where the numbers come from, per step::

    scheduler  a scored prompt's chunk [start, start + n) gets ``prompt_rows``: the offsets of its
               positions p < P - 1 (P prompt tokens; the logits at P - 1 sample the first output)
    runner     logits [R + Q, V] (the model's dtype): the R sampling rows (``logit_rows``), then the Q prompt rows
    engine     logits[:R] -> the sampler (it never sees a prompt row); logits[R:] -> :func:`score`:
               log_softmax, the logprob of the token at p + 1, the top k; enqueued on the device and
               copied to the host beside the sampled ids (pinned, the same event: no extra sync)
    complete   :meth:`PromptLogprobs.record`: one entry per position, kept once

A scored request never reuses cached prefix blocks or a prefill peer's KV (the scheduler admits it with
``use_cache=False``), so every position runs and is scored.  Chunked prefill scores each chunk's rows
in its step.  A preemption by recompute in the middle of the prompt scores the recomputed chunks again:
the first entry of a position is kept.  Once the first output token exists the whole prompt has been
scored, and a recompute after that scores nothing.

Output (``RequestOutput.prompt_logprobs``): one entry per prompt token, None for the first, then
``{"token_id": t, "logprob": lp, "top": [(id, lp), ...k]}`` -- the shape of the per-output-token
``CompletionOutput.logprobs`` entries -- on every output of the request (they come after the prompt).
"""

from __future__ import annotations

from dataclasses import dataclass

import torch

ROWS_PER_PASS = 512  # log_softmax over at most this many rows at once: bounds the [rows, V] temporary


@dataclass(frozen=True)
class PromptRows:
    """A step's prompt rows, in the order the runner returns them (host data only).

    seq_ids    per row: the request it scores
    positions  per row: the scored position p; its target is the prompt token at p + 1
    targets    per row: that token's id
    k          top logprobs per row: the largest ``prompt_logprobs`` of the step (a row of a request
               that asked for fewer reads its first ones)
    """

    seq_ids: tuple[int, ...]
    positions: tuple[int, ...]
    targets: tuple[int, ...]
    k: int

    @classmethod
    def of(cls, sched, seqs: dict) -> PromptRows | None:
        """The rows of ``sched``'s items' ``prompt_rows`` (None when it has none)."""
        sids, pos, targets, k = [], [], [], 0
        for item in sched.scheduled:
            if not item.prompt_rows:
                continue
            seq = seqs[item.seq_id]
            prompt = seq.prompt_token_ids
            for off in item.prompt_rows:
                p = item.start + off
                sids.append(item.seq_id)
                pos.append(p)
                targets.append(prompt[p + 1])
            k = max(k, seq.params.prompt_logprobs)
        if not sids:
            return None
        return cls(tuple(sids), tuple(pos), tuple(targets), k)


def score(logits: torch.Tensor, rows: PromptRows) -> list[torch.Tensor]:
    """logits [Q, V] of ``rows`` -> [target logprobs [Q] float32] (+ [top logprobs [Q, k] float32, top
    ids [Q, k] int64] when k > 0): raw logprobs, log_softmax in float32 of the logits as given (no
    temperature), like the sampler's.  Device work only: the targets go up in one non-blocking copy."""
    assert logits.dim() == 2 and logits.shape[0] == len(rows.targets), (logits.shape, len(rows.targets))
    host = torch.tensor(rows.targets, dtype=torch.int64)
    if logits.device.type == "cuda":
        targets = host.pin_memory().to(logits.device, non_blocking=True)
    else:
        targets = host.to(logits.device)
    chosen, tops, ids = [], [], []
    for a in range(0, logits.shape[0], ROWS_PER_PASS):
        lp = logits[a:a + ROWS_PER_PASS].float().log_softmax(dim=-1)
        chosen.append(lp.gather(1, targets[a:a + ROWS_PER_PASS, None])[:, 0])
        if rows.k:
            t, i = lp.topk(rows.k, dim=-1)
            tops.append(t)
            ids.append(i)
    out = [torch.cat(chosen)]
    if rows.k:
        out += [torch.cat(tops), torch.cat(ids)]
    return out


class PromptLogprobs:
    """The prompt logprobs of the engine's requests that asked for them, by request id."""

    def __init__(self) -> None:
        self._lists: dict[int, list[dict | None]] = {}

    def add(self, seq) -> None:
        """Start a request's list (a scored one: ``params.prompt_logprobs`` is not None)."""
        if seq.params.prompt_logprobs is not None:
            self._lists[seq.seq_id] = [None] * seq.num_prompt_tokens

    def record(self, rows: PromptRows, host: list[torch.Tensor], seqs: dict) -> None:
        """Store a step's scores (``host``: :func:`score`'s tensors, on the host and complete).  A row
        of a request that is gone (finished, aborted) or a position already held is skipped."""
        chosen = host[0].tolist()
        tops, ids = (host[1].tolist(), host[2].tolist()) if rows.k else (None, None)
        for i, (sid, p, t) in enumerate(zip(rows.seq_ids, rows.positions, rows.targets)):
            entries = self._lists.get(sid)
            if entries is None or entries[p + 1] is not None:
                continue
            k = seqs[sid].params.prompt_logprobs
            top = list(zip(ids[i][:k], tops[i][:k])) if k else []
            entries[p + 1] = {"token_id": t, "logprob": chosen[i], "top": top}

    def get(self, seq_id: int) -> list[dict | None] | None:
        """A request's list (shared by its outputs: complete once its prompt has run), or None."""
        return self._lists.get(seq_id)

    def forget(self, seq_id: int) -> None:
        self._lists.pop(seq_id, None)
