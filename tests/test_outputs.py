"""RequestOutput token ids: a running request's are an O(1) view (kvq.engine.outputs.TokenIds) that
reads like the list it snapshots and never changes as the request grows; a finished one's a list."""

import json

import pytest
from hypothesis import given
from hypothesis import strategies as st

from kvq.engine.outputs import TokenIds
from tests.tiny_model import write_tiny

idx = st.one_of(st.none(), st.integers(-12, 12))


@given(st.lists(st.integers(0, 50), max_size=10), st.integers(0, 10), st.lists(st.integers(0, 50), max_size=5),
       idx, idx, st.sampled_from([None, 1, 2, 3, -1, -2]))
def test_view_reads_like_the_snapshot_list(ids, n, later, start, stop, step):
    n = min(n, len(ids))
    live = list(ids)
    view = TokenIds(live, n)
    live.extend(later)  # the engine appends after the output was built: the view must not see it
    ref = ids[:n]
    assert len(view) == n and list(view) == ref and view == ref and ref == view and view == tuple(ref)
    assert view[start:stop:step] == ref[start:stop:step]
    for i in range(-n - 2, n + 2):
        if -n <= i < n:
            assert view[i] == ref[i]
        else:
            with pytest.raises(IndexError):
                view[i]
    assert repr(view) == repr(ref) and (view == ref + [1]) is False


def test_running_outputs_do_not_change_and_finished_ones_are_lists(tmp_path):
    """Outputs of one step held while the request runs on keep that step's tokens; the final output's
    token ids are a list (JSON-serializable) equal to the greedy tokens generated."""
    from kvq.engine.llm_engine import EngineConfig, LLMEngine
    from kvq.engine.sampling_params import SamplingParams

    eng = LLMEngine(EngineConfig(model=write_tiny(tmp_path), load_format="dummy", device="cpu", kv_cache_memory="4MiB",
                                 progress=False))
    eng.add_request([1, 2, 3, 4], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    held, final = [], None
    while eng.has_unfinished():
        for o in eng.step():
            held.append((o, list(o.outputs[0].token_ids)))
            if o.finished:
                final = o
    assert final is not None and type(final.outputs[0].token_ids) is list and len(final.outputs[0].token_ids) == 6
    assert json.loads(json.dumps(final.outputs[0].token_ids)) == final.outputs[0].token_ids
    assert [len(o.outputs[0].token_ids) for o, _ in held] == [1, 2, 3, 4, 5, 6]
    for o, tokens in held:  # what each step's output held then, it holds now
        assert o.outputs[0].token_ids == tokens == final.outputs[0].token_ids[:len(tokens)]
    assert all(isinstance(o.outputs[0].token_ids, TokenIds) for o, _ in held if not o.finished)
