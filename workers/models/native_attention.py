"""Paged attention as one native call per layer (paged_attention.cpp), built for this host at start-up.

The SDPA path (attention.py) gathers every sequence's K/V blocks into a padded copy each layer and step,
then runs a masked SDPA over the padding: at batch 1 that is six ops and ~150 us a layer, at batch 16 the
gather dominates the step. The native kernel writes the new K/V and attends in place through the block
tables, per query token over exactly the keys it sees, so ragged batches cost no padding either.

It covers float32, float64 and bfloat16: decode steps, chains to verify, prefill chunks (optionally
windowed) and token trees of up to MAX_TREE_NODES nodes. Larger trees and other dtypes take the SDPA path.
The same library holds a model's decoder layers as one call (decode_layers.cpp, which includes the
attention source; workers/models/fused_decode.py calls it). It is compiled with the host's C++ compiler
(`$CXX`, else c++/g++) for the host's CPU, once per source, compiler and CPU, into a cache directory; where
there is no compiler or the build fails, `load` logs why and returns None and attention stays on the SDPA
path.
"""

import ctypes
import functools
import hashlib
import logging
import os
import platform
import shutil
import subprocess
import tempfile
from array import array
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import torch

log = logging.getLogger(__name__)

# the library is built from BUILD_SOURCE, which includes the others; all of them key the build
BUILD_SOURCE = Path(__file__).with_name("decode_layers.cpp")
SOURCES = tuple(Path(__file__).with_name(name) for name in ("paged_attention.cpp", "row_max.cpp")) + (BUILD_SOURCE,)
COMPILE_FLAGS = ("-O3", "-march=native", "-std=c++17", "-shared", "-fPIC", "-fno-math-errno", "-fno-trapping-math")
# tokens spread over threads; torch's CPU wheels load GNU libgomp (soname libgomp.so.1) first, so the kernel
# joins torch's OpenMP runtime instead of starting a second one. A compiler without OpenMP builds it without
OPENMP_FLAG = "-fopenmp"
BUILD_TIMEOUT_S = 120
_ENTRY_POINTS = {
    torch.float32: "specfleet_paged_attention_f32",
    torch.float64: "specfleet_paged_attention_f64",
    torch.bfloat16: "specfleet_paged_attention_bf16",
}
_NUM_DIMS = 10
MAX_TREE_NODES = 63  # a tree query's visible tree slots are one int64 bitmask


@dataclass(frozen=True)
class NativeAttention:
    """The loaded kernel library: `attend` is one layer's K/V write and attention; `row_max` the greedy token."""

    library_path: Path
    _functions: dict[torch.dtype, Any]  # dtype -> its ctypes entry point
    _row_max: Any  # specfleet_row_max_f32 (row_max.cpp)

    def supports(self, dtype: torch.dtype) -> bool:
        return dtype in self._functions

    def attend(
        self,
        q: torch.Tensor,  # [T, H, D] rotated
        k: torch.Tensor,  # [T, KV, D] rotated
        v: torch.Tensor,  # [T, KV, D]
        k_cache: torch.Tensor,  # [num_blocks, block_size, KV, D] contiguous; k is written into it
        v_cache: torch.Tensor,  # [num_blocks, block_size, KV, D] contiguous
        slot_mapping: torch.Tensor,  # [T] long
        block_tables: torch.Tensor,  # [B, NB] long
        # [T] long each: token_seq (row of block_tables), key_start, key_end, tree_base, tree_bits (attention.py)
        ragged: tuple[torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor, torch.Tensor],
        scale: float,
    ) -> torch.Tensor:  # [T, H * D]
        num_tokens, num_heads, head_dim = q.shape
        q, k, v = _rows(q), _rows(k), _rows(v)
        block_tables = block_tables.contiguous()
        out = q.new_empty(num_tokens, num_heads * head_dim)
        dims = (ctypes.c_int64 * _NUM_DIMS)(
            num_tokens, num_heads, k_cache.shape[2], head_dim, k_cache.shape[1], block_tables.shape[1],
            q.stride(0), k.stride(0), v.stride(0), torch.get_num_threads(),
        )
        self._functions[q.dtype](
            q.data_ptr(), k.data_ptr(), v.data_ptr(), k_cache.data_ptr(), v_cache.data_ptr(),
            slot_mapping.data_ptr(), block_tables.data_ptr(), *(x.data_ptr() for x in ragged), out.data_ptr(), dims,
            scale,
        )
        return out

    def row_max(self, rows: torch.Tensor) -> tuple[list[float], list[int]]:  # [S, V] -> [S], [S]
        """Each row's largest value and its first index, torch.max(rows, dim=-1) as lists (NaN counts as the
        largest): in one native call for float32 CPU rows, whose ATen kernels compare one element at a time."""
        if rows.dtype != torch.float32 or not rows.is_cpu or rows.stride(1) != 1 or not rows.shape[1]:
            values, where = rows.max(dim=-1)
            return values.tolist(), where.tolist()
        num_rows, num_cols = rows.shape
        maxima, indices = array("f", bytes(4 * num_rows)), array("q", bytes(8 * num_rows))
        self._row_max(rows.data_ptr(), num_rows, num_cols, rows.stride(0), maxima.buffer_info()[0],
                      indices.buffer_info()[0])
        return maxima.tolist(), indices.tolist()


