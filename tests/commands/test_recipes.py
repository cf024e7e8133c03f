from lowmem_ft.cli import main


def test_list_shows_every_tier(capsys):
    assert main(["recipes"]) == 0
    out = capsys.readouterr().out
    for name in ("base", "8gb", "24gb", "40gb"):
        assert name in out


def test_show_prints_the_resolved_recipe_with_overrides(capsys):
    assert main(["recipes", "show", "8gb", "--set", "memory.max_seq_len=256"]) == 0
    out = capsys.readouterr().out
    assert "max_seq_len: 256" in out
    assert "quantization: nf4" in out  # inherited from base


def test_keys_documents_every_key(capsys):
    assert main(["recipes", "keys"]) == 0
    out = capsys.readouterr().out
    assert "memory.micro_batch_size:" in out and "optimizer.name:" in out
    lr = next(line for line in out.splitlines() if line.startswith("optimizer.lr:"))
    assert "per method in the tier recipes: dpo 5e-06, dpo/full 1e-06" in lr


def test_show_unknown_recipe_is_one_line_exit_2(capsys):
    assert main(["recipes", "show", "9gb"]) == 2
    err = capsys.readouterr().err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
