"""`pdserve plan`: should I disaggregate, and how many of each? A discrete-event simulator of a pdserve deployment
(sim.py) driven by a cost model measured on the real engine (costs.py, written by `python -m bench.costs`), and the
goodput search that compares prefill:decode splits with colocated replicas on the same GPUs (plan.py). Torch-free:
it imports nothing of pdserve but its config."""
