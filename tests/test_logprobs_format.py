"""OpenAI logprobs objects built from the engine's per-token entries (kvq/server/logprobs.py)."""

import math

from kvq.server.logprobs import chat_logprobs, completion_logprobs, echo_logprobs, merge

VOCAB = {1: "Hello", 2: ",", 3: " world", 4: "!", 5: " é"}


class Tok:
    def decode(self, ids):
        return "".join(VOCAB[i] for i in ids)


def test_completion_logprobs_tokens_offsets_and_tops():
    entries = [{"token_id": 3, "logprob": -0.5, "top": [(3, -0.5), (4, -1.5)]},
               {"token_id": 4, "logprob": -2.0, "top": [(2, -0.1)]}]
    out = completion_logprobs(entries, Tok(), offset=6)
    assert out["tokens"] == [" world", "!"]
    assert out["token_logprobs"] == [-0.5, -2.0]
    assert out["text_offset"] == [6, 12]
    assert out["top_logprobs"][0] == {" world": -0.5, "!": -1.5}
    assert out["top_logprobs"][1] == {",": -0.1, "!": -2.0}  # the sampled token is among them, as OpenAI's
    assert completion_logprobs([{"token_id": 1, "logprob": -1.0, "top": []}], Tok())["top_logprobs"] == [None]


def test_echo_then_output_joins_offsets():
    prompt = [1, 2]
    pl = [None, {"token_id": 2, "logprob": -3.0, "top": [(2, -3.0)]}]
    echo = echo_logprobs(prompt, pl, Tok())
    assert echo["tokens"] == ["Hello", ","] and echo["token_logprobs"] == [None, -3.0]
    assert echo["top_logprobs"] == [None, {",": -3.0}] and echo["text_offset"] == [0, 5]
    out = merge(echo, completion_logprobs([{"token_id": 3, "logprob": -0.25, "top": []}], Tok(), offset=6))
    assert out["tokens"] == ["Hello", ",", " world"] and out["text_offset"] == [0, 5, 6]


def test_chat_logprobs_bytes_and_top_k():
    e = [{"token_id": 5, "logprob": -float("inf"), "top": [(5, -1.0), (3, -2.0), (4, -3.0)]}]
    c = chat_logprobs(e, Tok(), top_k=2)["content"][0]
    assert c["token"] == " é" and c["bytes"] == list(" é".encode())
    assert math.isfinite(c["logprob"]) and c["logprob"] < -1e38  # JSON has no -inf
    assert [t["token"] for t in c["top_logprobs"]] == [" é", " world"]
