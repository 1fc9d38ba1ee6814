"""The FastAPI application: OpenAI-compatible routes over an :class:`AsyncEngine`.

Routes: ``POST /v1/completions``, ``POST /v1/chat/completions`` (JSON, or SSE
with ``stream: true``: ``data: {chunk}`` events then ``data: [DONE]``),
``GET /v1/models``, ``/health``, ``/metrics`` (Prometheus text), ``/status``
(JSON; ``?check=1`` also runs the allocator and scheduler integrity checks on
the engine thread and reports leaked blocks).  No trailing-slash redirects: a
path is served as written or is a 404.

The edge, in order: CORS (only with ``allowed_origins``), the API key
(kvq/server/auth.py, 401), then per generation request: Content-Type
``application/json`` (415), the body read against ``max_request_bytes`` as it
streams in (413) and ``timeout_body`` (408), then kvq/server/admission.py
(parse, limits, tokenization on its worker thread) and the engine.

A client that goes away aborts its engine requests at once: a stream through
the response's cancellation, a non-streaming request by racing it against the
connection's ``http.disconnect``; one that leaves mid-body is one log line.
Status codes: 400 bad input, 401 API key, 404 unknown route or model, 408 body
too slow, 413 body too large, 415 not JSON, 429 overloaded, 503 engine not
running or the server shutting down (with ``Retry-After``), 500 engine failure;
every body is OpenAI's error shape.

Shutdown (kvq/server/launch.py): while the server drains, ``/health`` and every new
generation request are 503 ``server_shutdown``; a request the drain's deadline ends is a
503 (JSON) or, in a stream, a last chunk with ``finish_reason: "abort"`` then ``[DONE]``.
"""

from __future__ import annotations

import asyncio
import json
import logging
import time
from collections.abc import AsyncIterator
from contextlib import asynccontextmanager

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import Response, StreamingResponse
from prometheus_client import CONTENT_TYPE_LATEST
from starlette.exceptions import HTTPException as StarletteHTTPException
from starlette.middleware.cors import CORSMiddleware

from kvq.connectors.remote_prefill import FILL_STATS
from kvq.server.admission import Admission
from kvq.server.async_engine import AsyncEngine, EngineDeadError, EngineError, OverloadedError, ShuttingDown
from kvq.server.auth import ApiKeyAuth
from kvq.server.http import ClientGone, api_error_response, error_response, read_json_body
from kvq.server.logprobs import chat_logprobs, completion_logprobs, echo_logprobs, merge
from kvq.server.metrics import ServerMetrics
from kvq.server.options import ServerOptions
from kvq.server.protocol import (
    ApiError,
    ChatCompletionRequest,
    CompletionRequest,
    chat_choice,
    chat_delta,
    completion_choice,
    error_body,
    new_id,
    response_head,
    safe_text_end,
    usage,
)

log = logging.getLogger("uvicorn.error")  # uvicorn's own log: same handlers and format as its lines
RETRY_AFTER_S = 5  # a 503 while shutting down: about a load balancer's health-check interval


def shutdown_response(e: ShuttingDown):
    """503 ``server_shutdown`` with Retry-After, closing the connection: the client's retry should reach
    another replica, not this one on a kept-alive connection."""
    response = error_response(503, str(e), "service_unavailable", "server_shutdown")
    response.headers["Retry-After"] = str(RETRY_AFTER_S)
    response.headers["Connection"] = "close"
    return response


class SSEResponse(StreamingResponse):
    """A streaming response that, however it ends, closes its generator at once (not at garbage
    collection) and then calls ``on_close``: the request is released even if the client left before
    the generator ever ran (closing an unstarted generator skips its ``finally``)."""

    def __init__(self, content, on_close, **kw):
        super().__init__(content, media_type="text/event-stream", headers={"Cache-Control": "no-cache"}, **kw)
        self.on_close = on_close

    async def __call__(self, scope, receive, send) -> None:
        try:
            await super().__call__(scope, receive, send)
        finally:
            await self.body_iterator.aclose()
            self.on_close()


