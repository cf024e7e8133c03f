"""Reading every kind of source into TRL records: exact line / row numbers, columns, BOMs, nulls, hostile files."""

from __future__ import annotations

import builtins
import io
import json

import pytest

from lowmem_ft.data.readers import content_id, read_records, record_stream
from lowmem_ft.data.sources import resolve_source
from lowmem_ft.errors import UserError
from tests.data.conftest import fixture

QA = [{"id": i, "question": f"What is {i} plus 1?", "answer": f" {i + 1}."} for i in range(5)]
QA_COLUMNS = {"prompt": "question", "completion": "answer"}
DEEP = '{"text": "ok", "x": ' + "[" * 2000 + "]" * 2000 + "}"  # 2,000 levels: past Python's JSON recursion limit


def read(path, **kw):
    skip = kw.pop("skip_bad_lines", False)
    return read_records(resolve_source(str(path), **kw), skip_bad_lines=skip)


def write_parquet(path, rows):
    import pyarrow as pa
    import pyarrow.parquet as pq

    pq.write_table(pa.Table.from_pylist(rows), path)


def test_jsonl_errors_name_the_physical_line_blank_lines_included(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "one"}\n\n   \n{"text": ""}\n{"text": "five"}\n', encoding="utf-8")
    with pytest.raises(UserError, match=r"d\.jsonl:4: field 'text' is empty \(or pass --skip-bad-lines\)"):
        read(path)
    data = read(path, skip_bad_lines=True)
    assert [r["text"] for r in data.records] == ["one", "five"]
    assert data.skipped == [f"{path}:4: field 'text' is empty"]


@pytest.mark.parametrize("kind", ["jsonl", "json", "csv"])
def test_a_utf8_byte_order_mark_is_accepted(tmp_path, kind):
    rows = [{"prompt": "2 plus 2?", "completion": " 4"}, {"prompt": "3 plus 1?", "completion": " 4"}]
    if kind == "jsonl":
        body = "".join(json.dumps(r) + "\n" for r in rows)
    elif kind == "json":
        body = json.dumps(rows)
    else:
        body = "prompt,completion\n" + "".join(f"{r['prompt']},{r['completion']}\n" for r in rows)
    path = tmp_path / f"bom.{kind}"
    path.write_bytes(b"\xef\xbb\xbf" + body.encode())
    data = read(path)
    assert data.format == "prompt_completion" and data.records == rows and data.unused_columns == []


def test_json_nested_past_the_recursion_limit_is_a_bad_line(tmp_path):
    path = tmp_path / "deep.jsonl"
    path.write_text('{"text": "fine"}\n' + DEEP + "\n", encoding="utf-8")
    with pytest.raises(UserError, match=r"deep\.jsonl:2: JSON nested deeper than Python's JSON reader allows"):
        read(path)
    data = read(path, skip_bad_lines=True)
    assert len(data.records) == 1 and "nested deeper" in data.skipped[0]
    array = tmp_path / "deep.json"
    array.write_text('[{"text": "fine"}, ' + DEEP + "]", encoding="utf-8")
    with pytest.raises(UserError, match=r"deep\.json: JSON nested deeper than Python's JSON reader allows"):
        read(array)


def test_json_array_errors_name_the_row_and_keep_missing_keys_missing(tmp_path):
    path = tmp_path / "d.json"
    path.write_text(json.dumps([{"prompt": "a", "completion": "b"}, {"prompt": "c"}]), encoding="utf-8")
    with pytest.raises(UserError, match=r"d\.json row 1: missing field 'completion'"):
        read(path)
    path.write_text(json.dumps([[1], {"text": "t"}]), encoding="utf-8")
    with pytest.raises(UserError, match=r"d\.json row 0: each record must be a JSON object, got list"):
        read(path)


def test_json_file_of_json_lines_is_line_numbered_and_one_pretty_object_is_refused(tmp_path):
    path = tmp_path / "d.json"
    path.write_text('{"text": "a"}\n{"text": 5}\n', encoding="utf-8")
    with pytest.raises(UserError, match=r"d\.json:2: field 'text' must be a string, got int"):
        read(path)
    path.write_text('{\n  "text": "a"\n}\n', encoding="utf-8")
    with pytest.raises(UserError, match=r"d\.json holds one JSON object; training data is an array of records"):
        read(path)
    path.write_text('{"text": "one line, one record"}', encoding="utf-8")
    assert read(path).records == [{"text": "one line, one record"}]


