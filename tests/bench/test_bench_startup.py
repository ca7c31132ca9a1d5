"""bench.startup's reading of a stack's start stages from its log (its runs are in the GPU kit's CPU test)."""

from __future__ import annotations

from bench.startup import start_stages

LOG = """\
2026-12-05 01:40:17 INFO up: started 2 node(s) and the router beside them
2026-12-05 01:40:17 INFO decode 29234: starting: tiny (float32 on cpu, cores 1)
2026-12-05 01:40:17 INFO router: imported the router in 0.5 s
2026-12-05 01:40:18 INFO decode 29234: imported torch and the engine in 1.4 s
2026-12-05 01:40:18 INFO prefill 29233: imported torch and the engine in 1.3 s
2026-12-05 01:40:18 INFO decode 29234: loaded the weights of tiny (float32 on cpu) in 0.2 s
2026-12-05 01:40:18 INFO router: decode@tcp://127.0.0.1:30281 joined
2026-12-05 01:40:19 INFO prefill 29233: loaded the weights of tiny (float32 on cpu) in 0.3 s
2026-12-05 01:40:19 INFO decode 29234: built the kernels and warmed up in 0.1 s (attention: cpu; KV pool: 8 blocks)
2026-12-05 01:40:19 INFO decode 29234: decode node ready in 0.4 s: takes requests from the router at tcp://x
2026-12-05 01:40:19 INFO router: decode@tcp://127.0.0.1:30281 is up (joined 0.2 s after the router started)
2026-12-05 01:40:19 INFO up: the decode node is ready, 1.8 s after launch
2026-12-05 01:40:19 INFO prefill 29233: built the kernels and CUDA graphs and warmed up in 3.5 s (attention: triton)
2026-12-05 01:40:19 INFO prefill 29233: prefill node ready in 4.0 s: takes requests from the router at tcp://y
2026-12-05 01:40:19 INFO up: the prefill node is ready, 2.0 s after launch
2026-12-05 01:40:19 INFO router: prefill@tcp://127.0.0.1:31706 is up (joined 0.3 s after the router started)
2026-12-05 01:40:19 INFO up: ready 2.1 s after launch: every node loaded and warmed up, the router joined them
"""


def test_each_process_start_stages_are_read_from_the_stacks_log():
    assert start_stages(LOG) == {
        "router": {"imported_s": 0.5},
        "decode 29234": {"imported_s": 1.4, "weights_s": 0.2, "kernels_and_graphs_s": 0.1, "ready_s": 0.4},
        "prefill 29233": {"imported_s": 1.3, "weights_s": 0.3, "kernels_and_graphs_s": 3.5, "ready_s": 4.0},
        "decode": {"joined_s": 0.2, "ready_after_launch_s": 1.8},
        "prefill": {"ready_after_launch_s": 2.0, "joined_s": 0.3},
        "up": {"ready_after_launch_s": 2.1},
    }
