"""Incremental detokenization against one decode of the whole output (the default model's tokenizer)."""

import random

import pytest

from kvq.engine.detokenizer import IncrementalDetokenizer

TEXT = ("Caches keep the past: keys and values, quantized to 8 bits — or 4 — with scales beside them. "
        "Émigré naïveté, 日本語のテキスト, emoji 🧪🚀 and   several   spaces.\nNew line, tab\tand the end.")


@pytest.fixture(scope="module")
def tokenizer():
    from kvq.models.loader import load_tokenizer

    return load_tokenizer("default")


def test_deltas_concatenate_to_the_full_decode(tokenizer):
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    rng = random.Random(0)
    for trial in range(4):
        d = IncrementalDetokenizer(tokenizer)
        deltas, i = [], 0
        while i < len(ids):  # one token at a time, or a few (chunks of a multi-token step)
            k = 1 if trial == 0 else rng.randint(1, 3)
            deltas.append(d.add(ids[i:i + k]))
            i += k
            assert "\ufffd" not in deltas[-1], "a delta must not end inside a character"
            assert d.text == "".join(deltas)
            assert tokenizer.decode(ids[:i], skip_special_tokens=True).startswith(d.text)
        assert d.text == tokenizer.decode(ids, skip_special_tokens=True)


def full_decode_search(tokenizer, ids, stop):
    """The engine's former rule: after each token, decode the whole output and cut at the
    first stop string (in list order) that occurs anywhere in it."""
    for i in range(1, len(ids) + 1):
        text = tokenizer.decode(ids[:i], skip_special_tokens=True)
        for s in stop:
            if s in text:
                return text[:text.index(s)], s
    return tokenizer.decode(ids, skip_special_tokens=True), None


@pytest.mark.parametrize("stop", [("several",), ("zzz", "8 bits"), ("and", "Caches"), ("values", ", q"), ("🚀",),
                                  ("the end.",), ("absent",)])
def test_stop_strings_cut_where_a_full_search_would(tokenizer, stop):
    ids = tokenizer(TEXT, add_special_tokens=False)["input_ids"]
    want, hit = full_decode_search(tokenizer, ids, stop)
    d = IncrementalDetokenizer(tokenizer, stop)
    for t in ids:
        d.add([t])
        if d.stop_hit is not None:
            break
    assert (d.text, d.stop_hit) == (want, hit)
    if hit is not None:
        assert d.add(ids[:3]) == "" and d.text == want  # nothing after the cut


def test_special_tokens_keep_the_window_short(tokenizer):
    ids = tokenizer("a few words", add_special_tokens=False)["input_ids"]
    eos = tokenizer.eos_token_id
    seq = [eos] * 50 + ids + [eos] * 50 + ids
    d = IncrementalDetokenizer(tokenizer)
    for t in seq:
        d.add([t])
        assert len(d.ids) - d._prefix <= 2, "the decoded window must not grow with skipped tokens"
    assert d.text == tokenizer.decode(seq, skip_special_tokens=True)