def test_parquet_with_its_own_column_names(tmp_path):
    path = tmp_path / "qa.parquet"
    write_parquet(path, QA)
    data = read(path, columns=QA_COLUMNS)
    assert data.format == "prompt_completion"
    assert data.records == [{"prompt": r["question"], "completion": r["answer"]} for r in QA]
    assert data.unused_columns == ["id"]  # reported, not silently ignored
    with pytest.raises(UserError, match=r"qa\.parquet row 0: cannot tell the format .* data\.columns"):
        read(path)
    with pytest.raises(UserError) as info:
        read(path, columns={"prompt": "q", "completion": "answer"})
    assert str(info.value) == (
        f"data.columns maps prompt to 'q', which {path} row 0 does not have; its columns are id, question, answer"
    )


def test_parquet_errors_name_the_row_and_nulls_in_structs_mean_missing(tmp_path):
    path = tmp_path / "chat.parquet"
    turns = [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "hello"}]
    rows = [{"conversation": turns}] * 3 + [{"conversation": [{"role": "user"}, turns[1]]}]
    write_parquet(path, rows)  # arrow stores the missing 'content' of row 3 as null
    with pytest.raises(UserError, match=r"chat\.parquet row 3: missing field 'messages\[0\]\.content'"):
        read(path, columns={"messages": "conversation"})
    data = read(path, columns={"messages": "conversation"}, skip_bad_lines=True)
    assert len(data.records) == 3 and data.records[0] == {"messages": turns}
    assert data.skipped == [f"{path} row 3: missing field 'messages[0].content'"]


def test_an_arrow_file_as_datasets_writes_its_shards(tmp_path):
    from datasets import Dataset

    Dataset.from_list(QA).save_to_disk(str(tmp_path / "saved"))
    path = tmp_path / "qa.arrow"
    path.write_bytes(next((tmp_path / "saved").glob("*.arrow")).read_bytes())
    data = read(path, columns=QA_COLUMNS)
    assert data.records == [{"prompt": r["question"], "completion": r["answer"]} for r in QA]


def test_csv_cells_are_text_and_empty_cells_are_empty(tmp_path):
    path = tmp_path / "qa.csv"
    path.write_text('question,answer\n"What is 2 plus 2?",4\n"multi\nline",\n', encoding="utf-8")
    with pytest.raises(UserError, match=r"qa\.csv row 1: field 'completion' is empty"):
        read(path, columns=QA_COLUMNS)
    path.write_text('question,answer\n"What is 2 plus 2?",4\n"multi\nline",007\n', encoding="utf-8")
    data = read(path, columns=QA_COLUMNS)
    assert data.records == [
        {"prompt": "What is 2 plus 2?", "completion": "4"},
        {"prompt": "multi\nline", "completion": "007"},  # a string, as written: not the number 7
    ]
    tsv = tmp_path / "qa.tsv"
    tsv.write_text("prompt\tcompletion\tsource\na, b\tc\tweb\n", encoding="utf-8")
    assert read(tsv).records == [{"prompt": "a, b", "completion": "c"}] and read(tsv).unused_columns == ["source"]


def test_csv_header_problems(tmp_path):
    path = tmp_path / "d.csv"
    path.write_text("prompt,prompt\na,b\n", encoding="utf-8")
    with pytest.raises(UserError, match=r"d\.csv: the header names the column\(s\) 'prompt' more than once"):
        read(path)
    path.write_text("", encoding="utf-8")
    with pytest.raises(UserError, match=r"d\.csv: the file is empty; a CSV file starts with a header row"):
        read(path)


def test_a_file_that_is_not_parquet_is_one_line(tmp_path):
    path = tmp_path / "d.parquet"
    path.write_bytes(b"this is not parquet")
    with pytest.raises(UserError) as info:
        read(path)
    assert "d.parquet" in str(info.value) and "\n" not in str(info.value)


