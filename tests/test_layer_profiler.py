"""LayerProfiler with a real Trainer: one row per decoder layer, consistent phase times, a PNG chart."""

from __future__ import annotations

import csv
import json

import lightning as L
import pytest
from lightning.pytorch.loggers import CSVLogger
from PIL import Image

from lit_instruct.callbacks import LayerProfiler
from lit_instruct.callbacks.layer_profiler import PHASES, decoder_layers
from tests.helpers import make, trainer


class HookCounter(L.Callback):
    """How many forward hooks the decoder layers carry during each training batch."""

    def __init__(self) -> None:
        self.per_batch: list[int] = []

    def on_before_backward(self, trainer, pl_module, loss) -> None:
        _, layers = decoder_layers(pl_module)
        self.per_batch.append(sum(len(layer._forward_hooks) for layer in layers))


@pytest.mark.e2e
def test_profile_of_the_real_model(smollm2_path, chat_file, tmp_path) -> None:
    module, data = make(smollm2_path, chat_file, batch_size=2)
    profiler = LayerProfiler(every_n_steps=1)
    logger = CSVLogger(tmp_path, name="run", version=0)
    run = trainer(tmp_path, max_steps=2, accumulate_grad_batches=2, limit_val_batches=0, logger=logger)
    run.callbacks.append(profiler)
    run.fit(module, datamodule=data)

    assert len(profiler.history) == 2
    phases, layers = profiler.summary()
    assert [row["layer"] for row in layers] == list(range(module.base_model.config.num_hidden_layers))
    assert len(layers) == 30
    assert all(row["forward_ms"] > 0 and row["backward_ms"] > 0 for row in layers)
    assert all(phases[f"{phase}_ms"] > 0 for phase in PHASES)
    assert sum(row["forward_ms"] for row in layers) <= phases["forward_ms"]
    assert sum(row["backward_ms"] for row in layers) <= phases["layer_backward_ms"]
    parts = sum(phases[f"{phase}_ms"] for phase in PHASES if phase != "step")
    assert parts <= phases["step_ms"]

    out = tmp_path / "run" / "version_0"
    with open(out / "layer_profile.csv") as f:
        assert len(list(csv.DictReader(f))) == 30
    assert json.loads((out / "layer_profile.json").read_text())["profiled_steps"] == 2
    with Image.open(out / "layer_profile.png") as image:
        assert image.format == "PNG" and image.size[0] > 100
        image.verify()
    with open(out / "metrics.csv") as f:
        rows = [row for row in csv.DictReader(f) if row.get("profile/step_ms")]
    assert len(rows) == 2 and float(rows[0]["profile/layer_29_backward_ms"]) > 0


def test_hooks_only_on_profiled_steps(tiny_model_dir, chat_file, tmp_path) -> None:
    module, data = make(tiny_model_dir, chat_file, batch_size=2)
    profiler, counter = LayerProfiler(every_n_steps=2, output_dir=str(tmp_path / "profile")), HookCounter()
    run = trainer(tmp_path, max_steps=5, limit_val_batches=2, val_check_interval=2)
    run.callbacks += [profiler, counter]
    run.fit(module, datamodule=data)
    assert counter.per_batch == [0, 2, 0, 2, 0]  # steps 1 and 3 are profiled, one hook per layer
    assert len(profiler.history) == 2
    _, layers = decoder_layers(module)
    assert all(not layer._forward_hooks and not layer._forward_pre_hooks for layer in layers)
    assert (tmp_path / "profile" / "layer_profile.png").is_file()


def test_charts_leave_the_process_matplotlib_backend_alone(tmp_path) -> None:
    import matplotlib

    from lit_instruct.callbacks import LossCurves
    from lit_instruct.callbacks.layer_profiler import plot_layer_profile

    previous = matplotlib.get_backend()
    matplotlib.use("svg")  # a user's own choice, which drawing our charts must not change
    try:
        layers = [{"layer": 0, "forward_ms": 1.0, "backward_ms": 2.0}]
        plot_layer_profile({"forward_ms": 1.0, "step_ms": 3.0}, layers, tmp_path / "layers.png")
        curves = LossCurves()
        curves.train, curves.val = [(1, 2.0, 100.0), (2, 1.5, 110.0)], [(2, 1.7)]
        curves.plot(tmp_path / "curves.png")
        assert matplotlib.get_backend() == "svg"
    finally:
        matplotlib.use(previous)
    for name in ("layers.png", "curves.png"):
        with Image.open(tmp_path / name) as image:
            assert image.format == "PNG" and image.size[0] > 100
