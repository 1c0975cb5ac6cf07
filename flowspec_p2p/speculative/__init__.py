"""The speculative core: draft trees and how they are drafted and verified.

Owns: draft trees as flat arrays (tree), lossless verification (verify: greedy walks, exact rejection sampling),
the EAGLE-style draft head and its bundles (head, assets/), the drafters (drafter: EAGLE-2 dynamic trees, tree
settings), prompt-lookup candidates (ngram) and single-device speculative decoding (decoder).

May import: model and the base modules. Pure: no asyncio, aiohttp or zeroconf.
"""