def test_alpaca_input_may_be_absent_when_mapped(tmp_path):
    path = tmp_path / "d.jsonl"
    path.write_text(
        json.dumps({"task": "Say hi.", "context": "politely", "reply": "Hello!"})
        + "\n"
        + json.dumps({"task": "Say bye.", "reply": "Bye!"})
        + "\n",
        encoding="utf-8",
    )
    data = read(path, columns={"instruction": "task", "input": "context", "output": "reply"})
    assert data.format == "alpaca"
    assert data.records[1]["messages"][0] == {"role": "user", "content": "Say bye."}


def test_a_directory_reads_each_file_with_its_own_reader_and_names_it(tmp_path):
    (tmp_path / "a.jsonl").write_text('{"text": "from jsonl"}\n', encoding="utf-8")
    write_parquet(tmp_path / "b.parquet", [{"text": "from parquet"}, {"text": ""}])
    with pytest.raises(UserError, match=r"b\.parquet row 1: field 'text' is empty"):
        read(tmp_path)
    assert [r["text"] for r in read(tmp_path, skip_bad_lines=True).records] == ["from jsonl", "from parquet"]


def test_saved_dataset_split_is_read_with_rows_named(tmp_path):
    from datasets import Dataset, DatasetDict

    train = Dataset.from_list([{"question": "q", "answer": "a"}] * 2)
    test = Dataset.from_list([{"question": "q2", "answer": ""}])
    DatasetDict({"train": train, "test": test}).save_to_disk(str(tmp_path / "saved"))
    assert len(read(tmp_path / "saved", columns=QA_COLUMNS).records) == 2
    with pytest.raises(UserError, match=r"saved \[test\] row 0: field 'completion' is empty"):
        read(tmp_path / "saved", columns=QA_COLUMNS, split="test")


def test_an_unreadable_file_is_one_line(tmp_path, monkeypatch):
    """Simulated: the tests run as root, who may read any file, so `open` is made to refuse this one path."""
    path = tmp_path / "secret.jsonl"
    path.write_text('{"text": "hi"}\n', encoding="utf-8")
    real_open = builtins.open

    def refusing_open(file, *args, **kwargs):
        if str(file) == str(path):
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", refusing_open)
    monkeypatch.setattr(io, "open", refusing_open)
    with pytest.raises(UserError, match=r"cannot read data file .*secret\.jsonl \(Permission denied\)"):
        resolve_source(str(path))


def test_content_id_follows_the_content(tmp_path):
    from datasets import Dataset

    path = tmp_path / "d.jsonl"
    path.write_text('{"text": "a"}\n', encoding="utf-8")
    first = content_id(resolve_source(str(path)))
    assert content_id(resolve_source(str(path))) == first
    path.write_text('{"text": "b"}\n', encoding="utf-8")
    assert content_id(resolve_source(str(path))) != first
    saved = tmp_path / "saved"
    Dataset.from_dict({"text": ["a"]}).save_to_disk(str(saved))
    one = content_id(resolve_source(str(saved)))
    Dataset.from_dict({"text": ["b"]}).save_to_disk(str(saved))
    assert one.startswith("saved:") and content_id(resolve_source(str(saved))) != one
    assert content_id(resolve_source(str(path), streaming=True)) is None  # a stream is not cached


def test_a_stream_yields_the_same_records(tmp_path):
    path = tmp_path / "qa.parquet"
    write_parquet(path, QA)
    source = resolve_source(str(path), columns=QA_COLUMNS, streaming=True)
    assert list(record_stream(source, "prompt_completion")) == read(path, columns=QA_COLUMNS).records


def test_formats_still_detected_for_every_fixture():
    assert read(fixture("sharegpt.jsonl")).format == "sharegpt"


# ---- the hostile inputs of issue #16, through both commands that read data ----------------------------------------


def command(name: str, data: str, tiny_model: str, tmp_path) -> list[str]:
    if name == "train":
        return ["train", "--vram", "8", "--model", tiny_model, "--data", data, "--no-wandb",
                "--set", f"training.output_dir={tmp_path / 'runs'}"]  # fmt: skip
    return ["data", "stats", data, "--model", tiny_model]


