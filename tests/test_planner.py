"""Unit tests for the verify-length planner and SPS tables (DESIGN.md §4.2)."""

from __future__ import annotations

import itertools
import json
import math
import random

import pytest
import torch

from dspark.spec.planner import (
    VerifyPlanner,
    global_argmax_budget,
    split_budget,
    sync_budget,
)
from dspark.spec.sps_table import SpsPoint, SpsTable, SpsTableError

# ---------------------------------------------------------------------------------------------
# Helpers
# ---------------------------------------------------------------------------------------------


class LookaheadPlanner:
    """Deliberately wrong: a global argmax over the SAME step's confidences (not lossless).

    Kept here, in tests only, to show that the sync test below tells early-stop from look-ahead.
    """

    def __init__(self, sps: SpsTable) -> None:
        self.sps = sps

    def plan(self, survivals: torch.Tensor, max_lens: torch.Tensor) -> torch.Tensor:
        return split_budget(survivals, max_lens, global_argmax_budget(survivals, max_lens, self.sps))


def fresh_seed() -> int:
    """A new seed each run (reported in assertion messages so a failure can be replayed)."""
    return random.SystemRandom().randrange(2**32)


def random_survivals(gen: torch.Generator, r: int, block_size: int, dyadic: bool) -> torch.Tensor:
    """Survivals [R, block_size] as cumulative products of confidences; dyadic ones make ties common."""
    if dyadic:
        choices = torch.tensor([0.0, 0.25, 0.5, 0.75, 1.0], dtype=torch.float64)
        conf = choices[torch.randint(len(choices), (r, block_size), generator=gen)]
    else:
        conf = torch.rand(r, block_size, generator=gen, dtype=torch.float64)
    return torch.cumprod(conf, dim=1).to(torch.float32)  # dyadic products are exact in float32 too


def random_table(gen: torch.Generator, max_tokens: int) -> SpsTable:
    """A mostly falling SPS curve with random bumps (so sync and the global argmax can disagree)."""
    n = min(int(torch.randint(1, 6, (1,), generator=gen)), max_tokens + 1)
    tokens = sorted((torch.randperm(max_tokens + 1, generator=gen)[:n] + 1).tolist())
    sps = [float(100.0 * (1.5 - i / n) + 40.0 * torch.rand(1, generator=gen)) for i in range(n)]
    return SpsTable(list(zip(tokens, sps, strict=True)))


def reference_sync(survivals: torch.Tensor, max_lens: torch.Tensor, sps: SpsTable) -> set[tuple[int, int]]:
    """The sync policy written out literally: the admitted (r, j) pairs (j 1-based)."""
    r_count, _ = survivals.shape
    a = survivals.tolist()
    items = [(r, j) for r in range(r_count) for j in range(1, int(max_lens[r]) + 1)]
    items.sort(key=lambda rj: (-a[rj[0]][rj[1] - 1], rj[1], rj[0]))
    admitted: set[tuple[int, int]] = set()
    tau = float(r_count)
    best = tau * sps(r_count)
    for r, j in items:
        tau_next = tau + a[r][j - 1]
        value = tau_next * sps(r_count + len(admitted) + 1)
        if not value > best:
            break
        admitted.add((r, j))
        tau, best = tau_next, value
    return admitted


def lengths_of(admitted: set[tuple[int, int]], r_count: int) -> list[int]:
    """Verify lengths from an admitted set, asserting it is a contiguous prefix per request."""
    out = []
    for r in range(r_count):
        js = sorted(j for rr, j in admitted if rr == r)
        assert js == list(range(1, len(js) + 1)), f"request {r} admitted non-prefix positions {js}"
        out.append(len(js))
    return out


