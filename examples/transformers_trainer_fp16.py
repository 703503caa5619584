"""HF transformers Trainer with lossscale: fp16=True that really trains in FP16 on CPU, skip-aware LR.

    pip install -c constraints.txt -e ".[integrations]"
    python examples/transformers_trainer_fp16.py

A 2-layer GPT-2 built from a config (nothing is downloaded) learns short counting sequences with the
Trainer's defaults (fused AdamW, linear schedule). Without lossscale, ``fp16=True`` with
``use_cpu=True`` silently trains in FP32 with no scaler; with it the forward runs under FP16
autocast, skipped steps do not advance the LR, and ``scaler/...`` metrics join the Trainer's logs.
Runs on the CPU in well under a minute.
"""

import argparse
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing to download: the model is built in code

import torch  # noqa: E402
from transformers import GPT2Config, GPT2LMHeadModel, Trainer, TrainingArguments  # noqa: E402

from lossscale.integrations import transformers as ls_transformers  # noqa: E402


class Counting(torch.utils.data.Dataset):
    """Sequences a, a+1, a+2, ... (mod vocab): easy to learn, so the loss visibly falls."""

    def __init__(self, n: int, length: int = 16, vocab: int = 64):
        starts = torch.arange(n) % vocab
        self.ids = (starts[:, None] + torch.arange(length)[None, :]) % vocab

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        return {"input_ids": self.ids[i], "labels": self.ids[i]}


def main(steps: int = 60, output_dir: str = "") -> dict:
    """Train; return the last training log (loss, learning rate and the scaler's metrics)."""
    config = GPT2Config(n_layer=2, n_embd=32, n_head=2, vocab_size=64, n_positions=16, bos_token_id=0, eos_token_id=0)
    torch.manual_seed(0)
    model = GPT2LMHeadModel(config)
    args = TrainingArguments(
        output_dir=output_dir or tempfile.mkdtemp(prefix="lossscale-trainer-"),
        fp16=True,
        use_cpu=not torch.cuda.is_available(),
        max_steps=steps,
        per_device_train_batch_size=8,
        learning_rate=3e-3,
        warmup_steps=steps // 10,
        logging_steps=steps // 4,
        save_strategy="no",
        report_to=["tensorboard"],
        disable_tqdm=True,
    )
    trainer = Trainer(model=model, args=args, train_dataset=Counting(8 * steps))
    scaler = ls_transformers.attach(trainer, init_scale=2.0**20)  # after Trainer(...), before train()
    trainer.train()
    logs = [h for h in trainer.state.log_history if "loss" in h]
    for h in logs:
        print(
            f"step {h['step']:3d}  loss {h['loss']:.3f}  lr {h['learning_rate']:.2e}  "
            f"scale {h['scaler/loss_scale']:.0f}  skipped {h['scaler/skipped_steps']}"
        )
    print(
        f"{scaler.counters()['skipped_steps']} of {steps} steps skipped; the LR schedule advanced "
        f"{trainer.lr_scheduler.last_epoch} times. TensorBoard: tensorboard --logdir {args.output_dir}"
    )
    return logs[-1]


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=60)
    parser.add_argument("--output-dir", default="", help="Trainer output (default: a new temporary directory)")
    args = parser.parse_args()
    main(args.steps, args.output_dir)
