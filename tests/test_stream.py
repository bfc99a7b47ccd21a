"""Streaming: disjoint shards per rank, a seeded shuffle buffer, packing, and exact mid-stream resume."""

from __future__ import annotations

import json
from collections import Counter
from itertools import islice
from pathlib import Path

import lightning as L
import pytest
import torch
from lightning.pytorch.callbacks import ModelCheckpoint

from lit_instruct.data.datamodule import InstructDataModule
from lit_instruct.data.prepare import DataSettings, TemplateRenderers
from lit_instruct.data.sources import DataSource
from lit_instruct.data.stream import SampleStream
from lit_instruct.models.lora import LoRAConfig
from lit_instruct.train.module import InstructLoRAModule
from tests.helpers import Recorder, StopAfter, trainer


@pytest.fixture
def corpus(tmp_path: Path) -> Path:
    """23 prompt/completion records (one of them bad) and a multi-turn one, over two files."""
    rows = [{"prompt": f"Question {i}?", "completion": f"Answer {i}."} for i in range(12)]
    rows[5]["completion"] = " "
    (tmp_path / "corpus").mkdir()
    with (tmp_path / "corpus" / "a.jsonl").open("w") as out:
        out.writelines(json.dumps(r) + "\n" for r in rows)
    turns = [
        {"role": r, "content": c}
        for r, c in [("user", "Hi"), ("assistant", "Yo"), ("user", "Bye"), ("assistant", "Ciao")]
    ]
    rows = [{"messages": turns}] + [{"prompt": f"More {i}?", "completion": f"Yes {i}."} for i in range(11)]
    with (tmp_path / "corpus" / "b.jsonl").open("w") as out:
        out.writelines(json.dumps(r) + "\n" for r in rows)
    return tmp_path / "corpus"


def stream(tokenizer, corpus: Path, **kwargs) -> SampleStream:
    settings = DataSettings(max_seq_len=64, on_bad_record="skip")
    sources = [DataSource(str(corpus))]
    return SampleStream(sources, TemplateRenderers(tokenizer, settings).settings(sources, None), **kwargs)


def texts(tokenizer, items) -> list[str]:
    return [tokenizer.decode(sample.input_ids) for sample, _ in items]


def test_ranks_read_disjoint_records_and_together_all_of_them(tokenizer, corpus) -> None:
    one_epoch = 23  # 24 records, one bad; the multi-turn one is one sample (ChatML is prefix-stable)
    alone = list(islice(stream(tokenizer, corpus, shuffle_buffer=5), one_epoch))
    assert {p[0] for _, p in alone} == {0}
    shares = {0: 12, 1: 11}  # the bad record is the 6th: rank 1's
    ranks = [
        list(islice(stream(tokenizer, corpus, rank=r, world_size=2, shuffle_buffer=5), n))
        for r, n in shares.items()
    ]
    assert [{p[0] for _, p in items} for items in ranks] == [{0}, {0}]  # one data epoch each
    shards = [Counter(texts(tokenizer, items)) for items in ranks]
    assert not set(shards[0]) & set(shards[1])
    assert shards[0] + shards[1] == Counter(texts(tokenizer, alone))


def test_the_buffer_shuffles_per_epoch_and_is_seeded(tokenizer, corpus) -> None:
    first = texts(tokenizer, islice(stream(tokenizer, corpus, shuffle_buffer=8, seed=1), 46))
    again = texts(tokenizer, islice(stream(tokenizer, corpus, shuffle_buffer=8, seed=1), 46))
    ordered = texts(tokenizer, islice(stream(tokenizer, corpus, shuffle_buffer=1), 23))
    assert first == again
    assert first[:23] != ordered and sorted(first[:23]) == sorted(ordered)
    assert first[:23] != first[23:] and sorted(first[:23]) == sorted(first[23:])  # a new order next epoch


def test_a_stream_resumed_at_any_sample_continues_exactly(tokenizer, corpus) -> None:
    full = list(islice(stream(tokenizer, corpus, shuffle_buffer=6), 40))
    for cut in (0, 7, 22, 23, 30):
        position = full[cut][1]
        resumed = list(islice(stream(tokenizer, corpus, shuffle_buffer=6, resume=position), 40 - cut - 1))
        assert [p for _, p in resumed] == [p for _, p in full[cut + 1 :]]
        assert texts(tokenizer, resumed) == texts(tokenizer, full[cut + 1 :])


def test_streamed_batches_can_be_packed(tiny_model_dir, corpus) -> None:
    data = InstructDataModule(
        tokenizer=str(tiny_model_dir),
        train_files=[str(corpus)],
        streaming=True,
        packing=True,
        batch_size=3,
        on_bad_record="skip",
    )
    data.setup("fit")
    batch = next(iter(data.train_dataloader()))
    assert batch["input_ids"].shape[0] == 1 and len(batch["packed_segments"]) == 4
    assert batch["stream_position"][0] == 0


