"""From a request body to engine work: every limit checked before the work is built, prompts
tokenized on a worker thread (never on the engine thread, whose stall would stall every stream).

Order, cheapest first; nothing proportional to ``n`` or to a prompt's length is built before
the check that bounds it::

    checks (the loop's default executor: a refusal never waits behind a tokenization)
      parse + field checks (400: stop strings, stop_token_ids, types)
      -> model served? (404 model_not_found)
      -> logprobs <= --max-logprobs, fields that need each other (400)
      -> n <= --max-n (400) -> prompts x n admissible (400 if never, 429 if not now, 503 if no engine)
      -> each prompt: token ids <= max_model_len, or text (chat: contents) bytes <= max_prompt_bytes (400)
    build (the one tokenizer worker thread)
      -> chat template -> tokenize -> tokens <= max_model_len (400) -> PromptSpecs

``max_prompt_bytes`` is ``max_model_len`` times the longest token of the vocabulary in bytes:
a text longer than that cannot tokenize to ``max_model_len`` tokens, so it is refused without
being tokenized.  Tokenizations run one at a time on their worker (the Rust tokenizer releases
the GIL while it works, so the event loop and the engine thread go on).
"""

from __future__ import annotations

import asyncio
from concurrent.futures import ThreadPoolExecutor

from kvq.server.async_engine import AsyncEngine, PromptSpec
from kvq.server.options import ServerOptions
from kvq.server.protocol import ApiError, ChatCompletionRequest, parse_request


def max_prompt_bytes(tokenizer, max_model_len: int) -> int | None:
    """An upper bound on the UTF-8 bytes of a text that fits in ``max_model_len`` tokens (None: no tokenizer).

    A token's vocabulary string is at least as long in UTF-8 as the text it stands for
    (byte-level BPE spells each byte as one character of 1-2 bytes; SentencePiece's "▁" is
    3 bytes for one space), so the bound is safe.
    """
    if tokenizer is None:
        return None
    longest = max((len(t.encode("utf-8")) for t in tokenizer.get_vocab()), default=0)
    return max_model_len * max(longest, 1)


