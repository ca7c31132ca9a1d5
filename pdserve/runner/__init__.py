"""Model execution: the model runner over a paged KV pool, its per-device backends and kernels (C on the CPU, Triton
on a GPU), the step graphs, the sampler and guided decoding's token masks. It runs what the engine's scheduler
decided."""
