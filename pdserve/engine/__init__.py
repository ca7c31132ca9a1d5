"""The engine: the only owner of requests, queues and KV blocks (scheduler, its block manager and KV pool from kv/,
model runner and its per-device backends, sampler)."""
