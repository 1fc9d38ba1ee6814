"""The OpenAI wire format: request models, error bodies, response objects.

Strictness.  The generation endpoints validate the whole body: a field that
is neither OpenAI's nor one of kvq's extensions is a 400 naming it, and so is
an OpenAI field kvq does not implement (``tools``, ``logit_bias``, ...): a client
never believes a setting was honoured when it was dropped.  Logprobs are served:
``logprobs: k`` and ``echo`` on completions (``echo`` with ``logprobs`` scores the
prompt: lm-evaluation-harness's loglikelihood path; ``max_tokens: 0`` with ``echo``
returns the prompt alone, the older harnesses' call), ``logprobs: true`` and
``top_logprobs: k`` on chat; ``k`` at most the server's ``--max-logprobs``
(:meth:`_GenerationRequest.check`, called by admission.py; never over ``MAX_LOGPROBS``,
the engine's limit).  They are raw: log_softmax of the
model's logits before temperature and top-k/top-p (vLLM's default).  Types are strict
(``"0.5"`` is not a number).  Extensions, vLLM's names: ``top_k``,
``ignore_eos``, ``stop_token_ids``, ``return_token_ids`` (token ids in each
choice, and a stream chunk for every token even where the text has not grown).

Bounds checked here, while parsing (the stop checks run on the engine thread
every step, so their size is bounded): at most ``MAX_STOP_STRINGS`` stop
strings of at most ``MAX_STOP_CHARS`` characters, at most
``MAX_STOP_TOKEN_IDS`` stop token ids.  Limits that depend on the server
(``n``, prompt length, body size) are kvq/server/admission.py's and app.py's.

Errors use OpenAI's body ``{"error": {"message", "type", "param", "code"}}``.
"""

from __future__ import annotations

import time
import uuid
from typing import Literal

from pydantic import BaseModel, ConfigDict, Field, StrictInt, StrictStr, ValidationError, field_validator

# OpenAI request fields that kvq does not implement: named in the 400 instead of "unknown field"
UNSUPPORTED = frozenset({
    "logit_bias", "suffix", "best_of", "tools", "tool_choice",
    "functions", "function_call", "response_format", "parallel_tool_calls", "audio", "modalities",
    "prediction", "reasoning_effort", "service_tier", "store", "metadata", "web_search_options",
})


MAX_STOP_STRINGS = 16
MAX_STOP_CHARS = 256
MAX_STOP_TOKEN_IDS = 256