def exhaustive_budget(survivals: torch.Tensor, max_lens: torch.Tensor, sps: SpsTable) -> int:
    """Try every per-request verify-length vector; return K = Σℓ of the best (smallest K on ties)."""
    r_count, _ = survivals.shape
    a = survivals.to(torch.float64).tolist()
    best_by_k: dict[int, float] = {}
    for lens in itertools.product(*(range(int(m) + 1) for m in max_lens)):
        k = sum(lens)
        tau = r_count + sum(math.fsum(a[r][:ell]) for r, ell in enumerate(lens))
        value = tau * sps(r_count + k)
        best_by_k[k] = max(best_by_k.get(k, -math.inf), value)
    top = max(best_by_k.values())
    return min(k for k, v in best_by_k.items() if v == top)


# ---------------------------------------------------------------------------------------------
# Planner
# ---------------------------------------------------------------------------------------------


@pytest.mark.parametrize("policy", ["sync", "lagged"])
def test_flat_table_verifies_everything(policy: str) -> None:
    gen = torch.Generator().manual_seed(fresh_seed())
    planner = VerifyPlanner(policy, SpsTable.flat())
    for _ in range(3):
        survivals = random_survivals(gen, 8, 7, dyadic=True)  # includes zero survivals
        max_lens = torch.randint(0, 8, (8,), generator=gen)
        assert torch.equal(planner.plan(survivals, max_lens), max_lens)
    # A multi-point table with one constant SPS is flat too.
    assert SpsTable([(1, 5.0), (100, 5.0)]).is_flat
    assert not SpsTable([(1, 5.0), (100, 4.0)]).is_flat


def test_sync_plan_gives_contiguous_prefixes() -> None:
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    for trial in range(150):
        r_count = int(torch.randint(1, 9, (1,), generator=gen))
        block_size = int(torch.randint(1, 8, (1,), generator=gen))
        survivals = random_survivals(gen, r_count, block_size, dyadic=trial % 2 == 0)
        max_lens = torch.randint(0, block_size + 1, (r_count,), generator=gen)
        sps = random_table(gen, r_count * (block_size + 1))
        # A flat table is the documented "verify everything" fast path, even past zero survivals.
        expected = (
            max_lens.tolist()
            if sps.is_flat
            else lengths_of(reference_sync(survivals, max_lens, sps), r_count)
        )
        got = VerifyPlanner("sync", sps).plan(survivals, max_lens)
        assert got.dtype == torch.int64 and got.shape == (r_count,)
        assert got.tolist() == expected, f"seed={seed} trial={trial}"


def test_sync_stops_at_first_non_improving_admission() -> None:
    # One request, a = [0.9, 0.8]. SPS(1)=10, SPS(2)=5, SPS(3)=5.
    # Objective: K=0: 1*10 = 10; K=1: 1.9*5 = 9.5 (worse: stop); K=2: 2.7*5 = 13.5 (best overall).
    table = SpsTable([(1, 10.0), (2, 5.0), (3, 5.0)])
    survivals = torch.tensor([[0.9, 0.8]])
    max_lens = torch.tensor([2])
    assert VerifyPlanner("sync", table).plan(survivals, max_lens).tolist() == [0]
    assert sync_budget(survivals, max_lens, table) == 0
    # The look-ahead planner would have verified both; sync must not.
    assert global_argmax_budget(survivals, max_lens, table) == 2
    assert LookaheadPlanner(table).plan(survivals, max_lens).tolist() == [2]


def test_sync_requires_strict_improvement() -> None:
    # a_1 = 0.25: K=1 gives 1.25 * 8 = 10 == K=0's 1 * 10 (exact in binary), so sync stops at 0.
    table = SpsTable([(1, 10.0), (2, 8.0), (3, 100.0)])
    survivals = torch.tensor([[0.25, 0.25]])
    assert VerifyPlanner("sync", table).plan(survivals, torch.tensor([2])).tolist() == [0]


