"""Decoding over a pipeline: the leader and its decoding modes.

Owns: what a mode sees of one request (context), the modes (ar, chunk: Chunk-PP, pipedec: PipeDec, flowspec: FlowSpec
with its pure bookkeeping in flowstate), the mode registry (registry), the leader (leader: requests, turns,
resumption, the demultiplexer; what each request does goes to its ledger, the base module ledger.py) and an
in-process ring for tests and benchmarks (loopback).

May import: pipeline, speculative, model and the base modules. flowstate is pure: no asyncio, aiohttp or zeroconf.
"""