class ApiError(Exception):
    """An error with its HTTP status and OpenAI error fields."""

    def __init__(self, status: int, message: str, *, type: str = "invalid_request_error",
                 param: str | None = None, code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type, param, code

    def body(self) -> dict:
        return error_body(self.message, self.type, self.param, self.code)


def error_body(message: str, type: str, param: str | None = None, code: str | None = None) -> dict:
    return {"error": {"message": message, "type": type, "param": param, "code": code}}


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", strict=True)


class StreamOptions(_Strict):
    include_usage: bool = False


class _GenerationRequest(_Strict):
    model: StrictStr | None = None  # None: the first served name
    max_tokens: StrictInt | None = Field(None, ge=1)
    temperature: float = Field(1.0, ge=0)
    top_p: float = Field(1.0, gt=0, le=1)
    n: StrictInt = Field(1, ge=1)
    stream: bool = False
    stream_options: StreamOptions | None = None
    stop: StrictStr | list[StrictStr] | None = None
    seed: StrictInt | None = None
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    user: StrictStr | None = None  # accepted, unused (OpenAI: end-user id for abuse tracking)
    # vLLM extensions
    top_k: StrictInt = Field(0, ge=-1)
    ignore_eos: bool = False
    stop_token_ids: list[StrictInt] | None = None
    return_token_ids: bool = False

    @field_validator("presence_penalty", "frequency_penalty")
    @classmethod
    def _no_penalties(cls, v: float) -> float:
        if v != 0:
            raise ValueError("penalties are not supported by kvq; valid value: 0")
        return v

    @field_validator("stop")
    @classmethod
    def _stop_strings(cls, v):
        stops = [] if v is None else [v] if isinstance(v, str) else v
        if len(stops) > MAX_STOP_STRINGS:
            raise ValueError(f"{len(stops)} stop strings; at most {MAX_STOP_STRINGS} are allowed")
        if any(not s for s in stops):
            raise ValueError("stop strings must be non-empty")
        if any(len(s) > MAX_STOP_CHARS for s in stops):
            raise ValueError(f"a stop string is {max(map(len, stops))} characters; at most {MAX_STOP_CHARS} "
                             "are allowed")
        return v

    @field_validator("stop_token_ids")
    @classmethod
    def _stop_token_ids(cls, v):
        if v is not None and len(v) > MAX_STOP_TOKEN_IDS:
            raise ValueError(f"{len(v)} stop_token_ids; at most {MAX_STOP_TOKEN_IDS} are allowed")
        return v

    def sampling(self, max_tokens: int, seed_offset: int = 0) -> dict:
        """Keywords of :class:`~kvq.engine.sampling_params.SamplingParams` for one of the ``n`` samples.
        ``max_tokens`` 0 (:attr:`scores_only`) asks the engine for one token, which the server drops."""
        stop = () if self.stop is None else (self.stop,) if isinstance(self.stop, str) else tuple(self.stop)
        return {"max_tokens": max(max_tokens, 1), "temperature": self.temperature, "top_p": self.top_p,
                "top_k": self.top_k, "seed": None if self.seed is None else self.seed + seed_offset,
                "stop": stop, "stop_token_ids": tuple(self.stop_token_ids or ()), "ignore_eos": self.ignore_eos,
                "logprobs": self.output_logprobs(), "prompt_logprobs": self.prompt_logprobs()}

    def check(self, max_logprobs: int) -> None:
        """What the field types cannot say: the server's ``--max-logprobs`` and fields that need each
        other (ApiError 400, naming the field)."""

    def output_logprobs(self) -> int | None:
        """Top alternatives per output token asked for, or None (no logprobs)."""
        return None

    def prompt_logprobs(self) -> int | None:
        """Top alternatives per prompt token asked for (completions' echo), or None."""
        return None

    @property
    def include_usage(self) -> bool:
        return self.stream_options is not None and self.stream_options.include_usage

    @property
    def scores_only(self) -> bool:
        """The request returns its prompt and no output token (completions' ``echo`` with ``max_tokens: 0``)."""
        return False


def _over_limit(param: str, k: int, max_logprobs: int) -> ApiError:
    return ApiError(400, f"{param} is {k}; this server returns at most {max_logprobs} logprobs per token "
                    f"(--max-logprobs {max_logprobs})", param=param, code="invalid_value")


class CompletionRequest(_GenerationRequest):
    prompt: StrictStr | list[StrictStr] | list[StrictInt] | list[list[StrictInt]]
    max_tokens: StrictInt | None = Field(None, ge=0)  # 0: with echo only (the prompt, scored, and no output)
    logprobs: StrictInt | None = Field(None, ge=0)  # top alternatives per token, at most --max-logprobs
    echo: bool = False  # the prompt before the completion (with logprobs: the prompt's logprobs too)

    def check(self, max_logprobs: int) -> None:
        if self.logprobs is not None and self.logprobs > max_logprobs:
            raise _over_limit("logprobs", self.logprobs, max_logprobs)
        if self.max_tokens == 0 and not self.echo:
            raise ApiError(400, "max_tokens is 0: that is served with echo: true only (the prompt, and with "
                           "logprobs its tokens' logprobs, without generating); otherwise give max_tokens >= 1",
                           param="max_tokens", code="invalid_value")

    @property
    def scores_only(self) -> bool:
        return self.echo and self.max_tokens == 0

    def output_logprobs(self) -> int | None:
        return self.logprobs

    def prompt_logprobs(self) -> int | None:
        return self.logprobs if self.echo else None

    def prompts(self) -> list[str | list[int]]:
        p = self.prompt
        if isinstance(p, str) and not p:
            raise ApiError(400, "prompt must not be empty", param="prompt", code="invalid_value")
        if isinstance(p, str) or (p and isinstance(p[0], int)):
            return [p]
        if not p:
            raise ApiError(400, "prompt must not be empty", param="prompt", code="invalid_value")
        for i, one in enumerate(p):
            if not one:
                raise ApiError(400, f"prompt[{i}] is empty", param="prompt", code="invalid_value")
        return list(p)


class TextPart(_Strict):
    type: Literal["text"]
    text: StrictStr


class ChatMessage(_Strict):
    role: Literal["system", "developer", "user", "assistant"]
    content: StrictStr | list[TextPart]
    name: StrictStr | None = None

    def template_dict(self) -> dict:
        text = self.content if isinstance(self.content, str) else "".join(p.text for p in self.content)
        return {"role": "system" if self.role == "developer" else self.role, "content": text}


class ChatCompletionRequest(_GenerationRequest):
    messages: list[ChatMessage] = Field(min_length=1)
    max_completion_tokens: StrictInt | None = Field(None, ge=1)
    logprobs: bool = False
    top_logprobs: StrictInt | None = Field(None, ge=0)  # at most --max-logprobs

    def check(self, max_logprobs: int) -> None:
        if self.top_logprobs is not None and not self.logprobs:
            raise ApiError(400, "top_logprobs needs logprobs: true", param="top_logprobs", code="invalid_value")
        if self.top_logprobs is not None and self.top_logprobs > max_logprobs:
            raise _over_limit("top_logprobs", self.top_logprobs, max_logprobs)

    def output_logprobs(self) -> int | None:
        return (self.top_logprobs or 0) if self.logprobs else None

    def output_limit(self) -> int | None:
        if self.max_tokens is not None and self.max_completion_tokens is not None \
                and self.max_tokens != self.max_completion_tokens:
            raise ApiError(400, "max_tokens and max_completion_tokens differ; give one of them",
                           param="max_completion_tokens", code="invalid_value")
        return self.max_completion_tokens or self.max_tokens


PROMPT_SHAPES = "a string, a list of strings, a list of token ids, or a list of token-id lists"


def parse_request(model: type[_GenerationRequest], body: bytes) -> _GenerationRequest:
    """Validate a JSON body; every failure is an :class:`ApiError` with status 400."""
    try:
        return model.model_validate_json(body)
    except ValidationError as e:
        raise _validation_error(model, e) from None


def _validation_error(model: type[BaseModel], e: ValidationError) -> ApiError:
    err = e.errors()[0]
    kind, loc = err["type"], [str(x) for x in err["loc"]]
    if kind == "json_invalid":
        return ApiError(400, f"malformed JSON body: {err['msg']}", code="json_invalid")
    if kind == "model_type" and not loc:
        return ApiError(400, "the body must be a JSON object", code="invalid_type")
    param = loc[0] if loc else None
    if kind == "extra_forbidden":
        field = ".".join(loc)
        if field in UNSUPPORTED:
            return ApiError(400, f"{field!r} is not supported by kvq", param=field, code="unsupported_parameter")
        valid = ", ".join(sorted(model.model_fields)) if len(loc) == 1 else None
        return ApiError(400, f"unknown field {field!r}" + (f"; valid fields: {valid}" if valid else ""),
                        param=field, code="unknown_parameter")
    if param == "prompt" and kind not in ("missing",):
        return ApiError(400, f"prompt must be {PROMPT_SHAPES}", param="prompt", code="invalid_type")
    path = ".".join(x for x in loc if not x.startswith(("list[", "str", "int")))
    msg = err["msg"].removeprefix("Value error, ")
    return ApiError(400, f"{path or 'body'}: {msg}", param=param, code="missing" if kind == "missing"
                    else "invalid_value")


# -- responses ----------------------------------------------------------------------------------
def new_id(prefix: str) -> str:
    return f"{prefix}-{uuid.uuid4().hex}"


def usage(prompt_tokens: int, completion_tokens: int) -> dict:
    return {"prompt_tokens": prompt_tokens, "completion_tokens": completion_tokens,
            "total_tokens": prompt_tokens + completion_tokens}


def response_head(rid: str, obj: str, model: str) -> dict:
    return {"id": rid, "object": obj, "created": int(time.time()), "model": model}


def _choice(index: int, finish_reason: str | None, token_ids: list[int] | None, logprobs: dict | None = None,
            **body) -> dict:
    c = {"index": index, **body, "logprobs": logprobs, "finish_reason": finish_reason}
    if token_ids is not None:  # the return_token_ids extension
        c["token_ids"] = token_ids
    return c


def completion_choice(index: int, text: str, finish_reason: str | None, token_ids: list[int] | None,
                      logprobs: dict | None = None) -> dict:
    return _choice(index, finish_reason, token_ids, logprobs, text=text)


def chat_choice(index: int, text: str, finish_reason: str | None, token_ids: list[int] | None,
                logprobs: dict | None = None) -> dict:
    return _choice(index, finish_reason, token_ids, logprobs, message={"role": "assistant", "content": text})


def chat_delta(index: int, delta: dict, finish_reason: str | None, token_ids: list[int] | None,
               logprobs: dict | None = None) -> dict:
    return _choice(index, finish_reason, token_ids, logprobs, delta=delta)


def safe_text_end(text: str, stop: tuple[str, ...], finished: bool) -> int:
    """How much of a growing output text may be streamed now.

    Held back until the request finishes: a trailing U+FFFD (bytes of a
    character still arriving) and the longest tail that could begin a stop
    string (the engine cuts the text where a stop string starts).
    """
    if finished:
        return len(text)
    end = len(text)
    while end and text[end - 1] == "\ufffd":
        end -= 1
    hold = 0
    for s in stop:
        for k in range(min(len(s) - 1, end), hold, -1):
            if text.endswith(s[:k], 0, end):
                hold = k
                break
    return end - hold
