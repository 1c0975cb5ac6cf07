"""Every benchmark, report and chart: the emulated edge cluster (edge, report, charts), the model core against
transformers (core), the data path (hop), single-device speculation and the tree tuner (single_device), the
few-row kernels (kernels), and the engine against llama.cpp on one device (engine, engine_report, llamacpp).

A leaf: no product module imports it (only commands/ does). May import every product part.
"""

ENGINE_PARTS = ("decode", "rows", "memory")  # what bench-engine measures (engine.py), in run order
