"""Known-answer and distribution tests for kvq.engine.sampler (CPU; one GPU test for syncs)."""

from __future__ import annotations

import math
from dataclasses import dataclass

import pytest
import torch

from kvq.engine.sampler import LogprobsTensors, Sampler, SamplingTensors, SeedState, apply_top_k_top_p


@dataclass(frozen=True)
class P:
    """Duck-typed stand-in for SamplingParams: the sampler reads only these fields."""

    temperature: float = 1.0
    top_p: float = 1.0
    top_k: int = 0
    seed: int | None = None
    logprobs: int | None = None


SAMPLER = Sampler()


def sample(logits, params, steps=None, state=None):
    st = SamplingTensors.from_params(params, logits.device, state)
    return SAMPLER(logits, st, steps)


# Chi-square critical values at p = 1e-6 (scipy.stats.chi2.ppf(1 - 1e-6, df)).  The
# draws use a fixed seed, so each test is deterministic; the threshold says that a
# correct sampler would fail on one seed in a million, while the wrong distributions
# checked beside it (temperature ignored / applied after the cut) score in the hundreds.
CHI2_1E6 = {2: 27.63, 3: 30.66}


def chi2(tokens: torch.Tensor, ids: list[int], p: torch.Tensor) -> float:
    n = tokens.numel()
    obs = torch.stack([(tokens == i).sum() for i in ids]).double()
    exp = p.double() * n
    assert (exp >= 5).all(), "chi-square needs >= 5 expected draws per cell"
    return float(((obs - exp) ** 2 / exp).sum())


# --- greedy --------------------------------------------------------------------------------


def test_greedy_is_argmax_and_ties_take_lowest_id():
    torch.manual_seed(0)
    logits = torch.randn(8, 300)
    logits[3, [17, 40, 200]] = 50.0  # a three-way tie at the max
    out = sample(logits, [P(temperature=0.0)] * 8)
    assert out.token_ids.dtype == torch.int64 and out.token_ids.shape == (8,)
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.token_ids[3] == 17
    assert out.logprobs is None


def test_greedy_rows_mixed_with_sampled_rows():
    torch.manual_seed(1)
    logits = torch.randn(6, 50)
    params = [P(temperature=0.0), P(), P(temperature=0.0, top_k=5), P(top_p=0.5), P(temperature=0.0), P()]
    out = sample(logits, params)
    for b in (0, 2, 4):
        assert out.token_ids[b] == logits[b].argmax()


def test_temperature_to_zero_approaches_greedy():
    torch.manual_seed(2)
    # distinct logits with gaps >= 0.05: at T=1e-3 the runner-up has weight <= e^-50
    logits = torch.stack([torch.randperm(200).float() * 0.05 for _ in range(64)])
    for t in (1e-3, 1e-4):
        out = sample(logits, [P(temperature=t)] * 64)
        assert torch.equal(out.token_ids, logits.argmax(-1))


def test_top_k_1_is_greedy_even_with_ties():
    torch.manual_seed(3)
    logits = torch.randn(128, 500)
    logits[5, [9, 300]] = 40.0
    out = sample(logits, [P(temperature=1.5, top_k=1)] * 128)
    assert torch.equal(out.token_ids, logits.argmax(-1))
    assert out.token_ids[5] == 9


def test_tiny_top_p_is_greedy():
    torch.manual_seed(4)
    logits = torch.randn(128, 500)
    out = sample(logits, [P(temperature=1.0, top_p=1e-6)] * 128)
    assert torch.equal(out.token_ids, logits.argmax(-1))


# --- distributions -------------------------------------------------------------------------

N_DRAWS = 20_000


def test_top_k_masks_outside_k_largest_and_matches_renormalised_distribution():
    # vocabulary ids shuffled so the top-k are not a prefix: checks the scatter back
    perm = torch.randperm(12, generator=torch.Generator().manual_seed(5))
    base = torch.tensor([2.0, 1.5, 1.0, 0.5, 0.4, 0.3, 0.2, 0.1, 0.0, -1.0, -2.0, -3.0])
    logits = torch.empty(12).scatter_(0, perm, base)
    allowed = perm[:4].tolist()  # ids of the 4 largest logits
    T = 0.5
    torch.manual_seed(6)
    tok = sample(logits.expand(N_DRAWS, 12).contiguous(), [P(temperature=T, top_k=4)] * N_DRAWS).token_ids
    assert set(tok.unique().tolist()) <= set(allowed)
    want = torch.softmax(base[:4] / T, -1)
    assert chi2(tok, allowed, want) < CHI2_1E6[3]
    # the test has power: temperature ignored would be rejected
    assert chi2(tok, allowed, torch.softmax(base[:4], -1)) > 10 * CHI2_1E6[3]


