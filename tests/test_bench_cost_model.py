"""`deltaspec bench --only cost_model` at its smallest: real servers, a never-matching draft on a MoE target (the
case the cost model must not lose in), every output checked against target-only decoding by the bench itself."""
from benchmarks import cost_model


def test_served_rows_compare_the_three_runs(tmp_path, capsys):
    prompts = [[72, 101, 108, 108, 111], [100, 101, 102, 32, 102, 40]]
    rows = cost_model.served(*cost_model.moe_pair(tmp_path), prompts, (1,), 1, 8)
    (row,) = rows
    assert row["concurrency"] == 1 and set(row["tokens_per_s"]) == set(cost_model.RUNS)
    assert all(len(v) == 1 and v[0] > 0 for v in row["tokens_per_s"].values())
    assert row["cost_k"] == [0.0]  # the tally learnt in the warm-up that this draft never matches: no drafts
    cost_model.print_rows({"header": "test", "k": cost_model.K, "max_new_tokens": 8, "warm_generations": 8,
                           "pairs": {"MoE target, random draft": rows}})
    assert "cost / k=0" in capsys.readouterr().out
