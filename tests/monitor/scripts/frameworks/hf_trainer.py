"""Hugging Face transformers.Trainer: a tiny BERT from a config (2 layers, hidden 32, random
weights) on a Dataset of random token ids with a slow __getitem__ (the steps wait on it),
per_device_train_batch_size=16. The user builds no DataLoader: Trainer builds one, and
Accelerate (inside Trainer) iterates its own copy with a batch sampler (batch_size None).

usage: hf_trainer.py OUT_DIR [STEPS] [compiled]
  compiled  TrainingArguments(torch_compile=True), and 12 samples fewer: the last batch of 4 is a
            new shape, which compiles the model's forward again

Prints its truth: the optimizer steps it ran and the sizes of the batches they trained on.
No downloads, no saving, no logging integrations, no progress bar.
"""

import os

os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_OFFLINE", "1")
os.environ.setdefault("TRANSFORMERS_VERBOSITY", "error")

import sys
import time

import torch
from torch.utils.data import Dataset
from transformers import BertConfig, BertForSequenceClassification, Trainer, TrainingArguments
from transformers.data.data_collator import default_data_collator

OUT = sys.argv[1]
STEPS = int(sys.argv[2]) if len(sys.argv) > 2 else 20
COMPILED = sys.argv[3:] == ["compiled"]
BATCH = 16
SEQ = 32


class Tokens(Dataset):
    def __init__(self, n: int):
        self.ids = torch.randint(0, 1000, (n, SEQ))
        self.labels = torch.randint(0, 2, (n,))

    def __len__(self):
        return len(self.ids)

    def __getitem__(self, i):
        time.sleep(0.0005)  # a slow read
        return {"input_ids": self.ids[i], "attention_mask": torch.ones(SEQ, dtype=torch.long), "labels": self.labels[i]}


def main():
    torch.set_num_threads(1)
    torch.manual_seed(0)
    config = BertConfig(vocab_size=1000, hidden_size=32, num_hidden_layers=2, num_attention_heads=2,
                        intermediate_size=64, max_position_embeddings=SEQ, num_labels=2)
    model = BertForSequenceClassification(config)
    sizes = set()

    def collate(samples):
        sizes.add(len(samples))
        return default_data_collator(samples)

    args = TrainingArguments(output_dir=OUT, per_device_train_batch_size=BATCH, max_steps=STEPS, report_to=[],
                             save_strategy="no", logging_strategy="no", eval_strategy="no", disable_tqdm=True,
                             use_cpu=True, dataloader_num_workers=0, learning_rate=1e-3, torch_compile=COMPILED)
    samples = STEPS * BATCH - (12 if COMPILED else 0)
    trainer = Trainer(model=model, args=args, train_dataset=Tokens(samples), data_collator=collate)
    trainer.train()  # the user's line: Trainer builds its DataLoader inside
    print(f"hf_trainer: steps {trainer.state.global_step} batch {sorted(sizes)}\n", end="", flush=True)


if __name__ == "__main__":
    main()
