"""Sources: hub ids (offline error, a local cache), column mapping, folders; the tokenized cache;
parallel tokenization; weighted mixtures with per-source validation."""

from __future__ import annotations

import codecs
import json
import re
import shutil
import time
from collections import Counter
from pathlib import Path

import numpy as np
import pytest
import torch

from lit_instruct.data.datamodule import InstructDataModule
from lit_instruct.data.records import DataError, Message
from lit_instruct.data.render import ChatRenderer
from lit_instruct.data.sampler import InstructSampler
from lit_instruct.data.sources import DataSource, fingerprint, read_source
from tests.helpers import trainer


def write_jsonl(path: Path, rows: list[dict]) -> Path:
    path.write_text("".join(json.dumps(r) + "\n" for r in rows))
    return path


def qa_rows(prefix: str, n: int) -> list[dict]:
    return [{"prompt": f"{prefix} question {i}?", "completion": f"{prefix} answer {i}."} for i in range(n)]


# -- hub ids ---------------------------------------------------------------------------------


@pytest.fixture
def offline_hub(monkeypatch, tmp_path):
    """The hub in offline mode, with an empty ``datasets`` cache of our own."""
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", True)
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets")
    return tmp_path / "hf-datasets"


def test_a_hub_id_offline_fails_at_once_naming_hf_hub_offline(offline_hub) -> None:
    start = time.monotonic()
    with pytest.raises(
        DataError,
        match=r"someuser/somedata: is neither a local path nor a cached hub dataset, and HF_HUB_OFFLINE",
    ):
        read_source(DataSource("someuser/somedata"))
    assert time.monotonic() - start < 10


def test_an_unreachable_hub_is_detected_in_seconds_not_retried(monkeypatch, tmp_path) -> None:
    import datasets.config
    import huggingface_hub.constants

    monkeypatch.setattr(huggingface_hub.constants, "HF_HUB_OFFLINE", False)
    monkeypatch.setattr(huggingface_hub.constants, "ENDPOINT", "http://127.0.0.1:9")  # nothing listens
    monkeypatch.setattr(datasets.config, "HF_DATASETS_CACHE", tmp_path / "hf-datasets")
    start = time.monotonic()
    with pytest.raises(DataError, match=r"the Hugging Face Hub \(http://127\.0\.0\.1:9\) is unreachable"):
        read_source(DataSource("someuser/somedata"))
    assert time.monotonic() - start < 10
    assert huggingface_hub.constants.HF_HUB_OFFLINE is False  # restored


def test_a_cached_hub_dataset_loads_offline(offline_hub, tmp_path) -> None:
    """A hub dataset in the ``datasets`` cache (laid out as a download leaves it) reads offline."""
    import datasets

    rows = qa_rows("hub", 3)
    parquet = tmp_path / "train.parquet"
    datasets.Dataset.from_list(rows).to_parquet(parquet)
    built = tmp_path / "built"
    datasets.load_dataset("parquet", data_files={"train": str(parquet)}, cache_dir=str(built))
    (prepared,) = (p for p in built.glob("parquet/*/0.0.0/*") if p.is_dir())
    target = offline_hub / "someuser___somedata" / "default" / "0.0.0" / "0123456789abcdef"
    shutil.copytree(prepared, target)
    (arrow,) = target.glob("*.arrow")
    arrow.rename(target / "somedata-train.arrow")

    records = read_source(DataSource("someuser/somedata"))
    assert [r.messages[1].content for r in records] == [r["completion"] for r in rows]
    assert records[2].source == "someuser/somedata[train]:row 2"


def test_a_missing_local_file_is_not_taken_for_a_hub_id(tmp_path) -> None:
    (tmp_path / "files").mkdir()
    write_jsonl(tmp_path / "files" / "alpaca_data.json", [{"instruction": "Hi?", "output": "Yo."}])
    typo = tmp_path / "files" / "alpaca_dta.json"
    expected = f"{typo}: no such file or folder; closest: {tmp_path / 'files' / 'alpaca_data.json'}"
    with pytest.raises(DataError, match=re.escape(expected)) as missing:
        read_source(DataSource(str(typo)))
    assert missing.value.reason == "missing_source"
    for path in (tmp_path / "nope.jsonl", tmp_path / "files" / "qa"):  # no suffix, in a folder there is
        with pytest.raises(DataError, match=re.escape(f"{path}: no such file or folder")):
            read_source(DataSource(str(path)))
    with pytest.raises(
        DataError, match=re.escape(f"{tmp_path / 'gone' / 'a.jsonl'}: no such file or folder (nor")
    ):
        fingerprint(DataSource(str(tmp_path / "gone" / "a.jsonl")))  # the cache key is taken first