def _rows(x: torch.Tensor) -> torch.Tensor:  # [T, heads, D] whose heads and elements are packed
    """The kernel walks tokens by stride and each token's heads densely: copy only when they are not."""
    _, num_heads, head_dim = x.shape
    if x.stride(2) == 1 and x.stride(1) == head_dim:
        return x
    return x.contiguous()


def build_key(compiler: str, extra_flags: tuple[str, ...] = ()) -> str:
    """What the library depends on: the sources, the flags, the compiler and the CPU it targets."""
    digest = hashlib.sha256()
    for source in SOURCES:
        digest.update(source.read_bytes())
    digest.update(" ".join((*COMPILE_FLAGS, *extra_flags, OPENMP_FLAG)).encode())
    digest.update(_compiler_version(compiler).encode())
    digest.update(platform.machine().encode())
    digest.update(_cpu_flags().encode())
    return digest.hexdigest()[:16]


def _compiler() -> str | None:
    for name in (os.environ.get("CXX"), "c++", "g++", "clang++"):
        if name and shutil.which(name):
            return name
    return None


def _compiler_version(compiler: str) -> str:
    result = subprocess.run([compiler, "--version"], capture_output=True, text=True, check=False)
    return result.stdout.splitlines()[0] if result.stdout else compiler


def _cpu_flags() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith(("flags", "Features")):
                return line
    except OSError:
        pass
    return platform.processor()


@functools.cache
def load(cache_dir: Path, extra_flags: tuple[str, ...] = ()) -> NativeAttention | None:
    """The kernel library, built into `cache_dir` if it is not there yet; None (logged) where it can't be.
    Safe for processes building at once: each writes its own file and renames it into place. `extra_flags`
    follow the usual ones (tests build the portable paths of a CPU's special instructions with them)."""
    compiler = _compiler()
    if compiler is None:
        log.warning("no C++ compiler found ($CXX, c++, g++, clang++): attention stays on the SDPA path")
        return None
    path = cache_dir / f"paged_attention-{build_key(compiler, extra_flags)}.so"
    if not path.exists():
        try:
            _build(compiler, path, extra_flags)
        except (OSError, subprocess.SubprocessError) as exc:
            log.warning("building the native attention kernel failed (%s): attention stays on the SDPA path", exc)
            return None
    try:
        library = ctypes.CDLL(str(path))
    except OSError as exc:
        log.warning("loading %s failed (%s): attention stays on the SDPA path", path, exc)
        return None
    functions = {dtype: getattr(library, name) for dtype, name in _ENTRY_POINTS.items()}
    for function in functions.values():  # 13 tensors' data pointers, the dims array, the scale
        function.argtypes = [ctypes.c_void_p] * 14 + [ctypes.c_double]
        function.restype = None
    row_max = library.specfleet_row_max_f32
    row_max.argtypes = [ctypes.c_void_p, ctypes.c_int64, ctypes.c_int64, ctypes.c_int64, ctypes.c_void_p,
                        ctypes.c_void_p]
    row_max.restype = None
    log.info("native attention kernel: %s", path)
    return NativeAttention(path, functions, row_max)


def _build(compiler: str, path: Path, extra_flags: tuple[str, ...] = ()) -> None:
    """Compile with OpenMP, else without; raises SubprocessError with the compiler's message if both fail."""
    path.parent.mkdir(parents=True, exist_ok=True)
    fd, tmp_name = tempfile.mkstemp(dir=path.parent, suffix=".so.tmp")
    os.close(fd)
    try:
        errors = []
        for extra in ([OPENMP_FLAG], []):
            command = [compiler, *COMPILE_FLAGS, *extra_flags, *extra, str(BUILD_SOURCE), "-o", tmp_name]
            result = subprocess.run(command, capture_output=True, text=True, timeout=BUILD_TIMEOUT_S, check=False)
            if result.returncode == 0:
                os.replace(tmp_name, path)
                return
            errors.append(f"{' '.join(command)}: {result.stderr.strip()[-2000:]}")
        raise subprocess.SubprocessError("; ".join(errors))
    finally:
        if os.path.exists(tmp_name):
            os.unlink(tmp_name)
