"""Training data: reading JSONL in the common formats, tokenizing it (cached), fitting it into the token budget,
and its length profile for the planner."""

from lowmem_ft.data.formats import LoadedData, load_jsonl
from lowmem_ft.data.profile import LengthProfile, length_profile

__all__ = ["LengthProfile", "LoadedData", "length_profile", "load_jsonl"]
