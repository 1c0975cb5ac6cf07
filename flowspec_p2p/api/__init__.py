"""The leader's HTTP API: OpenAI-compatible completions over the cluster, health and cluster views (app), the
Ollama-compatible routes (ollama), what both share (serving: a request's generation; catalog: the served model), the
request bodies and errors (schemas), logprobs in OpenAI's shapes (logprobs), Prometheus metrics (metrics), the access
log (access), the dashboard (dashboard, with its page in static/), and a member's API: forwarding to the leader
(proxy) and resuming a completion on the next leader (resume).

May import: cluster, config, decoding, pipeline, spec, model and the base modules.
"""
