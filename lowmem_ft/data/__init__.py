"""Training data: where it comes from (files, directories, saved and Hub data sets; mixes), reading and validating
it in the common formats, tokenizing it (cached), fitting it into the token budget, and its length profile for the
planner."""

from lowmem_ft.data.formats import LoadedData
from lowmem_ft.data.prepare import length_profile
from lowmem_ft.data.profile import LengthProfile
from lowmem_ft.data.readers import load_file
from lowmem_ft.data.sources import DataSource, check_source

__all__ = ["DataSource", "LengthProfile", "LoadedData", "check_source", "length_profile", "load_file"]