# -- columns and folders ------------------------------------------------------------------------


def test_columns_map_the_users_field_names(tmp_path) -> None:
    qa = write_jsonl(tmp_path / "qa.jsonl", [{"question": "Hi?", "answer": "Yo.", "id": 3}])
    (record,) = read_source(DataSource(str(qa), columns={"instruction": "question", "output": "answer"}))
    assert record.messages == (Message("user", "Hi?"), Message("assistant", "Yo."))
    dialog = [{"role": "user", "content": "Q"}, {"role": "assistant", "content": "A"}]
    chats = write_jsonl(tmp_path / "chats.jsonl", [{"dialog": dialog}])
    (record,) = read_source(DataSource(str(chats), columns={"messages": "dialog"}))
    assert record.messages == (Message("user", "Q"), Message("assistant", "A"))
    with pytest.raises(
        DataError, match=r"qa\.jsonl:1: column 'query' \(mapped to 'instruction' by columns\)"
    ):
        read_source(DataSource(str(qa), columns={"instruction": "query"}))


def test_a_folder_reads_its_data_files_in_name_order(tmp_path) -> None:
    import datasets

    folder = tmp_path / "corpus"
    (folder / "sub").mkdir(parents=True)
    write_jsonl(folder / "b.jsonl", qa_rows("b", 2))
    datasets.Dataset.from_list(qa_rows("a", 1)).to_parquet(folder / "a.parquet")
    write_jsonl(folder / "sub" / "c.jsonl", qa_rows("c", 1))
    (folder / "README.md").write_text("not data")
    records = read_source(DataSource(str(folder)))
    assert [r.messages[1].content for r in records] == [
        "a answer 0.",
        "b answer 0.",
        "b answer 1.",
        "c answer 0.",
    ]
    assert DataSource(str(folder)).name == "corpus"


# -- the tokenized cache and parallel tokenization --------------------------------------------


def setup_data(tiny_model_dir, cache_dir, **kwargs) -> InstructDataModule:
    data = InstructDataModule(tokenizer=str(tiny_model_dir), cache_dir=str(cache_dir), **kwargs)
    data.setup("fit")
    return data


def stores_equal(a, b) -> None:
    for name, array in a.arrays.items():
        assert np.array_equal(np.asarray(array), np.asarray(b.arrays[name])), name
    assert a.names == b.names


def test_a_second_setup_tokenizes_nothing_and_gives_the_same_samples(
    tiny_model_dir, chat_file, tmp_path, monkeypatch
) -> None:
    rendered = Counter()
    original = ChatRenderer.samples

    def counting(self, record):
        rendered["records"] += 1
        return original(self, record)

    monkeypatch.setattr(ChatRenderer, "samples", counting)
    first = setup_data(tiny_model_dir, tmp_path / "cache", train_files=[str(chat_file)], val_fraction=0.3)
    assert rendered["records"] == len(chat_file.read_text().splitlines()) and not first.prepared.cached
    second = setup_data(tiny_model_dir, tmp_path / "cache", train_files=[str(chat_file)], val_fraction=0.3)
    assert rendered["records"] == len(chat_file.read_text().splitlines())  # nothing rendered again
    assert second.prepared.cached and isinstance(second.train_samples.arrays["input_ids"], np.memmap)
    stores_equal(first.train_samples, second.train_samples)
    stores_equal(first.val_samples, second.val_samples)
    assert list(first.train_samples) == list(second.train_samples)
    assert first.counts == second.counts

    for change in ({"max_seq_len": 40}, {"val_fraction": 0.5}):  # any setting that shapes samples
        assert not setup_data(
            tiny_model_dir, tmp_path / "cache", train_files=[str(chat_file)], **change
        ).prepared.cached
    chat_file.write_text(chat_file.read_text().replace("Blue.", "Azure."))  # the contents, not the name
    assert not setup_data(tiny_model_dir, tmp_path / "cache", train_files=[str(chat_file)]).prepared.cached


