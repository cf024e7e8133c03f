"""Counting memory exactly: peak live tensor bytes, a CPU run against the prediction, the CUDA allocator replay."""
