"""What the engine hands back per request and step (vLLM's shapes: a RequestOutput holding CompletionOutputs)."""

from __future__ import annotations

from dataclasses import dataclass, field


@dataclass
class CompletionOutput:
    index: int
    text: str
    token_ids: list[int]
    finish_reason: str | None
    stop_reason: str | int | None = None
    logprobs: list[dict] | None = None


@dataclass
class RequestOutput:
    request_id: int
    prompt: str | None
    prompt_token_ids: tuple[int, ...]  # shared by every output of the request (not copied per step)
    outputs: list[CompletionOutput]
    finished: bool
    metrics: dict = field(default_factory=dict)
    error: str | None = None  # the request failed (a KV transfer without fallback): finish_reason "abort"
    kv_transfer: object | None = None  # what a KV connector carries for the request (a prefill engine's export)
    # SamplingParams.prompt_logprobs: one entry per prompt token, None for the first, then
    # {"token_id", "logprob", "top": [(id, logprob), ...k]} (kvq.engine.prompt_logprobs); else None
    prompt_logprobs: list[dict | None] | None = None
