"""The engine: model, kernels, KV layout, page pool, scheduler and the engine loop (no HTTP, no Ray)."""