def test_tie_order_is_position_then_request() -> None:
    # Every survival is 0.5; SPS flat up to 7 tokens then halves, so sync admits exactly 4 drafts:
    # K=4: (3 + 2) * 1 = 5; K=5: 5.5 * 0.5 = 2.75.
    table = SpsTable([(1, 1.0), (7, 1.0), (8, 0.5)])
    survivals = torch.full((3, 3), 0.5)
    max_lens = torch.tensor([3, 3, 3])
    # Order: (r0,j1) (r1,j1) (r2,j1) (r0,j2) | (r1,j2) ...
    assert VerifyPlanner("sync", table).plan(survivals, max_lens).tolist() == [2, 1, 1]
    assert split_budget(survivals, max_lens, 2).tolist() == [1, 1, 0]
    assert split_budget(survivals, max_lens, 5).tolist() == [2, 2, 1]
    # Position beats request: request 2's j=1 outranks request 0's j=2 at equal survival.
    survivals = torch.tensor([[1.0, 0.5], [0.25, 0.25], [0.5, 0.5]])
    assert split_budget(survivals, torch.tensor([2, 2, 2]), 2).tolist() == [1, 0, 1]
    # A cap hides the tied draft, so the next one in order takes the slot.
    assert split_budget(survivals, torch.tensor([2, 2, 0]), 2).tolist() == [2, 0, 0]


@pytest.mark.parametrize(
    ("survivals", "max_lens", "points", "budget", "sync", "plan"),
    [
        # Ranked: .9 .8 .6 .2; B = 2+K; SPS 100 90 60 55(interp) 50; τ 2 2.9 3.7 4.3 4.5
        # objective 200 261 222 236.5 225 -> K=1 both ways.
        (
            [[0.9, 0.6], [0.8, 0.2]],
            [2, 2],
            [(1, 100.0), (2, 100.0), (3, 90.0), (4, 60.0), (6, 50.0)],
            1,
            1,
            [1, 0],
        ),
        # Ranked: 1 .75 .5(r0) .5(r1); SPS(2..6) 100 93.33 86.67 80 40; τ 2 3 3.75 4.25 4.75
        # objective 200 280 325 340 190 -> K=3.
        ([[1.0, 0.5], [0.75, 0.5]], [2, 2], [(2, 100.0), (5, 80.0), (6, 40.0)], 3, 3, [2, 1]),
        # Same with request 0 capped at 1: ranked 1 .75 .5(r1); objective 200 280 325 340 -> K=3.
        ([[1.0, 0.5], [0.75, 0.5]], [1, 2], [(2, 100.0), (5, 80.0), (6, 40.0)], 3, 3, [1, 2]),
        # One request, objective 10 9.5 13.5: the argmax is 2 but sync stops at 0.
        ([[0.9, 0.8]], [2], [(1, 10.0), (2, 5.0), (3, 5.0)], 2, 0, [0]),
    ],
)
def test_budget_matches_known_sps_table(survivals, max_lens, points, budget, sync, plan) -> None:
    s, m, table = torch.tensor(survivals), torch.tensor(max_lens), SpsTable(points)
    assert global_argmax_budget(s, m, table) == budget
    assert sync_budget(s, m, table) == sync
    assert VerifyPlanner("sync", table).plan(s, m).tolist() == plan


@pytest.mark.parametrize("lag", [1, 2])
def test_lagged_uses_budget_from_lag_steps_earlier(lag: int) -> None:
    # Uniform survivals v on 4x4 drafts and a linearly falling SPS give budgets that grow with v.
    table = SpsTable([(1, 96.0), (20, 20.0)])
    max_lens = torch.full((4,), 4)
    steps = [torch.full((4, 4), v) for v in (0.125, 1.0, 0.25, 0.5, 1.0, 0.125)]
    budgets = [global_argmax_budget(s, max_lens, table) for s in steps]
    assert len(set(budgets)) >= 3, budgets  # the test only means something if K changes step to step
    planner = VerifyPlanner("lagged", table, lag=lag)
    for t, s in enumerate(steps):
        got = planner.plan(s, max_lens)
        if t < lag:
            assert got.tolist() == VerifyPlanner("sync", table).plan(s, max_lens).tolist()
        else:
            assert got.tolist() == split_budget(s, max_lens, budgets[t - lag]).tolist(), f"step {t}"
            assert int(got.sum()) == budgets[t - lag]


