"""The Python API, shaped like vLLM's: ``LLM(...).generate(prompts, SamplingParams(...))``."""

from __future__ import annotations

from typing import Iterator

from tqdm.auto import tqdm

from kvq.engine.llm_engine import EngineConfig, LLMEngine, RequestOutput
from kvq.engine.sampling_params import SamplingParams


class LLM:
    """An engine plus convenience calls.  Keyword arguments are :class:`EngineConfig` fields,
    e.g. ``LLM(model="default", kv_cache_dtype="fp8_e4m3")``."""

    def __init__(self, model: str = "default", config: EngineConfig | None = None, **kwargs):
        if config is not None and kwargs:
            raise ValueError("give either config or keyword arguments, not both")
        self.engine = LLMEngine(config or EngineConfig(model=model, **kwargs))

    @property
    def tokenizer(self):
        return self.engine.tokenizer

    def generate(self, prompts, sampling_params: SamplingParams | list[SamplingParams] | None = None,
                 use_tqdm: bool = True) -> list[RequestOutput]:
        """Prompts (strings or token-id lists) -> outputs in the same order."""
        if isinstance(prompts, str) or (prompts and isinstance(prompts[0], int)):
            prompts = [prompts]
        params = sampling_params if isinstance(sampling_params, list) else [sampling_params] * len(prompts)
        if len(params) != len(prompts):
            raise ValueError(f"{len(prompts)} prompts but {len(params)} sampling params")
        ids = [self.engine.add_request(p, sp or SamplingParams()) for p, sp in zip(prompts, params)]
        done: dict[int, RequestOutput] = {}
        with tqdm(total=len(ids), desc="generating", disable=not use_tqdm, unit="req") as bar:
            while self.engine.has_unfinished():
                for out in self.engine.step():
                    if out.finished and out.request_id not in done:
                        done[out.request_id] = out
                        bar.update()
        return [done[i] for i in ids]

    def apply_chat_template(self, messages: list[dict]) -> str:
        tok = self.engine.tokenizer
        if tok is None or not getattr(tok, "chat_template", None):
            raise ValueError("this model has no chat template")
        return tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=True)

    def chat(self, messages: list[dict] | list[list[dict]], sampling_params: SamplingParams | None = None,
             use_tqdm: bool = True) -> list[RequestOutput]:
        """One conversation (list of {"role", "content"}) or several -> outputs."""
        convs = [messages] if messages and isinstance(messages[0], dict) else messages
        return self.generate([self.apply_chat_template(c) for c in convs], sampling_params, use_tqdm)

    def stream(self, prompt, sampling_params: SamplingParams | None = None) -> Iterator[str]:
        """Yield text deltas of one request as tokens arrive."""
        rid = self.engine.add_request(prompt, sampling_params or SamplingParams())
        sent = ""
        while True:
            outs = [o for o in self.engine.step() if o.request_id == rid]
            for o in outs:
                text = o.outputs[0].text
                if len(text) > len(sent) and text.startswith(sent):
                    yield text[len(sent):]
                    sent = text
                if o.finished:
                    return
            if not self.engine.has_unfinished():
                return
