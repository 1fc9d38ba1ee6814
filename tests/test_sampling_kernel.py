"""The one-pass sampling kernel (kvq.models.sampling_triton), under the Triton interpreter on the
CPU and compiled on a GPU: greedy rows are torch's argmax (first maximal id), a draw follows
softmax(logits / T) (chi-square, fixed seeds, so deterministic), a row's token depends only on its
logits, temperature and seed, and the sampler sends every uncut row through it on CUDA."""

from __future__ import annotations

import pytest
import torch

from kvq.models import sampling_triton
from kvq.models.sampling_triton import sample_rows
from tests.test_sampler import P, chi2

DEV = "cuda" if torch.cuda.is_available() else "cpu"


def _rows(logits, temps, greedy, seeds):
    return sample_rows(logits.to(DEV), torch.tensor(temps, dtype=torch.float32, device=DEV),
                       torch.tensor(greedy, device=DEV), torch.tensor(seeds, dtype=torch.int64, device=DEV)).cpu()


def test_greedy_rows_are_torchs_argmax_across_blocks_and_dtypes():
    g = torch.Generator().manual_seed(1)
    V = 5000  # two 4096-wide blocks: the running maximum crosses a block edge
    logits = torch.randn(6, V, generator=g)
    logits[1, [4095, 4096, 4999]] = 9.0  # a tie across the block edge: the lower id wins
    logits[2, V - 1] = 9.0  # the maximum in the ragged last block
    logits[3] = float("-inf")
    logits[3, 17] = 0.0
    logits[4] = float("-inf")  # nothing but -inf: id 0, as torch's argmax
    logits[5, [4999, 7, 4998]] = 9.0  # a tie inside the last chunk and one far below it
    for dt in (torch.float32, torch.bfloat16):
        x = logits.to(dt)
        got = _rows(x, [1.0] * 6, [True] * 6, list(range(6)))
        assert got.tolist() == x.float().argmax(-1).tolist() == [int(x[0].float().argmax()), 4095, V - 1, 17, 0, 7]
        all_greedy = sample_rows(x.to(DEV), torch.ones(6, device=DEV), torch.ones(6, dtype=torch.bool, device=DEV),
                                 torch.zeros(6, dtype=torch.int64, device=DEV), all_greedy=True).cpu()
        assert torch.equal(all_greedy, got)


@pytest.mark.parametrize("T", [2.0])  # (0.5 left out for time: a kernel multiplying by T fails at 2.0 too)
def test_draws_follow_softmax_of_logits_over_temperature(T):
    """1500 rows of the same logits, each its own seed: the counts fit softmax(x / T) and not
    softmax(x) (what a kernel that ignored the temperature would draw from)."""
    x = torch.tensor([1.0, 0.2, -0.5, 0.0, -3.0, 0.7])
    n = 1500
    got = _rows(x.expand(n, -1).contiguous(), [T] * n, [False] * n, list(range(7, 7 + n)))
    got = torch.where(got == 4, 2, got)  # the rare id 4 shares id 2's cell: every cell expects >= 5 draws

    def cells(p):
        return torch.cat([p[:2], p[2:3] + p[4:5], p[3:4], p[5:]])

    ids = [0, 1, 2, 3, 5]
    assert chi2(got, ids, cells(torch.softmax(x / T, -1))) < 33.38  # chi2.ppf(1 - 1e-6, df=4)
    assert chi2(got, ids, cells(torch.softmax(x, -1))) > 100


def test_a_rows_token_depends_on_its_logits_temperature_and_seed_only():
    g = torch.Generator().manual_seed(2)
    a = torch.randn(1000, generator=g)
    b = torch.randn(1000, generator=g)
    alone = _rows(a[None], [0.8], [False], [12345])[0]
    mixed = _rows(torch.stack([b, a, b]), [1.3, 0.8, 0.1], [False, False, True], [99, 12345, 7])
    assert mixed[1] == alone
    draws = {int(_rows(a[None], [0.8], [False], [s])[0]) for s in range(40)}
    assert len(draws) > 10  # another seed, another draw


@pytest.mark.parametrize("block,chunk", [(4, 4), (4, 8), (8, 16)])
def test_small_tiles_keep_greedy_ties_and_draws(block, chunk, monkeypatch):
    g = torch.Generator().manual_seed(3)
    V, n = 37, 24  # a ragged last chunk and block
    logits = torch.randn(n, V, generator=g)
    logits[1, [chunk - 1, chunk]] = 9.0  # a tie across a chunk edge
    logits[2, [V - 1, V - 2]] = 9.0  # a tie in the ragged last chunk
    logits[3] = float("-inf")
    logits[4] = float("-inf")
    logits[4, V - 1] = 0.0
    temps = [0.7 + 0.1 * (r % 5) for r in range(n)]
    seeds = [1000 + 17 * r for r in range(n)]
    draws = _rows(logits, temps, [False] * n, seeds)
    monkeypatch.setattr(sampling_triton, "BLOCK_V", block)
    monkeypatch.setattr(sampling_triton, "CHUNK_V", chunk)
    greedy = _rows(logits, temps, [True] * n, seeds)
    assert greedy.tolist() == logits.argmax(-1).tolist()
    assert greedy[1:5].tolist() == [chunk - 1, V - 2, 0, V - 1]
    assert _rows(logits, temps, [False] * n, seeds).tolist() == draws.tolist()  # the default tiles' draws
    assert len(set(draws.tolist())) > 5


@pytest.mark.skipif(not torch.cuda.is_available(), reason="the sampler uses the kernel on CUDA only")
def test_sampler_on_cuda_sends_uncut_rows_through_the_kernel():
    from kvq.engine.sampler import Sampler, SamplingTensors, SeedState

    torch.manual_seed(5)
    logits = torch.randn(5, 32000, device="cuda")
    params = [P(seed=3), P(temperature=0.0), P(top_k=20, seed=4), P(temperature=0.7, seed=5), P(top_p=0.8)]
    st = SamplingTensors.from_params(params, "cuda", SeedState())
    out = Sampler()(logits, st, [2] * 5).token_ids.cpu()
    assert out[1] == logits[1].argmax().item()
    from kvq.engine.sampler import row_seed

    for r in (0, 3):
        key = torch.tensor([row_seed(params[r].seed, 2) & ((1 << 63) - 1)], device="cuda")
        t = torch.tensor([params[r].temperature], device="cuda")
        want = sample_rows(logits[r:r + 1], t, torch.zeros(1, dtype=torch.bool, device="cuda"), key)
        assert out[r] == want.item()
    st1 = SamplingTensors.from_params(params[2:3], "cuda", SeedState())
    assert out[2] == Sampler()(logits[2:3], st1, [2]).token_ids.item()  # a cut row: the exponential race
