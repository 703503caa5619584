"""DeepSpeed with lossscale: FP16 training with ZeRO, the scaler attached to the engine, a checkpoint round trip.

    pip install -c constraints.txt -e ".[integrations]"
    python examples/deepspeed_fp16.py                     # torch_autocast fp16, ZeRO-2 (CPU or GPU)
    python examples/deepspeed_fp16.py --classic --stage 1  # DeepSpeed's classic "fp16" mode (GPU)
    deepspeed examples/deepspeed_fp16.py                  # the same under DeepSpeed's launcher

A small MLP learns a random teacher network's labels (nothing is downloaded), with AdamW over two
parameter groups (decay and no decay, as transformers' Trainer builds them). The scale starts at
2**24, so the first steps overflow FP16 and are skipped: the engine counts them
(``engine.skipped_steps``) and the scale backs off until the steps go through. At the end the engine
saves a checkpoint, which carries the scaler, a second engine loads it, and the run's health account
is logged. Without a GPU it runs on DeepSpeed's CPU accelerator (``DS_ACCELERATOR=cpu``, set here when
no CUDA is present), where DeepSpeed compiles a communication op at the first ``initialize`` (about
100 s on 2 cores, cached afterwards) and classic fp16 needs a CPU with AVX512-FP16.
"""

import argparse
import os
import tempfile

import torch

if not torch.cuda.is_available():
    os.environ.setdefault("DS_ACCELERATOR", "cpu")
for key, value in dict(RANK="0", WORLD_SIZE="1", LOCAL_RANK="0", MASTER_ADDR="127.0.0.1", MASTER_PORT="29511").items():
    os.environ.setdefault(key, value)  # one process without a launcher; the launcher sets them all

import deepspeed  # noqa: E402

from lossscale.integrations import deepspeed as ls_deepspeed  # noqa: E402


def data(steps: int, batch: int = 32, seed: int = 0):
    """Batches labelled by a fixed random teacher MLP."""
    g = torch.Generator().manual_seed(seed)
    teacher = torch.nn.Sequential(torch.nn.Linear(32, 64), torch.nn.Tanh(), torch.nn.Linear(64, 8))
    for p in teacher.parameters():
        p.data = torch.randn(p.shape, generator=g)
    for _ in range(steps):
        x = torch.randn(batch, 32, generator=g)
        with torch.no_grad():
            y = teacher(x).argmax(-1)
        yield x, y


def config(stage: int, classic: bool) -> dict:
    """A DeepSpeed config with FP16 in one of its two modes."""
    cfg = {
        "train_micro_batch_size_per_gpu": 32,
        "gradient_accumulation_steps": 1,
        "steps_per_print": 10**9,
        "zero_optimization": {"stage": stage},
        "gradient_clipping": 1.0,
    }
    if classic:  # DeepSpeed keeps the scale (a DynamicLossScaler): attach() takes these numbers
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 24, "loss_scale_window": 100, "hysteresis": 1}
    else:  # DeepSpeed builds a torch GradScaler: attach() puts a lossscale.GradScaler there
        cfg["torch_autocast"] = {"enabled": True, "dtype": "torch.float16"}
    return cfg


def engine_for(stage: int, classic: bool):
    """A fresh model, its two-group AdamW and the engine deepspeed.initialize builds."""
    torch.manual_seed(0)
    model = torch.nn.Sequential(torch.nn.Linear(32, 128), torch.nn.ReLU(), torch.nn.Linear(128, 8))
    groups = [
        {"params": [p for n, p in model.named_parameters() if n.endswith("weight")], "weight_decay": 0.01},
        {"params": [p for n, p in model.named_parameters() if n.endswith("bias")], "weight_decay": 0.0},
    ]
    engine, *_ = deepspeed.initialize(
        model=model, optimizer=torch.optim.AdamW(groups, lr=3e-3), config=config(stage, classic)
    )
    return engine


def main(steps: int = 200, stage: int = 2, classic: bool = False, ckpt_dir: str = "") -> dict:
    """Train; return the loss, the scale, skipped steps and what the reloaded engine holds."""
    deepspeed.init_distributed(dist_backend="nccl" if torch.cuda.is_available() else "gloo", verbose=False)
    engine = engine_for(stage, classic)
    scaler_kwargs = {} if classic else {"init_scale": 2.0**24}  # classic: the config's numbers
    scaler = ls_deepspeed.attach(engine, **scaler_kwargs)  # right after initialize()
    device = engine.device
    for step, (x, y) in enumerate(data(steps)):
        dtype = next(engine.module.parameters()).dtype  # classic fp16: FP16 parameters
        loss = torch.nn.functional.cross_entropy(engine(x.to(device, dtype)).float(), y.to(device))
        engine.backward(loss)  # scaled by the lossscale scaler
        engine.step()  # skipped on inf/NaN
        if step % 50 == 0 or step == steps - 1:
            print(
                f"step {step:4d}  loss {loss.item():.4f}  scale {scaler.get_scale():10.0f}  "
                f"skipped {engine.skipped_steps}"
            )
    ckpt_dir = ckpt_dir or tempfile.mkdtemp(prefix="lossscale-deepspeed-")
    engine.save_checkpoint(ckpt_dir)  # carries the scaler's state
    reloaded = engine_for(stage, classic)
    reloaded_scaler = ls_deepspeed.attach(reloaded, **scaler_kwargs)
    reloaded.load_checkpoint(ckpt_dir)  # restores it
    report = ls_deepspeed.log_health(engine)  # logged on rank 0
    result = {
        "loss": loss.item(),
        "scale": scaler.get_scale(),
        "skipped": engine.skipped_steps,
        "counters": scaler.counters(),
        "reloaded_scale": reloaded_scaler.get_scale(),
        "reloaded_counters": reloaded_scaler.counters(),
        "verdict": report.verdict,
    }
    print(
        f"{engine.skipped_steps} of {steps} steps skipped; final scale {result['scale']:.0f}; the checkpoint in "
        f"{ckpt_dir} restored scale {result['reloaded_scale']:.0f}.\n{report.text}"
    )
    return result


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=200)
    parser.add_argument("--stage", type=int, default=2, choices=[0, 1, 2, 3], help="ZeRO stage")
    parser.add_argument(
        "--classic", action="store_true", help='DeepSpeed\'s classic "fp16" config instead of torch_autocast'
    )
    parser.add_argument("--ckpt-dir", default="", help="checkpoint directory (default: a new temporary one)")
    parser.add_argument("--local_rank", type=int, default=0, help=argparse.SUPPRESS)  # the deepspeed launcher passes it
    args = parser.parse_args()
    main(args.steps, args.stage, args.classic, args.ckpt_dir)
