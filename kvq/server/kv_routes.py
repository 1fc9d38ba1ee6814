"""HTTP endpoints of prefill/decode disaggregation (kvq/transfer/peer.py has the protocol).

A prefill server (``--kv-role prefill``) serves, beside the OpenAI API::

    GET  /kv/describe   its KVDescription (what it holds, for a look before connecting)
    POST /kv/connect    {"description": KVDescription, "static_scales": {layer: [k, v]}}
                        -> {"description", "receiver_id", "staging"}
                        409 when the two cannot exchange KV (the message names the field)
    POST /kv/prefill    {"receiver_id", "transfer_id", "generation", "request_id", "token_ids", "sampling"}
                        -> {"first_token", "logprobs", "num_tokens", "q_blocks", "hp_blocks", "headers",
                            "nbytes"}; 503 when its staging is full
    POST /kv/release    {"transfer_id"} -> {"released": bool}

A decode server serves ``GET /kv/describe`` too.  With an API key these paths
need it like /v1/* (the decode server sends $KVQ_KV_PEER_API_KEY, else its own).
"""

from __future__ import annotations

from fastapi import FastAPI, Request

from kvq.engine.sampling_params import SamplingParams
from kvq.server.async_engine import AsyncEngine, EngineDeadError, EngineError, OverloadedError, PromptSpec
from kvq.server.http import api_error_response, error_response, read_json_body
from kvq.server.protocol import ApiError
from kvq.transfer.describe import TransferIncompatible

#: Sampling fields a decode server forwards for the first token (the rest stay on the decode side).
PREFILL_SAMPLING = ("temperature", "top_p", "top_k", "seed", "stop_token_ids", "ignore_eos", "logprobs")


def _field(body: dict, name: str, tp, what: str):
    if name not in body:
        raise ValueError(f"{name}: missing")
    value = body[name]
    if not isinstance(value, tp) or isinstance(value, bool) and tp is not bool:
        raise ValueError(f"{name}: expected {what}, got {type(value).__name__}")
    return value


def add_kv_routes(app: FastAPI, engine: AsyncEngine, metrics, *, exporter=None, client=None) -> None:

    options = app.state.options
    description = (exporter or client).description

    async def body_of(request: Request) -> dict:
        import json

        raw = await read_json_body(request, options.max_request_bytes, options.timeout_body)
        try:
            body = json.loads(raw)
        except ValueError as e:
            raise ValueError(f"the body is not JSON ({e})") from None
        if not isinstance(body, dict):
            raise ValueError("the body must be a JSON object")
        return body

    @app.get("/kv/describe")
    async def describe():
        return description.to_dict()

    if exporter is None:
        return

    @app.post("/kv/connect")
    async def connect(request: Request):
        try:
            body = await body_of(request)
            scales = body.get("static_scales") or {}
            return exporter.connect(_field(body, "description", dict, "a KVDescription object"), scales)
        except TransferIncompatible as e:
            return error_response(409, f"this prefill server cannot send KV to that decode server: {e}",
                          "invalid_request_error", "kv_incompatible")
        except ApiError as e:
            return api_error_response(e)
        except ValueError as e:
            return error_response(400, str(e), "invalid_request_error", "invalid_value")

    @app.post("/kv/prefill")
    async def prefill(request: Request):
        try:
            body = await body_of(request)
            rid = _field(body, "receiver_id", str, "a string")
            transfer_id = _field(body, "transfer_id", str, "a string")
            generation = _field(body, "generation", int, "an integer")
            request_id = _field(body, "request_id", int, "an integer")
            token_ids = _field(body, "token_ids", list, "a list of token ids")
            sampling = _field(body, "sampling", dict, "an object")
            unknown = sorted(set(sampling) - set(PREFILL_SAMPLING))
            if unknown:
                raise ValueError(f"sampling: unknown field {unknown[0]!r}; valid: {', '.join(PREFILL_SAMPLING)}")
            if not 0 <= generation < 1 << 63 or not 0 <= request_id < 1 << 63:
                raise ValueError("generation and request_id must be in [0, 2^63)")
            sampling = {**sampling, "max_tokens": 1}
            SamplingParams(**sampling)  # a bad value: 400 here, not an engine error
            try:
                exporter.receiver(rid)
            except KeyError as e:
                return error_response(409, str(e.args[0]), "invalid_request_error", "kv_not_connected")
            group = await engine.submit([PromptSpec(sampling, token_ids, export_to=(rid, transfer_id, generation))])
        except ApiError as e:
            return api_error_response(e)
        except ValueError as e:
            return error_response(400, str(e), "invalid_request_error", "invalid_value")
        except OverloadedError as e:
            return error_response(429, str(e), "rate_limit_error", "overloaded")
        except EngineDeadError as e:
            return error_response(503, str(e), "service_unavailable")
        final = None
        try:
            async for _, out in engine.outputs(group):
                if out.finished:
                    final = out
        except (EngineError, EngineDeadError) as e:
            return error_response(500, str(e), "server_error")
        finally:
            engine.release(group)
        exp = final.kv_transfer
        if isinstance(exp, BaseException) or exp is None:
            from kvq.transfer.peer import StagingFull

            status = 503 if isinstance(exp, StagingFull) else 500
            return error_response(status, f"the prompt's KV was not staged: {exp}", "server_error")
        metrics.kv_bytes.labels("sent").inc(exp["nbytes"])
        c = final.outputs[0]
        return {"first_token": c.token_ids[0], "logprobs": c.logprobs[0] if c.logprobs else None,
                "num_tokens": len(token_ids), **exp}

    @app.post("/kv/release")
    async def release(request: Request):
        try:
            body = await body_of(request)
            return {"released": exporter.release(_field(body, "transfer_id", str, "a string"))}
        except ApiError as e:
            return api_error_response(e)
        except ValueError as e:
            return error_response(400, str(e), "invalid_request_error", "invalid_value")