class Admission:
    """Turns bodies into (request, model name, specs) on its worker thread."""

    def __init__(self, engine: AsyncEngine, served_model_names: list[str], options: ServerOptions):
        self.engine = engine
        self.names = list(served_model_names)
        self.max_n = options.max_n
        self.max_logprobs = options.max_logprobs
        self.max_model_len = engine.engine.max_model_len
        self.max_prompt_bytes = max_prompt_bytes(engine.engine.tokenizer, self.max_model_len)
        self._pool = ThreadPoolExecutor(1, thread_name_prefix="kvq-tokenize")

    async def prepare(self, kind: type, body: bytes) -> tuple:
        """(request, model name, specs).  Raises ApiError, ValueError (400), OverloadedError (429) or
        EngineDeadError (503; its ShuttingDown while the server drains).  The checks run on the loop's
        default executor, so a refusal never waits behind another request's tokenization; the
        tokenizations run on the one worker."""
        checked = await asyncio.to_thread(self._check, kind, body)
        return await asyncio.get_running_loop().run_in_executor(self._pool, self._build, *checked)

    def close(self) -> None:
        self._pool.shutdown(wait=False, cancel_futures=True)

    # -- on worker threads ------------------------------------------------------------------------
    def _check(self, kind: type, body: bytes) -> tuple:
        """Parse and check everything that needs no tokenizer: (request, model, prompts, max_tokens)."""
        req = parse_request(kind, body)
        model = req.model or self.names[0]
        if model not in self.names:
            raise ApiError(404, f"the model {model!r} does not exist here; served: {', '.join(self.names)}",
                           param="model", code="model_not_found")
        req.check(self.max_logprobs)
        if req.n > self.max_n:
            raise ApiError(400, f"n is {req.n}; this server allows at most {self.max_n} (--max-n)", param="n",
                           code="invalid_value")
        chat = kind is ChatCompletionRequest
        if chat:  # one prompt: the messages
            prompts, limit = [[m.template_dict() for m in req.messages]], req.output_limit()
        else:
            prompts, limit = req.prompts(), 16 if req.max_tokens is None else req.max_tokens  # OpenAI's default
        self.engine.check_room(len(prompts) * req.n)  # before any prompt is looked at
        if chat:
            self._check_contents(prompts[0])
        else:
            for i, p in enumerate(prompts):
                self._check_length(p, "prompt", i if len(prompts) > 1 else None)
        return req, model, prompts, limit

    def _build(self, req, model: str, prompts: list, limit: int | None) -> tuple:
        """On the tokenizer worker: token ids, then one PromptSpec per prompt and sample."""
        if isinstance(req, ChatCompletionRequest):
            token_ids = [self._chat_ids(prompts[0])]
        else:
            token_ids = [self._prompt_ids(p, i if len(prompts) > 1 else None) for i, p in enumerate(prompts)]
        specs = []
        for pi, ids in enumerate(token_ids):
            label = f"prompt[{pi}]" if len(token_ids) > 1 else None
            max_tokens = limit
            if req.scores_only and len(ids) >= self.max_model_len:  # the engine computes one token past it
                raise ApiError(400, f"{label or 'prompt'}: scoring a prompt of {len(ids)} tokens (max_tokens 0) needs "
                               f"max_model_len > {len(ids)} (it is {self.max_model_len})", param="prompt",
                               code="context_length_exceeded")
            if max_tokens is None:  # chat's default: up to max_model_len
                max_tokens = self.max_model_len - len(ids)
                if max_tokens < 1:
                    raise ApiError(400, f"the prompt has {len(ids)} tokens; max_model_len={self.max_model_len} "
                                   "leaves no room for output", param="messages", code="context_length_exceeded")
            specs.extend(PromptSpec(req.sampling(max_tokens, i), ids, label=label) for i in range(req.n))
        return req, model, specs

    def _check_length(self, prompt: str | list[int], param: str, index: int | None) -> None:
        """Token ids by count, text by bytes: both before any tokenization."""
        name = param if index is None else f"{param}[{index}]"
        if isinstance(prompt, str):
            if self.max_prompt_bytes is not None and len(prompt) > self.max_prompt_bytes:  # chars <= bytes
                size = len(prompt)
            elif self.max_prompt_bytes is not None:
                size = len(prompt.encode("utf-8", "surrogatepass"))
            else:
                return
            if size > self.max_prompt_bytes:
                raise ApiError(400, f"{name} is at least {size} bytes; no text over {self.max_prompt_bytes} bytes "
                               f"fits in max_model_len={self.max_model_len} tokens with this vocabulary", param=param,
                               code="context_length_exceeded")
        elif len(prompt) > self.max_model_len:
            raise ApiError(400, f"{name}: a prompt of {len(prompt)} tokens exceeds max_model_len="
                           f"{self.max_model_len}", param=param, code="context_length_exceeded")

    def _prompt_ids(self, prompt: str | list[int], index: int | None) -> list[int]:
        ids = self.engine.engine.encode(prompt)[1]
        if len(ids) > self.max_model_len:
            name = "prompt" if index is None else f"prompt[{index}]"
            raise ApiError(400, f"{name}: a prompt of {len(ids)} tokens exceeds max_model_len={self.max_model_len}",
                           param="prompt", code="context_length_exceeded")
        return ids

    def _check_contents(self, messages: list[dict]) -> None:
        """The chat template only adds text: contents over the byte bound are refused untemplated."""
        if self.max_prompt_bytes is None:
            return
        size = sum(len(m["content"].encode("utf-8", "surrogatepass")) for m in messages)
        if size > self.max_prompt_bytes:
            raise ApiError(400, f"the messages' contents are {size} bytes; no text over {self.max_prompt_bytes} "
                           f"bytes fits in max_model_len={self.max_model_len} tokens with this vocabulary",
                           param="messages", code="context_length_exceeded")

    def _chat_ids(self, messages: list[dict]) -> list[int]:
        tok = self.engine.engine.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise ValueError(f"model {self.engine.engine.info['model']!r} has no tokenizer or chat template: use "
                             "/v1/completions (with token-id prompts if it has no tokenizer)")
        text = tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)
        self._check_length(text, "messages", None)
        ids = self.engine.engine.encode(text)[1]
        if len(ids) > self.max_model_len:
            raise ApiError(400, f"the messages make a prompt of {len(ids)} tokens, which exceeds max_model_len="
                           f"{self.max_model_len}", param="messages", code="context_length_exceeded")
        return ids
