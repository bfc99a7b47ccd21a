"""CPU threads follow the cores other processes leave free (:mod:`lit_instruct.train.threads`)."""

from __future__ import annotations

import os
import subprocess
import sys
import time

import lightning as L
import pytest
import torch

from lit_instruct.train.threads import ThreadBudget, machine_busy_seconds, own_busy_seconds, threads_for
from tests.helpers import make, trainer


class Threads(L.Callback):
    """The intra-op threads of each training step."""

    def __init__(self) -> None:
        self.threads: list[int] = []

    def on_train_batch_start(self, *args, **kwargs) -> None:
        self.threads.append(torch.get_num_threads())


def test_the_free_cores_with_headroom_and_bounds() -> None:
    assert threads_for(2, 0.0, 2) == 2
    assert threads_for(2, 0.2, 2) == 2  # a little background work: keep both
    assert threads_for(2, 0.8, 2) == 1
    assert threads_for(2, 1.0, 2) == 1
    assert threads_for(2, 2.5, 2) == 1  # never 0
    assert threads_for(16, 3.0, 8) == 8  # never above what the run started with
    assert threads_for(16, 10.2, 16) == 6


def test_busy_seconds_come_from_proc_stat() -> None:
    stat = "cpu  100 20 30 4000 50 6 7 8 0 0\ncpu0 1 2 3 4\n"
    assert machine_busy_seconds(stat) == pytest.approx((100 + 20 + 30 + 6 + 7 + 8) / os.sysconf("SC_CLK_TCK"))
    before_machine, before_own = machine_busy_seconds(), own_busy_seconds()
    assert before_machine is not None
    end = time.monotonic() + 0.5
    while time.monotonic() < end:  # burn CPU: both counters see it
        pass
    assert own_busy_seconds() - before_own > 0.3
    assert machine_busy_seconds() - before_machine > 0.2  # type: ignore[operator]


def test_a_fit_beside_a_busy_process_in_another_session_trains_on_the_free_core(
    tiny_model_dir, chat_file, tmp_path, capsys
) -> None:
    """A busy process in its own session (where nice does not reach) takes a core: the fit runs on
    the other one and gives the thread back at the end."""
    torch.set_num_threads(2)
    spin = subprocess.Popen(
        ["nice", "-n", "19", sys.executable, "-c", "while True: pass"], start_new_session=True
    )
    try:
        time.sleep(0.5)
        module, data = make(tiny_model_dir, chat_file)  # its callbacks hold a ThreadBudget
        seen = Threads()
        trainer(tmp_path, max_steps=2, callbacks=[seen]).fit(module, datamodule=data)
    finally:
        spin.kill()
    assert seen.threads and set(seen.threads) == {1}
    assert torch.get_num_threads() == 2


def test_alone_the_fit_keeps_its_threads(tiny_model_dir, chat_file, tmp_path) -> None:
    torch.set_num_threads(2)
    module, data = make(tiny_model_dir, chat_file)
    seen = Threads()
    fit = trainer(tmp_path, max_steps=2, callbacks=[seen])
    fit.fit(module, datamodule=data)
    assert set(seen.threads) == {2}
    assert any(isinstance(c, ThreadBudget) for c in fit.callbacks)  # the module attached one


class ValidationThreads(L.Callback):
    """The thread count each validation batch ran with."""

    def __init__(self) -> None:
        self.threads: list[int] = []

    def on_validation_batch_start(self, trainer, pl_module, batch, batch_idx, dataloader_idx=0) -> None:
        self.threads.append(torch.get_num_threads())


def busy_process() -> subprocess.Popen:
    """A process in its own session that keeps a core busy (nice does not reach it)."""
    spin = subprocess.Popen(
        ["nice", "-n", "19", sys.executable, "-c", "while True: pass"], start_new_session=True
    )
    time.sleep(0.5)
    return spin


def test_the_validation_before_a_fit_runs_on_the_free_core_too(
    tiny_model_dir, chat_file, tmp_path, caplog
) -> None:
    """Issue 50: the budget started at the first training step, so the validation before it (and an
    EVA pass, answers SampleScores generates) ran on every core beside a busy process."""
    torch.set_num_threads(2)
    spin = busy_process()
    try:
        module, data = make(tiny_model_dir, chat_file)
        seen = ValidationThreads()
        run = trainer(tmp_path, max_steps=2, callbacks=[seen])
        with caplog.at_level("INFO"):
            run.validate(module, datamodule=data, verbose=False)
            run.fit(module, datamodule=data)
    finally:
        spin.kill()
    assert seen.threads and set(seen.threads) == {1}
    assert torch.get_num_threads() == 2
    assert "validation on 1 thread (was 2)" in caplog.text
    assert "validation before the fit: " in caplog.text and "of the command's" in caplog.text


def test_a_command_outside_a_fit_runs_on_the_free_cores_and_gives_them_back() -> None:
    from lit_instruct.cpu_threads import sharing_cores

    torch.set_num_threads(2)
    said: list[str] = []
    spin = busy_process()
    try:
        with sharing_cores("generation", say=said.append):
            inside = torch.get_num_threads()
    finally:
        spin.kill()
    assert (inside, torch.get_num_threads()) == (1, 2)
    assert len(said) == 1 and said[0].endswith("generation on 1 thread (was 2)"), said