def test_lagged_plans_as_sync_until_lag_steps_of_history() -> None:
    # The table where sync (K=0) and the global argmax (K=2) disagree: the first `lag` steps must be sync.
    table = SpsTable([(1, 10.0), (2, 5.0), (3, 5.0)])
    survivals, max_lens = torch.tensor([[0.9, 0.8]]), torch.tensor([2])
    planner = VerifyPlanner("lagged", table, lag=3)
    assert [planner.plan(survivals, max_lens).tolist() for _ in range(5)] == [[0], [0], [0], [2], [2]]


def test_lagged_falls_back_to_sync_after_reset() -> None:
    table = SpsTable([(1, 96.0), (20, 20.0)])
    max_lens = torch.full((4,), 4)
    high, low = torch.full((4, 4), 1.0), torch.full((4, 4), 0.125)
    planner = VerifyPlanner("lagged", table, lag=1)
    planner.plan(high, max_lens)
    assert int(planner.plan(low, max_lens).sum()) == global_argmax_budget(high, max_lens, table)
    planner.reset()
    assert planner.plan(low, max_lens).tolist() == VerifyPlanner("sync", table).plan(low, max_lens).tolist()


def test_lagged_budget_is_clamped_to_admissible_drafts() -> None:
    table = SpsTable([(1, 96.0), (20, 20.0)])
    planner = VerifyPlanner("lagged", table, lag=1)
    planner.plan(torch.full((4, 4), 1.0), torch.full((4,), 4))  # budget well above 3
    # Next step: two requests capped at 1 and 2 drafts; everything admissible is verified.
    assert planner.plan(torch.full((2, 4), 1.0), torch.tensor([1, 2])).tolist() == [1, 2]


@pytest.mark.parametrize("policy", ["sync", "lagged"])
def test_max_lens_caps_each_request(policy: str) -> None:
    # SPS barely falls, so every draft is worth verifying; the caps alone decide the lengths.
    table = SpsTable([(1, 100.0), (64, 99.0)])
    survivals = torch.tensor([[1.0, 1.0, 1.0], [0.9, 0.8, 0.7], [0.5, 0.4, 0.3], [0.99, 0.98, 0.97]])
    max_lens = torch.tensor([0, 1, 3, 2])
    planner = VerifyPlanner(policy, table, lag=1)
    for _ in range(3):
        assert planner.plan(survivals, max_lens).tolist() == [0, 1, 3, 2]
    # Random caps never exceeded under a falling table either.
    gen = torch.Generator().manual_seed(fresh_seed())
    falling = SpsTable([(1, 100.0), (30, 10.0)])
    planner = VerifyPlanner(policy, falling, lag=1)
    for _ in range(20):
        s = random_survivals(gen, 6, 5, dyadic=False)
        caps = torch.randint(0, 6, (6,), generator=gen)
        got = planner.plan(s, caps)
        assert bool((got >= 0).all()) and bool((got <= caps).all())


def test_lagged_budget_equals_exhaustive_argmax() -> None:
    seed = fresh_seed()
    gen = torch.Generator().manual_seed(seed)
    for trial in range(200):
        r_count = int(torch.randint(1, 4, (1,), generator=gen))
        block_size = int(torch.randint(1, 4, (1,), generator=gen))
        survivals = random_survivals(gen, r_count, block_size, dyadic=trial % 2 == 0).to(torch.float64)
        max_lens = torch.randint(0, block_size + 1, (r_count,), generator=gen)
        table = random_table(gen, r_count * (block_size + 1))
        expected = exhaustive_budget(survivals, max_lens, table)
        assert global_argmax_budget(survivals, max_lens, table) == expected, f"seed={seed} trial={trial}"
        if table.is_flat:
            continue
        # The lagged planner spends exactly that budget on the following step (room for all of it).
        planner = VerifyPlanner("lagged", table, lag=1)
        planner.plan(survivals, max_lens)
        nxt = torch.full((r_count, block_size), 0.5, dtype=torch.float64)
        got = planner.plan(nxt, torch.full((r_count,), block_size))
        assert int(got.sum()) == expected, f"seed={seed} trial={trial}"


