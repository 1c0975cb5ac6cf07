"""The leader's HTTP API: OpenAI-compatible completions over the cluster, health and cluster views (app).

May import: cluster, config, decoding, pipeline, spec, model and the base modules.
"""
