"""The data plane: how hidden states stream through the stages of a pipeline.

Owns: the in-band messages (messages) and their binary frames (codec), the pure stage core (stage), the async stage
worker (worker), websocket links (transport) and their server end (ring_server), and edge-device emulation of slow
links and slow compute (emulation).

May import: spec, model and the base modules. The pure parts (messages, codec, stage) import no asyncio, aiohttp or
zeroconf.
"""
