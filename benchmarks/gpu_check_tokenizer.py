"""gpu_check's tokenizer, made from this file alone: nothing to download, nothing to carry.

The lent GPU machine has no hub, and a random-weight model needs no particular tokenizer -- only
one that renders what the parts render: arith and long-sum prompts through a chat template,
multiply's warm start (assistant tool calls and `tool` results, env.ToolChat), preference pairs.
So gpu_check.py's preparation trains a small byte-level BPE (tokenizers' trainer, ~1 s) on text
this file writes -- numbers, sums and products, the prompt templates' words, tool-call JSON --
and saves it beside the random models as a transformers tokenizer. Its pre-tokenization is
Qwen2.5's (PRETOKENIZE: digits one at a time, NFC): transformers picks the tokenizer class from
the model's config, and its Qwen2Tokenizer imposes that on whatever it loads -- trained so, this
tokenizer is the same whichever class reads it.

    <|endoftext|>   bos
    <|im_start|>    opens a turn (ChatML)
    <|im_end|>      closes a turn: eos, and pad (pad == eos: smolrl's masks come from lengths)

Its chat template is env.TOOL_TEMPLATE, smolrl's own ChatML with tools (what env.ToolChat renders
episodes with for a model whose template cannot show tools): calls are <tool_call> JSON, which
env.TOOL_RESPONSE_TEMPLATE parses. Byte-level:
every id a model samples decodes to some text, and ids past the tokenizer's 512 entries (the
random models keep Qwen's 151,936-entry vocabulary) decode to nothing.
"""

import json
import random

from env import TOOL_TEMPLATE as CHAT_TEMPLATE

BOS, TURN, EOS = "<|endoftext|>", "<|im_start|>", "<|im_end|>"
VOCAB_SIZE = 512
# Words with an optional leading character, digits one at a time, punctuation runs, whitespace
PRETOKENIZE = (r"(?i:'s|'t|'re|'ve|'m|'ll|'d)|[^\r\n\p{L}\p{N}]?\p{L}+|\p{N}"
               r"| ?[^\s\p{L}\p{N}]+[\r\n]*|\s*[\r\n]+|\s+(?!\S)|\s+")


def corpus(seed: int = 0) -> list[str]:
    """Lines like those the parts render (data.py's tasks and templates through the chat template,
    its system turn included; the pairs, the long sums, tool calls and their results), for the BPE
    trainer."""
    from jinja2 import Template
    chat = Template(CHAT_TEMPLATE)
    rng = random.Random(seed)
    words = ("the of and to in is it that was for on are with as be at by this what add up "
             "these numbers sum answer reply one sentence number use calculator problem say "
             "something about think step final within boxed tool call result expression "
             "arguments name function description type string integer object required").split()
    lines = ["Reply with one sentence: The answer is <number>.",
             "Let's think step by step and output the final answer within \\boxed{}.",
             "You may call these tools (JSON schemas):", "system", "user", "assistant", "tool"]
    for _ in range(3000):
        a, b = rng.randint(0, 999), rng.randint(0, 999)
        expression = f"{a} * {b}"
        call = {"name": "calculator", "arguments": {"expression": expression}}
        lines += [chat.render(messages=[{"role": "user", "content": f"What is {a} + {b}?"}],
                              add_generation_prompt=True) + f"The answer is {a + b}.{EOS}",
                  f"What is {expression}? Use the calculator.",
                  f"<tool_call>\n{json.dumps(call)}\n</tool_call>\n{a * b}",
                  "Add up these numbers: " + " + ".join(str(rng.randint(1, 99)) for _ in range(8)),
                  " ".join(rng.choice(words) for _ in range(12)) + "."]
    return lines


def build_tokenizer(vocab_size: int = VOCAB_SIZE):
    """A transformers tokenizer (PreTrainedTokenizerFast), CHAT_TEMPLATE's, trained on corpus()."""
    from tokenizers import Regex, Tokenizer, decoders, models, normalizers, pre_tokenizers
    from tokenizers import trainers
    from transformers import PreTrainedTokenizerFast
    bpe = Tokenizer(models.BPE())
    bpe.normalizer = normalizers.NFC()
    bpe.pre_tokenizer = pre_tokenizers.Sequence([
        pre_tokenizers.Split(Regex(PRETOKENIZE), behavior="isolated"),
        pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=False)])
    bpe.decoder = decoders.ByteLevel()
    bpe.train_from_iterator(corpus(), trainers.BpeTrainer(
        vocab_size=vocab_size, special_tokens=[BOS, TURN, EOS], show_progress=False,
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet()))
    return PreTrainedTokenizerFast(tokenizer_object=bpe, bos_token=BOS, eos_token=EOS,
                                   pad_token=EOS, chat_template=CHAT_TEMPLATE)
