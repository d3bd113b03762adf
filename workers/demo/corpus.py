"""The demo pair's corpus: the running interpreter's standard-library sources, split into train and held-out.

Every Python install has these files, so the pair builds offline. The split is by file: the files are
sorted by name and every `HOLDOUT_EVERY`-th one (indices 0, 16, 32, ...) is held out, never trained on,
and used for prompts (`held_out_prompts`) and for validation.
"""

import logging
import re
import sysconfig
from dataclasses import dataclass
from pathlib import Path

logger = logging.getLogger(__name__)

HOLDOUT_EVERY = 16
DEFAULT_PROMPT_MAX_CHARS = 320
PROMPT_EXTRA_LINES = 2  # lines kept after the `def ...:` line (often the docstring's start)

# A one-line function header: `def name(args):` or `def name(args) -> T:` at any indentation.
_DEF_LINE = re.compile(r"^[ \t]*(async[ \t]+)?def[ \t]+\w+[ \t]*\(.*\)[^:]*:[ \t]*$")


@dataclass(frozen=True)
class CorpusSplit:
    """The corpus files, sorted by name, split into the ones trained on and the ones held out."""

    train_files: tuple[Path, ...]
    held_out_files: tuple[Path, ...]


def stdlib_dir() -> Path:
    """The running interpreter's standard-library directory."""
    return Path(sysconfig.get_paths()["stdlib"])


def corpus_files(root: Path | None = None) -> list[Path]:
    """The top-level `*.py` files of `root` (default: the stdlib), sorted by name."""
    return sorted((root or stdlib_dir()).glob("*.py"), key=lambda path: path.name)


def split_corpus(
    files: list[Path], holdout_every: int = HOLDOUT_EVERY, max_files: int | None = None
) -> CorpusSplit:
    """Hold out every `holdout_every`-th file of `files` (first `max_files` only, if given)."""
    if holdout_every < 2:
        raise ValueError(f"holdout_every must be >= 2, got {holdout_every}")
    chosen = files if max_files is None else files[:max_files]
    held_out = tuple(path for index, path in enumerate(chosen) if index % holdout_every == 0)
    train = tuple(path for index, path in enumerate(chosen) if index % holdout_every != 0)
    return CorpusSplit(train_files=train, held_out_files=held_out)


def read_source(path: Path) -> str:
    """A source file's text; undecodable bytes (a few stdlib files have some) become U+FFFD."""
    return path.read_bytes().decode("utf-8", errors="replace")


def _prompt_at(lines: list[str], def_index: int, max_chars: int) -> str | None:
    """The text up to the `def` line at `def_index` plus a few lines, cut at a line start to `max_chars`."""
    end = min(len(lines), def_index + 1 + PROMPT_EXTRA_LINES)
    kept: list[str] = []
    num_chars = 0
    for line in reversed(lines[:end]):
        if num_chars + len(line) > max_chars:
            break
        kept.append(line)
        num_chars += len(line)
    if def_index < end - len(kept):  # the def line itself did not fit
        return None
    # No trailing newline: in training "\n" mostly merges with the next line's indentation into one token,
    # so a prompt ending in a bare "\n" token would be out of distribution (models then emit blank lines).
    prompt = "".join(reversed(kept)).rstrip()
    return prompt or None


def _file_prompts(path: Path, max_chars: int) -> list[str]:
    lines = read_source(path).splitlines(keepends=True)
    prompts = (
        _prompt_at(lines, index, max_chars) for index, line in enumerate(lines) if _DEF_LINE.match(line)
    )
    return [prompt for prompt in prompts if prompt is not None]


def held_out_prompts(
    n: int, max_chars: int = DEFAULT_PROMPT_MAX_CHARS, root: Path | None = None
) -> list[str]:
    """`n` deterministic prompts from held-out files, each ending a few lines after a `def ...:` line.

    A prompt ends at the end of its last non-blank line (no trailing newline or spaces).
    Prompts are taken round-robin over the held-out files (first function of each file, then the
    second, ...), so consecutive prompts come from different modules. Each is at most `max_chars`
    characters, cut at a line start. Fewer than `n` come back only if the held-out files run out.
    """
    if n < 0:
        raise ValueError(f"n must be >= 0, got {n}")
    per_file = [_file_prompts(path, max_chars) for path in split_corpus(corpus_files(root)).held_out_files]
    prompts: list[str] = []
    for round_index in range(max((len(found) for found in per_file), default=0)):
        for found in per_file:
            if len(prompts) == n:
                return prompts
            if round_index < len(found):
                prompts.append(found[round_index])
    if len(prompts) < n:
        logger.warning("only %d held-out prompts available, %d asked", len(prompts), n)
    return prompts
