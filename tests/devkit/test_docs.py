"""The docs: the generated references equal what `python -m devkit.docs` writes from the code now, every relative
link and every repository path or module named in backticks resolves, and the README stays a landing page that names
both test tiers (`devkit/docs.py`)."""

from __future__ import annotations

import re

import pytest

from devkit import docs

ROOT = docs.ROOT
PAGES = docs.pages()


def _name(page):
    return str(page.relative_to(ROOT))


@pytest.mark.parametrize("page", sorted(docs.render()), ids=_name)
def test_generated_reference_matches_the_code(page):
    assert page.exists(), f"{_name(page)} is missing: run python -m devkit.docs"
    assert page.read_text(encoding="utf-8") == docs.render()[page], (
        f"{_name(page)} differs from the parsers / the recipe schema: run python -m devkit.docs and commit it"
    )


def test_the_references_cover_every_command_and_key():
    from lowmem_ft.cli import COMMANDS
    from lowmem_ft.recipe.schema import KEYS

    cli, keys = docs.cli_page(), docs.keys_page()
    for command in [*COMMANDS, "data stats"]:
        assert f"\n## lowmem-ft {command}\n" in cli, command
    assert "`--seq-len`" in cli and "`--accelerate-arg`" in cli and "`--max-new-tokens`" in cli
    for path, key in KEYS.items():
        assert f"| `{key.name}` |" in keys.split(f"\n## {key.section}\n")[1].split("\n## ")[0], path


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_relative_link_resolves(page):
    assert docs.broken_links(page) == []


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_path_and_module_named_exists(page):
    assert docs.missing_paths(page) == []


def test_the_checks_find_what_is_broken():
    page = ROOT / "docs" / "README.md"
    text = (
        "[a](usage.md#no-such-heading) [b](no-such-page.md) [ok](usage.md#bad-input-one-line-exit-2) [w](https://x.org)"
    )
    assert docs.broken_links(page, text) == ["usage.md#no-such-heading: no heading with that anchor",
                                             "no-such-page.md: no such file"]  # fmt: skip
    text = "`lowmem_ft/nope.py`, `train/nope/`, `lowmem_ft.train.nope`, `lowmem_ft.train.trace.step.allocation_log`"
    assert docs.missing_paths(page, text) == ["`lowmem_ft/nope.py`: no such file or folder",
                                              "`train/nope/`: no such file or folder",
                                              "`lowmem_ft.train.nope`: no such module or name"]  # fmt: skip
    # a command or a path inside a code block is shown, not claimed
    assert docs.missing_paths(page, "    `lowmem_ft/nope.py`\n```\n[b](nope.md)\n```") == []


def test_headings_anchor_as_github_makes_them():
    text = "# Planning: `lowmem-ft plan`\n## Data\n## Data\n    # not a heading\n"
    assert docs.anchors(text) == {"planning-lowmem-ft-plan", "data", "data-1"}


def test_readme_is_a_landing_page_naming_both_tiers():
    readme = (ROOT / "README.md").read_text(encoding="utf-8")
    assert len(readme.splitlines()) <= 250
    commands = [line.strip() for line in readme.splitlines() if line.startswith("    ")]
    assert commands[0].startswith("lowmem-ft train --vram 24 --model Qwen/Qwen-7B --data ")
    assert "bash scripts/test.sh" in commands and "bash scripts/test.sh --fast" in commands
    development = (ROOT / "docs" / "development.md").read_text(encoding="utf-8")
    assert re.search(r"bash scripts/test\.sh --fast .*inner loop", development)
    # CI runs exactly the README's test command, and the full tier records where its time went
    ci = [line for line in (ROOT / ".ci" / "run").read_text().splitlines() if line and not line.startswith("#")]
    assert ci[-1] == "bash scripts/test.sh"
    script = (ROOT / "scripts" / "test.sh").read_text()
    assert "--durations=30" in script and '-m "not slow"' in script


def test_every_page_is_reachable_from_the_index():
    index = (ROOT / "docs" / "README.md").read_text(encoding="utf-8")
    linked = {target.partition("#")[0] for target in docs._LINK.findall(index)}
    pages = {str(p.relative_to(ROOT / "docs")) for p in PAGES if p.parent != ROOT and p.name != "README.md"}
    assert pages - linked == set()


@pytest.mark.parametrize("page", PAGES, ids=_name)
def test_every_command_shown_parses(page):
    """Each `lowmem-ft ...` line of a code block is one the parsers accept: the flags exist, values in range."""
    assert docs.unparsed_commands(page) == []


def test_the_shown_commands_are_found_and_checked():
    text = (
        "    lowmem-ft train --vram 24 --model m --data d.jsonl   # a comment\n"
        "    $ lowmem-ft plan --vram 24 --model m \\\n        --seq-len 2048\n"
        "    lowmem-ft data stats d.jsonl --model m [--json]\n"
        "    lowmem-ft train: error: a one-line error is output, not a command\n"
        "lowmem-ft train --no-such-flag (prose, not a code block)\n"
    )
    assert docs.commands_shown(text) == [
        "lowmem-ft train --vram 24 --model m --data d.jsonl",
        "lowmem-ft plan --vram 24 --model m  --seq-len 2048",
        "lowmem-ft data stats d.jsonl --model m --json",
    ]
    page = ROOT / "docs" / "README.md"
    assert docs.unparsed_commands(page, text) == []
    (refused,) = docs.unparsed_commands(
        page, "    lowmem-ft train --vram 24 --no-such-flag\n    lowmem-ft plan --vram 0\n"
    )[:1]
    assert (
        refused.startswith("lowmem-ft train --vram 24 --no-such-flag: ")
        and "--no-such-flag" in refused.split(": ", 1)[1]
    )
    assert len(docs.unparsed_commands(page, "    lowmem-ft plan --model m --vram -1\n")) == 1  # a value out of range