def _damage(path: Path, how: str) -> None:
    """One byte of the array's data flipped (same size), the file cut short, or the file removed."""
    data = bytearray(path.read_bytes())
    if how == "one byte":
        data[-3] ^= 0xFF
        path.write_bytes(bytes(data))
    elif how == "truncated":
        path.write_bytes(bytes(data[:-8]))
    elif how == "missing":
        path.unlink()
    else:  # a digit of the counts changed in place: the counts reported would be wrong
        path.write_text(path.read_text().replace('"samples": 4', '"samples": 5', 1))


@pytest.mark.parametrize(
    ("file", "how"),
    [
        ("train/input_ids.npy", "one byte"),
        ("train/labels.npy", "truncated"),
        ("val/offsets.npy", "missing"),
        ("meta.json", "one digit"),
    ],
)
def test_item8_a_damaged_cache_is_rebuilt_with_one_log_line(
    tiny_model_dir, chat_file, tmp_path, caplog, file, how
) -> None:
    """A cached array or the cache's metadata changed in place, cut short or removed: the next setup
    says which file in one log line, rebuilds the cache, and trains on what a fresh build gives; the
    repaired cache is then memory-mapped again."""
    import logging

    kwargs = dict(train_files=[str(chat_file)], val_fraction=0.3)
    fresh = setup_data(tiny_model_dir, tmp_path / "fresh", **kwargs)
    first = setup_data(tiny_model_dir, tmp_path / "cache", **kwargs)
    assert first.counts["train"]["samples"] == 4  # what the one-digit damage changes
    path = first.prepared.folder / file
    _damage(path, how)
    caplog.clear()
    with caplog.at_level(logging.INFO):
        again = setup_data(tiny_model_dir, tmp_path / "cache", **kwargs)
    damaged = [r.getMessage() for r in caplog.records if "cache is damaged" in r.getMessage()]
    assert len(damaged) == 1 and str(path) in damaged[0], damaged
    assert not again.prepared.cached
    for data in (again, setup_data(tiny_model_dir, tmp_path / "cache", **kwargs)):
        stores_equal(data.train_samples, fresh.train_samples)
        stores_equal(data.val_samples, fresh.val_samples)
        assert data.counts == fresh.counts
    assert data.prepared.cached  # the repaired folder, memory-mapped


def _prepare_in_child(args: tuple) -> list[tuple[list[int], list[int]]]:
    """``prepare`` in a forked process: the training samples' ids and labels."""
    from lit_instruct.data.prepare import prepare

    sources, tokenizer, settings, cache = args
    prepared = prepare(sources, [], tokenizer, settings, cache_dir=cache)
    return [(sample.input_ids, sample.labels) for sample in prepared.train]


def test_item8_ranks_opening_a_damaged_cache_at_once_each_get_a_fresh_build(
    tokenizer, chat_file, tmp_path
) -> None:
    """Several processes (DDP ranks, nodes) that find the same damaged cache at once each end with
    the samples of a fresh build, and leave one sound cache folder behind (no staging folder)."""
    import multiprocessing

    from lit_instruct.data.prepare import DataSettings, prepare

    sources, settings = [DataSource(str(chat_file))], DataSettings(val_fraction=0.0)
    fresh = prepare(sources, [], tokenizer, settings)
    cache = tmp_path / "cache"
    built = prepare(sources, [], tokenizer, settings, cache_dir=cache)
    _damage(built.folder / "train" / "labels.npy", "one byte")
    with multiprocessing.get_context("fork").Pool(3) as pool:
        results = pool.map(_prepare_in_child, [(sources, tokenizer, settings, cache)] * 3)
    assert all(result == [(s.input_ids, s.labels) for s in fresh.train] for result in results)
    assert [p.name for p in cache.iterdir()] == [built.folder.name]
    again = prepare(sources, [], tokenizer, settings, cache_dir=cache)
    assert again.cached and list(again.train) == list(fresh.train)


