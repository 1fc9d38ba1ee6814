"""What the evaluation reads: real text for perplexity, synthetic haystacks for retrieval.

Perplexity, KL and top-1 are measured on real English prose shipped inside
the package (``kvq/data/reference_prose.txt``: the Python 3.11 language
reference's prose, PSF license; kvq/data/README.md), so every machine scores
the same tokens; nothing is downloaded or generated.  Several *passages*,
disjoint stretches of the text where it is long enough, give the intervals of
:mod:`kvq.eval.stats`.

Retrieval uses single-needle *passkey* haystacks (filler is synthetic by
design, the classic "The grass is green..." of the passkey test): one haystack
per (bin, depth, trial) holds one needle under a random name::

    [intro] filler ... "The pass key of Alice is 48213. Remember it." filler ...
    then the question on a fork of the cached haystack:
    "What is the pass key of Alice? The pass key of Alice is" + answer " 48213"

One needle, because several in one haystack defeat the small default model
(its bf16 baseline then retrieves a few in ten, so the test measured noise).
Depths span only the part of the haystack that every evaluated format stores
quantized: after the largest sink block and before the largest recent window
of the run (a needle inside a high-precision window says nothing about the
format).
"""

from __future__ import annotations

import hashlib
import random
from dataclasses import dataclass
from pathlib import Path

#: The default evaluation text (fixed; see kvq/data/README.md).
TEXT_FILE = Path(__file__).resolve().parent.parent / "data" / "reference_prose.txt"
TEXT_SOURCE = ("kvq/data/reference_prose.txt: prose of the Python 3.11 language reference (CPython 3.11.7 "
               "pydoc_data.topics, PSF license), shipped with kvq")

FILLER = "The grass is green. The sky is blue. The sun is yellow. Here we go. There and back again. "
INTRO = ("There are important pass keys hidden inside a lot of irrelevant text. Find them and memorize them. "
         "I will quiz you about them.\n")
NAMES = ("Alice", "Bruno", "Chen", "Dara", "Emil", "Farah", "Goran", "Hana")
#: Tokens reserved at the end of a bin for a question and its answer.
QUESTION_TOKENS = 32


def text_source(text_file: str | None = None) -> str:
    """Where the perplexity text comes from (and the default text's license)."""
    return f"file {text_file}" if text_file else TEXT_SOURCE


def file_sha256(path: str | Path) -> str:
    return hashlib.sha256(Path(path).read_bytes()).hexdigest()


def tokens_sha256(ids: list[int]) -> str:
    """Hash of the scored token ids: two runs scored the same tokens iff their hashes agree."""
    return hashlib.sha256(b"".join(int(i).to_bytes(4, "little") for i in ids)).hexdigest()


def eval_token_ids(tokenizer, text_file: str | None = None) -> list[int]:
    """Every token id of the evaluation text: ``text_file`` (UTF-8) or the shipped default
    (ValueError if the file cannot be read)."""
    path = Path(text_file) if text_file else TEXT_FILE
    try:
        text = path.read_text(encoding="utf-8")
    except (OSError, UnicodeDecodeError) as e:
        raise ValueError(f"--text {path}: cannot read it as UTF-8 text ({e})") from None
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def passage_offsets(num_ids: int, needed: int, passages: int, window: int) -> list[int]:
    """Start of each passage of ``needed`` tokens in a text of ``num_ids``: disjoint when the
    text holds them all, else evenly spread and overlapping, as long as their scored
    positions (``window`` per bin) still differ; ValueError otherwise."""
    if passages < 1:
        raise ValueError(f"passages must be >= 1, got {passages}")
    if num_ids < needed:
        raise ValueError(f"the evaluation text has {num_ids} tokens, fewer than the {needed} one passage needs "
                         f"(the largest bin + 1)")
    if passages == 1:
        return [0]
    stride = min(needed, (num_ids - needed) // (passages - 1))
    if stride < window:
        fit = 1 + (num_ids - needed) // window
        raise ValueError(f"the evaluation text ({num_ids} tokens) holds at most {fit} passages of {needed} tokens "
                         f"whose scored positions differ; use --passages {fit} or a longer --text")
    return [k * stride for k in range(passages)]


@dataclass(frozen=True)
class Needle:
    depth: float  # 0.0 (start of the haystack) .. 1.0 (end)
    name: str
    key: str
    question_ids: tuple[int, ...]  # question tokens, answer excluded
    answer_ids: tuple[int, ...]  # the tokens a correct greedy answer produces


@dataclass(frozen=True)
class Haystack:
    bin: int
    trial: int
    token_ids: tuple[int, ...]  # length bin - QUESTION_TOKENS, a multiple of the block size
    needles: tuple[Needle, ...]


def _ids(tokenizer, text: str) -> list[int]:
    return tokenizer(text, add_special_tokens=False)["input_ids"]


def make_haystack(tokenizer, length: int, depth: float, trial: int, seed: int = 0, align: int = 32,
                  keep_head: int = 0, keep_tail: int = 0) -> Haystack:
    """A haystack of a ``length``-token bin with one needle at ``depth`` (deterministic in
    ``seed``, ``trial``).  Depth 0 puts the needle right after the first ``keep_head`` tokens
    (the largest sink block of the run's formats), depth 1 right before the last
    ``keep_tail`` (the largest recent window): every needle lies where the formats store
    it quantized, so retrieval tests the format, not its high-precision windows."""
    if not 0.0 <= depth <= 1.0:
        raise ValueError(f"passkey depth {depth} outside [0, 1]")
    rng = random.Random(f"{seed}:{length}:{depth:g}:{trial}")
    name = rng.choice(NAMES)
    key = str(rng.randint(10000, 99999))
    n_hay = (length - QUESTION_TOKENS) // align * align
    intro = _ids(tokenizer, INTRO)
    needle_ids = _ids(tokenizer, f" The pass key of {name} is {key}. Remember it. ")
    question = _ids(tokenizer, f"\nWhat is the pass key of {name}? The pass key of {name} is")
    answer = _ids(tokenizer, f" {key}")
    if len(question) + len(answer) > QUESTION_TOKENS:
        raise AssertionError(f"question and answer take {len(question) + len(answer)} tokens")
    lo = max(len(intro), keep_head)  # first position the needle may start at
    hi = n_hay - keep_tail - len(needle_ids)  # last one
    if hi < lo:
        raise ValueError(f"bin {length} is too short for a passkey haystack whose needle stays outside "
                         f"{keep_head} sink and {keep_tail} recent high-precision tokens")
    at = lo + int(round(depth * (hi - lo)))
    n_filler = n_hay - len(intro) - len(needle_ids)
    filler = _ids(tokenizer, FILLER * (n_filler // 10 + 2))[:n_filler]
    cut = at - len(intro)
    out = list(intro) + filler[:cut] + needle_ids + filler[cut:]  # no BOS: the engine's encode adds none either
    assert len(out) == n_hay, (len(out), n_hay)
    return Haystack(length, trial, tuple(out), (Needle(depth, name, key, tuple(question), tuple(answer)),))