def one_line_error(capsys, code: int) -> str:
    err = capsys.readouterr().err.strip()
    assert code == 2 and "Traceback" not in err and len(err.splitlines()) == 1, err
    return err


@pytest.mark.parametrize("name", ["train", "data"])
def test_deeply_nested_json_is_one_line_naming_the_line(name, tmp_path, tiny_model, capsys):
    from lowmem_ft.cli import main

    path = tmp_path / "deep.jsonl"
    path.write_text('{"text": "fine"}\n' + DEEP + "\n", encoding="utf-8")
    err = one_line_error(capsys, main(command(name, str(path), tiny_model, tmp_path)))
    assert f"{path}:2: JSON nested deeper than Python's JSON reader allows" in err


@pytest.mark.parametrize("name", ["train", "data"])
def test_an_unreadable_file_is_one_line_through_the_cli(name, tmp_path, tiny_model, capsys, monkeypatch):
    """Simulated PermissionError (the tests run as root), as in test_an_unreadable_file_is_one_line."""
    from lowmem_ft.cli import main

    path = tmp_path / "secret.jsonl"
    path.write_text('{"text": "hi"}\n', encoding="utf-8")
    real_open = builtins.open

    def refusing_open(file, *args, **kwargs):
        if str(file) == str(path):
            raise PermissionError(13, "Permission denied", str(file))
        return real_open(file, *args, **kwargs)

    monkeypatch.setattr(builtins, "open", refusing_open)
    err = one_line_error(capsys, main(command(name, str(path), tiny_model, tmp_path)))
    assert f"cannot read data file {path} (Permission denied); check that it is readable" in err


# ---- Hub data sets: the same load_dataset call; its answers simulated here (no network in the tests) -------------


def fake_hub(monkeypatch, answer):
    """Make `datasets.load_dataset` answer as the Hub would, recording the call."""
    import datasets

    from lowmem_ft.data import readers

    calls = []

    def load_dataset(path, **kwargs):
        calls.append((path, kwargs))
        if isinstance(answer, Exception):
            raise answer
        return answer

    monkeypatch.setattr(datasets, "load_dataset", load_dataset)
    readers.load_hub.cache_clear()
    return calls


def test_a_hub_data_set_is_read_through_load_dataset_with_rows_named(monkeypatch):
    from datasets import Dataset

    ds = Dataset.from_list([{"question": "q", "answer": "a"}, {"question": "q2", "answer": ""}])
    calls = fake_hub(monkeypatch, ds)
    source = resolve_source("org/qa", subset="en", split="test", columns=QA_COLUMNS)
    with pytest.raises(UserError, match=r"org/qa \[en/test\] row 1: field 'completion' is empty"):
        read_records(source)
    assert calls[0] == ("org/qa", {"name": "en", "split": "test", "streaming": False})
    assert content_id(source) == "hub:" + ds._fingerprint


@pytest.mark.parametrize(
    "error, words",
    [
        (ValueError("BuilderConfig 'xx' not found. Available: ['en', 'de']"), "data.subset: cannot load org/qa"),
        (ValueError("Unknown split \"dev\". Should be one of ['train', 'test']."), "data.split: cannot load org/qa"),
        ("not found", "data org/qa: no such data set on the Hugging Face Hub (or it is private or gated"),
    ],
)
def test_hub_answers_are_one_line(monkeypatch, error, words):
    from datasets.exceptions import DatasetNotFoundError

    fake_hub(
        monkeypatch,
        DatasetNotFoundError("Dataset 'org/qa' doesn't exist on the Hub") if error == "not found" else error,
    )
    with pytest.raises(UserError) as info:
        read_records(resolve_source("org/qa"))
    assert words in str(info.value) and "\n" not in str(info.value)


# ---- compressed files (issue #24: a .jsonl.gz was "not UTF-8 (byte 1)", with advice to re-encode) ----------------
def _compressed(path, data: bytes, how: str):
    import bz2
    import gzip
    import lzma

    path.write_bytes({"gzip": gzip.compress, "bz2": bz2.compress, "xz": lzma.compress}[how](data))
    return path


LINES = b'{"text": "one"}\n\n{"text": "three"}\n{"text": ""}\n{"text": "five"}\n'