def test_skipped_records_survive_the_cache(tiny_model_dir, chat_file, tmp_path) -> None:
    bad = tmp_path / "bad.jsonl"
    bad.write_text(chat_file.read_text() + '{"messages": 3}\n')
    kwargs = dict(train_files=[str(bad)], on_bad_record="skip", rejects_file=str(tmp_path / "r.jsonl"))
    first = setup_data(tiny_model_dir, tmp_path / "cache", **kwargs)
    (tmp_path / "r.jsonl").unlink()
    second = setup_data(tiny_model_dir, tmp_path / "cache", **kwargs)
    assert second.prepared.cached and second.counts == first.counts
    assert second.counts["train"]["skipped_bad_type"] == 1
    assert (
        json.loads((tmp_path / "r.jsonl").read_text())["source"]
        == f"{bad}:{len(chat_file.read_text().splitlines()) + 1}"
    )


def test_two_processes_tokenize_exactly_like_one(tiny_model_dir, tmp_path, monkeypatch) -> None:
    import lit_instruct.data.tokenize as tokenize

    monkeypatch.setattr(tokenize, "CHUNK", 7)  # many chunks, finished out of order
    rows = [
        {
            "messages": [
                {"role": "user", "content": f"Q{i} " * (i % 5 + 1)},
                {"role": "assistant", "content": f"A{i}"},
            ]
        }
        for i in range(60)
    ]
    rows[33]["messages"][1]["content"] = " "  # one bad record, skipped and counted
    path = write_jsonl(tmp_path / "many.jsonl", rows)
    kwargs = dict(
        train_files=[str(path)], on_bad_record="skip", cache=False, rejects_file=str(tmp_path / "r.jsonl")
    )
    one = InstructDataModule(tokenizer=str(tiny_model_dir), num_proc=1, **kwargs)
    two = InstructDataModule(tokenizer=str(tiny_model_dir), num_proc=2, **kwargs)
    one.setup("fit")
    two.setup("fit")
    stores_equal(one.train_samples, two.train_samples)
    stores_equal(one.val_samples, two.val_samples)
    assert one.counts == two.counts and one.prepared.rejects == two.prepared.rejects
    assert one.counts["train"]["skipped_empty_content"] == 1


def test_a_bad_record_raises_the_same_error_from_a_worker(tiny_model_dir, tmp_path) -> None:
    rows = qa_rows("x", 40)
    rows[25]["completion"] = " "
    path = write_jsonl(tmp_path / "x.jsonl", rows)
    data = InstructDataModule(tokenizer=str(tiny_model_dir), train_files=[str(path)], num_proc=2, cache=False)
    with pytest.raises(DataError, match=rf"{path}:26: field 'messages\[1\]\.content' \(assistant\) is empty"):
        data.setup("fit")


# -- mixtures ---------------------------------------------------------------------------------


def test_mixture_weights_set_each_sources_draws_per_epoch() -> None:
    sources = [0] * 10 + [1] * 30
    sampler = InstructSampler([5] * 40, 4, sources=sources, weights=[2.0, 0.5], seed=3)
    assert len(sampler) == 35
    seen = []
    for epoch in range(3):
        sampler.set_epoch(epoch)
        order = list(sampler)
        drawn = Counter(order)
        assert all(drawn[i] == 2 for i in range(10))  # weight 2: every sample exactly twice
        halves = {i for i in order if i >= 10}
        assert len(halves) == 15 and all(drawn[i] == 1 for i in halves)  # weight 0.5: 15 distinct
        seen.append(halves)
        again = InstructSampler([5] * 40, 4, sources=sources, weights=[2.0, 0.5], seed=3)
        again.set_epoch(epoch)
        assert list(again) == order  # seeded: the same draw in a new process
    assert seen[0] != seen[1]  # another half each epoch

    replaced = InstructSampler([5] * 40, 4, sources=sources, weights=[2.0, 0.5], replacement=True, seed=3)
    order = list(replaced)
    assert len(order) == 35 and sum(i < 10 for i in order) == 20
    assert max(Counter(order).values()) > 1 or len(set(order)) < 35


