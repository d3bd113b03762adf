"""The demo pair's tokenizer: byte-level BPE trained on the corpus, saved in Hugging Face layout.

Byte-level means every byte is in the vocabulary, so any text round-trips exactly. One special token,
`EOS_TOKEN`, separates documents in training and ends generation.
"""

import json
import logging
from collections.abc import Iterable
from pathlib import Path

from tokenizers import Tokenizer, decoders, models, pre_tokenizers, trainers

logger = logging.getLogger(__name__)

EOS_TOKEN = "<|endoftext|>"
EOS_TOKEN_ID = 0  # the first (and only) special token


def train_tokenizer(texts: Iterable[str], vocab_size: int) -> Tokenizer:
    """Train a byte-level BPE tokenizer with `vocab_size` entries (256 bytes + special + merges)."""
    tokenizer = Tokenizer(models.BPE())
    tokenizer.pre_tokenizer = pre_tokenizers.ByteLevel(add_prefix_space=False, use_regex=True)
    tokenizer.decoder = decoders.ByteLevel()
    trainer = trainers.BpeTrainer(
        vocab_size=vocab_size,
        min_frequency=2,
        special_tokens=[EOS_TOKEN],
        initial_alphabet=pre_tokenizers.ByteLevel.alphabet(),
        show_progress=False,
    )
    tokenizer.train_from_iterator(texts, trainer=trainer)
    if tokenizer.token_to_id(EOS_TOKEN) != EOS_TOKEN_ID:
        raise RuntimeError(f"{EOS_TOKEN} did not get id {EOS_TOKEN_ID}")
    logger.info("tokenizer trained: %d entries", tokenizer.get_vocab_size())
    return tokenizer


def encode_documents(tokenizer: Tokenizer, texts: list[str]) -> list[int]:
    """One token stream: each document preceded by `EOS_TOKEN` (the document separator)."""
    token_ids: list[int] = []
    for encoding in tokenizer.encode_batch_fast(texts):
        token_ids.append(EOS_TOKEN_ID)
        token_ids.extend(encoding.ids)
    return token_ids


def save_tokenizer(tokenizer: Tokenizer, out_dir: Path, model_max_length: int) -> None:
    """Write tokenizer.json, tokenizer_config.json and special_tokens_map.json for `AutoTokenizer`.

    transformers 5 writes `"tokenizer_class": "TokenizersBackend"`, a name transformers 4 does not know;
    `PreTrainedTokenizerFast` loads the same tokenizer.json in both, so that name is written instead,
    and special_tokens_map.json (which transformers 5 no longer writes) for older loaders.
    """
    from transformers import PreTrainedTokenizerFast

    hf_tokenizer = PreTrainedTokenizerFast(
        tokenizer_object=tokenizer,
        eos_token=EOS_TOKEN,
        bos_token=EOS_TOKEN,
        pad_token=EOS_TOKEN,
        unk_token=None,
        model_max_length=model_max_length,
        clean_up_tokenization_spaces=False,
    )
    hf_tokenizer.save_pretrained(str(out_dir))
    config_path = out_dir / "tokenizer_config.json"
    tokenizer_config = json.loads(config_path.read_text())
    tokenizer_config["tokenizer_class"] = "PreTrainedTokenizerFast"
    config_path.write_text(json.dumps(tokenizer_config, indent=2, sort_keys=True) + "\n")
    special_tokens = {"bos_token": EOS_TOKEN, "eos_token": EOS_TOKEN, "pad_token": EOS_TOKEN}
    (out_dir / "special_tokens_map.json").write_text(json.dumps(special_tokens, indent=2) + "\n")
