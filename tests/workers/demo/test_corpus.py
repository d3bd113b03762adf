from workers.demo.corpus import (
    HOLDOUT_EVERY,
    corpus_files,
    held_out_prompts,
    read_source,
    split_corpus,
)


def test_split_holds_out_every_16th_file_and_never_trains_on_it() -> None:
    files = corpus_files()
    split = split_corpus(files)

    assert set(split.train_files).isdisjoint(split.held_out_files)
    assert len(split.train_files) + len(split.held_out_files) == len(files)
    assert list(split.held_out_files) == files[::HOLDOUT_EVERY]
    assert files == sorted(files, key=lambda path: path.name)


def test_split_of_a_slice_uses_only_that_slice() -> None:
    files = corpus_files()
    split = split_corpus(files, max_files=20)

    assert split.held_out_files == (files[0], files[16])
    assert split.train_files == tuple(path for path in files[:20] if path not in split.held_out_files)


def test_held_out_prompts_are_deterministic_def_snippets_from_held_out_files() -> None:
    prompts = held_out_prompts(12, max_chars=200)
    held_out_texts = [read_source(path) for path in split_corpus(corpus_files()).held_out_files]

    assert prompts == held_out_prompts(12, max_chars=200)
    assert len(prompts) == 12
    assert len(set(prompts)) == 12
    for prompt in prompts:
        assert len(prompt) <= 200
        assert prompt == prompt.rstrip()
        assert any(line.lstrip().startswith(("def ", "async def ")) for line in prompt.splitlines())
        assert any(prompt in text for text in held_out_texts)


def test_held_out_prompts_rotate_over_files() -> None:
    prompts = held_out_prompts(3)
    split = split_corpus(corpus_files())
    sources = [
        next(index for index, path in enumerate(split.held_out_files) if prompt in read_source(path))
        for prompt in prompts
    ]

    assert len(set(sources)) == 3
