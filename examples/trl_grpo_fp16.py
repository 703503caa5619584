"""TRL GRPO in FP16 with lossscale: overflows skipped, the LR held on skipped steps, the scaler in the logs.

    pip install -c constraints.txt -e ".[test]"          # lossscale, trl, datasets
    python examples/trl_grpo_fp16.py

TRL's ``GRPOTrainer`` is a transformers ``Trainer``, so ``lossscale.integrations.transformers.attach``
is the whole integration: call it after building the trainer, before ``train()``. A 2-layer Qwen2 and a
character tokenizer are built in code (nothing is downloaded); each prompt gets 4 sampled completions
of 4 characters, scored by a rule (letters late in the alphabet score higher), and the policy learns to
prefer them. ``fp16=True`` trains in FP16 on a GPU, and on the CPU too once attached (the Trainer alone
would train in FP32 there). Runs on a CPU.

The scaler's settings are the ones docs/how-to/rl-post-training.md explains: a shorter growth interval
than torch's 2000 (RL runs are short and their gradient scale drifts), the scale kept within
[1, 2**24], and finite gradient-norm spikes (a reward outlier) skipped instead of applied.
"""

import argparse
import os
import tempfile

os.environ.setdefault("HF_HUB_OFFLINE", "1")  # nothing to download: model and tokenizer are built in code

import torch  # noqa: E402
from datasets import Dataset  # noqa: E402
from tokenizers import Tokenizer, models, pre_tokenizers  # noqa: E402
from transformers import PreTrainedTokenizerFast, Qwen2Config, Qwen2ForCausalLM  # noqa: E402
from trl import GRPOConfig, GRPOTrainer  # noqa: E402

import lossscale  # noqa: E402
from lossscale.integrations import transformers as ls_transformers  # noqa: E402

LETTERS = "abcdefghijklmnopqrstuvwxyz "


def char_tokenizer() -> PreTrainedTokenizerFast:
    """One token per character of ``LETTERS``, plus <pad> (0) and <eos> (1)."""
    vocab = {"<pad>": 0, "<eos>": 1, **{c: i + 2 for i, c in enumerate(LETTERS)}}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<pad>"))
    tok.pre_tokenizer = pre_tokenizers.Split("", "isolated")
    return PreTrainedTokenizerFast(tokenizer_object=tok, pad_token="<pad>", eos_token="<eos>")


def tiny_qwen2(seed: int = 0) -> Qwen2ForCausalLM:
    """A 2-layer Qwen2 (hidden 32, 2 heads, 1 KV head) over the character vocabulary."""
    config = Qwen2Config(
        vocab_size=32,
        hidden_size=32,
        intermediate_size=64,
        num_hidden_layers=2,
        num_attention_heads=2,
        num_key_value_heads=1,
        max_position_embeddings=64,
        pad_token_id=0,
        bos_token_id=1,
        eos_token_id=1,
        tie_word_embeddings=False,
    )
    torch.manual_seed(seed)
    return Qwen2ForCausalLM(config)


def later_letters(completions, **kwargs) -> list:
    """The reward: the mean alphabet position of a completion's characters, in [0, 1) (0 if empty)."""
    return [sum(LETTERS.index(c) for c in text) / max(len(text), 1) / len(LETTERS) for text in completions]


def main(steps: int = 40, output_dir: str = "") -> dict:
    """Train; return the final training log (the scaler's health account is under ``scaler/health/``) and
    how many times the LR schedule advanced (``lr_steps``: the steps taken, skipped ones not counted)."""
    prompts = [a + b for a, b in zip(LETTERS[:-1], LETTERS[1:-1] + "a")]  # "ab", "bc", ..., "za"
    args = GRPOConfig(
        output_dir=output_dir or tempfile.mkdtemp(prefix="lossscale-grpo-"),
        fp16=True,
        use_cpu=not torch.cuda.is_available(),
        max_steps=steps,
        per_device_train_batch_size=8,
        num_generations=4,
        max_completion_length=4,
        learning_rate=1e-2,
        warmup_steps=steps // 10,
        logging_steps=max(steps // 4, 1),
        save_strategy="no",
        report_to=[],
        disable_tqdm=True,
        seed=0,
    )
    trainer = GRPOTrainer(
        model=tiny_qwen2(),
        reward_funcs=later_letters,
        args=args,
        train_dataset=Dataset.from_dict({"prompt": prompts}),
        processing_class=char_tokenizer(),
    )
    scaler = ls_transformers.attach(  # after GRPOTrainer(...), before train()
        trainer,
        growth_interval=200,  # regrow within a short run (torch: 2000)
        min_scale=2.0**-24,
        max_scale=2.0**24,  # the defaults, spelled out
        skip_if=lossscale.SkipIf(grad_norm_zscore=6.0, min_steps=16),  # finite spikes skipped, not applied
    )
    trainer.train()
    history = trainer.state.log_history
    for h in (h for h in history if "loss" in h):
        print(
            f"step {h['step']:3d}  reward {h['reward']:.3f}  lr {h['learning_rate']:.2e}  "
            f"scale {h['scaler/loss_scale']:.0f}  skipped {h['scaler/skipped_steps']}"
        )
    print(scaler.health())
    print(f"The LR schedule advanced {trainer.lr_scheduler.last_epoch} times in {steps} steps.")
    return {**history[-1], "lr_steps": trainer.lr_scheduler.last_epoch}


if __name__ == "__main__":
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--steps", type=int, default=40)
    parser.add_argument("--output-dir", default="", help="Trainer output (default: a new temporary directory)")
    cli = parser.parse_args()
    main(cli.steps, cli.output_dir)
