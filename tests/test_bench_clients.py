"""bench --clients' report: what auto ran per client count and the rates it measured, beside the figures."""

from flowspec_p2p.bench.clients import markdown


def test_the_report_says_what_auto_ran_and_measured():
    fig = {"tokens_per_s": 40.0, "vs_fewest": 3.2, "ttft_s": {"p50": 1.0, "p99": 2.0},
           "itl_s": {"p50": 0.1, "p99": 0.2}, "identical": "12/12"}
    res = {"stages": 4, "command": "flowspec bench --clients 1,4", "link_mbps": 100, "link_latency_ms": 2,
           "slowdown": 5, "max_tokens": 128, "rounds": 3, "prompts": 4, "load_average": [1.0, 2.0],
           "modes": {"ar": {"4": fig}, "auto": {"1": {**fig, "auto_chose": {"flowspec": 3}},
                                                "4": {**fig, "auto_chose": {"ar": 10, "flowspec": 2}}}},
           "auto_rates": {"epoch 1 greedy load 3-4": {"ar": {"tokens_per_s": 36.1},
                                                      "flowspec": {"tokens_per_s": 28.0}}}}
    md = markdown(res)
    assert "| auto | 4 | 40.0 | 3.2x |" in md
    assert "auto ran 1 client(s): flowspec 3; 4 client(s): ar 10, flowspec 2." in md
    assert "- epoch 1 greedy load 3-4: ar 36.1, flowspec 28.0" in md
    del res["auto_rates"]
    assert "measured rates" not in markdown(res)