def _fill_stats(engine) -> dict:
    """A decode engine's fills from its prefill peer (kvq.connectors.remote_prefill); zeros elsewhere."""
    connector = engine.connector("remote_prefill")
    return connector.stats() if connector is not None else dict(FILL_STATS)


class NotJSON(ValueError):
    """An output holds a value JSON cannot carry (NaN or infinity: a fault upstream, e.g. in the KV cache)."""


#: What a client is told when its output cannot be encoded (the server's log has the value's place).
NOT_JSON = "the output holds a value JSON cannot carry (NaN or infinity); this is a server fault"


def _json(obj, ascii: bool = True) -> str:
    try:
        return json.dumps(obj, separators=(',', ':'), allow_nan=False, ensure_ascii=ascii)
    except ValueError as e:  # never "NaN" on the wire: it is not JSON, and clients parse it differently
        raise NotJSON(str(e)) from e


def _sse(obj: dict | str) -> str:
    return f"data: {obj if isinstance(obj, str) else _json(obj)}\n\n"


async def _until_disconnect(request: Request, coro):
    """Run ``coro``; if the client disconnects first, cancel it and raise ClientGone."""
    async def disconnected() -> None:
        while (await request.receive())["type"] != "http.disconnect":
            pass

    work, gone = asyncio.ensure_future(coro), asyncio.ensure_future(disconnected())
    try:
        await asyncio.wait({work, gone}, return_when=asyncio.FIRST_COMPLETED)
    except BaseException:  # this handler was cancelled (shutdown)
        work.cancel()
        raise
    finally:
        gone.cancel()
    if work.done():
        return work.result()
    work.cancel()
    raise ClientGone


class _Choices:
    """Per-choice streaming state: text and token ids already sent."""

    def __init__(self, n: int, stop: tuple[str, ...]):
        self.stop = stop
        self.text = [""] * n
        self.ntok = [0] * n

    def delta(self, index: int, out) -> tuple[str, list[int]]:
        c = out.outputs[0]
        end = safe_text_end(c.text, self.stop, out.finished)
        sent, text = self.text[index], ""
        if end > len(sent) and c.text.startswith(sent):
            text = c.text[len(sent):end]
            self.text[index] = c.text[:end]
        tokens = c.token_ids[self.ntok[index]:]
        self.ntok[index] = len(c.token_ids)
        return text, tokens


