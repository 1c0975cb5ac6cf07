"""The control plane: agents finding each other, planning the pipeline, and following the plan.

Owns: discovery (mDNS and static peers), device profiles (profile), the pure planner (planner), membership as a
pure ``apply(state, event)`` (membership), control-plane messages (control) and their client (net), the leader's
coordinator (coordinator) and what it shows (view), a member's side (member), the stage an agent hosts (stage_host)
and its metrics (stage_metrics), the stages' timelines for the dashboard (telemetry), weights without a hub
(weight_server), a local cluster of agent processes (local_cluster), and the cluster's security: the cluster key
(keys), agent identities (identity), the proofs keyed by the key (handshake), both ends of the mutual
authentication (guard, pinning) and what the agent asks of them (security).

May import: config, decoding, pipeline, spec, model and the base modules. planner and membership are pure: no
asyncio, aiohttp or zeroconf.
"""
