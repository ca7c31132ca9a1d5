"""pdserve's benchmark harness: workloads, load generators, baselines and the side-by-side runner."""
