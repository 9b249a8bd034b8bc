"""paraflex.engine.worker: model execution on a device: the stage model, weights, paged attention over the KV pool, sampling, tokenizers."""