def test_mixture_sources_report_counts_and_per_source_validation_loss(tiny_model_dir, tmp_path) -> None:
    from tests.helpers import make

    alpaca = write_jsonl(
        tmp_path / "alpaca.jsonl",
        [{"instruction": f"Add {i} and 1.", "output": f"{i + 1}."} for i in range(12)],
    )
    sharegpt = write_jsonl(
        tmp_path / "sharegpt.jsonl",
        [
            {"conversations": [{"from": "human", "value": f"Say {i}."}, {"from": "gpt", "value": f"{i}!"}]}
            for i in range(8)
        ],
    )
    module, _ = make(tiny_model_dir, alpaca)
    data = InstructDataModule(
        tokenizer=str(tiny_model_dir),
        sources=[
            DataSource(str(alpaca), val_fraction=0.25),
            DataSource(str(sharegpt), weight=2.0, val_fraction=0.25),
        ],
        cache_dir=str(tmp_path / "cache"),
        batch_size=2,
    )
    data.setup("fit")
    assert data.train_samples.counts_by_source() == {"alpaca": 9, "sharegpt": 6}
    assert data.val_samples.counts_by_source() == {"alpaca": 3, "sharegpt": 2}
    loaders = data.val_dataloader()
    assert [next(iter(loader))["source"] for loader in loaders] == ["alpaca", "sharegpt"]
    assert len(data.train_dataloader().sampler) == 9 + 12

    results = trainer(tmp_path).validate(module, datamodule=data, verbose=False)
    metrics = results[0]  # one dict per loader; the epoch's metrics are in each
    sums: dict[str, list[float]] = {}
    module.eval()
    with torch.no_grad():
        for i, sample in enumerate(data.val_samples):
            name = data.val_samples.names[int(data.val_samples.source_ids[i])]
            logits = module.model(input_ids=torch.tensor([sample.input_ids])).logits[0, :-1]
            loss = torch.nn.functional.cross_entropy(logits, torch.tensor(sample.labels[1:]), reduction="sum")
            entry = sums.setdefault(name, [0.0, 0])
            entry[0] += float(loss)
            entry[1] += sample.num_targets
    for name, (total, count) in sums.items():
        torch.testing.assert_close(metrics[f"val/loss/{name}"], total / count, rtol=1e-5, atol=1e-6)
    overall = sum(t for t, _ in sums.values()) / sum(c for _, c in sums.values())
    torch.testing.assert_close(metrics["val/loss"], overall, rtol=1e-5, atol=1e-6)


def test_sources_with_the_same_name_are_refused_shorthand_files_renamed(tiny_model_dir, tmp_path) -> None:
    (tmp_path / "a").mkdir()
    one = write_jsonl(tmp_path / "train.jsonl", qa_rows("a", 3))
    two = write_jsonl(tmp_path / "a" / "train.jsonl", qa_rows("b", 3))
    shorthand = InstructDataModule(tokenizer=str(tiny_model_dir), train_files=[str(one), str(two)])
    assert [s.name for s in shorthand.sources] == ["train", "train-2"]
    sources = [DataSource(str(one)), DataSource(str(two))]
    data = InstructDataModule(tokenizer=str(tiny_model_dir), sources=sources, cache=False)
    with pytest.raises(
        ValueError, match=r"several training sources are named \['train'\]: give each a distinct name"
    ):
        data.setup("fit")


def test_a_held_out_part_named_like_a_validation_file_gets_its_own_name(tiny_model_dir, tmp_path) -> None:
    (tmp_path / "val").mkdir()
    train = write_jsonl(tmp_path / "train.jsonl", qa_rows("t", 10))
    val = write_jsonl(tmp_path / "val" / "train.jsonl", qa_rows("v", 4))  # also named "train"
    data = InstructDataModule(
        tokenizer=str(tiny_model_dir),
        sources=[DataSource(str(train), val_fraction=0.3)],
        val_files=[str(val)],
        cache=False,
    )
    data.setup("fit")
    store = data.val_samples
    assert store.counts_by_source() == {"train": 4, "train-held-out": 3}
    loaders = data.val_dataloader()
    texts = [[data.tokenizer.decode(ids) for ids in next(iter(loader))["input_ids"]] for loader in loaders]
    assert all("v answer" in t for t in texts[0]) and all("t answer" in t for t in texts[1])
    assert [next(iter(loader))["source"] for loader in loaders] == ["train", "train-held-out"]


