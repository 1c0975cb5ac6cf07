"""The speculative core: draft trees and how they are drafted and verified.

Owns: draft trees as flat arrays (tree), lossless verification (verify: greedy walks, exact rejection sampling),
the EAGLE-style draft head and its bundles (head, assets/), the drafters (drafter: EAGLE-2 dynamic trees, tree
settings), prompt-lookup candidates (ngram), single-device speculative decoding (decoder) and public EAGLE heads as
published (eagle: the EAGLE-1/2 and EAGLE-3 formats; eagle3: EAGLE-3's network over the target's tapped layers).

May import: model and the base modules. Pure: no asyncio, aiohttp or zeroconf.
"""
