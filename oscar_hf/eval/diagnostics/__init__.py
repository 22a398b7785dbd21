"""Quality diagnostics: metric definitions, per-layer error decomposition through any KV cache, reports."""