def test_validation_sources_take_the_sources_syntax_and_overlap_with_training_is_counted(
    tiny_model_dir, tmp_path
) -> None:
    import datasets

    train, val = qa_rows("t", 6), qa_rows("v", 3)
    datasets.DatasetDict(
        {"train": datasets.Dataset.from_list(train), "validation": datasets.Dataset.from_list(val)}
    ).save_to_disk(tmp_path / "dd")
    datasets.DatasetDict({"train": datasets.Dataset.from_list(train)}).save_to_disk(tmp_path / "only_train")
    renamed = write_jsonl(tmp_path / "renamed.jsonl", [{"q": r["prompt"], "a": r["completion"]} for r in val])

    data = InstructDataModule(  # val_files shorthand: the DatasetDict's validation split
        tokenizer=str(tiny_model_dir),
        sources=[DataSource(str(tmp_path / "dd"))],
        val_files=[str(tmp_path / "dd")],
        cache=False,
    )
    data.setup("fit")
    assert len(data.train_samples) == 6 and len(data.val_samples) == 3
    assert "also_in_training" not in data.counts["val"]

    data = InstructDataModule(  # full syntax: columns, format
        tokenizer=str(tiny_model_dir),
        sources=[DataSource(str(tmp_path / "dd"))],
        val_sources=[DataSource(str(renamed), name="held", columns={"prompt": "q", "completion": "a"})],
        cache=False,
    )
    data.setup("fit")
    assert data.val_samples.counts_by_source() == {"held": 3}

    data = InstructDataModule(  # the train split again: validated on, counted and warned about
        tokenizer=str(tiny_model_dir),
        sources=[DataSource(str(tmp_path / "dd"))],
        val_files=[str(tmp_path / "only_train")],
        cache=False,
    )
    with pytest.warns(
        UserWarning,
        match="validation source 'only_train': 6 of its 6 conversations are also in the training data",
    ):
        data.setup("fit")
    assert data.counts["val"]["also_in_training"] == 6


def test_samples_read_before_setup_say_so(tiny_model_dir, tmp_path) -> None:
    data = InstructDataModule(tokenizer=str(tiny_model_dir), train_files=[str(tmp_path / "x.jsonl")])
    for read in (lambda: data.train_samples, lambda: data.val_samples, lambda: data.counts):
        with pytest.raises(RuntimeError, match=r"call setup\(\) before reading its samples or counts"):
            read()


@pytest.mark.parametrize("kind", ["jsonl", "json", "csv"])
def test_a_byte_order_mark_is_read_as_excel_and_notepad_write_it(kind: str, tiny_model_dir, tmp_path) -> None:
    """A UTF-8 file starting with a byte-order mark gives the samples the same file without it gives
    (issue 50): it was refused ("decode using utf-8-sig")."""
    from lit_instruct.data.datamodule import InstructDataModule

    rows = [{"instruction": f"Say {word}.", "output": word} for word in ("hi", "bye", "yes")]
    if kind == "jsonl":
        text = "".join(json.dumps(row) + "\n" for row in rows)
    elif kind == "json":
        text = json.dumps(rows)
    else:
        text = "instruction,output\n" + "".join(f"{row['instruction']},{row['output']}\n" for row in rows)
    samples = []
    for name, mark in (("plain", b""), ("marked", codecs.BOM_UTF8)):
        path = tmp_path / name / f"data.{kind}"
        path.parent.mkdir()
        path.write_bytes(mark + text.encode())
        data = InstructDataModule(tokenizer=str(tiny_model_dir), train_files=[str(path)], val_fraction=0)
        samples.append(list(data.prepare_samples().train))
    plain, marked = samples
    assert len(plain) == len(marked) == 3
    for a, b in zip(plain, marked, strict=True):
        assert a.input_ids == b.input_ids and a.labels == b.labels
