"""The windowed library prefill as one call over runs of queries (split_prefill.WINDOW_RUNS): the runs
follow the window rule exactly, and the call meets the per-query definition of tests/test_prefill_window."""

import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

import tests.test_prefill_window as tpw
from kvq.cache.window import WindowPolicy, can_seal, exact_from, exact_runs
from tests.test_split_prefill import LIBS, lib


@settings(max_examples=300, deadline=None)
@given(bs=st.sampled_from([1, 4, 16, 32]), sink=st.integers(0, 3), res=st.integers(0, 140), direct=st.booleans(),
       start=st.integers(0, 400), n=st.integers(1, 300))
def test_runs_cut_positions_where_the_window_moves(bs, sink, res, direct, start, n):
    pol = WindowPolicy(bs, sink, res, direct)
    runs = exact_runs(start, start + n, pol)
    assert runs[0][0] == start and runs[-1][1] == start + n
    for (a, b, e), nxt in zip(runs, runs[1:] + [None]):
        assert a < b and all(exact_from(p, pol) == e for p in range(a, b))
        if nxt is not None:
            assert nxt[0] == b and exact_from(b, pol) != e  # maximal: the next position moves the window
        if can_seal(pol):
            assert e % bs == 0 and (b - a <= bs or b <= res + bs)


def _runs_kernels(monkeypatch, lib_name):
    """The window tests' kernels with the library prefill through runs (the torch definition of the library
    call, or FlashInfer on a GPU that has it)."""
    from kvq.attention.backends import with_prefill
    from kvq.attention.split_prefill import SplitPrefill
    from kvq.attention.triton import kernels

    split = SplitPrefill(lib(lib_name), model_dtype_scratch=False, window_runs=True)
    monkeypatch.setattr(tpw, "_kernels", lambda name: with_prefill(kernels, split.paged_attention))


@pytest.mark.parametrize("lib_name", LIBS)
@pytest.mark.parametrize("fmt,sink,res", tpw.CASES)
def test_window_runs_read_each_querys_window_exact(fmt, sink, res, lib_name, monkeypatch):
    """The window tests' two sequences (a prompt, then a long chunk), through one call over runs."""
    _runs_kernels(monkeypatch, lib_name)
    tpw._check_windows(fmt, sink, res, "split-runs", ({"a": 64, "b": 32}, {"a": 96, "b": 64}))


@pytest.mark.parametrize("lib_name", LIBS)
@pytest.mark.parametrize("fmt", ["int4_kivi", "int8_per_token_head"])
def test_window_runs_meet_the_definition_on_long_chunks(fmt, lib_name, monkeypatch):
    _runs_kernels(monkeypatch, lib_name)
    tpw._check_windows(fmt, 4, 32, "split-runs", ({"a": 256, "b": 96}, {"a": 160, "b": 224}))