def streamed_fit(tiny_model_dir, corpus, root, *callbacks, ckpt_path=None) -> Recorder:
    L.seed_everything(0)
    module = InstructLoRAModule(
        model=str(tiny_model_dir),
        lora=LoRAConfig(r=4, alpha=8, dropout=0.1),
        learning_rate=1e-2,
        warmup_steps=0,
    )
    data = InstructDataModule(
        tokenizer=str(tiny_model_dir),
        train_files=[str(corpus)],
        streaming=True,
        shuffle_buffer=5,
        batch_size=4,
        on_bad_record="skip",
        rejects_file=str(root / "rejects.jsonl"),
    )
    recorder = Recorder()
    run = trainer(root, max_steps=8, limit_val_batches=0, deterministic=True)
    run.callbacks += [recorder, *callbacks]
    run.fit(module, datamodule=data, ckpt_path=ckpt_path)
    return recorder


def test_training_resumed_mid_stream_equals_the_uninterrupted_run(tiny_model_dir, corpus, tmp_path) -> None:
    """8 steps of 4 samples cross the 23-sample data epoch; stopped after 3 and resumed."""
    uninterrupted = streamed_fit(tiny_model_dir, corpus, tmp_path / "a")
    (reject,) = [json.loads(line) for line in (tmp_path / "a" / "rejects.jsonl").read_text().splitlines()]
    assert reject["source"] == f"{corpus / 'a.jsonl'}:6" and reject["reason"] == "empty_content"
    every_3 = ModelCheckpoint(dirpath=tmp_path / "ckpt", every_n_train_steps=3, save_top_k=-1)
    streamed_fit(tiny_model_dir, corpus, tmp_path / "b", every_3, StopAfter(3))
    path = tmp_path / "ckpt" / "epoch=0-step=3.ckpt"
    state = torch.load(path, weights_only=True)["InstructDataModule"]
    assert state == {"stream_positions": [[0, 11, 0]]}  # 12 samples trained: the 12th record's only one
    resumed = streamed_fit(tiny_model_dir, corpus, tmp_path / "c", ckpt_path=path)
    assert len(resumed.losses) == 5
    torch.testing.assert_close(
        torch.tensor(resumed.losses), torch.tensor(uninterrupted.losses[3:]), atol=1e-6, rtol=0
    )


def test_streaming_needs_max_steps_and_refuses_weights(tiny_model_dir, corpus, tmp_path) -> None:
    data = InstructDataModule(tokenizer=str(tiny_model_dir), train_files=[str(corpus)], streaming=True)
    data.trainer = trainer(tmp_path, max_steps=-1, max_epochs=1)
    with pytest.raises(ValueError, match=r"the stream has no end; set trainer\.max_steps"):
        data.train_dataloader()
    weighted = InstructDataModule(
        tokenizer=str(tiny_model_dir), sources=[DataSource(str(corpus), weight=2.0)], streaming=True
    )
    with pytest.raises(ValueError, match="streaming reads its sources in order"):
        weighted.train_dataloader()


@pytest.mark.slow
def test_two_ranks_resume_their_own_stream_positions_exactly(tiny_model_dir, corpus, tmp_path) -> None:
    """2-process DDP (gloo): the checkpoint holds both ranks' positions, and the resumed run's losses
    (all-reduced over ranks) equal the uninterrupted run's."""
    from tests.ddp_fit import run_ddp_fit

    common = {
        "model": str(tiny_model_dir),
        "data": str(corpus / "b.jsonl"),
        "streaming": True,
        "batch_size": 2,
    }
    # the uninterrupted run's checkpoint at step 3 is the one a run stopped there writes
    full = run_ddp_fit({**common, "out": str(tmp_path / "full"), "max_steps": 6, "ckpt_every": 3})
    path = tmp_path / "full" / "epoch=0-step=3.ckpt"
    positions = torch.load(path, weights_only=True)["InstructDataModule"]["stream_positions"]
    assert positions == [[0, 5, 0], [0, 5, 0]]  # each rank: its 6 records of 12, one sample each
    resumed = run_ddp_fit(
        {**common, "out": str(tmp_path / "resumed"), "max_steps": 6, "ckpt_path": str(path)}
    )
    for rank in (0, 1):
        torch.testing.assert_close(
            torch.tensor(resumed[rank]["losses"]), torch.tensor(full[rank]["losses"][3:]), atol=1e-6, rtol=0
        )


@pytest.mark.slow
def test_every_ranks_streamed_rejects_reach_the_rejects_file(tiny_model_dir, corpus, tmp_path) -> None:
    """Each rank reads its own records: the bad ones of both ranks are listed (by rank 0)."""
    from tests.ddp_fit import run_ddp_fit

    lines = (corpus / "b.jsonl").read_text().splitlines()
    lines[2] = '{"prompt": "Bad?", "completion": " "}'  # record 3: rank 0's
    lines[3] = '{"prompt": "Bad too?", "completion": " "}'  # record 4: rank 1's
    data = tmp_path / "bad.jsonl"
    data.write_text("\n".join(lines) + "\n")
    args = {"model": str(tiny_model_dir), "data": str(data), "out": str(tmp_path / "out"), "max_steps": 2}
    run_ddp_fit({**args, "streaming": True, "batch_size": 2, "on_bad_record": "skip"})
    rows = [json.loads(line) for line in (tmp_path / "out" / "rejects.jsonl").read_text().splitlines()]
    assert sorted(row["source"] for row in rows) == [f"{data}:3", f"{data}:4"]