def test_empty_batch_plans_nothing() -> None:
    table = SpsTable([(1, 10.0), (8, 5.0)])
    for policy in ("sync", "lagged"):
        got = VerifyPlanner(policy, table).plan(torch.zeros(0, 7), torch.zeros(0, dtype=torch.int64))
        assert got.shape == (0,) and got.dtype == torch.int64


def test_large_batch_plan_is_contiguous_and_capped() -> None:
    gen = torch.Generator().manual_seed(fresh_seed())
    survivals = random_survivals(gen, 256, 16, dyadic=False)
    max_lens = torch.randint(0, 17, (256,), generator=gen)
    table = SpsTable([(1, 50.0), (512, 45.0), (4352, 5.0)])
    for policy in ("sync", "lagged"):
        got = VerifyPlanner(policy, table).plan(survivals, max_lens)
        assert bool((got <= max_lens).all())
        # Every verified draft outranks (or ties) every unverified admissible one.
        pos = torch.arange(16)[None, :]
        verified = pos < got[:, None]
        unverified = (pos >= got[:, None]) & (pos < max_lens[:, None])
        if verified.any() and unverified.any():
            assert survivals[verified].min() >= survivals[unverified].max()


@pytest.mark.parametrize(
    ("survivals", "max_lens", "field"),
    [
        (torch.tensor([[0.5, 0.25]]), torch.tensor([3]), "max_lens"),
        (torch.tensor([[0.5, 0.25]]), torch.tensor([-1]), "max_lens"),
        (torch.tensor([[0.5, 0.25]]), torch.tensor([1.0]), "max_lens"),
        (torch.tensor([[0.5, 0.25]]), torch.tensor([1, 1]), "max_lens"),
        (torch.tensor([[0.25, 0.5]]), torch.tensor([2]), "survivals"),
        (torch.tensor([[float("nan"), 0.5]]), torch.tensor([2]), "survivals"),
        (torch.tensor([0.5, 0.25]), torch.tensor([2]), "survivals"),
    ],
)
def test_bad_planner_inputs_name_field(survivals, max_lens, field) -> None:
    with pytest.raises(ValueError, match=field):
        VerifyPlanner("sync", SpsTable([(1, 10.0), (4, 5.0)])).plan(survivals, max_lens)


def test_unchecked_padding_past_cap_is_ignored() -> None:
    # Entries past a request's cap may be padding (even increasing or NaN); they are never read.
    survivals = torch.tensor([[0.5, float("nan")], [0.25, 0.75]])
    got = VerifyPlanner("sync", SpsTable.flat()).plan(survivals, torch.tensor([1, 1]))
    assert got.tolist() == [1, 1]


def test_bad_planner_settings_name_field() -> None:
    with pytest.raises(ValueError, match="policy"):
        VerifyPlanner("greedy", SpsTable.flat())
    with pytest.raises(ValueError, match="lag"):
        VerifyPlanner("lagged", SpsTable.flat(), lag=0)


# ---------------------------------------------------------------------------------------------
# SPS tables
# ---------------------------------------------------------------------------------------------


def test_sps_table_json_round_trip(tmp_path) -> None:
    table = SpsTable([(1, 41.2), (64, 40.7), (512, 22.9)], model="m", device="H200", dtype="bfloat16")
    path = tmp_path / "sps.json"
    table.save(path)
    doc = json.loads(path.read_text())
    assert doc == {
        "version": 1,
        "model": "m",
        "device": "H200",
        "dtype": "bfloat16",
        "points": [
            {"tokens": 1, "steps_per_second": 41.2},
            {"tokens": 64, "steps_per_second": 40.7},
            {"tokens": 512, "steps_per_second": 22.9},
        ],
    }
    loaded = SpsTable.load(path)
    assert loaded == table
    assert loaded.points[1] == SpsPoint(64, 40.7)
    assert SpsTable.load(_write(tmp_path, SpsTable.flat().to_dict())).is_flat