def test_top_p_keeps_smallest_nucleus_and_matches_renormalised_distribution():
    probs = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.05, 0.03, 0.02])
    perm = torch.randperm(7, generator=torch.Generator().manual_seed(7))
    logits = torch.empty(7).scatter_(0, perm, probs.log())
    # cumulative 0.40, 0.65, 0.80: top_p = 0.75 keeps the first three
    allowed = perm[:3].tolist()
    torch.manual_seed(8)
    tok = sample(logits.expand(N_DRAWS, 7).contiguous(), [P(top_p=0.75)] * N_DRAWS).token_ids
    assert set(tok.unique().tolist()) == set(allowed)
    want = probs[:3] / probs[:3].sum()
    assert chi2(tok, allowed, want) < CHI2_1E6[2]
    assert chi2(tok, allowed, probs[:3]) > 10 * CHI2_1E6[2]  # rejects the un-renormalised one


def test_top_p_applies_to_what_top_k_kept_after_temperature():
    probs = torch.tensor([0.40, 0.25, 0.15, 0.10, 0.05, 0.03, 0.02])
    logits = probs.log()
    # T = 1, top_k = 4 -> [.444, .278, .167, .111]; top_p = 0.7 then keeps 2 (cum .444, .722)
    # (top-p on the un-truncated probs would keep 3: cum .40, .65, .80)
    mask = apply_top_k_top_p(logits[None], torch.tensor([4]), torch.tensor([0.7]))[0]
    assert torch.isfinite(mask).tolist() == [True, True] + [False] * 5
    # temperature comes first: T = 0.25 sharpens to ~[.86, .13, ...] -> top_p 0.7 keeps 1
    tok = sample(logits.expand(2000, 7).contiguous(), [P(temperature=0.25, top_k=4, top_p=0.7)] * 2000).token_ids
    assert (tok == 0).all()


def test_top_p_one_does_not_cut_the_tail():
    # 1000 ids with near-zero mass after a dominant one: a cumsum that rounds to 1.0 early
    # must not drop them when top_p is off, even if another row forces the sort path
    logits = torch.full((2, 1000), -30.0)
    logits[:, 0] = 30.0
    x = apply_top_k_top_p(logits, torch.tensor([0, 3]), torch.tensor([1.0, 1.0]))
    assert torch.isfinite(x[0]).all()
    assert torch.isfinite(x[1]).sum() == 3


# --- seeds ---------------------------------------------------------------------------------


def _run_steps(rows, target, steps, state):
    """Tokens of row ``target`` over ``steps`` steps; rows = [(logits [V], params)]."""
    logits = torch.stack([r[0] for r in rows])
    params = [r[1] for r in rows]
    out = []
    for s in range(steps):
        st = SamplingTensors.from_params(params, "cpu", state)
        out.append(int(SAMPLER(logits, st, [s] * len(rows)).token_ids[target]))
    return out


def test_seeded_rows_reproduce_across_batch_composition_and_order():
    V = 1000
    g = torch.Generator().manual_seed(9)
    la, lb, lc, ld = (torch.randn(V, generator=g) * 0.5 for _ in range(4))
    a = (la, P(temperature=0.9, seed=7))
    b = (lb, P(temperature=1.2, top_k=50, top_p=0.9, seed=9))
    state = SeedState()
    torch.manual_seed(100)
    ref_a = _run_steps([a, (lc, P()), b], 0, 12, state)
    ref_b = _run_steps([a, (lc, P()), b], 2, 12, state)
    torch.manual_seed(200)  # different default-generator state, other rows, other order
    other = [(ld, P(seed=3, top_k=10)), b, (lc, P(temperature=0.0)), (lc, P(top_p=0.3)), a]
    assert _run_steps(other, 4, 12, state) == ref_a
    assert _run_steps(other, 1, 12, state) == ref_b
    assert _run_steps([a], 0, 12, SeedState()) == ref_a  # alone, fresh generators
    assert len(set(ref_a)) > 6  # the step index moves the stream on


def test_different_seeds_differ():
    V = 1000
    logits = torch.zeros(V)  # uniform: any two streams agree on a token with p = 1/V
    t1 = _run_steps([(logits, P(seed=1))], 0, 16, SeedState())
    t2 = _run_steps([(logits, P(seed=2))], 0, 16, SeedState())
    assert t1 != t2
    assert sum(x == y for x, y in zip(t1, t2)) <= 2


def test_seeded_rows_need_step_index():
    logits = torch.randn(2, 10)
    st = SamplingTensors.from_params([P(seed=1), P()], "cpu")
    with pytest.raises(ValueError, match="step_index"):
        SAMPLER(logits, st)
    SAMPLER(logits, st, torch.tensor([3, 0]))  # a CPU tensor is accepted
    SAMPLER(logits, SamplingTensors.from_params([P(), P()], "cpu"))  # unseeded: not needed


# --- logprobs ------------------------------------------------------------------------------


