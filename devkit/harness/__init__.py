"""The memory model against exact measurement: real training steps on random-initialized models, each phase's peak
measured (`PeakMemory` on the CPU, the CUDA allocator on a GPU) beside what `lowmem_ft.memory` predicts.

`estimator` (whole steps over a grid of recipes), `long_context` (the long-context knobs), `moe` (mixtures of
experts) and `layer_bytes` (one decoder layer's kept activations). The tables they feed are written by `devkit.bench`.
"""
