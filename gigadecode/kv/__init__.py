"""The paged KV cache: specs and HMA grouping (`spec`), buffers and their packed-FP8 layout (`cache`),
the block pool and per-group managers (`manager`)."""