def test_sps_table_interpolates_and_clamps() -> None:
    table = SpsTable([(4, 100.0), (8, 60.0), (16, 20.0)])
    assert table(1) == 100.0 and table(4) == 100.0  # clamped below
    assert table(6) == pytest.approx(80.0)
    assert table(8) == 60.0
    assert table(12) == pytest.approx(40.0)
    assert table(16) == 20.0 and table(1000) == 20.0  # clamped above
    assert SpsTable([(5, 7.0)])(1) == 7.0 and SpsTable([(5, 7.0)])(99) == 7.0
    # The planner's vectorized lookup agrees with the scalar one bit for bit.
    n = torch.arange(0, 20)
    assert table.at(n).tolist() == [table(int(i)) for i in n]
    assert SpsTable([(5, 7.0)]).at(n).tolist() == [7.0] * 20


@pytest.mark.parametrize(
    ("doc", "field"),
    [
        ([], "<root>"),
        ({"version": 2, "points": [{"tokens": 1, "steps_per_second": 1.0}]}, "version"),
        ({"version": True, "points": [{"tokens": 1, "steps_per_second": 1.0}]}, "version"),
        ({"version": 1}, "points"),
        ({"version": 1, "points": []}, "points"),
        ({"version": 1, "model": 3, "points": [{"tokens": 1, "steps_per_second": 1.0}]}, "model"),
        ({"version": 1, "dtype": None, "points": [{"tokens": 1, "steps_per_second": 1.0}]}, "dtype"),
        ({"version": 1, "pionts": [], "points": []}, "pionts"),
        ({"version": 1, "points": [{"tokens": 1}]}, r"points\[0\]\.steps_per_second"),
        ({"version": 1, "points": [{"tokens": 0, "steps_per_second": 1.0}]}, r"points\[0\]\.tokens"),
        ({"version": 1, "points": [{"tokens": 1.5, "steps_per_second": 1.0}]}, r"points\[0\]\.tokens"),
        ({"version": 1, "points": [{"tokens": 1, "steps_per_second": 0}]}, r"points\[0\]\.steps_per_second"),
        (
            {"version": 1, "points": [{"tokens": 1, "steps_per_second": -2.0}]},
            r"points\[0\]\.steps_per_second",
        ),
        (
            {"version": 1, "points": [{"tokens": 1, "steps_per_second": "fast"}]},
            r"points\[0\]\.steps_per_second",
        ),
        ({"version": 1, "points": [{"tokens": 1, "steps_per_second": 1.0, "x": 1}]}, r"points\[0\]\.x"),
        (
            {
                "version": 1,
                "points": [{"tokens": 4, "steps_per_second": 1.0}, {"tokens": 2, "steps_per_second": 1.0}],
            },
            r"points\[1\]\.tokens",
        ),
        (
            {
                "version": 1,
                "points": [{"tokens": 4, "steps_per_second": 1.0}, {"tokens": 4, "steps_per_second": 1.0}],
            },
            r"points\[1\]\.tokens",
        ),
    ],
)
def test_bad_sps_table_names_field(doc, field) -> None:
    with pytest.raises(SpsTableError, match=f"^{field}"):
        SpsTable.from_dict(doc)


def test_bad_sps_table_file_names_field(tmp_path) -> None:
    path = tmp_path / "bad.json"
    path.write_text('{"version": 1, "points": [{"tokens": 1, "steps_per_second": NaN}]}')
    with pytest.raises(SpsTableError, match=r"^points\[0\]\.steps_per_second"):
        SpsTable.load(path)
    path.write_text("{not json")
    with pytest.raises(SpsTableError, match="^<root>"):
        SpsTable.load(path)
    with pytest.raises(SpsTableError, match=r"^points\[1\]\.tokens"):
        SpsTable([(2, 1.0), (1, 1.0)])


def _write(tmp_path, doc) -> str:
    path = tmp_path / "doc.json"
    path.write_text(json.dumps(doc))
    return str(path)
