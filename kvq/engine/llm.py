"""The Python API, shaped like vLLM's: ``LLM(...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

from dataclasses import fields
from typing import Iterator

from tqdm.auto import tqdm

from kvq.engine.config import EngineConfig
from kvq.engine.llm_engine import LLMEngine
from kvq.engine.outputs import RequestOutput
from kvq.engine.sampling_params import SamplingParams


class LLM:
    """An engine plus convenience calls.  Keyword arguments are :class:`EngineConfig` fields,
    e.g. ``LLM(model="default", kv_cache_dtype="fp8_e4m3", threads=2)``.  Every bad choice raises
    ValueError before the weights load; what was resolved is logged at INFO on the "kvq" logger
    (``logging.basicConfig(level=logging.INFO)`` to see it) and kept in ``llm.engine.info``."""

    def __init__(self, model: str = "default", config: EngineConfig | None = None, **kwargs):
        if config is not None and kwargs:
            raise ValueError("give either config or keyword arguments, not both")
        unknown = sorted(set(kwargs) - {f.name for f in fields(EngineConfig)})
        if unknown:
            raise ValueError(f"unknown LLM argument(s) {', '.join(unknown)}; valid: "
                             f"{', '.join(f.name for f in fields(EngineConfig) if f.name != 'model')}")
        config = config or EngineConfig(model=model, **kwargs)
        config.kv_cache_config.check_options_apply()
        self.engine = LLMEngine(config)

    def shutdown(self) -> None:
        """Stop the other tensor-parallel ranks now (else at exit); the engine is unusable after."""
        self.engine.shutdown()

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Prompts (strings or token-id lists) -> outputs in the same order.

        All or nothing: a bad prompt or parameter raises ValueError before any request is
        queued; an exception while generating (Ctrl-C included) aborts the call's requests,
        so none of them runs during a later call."""
        prompts = _prompt_list(prompts)
        if isinstance(sampling_params, (list, tuple)):
            params = list(sampling_params)
        elif sampling_params is None or isinstance(sampling_params, SamplingParams):
            params = [sampling_params] * len(prompts)
        else:
            raise TypeError(f"sampling_params must be a SamplingParams, a list of them (one per prompt) or None, "
                            f"got {type(sampling_params).__name__}")
        ids = self.engine.add_requests(prompts, params)
        done: dict[int, RequestOutput] = {}
        try:
            with tqdm(total=len(ids), desc="generating", disable=not use_tqdm, unit="req") as bar:
                while self.engine.has_unfinished():
                    for out in self.engine.step():
                        if out.finished and out.request_id not in done:
                            done[out.request_id] = out
                            bar.update()
        finally:
            for rid in ids:
                if rid not in done:
                    self.engine.abort(rid)
        return [done[i] for i in ids]

    def apply_chat_template(self, messages: list[dict]) -> str:
        tok = self.engine.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise ValueError("this model has no chat template")
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """One conversation (list of {"role", "content"}) or several -> outputs."""
        convs = [messages] if isinstance(messages, list) and messages and isinstance(messages[0], dict) else messages
        if not isinstance(convs, list) or not all(
                isinstance(c, list) and c and all(isinstance(m, dict) for m in c) for c in convs):
            raise TypeError("messages must be a conversation (a non-empty list of {'role': ..., 'content': ...} "
                            f"dicts) or a list of conversations, got {_describe(messages)}")
        return self.generate([self.apply_chat_template(c) for c in convs], sampling_params, use_tqdm)

    def stream(self, prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield text deltas of one request as tokens arrive.  Closing the generator early
        (``close()``, ``break`` out of a for loop, garbage collection) aborts the request and
        frees its KV blocks at once."""
        rid = self.engine.add_request(prompt, sampling_params)
        sent = ""
        finished = False
        try:
            while not finished:
                outs = [o for o in self.engine.step() if o.request_id == rid]
                for o in outs:
                    text = o.outputs[0].text
                    finished = finished or o.finished
                    if len(text) > len(sent) and text.startswith(sent):
                        yield text[len(sent):]
                        sent = text
                if not self.engine.has_unfinished():
                    finished = True
        finally:
            if not finished:
                self.engine.abort(rid)


PROMPTS = "a str, a list of token ids, or a list of those"


def _describe(x) -> str:
    return "an empty list" if isinstance(x, (list, tuple)) and not x else type(x).__name__


def _prompt_list(prompts) -> list:
    """``generate``'s prompts as a list of prompts; TypeError naming the argument for anything else."""
    if isinstance(prompts, str):
        return [prompts]
    if isinstance(prompts, (list, tuple)):
        if prompts and all(isinstance(t, int) and not isinstance(t, bool) for t in prompts):
            return [list(prompts)]  # one prompt of token ids
        for i, p in enumerate(prompts):
            if not isinstance(p, (str, list, tuple)):
                raise TypeError(f"prompts must be {PROMPTS}; prompts[{i}] is {type(p).__name__}")
        return list(prompts)
    raise TypeError(f"prompts must be {PROMPTS}, got {type(prompts).__name__}")
