"""The engine's control core: what runs and when. The scheduler (its block manager from kv/), the requests and their
states, the step loop (`Engine`), and the parts it is given to run a step with (`EngineParts`: a model runner from
runner/ or the mock engine). Nothing here runs a model."""