def test_logprobs_are_raw_log_softmax_sorted_top_k_and_sampled():
    torch.manual_seed(10)
    logits = torch.randn(4, 100).to(torch.bfloat16)
    params = [P(temperature=0.5, top_k=3, logprobs=2), P(temperature=0.0), P(top_p=0.5, logprobs=5), P(logprobs=0)]
    out = sample(logits, params)
    lp = out.logprobs
    assert isinstance(lp, LogprobsTensors)
    raw = logits.float().log_softmax(-1)  # not temperature-scaled, not masked
    assert lp.top_logprobs.shape == (4, 5) and lp.top_ids.shape == (4, 5)
    assert (lp.top_logprobs[:, 1:] <= lp.top_logprobs[:, :-1]).all()
    torch.testing.assert_close(lp.top_logprobs, raw.topk(5, -1).values)
    torch.testing.assert_close(lp.top_logprobs, raw.gather(1, lp.top_ids))
    torch.testing.assert_close(lp.sampled_logprobs, raw.gather(1, out.token_ids[:, None])[:, 0])
    ranks = (raw > raw.gather(1, out.token_ids[:, None])).sum(-1) + 1
    assert torch.equal(lp.sampled_ranks, ranks)
    assert lp.sampled_ranks[1] == 1  # greedy row samples the argmax


def test_logprobs_absent_or_zero():
    logits = torch.randn(3, 20)
    assert sample(logits, [P()] * 3).logprobs is None
    lp = sample(logits, [P(logprobs=0), P(), P()]).logprobs
    assert lp.top_logprobs.shape == (3, 0) and lp.sampled_logprobs.shape == (3,)


# --- validation ----------------------------------------------------------------------------


def test_invalid_shapes_raise():
    st = SamplingTensors.from_params([P(), P()], "cpu")
    with pytest.raises(ValueError, match=r"\[B, V\]"):
        SAMPLER(torch.randn(10), st)
    with pytest.raises(ValueError, match=r"\[B, V\]"):
        SAMPLER(torch.randn(2, 1, 10), st)
    with pytest.raises(ValueError, match="rows"):
        SAMPLER(torch.randn(3, 10), st)
    with pytest.raises(ValueError, match="empty"):
        SAMPLER(torch.randn(2, 0), st)
    with pytest.raises(TypeError, match="floating"):
        SAMPLER(torch.randint(0, 5, (2, 10)), st)
    st_seeded = SamplingTensors.from_params([P(seed=1), P()], "cpu")
    with pytest.raises(ValueError, match="entries"):
        SAMPLER(torch.randn(2, 10), st_seeded, [0, 0, 0])
    with pytest.raises(ValueError, match="vocabulary"):
        SAMPLER(torch.randn(2, 4), SamplingTensors.from_params([P(logprobs=5), P()], "cpu"))


@pytest.mark.parametrize(
    "bad", [P(temperature=-0.1), P(temperature=math.nan), P(top_p=0.0), P(top_p=1.5), P(top_k=-2), P(logprobs=21)]
)
def test_invalid_params_raise(bad):
    with pytest.raises(ValueError):
        SamplingTensors.from_params([P(), bad], "cpu")


def test_sampling_tensors_layout():
    st = SamplingTensors.from_params(
        [P(temperature=0.0, seed=5), P(top_k=-1, seed=4), P(top_k=7, temperature=0.3), P(top_p=0.9)], "cpu"
    )
    assert st.temperature.tolist() == pytest.approx([1.0, 1.0, 0.3, 1.0])
    assert st.top_k.dtype == torch.int64 and st.top_k.tolist() == [0, 0, 7, 0]
    assert st.greedy.tolist() == [True, False, False, False]
    assert st.seeded_rows == (1,) and st.seeds == (4,)  # a greedy row's seed is unused
    assert st.needs_sort and st.any_greedy and not st.all_greedy and st.max_logprobs is None


def test_real_sampling_params_duck_type():
    SamplingParams = pytest.importorskip("kvq.engine.sampling_params").SamplingParams
    logits = torch.randn(2, 30)
    out = sample(logits, [SamplingParams(temperature=0.0), SamplingParams(top_k=1, seed=3)], [0, 0])
    assert torch.equal(out.token_ids, logits.argmax(-1))


# --- GPU -----------------------------------------------------------------------------------


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs CUDA")
def test_cuda_no_host_sync_and_seeded_reproducibility():
    torch.manual_seed(11)
    logits = torch.randn(6, 32000, device="cuda")
    params = [P(seed=1), P(), P(temperature=0.0), P(top_k=40, top_p=0.9, seed=2, logprobs=3), P(top_p=0.5), P()]
    state = SeedState()
    st = SamplingTensors.from_params(params, "cuda", state)
    torch.cuda.synchronize()
    torch.cuda.set_sync_debug_mode("error")
    try:
        st = SamplingTensors.from_params(params, "cuda", state)
        out = SAMPLER(logits, st, [4] * 6)
    finally:
        torch.cuda.set_sync_debug_mode("default")
    assert out.token_ids.device.type == "cuda"
    assert out.token_ids[2] == logits[2].argmax()
    alone = sample(logits[3:4].clone(), [params[3]], [4], state).token_ids
    assert alone[0] == out.token_ids[3]
    alone = sample(logits[0:1].clone(), [params[0]], [4], SeedState()).token_ids
    assert alone[0] == out.token_ids[0]
