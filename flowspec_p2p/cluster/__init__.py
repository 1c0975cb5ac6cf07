"""The control plane: agents finding each other, planning the pipeline, and following the plan.

Owns: discovery (mDNS and static peers), device profiles (profile), the pure planner (planner), membership as a
pure ``apply(state, event)`` (membership), control-plane messages and signing (control), the leader's coordinator
(coordinator) and what it shows (view), a member's side (member), the stage an agent hosts (stage_host) and its
metrics (stage_metrics), the stages' timelines for the dashboard (telemetry), weights without a hub (weight_server)
and a local cluster of agent processes (local_cluster).

May import: config, decoding, pipeline, spec, model and the base modules. planner and membership are pure: no
asyncio, aiohttp or zeroconf.
"""