@pytest.mark.parametrize(
    "name,how", [("d.jsonl.gz", "gzip"), ("d.jsonl.bz2", "bz2"), ("d.jsonl.xz", "xz"), ("d.jsonl", "gzip")]
)
def test_compressed_jsonl_is_read_with_the_lines_of_the_text_inside(tmp_path, name, how):
    """By suffix, or a .jsonl whose bytes are gzip (datasets' magic numbers): line numbers are the decompressed
    text's, blank lines included."""
    path = _compressed(tmp_path / name, LINES, how)
    with pytest.raises(UserError, match=rf"{name}:4: field 'text' is empty \(or pass --skip-bad-lines\)"):
        read(path)
    data = read(path, skip_bad_lines=True)
    assert [r["text"] for r in data.records] == ["one", "three", "five"] and data.format == "text"


def test_compressed_json_csv_and_directories(tmp_path):
    rows = [{"text": "a"}, {"text": "b"}]
    assert len(read(_compressed(tmp_path / "d.json.gz", json.dumps(rows).encode(), "gzip")).records) == 2
    csv = _compressed(tmp_path / "qa.csv.bz2", b"question,answer\nWhat?,That.\nWho?,Me.\n", "bz2")
    data = read(csv, columns=QA_COLUMNS)
    assert data.records[1] == {"prompt": "Who?", "completion": "Me."}
    folder = tmp_path / "folder"
    folder.mkdir()
    _compressed(folder / "train.jsonl.gz", LINES, "gzip")
    assert read(folder, skip_bad_lines=True).skipped == [f"{folder / 'train.jsonl.gz'}:4: field 'text' is empty"]


def test_damaged_or_unreadable_compressed_files_are_one_line(tmp_path):
    whole = _compressed(tmp_path / "whole.jsonl.gz", LINES * 50, "gzip").read_bytes()
    (tmp_path / "cut.jsonl.gz").write_bytes(whole[: len(whole) // 2])
    with pytest.raises(UserError, match=r"cannot read data file .*cut\.jsonl\.gz \(Compressed file ended"):
        read(tmp_path / "cut.jsonl.gz", skip_bad_lines=True)
    (tmp_path / "d.jsonl.zst").write_bytes(b"\x28\xb5\x2f\xfd" + bytes(16))
    try:
        import zstandard  # noqa: F401
    except ImportError:
        with pytest.raises(UserError, match=r"d\.jsonl\.zst is zstd-compressed.*pip install zstandard"):
            read(tmp_path / "d.jsonl.zst")
    (tmp_path / "hidden.csv").write_bytes(_compressed(tmp_path / "x.gz", b"text\nhi\n", "gzip").read_bytes())
    with pytest.raises(
        UserError, match=r"hidden\.csv is gzip-compressed under a \.csv name; rename it hidden\.csv\.gz"
    ):
        read(tmp_path / "hidden.csv")
    (tmp_path / "t.parquet.gz").write_bytes(b"x")
    with pytest.raises(UserError, match="Parquet is compressed inside the file already"):
        read(tmp_path / "t.parquet.gz")


def test_the_cache_key_of_a_compressed_file_is_its_bytes(tmp_path):
    a = _compressed(tmp_path / "a.jsonl.gz", LINES, "gzip")
    b = _compressed(tmp_path / "b.jsonl.bz2", LINES, "bz2")
    assert content_id(resolve_source(str(a))) != content_id(resolve_source(str(b)))


def test_the_compressions_are_datasets_own():
    from datasets.utils.file_utils import (
        MAGIC_NUMBER_TO_COMPRESSION_PROTOCOL,
        SINGLE_FILE_COMPRESSION_EXTENSION_TO_PROTOCOL,
    )

    from lowmem_ft.data.sources import COMPRESSIONS, MAGIC

    assert {k.lstrip("."): v for k, v in COMPRESSIONS.items()} == SINGLE_FILE_COMPRESSION_EXTENSION_TO_PROTOCOL
    assert {k: v for k, v in MAGIC_NUMBER_TO_COMPRESSION_PROTOCOL.items() if v != "zip"} == MAGIC
