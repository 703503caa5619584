"""Every scaler metric through a real TensorBoard SummaryWriter, read back by tensorboard."""

import pytest
import torch
from _integration_models import INIT_SCALE, InfAt, batch, mlp, read_tensorboard
from torch.utils.tensorboard import SummaryWriter

import lossscale
from lossscale.integrations.loggers import log_tensorboard, scalars

pytestmark = pytest.mark.usefixtures("one_thread")  # conftest: tiny ops, one thread


def _train_and_log(logdir, steps=6, inject=(3,)):
    model = mlp()
    opt = torch.optim.SGD(model.parameters(), lr=0.1)
    scaler = lossscale.GradScaler("cpu", init_scale=INIT_SCALE, model=model, telemetry=dict(every=1, per="module"))
    InfAt(model[2].weight, inject)
    written = []
    with SummaryWriter(str(logdir)) as writer:
        for step in range(steps):
            x, y = batch(step)
            opt.zero_grad()
            with torch.autocast("cpu", dtype=torch.float16):
                loss = torch.nn.functional.cross_entropy(model(x), y)
            scaler.scale(loss).backward()
            scaler.step(opt)
            scaler.update()
            metrics = scaler.metrics()
            assert log_tensorboard(writer, metrics, step) == scalars(metrics)  # one call per step
            written.append(metrics)
    return scaler, written


def test_every_metric_round_trips_through_tensorboard(tmp_path):
    scaler, written = _train_and_log(tmp_path)
    last = written[-1]
    # Numbers only (what SummaryWriter.add_scalar and Lightning's log_dict accept); the text is elsewhere.
    assert all(isinstance(v, (int, float, bool)) for m in written for v in m.values())
    assert all(isinstance(v, str) for v in scaler.metric_labels().values())
    assert any(k.startswith("grad/") for k in last)  # telemetry figures, per module too
    assert {"loss_scale", "skipped_steps", "last_step_skipped"} <= set(last)
    read = read_tensorboard(tmp_path)
    assert set(read) == {f"scaler/{k}" for m in written for k in m}
    for key in last:
        steps = [s for s, m in enumerate(written) if key in m]
        # TensorBoard stores float32: the read-back equals the written value rounded to float32, exactly.
        expected = torch.tensor([float(written[s][key]) for s in steps], dtype=torch.float32)
        got = torch.tensor([v for _, v in read[f"scaler/{key}"]], dtype=torch.float32)
        assert [s for s, _ in read[f"scaler/{key}"]] == steps
        assert torch.equal(got, expected), key
    assert [v for _, v in read["scaler/last_step_skipped"]] == [0.0, 0.0, 0.0, 1.0, 0.0, 0.0]
    assert [v for _, v in read["scaler/loss_scale"]] == [INIT_SCALE] * 3 + [INIT_SCALE / 2] * 3


def test_scaler_argument_reads_its_metrics(tmp_path):
    scaler = lossscale.GradScaler("cpu", init_scale=INIT_SCALE)
    with SummaryWriter(str(tmp_path)) as writer:
        values = log_tensorboard(writer, scaler, 7, prefix="amp/")
    assert values["amp/loss_scale"] == INIT_SCALE
    assert read_tensorboard(tmp_path)["amp/loss_scale"] == [(7, INIT_SCALE)]


def test_validation_names_the_argument(tmp_path):
    with pytest.raises(ValueError, match="metric 'grad/measured' is 'parameter gradients', not a number"):
        scalars({"loss_scale": 1.0, "grad/measured": "parameter gradients"})
    with pytest.raises(ValueError, match="writer=.*add_scalar"):
        log_tensorboard(object(), {}, 0)
    with SummaryWriter(str(tmp_path)) as writer:
        with pytest.raises(ValueError, match="step=.*int"):
            log_tensorboard(writer, {}, 1.5)
        with pytest.raises(ValueError, match="scaler_or_metrics="):
            log_tensorboard(writer, 3, 0)
