"""`deltaspec bench --only cost_model` at its smallest: real servers, a never-matching draft on a MoE target (the
case the cost model must not lose in), every output checked against target-only decoding by the bench itself."""
import torch

from benchmarks import cost_model, cost_model_sim, report


def test_served_rows_compare_k0_the_best_fixed_k_and_the_cost_model(tmp_path, capsys):
    prompts = [[72, 101, 108, 108, 111], [100, 101, 102, 32, 102, 40]]
    rows = cost_model.served(*cost_model.moe_pair(tmp_path), prompts, (1,), (1,), 1, 8, window_s=0.3,
                             flags=("--max-batch", "1"))
    (row,) = rows
    assert row["concurrency"] == 1 and set(row["fixed_once"]) == {1} and row["best_fixed_k"] == 1
    assert list(row["tokens_per_s"]) == ["k = 0", f"fixed k = {row['best_fixed_k']}", "cost model"]
    assert all(len(v) == 1 and v[0] > 0 for v in row["tokens_per_s"].values())
    assert row["cost_k"] == [0.0]  # the tally learnt in the warm-up that this draft never matches: no drafts
    cost_model.print_rows({"header": "test", "cost_k_max": 8, "max_new_tokens": 8, "warm_generations": 8,
                           "window_s": 0.3, "repeats": 1, "pairs": {"useless draft": rows}})
    out = capsys.readouterr().out
    assert "cost / better" in out and "useless draft: N = 1 " in out


def test_a_cells_median_interval_holds_the_median_as_often_as_it_says():
    """Nine repeats: the 2nd and 8th of them, 96.1 %; drawn afresh from a known distribution, the interval holds
    its median about that often; a miss whose interval reaches the goal is said to be unresolved."""
    assert report.median_interval([float(i) for i in range(9, 0, -1)]) == (2.0, 8.0, 0.9609375)
    assert report.median_interval([3.0, 1.0, 2.0])[:2] == (1.0, 3.0)  # too few repeats for 95 %: the range
    g = torch.Generator().manual_seed(3)
    held = sum(lo <= 0 <= hi for lo, hi, _ in (report.median_interval(torch.randn(9, generator=g).tolist())
                                                for _ in range(4000)))
    assert 0.95 <= held / 4000 <= 0.97
    spread = [0.9, 0.92, 0.93, 0.95, 0.96, 0.97, 0.98, 1.0, 1.1]
    assert report.median_verdict([1.0] * 9, low=0.97) == "met"
    assert "not resolved" not in report.median_verdict([0.9] * 9, low=0.97)
    assert "not resolved" in report.median_verdict(spread, low=0.97)
    assert report.median_verdict(spread, low=0.95, high=1.05) == "met"
    assert "not resolved" in report.median_verdict([x + 0.1 for x in spread], high=1.05)


def test_simulated_rounds_compare_the_cost_model_with_every_fixed_k(capsys):
    """The simulation behind the bench's last table: a draft that matches 96 % of the time behind the embedded
    pair's measured costs, where the longest round pays most."""
    (row,) = cost_model_sim.simulate([("pair", True, cost_model_sim.Iid(0.96))])
    assert row["best_fixed_k"] == 8 and 0 < row["cost_vs_best"] <= 1.05 and row["mean_k"] > 6
    cost_model_sim.print_rows([row])
    assert "Iid(a=0.96)" in capsys.readouterr().out


def test_simulated_sessions_alternating_a_good_and_a_useless_draft():
    """Sessions alternate between a draft the target agrees with 90 % of the time and one it never agrees with, on
    the MoE target's costs: no fixed k suits both, and the model, drafting in the one and not in the other, beats
    the best of them (k = 0 there)."""
    sim = cost_model_sim
    case = sim.Alternating(sim.Iid(0.9), sim.Iid(0.0))
    assert sim.session_draft(case, 0) == sim.Iid(0.9) and sim.session_draft(case, 1) == sim.Iid(0.0)
    (row,) = sim.simulate([("moe", False, case)])
    assert row["best_fixed_k"] == 0 and row["cost_vs_best"] > 1.05 and 0.5 < row["mean_k"] < 3
