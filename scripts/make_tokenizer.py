"""Build the small deterministic tokenizer that ships with Bouncer (src/bouncer/data/tokenizer.json).

The engine model and the gateway both count prompt tokens with it, so they agree on prompt
length and prefix blocks; the tiny local model used to compare against real vLLM uses it too.
A byte-level BPE (2,048 tokens) trained on text that every CPython 3.11 install carries (the
standard library's own source), so running this again gives the same file. The committed JSON is
the artefact; this script only documents and reproduces it.

    python scripts/make_tokenizer.py
"""

from __future__ import annotations

import pathlib
import sysconfig

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

SPECIAL_TOKENS = ["<unk>", "<s>", "</s>", "<pad>"]
VOCAB_SIZE = 2048
CORPUS_MODULES = ["argparse", "asyncio/base_events", "collections/__init__", "dataclasses",
                  "difflib", "email/message", "http/server", "json/decoder", "logging/__init__",
                  "pathlib", "statistics", "textwrap", "typing", "unittest/case", "zipfile"]


def corpus() -> list[str]:
    stdlib = pathlib.Path(sysconfig.get_paths()["stdlib"])
    return [(stdlib / f"{name}.py").read_text(encoding="utf-8") for name in CORPUS_MODULES]


def main() -> None:
    tokenizer = Tokenizer(models.BPE(unk_token="<unk>"))
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(vocab_size=VOCAB_SIZE, special_tokens=SPECIAL_TOKENS,
                                  initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
                                  show_progress=False)
    tokenizer.train_from_iterator(corpus(), trainer=trainer)
    out = pathlib.Path(__file__).resolve().parents[1] / "src/bouncer/data/tokenizer.json"
    tokenizer.save(str(out))
    print(f"wrote {out} ({tokenizer.get_vocab_size()} tokens)")


if __name__ == "__main__":
    main()
