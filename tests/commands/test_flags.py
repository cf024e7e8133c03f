"""Flag values refused while the command line is parsed, in the words transformers and the schema use."""

from __future__ import annotations

import argparse

import pytest
from transformers.utils.hub import convert_file_size_to_int

from lowmem_ft.commands import flags


@pytest.mark.parametrize("text", ["5GB", "500MB", "2GiB", "100KiB", "5gb", "1 GB", "750mib"])
def test_shard_sizes_transformers_reads_are_accepted_as_given(text):
    assert convert_file_size_to_int(flags.shard_size(text)) > 0


@pytest.mark.parametrize("text", ["1.5GB", "5", "GB", "5TB", "0GB", "-1GB", "big", "1e3GB"])
def test_shard_sizes_are_refused_before_the_merge(text):
    with pytest.raises(argparse.ArgumentTypeError):
        flags.shard_size(text)


def test_ranges_say_their_bounds_in_words():
    top_p = flags.ranged(float, gt=0, le=1)
    assert top_p("1") == 1.0 and top_p("0.01") == 0.01
    for bad, words in (("0", "must be in (0, 1], got 0"), ("nan", "finite"), ("x", "expected a number")):
        with pytest.raises(argparse.ArgumentTypeError, match=words.replace("(", r"\(").replace("]", r"\]")):
            top_p(bad)
    assert flags.count("3") == 3
    with pytest.raises(argparse.ArgumentTypeError, match="below 2,147,483,648"):
        flags.count(str(2**31))
