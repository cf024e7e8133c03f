"""Training data: reading JSONL in the common formats and preparing it for TRL."""

from lowmem_ft.data.formats import LoadedData, load_jsonl

__all__ = ["LoadedData", "load_jsonl"]
