from pathlib import Path

from tokenizers import Tokenizer
from transformers import AutoTokenizer

from workers.demo.corpus import corpus_files, read_source
from workers.demo.tokenizer import EOS_TOKEN, EOS_TOKEN_ID, encode_documents, save_tokenizer, train_tokenizer

TEXT = 'def f(x: int) -> str:\n    """Ünïcode ✓ and\ttabs."""\n    return  str(x)  # 🐍\n'


def _small_tokenizer() -> Tokenizer:
    return train_tokenizer([read_source(path) for path in corpus_files()[1:6]], vocab_size=400)


def test_byte_level_bpe_round_trips_any_text() -> None:
    tokenizer = _small_tokenizer()

    assert tokenizer.get_vocab_size() == 400
    assert tokenizer.token_to_id(EOS_TOKEN) == EOS_TOKEN_ID
    assert tokenizer.decode(tokenizer.encode(TEXT).ids) == TEXT


def test_documents_are_separated_by_eos() -> None:
    tokenizer = _small_tokenizer()

    ids = encode_documents(tokenizer, ["a = 1\n", "b = 2\n"])

    assert ids[0] == EOS_TOKEN_ID
    assert ids.count(EOS_TOKEN_ID) == 2
    second = ids.index(EOS_TOKEN_ID, 1)
    assert tokenizer.decode(ids[1:second]) == "a = 1\n"


def test_saved_tokenizer_loads_with_auto_tokenizer_and_round_trips(tmp_path: Path) -> None:
    save_tokenizer(_small_tokenizer(), tmp_path, model_max_length=512)

    loaded = AutoTokenizer.from_pretrained(tmp_path)
    ids = loaded(TEXT)["input_ids"]

    assert loaded.eos_token == EOS_TOKEN
    assert loaded.eos_token_id == EOS_TOKEN_ID
    assert ids[0] != EOS_TOKEN_ID  # nothing is prepended
    assert loaded.decode(ids) == TEXT
    assert {"tokenizer.json", "tokenizer_config.json", "special_tokens_map.json"} <= {
        path.name for path in tmp_path.iterdir()
    }
