"""Counting memory exactly: peak live tensor bytes, a CPU run against the prediction, the CUDA allocator replay, and
a GPU's own overheads measured without training."""