def build_app(engine: AsyncEngine, metrics: ServerMetrics, served_model_names: list[str],
              options: ServerOptions | None = None, kv_peer=None) -> FastAPI:
    """The app; its lifespan starts and stops the engine thread.  ``kv_peer``: a
    :class:`~kvq.transfer.peer.PrefillExporter` or ``PrefillClient`` (closed with the app)."""
    if not served_model_names:
        raise ValueError("at least one served model name is needed")
    names = list(served_model_names)
    options = options or ServerOptions()
    info = engine.engine.info
    started = int(time.time())
    admission = Admission(engine, names, options)

    @asynccontextmanager
    async def lifespan(app: FastAPI):
        engine.start()
        try:
            yield
        finally:
            engine.stop()
            admission.close()
            if kv_peer is not None:
                kv_peer.close()

    docs = options.enable_docs
    app = FastAPI(title="kvq", lifespan=lifespan, redirect_slashes=False, docs_url="/docs" if docs else None,
                  redoc_url="/redoc" if docs else None, openapi_url="/openapi.json" if docs else None)
    app.state.engine = engine
    app.state.metrics = metrics
    app.state.options = options
    if options.api_key is not None:
        app.add_middleware(ApiKeyAuth, api_key=options.api_key, public_metrics=options.public_metrics)
    if options.allowed_origins:  # added last: outermost, so preflights are answered before the key is asked
        app.add_middleware(CORSMiddleware, allow_origins=list(options.allowed_origins), allow_methods=["GET", "POST"],
                           allow_headers=["*"])

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, exc: StarletteHTTPException):
        type_ = "not_found_error" if exc.status_code == 404 else "invalid_request_error"
        return error_response(exc.status_code, f"{request.method} {request.url.path}: {exc.detail}", type_)

    @app.exception_handler(Exception)
    async def internal_error(request: Request, exc: Exception):  # (Starlette logs the traceback after it)
        return error_response(500, f"{request.method} {request.url.path}: internal server error "
                              f"({type(exc).__name__}); the server's log has the traceback", "server_error")

    @app.exception_handler(RequestValidationError)
    async def invalid_query(request: Request, exc: RequestValidationError):
        err = exc.errors()[0]
        loc = [str(x) for x in err["loc"]]
        return error_response(400, f"{'.'.join(loc)}: {err['msg']}", "invalid_request_error", "invalid_value",
                      loc[-1] if loc else None)

    @app.head("/health", include_in_schema=False)  # HEAD: GET's status and headers; uvicorn drops the body
    @app.get("/health")
    async def health():
        if engine.draining:
            return shutdown_response(ShuttingDown(f"the server is shutting down: draining {engine.num_live} "
                                                  "running sequences; it takes no new requests"))
        if not engine.alive:
            return error_response(503, engine.dead_reason or "the engine is not running", "service_unavailable")
        return {"status": "ok"}

    @app.head("/v1/models", include_in_schema=False)
    @app.get("/v1/models")
    async def models():
        return {"object": "list", "data": [
            {"id": name, "object": "model", "created": started, "owned_by": "kvq", "root": info["model"],
             "max_model_len": info["max_model_len"]} for name in names]}

    @app.get("/metrics")
    async def prometheus():
        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/status")
    async def status(check: bool = False):
        snap = engine.snapshot
        body = {
            "alive": engine.alive, "dead_reason": engine.dead_reason, "draining": engine.draining,
            "served_model_names": names,
            "model": info["model"], "device": info["device"], "dtype": info["dtype"],
            "requests": {k: snap[k] for k in ("running", "waiting", "swapped", "live_requests")},
            "max_live_requests": engine.max_live,
            "kv_cache_dtype": info["kv_cache_dtype"], "kv_scales": info["kv_scales"],
            "attention_backend": info["attention_backend"],
            "block_size": info["block_size"], "max_model_len": info["max_model_len"],
            "kv_pool": {**info["kv_pool"], "bytes_per_block": engine.engine.plan.bytes_per_block,
                        "hp_bytes_per_block": engine.engine.plan.hp_bytes_per_block},
            "kv_blocks": snap["kv_blocks"], "steps": snap["steps"], "recoveries": snap["recoveries"],
            "kv_tiers": {"tiers": snap["tiers"], "pressure_demotions": snap["pressure_demotions"],
                         "demotion_seconds": round(snap["demotion_seconds"], 6)}
            if snap["tiers"] else None,
            "preemption_mode": info["preemption_mode"],
            "cpu_offload": {**info["cpu_offload"], "swap": snap["swap"], "prefix_tier_stats": snap["cpu_offload"]},
            "kv_transfer": {**kv_peer.status(), "fills": _fill_stats(engine.engine)} if kv_peer is not None
            else {"role": "both"},
        }
        if check:
            try:
                body["integrity"] = await engine.check()
            except EngineDeadError as e:
                return error_response(503, str(e), "service_unavailable")
        return body

    async def admit(request: Request, kind: type) -> tuple:
        body = await read_json_body(request, options.max_request_bytes, options.timeout_body)
        req, model, specs = await admission.prepare(kind, body)
        return req, model, await engine.submit(specs)

    async def generate(request: Request, kind: type):
        try:
            if engine.draining:  # refused before its body is read
                raise ShuttingDown("the server is shutting down and takes no new requests; retry on another "
                                   "replica")
            req, model, group = await admit(request, kind)
        except ClientGone as e:
            metrics.outcome("abort")
            client = request.client
            log.info("%s - %s %s: the client disconnected %s", f"{client.host}:{client.port}" if client else "?",
                     request.method, request.url.path, e)
            return Response(status_code=499)  # nobody reads it
        except ApiError as e:
            metrics.outcome("invalid")
            return api_error_response(e)
        except ValueError as e:  # the engine's refusals name their field (kvq.engine.errors.RequestError)
            metrics.outcome("invalid")
            return error_response(400, str(e), "invalid_request_error", "invalid_value", getattr(e, "param", None))
        except OverloadedError as e:
            metrics.outcome("overloaded")
            return error_response(429, str(e), "rate_limit_error", "overloaded")
        except ShuttingDown as e:
            metrics.outcome("unavailable")
            return shutdown_response(e)
        except EngineDeadError as e:
            metrics.outcome("unavailable")
            return error_response(503, str(e), "service_unavailable")
        chat = kind is ChatCompletionRequest
        if req.stream:
            def on_close() -> None:
                if not group.released:  # the stream never started: its own finally did not run
                    metrics.outcome("abort")
                    engine.release(group)

            return SSEResponse(stream(group, req, model, chat), on_close)
        try:
            body = await _until_disconnect(request, collect(group, req, model, chat))
        except ClientGone:
            metrics.outcome("abort")
            return Response(status_code=499)  # nobody reads it
        except ShuttingDown as e:  # still running at the drain's deadline
            metrics.outcome("abort")
            return shutdown_response(e)
        except (EngineError, EngineDeadError) as e:
            metrics.outcome("error")
            return error_response(500 if isinstance(e, EngineError) else 503, str(e), "server_error")
        finally:
            engine.release(group)
        try:
            out = Response(_json(body, ascii=False), media_type="application/json")  # (as JSONResponse)
        except NotJSON as e:
            metrics.outcome("error")
            log.error("an output could not be encoded: %s", e)
            return error_response(500, NOT_JSON, "server_error")
        metrics.outcome("success")
        return out

    def prompt_tokens(group, n: int) -> int:
        return sum(len(ids) for ids in group.prompt_token_ids[::n])  # each prompt once, not once per sample

    async def collect(group, req, model: str, chat: bool) -> dict:
        outs = {}
        async for index, out in engine.outputs(group):
            if out.finished:
                outs[index] = out
        ids = req.return_token_ids
        choices = [_final_choice(i, outs[i], req, chat, ids) for i in sorted(outs)]
        head = response_head(new_id("chatcmpl" if chat else "cmpl"), "chat.completion" if chat else "text_completion",
                             model)
        generated = 0 if req.scores_only else sum(len(o.outputs[0].token_ids) for o in outs.values())
        body = {**head, "choices": choices, "usage": usage(prompt_tokens(group, req.n), generated)}
        if ids:
            body["prompt_token_ids"] = group.prompt_token_ids[::req.n]
        return body

    async def stream(group, req, model: str, chat: bool) -> AsyncIterator[str]:
        head = response_head(new_id("chatcmpl" if chat else "cmpl"),
                             "chat.completion.chunk" if chat else "text_completion", model)
        state = _Choices(len(group), tuple(group.specs[0].sampling["stop"]))
        ids, completion_tokens, outcome = req.return_token_ids, 0, "abort"
        # echo: each choice's first chunk is its prompt (with logprobs, the prompt's), sent with the
        # choice's first output; echoed[i] is that prompt's length, the offset of the output's text
        echo, scores_only, echoed = not chat and req.echo, req.scores_only, {}
        try:
            if chat:
                for i in range(len(group)):
                    yield _sse({**head, "choices": [chat_delta(i, {"role": "assistant", "content": ""}, None,
                                                               [] if ids else None)]})
            want_lp = req.output_logprobs() is not None
            async for index, out in engine.outputs(group):
                if echo and index not in echoed and out.outputs[0].token_ids:  # the prompt has been scored
                    prompt = _prompt_text(out)
                    echoed[index] = len(prompt)
                    lp = echo_logprobs(out.prompt_token_ids, out.prompt_logprobs or [], tokenizer) if want_lp \
                        else None
                    yield _sse({**head, "choices": [completion_choice(index, prompt, None, [] if ids else None, lp)]})
                if scores_only:  # the engine's one token is not the client's: the choice ends without it
                    if out.finished:
                        lp = completion_logprobs([], tokenizer) if want_lp else None
                        yield _sse({**head, "choices": [completion_choice(index, "", "length", [] if ids else None,
                                                                          lp)]})
                    continue
                offset = echoed.get(index, 0) + len(state.text[index])
                text, tokens = state.delta(index, out)
                finish = out.outputs[0].finish_reason if out.finished else None
                if out.finished:
                    completion_tokens += len(out.outputs[0].token_ids)
                if not (text or finish or ((ids or want_lp) and tokens)):
                    continue
                tok = tokens if ids else None
                lp = _new_logprobs(out, len(tokens), req, chat, offset) if want_lp else None
                choice = chat_delta(index, {"content": text} if text else {}, finish, tok, lp) if chat \
                    else completion_choice(index, text, finish, tok, lp)
                yield _sse({**head, "choices": [choice]})
            if req.include_usage:
                yield _sse({**head, "choices": [], "usage": usage(prompt_tokens(group, req.n), completion_tokens)})
            outcome = "success"
            yield _sse("[DONE]")
        except ShuttingDown:  # still running at the drain's deadline: each unfinished choice ends "abort"
            for index in sorted(set(range(len(group))) - group.done):
                yield _sse({**head, "choices": [chat_delta(index, {}, "abort", [] if ids else None) if chat
                                                else completion_choice(index, "", "abort", [] if ids else None)]})
            if req.include_usage:
                yield _sse({**head, "choices": [], "usage": usage(prompt_tokens(group, req.n), sum(state.ntok))})
            yield _sse("[DONE]")
        except (EngineError, EngineDeadError) as e:
            outcome = "error"
            yield _sse(error_body(str(e), "server_error"))
            yield _sse("[DONE]")
        except NotJSON as e:
            outcome = "error"
            log.error("a streamed output could not be encoded: %s", e)
            yield _sse(error_body(NOT_JSON, "server_error"))
            yield _sse("[DONE]")
        finally:
            metrics.outcome(outcome)
            engine.release(group)

    tokenizer = engine.engine.tokenizer

    def _prompt_text(out) -> str:
        """The text an echo puts first: the prompt as sent, or its token ids decoded."""
        if out.prompt is not None:
            return out.prompt
        return tokenizer.decode(out.prompt_token_ids) if tokenizer is not None else ""

    def _final_choice(index: int, out, req, chat: bool, ids: bool) -> dict:
        """A finished request's choice, with its logprobs (and, for an echo, the prompt before it).  A
        ``scores_only`` request (echo, max_tokens 0) drops the one token the engine computed."""
        c, k = out.outputs[0], req.output_logprobs()
        if chat:
            lp = chat_logprobs(c.logprobs or [], tokenizer, k) if k is not None else None
            return chat_choice(index, c.text, c.finish_reason, c.token_ids if ids else None, lp)
        drop = req.scores_only
        generated, finish = ("", "length") if drop else (c.text, c.finish_reason)
        token_ids = ([] if drop else c.token_ids) if ids else None
        prompt = _prompt_text(out) if req.echo else ""
        lp = None
        if k is not None:
            lp = completion_logprobs([] if drop else c.logprobs or [], tokenizer, offset=len(prompt))
            if req.echo:
                lp = merge(echo_logprobs(out.prompt_token_ids, out.prompt_logprobs or [], tokenizer), lp)
        return completion_choice(index, prompt + generated, finish, token_ids, lp)

    def _new_logprobs(out, count: int, req, chat: bool, offset: int) -> dict:
        """The logprobs of a stream chunk's ``count`` new tokens."""
        c = out.outputs[0]
        entries = (c.logprobs or [])[len(c.token_ids) - count:len(c.token_ids)]
        if chat:
            return chat_logprobs(entries, tokenizer, req.output_logprobs())
        return completion_logprobs(entries, tokenizer, offset)

    if kv_peer is not None:
        from kvq.server.kv_routes import add_kv_routes
        from kvq.transfer.peer import PrefillExporter

        role = "exporter" if isinstance(kv_peer, PrefillExporter) else "client"
        add_kv_routes(app, engine, metrics, **{role: kv_peer})

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await generate(request, CompletionRequest)

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await generate(request, ChatCompletionRequest)

    return app
