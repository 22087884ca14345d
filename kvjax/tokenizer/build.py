"""Build the bundled model's tokenizer: byte-level BPE trained on the synthetic task prompts.

    python -m kvjax.tokenizer.build [--out kvjax/assets/tokenizer] [--vocab-size 2560]

Byte-level, so every string is encodable (no unknown token); digits are split one per token so
that numbers are copied digit by digit; every built-in word, with a leading space, is one token
(checked after training). The corpus is the prompts of the synthetic tasks themselves (RULER
without qa, the needle grid, passkey), rendered with a whitespace length counter, so no data is
downloaded. Special tokens: ``<s>`` (BOS), ``<|end|>`` (end of turn, EOS), ``<pad>`` and the
role markers ``<|system|>``, ``<|user|>``, ``<|assistant|>`` used by the chat template.

The files in ``kvjax/assets/tokenizer`` are the reference: the bundled model is trained on their
token ids, so do not rebuild them once a model is trained (a change to the task templates changes
the corpus, and may change the merges).
"""

from __future__ import annotations

import argparse
import json
import pathlib

from kvjax.data import generate, suite_tasks
from kvjax.data.words import ADJECTIVES, NAMES, NOUNS, VERBS
from kvjax.tokenizer import TOKENIZER_DIR

DEFAULT_DIR = TOKENIZER_DIR
SPECIAL_TOKENS = ["<pad>", "<s>", "<|end|>", "<|system|>", "<|user|>", "<|assistant|>"]
CHAT_TEMPLATE = (
    "{{ bos_token }}{% for message in messages %}<|{{ message['role'] }}|>\n{{ message['content'] }}<|end|>\n"
    "{% endfor %}{% if add_generation_prompt %}<|assistant|>\n{% endif %}"
)


class _WordCounter:
    """A stand-in tokenizer for rendering the corpus: one token per whitespace-separated word."""

    def encode(self, text: str, add_special_tokens: bool = False) -> list[int]:
        return [0] * len(text.split())

    def decode(self, ids: list[int]) -> str:
        return ""


def corpus(seed: int = 0) -> list[str]:
    """Training texts: synthetic task prompts at a few lengths, with their answers."""
    texts: list[str] = []
    for task in suite_tasks("synthetic"):
        for length in (512, 1024, 2048):
            for s in generate(task, _WordCounter(), length, 4, seed=seed + length):
                texts.append(s["context"] + s["question"] + s["answer_prefix"] + " " + " ".join(s["answers"]))
    # The word lists, often enough that each word (after a space) earns its own token.
    # Nouns also follow a hyphen in the ``adjective-noun`` keys, where they carry no leading space.
    texts.extend([" ".join(ADJECTIVES + NOUNS + VERBS + NAMES)] * 50)
    texts.extend([" " + "-".join(NOUNS)] * 50)
    return texts


def train(vocab_size: int = 2560, seed: int = 0):
    """A `tokenizers.Tokenizer` trained on ``corpus(seed)``."""
    from tokenizers import Tokenizer, decoders, models, pre_tokenizers, processors, trainers

    tok = Tokenizer(models.BPE())
    tok.pre_tokenizer = pre_tokenizers.Sequence(
        [pre_tokenizers.Digits(individual_digits=True), pre_tokenizers.ByteLevel(add_prefix_space=False)]
    )
    tok.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=SPECIAL_TOKENS, min_frequency=2,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(), show_progress=False,
    )
    tok.train_from_iterator(corpus(seed), trainer=trainer)
    tok.post_processor = processors.TemplateProcessing(
        single="<s> $A", pair="<s> $A $B", special_tokens=[("<s>", tok.token_to_id("<s>"))]
    )
    return tok


def multi_token_words(tokenizer) -> list[str]:
    """Built-in words that are not one token after a space (nouns: nor after a hyphen, as in keys)."""
    bad = [w for w in ADJECTIVES + NOUNS + VERBS + NAMES
           if len(tokenizer.encode(" " + w, add_special_tokens=False)) != 1]
    return bad + [f"-{w}" for w in NOUNS if len(tokenizer.encode("-" + w, add_special_tokens=False)) != 2]


def build(out: pathlib.Path = DEFAULT_DIR, vocab_size: int = 2560, seed: int = 0):
    """Train, wrap as `PreTrainedTokenizerFast` with the chat template, check and save to ``out``."""
    from transformers import PreTrainedTokenizerFast

    fast = PreTrainedTokenizerFast(
        tokenizer_object=train(vocab_size, seed), bos_token="<s>", eos_token="<|end|>", pad_token="<pad>",
        additional_special_tokens=["<|system|>", "<|user|>", "<|assistant|>"],
        model_max_length=1 << 20, padding_side="right",
    )
    fast.chat_template = CHAT_TEMPLATE
    bad = multi_token_words(fast)
    if bad:
        raise ValueError(f"vocab_size {vocab_size} leaves {len(bad)} words split, e.g. {bad[:8]}; raise it")
    out.mkdir(parents=True, exist_ok=True)
    fast.save_pretrained(str(out))
    # Loadable by transformers 4.x too: a known class name, the template inline, the extra specials.
    config_path = out / "tokenizer_config.json"
    config = json.loads(config_path.read_text())
    config.update(tokenizer_class="PreTrainedTokenizerFast", chat_template=CHAT_TEMPLATE,
                  additional_special_tokens=["<|system|>", "<|user|>", "<|assistant|>"])
    config_path.write_text(json.dumps(config, indent=2) + "\n")
    return fast


def main(argv: list[str] | None = None) -> None:
    parser = argparse.ArgumentParser(prog="python -m kvjax.tokenizer.build", description=__doc__.split("\n")[0])
    parser.add_argument("--out", type=pathlib.Path, default=DEFAULT_DIR, help="output folder (default: %(default)s)")
    parser.add_argument("--vocab-size", type=int, default=2560, help="BPE vocabulary size (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=0, help="corpus seed (default: %(default)s)")
    args = parser.parse_args(argv)
    tok = build(args.out, args.vocab_size, args.seed)
    print(f"saved a {len(tok)}-token tokenizer to {args.out}")


if __name__ == "__main__":
    main()
