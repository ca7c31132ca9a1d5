"""The engine: the only owner of requests, queues and KV blocks (scheduler, allocator, KV pool,
model runner and its per-device backends, sampler)."""
